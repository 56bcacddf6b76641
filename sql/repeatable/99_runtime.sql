-- Repeatable: what the runtime and the Spark executors may do (roles in 024_runtime_roles.sql).
-- This file sorts last and is the one place that grants anything to pgstream_runtime or
-- pgstream_executor: it first takes every privilege in schema pgstream from them, then grants
-- exactly what they need, so what is written here is what they have. A function added to the
-- runtime's API gets its grant here.
--
--   * pgstream_runtime (the code location, its sensors, schedules and checks, every run, the
--     CLI's operations; its login members need REPLICATION for the slots): reads the ledger and the
--     events, writes the ledger's run columns, its locks, dead letters, resume points and
--     housekeeping records; everything that needs ownership (publications, partitions, the stream
--     rows, failover, pausing, backfills, the expected trigger of a table) goes through the
--     owner's SECURITY DEFINER functions below. It may read pgstream.subscriptions and write no
--     definition: no subscription, table, function, trigger or publication of its own, nothing it
--     could make the owner run.
--   * pgstream_executor (Spark executors: by_key tasks, the readers of Spark rounds, backfill
--     partitions, the Spark source; every executor host holds its credentials): reads events,
--     batches, resume points and dead letters, and holds no other table privilege (a write privilege
--     would let it LOCK the table in a mode that stalls every writer). It writes through the owner's
--     functions only, each with a token that names what it may write: a by_key round's resume points
--     and dead letters with the round's delivery token (record_key_progress, set_aside_rejected), a
--     registered consumer's position with that consumer's token (consumer_commit), backfill chunks
--     with the backfill's owner token (backfill_chunk).

-- ---------------------------------------------------------------------------------------------
-- The owner's functions that exist for the runtime.

-- The trigger pgstream generates for one table, operation and mode ('row' or 'statement'), its
-- names and its hash (what the subscription assets and checks compare the installed trigger with).
-- Runs as the owner: generating it validates the subscriptions' expressions, which the runtime must
-- not do as itself. Reads only; null columns when no subscription of that mode targets the table.
create or replace function pgstream.expected_trigger(
    p_schema text, p_table text, p_op pgstream.operation_type, p_mode text,
    out trigger_name text, out function_name text, out function_body text, out when_clause text,
    out trigger_hash text
)
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_mode is null or p_mode not in ('row', 'statement') then
        raise exception 'pgstream: expected_trigger: mode must be row or statement, got %',
            pg_catalog.quote_nullable(p_mode) using errcode = 'invalid_parameter_value';
    end if;
    trigger_name := pgstream.trigger_name(p_op, p_mode);
    function_name := pgstream.trigger_function_name(p_schema, p_table, p_op, p_mode);
    select g.function_body, g.when_clause into function_body, when_clause
    from pgstream.generated_trigger(p_schema, p_table, p_op, p_mode) g;
    trigger_hash := pgstream.generated_trigger_hash(function_body, when_clause);
end
$$;
revoke all on function pgstream.expected_trigger(text, text, pgstream.operation_type, text) from public;

-- ---------------------------------------------------------------------------------------------
-- A by_key round's delivery token (sql/030_executor_writes.sql): what its Spark tasks write with.

-- Issues stream p_stream_id's delivery token for run p_run_id, whose delivery lease this session
-- holds (the run's lease connection), and returns it; it replaces the stream's last one. The run
-- gives it to its round's Spark tasks: with it they write that stream's resume points and dead
-- letters, and only while that run holds the lease.
create or replace function pgstream.issue_delivery_token(p_stream_id bigint, p_run_id text)
returns text
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_token text := pgstream.new_token();
begin
    -- the lock row names this backend: its pid and its login role (its backend_start is hidden from
    -- the owner when the caller is another role: pg_stat_get_activity)
    if not exists (select 1 from pgstream.locks l
                   where l.name = 'delivery' and l.key = p_stream_id and l.holder = p_run_id
                     and l.pid = pg_catalog.pg_backend_pid()
                     and l.usesysid = (select r.oid from pg_catalog.pg_roles r where r.rolname = session_user)) then
        raise exception 'pgstream.issue_delivery_token: this session does not hold stream %''s delivery lease for '
                        'run %', p_stream_id, pg_catalog.quote_nullable(pg_catalog.left(p_run_id, 100))
            using errcode = 'insufficient_privilege';
    end if;
    insert into pgstream.delivery_tokens as t (stream_id, run_id, token_hash)
    values (p_stream_id, p_run_id, pgstream.token_hash(v_token))
    on conflict (stream_id) do update
        set run_id = excluded.run_id, token_hash = excluded.token_hash, issued_at = pg_catalog.now();
    return v_token;
end
$$;
revoke all on function pgstream.issue_delivery_token(bigint, text) from public;

-- The stream whose delivery token p_token is, while the run it was issued to holds the stream's
-- delivery lease; null otherwise (another token, a run that ended or died).
create or replace function pgstream.delivery_token_stream(p_token text)
returns bigint
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select t.stream_id from pgstream.delivery_tokens t
    where t.token_hash = pgstream.token_hash(p_token)
      and pgstream.lock_holder('delivery', t.stream_id) = t.run_id
$$;
revoke all on function pgstream.delivery_token_stream(text) from public;

-- A by_key task records that every event of its buckets p_buckets (of p_partitions) up to position
-- (p_batch_id, p_ord) of its stream is handled (sql/018_key_progress.sql; positions only move
-- forward). The stream is the one whose delivery token p_token is; false (nothing written) when it
-- is no live run's token: the run is gone and the task stops.
create or replace function pgstream.record_key_progress(p_token text, p_partitions integer, p_buckets integer[],
                                                        p_batch_id bigint, p_ord bigint)
returns boolean
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_stream bigint := pgstream.delivery_token_stream(p_token);
begin
    if v_stream is null then
        return false;
    end if;
    insert into pgstream.key_progress as p (stream_id, partitions, bucket, batch_id, ord)
    select v_stream, p_partitions, b, p_batch_id, p_ord from pg_catalog.unnest(p_buckets) b
    on conflict (stream_id, partitions, bucket) do update
       set batch_id = excluded.batch_id, ord = excluded.ord, updated_at = pg_catalog.now()
       where (p.batch_id, p.ord) < (excluded.batch_id, excluded.ord);
    return true;
end
$$;
revoke all on function pgstream.record_key_progress(text, integer, integer[], bigint, bigint) from public;

-- A by_key task sets aside the event the sink rejected for good (or that is too large for it) at
-- ordinal p_ord of open batch p_batch_id of the stream whose delivery token p_token is: a dead
-- letter with the event's own created_at, payload and metadata from pgstream.events (none if it
-- vanished), never the caller's. True when set aside now, false when it had a dead letter already.
create or replace function pgstream.set_aside_rejected(p_token text, p_batch_id bigint, p_ord integer,
                                                       p_sink text, p_error text, p_attempts integer)
returns boolean
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_stream bigint := pgstream.delivery_token_stream(p_token);
    v_event  bigint;
    v_lo     timestamptz;
    v_hi     timestamptz;
begin
    if v_stream is null then
        raise exception 'pgstream.set_aside_rejected: not the delivery token of a run that holds a stream''s '
                        'delivery lease' using errcode = 'insufficient_privilege';
    end if;
    select b.event_ids[p_ord], b.min_created_at, b.max_created_at into v_event, v_lo, v_hi
    from pgstream.batches b
    where b.id = p_batch_id and b.stream_id = v_stream and pgstream.batch_is_open(b.status);
    if v_event is null then
        raise exception 'pgstream.set_aside_rejected: (batch %, ordinal %) holds no event of an open batch of stream %',
                        coalesce(p_batch_id::text, 'null'), coalesce(p_ord::text, 'null'), v_stream
            using errcode = 'invalid_parameter_value';
    end if;
    insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, event_created_at, payload,
                                       metadata, sink, error, attempts)
    select v_stream, v_event, 'deliver', p_batch_id, p_ord, e.created_at, e.payload, e.metadata,
           pg_catalog.left(p_sink, 200), pg_catalog.left(coalesce(p_error, ''), 2000),
           greatest(coalesce(p_attempts, 0), 0)
    from (select 1) one
    left join pgstream.events e
      on e.id = v_event and e.stream_id = v_stream and e.created_at >= v_lo and e.created_at <= v_hi
    on conflict (stream_id, event_id) do nothing;
    return found;
