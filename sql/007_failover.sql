-- 007: failover, slot recovery and the retention edge.
--
-- Failover: when a delivery fails, the stream records a checkpoint (the first event of the batch
-- the sink refused) and enters failover. The sensor keeps consuming the slot and recording
-- batches (WAL keeps being released) but only re-probes the checkpoint batch, with exponential
-- backoff, until the sink accepts it; then it delivers the backlog from the table in commit order
-- and leaves failover. Every failover is kept in pgstream.failovers. The failover, retry, skip and
-- retention functions are in repeatable/02_ledger.sql and repeatable/03_partitions.sql.

alter table pgstream.streams add column if not exists failover_error text;
alter table pgstream.streams add column if not exists failover_retry_at timestamptz;
alter table pgstream.streams add column if not exists failover_attempts integer not null default 0;
-- Every event committed before this moment has been read from the slot into the ledger (or is
-- not in the stream). Housekeeping never drops a partition an unconsumed event may sit in.
alter table pgstream.streams add column if not exists consumed_through timestamptz not null default now();
-- Set before a lost slot is dropped/recreated; cleared in the transaction that records the
-- recovery batches. A crash in between makes the next tick recover again, never skip it.
alter table pgstream.streams add column if not exists recovery_pending boolean not null default false;
-- Delivered batches older than this were pruned from the ledger: recovery does not look at
-- events created before it (they were delivered).
alter table pgstream.streams add column if not exists ledger_horizon timestamptz;

create table if not exists pgstream.failovers (
    id                   bigint generated always as identity primary key,
    stream_id            bigint not null references pgstream.streams (id) on delete cascade,
    started_at           timestamptz not null default now(),
    ended_at             timestamptz,
    checkpoint_batch_id  bigint,
    checkpoint_event_id  bigint,
    checkpoint_commit_at timestamptz,
    first_error          text,
    last_error           text,
    attempts             integer not null default 1,
    events_behind        bigint
);
create unique index if not exists failovers_open_idx on pgstream.failovers (stream_id) where ended_at is null;

-- Events of a batch the sink already confirmed (a prefix, in commit order): a retry resumes
-- after them, so a sink that fails every other call still makes progress.
alter table pgstream.batches add column if not exists confirmed_count integer not null default 0;

-- Batch kinds: 'stream' (cut from the slot), 'recovery' (read from the table after a slot was
-- lost or created); statuses gain 'skipped' (an operator gave up on a batch, see skip_batch).
alter table pgstream.batches drop constraint if exists batches_status_check;
alter table pgstream.batches add constraint batches_status_check
    check (status in ('pending', 'launched', 'delivered', 'failed', 'skipped'));
drop index if exists pgstream.batches_undelivered_idx;
-- The open batches: the predicate is pgstream.batch_is_open(status) (repeatable/02_ledger.sql)
-- spelled out, as the function does not exist yet when versioned migrations run. The function is
-- inlined into the queries that call it, so they match this predicate and use the index.
create index if not exists batches_open_idx on pgstream.batches (stream_id, id)
    where status not in ('delivered', 'skipped');

-- drop_partitions gained a policy argument (repeatable/03_partitions.sql): the two-argument form
-- of earlier installs goes, or calls with two arguments would be ambiguous.
drop function if exists pgstream.drop_partitions(integer, date);

revoke all on all tables in schema pgstream from public;
