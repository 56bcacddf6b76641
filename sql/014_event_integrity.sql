-- 014: event integrity. No single bad event stalls a stream or is lost silently.
--
--   * An event's id and created_at are the database's. Roles that insert events (pgstream_writer,
--     and the roles an operator lets insert manual events) may set payload, metadata and stream_id
--     only (column privileges), and every insert not made by the generated triggers goes through
--     pgstream._check_event(): its id is taken from the sequence whatever was given, a created_at
--     that is not the insert's own clock time is refused, and so is a stream that does not exist.
--   * Dead letters: an event a sink rejected for good (stage 'deliver') or that the sensor could
--     not read (stage 'read', e.g. a created_at outside what a client can represent) is set aside
--     in pgstream.dead_letters with the reason and its position, and the stream goes on. Delivery
--     never sends an event that has a dead letter; operators redeliver (replay path) or discard it.
--   * Retention never deletes a row of the default partition that no batch has delivered.

-- ---------------------------------------------------------------------------------------------
-- Column privileges: nobody but the owner may choose an event's id, created_at or lsn.
revoke insert on pgstream.events from pgstream_writer;
grant insert (payload, metadata, stream_id) on pgstream.events to pgstream_writer;

-- Roles an operator granted INSERT on the whole table (the manual-event grant documented before
-- this migration) keep inserting, on the same three columns.
do $$
declare
    v_grantee text;
