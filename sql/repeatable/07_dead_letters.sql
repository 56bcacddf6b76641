-- Repeatable: dead letters. An event a sink rejected for good (stage 'deliver') or that the sensor
-- could not read (stage 'read') is set aside in pgstream.dead_letters (014_event_integrity.sql) with
-- the reason and its position, and the stream goes on. Delivery never sends an event that has a
-- dead letter; operators redeliver (replay path) or discard it. The operator's functions are here.
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.

-- Operator: set aside events of the stream's open batches (the one a failover is blocked on, an
-- event that vanished from pgstream.events): each becomes an open dead letter (payload copied)
-- and delivery goes on without it. Returns the number set aside; refuses, changing nothing, ids
-- that are in no open batch of the stream or already set aside.
create or replace function pgstream.set_aside_events(p_stream_id bigint, p_event_ids bigint[], p_reason text)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_missing bigint[];
    v_count   integer;
begin
    if p_event_ids is null or pg_catalog.cardinality(p_event_ids) operator(pg_catalog.=) 0 then
        raise exception 'pgstream: no event ids given' using errcode = 'invalid_parameter_value';
    end if;
    if p_reason is null or pg_catalog.btrim(p_reason) operator(pg_catalog.=) '' then
        raise exception 'pgstream: a reason is required (it is kept with the dead letters)'
            using errcode = 'invalid_parameter_value';
    end if;
    if not exists (select 1 from pgstream.streams where id operator(pg_catalog.=) p_stream_id) then
        raise exception 'pgstream: stream % does not exist', p_stream_id using errcode = 'no_data_found';
    end if;
    perform pgstream._temp_table_check('pgstream_set_aside');
    create temporary table if not exists pg_temp.pgstream_set_aside (
        event_id bigint primary key, batch_id bigint, ord integer) on commit drop;
    truncate pg_temp.pgstream_set_aside;
    insert into pg_temp.pgstream_set_aside (event_id, batch_id, ord)
    select distinct on (x.event_id) x.event_id, b.id, o.ord::integer
    from pg_catalog.unnest(p_event_ids) as x(event_id)
    join pgstream.batches b
      on b.stream_id operator(pg_catalog.=) p_stream_id and pgstream.batch_is_open(b.status)
     and x.event_id operator(pg_catalog.=) any (b.event_ids)
    cross join lateral pg_catalog.unnest(b.event_ids) with ordinality as o(id, ord)
    where o.id operator(pg_catalog.=) x.event_id
    order by x.event_id, b.id;
    select pg_catalog.array_agg(x.event_id order by x.event_id) into v_missing
    from (select distinct pg_catalog.unnest(p_event_ids) as event_id) x
    where not exists (select 1 from pg_temp.pgstream_set_aside a where a.event_id operator(pg_catalog.=) x.event_id)
       or exists (select 1 from pgstream.dead_letters d
                  where d.stream_id operator(pg_catalog.=) p_stream_id and d.event_id operator(pg_catalog.=) x.event_id);
    if v_missing is not null then
        raise exception 'pgstream: events % are not undelivered events of stream % (or are already dead letters)',
            v_missing, p_stream_id using errcode = 'no_data_found';
    end if;
    insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, event_created_at, payload,
                                       metadata, error, attempts)
    select p_stream_id, a.event_id, 'deliver', a.batch_id, a.ord, e.created_at, e.payload, e.metadata,
           pg_catalog.left('set aside by an operator: ' operator(pg_catalog.||) p_reason, 2000), 0
    from pg_temp.pgstream_set_aside a
    left join pgstream.events e
      on e.id operator(pg_catalog.=) a.event_id and e.stream_id operator(pg_catalog.=) p_stream_id;
    get diagnostics v_count = row_count;
    return v_count;
end
$$;
revoke all on function pgstream.set_aside_events(bigint, bigint[], text) from public;

-- Operator: give up on open dead letters (p_ids null: all of the stream's). Returns how many;
-- refuses, changing nothing, ids that are not open dead letters of the stream.
create or replace function pgstream.discard_dead_letters(p_stream_id bigint, p_ids bigint[], p_by text)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_wrong bigint[];
    v_count integer;
begin
    if p_ids is not null then
        select pg_catalog.array_agg(i order by i) into v_wrong
        from (select distinct pg_catalog.unnest(p_ids) as i) x
        where not exists (select 1 from pgstream.dead_letters d
                          where d.id operator(pg_catalog.=) x.i and d.stream_id operator(pg_catalog.=) p_stream_id
                            and d.status operator(pg_catalog.=) 'open');
        if v_wrong is not null then
            raise exception 'pgstream: dead letters % are not open dead letters of stream %', v_wrong, p_stream_id
                using errcode = 'no_data_found';
        end if;
    end if;
    update pgstream.dead_letters
       set status = 'discarded', resolved_at = pg_catalog.now(), updated_at = pg_catalog.now(),
           resolved_by = pg_catalog.left(coalesce(p_by, 'sql'), 200)
     where stream_id operator(pg_catalog.=) p_stream_id and status operator(pg_catalog.=) 'open'
       and (p_ids is null or id operator(pg_catalog.=) any (p_ids));
    get diagnostics v_count = row_count;
    return v_count;
end
$$;
revoke all on function pgstream.discard_dead_letters(bigint, bigint[], text) from public;
