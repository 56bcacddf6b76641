-- Repeatable: the schema-drift guard. Policy: REFUSE. DDL that would make a generated trigger
-- fail at commit time or silently stop publishing is rolled back with an error that names the
-- subscriptions in the way:
--   * DROP TABLE / DROP SCHEMA / DROP OWNED of a subscribed table;
--   * dropping, renaming or retyping a column a subscription uses (column_names, when_clause,
--     payload and metadata extension expressions), and changing the type of a column_names column;
--   * renaming or moving a subscribed table or its schema;
--   * dropping, renaming or disabling a generated trigger (a partition's copies included: a trigger
--     is pgstream's when it calls a generated function, not by its name), dropping, replacing or
--     altering a generated function;
--   * attaching or creating a partition of a subscribed partitioned table that carries a trigger of
--     its own under a generated trigger's name;
--   * detaching a partition that holds rows, or dropping a partition, of a table with DELETE
--     subscriptions that take no TRUNCATE events (emit_truncate); with the opt-in it is the
--     partition's TRUNCATE event (the ddl_command_start trigger notes, before each command, which
--     tables are such partitions: once dropped they are gone from the catalog);
--   * creating, replacing, altering (SECURITY INVOKER, SET, OWNER TO, RENAME) or dropping any
--     function in schema pgstream, whoever owns it, outside pgstream's own DDL (internal DDL: trigger
--     regeneration, and every file `pgstream-dagster migrate` applies): code that runs as
--     pgstream_writer, which owns the generated functions, can change nothing the owner executes.
-- Change or delete the subscriptions first, then run the DDL. There is no session-settable bypass:
-- pgstream's own DDL (trigger regeneration) marks its transaction in pgstream.internal_ddl, a table
-- only the owner can write. A stale subscription (its table gone while the guard was off) does not
-- block DDL on other tables. Event triggers need superuser: without it the guard is not installed,
-- with a warning.
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.

-- The subscriptions of one table, for messages.
create or replace function pgstream._drift_subscription_list(p_schema text, p_table text)
returns text
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.string_agg(pg_catalog.format('"%s" (stream %s, %s)', key, stream_id, operation),
                                 ', ' order by stream_id, key)
    from pgstream.subscriptions where schema_name = p_schema and table_name = p_table
$$;
revoke all on function pgstream._drift_subscription_list(text, text) from public;

-- Why the generated triggers of one table no longer serve its subscriptions, or null: each
-- (operation, mode) that has subscriptions needs its trigger, enabled, calling its function. A
-- partition of a subscribed partitioned table needs the same triggers as the table.
create or replace function pgstream._drift_trigger_problem(p_rel pg_catalog.oid)
returns text
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format('the generated trigger %I of %s on %s %s',
                             pgstream.trigger_name(w.operation, w.trigger_mode), w.operation,
                             p_rel::pg_catalog.regclass,
                             case when t.oid is null then 'would be missing (dropped or renamed)'
                                  when t.tgenabled not in ('O', 'A') then 'would be disabled'
                                  else 'would call another function' end)
    from (select p_rel as relid
          union select a.relid from pg_catalog.pg_partition_ancestors(p_rel::pg_catalog.regclass) a) r
    join pg_catalog.pg_class c on c.oid = r.relid
    join pg_catalog.pg_namespace n on n.oid = c.relnamespace
    cross join lateral pgstream._trigger_modes(n.nspname, c.relname) as w(operation, trigger_mode)
    left join pg_catalog.pg_trigger t
      on t.tgrelid = p_rel and t.tgname = pgstream.trigger_name(w.operation, w.trigger_mode)
    where t.oid is null or t.tgenabled not in ('O', 'A')
          or t.tgfoid is distinct from pg_catalog.to_regprocedure(pg_catalog.format('pgstream.%I()',
                 pgstream.trigger_function_name(n.nspname, c.relname, w.operation, w.trigger_mode)))
    order by w.operation, w.trigger_mode
    limit 1
$$;
revoke all on function pgstream._drift_trigger_problem(oid) from public;