begin
    for v_grantee in
        select distinct case when a.grantee = 0 then 'public'
                             else pg_catalog.quote_ident(r.rolname) end
        from pg_catalog.pg_class c
        cross join lateral pg_catalog.aclexplode(c.relacl) a
        left join pg_catalog.pg_roles r on r.oid = a.grantee
        where c.oid = 'pgstream.events'::pg_catalog.regclass
          and a.privilege_type = 'INSERT'
          and a.grantee <> c.relowner
    loop
        execute pg_catalog.format('revoke insert on pgstream.events from %s', v_grantee);
        execute pg_catalog.format('grant insert (payload, metadata, stream_id) on pgstream.events to %s', v_grantee);
        raise notice 'pgstream: % may now insert events with payload, metadata and stream_id only', v_grantee;
    end loop;
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Every event not written by a generated trigger (manual events, the owner's own inserts).
create or replace function pgstream._check_event()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_now pg_catalog.timestamptz := pg_catalog.clock_timestamp();
begin
    if not exists (select 1 from pgstream.streams s where s.id operator(pg_catalog.=) new.stream_id) then
        raise exception 'pgstream: stream % does not exist: no sensor would ever read this event', new.stream_id
            using errcode = 'foreign_key_violation',
                  hint = 'declare the stream in pgstream.yaml and run pgstream-dagster init, or insert with an existing stream_id';
    end if;
    -- created_at defaults to the insert's clock_timestamp(), evaluated just before this trigger
    if new.created_at is null
       or new.created_at operator(pg_catalog.<) (v_now operator(pg_catalog.-) '5 minutes'::pg_catalog.interval)
       or new.created_at operator(pg_catalog.>) v_now then
        raise exception 'pgstream: created_at of an event is set by the database; got %', new.created_at
            using errcode = 'check_violation',
                  hint = 'insert payload, metadata and stream_id only; put your own timestamps in the payload';
    end if;
    -- a fresh id whatever was given: ids stay unique and increasing (the default's id is a gap)
    new.id := pg_catalog.nextval('pgstream.events_id_seq'::pg_catalog.regclass);
    return new;
end
$$;
revoke all on function pgstream._check_event() from public;

drop trigger if exists check_event on pgstream.events;
create trigger check_event
before insert on pgstream.events
for each row
when (current_user operator(pg_catalog.<>) 'pgstream_writer'::pg_catalog.name)
execute function pgstream._check_event();

-- ---------------------------------------------------------------------------------------------
-- Dead letters.
create table if not exists pgstream.dead_letters (
    id               bigint generated always as identity primary key,
    stream_id        bigint not null references pgstream.streams (id) on delete cascade,
    event_id         bigint not null,
    -- 'read': the sensor could not record it (it is in no batch); 'deliver': the sink rejected it
    stage            text not null check (stage in ('read', 'deliver')),
    -- its place in the delivery order: the batch and the ordinal in it ('deliver'), the commit LSN
    -- of its transaction ('read')
    batch_id         bigint,
    ord              integer,
    lsn              pg_lsn,
    event_created_at timestamptz,
    -- a copy, so that retention never makes a dead letter undeliverable (null: the row was gone)
    payload          jsonb,
    metadata         jsonb,
    sink             text,
    error            text not null,
    attempts         integer not null default 1 check (attempts >= 0),
    status           text not null default 'open' check (status in ('open', 'redelivered', 'discarded')),
    created_at       timestamptz not null default now(),
    updated_at       timestamptz not null default now(),
    resolved_at      timestamptz,
    resolved_by      text,
    check ((status = 'open') = (resolved_at is null)),
    check (stage = 'read' or batch_id is not null)
);
-- an event is set aside at most once: delivery skips it from then on
create unique index if not exists dead_letters_event_idx on pgstream.dead_letters (stream_id, event_id);
create index if not exists dead_letters_batch_idx on pgstream.dead_letters (batch_id) where batch_id is not null;
create index if not exists dead_letters_open_idx on pgstream.dead_letters (stream_id, id) where status = 'open';
revoke all on pgstream.dead_letters from public;

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
    create temporary table if not exists pg_temp.pgstream_set_aside (
        event_id bigint primary key, batch_id bigint, ord integer) on commit drop;
    truncate pg_temp.pgstream_set_aside;
    insert into pg_temp.pgstream_set_aside (event_id, batch_id, ord)
    select distinct on (x.event_id) x.event_id, b.id, o.ord::integer
    from pg_catalog.unnest(p_event_ids) as x(event_id)
    join pgstream.batches b
      on b.stream_id operator(pg_catalog.=) p_stream_id and b.status not in ('delivered', 'skipped')
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

-- ---------------------------------------------------------------------------------------------
-- Status: open dead letters per stream (appended: create or replace view keeps the old columns).
create or replace view pgstream.stream_status as
select s.id,
       case when s.paused then 'paused'
            when s.recovery_pending then 'recovering'
            when s.failover_since is not null and exists (
                 select 1 from pgstream.batches b where b.stream_id = s.id and b.status = 'failed') then 'failover'
            when s.failover_since is not null then 'catching up'
            else 'healthy' end as state,
       s.paused, s.failover_since, s.failover_checkpoint_id, s.failover_checkpoint_ts, s.failover_error,
       s.failover_retry_at, s.failover_attempts, s.consumed_through, s.recovery_pending,
       o.batches as undelivered_batches, o.events as undelivered_events,
       o.oldest_event_id as oldest_undelivered_event_id, o.oldest_commit_at as oldest_undelivered_at,
       (select coalesce(sum(b.event_count), 0) from pgstream.batches b
         where b.stream_id = s.id and b.status = 'delivered'
           and b.delivered_at >= (pgstream.utc_today()::timestamp at time zone 'UTC')) as delivered_today,
       (select max(b.last_event_id) from pgstream.batches b where b.stream_id = s.id) as last_recorded_event_id,
       (select max(b.delivered_at) from pgstream.batches b where b.stream_id = s.id) as last_delivered_at,
       coalesce(s.slot_name, 'pgstream_stream_' || s.id) as slot_name,
       r.slot_name is not null as slot_exists,
       r.wal_status,
       pg_wal_lsn_diff(pg_current_wal_lsn(), r.restart_lsn)::bigint as slot_retained_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), r.confirmed_flush_lsn)::bigint as slot_lag_bytes,
       d.open as open_dead_letters,
       d.oldest as oldest_dead_letter_at
from pgstream.streams s
cross join lateral (
    select count(*) as batches, coalesce(sum(b.event_count), 0) as events,
           min(b.first_event_id) as oldest_event_id, min(b.first_commit_at) as oldest_commit_at
    from pgstream.batches b
    where b.stream_id = s.id and b.status not in ('delivered', 'skipped')) o
cross join lateral (
    select count(*) as open, min(dl.created_at) as oldest
    from pgstream.dead_letters dl
    where dl.stream_id = s.id and dl.status = 'open') d
left join pg_catalog.pg_replication_slots r
  on r.slot_name = coalesce(s.slot_name, 'pgstream_stream_' || s.id) and r.database = current_database();

revoke all on pgstream.stream_status from public;

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
        select b.stream_id, o.id, pg_catalog.bool_or(b.status not in ('delivered', 'skipped')) as open
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
-- Returns the dropped partition names. Serialised with create_partitions (013's advisory lock). A
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
    perform pg_catalog.pg_advisory_xact_lock(1885827952);
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
