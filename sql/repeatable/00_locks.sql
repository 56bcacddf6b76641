-- Repeatable: pgstream's own locks (table pgstream.locks, sql/020_locks.sql).
--
-- Advisory locks are open to every role that can connect: an application role could take
-- pgstream's keys and hold them, and stall a stream. These locks are rows of a table only the owner
-- can write, so only the roles that run pgstream can take them. Two kinds:
--   * held by a session (try_lock / unlock / lock_holder): the row names the backend holding it (pid,
--     session role and backend_start); it is free again once that backend has ended, however it ended, like a
--     session advisory lock, and no transaction stays open meanwhile (nothing holds back vacuum);
--   * held for one transaction (lock_for_transaction): the row locked FOR UPDATE, released at commit
--     or rollback.
-- None of these is security definer: they run as their caller (the owner, or a security definer
-- function of pgstream), and every other role lacks the privileges on pgstream.locks.

-- Whether the backend p_pid of role p_role, started at p_started, is still running. A backend of
-- another role than the caller's hides its backend_start (pg_stat_activity): one with that pid and
-- role counts as alive then (a holder connected as another role of pgstream's: never taken over
-- while it may live); a backend of any other role with that pid (a reused pid) is not the holder.
-- pg_stat_get_activity(pid) reads that one backend's entry (pg_stat_activity reads every backend's:
-- a cost that grew with connections, paid per lock checked).
create or replace function pgstream.backend_alive(p_pid integer, p_started timestamptz, p_role oid)
returns boolean
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select 1 from pg_catalog.pg_stat_get_activity(p_pid) a
                   where a.pid = p_pid and a.usesysid = p_role
                     and (a.backend_start = p_started or a.backend_start is null))
$$;
revoke all on function pgstream.backend_alive(integer, timestamptz, oid) from public;

-- Take lock (p_name, p_key) for this session, naming p_holder: true when taken (or this session
-- held it already), false when a live backend holds it. It is free once unlock() is called or the
-- session ends.
create or replace function pgstream.try_lock(p_name text, p_key bigint, p_holder text default null)
returns boolean
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    with me as (
        select a.pid, a.backend_start, a.usesysid
        from pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a
    ), taken as (
        insert into pgstream.locks as l (name, key, pid, backend_start, usesysid, holder, taken_at)
        select p_name, p_key, me.pid, me.backend_start, me.usesysid, p_holder, pg_catalog.clock_timestamp() from me
        on conflict (name, key) do update
            set pid = excluded.pid, backend_start = excluded.backend_start, usesysid = excluded.usesysid,
                holder = excluded.holder, taken_at = excluded.taken_at
            where l.pid is null
               or (l.pid = excluded.pid and l.backend_start = excluded.backend_start)
               or not pgstream.backend_alive(l.pid, l.backend_start, l.usesysid)
        returning 1
    )
    select exists (select 1 from taken)
$$;
revoke all on function pgstream.try_lock(text, bigint, text) from public;

-- Give lock (p_name, p_key) up if this session holds it: true when it did. A row naming this pid
-- but an earlier backend (a reused pid) holds nothing already: clearing it changes nothing.
create or replace function pgstream.unlock(p_name text, p_key bigint)
returns boolean
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    with freed as (
        update pgstream.locks l
        set pid = null, backend_start = null, usesysid = null, holder = null, taken_at = null
        where l.name = p_name and l.key = p_key and l.pid = pg_catalog.pg_backend_pid()
        returning 1
    )
    select exists (select 1 from freed)
$$;
revoke all on function pgstream.unlock(text, bigint) from public;

-- Who holds lock (p_name, p_key): its holder's name ('' when it gave none), or null when free.
create or replace function pgstream.lock_holder(p_name text, p_key bigint)
returns text
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(l.holder, '') from pgstream.locks l
    where l.name = p_name and l.key = p_key and l.pid is not null
      and pgstream.backend_alive(l.pid, l.backend_start, l.usesysid)
$$;
revoke all on function pgstream.lock_holder(text, bigint) from public;

-- Lock p_name (key 0) until this transaction ends: callers of one name run one at a time, each
-- seeing what the previous one committed.
create or replace function pgstream.lock_for_transaction(p_name text)
returns void
language plpgsql
volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    loop
        perform 1 from pgstream.locks l where l.name = p_name and l.key = 0 for update;
        exit when found;
        insert into pgstream.locks (name, key) values (p_name, 0) on conflict do nothing;
    end loop;
end
$$;
revoke all on function pgstream.lock_for_transaction(text) from public;
