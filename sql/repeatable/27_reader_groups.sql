-- Repeatable: reader groups (sql/027_reader_groups.sql). Streams with `streams[].reader: <group>` share
-- the group's slot and publication; the group's reader (engine/ingest/group.py) decodes the WAL once and
-- records each member's transactions in its ledger. Every function here runs as the owner (a
-- publication of pgstream.events needs its owner, the stream rows are the owner's), validates its input,
-- and is granted to pgstream_runtime only (99_runtime.sql).

-- The group's slot: pgstream_g_<name>_d<database oid>_<8 hex digits of sha256(install secret, oid,
-- name)>, unique in the cluster and not to be guessed by another database's roles (as a stream's
-- default slot, 01_streams.sql); at most 63 characters (a name has at most 31). Runs as its caller:
-- the owner, or a security definer function of pgstream (only they read pgstream.install).
create or replace function pgstream.group_slot_name(p_group text)
returns text language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select 'pgstream_g_' || p_group || '_d' || d.oid::text || '_'
           || pg_catalog.left(pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
                  i.secret::text || '/' || d.oid::text || '/group/' || p_group, 'UTF8')), 'hex'), 8)
    from pgstream.install i
    join pg_catalog.pg_database d on d.datname = pg_catalog.current_database()
$$;
revoke all on function pgstream.group_slot_name(text) from public;

-- The group's publication: pgstream_group_<name>, over pgstream.events (id, payload, metadata, stream_id,
-- created_at: a group run hands what its reader records to its members' runs without reading it back),
-- insert only, through the partition root, with the row filter stream_id in (<its members>).
create or replace function pgstream.group_publication_name(p_group text)
returns text language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'pgstream_group_' || p_group $$;
revoke all on function pgstream.group_publication_name(text) from public;

-- The one prelude of the functions below, which the runtime calls: p_group is a group name, each of
-- p_stream_ids a stream id; with p_lock, the group's row (which must exist) is locked and returned.
-- Each refusal is one line naming the function and the argument.
create or replace function pgstream._group_call(p_function text, p_group text, p_stream_ids bigint[], p_lock boolean)
returns pgstream.reader_groups
language plpgsql
volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_id  bigint;
    v_row pgstream.reader_groups;
begin
    if p_group is null or p_group operator(pg_catalog.!~) '^[a-z][a-z0-9_]{0,30}$' then
        raise exception 'pgstream: %: reader group name % is not [a-z][a-z0-9_]{0,30}', p_function,
            pg_catalog.quote_nullable(p_group) using errcode = 'invalid_parameter_value';
    end if;
    foreach v_id in array p_stream_ids loop
        if v_id is null or v_id operator(pg_catalog.<=) 0 then
            raise exception 'pgstream: %: stream id must be positive, got %', p_function,
                pg_catalog.quote_nullable(v_id) using errcode = 'invalid_parameter_value';
        end if;
    end loop;
    if p_lock then
        select g.* into v_row from pgstream.reader_groups g where g.name operator(pg_catalog.=) p_group for update;
        if not found then
            raise exception 'pgstream: %: reader group % does not exist', p_function, p_group
                using errcode = 'no_data_found';
        end if;
    end if;
    return v_row;
end
$$;
revoke all on function pgstream._group_call(text, text, bigint[], boolean) from public;
drop function if exists pgstream._check_group(text);

