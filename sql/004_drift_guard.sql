-- 004: schema-drift guard. Policy: REFUSE. DDL that would make a generated trigger fail at
-- commit time (or silently stop publishing) is rolled back with an error that names the
-- subscriptions in the way:
--   * DROP TABLE / DROP SCHEMA of a subscribed table;
--   * dropping, renaming or retyping a column a subscription uses (column_names, when_clause,
--     payload extension expressions);
--   * renaming or moving a subscribed table or its schema;
--   * dropping a generated pgstream_* trigger by hand.
-- Change or delete the subscriptions first, then run the DDL. pgstream's own DDL (trigger
-- regeneration, tear-down) sets pgstream.internal_ddl=on for its transaction and is let through.
-- Event triggers need superuser: without it the guard is skipped with a warning.

-- Revalidates every subscription on one table; raises, naming them, if any no longer holds.
create or replace function pgstream._drift_check_table(p_schema text, p_table text, p_what text)
returns void
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_sub pgstream.subscriptions;
    v_msg text;
begin
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
end
$$;

create or replace function pgstream._drift_subscription_list(p_schema text, p_table text)
returns text
language sql
stable
security definer
set search_path = ''
as $$
    select string_agg(format('"%s" (stream %s, %s)', key, stream_id, operation), ', ' order by stream_id, key)
    from pgstream.subscriptions where schema_name = p_schema and table_name = p_table
$$;

-- Subscriptions whose table no longer resolves (renamed or moved).
create or replace function pgstream._drift_check_unresolved(p_what text)
returns void
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_row record;
begin
    select schema_name, table_name into v_row
    from pgstream.subscriptions
    where to_regclass(format('%I.%I', schema_name, table_name)) is null
    order by 1, 2
    limit 1;
    if found then
        raise exception 'pgstream: refusing %: table %.% is subscribed by %', p_what,
            quote_ident(v_row.schema_name), quote_ident(v_row.table_name),
            pgstream._drift_subscription_list(v_row.schema_name, v_row.table_name)
            using errcode = 'dependent_objects_still_exist',
                  hint = 'Update or delete the subscriptions first, then repeat the DDL.';
    end if;
end
$$;

create or replace function pgstream._drift_guard_sql_drop()
returns event_trigger
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_obj  record;
    v_subs text;
begin
    if current_setting('pgstream.internal_ddl', true) = 'on'
       or to_regclass('pgstream.subscriptions') is null then
        return;
    end if;
    for v_obj in select * from pg_event_trigger_dropped_objects() where object_type = 'table' and not is_temporary loop
        v_subs := pgstream._drift_subscription_list(v_obj.schema_name, v_obj.object_name);
        if v_subs is not null then
            raise exception 'pgstream: refusing % of %: subscriptions % depend on it', tg_tag, v_obj.object_identity, v_subs
                using errcode = 'dependent_objects_still_exist',
                      hint = format('Delete them first: delete from pgstream.subscriptions where schema_name = %L and table_name = %L;',
                                    v_obj.schema_name, v_obj.object_name);
        end if;
    end loop;
    for v_obj in select * from pg_event_trigger_dropped_objects() where object_type = 'trigger' loop
        if v_obj.object_identity ~ '^pgstream_(insert|update|delete) on ' then
            raise exception 'pgstream: refusing % that drops the generated trigger %: its subscriptions would silently stop producing events',
                tg_tag, v_obj.object_identity
                using errcode = 'dependent_objects_still_exist',
                      hint = 'Delete or change the subscriptions instead; the trigger follows them.';
        end if;
    end loop;
    for v_obj in select * from pg_event_trigger_dropped_objects() where object_type = 'table column' loop
        perform pgstream._drift_check_table(v_obj.address_names[1], v_obj.address_names[2],
            format('%s dropping column %s', tg_tag, v_obj.object_identity));
    end loop;
end
$$;

create or replace function pgstream._drift_guard_ddl_end()
returns event_trigger
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_cmd record;
    v_rel record;
begin
    if current_setting('pgstream.internal_ddl', true) = 'on'
       or to_regclass('pgstream.subscriptions') is null then
        return;
    end if;
    perform pgstream._drift_check_unresolved(tg_tag);
    for v_cmd in select * from pg_event_trigger_ddl_commands() where object_type in ('table', 'table column') loop
        select n.nspname, c.relname into v_rel
        from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
        where c.oid = v_cmd.objid;
        if found then
            perform pgstream._drift_check_table(v_rel.nspname, v_rel.relname,
                format('%s on %s', tg_tag, v_cmd.object_identity));
        end if;
    end loop;
end
$$;

do $$
begin
    drop event trigger if exists pgstream_drift_guard_drop;
    drop event trigger if exists pgstream_drift_guard_alter;
    create event trigger pgstream_drift_guard_drop on sql_drop
        when tag in ('DROP TABLE', 'DROP SCHEMA', 'ALTER TABLE', 'DROP TRIGGER', 'DROP OWNED')
        execute function pgstream._drift_guard_sql_drop();
    create event trigger pgstream_drift_guard_alter on ddl_command_end
        when tag in ('ALTER TABLE', 'ALTER SCHEMA')
        execute function pgstream._drift_guard_ddl_end();
exception when insufficient_privilege then
    raise warning 'pgstream: the schema-drift guard needs superuser to install event triggers; it is NOT active';
end
$$;
