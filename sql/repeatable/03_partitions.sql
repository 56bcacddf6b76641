-- Repeatable: partitions and retention. Daily partitions of pgstream.events (UTC days), created
-- ahead and dropped after retention; undelivered events are never dropped silently.
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.
--
-- Partition maintenance is serialised: create_partitions and drop_partitions take pgstream's lock
-- 'partitions' for their transaction (pgstream.lock_for_transaction, repeatable/00_locks.sql: a row
-- only the owner can lock, not an advisory lock any role could hold) before they look at the catalog. Concurrent
-- callers (housekeeping next to migrate or init) used to deadlock attaching partitions next to the
-- default partition, or fail creating the same day twice.

create or replace function pgstream.partition_name(p_day date)
returns text language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'events_' || to_char(p_day, 'YYYYMMDD') $$;
revoke all on function pgstream.partition_name(date) from public;

create or replace function pgstream.utc_today()
returns date language sql stable
set search_path = pg_catalog, pg_temp
as $$ select (now() at time zone 'UTC')::date $$;
-- Reads only the clock: any role may run it, so that a role granted SELECT on pgstream.stream_status
-- (which counts today's deliveries with it) can read the view.
grant execute on function pgstream.utc_today() to public;

-- ---------------------------------------------------------------------------------------------
-- What retention must keep.

-- Partitions that hold events a stream has not delivered, or may not have read from its slot
-- yet, are protected. consumed_through is moved back one day for transactions that commit long
-- after their rows were inserted.
create or replace function pgstream.oldest_protected_day()
returns date
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select (least(
        (select min(min_created_at) from pgstream.batches where pgstream.batch_is_open(status)),
        (select min(consumed_through) - interval '1 day' from pgstream.streams)
    ) at time zone 'UTC')::date
$$;
revoke all on function pgstream.oldest_protected_day() from public;

-- Which streams hold back which day: for operators and the 'fail' policy's message.
create or replace function pgstream.protected_streams(
    out stream_id bigint, out oldest_undelivered timestamptz, out consumed_through timestamptz
)
returns setof record
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select s.id,
           (select min(b.min_created_at) from pgstream.batches b
             where b.stream_id = s.id and pgstream.batch_is_open(b.status)),
           s.consumed_through
    from pgstream.streams s
    order by s.id
$$;
revoke all on function pgstream.protected_streams() from public;

-- ---------------------------------------------------------------------------------------------
-- Partition maintenance, serialised (see above).

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
    perform pgstream.lock_for_transaction('partitions');
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
revoke all on function pgstream.create_partitions(integer, date) from public;

-- ---------------------------------------------------------------------------------------------
-- Retention of the default partition: a row past retention is deleted only once it is done with:
-- a closed (delivered or skipped) batch holds it, or it is a dead letter (its payload was copied),
-- or it is older than its stream's ledger horizon (delivered by batches pruned since), was read
-- from the slot (a day of slack, as for partitions) and is in no open batch. A row no batch holds
-- yet (not read from the slot, whatever its date) stays.
-- (A batch holding a row has min_created_at <= its created_at: only batches older than the
-- cutoff are looked at.) Called by pgstream.drop_partitions; returns the rows deleted.
create or replace function pgstream._delete_expired_default(p_before timestamptz)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    -- every (stream, event) a batch old enough holds, and whether an open batch holds it
    with held as materialized (
        select b.stream_id, o.id, pg_catalog.bool_or(pgstream.batch_is_open(b.status)) as open
        from pgstream.batches b
        cross join lateral pg_catalog.unnest(b.event_ids) as o(id)
        where b.min_created_at operator(pg_catalog.<) p_before
        group by b.stream_id, o.id
    ), gone as (
        delete from pgstream.events_default e
        where e.created_at operator(pg_catalog.<) p_before
          and not exists (select 1 from held h
                          where h.stream_id operator(pg_catalog.=) e.stream_id and h.id operator(pg_catalog.=) e.id
                            and h.open)
          and (exists (select 1 from held h
                       where h.stream_id operator(pg_catalog.=) e.stream_id and h.id operator(pg_catalog.=) e.id
                         and not h.open)
               or exists (select 1 from pgstream.dead_letters d
                          where d.stream_id operator(pg_catalog.=) e.stream_id
                            and d.event_id operator(pg_catalog.=) e.id)
               or exists (select 1 from pgstream.streams s
                          where s.id operator(pg_catalog.=) e.stream_id
                            and e.created_at operator(pg_catalog.<=) s.ledger_horizon
                            and e.created_at operator(pg_catalog.<)
                                (s.consumed_through operator(pg_catalog.-) '1 day'::pg_catalog.interval)))
        returning 1
    )
    select pg_catalog.count(*) into v_count from gone;
    return v_count;
end
$$;
revoke all on function pgstream._delete_expired_default(timestamptz) from public;

-- Drops the daily partitions older than p_retention_days and the expired rows of the default
-- partition that are done with (_delete_expired_default; the ones kept are counted in a WARNING).
-- Returns the dropped partition names. Serialised with create_partitions (the 'partitions' lock above). A
-- partition past retention that still holds events a stream has not delivered
-- (pgstream.oldest_protected_day()) is handled by policy:
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
set search_path = pg_catalog, pg_temp
as $$
declare
    v_cutoff    date;
    v_protected date;
    v_rel       record;
    v_day       date;
    v_held      text;
    v_undone    bigint;
begin
    if p_retention_days is null or p_retention_days < 1 then
        raise exception 'pgstream.drop_partitions: p_retention_days must be >= 1, got %', p_retention_days;
    end if;
    if p_policy is null or p_policy not in ('keep', 'fail') then
        raise exception 'pgstream.drop_partitions: p_policy must be ''keep'' or ''fail'', got %', p_policy;
    end if;
    perform pgstream.lock_for_transaction('partitions');
    v_protected := pgstream.oldest_protected_day();
    v_cutoff := p_today - p_retention_days;
    if p_policy = 'fail' and v_protected is not null and v_protected < v_cutoff then
        select pg_catalog.string_agg(pg_catalog.format('stream %s (oldest undelivered %s, slot consumed through %s)',
                                                       stream_id, coalesce(oldest_undelivered::text, 'none'),
                                                       consumed_through), '; ')
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
        where i.inhparent = 'pgstream.events'::pg_catalog.regclass
          and c.relname ~ '^events_[0-9]{8}$'
        order by c.relname
    loop
        v_day := pg_catalog.to_date(pg_catalog.substr(v_rel.relname, 8), 'YYYYMMDD');
        continue when v_day >= v_cutoff;
        if v_protected is not null and v_day >= v_protected then
            raise warning 'pgstream: keeping partition % past retention: it holds undelivered events', v_rel.relname;
            continue;
        end if;
        execute pg_catalog.format('alter table pgstream.events detach partition pgstream.%I', v_rel.relname);
        execute pg_catalog.format('drop table pgstream.%I', v_rel.relname);
        return next v_rel.relname;
    end loop;
    -- row by row: the protected day (which holds whole partitions back) does not apply
    perform pgstream._delete_expired_default(v_cutoff::timestamp at time zone 'UTC');
    select pg_catalog.count(*) into v_undone from pgstream.events_default
     where created_at < (v_cutoff::timestamp at time zone 'UTC');
    if v_undone > 0 then
        raise warning 'pgstream: % expired rows of events_default are kept: no batch has delivered them yet', v_undone;
    end if;
end
$$;
revoke all on function pgstream.drop_partitions(integer, date, text) from public;