end
$$;
revoke all on function pgstream.set_aside_rejected(text, bigint, integer, text, text, integer) from public;

-- ---------------------------------------------------------------------------------------------
-- Start from nothing: the grants below are all these roles hold in schema pgstream. Only what names
-- them is revoked (a revoke on an object that grants them nothing would still write its ACL out).
do $$
declare
    v_object text;
begin
    for v_object in
        select pg_catalog.format('%s %s', case c.relkind when 'S' then 'sequence' else 'table' end,
                                 c.oid::pg_catalog.regclass)
        from pg_catalog.pg_class c
        where c.relnamespace operator(pg_catalog.=) 'pgstream'::pg_catalog.regnamespace
          and (exists (select 1 from pg_catalog.aclexplode(c.relacl) a
                       where a.grantee::pg_catalog.regrole::pg_catalog.text in ('pgstream_runtime', 'pgstream_executor'))
               or exists (select 1 from pg_catalog.pg_attribute t cross join lateral pg_catalog.aclexplode(t.attacl) a
                          where t.attrelid operator(pg_catalog.=) c.oid
                            and a.grantee::pg_catalog.regrole::pg_catalog.text in ('pgstream_runtime', 'pgstream_executor')))
        union all
        select pg_catalog.format('function %s', p.oid::pg_catalog.regprocedure)
        from pg_catalog.pg_proc p
        where p.pronamespace operator(pg_catalog.=) 'pgstream'::pg_catalog.regnamespace
          and exists (select 1 from pg_catalog.aclexplode(p.proacl) a
                      where a.grantee::pg_catalog.regrole::pg_catalog.text in ('pgstream_runtime', 'pgstream_executor'))
    loop
        execute pg_catalog.format('revoke all on %s from pgstream_runtime, pgstream_executor', v_object);
    end loop;
