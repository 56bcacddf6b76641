-- 007: failover, slot recovery and the retention edge.
--
-- Failover: when a delivery fails, the stream records a checkpoint (the first event of the batch
-- the sink refused) and enters failover. The sensor keeps consuming the slot and recording
-- batches (WAL keeps being released) but only re-probes the checkpoint batch, with exponential
-- backoff, until the sink accepts it; then it delivers the backlog from the table in commit order
-- and leaves failover. Every failover is kept in pgstream.failovers.

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
create index if not exists batches_open_idx on pgstream.batches (stream_id, id)
    where status not in ('delivered', 'skipped');

-- Record a failed delivery of p_batch_id: the batch waits for p_retry_at, the stream enters
-- failover (or stays in it, one more attempt).
create or replace function pgstream.enter_failover(
    p_stream_id bigint, p_batch_id bigint, p_error text, p_retry_at timestamptz
)
returns void
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_batch pgstream.batches;
begin
    select * into strict v_batch from pgstream.batches where id = p_batch_id and stream_id = p_stream_id;
    update pgstream.streams
       set failover_since = coalesce(failover_since, now()),
           failover_checkpoint_id = coalesce(failover_checkpoint_id, v_batch.first_event_id),
           failover_checkpoint_ts = coalesce(failover_checkpoint_ts, v_batch.first_commit_at),
           failover_error = left(p_error, 2000),
           failover_retry_at = p_retry_at,
           failover_attempts = failover_attempts + 1,
           updated_at = now()
     where id = p_stream_id;
    update pgstream.failovers
       set last_error = left(p_error, 2000), attempts = attempts + 1
     where stream_id = p_stream_id and ended_at is null;
    if not found then
        insert into pgstream.failovers (stream_id, checkpoint_batch_id, checkpoint_event_id,
                                        checkpoint_commit_at, first_error, last_error)
        values (p_stream_id, p_batch_id, v_batch.first_event_id, v_batch.first_commit_at,
                left(p_error, 2000), left(p_error, 2000));
    end if;
end
$$;

-- The stream caught up: close the failover. Returns the closed failovers row id (null if the
-- stream was not in failover).
create or replace function pgstream.leave_failover(p_stream_id bigint)
returns bigint
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_id bigint;
begin
    update pgstream.streams
       set failover_since = null, failover_checkpoint_id = null, failover_checkpoint_ts = null,
           failover_error = null, failover_retry_at = null, failover_attempts = 0, updated_at = now()
     where id = p_stream_id and failover_since is not null;
    update pgstream.failovers set ended_at = now()
     where stream_id = p_stream_id and ended_at is null
    returning id into v_id;
    return v_id;
end
$$;

-- Operator: retry the failed batch at the next sensor tick instead of waiting for the backoff.
-- Failover itself ends once the backlog is delivered. Returns the batch id made due (null if none).
create or replace function pgstream.retry_now(p_stream_id bigint)
returns bigint
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_id bigint;
begin
    if not exists (select 1 from pgstream.streams where id = p_stream_id) then
        raise exception 'pgstream: stream % does not exist', p_stream_id using errcode = 'no_data_found';
    end if;
    update pgstream.batches set next_attempt_at = now()
     where stream_id = p_stream_id and status = 'failed'
    returning id into v_id;
    update pgstream.streams set failover_retry_at = now(), updated_at = now()
     where id = p_stream_id and failover_since is not null;
    return v_id;
end
$$;

-- Operator: give up on one undelivered batch (e.g. an event the sink will never accept). Its
-- events stay in pgstream.events and can be replayed later by id range. Returns the events skipped.
create or replace function pgstream.skip_batch(p_stream_id bigint, p_batch_id bigint)
returns integer
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_count integer;
begin
    update pgstream.batches set status = 'skipped', error = coalesce(error, '') || ' [skipped by operator]'
     where id = p_batch_id and stream_id = p_stream_id and status in ('pending', 'failed', 'launched')
    returning event_count into v_count;
    if v_count is null then
        raise exception 'pgstream: batch % of stream % is not an undelivered batch', p_batch_id, p_stream_id
            using errcode = 'no_data_found';
    end if;
    return v_count;
end
$$;

create or replace function pgstream.set_paused(p_stream_id bigint, p_paused boolean)
returns void
language plpgsql
security definer
set search_path = ''
as $$
begin
    update pgstream.streams set paused = p_paused, updated_at = now() where id = p_stream_id;
    if not found then
        raise exception 'pgstream: stream % does not exist', p_stream_id using errcode = 'no_data_found';
    end if;
end
$$;

