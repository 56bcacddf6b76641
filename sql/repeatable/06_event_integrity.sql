-- Repeatable: event integrity. An event's id and created_at are the database's: every insert into
-- pgstream.events not made by a generated trigger (manual events, the owner's own inserts) goes
-- through pgstream._check_event(): its id is taken from the sequence and the WAL timeline (as the
-- column's default: 031_event_ids_per_timeline.sql) whatever was given, a created_at that is not the
-- insert's own clock time is refused, and so is a stream that does not exist. (Column privileges, in 014_event_integrity.sql, keep id, created_at and lsn out of reach of
-- the roles that insert events.)
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.

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
    -- a fresh id whatever was given: ids stay unique and increasing (the default's id is a gap); the
    -- column's default, the timeline in the high bits (031_event_ids_per_timeline.sql)
    new.id := pg_catalog.nextval('pgstream.events_id_seq'::pg_catalog.regclass)
              operator(pg_catalog.+) ((('x' operator(pg_catalog.||) pg_catalog.substr(
                  pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::pg_catalog.bit(32)
                  ::pg_catalog.int8 operator(pg_catalog.-) 1) operator(pg_catalog.<<) 48);
    return new;
end
$$;
revoke all on function pgstream._check_event() from public;

-- Generated triggers run as pgstream_writer and skip the check: their ids and times are the
-- defaults already.
create or replace trigger check_event
before insert on pgstream.events
for each row
when (current_user operator(pg_catalog.<>) 'pgstream_writer'::pg_catalog.name)
execute function pgstream._check_event();
