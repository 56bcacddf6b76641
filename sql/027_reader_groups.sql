-- 027: reader groups. Streams configured with `streams[].reader: <group>` share one replication slot
-- and one publication (the group's): the WAL is decoded once for all of them, by the group's reader,
-- which records each member's transactions in that stream's ledger. The functions are in
-- repeatable/27_reader_groups.sql; who may do what in repeatable/99_runtime.sql.
--
-- pgstream.reader_groups: one row per group: its slot (derived like a stream's default slot, unique in
-- the cluster: pgstream.group_slot_name), recovery_pending (its slot was lost: each member recovers from
-- the table), consumed_through (every commit before it was read from the group's slot), recorded_through
-- (the end LSN of the last transaction the group's reader recorded, written in the same transaction)
-- and the members its publication's row filter was last set for.
--
-- pgstream.streams.reader_group: the group a stream belongs to (set by pgstream.register_group_member
-- only). join_lsn: while a stream that had its own slot joins, the position L up to which its own slot
-- is drained (transactions with end_lsn <= L from its own slot, the later ones from the group's).
-- slot_reader of a member is 'group:<name>' (the constraint below), once it has joined.

create table if not exists pgstream.reader_groups (
    name             text primary key check (name ~ '^[a-z][a-z0-9_]{0,30}$'),
    slot             text not null unique,
    recovery_pending boolean not null default false,
    consumed_through timestamptz,
    recorded_through pg_lsn,
    members          bigint[] not null default '{}',
    created_at       timestamptz not null default now()
);
revoke all on pgstream.reader_groups from public;

alter table pgstream.streams add column if not exists reader_group text
    references pgstream.reader_groups (name);
alter table pgstream.streams add column if not exists join_lsn pg_lsn;
create index if not exists streams_reader_group_idx on pgstream.streams (reader_group);

alter table pgstream.streams drop constraint if exists streams_slot_reader_check;
alter table pgstream.streams add constraint streams_slot_reader_check
    check (slot_reader = 'sensor'
           or (open_run_key is not null and slot_reader = 'run:' || open_run_key)
           or (reader_group is not null and slot_reader = 'group:' || reader_group));
