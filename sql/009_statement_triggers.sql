-- 009: statement-level trigger mode.
--
-- pgstream.subscriptions.trigger_mode = 'row' (default, unchanged behaviour: a deferred
-- constraint trigger FOR EACH ROW, events written at commit) or 'statement': an AFTER ... FOR EACH
-- STATEMENT trigger with a transition table whose function writes all events of the statement with
-- one INSERT ... SELECT. Same payloads, same order (rows of the statement, then subscriptions in
-- (stream_id, key, id) order). Differences: events are written at the end of the statement rather
-- than at commit; tg_table_name/tg_table_schema name the subscribed table (for a partitioned table
-- that is the parent, where row mode names the partition). UPDATE is row mode only: a statement's
-- old and new transition tables cannot be paired without a key.
--
-- A table's subscriptions for one operation may mix modes: each mode gets its own trigger
-- (pgstream_<op> for row mode, pgstream_<op>_stmt for statement mode) and trigger function.

alter table pgstream.subscriptions add column if not exists trigger_mode text not null default 'row';

do $$
begin
    alter table pgstream.subscriptions
        add constraint subscriptions_trigger_mode_check check (trigger_mode in ('row', 'statement'));
exception when duplicate_object then null;
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Validation: the 003 checks plus the mode. The 003 function is kept under another name.
do $$
begin
    if to_regprocedure('pgstream._validate_subscription_003(pgstream.subscriptions)') is null then
        alter function pgstream.validate_subscription(pgstream.subscriptions) rename to _validate_subscription_003;
    end if;
end
$$;

create or replace function pgstream.validate_subscription(p_sub pgstream.subscriptions)
returns void
language plpgsql
security definer
set search_path = ''
as $$
begin
    if p_sub.trigger_mode is null or p_sub.trigger_mode not in ('row', 'statement') then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'trigger_mode',
            format('must be ''row'' or ''statement'', got %s', coalesce(quote_literal(p_sub.trigger_mode), 'NULL')));
    end if;
    if p_sub.trigger_mode = 'statement' and p_sub.operation = 'UPDATE' then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'trigger_mode',
            'statement mode supports INSERT and DELETE only: an UPDATE statement''s old and new rows '
            'cannot be paired without a key; use trigger_mode ''row''');
    end if;
    perform pgstream._validate_subscription_003(p_sub);
end
$$;

revoke all on function pgstream.validate_subscription(pgstream.subscriptions) from public;

create or replace function pgstream._subscription_before_write()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
    new.schema_name := coalesce(nullif(btrim(new.schema_name), ''), 'public');
    new.when_clause := nullif(btrim(new.when_clause), '');
    new.column_names := coalesce(new.column_names, '{}');
    new.payload_extensions := coalesce(new.payload_extensions, '[]'::jsonb);
    new.trigger_mode := coalesce(new.trigger_mode, 'row');
    if tg_op = 'UPDATE' then
        new.updated_at := now();
    end if;
    perform pgstream.validate_subscription(new);
    perform pgstream.ensure_stream(new.stream_id);
    return new;
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Names per mode. Row mode keeps the 003 names, so existing triggers are untouched.

create or replace function pgstream.trigger_name(p_op pgstream.operation_type, p_mode text)
returns text
language sql
immutable
as $$ select 'pgstream_' || lower(p_op::text) || case when p_mode = 'statement' then '_stmt' else '' end $$;

create or replace function pgstream.trigger_function_name(
    p_schema text, p_table text, p_op pgstream.operation_type, p_mode text
)
returns text
language sql
immutable
set search_path = ''
as $$
    select '_publish_' || lower(p_op::text) || case when p_mode = 'statement' then '_stmt' else '' end
           || '_' || substr(md5(format('%I.%I', p_schema, p_table)), 1, 16)
$$;

