-- 022: partition maintenance never holds application writes back for more than a moment, and a
-- stream's default replication slot name is unique in the cluster.
--
-- Partitions (repeatable/03_partitions.sql): create_partitions and drop_partitions gained lock
-- arguments (p_lock_timeout_ms, p_lock_attempts), so the forms without them go; a housekeeping
-- pass records the partitions it could not drop because their locks were held (partitions_busy).
drop function if exists pgstream.create_partitions(integer, date);
drop function if exists pgstream.drop_partitions(integer, date, text);
alter table pgstream.housekeeping_runs add column if not exists partitions_busy integer not null default 0;

-- Default slot names. Replication slots are the cluster's, not a database's: two installs of one
-- cluster that both had a stream 77 both wanted slot pgstream_stream_77, and a role of one
-- database allowed to create slots could take the other's names in advance. A stream's default slot
-- is now derived (pgstream.default_slot_name, repeatable/01_streams.sql) from its id, the
-- database's oid (unique in the cluster, kept by ALTER DATABASE ... RENAME) and a secret of this
-- install (pgstream.install, readable by the owner only): pgstream_stream_<id>_d<oid>_<12 hex>.
-- It is stored in streams.default_slot when the row is created; streams.slot is the slot the
-- stream reads (slot_name if set, else default_slot), unique (streams_slot_key).
create table if not exists pgstream.install (
    singleton  boolean primary key default true check (singleton),
    secret     uuid not null default pg_catalog.gen_random_uuid(),
    created_at timestamp with time zone not null default pg_catalog.now()
);
revoke all on pgstream.install from public;
comment on table pgstream.install is
    'One row: this install''s secret, from which default replication slot names are derived '
    '(pgstream.default_slot_name). Owner only.';
insert into pgstream.install default values on conflict do nothing;

alter table pgstream.streams add column if not exists default_slot text;
-- An existing stream whose slot (the old default name, pgstream_stream_<id>) exists in this database
-- keeps it: an upgrade neither loses nor repeats an event. The others get the new default name
-- (repeatable/01_streams.sql fills the rows left null here).
-- (not an edit of the stream: updated_at stays; on a fresh install the trigger comes later, with
-- repeatable/01_streams.sql, and there are no rows)
do $$
declare
    v_touch boolean := exists (select 1 from pg_catalog.pg_trigger
                               where tgrelid operator(pg_catalog.=) 'pgstream.streams'::pg_catalog.regclass
                                 and tgname operator(pg_catalog.=) 'touch_updated_at');
begin
    if v_touch then
        alter table pgstream.streams disable trigger touch_updated_at;
    end if;
    update pgstream.streams s
       set default_slot = 'pgstream_stream_' operator(pg_catalog.||) s.id::pg_catalog.text
     where s.default_slot is null
       and exists (select 1 from pg_catalog.pg_replication_slots r
                   where r.slot_name::pg_catalog.text operator(pg_catalog.=)
                         ('pgstream_stream_' operator(pg_catalog.||) s.id::pg_catalog.text)
                     and r.database operator(pg_catalog.=) pg_catalog.current_database());
    if v_touch then
        alter table pgstream.streams enable trigger touch_updated_at;
    end if;
end
$$;
alter table pgstream.streams add column if not exists slot text
    generated always as (coalesce(slot_name, default_slot)) stored;
comment on column pgstream.streams.slot is
    'The replication slot the stream reads: slot_name if set, else default_slot (unique: streams_slot_key).';
drop index if exists pgstream.streams_slot_key;
create unique index streams_slot_key on pgstream.streams (slot);
