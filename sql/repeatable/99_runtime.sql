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
--     partitions): reads events and batches, writes the resume points of by_key rounds and the dead
--     letters a by_key task sets aside, runs backfill chunks.

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

-- Whether run p_run_id holds stream p_stream_id's delivery lease (pgstream's lock 'delivery' names it
-- and its backend lives: pgstream.lock_holder): a by_key task asks before it records a chunk and
-- publishes the next one, and stops once its run is gone. Runs as the owner so the executors need no
-- privilege on pgstream.locks; it answers that one question and nothing else.
create or replace function pgstream.delivery_lease_held(p_stream_id bigint, p_run_id text)
returns boolean
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(pgstream.lock_holder('delivery', p_stream_id) = p_run_id, false)
$$;
revoke all on function pgstream.delivery_lease_held(bigint, text) from public;

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
-- a reader group's reader: what it recorded through, how far it read, its slot's recovery
-- (engine/ingest/group.py); membership and the publication go through the functions below
grant update (recovery_pending, consumed_through, recorded_through) on pgstream.reader_groups to pgstream_runtime;
-- the open run, the slot's declared reader, and how far the slot was read (engine/ledger); everything
-- else of a stream row goes through register_stream, set_paused, enter_failover, leave_failover, retry_now
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
    pgstream.register_stream(bigint, text),
    pgstream.register_group_member(bigint, text),
    pgstream.ensure_group_publication(text),
    pgstream.begin_join(bigint, text),
    pgstream.finish_join(bigint, text),
    pgstream.ensure_stream(bigint),
    pgstream.ensure_publications(bigint),
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
    pgstream.drop_consumer(text),
    pgstream.set_consumer_retention(text, integer),
    pgstream.delivery_lease_held(bigint, text)
    to pgstream_runtime;
-- ... and run as their caller, on the tables granted above (a lock names the session's backend):
grant execute on function
    pgstream.try_lock(text, bigint, text),
    pgstream.unlock(text, bigint),
    pgstream.lock_holder(text, bigint),
    pgstream.backend_alive(integer, timestamptz, oid),
    pgstream.backfill_try_lock(bigint),
    pgstream.backfill_unlock(bigint),
    pgstream.slot_holder(text, bigint)
    to pgstream_runtime;

-- ---------------------------------------------------------------------------------------------
-- pgstream_executor: what Spark tasks run (engine/spark.py readers, ledger.KeyProgress,
-- ledger.DeadLetterWriter on a by_key task, engine/backfill.py run_partition) and the Spark source
-- (engine/spark_source.py: it reads events, batches and dead letters, and records a
-- registered consumer's position through consumer_commit only: it can neither register a consumer,
-- change a consumer's bound nor drop one).
grant select on pgstream.events, pgstream.batches, pgstream.key_progress, pgstream.dead_letters
    to pgstream_executor;
grant insert, update on pgstream.key_progress to pgstream_executor;
grant insert (stream_id, event_id, stage, batch_id, ord, event_created_at, payload, metadata, sink, error, attempts)
    on pgstream.dead_letters to pgstream_executor;
grant select (id, status, owner_token) on pgstream.backfills to pgstream_executor;
grant execute on function
    pgstream.backfill_chunk(bigint, integer, uuid, integer),
    pgstream.backfill_next_key(bigint, integer),
    pgstream.consumer_commit(text, bigint, bigint, integer),
    pgstream.backfill_backlog(bigint),
    pgstream.delivery_lease_held(bigint, text)
    to pgstream_executor;