-- Revalidates every subscription on one table and checks its generated triggers and the types of
-- its published columns; raises, naming the subscriptions, if any no longer holds.
create or replace function pgstream._drift_check_table(p_schema text, p_table text, p_what text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_sub   pgstream.subscriptions;
    v_msg   text;
    v_rel   pg_catalog.oid := pgstream._relid(p_schema, p_table);
    v_col   record;
begin
    if v_rel is null or not exists (select 1 from pgstream.subscriptions
                                    where schema_name = p_schema and table_name = p_table) then
        return;
    end if;
    for v_sub in
        select * from pgstream.subscriptions
        where schema_name = p_schema and table_name = p_table
        order by stream_id, key
    loop
        begin
            perform pgstream.validate_subscription(v_sub);
        exception when others then
            get stacked diagnostics v_msg = message_text;
            raise exception 'pgstream: refusing % because it breaks a subscription. %', p_what, v_msg
                using errcode = 'dependent_objects_still_exist',
                      hint = 'Update or delete the subscription first (pgstream.subscriptions / set_subscriptions), then repeat the DDL.';
        end;
    end loop;
    select sc.column_name, sc.type_oid::pg_catalog.regtype as was, a.atttypid::pg_catalog.regtype as now
    into v_col
    from pgstream.subscribed_columns sc
    join pg_catalog.pg_attribute a on a.attrelid = v_rel and a.attname = sc.column_name
                                  and a.attnum > 0 and not a.attisdropped
    where sc.schema_name = p_schema and sc.table_name = p_table
      and (a.atttypid <> sc.type_oid or a.atttypmod <> sc.typmod)
    order by 1
    limit 1;
    if found then
        raise exception 'pgstream: refusing %: column % of %.% is published by subscriptions % and its type would change (% to %)',
            p_what, pg_catalog.quote_ident(v_col.column_name), pg_catalog.quote_ident(p_schema),
            pg_catalog.quote_ident(p_table), pgstream._drift_subscription_list(p_schema, p_table), v_col.was, v_col.now
            using errcode = 'dependent_objects_still_exist',
                  hint = 'Remove the column from the subscriptions'' column_names first, then repeat the DDL.';
    end if;
    v_msg := pgstream._drift_trigger_problem(v_rel);
    if v_msg is not null then
        raise exception 'pgstream: refusing %: % and subscriptions % would silently stop producing events',
            p_what, v_msg, pgstream._drift_subscription_list(p_schema, p_table)
            using errcode = 'dependent_objects_still_exist',
                  hint = 'Delete or change the subscriptions instead; the trigger follows them.';
    end if;
end
$$;
revoke all on function pgstream._drift_check_table(text, text, text) from public;

-- A table that carries generated triggers but whose name no longer matches a subscription was
-- renamed or moved (itself or its schema).
create or replace function pgstream._drift_check_renamed(p_rel pg_catalog.oid, p_what text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_old record;
begin
    select s.schema_name, s.table_name into v_old
    from pg_catalog.pg_trigger t
    join pg_catalog.pg_proc p on p.oid = t.tgfoid
    join pg_catalog.pg_class c on c.oid = t.tgrelid
    join pg_catalog.pg_namespace n on n.oid = c.relnamespace
    join pgstream.subscriptions s
      on pgstream.trigger_function_name(s.schema_name, s.table_name, s.operation, s.trigger_mode) = p.proname
    where t.tgrelid = p_rel and p.pronamespace = 'pgstream'::pg_catalog.regnamespace
      and (s.schema_name <> n.nspname::text or s.table_name <> c.relname::text)
      -- a partition carries the triggers of the partitioned table it belongs to
      and not exists (select 1 from pg_catalog.pg_partition_ancestors(p_rel::pg_catalog.regclass) a
                      where a.relid = pgstream._relid(s.schema_name, s.table_name))
    order by 1, 2
    limit 1;
    if found then
        raise exception 'pgstream: refusing %: table %.% is subscribed by %', p_what,
            pg_catalog.quote_ident(v_old.schema_name), pg_catalog.quote_ident(v_old.table_name),
            pgstream._drift_subscription_list(v_old.schema_name, v_old.table_name)
            using errcode = 'dependent_objects_still_exist',
                  hint = 'Update or delete the subscriptions first, then repeat the DDL.';
    end if;
end
$$;
revoke all on function pgstream._drift_check_renamed(oid, text) from public;

-- A partition leaves the tree of p_schema.p_table, a table with DELETE subscriptions, with its rows
-- (DETACH PARTITION of one that holds rows, p_dropped false; DROP of one, p_dropped true: its rows
-- cannot be counted any more): for its DELETE subscribers that is its TRUNCATE. Refused, naming
-- them, when one has not opted in (emit_truncate), like the TRUNCATE; else each gets the event its
-- TRUNCATE would write (tg_op 'TRUNCATE', named after the partition, the static metadata).
create or replace function pgstream._drift_partition_removed(
    p_schema text, p_table text, p_part_schema text, p_part text, p_what text, p_dropped boolean
)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_refused text;
    v_root    text := pg_catalog.format('%I.%I', p_schema, p_table);
    v_part    text := pg_catalog.format('%I.%I', p_part_schema, p_part);
begin
    select pg_catalog.string_agg(pg_catalog.format('"%s" (stream %s)', s.key, s.stream_id), ', '
                                 order by s.stream_id, s.key, s.id) filter (where not s.emit_truncate)
    into v_refused
    from pgstream.subscriptions s
    where s.schema_name = p_schema and s.table_name = p_table and s.operation = 'DELETE';
    if v_refused is not null then
        raise exception 'pgstream: refusing %: % is a partition of % %, and DELETE subscriptions % of % take no TRUNCATE events (emit_truncate) and would silently keep its rows',
            p_what, v_part, v_root, case when p_dropped then '(its rows go with it)' else 'that holds rows' end,
            v_refused, v_root
            using errcode = 'object_not_in_prerequisite_state',
                  hint = case when p_dropped
                              then pg_catalog.format('Delete its rows and detach it (ALTER TABLE %s DETACH PARTITION %s) before dropping it, '
                                                     'or set emit_truncate = true on those subscriptions to send them a TRUNCATE event of it.',
                                                     v_root, v_part)
                              else 'Delete its rows first, or set emit_truncate = true on those subscriptions to send them a TRUNCATE event of it.' end;
    end if;
    insert into pgstream.events (payload, stream_id, metadata)
    select pg_catalog.jsonb_build_object('tg_name', s.key, 'tg_op', 'TRUNCATE', 'tg_table_name', p_part,
                                         'tg_table_schema', p_part_schema,
                                         'timestamp', (pg_catalog.extract('epoch'::text, pg_catalog.now()) operator(pg_catalog.*) 1000::pg_catalog.numeric)::pg_catalog.int8,
                                         'new', null::pg_catalog.jsonb, 'old', null::pg_catalog.jsonb),
           s.stream_id, s.metadata
    from pgstream.subscriptions s
    where s.schema_name = p_schema and s.table_name = p_table and s.operation = 'DELETE'
    order by s.stream_id, s.key, s.id;
end
$$;
revoke all on function pgstream._drift_partition_removed(text, text, text, text, text, boolean) from public;

-- The tables detached from the tree of p_schema.p_table (a table with DELETE subscriptions) by the
-- DDL being checked: those that still carry a copy of its TRUNCATE trigger (a trigger calling its
-- function) but are no longer in its tree. Each that holds rows goes through _drift_partition_removed
-- (a table it cannot read, or a foreign table, is taken to hold rows). Read with row_security off: a
-- row-level security policy of the table's owner would run as pgstream's owner (a non-superuser
-- owner; a superuser bypasses them); Postgres refuses the read instead, and the table counts as
-- holding rows.
create or replace function pgstream._drift_check_detached(p_schema text, p_table text, p_what text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set row_security = off
as $$
declare
    v_rel  pg_catalog.regclass := pgstream._relid(p_schema, p_table);
    v_fn   pg_catalog.oid := pg_catalog.to_regprocedure(pg_catalog.format('pgstream.%I()',
                                 pgstream.trigger_function_name(p_schema, p_table, 'DELETE', 'truncate')));
    v_part record;
    v_rows boolean;
begin
    if v_fn is null then
        return;
    end if;
    for v_part in select distinct c.oid::pg_catalog.regclass as rel, c.relkind, n.nspname::text as nspname,
                                  c.relname::text as relname
                  from pg_catalog.pg_trigger t
                  join pg_catalog.pg_class c on c.oid = t.tgrelid
                  join pg_catalog.pg_namespace n on n.oid = c.relnamespace
                  where t.tgfoid = v_fn and t.tgparentid = 0 and t.tgrelid <> v_rel::pg_catalog.oid
                    and c.relkind <> 'p'  -- its own rows are its partitions', each checked
                    and not exists (select 1 from pg_catalog.pg_partition_tree(v_rel) p where p.relid = t.tgrelid)
                  order by 3, 4 loop
        v_rows := true;
        if v_part.relkind = 'r' then
            begin
                execute pg_catalog.format('select exists (select from only %s)', v_part.rel) into v_rows;
            exception when insufficient_privilege then
                v_rows := true;
            end;
        end if;
        if v_rows then
            perform pgstream._drift_partition_removed(p_schema, p_table, v_part.nspname, v_part.relname, p_what, false);
        end if;
    end loop;
end
$$;
revoke all on function pgstream._drift_check_detached(text, text, text) from public;

-- DDL on a partition of a subscribed partitioned table that disabled, renamed or changed its copy of
-- a generated trigger is refused like the table's own (which _drift_check_table checks).
create or replace function pgstream._drift_check_partition_triggers(p_rel pg_catalog.oid, p_what text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_msg text;
begin
    if not exists (select 1 from pg_catalog.pg_class c where c.oid = p_rel and c.relispartition) then
        return;
    end if;
    v_msg := pgstream._drift_trigger_problem(p_rel);
    if v_msg is not null then
        raise exception 'pgstream: refusing %: % and the subscriptions of its partitioned table would silently stop producing events',
            p_what, v_msg
            using errcode = 'dependent_objects_still_exist',
                  hint = 'Delete or change the subscriptions instead; the trigger follows them.';
    end if;
end
$$;
revoke all on function pgstream._drift_check_partition_triggers(oid, text) from public;

-- After DDL on a table of a subscribed partitioned table's tree (CREATE TABLE ... PARTITION OF,
-- ATTACH / DETACH PARTITION, on the table or on a partition): a table detached with rows is checked
-- (_drift_check_detached), every partition gets the generated triggers (a partition that brings a
-- trigger of their name that is not pgstream's is refused), a detached table loses them (pgstream's
-- own DDL); then the partition's copies are checked (_drift_check_partition_triggers).
create or replace function pgstream._drift_check_partitions(p_rel pg_catalog.oid, p_what text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_sub   record;
    v_begun boolean;
begin
    if not exists (select 1 from pg_catalog.pg_class c where c.oid = p_rel and (c.relispartition or c.relkind = 'p')) then
        return;
    end if;
    for v_sub in select distinct n.nspname::text as schema_name, c.relname::text as table_name
                 from pg_catalog.pg_partition_ancestors(p_rel::pg_catalog.regclass) a
                 join pg_catalog.pg_class c on c.oid = a.relid
                 join pg_catalog.pg_namespace n on n.oid = c.relnamespace
                 join pgstream.subscriptions s on s.schema_name = n.nspname and s.table_name = c.relname
                                              and s.operation = 'DELETE'
                 order by 1, 2 loop
        perform pgstream._drift_check_detached(v_sub.schema_name, v_sub.table_name, p_what);
    end loop;
    v_begun := pgstream._internal_ddl_begin();
    for v_sub in select n.nspname::text as schema_name, c.relname::text as table_name, m.operation, m.mode
                 from pg_catalog.pg_partition_ancestors(p_rel::pg_catalog.regclass) a
                 join pg_catalog.pg_class c on c.oid = a.relid
                 join pg_catalog.pg_namespace n on n.oid = c.relnamespace
                 cross join lateral pgstream._trigger_modes(n.nspname, c.relname) m
                 order by 1, 2, 3, 4 loop
        perform pgstream._sync_partition_triggers(v_sub.schema_name, v_sub.table_name, v_sub.operation, v_sub.mode,
                                                  p_what);
    end loop;
    perform pgstream._internal_ddl_end(v_begun);
    perform pgstream._drift_check_partition_triggers(p_rel, p_what);
end
$$;
revoke all on function pgstream._drift_check_partitions(oid, text) from public;

-- Before each DDL command (ddl_command_start, which cannot see what it will drop: besides DROP TABLE,
-- DROP SCHEMA and DROP OWNED, a CASCADE from a function, type, operator class or column of a
-- partition key drops a partition too): the partitions of the subscribed tables with DELETE
-- subscriptions, as {partition oid: [table oid, ...]}, for _drift_guard_sql_drop, which runs once
-- they are gone from the catalog. Set for the transaction at the start of every command, so that no
-- earlier value (a role may set any setting of its session) is ever read. Without such tables it is
-- one look at pgstream.subscriptions.
create or replace function pgstream._drift_guard_ddl_start()
returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_catalog.to_regclass('pgstream.subscriptions') is null or pgstream._in_internal_ddl() then
        return;
    end if;
    perform pg_catalog.set_config('pgstream.drift_partitions', coalesce((
        select pg_catalog.jsonb_object_agg(x.part, x.roots)::text
        from (select p.relid::pg_catalog.oid::text as part, pg_catalog.jsonb_agg(r.oid::pg_catalog.oid) as roots
              from (select distinct pgstream._relid(s.schema_name, s.table_name) as oid
                    from pgstream.subscriptions s where s.operation = 'DELETE') r
              cross join lateral pg_catalog.pg_partition_tree(r.oid) p
              where r.oid is not null and p.relid <> r.oid
              group by p.relid) x), ''), true);
end
$$;
revoke all on function pgstream._drift_guard_ddl_start() from public;

create or replace function pgstream._drift_guard_sql_drop()
returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_obj   record;
    v_subs  text;
    v_parts pg_catalog.jsonb;
    v_what  text;
begin
    if pg_catalog.to_regclass('pgstream.subscriptions') is null or pgstream._in_internal_ddl() then
        return;
    end if;
    for v_obj in select * from pg_catalog.pg_event_trigger_dropped_objects() d
                 where d.object_type = 'table' and not d.is_temporary loop
        v_subs := pgstream._drift_subscription_list(v_obj.schema_name, v_obj.object_name);
        if v_subs is not null then
            raise exception 'pgstream: refusing % of %: subscriptions % depend on it', tg_tag, v_obj.object_identity, v_subs
                using errcode = 'dependent_objects_still_exist',
                      hint = pg_catalog.format('Delete them first: delete from pgstream.subscriptions where schema_name = %L and table_name = %L;',
                                               v_obj.schema_name, v_obj.object_name);
        end if;
    end loop;
    -- a partition of a table with DELETE subscriptions (see _drift_guard_ddl_start)
    v_parts := nullif(pg_catalog.current_setting('pgstream.drift_partitions', true), '')::pg_catalog.jsonb;
    for v_obj in select d.*, n.nspname::text as root_schema, c.relname::text as root_table
                 from pg_catalog.pg_event_trigger_dropped_objects() d
                 cross join lateral pg_catalog.jsonb_array_elements_text(v_parts -> d.objid::text) r(oid)
                 join pg_catalog.pg_class c on c.oid = r.oid::pg_catalog.oid
                 join pg_catalog.pg_namespace n on n.oid = c.relnamespace
                 where d.object_type in ('table', 'foreign table') and not d.is_temporary
                 order by d.schema_name, d.object_name, 1, 2 loop
        perform pgstream._drift_partition_removed(v_obj.root_schema, v_obj.root_table, v_obj.schema_name,
                                                  v_obj.object_name,
                                                  pg_catalog.format('%s of %s', tg_tag, v_obj.object_identity), true);
    end loop;
    -- a trigger dropped without its table: the table's generated triggers (and a partition's copies)
    -- must still be there, enabled, calling their functions (a trigger that only bears their name is
    -- the table owner's own)
    for v_obj in select distinct d.address_names[1] as nsp, d.address_names[2] as rel, d.object_identity
                 from pg_catalog.pg_event_trigger_dropped_objects() d
                 where d.object_type = 'trigger' and not d.is_temporary
                   -- dropped with its table (a partition: a subscribed table is refused above)
                   and not exists (select 1 from pg_catalog.pg_event_trigger_dropped_objects() x
                                   where x.object_type = 'table' and x.schema_name = d.address_names[1]
                                     and x.object_name = d.address_names[2])
                 order by 1, 2, 3 loop
        v_what := pg_catalog.format('%s of %s', tg_tag, v_obj.object_identity);
        perform pgstream._drift_check_table(v_obj.nsp, v_obj.rel, v_what);
        perform pgstream._drift_check_partition_triggers(pgstream._relid(v_obj.nsp, v_obj.rel),
                                                         v_what);
    end loop;
    for v_obj in select * from pg_catalog.pg_event_trigger_dropped_objects() d
                 where d.object_type in ('function', 'procedure', 'routine', 'aggregate') and d.schema_name = 'pgstream'
                 order by d.object_name like '\_publish\_%' desc loop
        if v_obj.object_name like '\_publish\_%' then
            raise exception 'pgstream: refusing % that drops the generated function %', tg_tag, v_obj.object_identity
                using errcode = 'dependent_objects_still_exist',
                      hint = 'Delete or change the subscriptions instead; the function follows them.';
        end if;
        raise exception 'pgstream: refusing % of %: functions in schema pgstream change only with pgstream''s own DDL',
            tg_tag, v_obj.object_identity
            using errcode = 'insufficient_privilege',
                  hint = 'pgstream-dagster migrate changes them (the generated ones follow the subscriptions and backfills).';
    end loop;
    for v_obj in select * from pg_catalog.pg_event_trigger_dropped_objects() d
                 where d.object_type = 'table column' and not d.is_temporary loop
        perform pgstream._drift_check_table(v_obj.address_names[1], v_obj.address_names[2],
            pg_catalog.format('%s dropping column %s', tg_tag, v_obj.object_identity));
    end loop;
end
$$;
revoke all on function pgstream._drift_guard_sql_drop() from public;

create or replace function pgstream._drift_guard_ddl_end()
returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_cmd record;
    v_rel record;
    v_what text;
begin
    if pg_catalog.to_regclass('pgstream.subscriptions') is null or pgstream._in_internal_ddl() then
        return;
    end if;
    for v_cmd in select * from pg_catalog.pg_event_trigger_ddl_commands() c where not c.in_extension loop
        v_what := pg_catalog.format('%s on %s', tg_tag, v_cmd.object_identity);
        if v_cmd.object_type in ('table', 'table column') then
            for v_rel in select c.oid, n.nspname, c.relname from pg_catalog.pg_class c
                         join pg_catalog.pg_namespace n on n.oid = c.relnamespace where c.oid = v_cmd.objid loop
                perform pgstream._drift_check_partitions(v_rel.oid, v_what);
                perform pgstream._drift_check_renamed(v_rel.oid, v_what);
                perform pgstream._drift_check_table(v_rel.nspname, v_rel.relname, v_what);
            end loop;
        elsif v_cmd.object_type = 'schema' then
            for v_rel in select distinct c.oid from pg_catalog.pg_class c
                         join pg_catalog.pg_trigger t on t.tgrelid = c.oid
                         join pg_catalog.pg_proc p on p.oid = t.tgfoid
                         where c.relnamespace = v_cmd.objid and p.pronamespace = 'pgstream'::pg_catalog.regnamespace loop
                perform pgstream._drift_check_renamed(v_rel.oid, v_what);
            end loop;
        elsif v_cmd.object_type = 'trigger' then
            for v_rel in select c.oid, n.nspname, c.relname from pg_catalog.pg_trigger t
                         join pg_catalog.pg_class c on c.oid = t.tgrelid
                         join pg_catalog.pg_namespace n on n.oid = c.relnamespace where t.oid = v_cmd.objid loop
                perform pgstream._drift_check_table(v_rel.nspname, v_rel.relname, v_what);
                perform pgstream._drift_check_partition_triggers(v_rel.oid, v_what);
            end loop;
        elsif v_cmd.object_type in ('function', 'procedure', 'routine', 'aggregate')
              and v_cmd.schema_name = 'pgstream' then
            if exists (select 1 from pg_catalog.pg_proc p where p.oid = v_cmd.objid
                       and p.proname like '\_publish\_%') then
                raise exception 'pgstream: refusing % of a generated trigger function: its subscriptions define it', v_what
                    using errcode = 'dependent_objects_still_exist',
                          hint = 'Change the subscriptions instead; pgstream.repair_trigger(schema, table, operation) recreates it.';
            end if;
            raise exception 'pgstream: refusing %: functions in schema pgstream change only with pgstream''s own DDL', v_what
                using errcode = 'insufficient_privilege',
                      hint = 'pgstream-dagster migrate changes them (the generated ones follow the subscriptions and backfills).';
        end if;
    end loop;
end
$$;
revoke all on function pgstream._drift_guard_ddl_end() from public;

-- The event triggers (dropped and created again: there is no create or replace for them).
do $$
begin
    drop event trigger if exists pgstream_drift_guard_drop;
    drop event trigger if exists pgstream_drift_guard_alter;
    drop event trigger if exists pgstream_drift_guard_start;
    create event trigger pgstream_drift_guard_start on ddl_command_start
        execute function pgstream._drift_guard_ddl_start();
    create event trigger pgstream_drift_guard_drop on sql_drop
        execute function pgstream._drift_guard_sql_drop();
    create event trigger pgstream_drift_guard_alter on ddl_command_end
        when tag in ('CREATE TABLE', 'ALTER TABLE', 'ALTER SCHEMA', 'ALTER TRIGGER', 'ALTER FUNCTION', 'ALTER ROUTINE',
                     'ALTER PROCEDURE', 'ALTER AGGREGATE', 'CREATE FUNCTION', 'CREATE PROCEDURE',
                     'CREATE AGGREGATE')
        execute function pgstream._drift_guard_ddl_end();
exception when insufficient_privilege then
    raise warning 'pgstream: the schema-drift guard needs superuser to install event triggers; it is NOT active';
end
$$;
