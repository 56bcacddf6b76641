-- Repeatable: streams. The publication that follows each pgstream.streams row, updated_at, and
-- the stream a subscription creates (one slot, one stream).
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent (create or
-- replace, followed by the function's privileges, which a replace keeps and a first create sets).

-- ---------------------------------------------------------------------------------------------
-- Two publications per stream, both insert-only, published through the partition root and
-- filtered on the stream's id; a slot is not tied to a publication, each read names the one it
-- decodes with:
-- * pgstream_stream_<id> carries only what the sensor reads: the event id and created_at (and
--   stream_id, the row filter's column). The sensor peeks and advances (each decodes the WAL
--   again) and records ids; the delivery run loads payloads from the table, so its decoding never
--   turns a payload into text for nothing.
-- * pgstream_stream_<id>_rows carries the whole event (every column but lsn) for an open run's
--   reader: it decodes each transaction once over the replication protocol, records the ids and
--   delivers the rows it decoded without reading them back from pgstream.events.
-- Created when a streams row appears, dropped when it goes.
create or replace function pgstream.publication_name(p_stream_id bigint)
returns text language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'pgstream_stream_' || p_stream_id $$;
revoke all on function pgstream.publication_name(bigint) from public;

create or replace function pgstream.rows_publication_name(p_stream_id bigint)
returns text language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'pgstream_stream_' || p_stream_id || '_rows' $$;
revoke all on function pgstream.rows_publication_name(bigint) from public;

-- Who owns publication p_name when it is not one of pgstream's (a role with CREATE on the database may
-- create a publication by a stream's or a group's name before pgstream does, for its own tables): its
-- owner's name when it is another role's, or publishes anything but pgstream.events (all tables, a
-- schema, another table); null when it is pgstream's own or does not exist.
create or replace function pgstream.foreign_publication_owner(p_name text)
returns text
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.pg_get_userbyid(p.pubowner)::pg_catalog.text
      from pg_catalog.pg_publication p
     where p.pubname operator(pg_catalog.=) p_name
       and (p.pubowner operator(pg_catalog.<>) (select r.oid from pg_catalog.pg_roles r
                                                 where r.rolname operator(pg_catalog.=) current_user)
            or p.puballtables
            or exists (select 1 from pg_catalog.pg_publication_namespace n
                        where n.pnpubid operator(pg_catalog.=) p.oid)
            or exists (select 1 from pg_catalog.pg_publication_rel r
                        where r.prpubid operator(pg_catalog.=) p.oid
                          and r.prrelid operator(pg_catalog.<>) 'pgstream.events'::pg_catalog.regclass))
$$;
revoke all on function pgstream.foreign_publication_owner(text) from public;

-- The stream's publications that are missing, created; returns their names. A publication by one of
-- their names that is not pgstream's (pgstream.foreign_publication_owner) is refused, naming it: the
-- slot would decode another role's tables under the stream's name, and none of the stream's events. Called by the trigger
-- below, and by the sensor each tick (engine/ingest.py ensure_slot): a publication dropped by hand
-- would make logical decoding skip the stream's events without an error (Postgres 18 warns
-- "skipped loading publication" and sends nothing), so the sensor puts it back and recovers from
-- the table what was committed meanwhile. Runs as the owner (a publication of pgstream.events needs
-- its owner), for streams that exist only: the runtime role calls it (99_runtime.sql).
create or replace function pgstream.ensure_publications(p_stream_id bigint)
returns setof text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name    text;
    v_columns text;  -- constants below, never input
    v_owner   text;
begin
    if not exists (select 1 from pgstream.streams s where s.id operator(pg_catalog.=) p_stream_id) then
        raise exception 'pgstream: stream % does not exist: no publication is created for it', p_stream_id
            using errcode = 'no_data_found';
    end if;
    for v_name, v_columns in
        values (pgstream.publication_name(p_stream_id), 'id, stream_id, created_at'),
               (pgstream.rows_publication_name(p_stream_id), 'id, payload, metadata, stream_id, created_at')
    loop
        v_owner := pgstream.foreign_publication_owner(v_name);
        if v_owner is not null then
            raise exception 'pgstream: stream %: publication % is not the stream''s (owner %, or it publishes more '
                'than pgstream.events): drop it', p_stream_id, v_name, v_owner using errcode = 'duplicate_object';
        end if;
        if not exists (select 1 from pg_catalog.pg_publication p where p.pubname operator(pg_catalog.=) v_name) then
            execute pg_catalog.format(
                'create publication %I for table pgstream.events (%s) '
                'where (stream_id = %s) with (publish = %L, publish_via_partition_root = true)',
                v_name, v_columns, p_stream_id, 'insert');
            return next v_name;
        end if;
    end loop;
end
$$;
revoke all on function pgstream.ensure_publications(bigint) from public;