end
$$;
revoke all on schema pgstream from pgstream_runtime, pgstream_executor;
grant usage on schema pgstream to pgstream_runtime, pgstream_executor;

-- ---------------------------------------------------------------------------------------------
-- pgstream_runtime: tables and views.
grant select on pgstream.streams, pgstream.batches, pgstream.events, pgstream.events_default, pgstream.failovers,
                pgstream.subscriptions, pgstream.dead_letters, pgstream.key_progress, pgstream.locks, pgstream.housekeeping_runs,
                pgstream.backfills, pgstream.backfill_partitions, pgstream.backfill_progress,
                pgstream.stream_status, pgstream.orphaned_slots, pgstream.metrics, pgstream.consumers,
                pgstream.consumer_status, pgstream.reader_groups
    to pgstream_runtime;
-- a reader group's reader: what it recorded through, how far it read, its slot's recovery, the point and
-- timeline it created its slot at (engine/ingest/group.py); membership and the publication go through the
-- functions below
grant update (recovery_pending, consumed_through, recorded_through, slot_lsn, slot_timeline)
    on pgstream.reader_groups to pgstream_runtime;
-- the open run, the slot's declared reader, and how far the slot was read (engine/ledger); everything
-- else of a stream row goes through register_group_member, set_paused, enter_failover, leave_failover, retry_now
grant update (open_run_key, slot_reader, consumed_through, recovery_pending) on pgstream.streams to pgstream_runtime;
-- recording batches and their transitions
grant insert (stream_id, kind, event_ids, event_count, first_event_id, last_event_id, min_created_at,
              max_created_at, start_lsn, end_lsn, first_commit_at, last_commit_at) on pgstream.batches
    to pgstream_runtime;
grant update (status, run_key, attempts, launched_at, next_attempt_at, error, confirmed_count, delivered_at, run_id)
    on pgstream.batches to pgstream_runtime;
-- dead letters: set aside by the sensor and the runs, resolved by a redelivery
grant insert (stream_id, event_id, stage, batch_id, ord, lsn, event_created_at, payload, metadata, sink, error,
              attempts) on pgstream.dead_letters to pgstream_runtime;
grant update (error, attempts, sink, status, resolved_at, resolved_by, updated_at) on pgstream.dead_letters
    to pgstream_runtime;
grant insert, update, delete on pgstream.key_progress to pgstream_runtime;
-- pgstream's session locks (repeatable/00_locks.sql run as their caller)
grant insert (name, key, pid, backend_start, usesysid, holder, taken_at),
      update (pid, backend_start, usesysid, holder, taken_at) on pgstream.locks to pgstream_runtime;