-- The extensions expression of one subscription.
create or replace function pgstream._subscription_extensions_sql(p_sub pgstream.subscriptions)
returns text
language sql
immutable
set search_path = ''
as $$
    select pgstream._extensions_sql(coalesce((
        select jsonb_agg(jsonb_build_object('parts', to_jsonb(string_to_array(x ->> 'json_path', '.')),
                                            'expr', x ->> 'expression') order by o)
        from jsonb_array_elements(p_sub.payload_extensions) with ordinality as e(x, o)), '[]'::jsonb))
$$;

-- The generated trigger for one target and mode, or null when no subscription of that mode targets
-- it. Row mode produces exactly the 003 text (so existing trigger hashes hold). Statement mode has
-- no WHEN clause (when_clause is always null): filters go into the INSERT ... SELECT.
create or replace function pgstream.generated_trigger(
    p_schema text, p_table text, p_op pgstream.operation_type, p_mode text,
    out function_body text, out when_clause text
)
language plpgsql
stable
set search_path = ''
as $$
declare
    v_blocks text;
    v_count  integer;
    v_src    text := case p_op when 'DELETE' then 'old' else 'new' end;
begin
    if p_mode = 'row' then
        select case when bool_or(s.when_clause is null) then null
                    else string_agg(format('(%s)', s.when_clause), ' or ' order by s.stream_id, s.key, s.id)
               end,
               string_agg(format(
$b$    if %s then
        insert into pgstream.events (payload, stream_id, metadata)
        values (jsonb_build_object('tg_name', %L, 'tg_op', tg_op, 'tg_table_name', tg_table_name,
                                   'tg_table_schema', tg_table_schema, 'timestamp', v_ts,
                                   'new', %s, 'old', %s) || %s,
                %s, %L::jsonb);
    end if;
$b$,
                   coalesce(s.when_clause, 'true'),
                   s.key,
                   case when p_op = 'DELETE' then 'null' else pgstream._row_object_sql('new', s.column_names) end,
                   case when p_op = 'INSERT' then 'null' else pgstream._row_object_sql('old', s.column_names) end,
                   pgstream._subscription_extensions_sql(s),
                   s.stream_id,
                   s.metadata), '' order by s.stream_id, s.key, s.id)
        into when_clause, v_blocks
        from pgstream.subscriptions s
        where s.schema_name = p_schema and s.table_name = p_table and s.operation = p_op
          and s.trigger_mode = 'row';

        if v_blocks is null then
            function_body := null;
            when_clause := null;
            return;
        end if;
        function_body := format(
$f$
declare
    v_ts bigint := (extract(epoch from now()) * 1000)::bigint;
begin
%s    return null;
end
$f$, v_blocks);
        return;
    end if;

    if p_mode is distinct from 'statement' or p_op = 'UPDATE' then
        function_body := null;
        when_clause := null;
        return;
    end if;

    -- One row of (payload or null when filtered out, stream_id, metadata) per subscription. The
    -- trigger's variables are inlined as literals: with '#variable_conflict use_column' a table
    -- column never clashes with a PL/pgSQL name, and the statement uses no variables at all.
    select count(*),
           string_agg(format(
               $r$(case when %s then jsonb_build_object('tg_name', %L, 'tg_op', %L, 'tg_table_name', %L, 'tg_table_schema', %L, 'timestamp', pgstream_ts.pgstream_ts_ms, 'new', %s, 'old', %s)%s end, %s::bigint, %L::jsonb)$r$,
               coalesce(s.when_clause, 'true'),
               s.key, p_op::text, p_table, p_schema,
               case when p_op = 'DELETE' then 'null' else pgstream._row_object_sql('new', s.column_names) end,
               case when p_op = 'INSERT' then 'null' else pgstream._row_object_sql('old', s.column_names) end,
               case when jsonb_array_length(s.payload_extensions) = 0 then ''
                    else ' || ' || pgstream._subscription_extensions_sql(s) end,
               s.stream_id,
               s.metadata), E',\n            ' order by s.stream_id, s.key, s.id)
    into v_count, v_blocks
    from pgstream.subscriptions s
    where s.schema_name = p_schema and s.table_name = p_table and s.operation = p_op
      and s.trigger_mode = 'statement';

    if v_count = 0 then
        function_body := null;
        when_clause := null;
        return;
    end if;
    if v_count = 1 then
        -- one subscription: a plain filtered INSERT ... SELECT (about a third cheaper than the VALUES list)
        select format(
$f$
#variable_conflict use_column
begin
    insert into pgstream.events (payload, stream_id, metadata)
    select jsonb_build_object('tg_name', %L, 'tg_op', %L, 'tg_table_name', %L, 'tg_table_schema', %L, 'timestamp', pgstream_ts.pgstream_ts_ms, 'new', %s, 'old', %s)%s,
           %s::bigint, %L::jsonb
    from (select (extract(epoch from now()) * 1000)::bigint) as pgstream_ts(pgstream_ts_ms)
    cross join pgstream_%s as %s
    where (%s);
    return null;
end
$f$,
                   s.key, p_op::text, p_table, p_schema,
                   case when p_op = 'DELETE' then 'null' else pgstream._row_object_sql('new', s.column_names) end,
                   case when p_op = 'INSERT' then 'null' else pgstream._row_object_sql('old', s.column_names) end,
                   case when jsonb_array_length(s.payload_extensions) = 0 then ''
                        else ' || ' || pgstream._subscription_extensions_sql(s) end,
                   s.stream_id, s.metadata, v_src, v_src, coalesce(s.when_clause, 'true'))
        into function_body
        from pgstream.subscriptions s
        where s.schema_name = p_schema and s.table_name = p_table and s.operation = p_op
          and s.trigger_mode = 'statement';
        when_clause := null;
        return;
    end if;
    -- The transition table is scanned once, in the statement's row order; the lateral VALUES list
    -- is evaluated per row in subscription order, so ids follow (row, subscription). The payload
    -- timestamp (transaction start, as in row mode) is computed once per statement.
    function_body := format(
$f$
#variable_conflict use_column
begin
    insert into pgstream.events (payload, stream_id, metadata)
    select e.payload, e.stream_id, e.metadata
    from (select (extract(epoch from now()) * 1000)::bigint) as pgstream_ts(pgstream_ts_ms)
    cross join pgstream_%s as %s
    cross join lateral (values
            %s
    ) as e(payload, stream_id, metadata)
    where e.payload is not null;
    return null;
end
$f$, v_src, v_src, v_blocks);
    when_clause := null;