create or replace function pgstream._sync_publication()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if tg_op = 'INSERT' then
        perform pgstream.ensure_publications(new.id);
        return new;
    end if;
    execute format('drop publication if exists %I', pgstream.publication_name(old.id));
    execute format('drop publication if exists %I', pgstream.rows_publication_name(old.id));
    return old;
end
$$;
revoke all on function pgstream._sync_publication() from public;

create or replace trigger sync_publication
after insert or delete on pgstream.streams
for each row execute function pgstream._sync_publication();

create or replace function pgstream._touch_updated_at()
returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if new.default_slot is distinct from old.default_slot
       and (pg_catalog.to_jsonb(new) operator(pg_catalog.-) 'default_slot'::text operator(pg_catalog.-) 'slot'::text)
           operator(pg_catalog.=)
           (pg_catalog.to_jsonb(old) operator(pg_catalog.-) 'default_slot'::text operator(pg_catalog.-) 'slot'::text) then
        return new;  -- a default slot name derived again (pgstream.stream_slot, the migration): not an edit
    end if;
    new.updated_at := now();
    return new;
end
$$;
revoke all on function pgstream._touch_updated_at() from public;

create or replace trigger touch_updated_at before update on pgstream.streams
for each row execute function pgstream._touch_updated_at();

-- ---------------------------------------------------------------------------------------------
-- Default slot names (sql/022_lock_timeouts_and_slot_names.sql). Slots are the cluster's: a stream's
-- default slot is pgstream_stream_<id>_d<database oid>_<12 hex digits of sha256(install secret, oid,
-- id)>. Unique in the cluster (the oid), the same after ALTER DATABASE ... RENAME (the oid stays),
-- and not to be guessed by a role of another database that may create slots (the secret is in
-- pgstream.install, which only the owner reads): once a slot exists its name is visible
-- cluster-wide, but not the names of the streams to come. A database restored by pg_dump, or copied
-- with CREATE DATABASE ... TEMPLATE, has another oid: its streams' defaults are derived again on
-- first use (pgstream.stream_slot), and their slots created there. A stream from before 022 whose
-- slot pgstream_stream_<id> existed keeps it (the migration stored it as its default_slot).

-- What every default slot name matches, old form (pgstream_stream_<id>) and new, and a reader group's
-- slot (pgstream_g_<name>_d<oid>_<8 hex>, 27_reader_groups.sql): the orphaned_slots view and tear-down
-- recognise pgstream's slots by it.
create or replace function pgstream.default_slot_pattern()
returns text language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select '^(pgstream_stream_[0-9]+(_d[0-9]+_[0-9a-f]{12})?|pgstream_g_[a-z][a-z0-9_]{0,30}_d[0-9]+_[0-9a-f]{8})$'::text $$;
-- a constant: the roles that may read the orphaned_slots view (or the metrics) need it
grant execute on function pgstream.default_slot_pattern() to public;

-- The default slot name of stream p_stream_id in this database (see above). Runs as its caller:
-- the owner, or a security definer function of pgstream (only they read pgstream.install).
create or replace function pgstream.default_slot_name(p_stream_id bigint)
returns text language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select 'pgstream_stream_' || p_stream_id::text || '_d' || d.oid::text || '_'
           || pg_catalog.left(pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
                  i.secret::text || '/' || d.oid::text || '/' || p_stream_id::text, 'UTF8')), 'hex'), 12)
    from pgstream.install i
    join pg_catalog.pg_database d on d.datname = pg_catalog.current_database()
$$;
revoke all on function pgstream.default_slot_name(bigint) from public;

-- A new stream row gets its default slot name; nobody chooses it (slot_name does that).
create or replace function pgstream._default_slot()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    new.default_slot := pgstream.default_slot_name(new.id);
    return new;
end
$$;
revoke all on function pgstream._default_slot() from public;

create or replace trigger default_slot before insert on pgstream.streams
for each row execute function pgstream._default_slot();

-- The rows the migration left without a default (their old slot did not exist): the new name.
update pgstream.streams set default_slot = pgstream.default_slot_name(id) where default_slot is null;

