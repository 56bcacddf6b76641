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
--
-- This version sets the column privileges and creates pgstream.dead_letters. The check on every
-- insert (pgstream._check_event and its trigger) is in repeatable/06_event_integrity.sql, the dead
-- letter functions in repeatable/07_dead_letters.sql, the open dead letters of stream_status in
-- repeatable/08_status.sql and retention in repeatable/03_partitions.sql.

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
