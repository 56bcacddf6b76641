-- 013: no configuration collision stalls a stream or loses an event.
--
--   * A replication slot belongs to one stream. Two streams reading one slot would each advance
--     it past the other's events: one records them, the other records nothing and looks healthy.
--     The effective slot name of a stream (streams.slot_name, default pgstream_stream_<id>) is
--     unique; an existing install where two streams share a slot fails this migration with the
--     streams named, before anything changes.
--   * Partition maintenance is serialised: create_partitions and drop_partitions take one
--     transaction-level advisory lock (key 1885827952 = 0x70677370, "pgsp";
--     pgstream_dagster.engine.migrations.PARTITION_LOCK_KEY) before they look at the catalog. Concurrent
--     callers (housekeeping next to migrate or init) used to deadlock attaching partitions next
--     to the default partition, or fail creating the same day twice.

-- ---------------------------------------------------------------------------------------------
-- One slot, one stream.
do $$
declare
    v_clash text;
begin
    select pg_catalog.string_agg(pg_catalog.format('slot %s is used by streams %s', c.slot, c.ids), '; '
                                 order by c.slot)
      into v_clash
      from (select coalesce(s.slot_name, 'pgstream_stream_' operator(pg_catalog.||) s.id::pg_catalog.text) as slot,
                   pg_catalog.string_agg(s.id::pg_catalog.text, ', ' order by s.id) as ids
              from pgstream.streams s
             group by 1
            having pg_catalog.count(*) operator(pg_catalog.>) 1) c;
    if v_clash is not null then
        raise exception 'pgstream: streams share a replication slot (%): only one of them would see its events', v_clash
            using hint = 'Give each stream its own streams[].slot_name in pgstream.yaml and set the same in '
                         'pgstream.streams.slot_name (null means pgstream_stream_<id>), or delete the stream that is '
                         'no longer used (delete from pgstream.streams where id = N); then migrate again.';
    end if;
end
$$;

create unique index if not exists streams_slot_key on pgstream.streams
    ((coalesce(slot_name, 'pgstream_stream_' operator(pg_catalog.||) id::pg_catalog.text)));

-- The stream that holds a slot name, other than p_stream_id (null if none). Runs as its caller:
-- the owner, or ensure_stream.
create or replace function pgstream.slot_holder(p_slot text, p_stream_id bigint)
returns bigint
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select s.id from pgstream.streams s
    where coalesce(s.slot_name, 'pgstream_stream_' || s.id::text) = p_slot and s.id <> p_stream_id
    order by s.id
    limit 1
$$;

-- A subscription for a stream that has no row yet creates the row (and so its publication), with
-- the default slot name: refused, naming the stream, when another stream already reads that slot.
create or replace function pgstream.ensure_stream(p_stream_id bigint)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_slot   text := 'pgstream_stream_' || p_stream_id::text;
    v_holder bigint;
begin
    if exists (select 1 from pgstream.streams where id = p_stream_id) then
        return;
    end if;
    v_holder := pgstream.slot_holder(v_slot, p_stream_id);
    if v_holder is not null then
        raise exception 'pgstream: stream %: slot % is already used by stream %', p_stream_id, v_slot, v_holder
            using errcode = 'unique_violation', constraint = 'streams_slot_key',
                  hint = pg_catalog.format('A slot belongs to one stream. Give stream %s another slot_name, or '
                                           'delete stream %s if it is no longer used.', v_holder, v_holder);
    end if;
    insert into pgstream.streams (id) values (p_stream_id) on conflict (id) do nothing;
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Partition maintenance, serialised. Same behaviour as 002 (create) and 007 (drop).

-- Creates the partitions for p_today .. p_today + p_days_ahead that do not exist yet and returns
-- their names. A day whose rows already sit in the default partition (maintenance did not run in
-- time) is left in the default partition, with a warning: moving them would replay them through
-- logical replication as new inserts.
create or replace function pgstream.create_partitions(
    p_days_ahead integer default 7,
    p_today date default pgstream.utc_today()
)
returns setof text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_day  date;
    v_name text;
    v_lo   timestamptz;
    v_hi   timestamptz;
begin
    if p_days_ahead is null or p_days_ahead < 0 then
        raise exception 'pgstream.create_partitions: p_days_ahead must be >= 0, got %', p_days_ahead;
    end if;
    -- one maintainer at a time; each statement below sees what the previous holder committed
    perform pg_catalog.pg_advisory_xact_lock(1885827952);
    for v_day in select d::date from pg_catalog.generate_series(p_today, p_today + p_days_ahead,
                                                                interval '1 day') d loop
        v_name := pgstream.partition_name(v_day);
        continue when pg_catalog.to_regclass(pg_catalog.format('pgstream.%I', v_name)) is not null;
        v_lo := v_day::timestamp at time zone 'UTC';
        v_hi := (v_day + 1)::timestamp at time zone 'UTC';
        if exists (select 1 from pgstream.events_default where created_at >= v_lo and created_at < v_hi) then
            raise warning 'pgstream: events for % are in pgstream.events_default; no partition created for that day', v_day;
            continue;
        end if;
        -- create standalone then attach: ATTACH only takes SHARE UPDATE EXCLUSIVE on the parent,
        -- so application inserts keep flowing.
        execute pg_catalog.format('create table pgstream.%I (like pgstream.events including defaults '
                                  'including constraints)', v_name);
        execute pg_catalog.format('alter table pgstream.%I add constraint %I check (created_at >= %L and '
                                  'created_at < %L)', v_name, v_name || '_bounds', v_lo, v_hi);
        execute pg_catalog.format('alter table pgstream.events attach partition pgstream.%I for values '
                                  'from (%L) to (%L)', v_name, v_lo, v_hi);
        execute pg_catalog.format('alter table pgstream.%I drop constraint %I', v_name, v_name || '_bounds');
        return next v_name;
    end loop;
end
$$;

-- drop_partitions takes the same lock: see 014_event_integrity.sql, which redefines it.

revoke all on function pgstream.slot_holder(text, bigint) from public;
revoke all on function pgstream.ensure_stream(bigint) from public;
revoke all on function pgstream.create_partitions(integer, date) from public;