end
$$;

-- 003's signature: row mode.
create or replace function pgstream.generated_trigger(
    p_schema text, p_table text, p_op pgstream.operation_type,
    out function_body text, out when_clause text
)
language sql
stable
set search_path = ''
as $$
    select g.function_body, g.when_clause from pgstream.generated_trigger(p_schema, p_table, p_op, 'row') g
$$;

-- Regenerates the trigger of one (schema, table, operation, mode). An identical definition is left
-- untouched (same trigger oid). Returns whether anything changed.
create or replace function pgstream._regenerate_trigger_mode(
    p_schema text, p_table text, p_op pgstream.operation_type, p_mode text
)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_fn      text := pgstream.trigger_function_name(p_schema, p_table, p_op, p_mode);
    v_trg     text := pgstream.trigger_name(p_op, p_mode);
    v_rel     regclass := to_regclass(format('%I.%I', p_schema, p_table));
    v_gen     record;
    v_hash    text;
    v_current text;
    v_guard   text := coalesce(current_setting('pgstream.internal_ddl', true), '');
begin
    select * into v_gen from pgstream.generated_trigger(p_schema, p_table, p_op, p_mode);

    if v_rel is not null then
        select obj_description(t.oid, 'pg_trigger') into v_current
        from pg_catalog.pg_trigger t where t.tgrelid = v_rel and t.tgname = v_trg;
    end if;
    v_hash := 'pgstream generated ' || md5(coalesce(v_gen.function_body, '') || '|' || coalesce(v_gen.when_clause, ''));
    if v_gen.function_body is not null and v_current is not distinct from v_hash then
        return false;
    end if;
    if v_gen.function_body is null and v_current is null
       and to_regprocedure(format('pgstream.%I()', v_fn)) is null then
        return false;
    end if;

    perform set_config('pgstream.internal_ddl', 'on', true);
    if v_rel is not null then
        execute format('drop trigger if exists %I on %s', v_trg, v_rel);
    end if;
    if v_gen.function_body is null then
        execute format('drop function if exists pgstream.%I()', v_fn);
    else
        execute format('create or replace function pgstream.%I() returns trigger language plpgsql '
                       'security definer set search_path = '''' as %L', v_fn, v_gen.function_body);
        execute format('revoke all on function pgstream.%I() from public', v_fn);
        execute format('comment on function pgstream.%I() is %L', v_fn,
                       format('pgstream %s-mode trigger function for %s on %I.%I', p_mode, p_op, p_schema, p_table));
        if p_mode = 'row' then
            execute format('create constraint trigger %I after %s on %s deferrable initially deferred '
                           'for each row %s execute function pgstream.%I()',
                           v_trg, p_op, v_rel,
                           case when v_gen.when_clause is null then '' else format('when (%s)', v_gen.when_clause) end,
                           v_fn);
        else
            execute format('create trigger %I after %s on %s referencing %s table as %I '
                           'for each statement execute function pgstream.%I()',
                           v_trg, p_op, v_rel,
                           case p_op when 'DELETE' then 'old' else 'new' end,
                           case p_op when 'DELETE' then 'pgstream_old' else 'pgstream_new' end,
                           v_fn);
        end if;
        execute format('comment on trigger %I on %s is %L', v_trg, v_rel, v_hash);
    end if;
    perform set_config('pgstream.internal_ddl', v_guard, true);
    return true;
end
$$;

revoke all on function pgstream._regenerate_trigger_mode(text, text, pgstream.operation_type, text) from public;

-- Both modes of one (schema, table, operation).
create or replace function pgstream.regenerate_trigger(
    p_schema text, p_table text, p_op pgstream.operation_type
)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_row  boolean;
    v_stmt boolean;
begin
    perform pg_advisory_xact_lock(pg_catalog.hashtext('pgstream.regenerate'));
    v_row := pgstream._regenerate_trigger_mode(p_schema, p_table, p_op, 'row');
    v_stmt := pgstream._regenerate_trigger_mode(p_schema, p_table, p_op, 'statement');
    return v_row or v_stmt;
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Drift guard: the statement triggers are generated triggers too.
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
        if v_obj.object_identity ~ '^pgstream_(insert|update|delete)(_stmt)? on ' then
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

-- ---------------------------------------------------------------------------------------------
-- set_subscriptions: as in 003, with trigger_mode part of the definition.
create or replace function pgstream.set_subscriptions(
    p_stream_id bigint,
    p_subscriptions pgstream.subscriptions[],
    p_managed_by text default null
)
returns table (action text, key text, schema_name text, table_name text, operation pgstream.operation_type)
language plpgsql
security definer
set search_path = ''
as $$
#variable_conflict use_column
declare
    v_bad record;
begin
    if p_stream_id is null then
        raise exception 'pgstream.set_subscriptions: p_stream_id must not be null'
            using errcode = 'invalid_parameter_value';
    end if;
    perform pg_advisory_xact_lock(pg_catalog.hashtext('pgstream.regenerate'));

    select s.key, s.stream_id into v_bad
    from unnest(coalesce(p_subscriptions, '{}')) s
    where s.stream_id is not null and s.stream_id <> p_stream_id
    limit 1;
    if found then
        raise exception 'pgstream.set_subscriptions: subscription "%" has stream_id % but the set is for stream %',
            v_bad.key, v_bad.stream_id, p_stream_id using errcode = 'invalid_parameter_value';
    end if;

    select s.key into v_bad
    from unnest(coalesce(p_subscriptions, '{}')) s
    group by s.key, coalesce(nullif(btrim(s.schema_name), ''), 'public'), s.table_name, s.operation
    having count(*) > 1
    limit 1;
    if found then
        raise exception 'pgstream.set_subscriptions: subscription "%" appears more than once for the same table and operation',
            v_bad.key using errcode = 'unique_violation';
    end if;

    perform pgstream.ensure_stream(p_stream_id);

    create temporary table if not exists pgstream_set_subscriptions_input_v2 (
        key text, operation pgstream.operation_type, schema_name text, table_name text,
        when_clause text, column_names text[], metadata jsonb, payload_extensions jsonb,
        managed_by text, trigger_mode text
    ) on commit drop;
    truncate pg_temp.pgstream_set_subscriptions_input_v2;
    insert into pg_temp.pgstream_set_subscriptions_input_v2
    select s.key, s.operation, coalesce(nullif(btrim(s.schema_name), ''), 'public'), s.table_name,
           nullif(btrim(s.when_clause), ''), coalesce(s.column_names, '{}'), s.metadata,
           coalesce(s.payload_extensions, '[]'::jsonb), coalesce(p_managed_by, s.managed_by),
           coalesce(s.trigger_mode, 'row')
    from unnest(coalesce(p_subscriptions, '{}')) s;

    return query
    delete from pgstream.subscriptions t
    where t.stream_id = p_stream_id
      and (p_managed_by is null or t.managed_by is not distinct from p_managed_by)
      and not exists (
          select 1 from pg_temp.pgstream_set_subscriptions_input_v2 i
          where i.key = t.key and i.schema_name = t.schema_name
            and i.table_name = t.table_name and i.operation = t.operation)
    returning 'deleted'::text, t.key, t.schema_name, t.table_name, t.operation;

    return query
    update pgstream.subscriptions t
    set when_clause = i.when_clause,
        column_names = i.column_names,
        metadata = i.metadata,
        payload_extensions = i.payload_extensions,
        managed_by = i.managed_by,
        trigger_mode = i.trigger_mode
    from pg_temp.pgstream_set_subscriptions_input_v2 i
    where t.stream_id = p_stream_id
      and i.key = t.key and i.schema_name = t.schema_name
      and i.table_name = t.table_name and i.operation = t.operation
      and (t.when_clause is distinct from i.when_clause
           or t.column_names is distinct from i.column_names
           or t.metadata is distinct from i.metadata
           or t.payload_extensions is distinct from i.payload_extensions
           or t.managed_by is distinct from i.managed_by
           or t.trigger_mode is distinct from i.trigger_mode)
    returning 'updated'::text, t.key, t.schema_name, t.table_name, t.operation;

    return query
    insert into pgstream.subscriptions as t
        (key, stream_id, operation, schema_name, table_name, when_clause, column_names,
         metadata, payload_extensions, managed_by, trigger_mode)
    select i.key, p_stream_id, i.operation, i.schema_name, i.table_name, i.when_clause,
           i.column_names, i.metadata, i.payload_extensions, i.managed_by, i.trigger_mode
    from pg_temp.pgstream_set_subscriptions_input_v2 i
    where not exists (
        select 1 from pgstream.subscriptions t
        where t.stream_id = p_stream_id and t.key = i.key and t.schema_name = i.schema_name
          and t.table_name = i.table_name and t.operation = i.operation)
    order by i.key, i.schema_name, i.table_name, i.operation
    returning 'inserted'::text, t.key, t.schema_name, t.table_name, t.operation;

    truncate pg_temp.pgstream_set_subscriptions_input_v2;
end
$$;

revoke all on all functions in schema pgstream from public;