grant insert (today, partitions_created, partitions_dropped, partitions_kept, partitions_busy, rows_dropped,
              bytes_dropped, default_rows_deleted, batches_pruned, warnings, consumers_overrun), delete
    on pgstream.housekeeping_runs
    to pgstream_runtime;

-- pgstream_runtime: functions. SECURITY DEFINER (run as the owner, each validating its input):
grant execute on function
    pgstream.register_group_member(bigint, text),
    pgstream.ensure_group_publication(text),
    pgstream.begin_join(bigint, text),
    pgstream.finish_join(bigint, text),
    pgstream.enter_failover(bigint, bigint, text, timestamptz),
    pgstream.leave_failover(bigint),
    pgstream.retry_now(bigint),
    pgstream.skip_batch(bigint, bigint),
    pgstream.set_paused(bigint, boolean),
    pgstream.prune_batches(interval),
    pgstream.create_partitions(integer, date, integer, integer),
    pgstream.drop_partitions(integer, date, text, integer, integer),
    pgstream.expired_partitions(integer, date, text),
    pgstream.drop_partition(text, integer, date, integer, integer),
    pgstream.delete_expired_default(integer, date),
    pgstream.stream_slot(bigint),
    pgstream.set_aside_events(bigint, bigint[], text),
    pgstream.discard_dead_letters(bigint, bigint[], text),
    pgstream.expected_trigger(text, text, pgstream.operation_type, text),
    pgstream.backfill_start(bigint, text, text, text, text, jsonb, jsonb, integer),
    pgstream.backfill_claim(bigint, uuid, text),
    pgstream.backfill_chunk(bigint, integer, uuid, integer),
    pgstream.backfill_next_key(bigint, integer),
    pgstream.backfill_backlog(bigint),
    pgstream.backfill_release(bigint, uuid, text, text),
    pgstream.backfill_stop(bigint, boolean),
    pgstream.consumer_positions(date),
    pgstream.register_consumer(text, bigint, boolean, integer),
    pgstream.consumer_token(text),
    pgstream.drop_consumer(text),
    pgstream.set_consumer_retention(text, integer),
    pgstream.issue_delivery_token(bigint, text)
    to pgstream_runtime;
-- ... and run as their caller, on the tables granted above (a lock names the session's backend):
grant execute on function
    pgstream.try_lock(text, bigint, text),
    pgstream.unlock(text, bigint),
    pgstream.lock_holder(text, bigint),
    pgstream.backend_alive(integer, timestamptz, oid),
    pgstream.backfill_try_lock(bigint),
    pgstream.backfill_unlock(bigint)
    to pgstream_runtime;

-- ---------------------------------------------------------------------------------------------
-- pgstream_executor: what Spark tasks run (engine/spark.py readers, ledger.KeyProgress,
-- ledger.DeadLetterWriter on a by_key task, engine/backfill.py run_partition) and the Spark source
-- (engine/spark_source.py: it reads events, batches and dead letters, and records its registered
-- consumer's position through consumer_commit with that consumer's token: it can neither register a
-- consumer, change a consumer's bound, drop one nor move another's position). SELECT only on tables:
-- it allows no LOCK mode but ACCESS SHARE, which blocks no reader or writer, and no row lock.
grant select on pgstream.events, pgstream.batches, pgstream.key_progress, pgstream.dead_letters
    to pgstream_executor;
grant select (id, status, owner_token) on pgstream.backfills to pgstream_executor;
-- the Spark source goes on from its consumer's recorded position when a failover lost the ledger its
-- checkpoint read (engine/spark_source.py StreamReader._checked)
grant select (name, stream_id, batch_id, ord) on pgstream.consumers to pgstream_executor;
grant execute on function
    pgstream.backfill_chunk(bigint, integer, uuid, integer),
    pgstream.backfill_next_key(bigint, integer),
    pgstream.consumer_commit(text, bigint, bigint, integer, text),
    pgstream.record_key_progress(text, integer, integer[], bigint, bigint),
    pgstream.set_aside_rejected(text, bigint, integer, text, text, integer),
    pgstream.backfill_backlog(bigint)
    to pgstream_executor;
