-- 002: daily partitions of pgstream.events (UTC days), created ahead and dropped after retention.

create or replace function pgstream.partition_name(p_day date)
returns text language sql immutable
as $$ select 'events_' || to_char(p_day, 'YYYYMMDD') $$;

create or replace function pgstream.utc_today()
returns date language sql stable
as $$ select (now() at time zone 'UTC')::date $$;

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
set search_path = ''
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
    for v_day in select d::date from generate_series(p_today, p_today + p_days_ahead, interval '1 day') d loop
        v_name := pgstream.partition_name(v_day);
        continue when to_regclass(format('pgstream.%I', v_name)) is not null;
        v_lo := v_day::timestamp at time zone 'UTC';
        v_hi := (v_day + 1)::timestamp at time zone 'UTC';
        if exists (select 1 from pgstream.events_default where created_at >= v_lo and created_at < v_hi) then
            raise warning 'pgstream: events for % are in pgstream.events_default; no partition created for that day', v_day;
            continue;
        end if;
        -- create standalone then attach: ATTACH only takes SHARE UPDATE EXCLUSIVE on the parent,
        -- so application inserts keep flowing.
        execute format('create table pgstream.%I (like pgstream.events including defaults including constraints)', v_name);
        execute format('alter table pgstream.%I add constraint %I check (created_at >= %L and created_at < %L)',
                       v_name, v_name || '_bounds', v_lo, v_hi);
        execute format('alter table pgstream.events attach partition pgstream.%I for values from (%L) to (%L)',
                       v_name, v_lo, v_hi);
        execute format('alter table pgstream.%I drop constraint %I', v_name, v_name || '_bounds');
        return next v_name;
    end loop;
end
$$;

-- The first UTC day whose events must be kept for delivery. Replaced by the ledger migration;
-- until then nothing is protected beyond the retention.
create or replace function pgstream.oldest_protected_day()
returns date language sql stable
as $$ select null::date $$;

-- Drops the daily partitions older than p_retention_days (and deletes expired rows of the
-- default partition). Returns the dropped partition names. Partitions that still hold events a
-- stream has not delivered are kept (see pgstream.oldest_protected_day()) and reported with a
-- warning: an outage longer than the retention never loses events silently.
create or replace function pgstream.drop_partitions(
    p_retention_days integer default 7,
    p_today date default pgstream.utc_today()
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
begin
    if p_retention_days is null or p_retention_days < 1 then
        raise exception 'pgstream.drop_partitions: p_retention_days must be >= 1, got %', p_retention_days;
    end if;
    v_cutoff := p_today - p_retention_days;
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
