-- 020: pgstream's own locks, in a table only the owner can write, instead of advisory locks.
-- Any role that can connect can take any advisory lock and hold it: it could stall a stream's
-- delivery (the lease), its slot reader (the sensor stops peeking), a redelivery, a backfill,
-- partition maintenance or trigger regeneration. A row of pgstream.locks is held by the backend it
-- names (pid, session role and backend_start, so a reused pid is not mistaken for it) while that backend lives, or
-- locked for one transaction (FOR UPDATE); nobody without privileges on the table can do either.
-- The functions that take them are in repeatable/00_locks.sql.
create table if not exists pgstream.locks (
    name          text                     not null,
    key           bigint                   not null default 0,
    pid           integer,
    backend_start timestamp with time zone,
    usesysid      oid,
    holder        text,
    taken_at      timestamp with time zone,
    primary key (name, key),
    check ((pid is null) = (backend_start is null) and (pid is null) = (usesysid is null))
);
revoke all on pgstream.locks from public;
comment on table pgstream.locks is
    'pgstream''s own locks (repeatable/00_locks.sql): a row is held by the live backend it names, or '
    'locked FOR UPDATE for one transaction. Owner only.';

insert into pgstream.locks (name, key) values ('partitions', 0), ('regenerate', 0)
on conflict do nothing;