-- Partitions that hold events a stream has not delivered, or may not have read from its slot
-- yet, are protected. consumed_through is moved back one day for transactions that commit long
-- after their rows were inserted.
create or replace function pgstream.oldest_protected_day()
returns date
language sql
stable
security definer
set search_path = ''
as $$
    select (least(
        (select min(min_created_at) from pgstream.batches where status not in ('delivered', 'skipped')),
        (select min(consumed_through) - interval '1 day' from pgstream.streams)
    ) at time zone 'UTC')::date
$$;

-- Which streams hold back which day: for operators and the 'fail' policy's message.
create or replace function pgstream.protected_streams(
    out stream_id bigint, out oldest_undelivered timestamptz, out consumed_through timestamptz
)
returns setof record
language sql
stable
security definer
set search_path = ''
as $$
    select s.id,
           (select min(b.min_created_at) from pgstream.batches b
             where b.stream_id = s.id and b.status not in ('delivered', 'skipped')),
           s.consumed_through
    from pgstream.streams s
    order by s.id
$$;

drop function if exists pgstream.drop_partitions(integer, date);

-- Drops the daily partitions older than p_retention_days (and deletes expired rows of the
-- default partition). Returns the dropped partition names. A partition past retention that still
-- holds events a stream has not delivered (pgstream.oldest_protected_day()) is handled by policy:
--   'keep' (default): kept, with a WARNING naming it; dropped by a later run once delivered;
--   'fail': nothing is dropped and an error names the streams that hold it back.
-- Events are never dropped silently.
create or replace function pgstream.drop_partitions(
    p_retention_days integer default 7,
    p_today date default pgstream.utc_today(),
    p_policy text default 'keep'
)
returns setof text
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_cutoff    date;
    v_protected date := pgstream.oldest_protected_day();
    v_rel       record;
    v_day       date;
    v_held      text;
begin
    if p_retention_days is null or p_retention_days < 1 then
        raise exception 'pgstream.drop_partitions: p_retention_days must be >= 1, got %', p_retention_days;
    end if;
    if p_policy is null or p_policy not in ('keep', 'fail') then
        raise exception 'pgstream.drop_partitions: p_policy must be ''keep'' or ''fail'', got %', p_policy;
    end if;
    v_cutoff := p_today - p_retention_days;
    if p_policy = 'fail' and v_protected is not null and v_protected < v_cutoff then
        select string_agg(format('stream %s (oldest undelivered %s, slot consumed through %s)',
                                 stream_id, coalesce(oldest_undelivered::text, 'none'), consumed_through), '; ')
          into v_held
          from pgstream.protected_streams()
         where (oldest_undelivered at time zone 'UTC')::date < v_cutoff
            or ((consumed_through - interval '1 day') at time zone 'UTC')::date < v_cutoff;
        raise exception 'pgstream: partitions before % hold undelivered events; nothing dropped', v_cutoff
            using detail = coalesce(v_held, ''),
                  hint = 'deliver or replay the backlog, skip_batch() what will never be delivered, '
                         'or run housekeeping with the keep policy';
    end if;
    for v_rel in
        select c.relname
        from pg_catalog.pg_inherits i
        join pg_catalog.pg_class c on c.oid = i.inhrelid
        where i.inhparent = 'pgstream.events'::regclass
          and c.relname ~ '^events_[0-9]{8}$'
        order by c.relname
    loop
        v_day := to_date(substr(v_rel.relname, 8), 'YYYYMMDD');
        continue when v_day >= v_cutoff;
        if v_protected is not null and v_day >= v_protected then
            raise warning 'pgstream: keeping partition % past retention: it holds undelivered events', v_rel.relname;
            continue;
        end if;
        execute format('alter table pgstream.events detach partition pgstream.%I', v_rel.relname);
        execute format('drop table pgstream.%I', v_rel.relname);
        return next v_rel.relname;
    end loop;
    delete from pgstream.events_default
    where created_at < (least(v_cutoff, coalesce(v_protected, v_cutoff))::timestamp at time zone 'UTC');
end
$$;

-- Ledger housekeeping: delivered (or skipped) batches older than p_keep are removed; each
-- stream's ledger_horizon moves up to the newest event they covered. Returns rows removed.
create or replace function pgstream.prune_batches(p_keep interval default interval '7 days')
returns bigint
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_count bigint;
begin
    with gone as (
        delete from pgstream.batches
        where status in ('delivered', 'skipped') and coalesce(delivered_at, created_at) < now() - p_keep
        returning stream_id, max_created_at
    ), horizon as (
        update pgstream.streams s
           set ledger_horizon = greatest(s.ledger_horizon, h.max_created_at)
          from (select stream_id, max(max_created_at) as max_created_at from gone group by stream_id) h
         where s.id = h.stream_id
        returning 1
    )
    select count(*) into v_count from gone;
    return v_count;
end
$$;

revoke all on all tables in schema pgstream from public;
revoke all on all functions in schema pgstream from public;
