-- 006: the batch ledger. The sensor records every batch it cuts from a stream's replication
-- slot here, durably, before it advances the slot; the delivery run marks it delivered only after
-- the sink confirmed every event. event_ids are in commit order (the order of the WAL).
-- The ledger's functions are in repeatable/02_ledger.sql and repeatable/03_partitions.sql.

create table if not exists pgstream.batches (
    id              bigint generated always as identity primary key,
    stream_id       bigint not null references pgstream.streams (id) on delete cascade,
    kind            text not null default 'stream' check (kind in ('stream', 'recovery')),
    event_ids       bigint[] not null,
    event_count     integer not null check (event_count = cardinality(event_ids) and event_count > 0),
    first_event_id  bigint not null,
    last_event_id   bigint not null,
    min_created_at  timestamptz not null,
    max_created_at  timestamptz not null,
    start_lsn       pg_lsn,
    end_lsn         pg_lsn,
    first_commit_at timestamptz,
    last_commit_at  timestamptz,
    status          text not null default 'pending'
                    check (status in ('pending', 'launched', 'delivered', 'failed')),
    attempts        integer not null default 0,
    run_key         text,
    run_id          text,
    error           text,
    next_attempt_at timestamptz,
    created_at      timestamptz not null default now(),
    launched_at     timestamptz,
    delivered_at    timestamptz
);

create index if not exists batches_undelivered_idx on pgstream.batches (stream_id, id) where status <> 'delivered';
create index if not exists batches_stream_lsn_idx on pgstream.batches (stream_id, end_lsn);
create index if not exists batches_delivered_at_idx on pgstream.batches (delivered_at) where status = 'delivered';

-- Distinguishes installations: run keys include it, so a re-installed pgstream never mistakes the
-- runs of a previous installation (kept in the same Dagster instance) for its own.
alter table pgstream.streams add column if not exists incarnation text not null
    default substr(md5(gen_random_uuid()::text), 1, 10);

revoke all on all tables in schema pgstream from public;
