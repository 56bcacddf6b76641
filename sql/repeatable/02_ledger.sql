-- Repeatable: the batch ledger and failover. What is an open batch, failover state, the
-- operator's controls (retry now, skip a batch, pause) and ledger pruning.
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.
--
-- Failover: when a delivery fails, the stream records a checkpoint (the first event of the batch
-- the sink refused) and enters failover. The sensor keeps consuming the slot and recording
-- batches (WAL keeps being released) but only re-probes the checkpoint batch, with exponential
-- backoff, until the sink accepts it; then it delivers the backlog from the table in commit order
-- and leaves failover. Every failover is kept in pgstream.failovers.

-- ---------------------------------------------------------------------------------------------
-- Whether a batch still has to be delivered: every status but 'delivered' and 'skipped' (pending,
-- launched, failed). The one definition of an open batch: views, functions and the Python code
-- call it rather than spelling the statuses out.
-- A SQL-standard body and no SET clause: its names are bound once, when it is created, under the
-- search_path set here (for this file's transaction only: pg_catalog's operators, whatever the
-- migrating role's search_path), and Postgres inlines it into the calling query, so
-- `where stream_id = $1 and pgstream.batch_is_open(status)` is planned exactly like the spelled-out
-- predicate and uses the partial index batches_open_idx (007_failover.sql). That index spells the
-- predicate out: it is created by a versioned migration, before this function exists.
set local search_path = pg_catalog, pg_temp;
create or replace function pgstream.batch_is_open(p_status text)
returns boolean
language sql
immutable
parallel safe
return p_status not in ('delivered', 'skipped');
-- A pure comparison that reads nothing: any role may run it, so that a role granted SELECT on a
-- view that uses it (pgstream.stream_status, for monitoring) can read the view.
grant execute on function pgstream.batch_is_open(text) to public;

-- ---------------------------------------------------------------------------------------------
-- Failover.

-- Record a failed delivery of p_batch_id: the batch waits for p_retry_at, the stream enters
-- failover (or stays in it, one more attempt).
create or replace function pgstream.enter_failover(
    p_stream_id bigint, p_batch_id bigint, p_error text, p_retry_at timestamptz
)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
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
revoke all on function pgstream.enter_failover(bigint, bigint, text, timestamptz) from public;

-- The stream caught up: close the failover. Returns the closed failovers row id (null if the
-- stream was not in failover).
create or replace function pgstream.leave_failover(p_stream_id bigint)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
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
revoke all on function pgstream.leave_failover(bigint) from public;

-- Operator: retry the failed batch at the next sensor tick instead of waiting for the backoff.
-- Failover itself ends once the backlog is delivered. Returns the batch id made due (null if none).
create or replace function pgstream.retry_now(p_stream_id bigint)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
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
revoke all on function pgstream.retry_now(bigint) from public;

-- Operator: give up on one undelivered batch (e.g. an event the sink will never accept). Its
-- events stay in pgstream.events and can be replayed later by id range. Returns the events skipped.
create or replace function pgstream.skip_batch(p_stream_id bigint, p_batch_id bigint)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count integer;
begin
    update pgstream.batches set status = 'skipped', error = coalesce(error, '') || ' [skipped by operator]'
     where id = p_batch_id and stream_id = p_stream_id and pgstream.batch_is_open(status)
    returning event_count into v_count;
    if v_count is null then
        raise exception 'pgstream: batch % of stream % is not an undelivered batch', p_batch_id, p_stream_id
            using errcode = 'no_data_found';
    end if;
    return v_count;
end
$$;
revoke all on function pgstream.skip_batch(bigint, bigint) from public;

-- Operator: pause or resume a stream (its sensor records batches but requests no delivery run).
-- A run publishes each chunk holding the stream row FOR KEY SHARE and only while the stream is not
-- paused (ledger.publishing): the FOR UPDATE below waits for a chunk in flight, so once this returns no
-- run publishes anything more of the stream.
create or replace function pgstream.set_paused(p_stream_id bigint, p_paused boolean)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform 1 from pgstream.streams where id operator(pg_catalog.=) p_stream_id for update;
    update pgstream.streams set paused = p_paused, updated_at = now() where id = p_stream_id;
    if not found then
        raise exception 'pgstream: stream % does not exist', p_stream_id using errcode = 'no_data_found';
    end if;
end
$$;
revoke all on function pgstream.set_paused(bigint, boolean) from public;

-- ---------------------------------------------------------------------------------------------
-- Ledger housekeeping: delivered (or skipped) batches older than p_keep are removed, except those a
-- registered consumer has not read (within its bound); each stream's ledger_horizon moves up to the
-- newest event they covered. Returns rows removed.
create or replace function pgstream.prune_batches(p_keep interval default interval '7 days')
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    with gone as (
        delete from pgstream.batches
        where not pgstream.batch_is_open(status) and coalesce(delivered_at, created_at) < now() - p_keep
          -- a batch a registered consumer has not read stays (for its bound at most): it says which
          -- events the consumer reads next
          and not pgstream.consumer_unread(stream_id, id, event_count, max_created_at)
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
revoke all on function pgstream.prune_batches(interval) from public;