-- Stream p_stream_id reads with group p_group: the group row is created when missing; a new stream row
-- is created as a member (slot_reader 'group:<name>', no slot of its own, joining); an existing stream without a
-- group becomes a joining member (reader_group set, its own slot still read by its old reader until
-- the group's reader hands it over: begin_join, finish_join). Moving a stream to another group is
-- refused, and so is a group whose slot name a stream reads (register_stream refuses a group's slot). A
-- new stream joins at the group's next tick too (join_lsn '0/0': nothing to drain, it records
-- from the table what it has by then). Returns the group's slot. Locks the stream row only when
-- something changes.
create or replace function pgstream.register_group_member(p_stream_id bigint, p_group text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_current text;
    v_found   boolean;
    v_slot    text;
    v_holder  bigint;
begin
    perform pgstream._group_call('register_group_member', p_group, array[p_stream_id], false);
    -- (an insert that finds the row would wait for the group's recording transaction, which updates it)
    select g.slot into v_slot from pgstream.reader_groups g where g.name operator(pg_catalog.=) p_group;
    if v_slot is null then
        v_slot := pgstream.group_slot_name(p_group);
        v_holder := pgstream.slot_holder(v_slot, 0);
        if v_holder is not null then
            raise exception 'pgstream: reader group %: its slot % is stream %''s slot', p_group, v_slot, v_holder
                using errcode = 'unique_violation';
        end if;
        insert into pgstream.reader_groups (name, slot) values (p_group, v_slot) on conflict (name) do nothing;
        select g.slot into v_slot from pgstream.reader_groups g where g.name operator(pg_catalog.=) p_group;
    end if;
    select s.reader_group, true into v_current, v_found from pgstream.streams s
     where s.id operator(pg_catalog.=) p_stream_id;
    if v_found is null then
        -- join_lsn '0/0': it joins at the group's next tick like a stream that had a slot, with nothing to
        -- drain: what it has when it joins is recorded from the table (its events of before the group's
        -- publication included it are not in the group's slot)
        insert into pgstream.streams (id, reader_group, slot_reader, join_lsn)
        values (p_stream_id, p_group, 'group:' operator(pg_catalog.||) p_group, '0/0')
        on conflict (id) do nothing;
        if found then
            return v_slot;
        end if;
        select s.reader_group into v_current from pgstream.streams s where s.id operator(pg_catalog.=) p_stream_id;
    end if;
    if v_current is null then
        update pgstream.streams set reader_group = p_group
         where id operator(pg_catalog.=) p_stream_id and reader_group is null;
    elsif v_current operator(pg_catalog.<>) p_group then
        raise exception 'pgstream: stream % reads with reader group %, not %: moving a stream to another group is not supported',
            p_stream_id, v_current, p_group using errcode = 'feature_not_supported';
    end if;
    return v_slot;
end
$$;
revoke all on function pgstream.register_group_member(bigint, text) from public;

-- The group's publication exists and its row filter names exactly the group's members (joined and
-- joining): created when missing ('created': what committed meanwhile was not decoded, the members
-- recover from the table), altered when the members changed ('altered'), else null (its columns set
-- when an earlier version's publication lacks payload and metadata: the same rows). A publication of
-- that name that is not the owner's, or publishes anything but pgstream.events, is refused (any role
-- with CREATE on the database may create one by that name before the group exists).
create or replace function pgstream.ensure_group_publication(p_group text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_members bigint[];
    v_had     bigint[];
    v_name    text := pgstream.group_publication_name(p_group);
    v_filter  text;
    v_owner   text;
    -- the group run's reader hands payload and metadata to its members' runs (engine/handoff.py)
    v_columns constant text := 'id, payload, metadata, stream_id, created_at';
begin
    v_had := (pgstream._group_call('ensure_group_publication', p_group, '{}', true)).members;
    select coalesce(pg_catalog.array_agg(s.id order by s.id), '{}') into v_members
      from pgstream.streams s where s.reader_group operator(pg_catalog.=) p_group;
    -- bigints only: nothing of the input reaches the statement but the checked group name
    v_filter := coalesce(nullif(pg_catalog.array_to_string(v_members, ', '), ''), '0');
    select pg_catalog.pg_get_userbyid(p.pubowner)::pg_catalog.text into v_owner
      from pg_catalog.pg_publication p where p.pubname operator(pg_catalog.=) v_name;
    if v_owner is null then
        execute pg_catalog.format(
            'create publication %I for table pgstream.events (%s) '
            'where (stream_id in (%s)) with (publish = %L, publish_via_partition_root = true)',
            v_name, v_columns, v_filter, 'insert');
        update pgstream.reader_groups set members = v_members, changed_xmax = pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())
         where name operator(pg_catalog.=) p_group;
        return 'created';
    end if;
    if pgstream.foreign_publication_owner(v_name) is not null then
        raise exception 'pgstream: reader group %: publication % is not the group''s (owner %, or it publishes more '
            'than pgstream.events): drop it', p_group, v_name, v_owner using errcode = 'duplicate_object';
    end if;
    if v_members operator(pg_catalog.=) v_had
       and exists (select from pg_catalog.pg_publication_tables t
                   where t.pubname operator(pg_catalog.=) v_name
                     and t.attnames operator(pg_catalog.@>) array['payload', 'metadata']::pg_catalog.name[]) then
        return null;
    end if;
    -- the members changed, or an earlier version's publication lacks payload and metadata (the same rows)
    execute pg_catalog.format('alter publication %I set table pgstream.events (%s) where (stream_id in (%s))',
                              v_name, v_columns, v_filter);
    if v_members operator(pg_catalog.=) v_had then
        return null;
    end if;
    update pgstream.reader_groups set members = v_members, changed_xmax = pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())
     where name operator(pg_catalog.=) p_group;
    return 'altered';
end
$$;
revoke all on function pgstream.ensure_group_publication(text) from public;

-- A joining member of p_group (reader_group set, its own slot still read by its old reader; or a new
-- stream, join_lsn '0/0') hands over: under the group row's and the stream row's locks, its join
-- position L is the WAL insert position now, and the group's reader becomes its declared reader (an open
-- run reading its own slot loses it: it records nothing more). Refused unless the group's publication
-- includes the stream and every transaction that was running when the publication last changed has
-- ended (changed_xmax; docs/architecture.md: the join): each of the stream's transactions that ends after
-- L is then whole in the group's slot. Returns L (again, for a stream already handing over); refused
-- for a stream of another group or one that has joined.
drop function if exists pgstream.begin_join(bigint);
create or replace function pgstream.begin_join(p_stream_id bigint, p_group text)
returns pg_lsn
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_row    pgstream.reader_groups;
    v_group  text;
    v_reader text;
    v_join   pg_lsn;
    v_now    pg_catalog.pg_snapshot := pg_catalog.pg_current_snapshot();
begin
    v_row := pgstream._group_call('begin_join', p_group, array[p_stream_id], true);
    select s.reader_group, s.slot_reader, s.join_lsn into v_group, v_reader, v_join
      from pgstream.streams s where s.id operator(pg_catalog.=) p_stream_id for update;
    if v_group is distinct from p_group then
        raise exception 'pgstream: begin_join: stream % is not a member of reader group %', p_stream_id, p_group
            using errcode = 'no_data_found';
    end if;
    if v_reader operator(pg_catalog.=) ('group:' operator(pg_catalog.||) p_group) and v_join is null then
        raise exception 'pgstream: begin_join: stream % has joined reader group % already', p_stream_id, p_group
            using errcode = 'object_not_in_prerequisite_state';
    end if;
    if v_reader operator(pg_catalog.=) ('group:' operator(pg_catalog.||) p_group)
       and v_join operator(pg_catalog.<>) '0/0'::pg_catalog.pg_lsn then
        return v_join;
    end if;
    if not (p_stream_id operator(pg_catalog.=) any (v_row.members)) then
        raise exception 'pgstream: begin_join: stream %: the publication of reader group % does not include it yet',
            p_stream_id, p_group using errcode = 'object_not_in_prerequisite_state';
    end if;
    -- the snapshot is not older than the change, and none of the transactions running then runs now
    if v_row.changed_xmax is not null
       and (pg_catalog.pg_snapshot_xmax(v_now) operator(pg_catalog.<) v_row.changed_xmax
            or exists (select 1 from pg_catalog.pg_snapshot_xip(v_now) x
                        where x operator(pg_catalog.<) v_row.changed_xmax)) then
        raise exception 'pgstream: begin_join: stream %: transactions older than the last change of reader group %''s '
            'publication are still running', p_stream_id, p_group using errcode = 'object_not_in_prerequisite_state';
    end if;
    update pgstream.streams set join_lsn = pg_catalog.pg_current_wal_insert_lsn(),
                                slot_reader = 'group:' operator(pg_catalog.||) p_group
     where id operator(pg_catalog.=) p_stream_id
    returning join_lsn into v_join;
    return v_join;
end
$$;
revoke all on function pgstream.begin_join(bigint, text) from public;

-- The member's own slot is drained up to its join position L (its confirmed position is L or later), or
-- is gone or lost (what it had was recovered from the table): it has joined. Refused before begin_join,
-- while its own slot is behind L, and for a stream of another group; nothing to do once it has joined.
drop function if exists pgstream.finish_join(bigint);
create or replace function pgstream.finish_join(p_stream_id bigint, p_group text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_group     text;
    v_reader    text;
    v_join      pg_lsn;
    v_slot      text;
    v_confirmed pg_lsn;
    v_status    text;
begin
    perform pgstream._group_call('finish_join', p_group, array[p_stream_id], false);
    select s.reader_group, s.slot_reader, s.join_lsn, s.slot into v_group, v_reader, v_join, v_slot
      from pgstream.streams s where s.id operator(pg_catalog.=) p_stream_id for update;
    if v_group is distinct from p_group then
        raise exception 'pgstream: finish_join: stream % is not a member of reader group %', p_stream_id, p_group
            using errcode = 'no_data_found';
    end if;
    if v_reader operator(pg_catalog.<>) ('group:' operator(pg_catalog.||) p_group)
       or v_join operator(pg_catalog.=) '0/0'::pg_catalog.pg_lsn then
        raise exception 'pgstream: finish_join: stream % has not begun joining reader group % (begin_join)',
            p_stream_id, p_group using errcode = 'object_not_in_prerequisite_state';
    end if;
    if v_join is null then
        return;
    end if;
    select r.confirmed_flush_lsn, r.wal_status into v_confirmed, v_status from pg_catalog.pg_replication_slots r
     where r.slot_name operator(pg_catalog.=) v_slot and r.database operator(pg_catalog.=) pg_catalog.current_database();
    if found and v_status operator(pg_catalog.<>) 'lost'
       and (v_confirmed is null or v_confirmed operator(pg_catalog.<) v_join) then
        raise exception 'pgstream: finish_join: stream %: its own slot % is at %, not drained to its join position % yet',
            p_stream_id, v_slot, coalesce(v_confirmed::pg_catalog.text, 'nothing'), v_join
            using errcode = 'object_not_in_prerequisite_state';
    end if;
    update pgstream.streams set join_lsn = null where id operator(pg_catalog.=) p_stream_id;
end
$$;
revoke all on function pgstream.finish_join(bigint, text) from public;

-- Once a member has joined, its slot_reader stays 'group:<name>': opening and closing its runs (which
-- set 'sensor' or 'run:<key>') leave it to the group's reader. And only the owner (begin_join) makes the
-- group a joining member's reader: the runtime, which may write slot_reader, would otherwise skip the
-- hand-over (its own slot's events never drained).
create or replace function pgstream._keep_group_reader()
returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if old.slot_reader operator(pg_catalog.~~) 'group:%'
       and new.reader_group is not distinct from old.reader_group
       and new.slot_reader operator(pg_catalog.!~~) 'group:%' then
        new.slot_reader := old.slot_reader;
    end if;
    if new.slot_reader operator(pg_catalog.~~) 'group:%'
       and new.slot_reader is distinct from old.slot_reader
       and current_user operator(pg_catalog.<>) (select pg_catalog.pg_get_userbyid(c.relowner)
                                                   from pg_catalog.pg_class c where c.oid operator(pg_catalog.=) tg_relid) then
        raise exception 'pgstream: stream %: only pgstream.begin_join hands a stream over to its reader group', new.id
            using errcode = 'insufficient_privilege';
    end if;
    return new;
end
$$;
revoke all on function pgstream._keep_group_reader() from public;

create or replace trigger keep_group_reader before update of slot_reader on pgstream.streams
for each row execute function pgstream._keep_group_reader();

-- The group's publication goes with its row.
create or replace function pgstream._drop_group_publication()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    execute pg_catalog.format('drop publication if exists %I', pgstream.group_publication_name(old.name));
    return old;
end
$$;
revoke all on function pgstream._drop_group_publication() from public;

create or replace trigger drop_group_publication after delete on pgstream.reader_groups
for each row execute function pgstream._drop_group_publication();