-- The slot stream p_stream_id reads (streams.slot; a reader group's slot once it has joined one), or the
-- default a new row would get. A default
-- derived in another database (the row came with pg_dump or a template copy; that database's slot
-- is not this one's) is derived again first.
create or replace function pgstream.stream_slot(p_stream_id bigint)
returns text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_default text;
    v_ours    text := pgstream.default_slot_name(p_stream_id);
    v_slot    text;
begin
    select s.default_slot, s.slot into v_default, v_slot from pgstream.streams s where s.id = p_stream_id;
    if not found then
        return v_ours;
    end if;
    if v_default ~ '_d[0-9]+_[0-9a-f]{12}$' and v_default <> v_ours then
        update pgstream.streams set default_slot = v_ours where id = p_stream_id
        returning slot into v_slot;
    end if;
    -- a stream of a reader group that has joined reads the group's slot (27_reader_groups.sql); while it
    -- joins, its own
    return coalesce((select g.slot from pgstream.streams s join pgstream.reader_groups g on g.name = s.reader_group
                     where s.id = p_stream_id and s.slot_reader = 'group:' || s.reader_group
                       and s.join_lsn is null), v_slot);
end
$$;
revoke all on function pgstream.stream_slot(bigint) from public;

-- ---------------------------------------------------------------------------------------------
-- One slot, one stream (the unique index streams_slot_key is in 013_collisions.sql).

-- The stream that holds a slot name, other than p_stream_id (null if none). Runs as its caller:
-- the owner, or ensure_stream.
create or replace function pgstream.slot_holder(p_slot text, p_stream_id bigint)
returns bigint
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select s.id from pgstream.streams s
    where s.slot = p_slot and s.id <> p_stream_id
    order by s.id
    limit 1
$$;
revoke all on function pgstream.slot_holder(text, bigint) from public;

-- A subscription for a stream that has no row yet creates the row (and so its publication), with
-- the default slot name: refused, naming the stream, when another stream already reads that slot.
create or replace function pgstream.ensure_stream(p_stream_id bigint)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_slot   text := pgstream.default_slot_name(p_stream_id);
    v_holder bigint;
begin
    if exists (select 1 from pgstream.streams where id = p_stream_id) then
        return;
    end if;
    v_holder := pgstream.slot_holder(v_slot, p_stream_id);
    if v_holder is not null then
        raise exception 'pgstream: stream %: slot % is already used by stream %', p_stream_id, v_slot, v_holder
            using errcode = 'unique_violation', constraint = 'streams_slot_key',
                  hint = pg_catalog.format('A slot belongs to one stream. Give stream %s another slot_name, or '
                                           'delete stream %s if it is no longer used.', v_holder, v_holder);
    end if;
    insert into pgstream.streams (id) values (p_stream_id) on conflict (id) do nothing;
end
$$;
revoke all on function pgstream.ensure_stream(bigint) from public;

-- The stream row for stream p_stream_id reading slot p_slot (null: its default slot): created when
-- missing (and so its publications), its slot_name set when it differs. The owner's only (the runtime
-- registers a stream through register_group_member): a stream reading a slot of its own, as a release
-- before reader groups made it. A slot another stream reads is refused
-- (unique_violation on streams_slot_key, which the caller names), and so is a reader group's slot
-- (reader_groups_slot_key).
create or replace function pgstream.register_stream(p_stream_id bigint, p_slot text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_stream_id is null or p_stream_id operator(pg_catalog.<=) 0 then
        raise exception 'pgstream: register_stream: stream id must be positive, got %', p_stream_id
            using errcode = 'invalid_parameter_value';
    end if;
    if p_slot operator(pg_catalog.!~) '^[a-z0-9_]{1,63}$' then
        raise exception 'pgstream: register_stream: stream %: slot name % is not [a-z0-9_]{1,63}', p_stream_id,
            pg_catalog.quote_nullable(p_slot) using errcode = 'invalid_parameter_value';
    end if;
    -- a reader group's slot (each reader would advance it past the other's events)
    if exists (select 1 from pgstream.reader_groups g where g.slot operator(pg_catalog.=) p_slot) then
        raise exception 'pgstream: register_stream: stream %: slot % is the slot of reader group %', p_stream_id, p_slot,
            (select g.name from pgstream.reader_groups g where g.slot operator(pg_catalog.=) p_slot)
            using errcode = 'unique_violation', constraint = 'reader_groups_slot_key';
    end if;
    if exists (select 1 from pgstream.streams s where s.id operator(pg_catalog.=) p_stream_id
               and s.reader_group is not null) then
        raise exception 'pgstream: stream % reads with reader group %: leaving a group is not supported (keep its streams[].reader)',
            p_stream_id, (select s.reader_group from pgstream.streams s where s.id operator(pg_catalog.=) p_stream_id)
            using errcode = 'feature_not_supported';
    end if;
    -- neither statement locks the row when nothing changes (a run may hold its lock); a null slot is
    -- the stream's default (streams.default_slot)
    if p_slot is null then
        perform pgstream.ensure_stream(p_stream_id);
    else
        insert into pgstream.streams (id, slot_name) values (p_stream_id, p_slot) on conflict (id) do nothing;
    end if;
    update pgstream.streams set slot_name = p_slot
    where id operator(pg_catalog.=) p_stream_id and slot_name is distinct from p_slot;
end
$$;
revoke all on function pgstream.register_stream(bigint, text) from public;
