-- 003: subscription validation, trigger generation and set_subscriptions().
--
-- Every change to pgstream.subscriptions is validated row by row *before* it is written, then the
-- trigger of each affected (schema, table, operation) is regenerated once per statement. Any error
-- aborts the statement, so triggers stay exactly as they were.

-- Subscriptions written by a tool (the Dagster YAML loader writes 'yaml') carry a marker so the tool
-- can remove its own subscriptions without touching those created by hand in SQL.
alter table pgstream.subscriptions add column if not exists managed_by text;

-- ---------------------------------------------------------------------------------------------
-- Error helper: every validation error names the subscription and the offending part.
create or replace function pgstream._subscription_error(
    p_key text, p_stream_id bigint, p_op pgstream.operation_type, p_schema text, p_table text,
    p_part text, p_message text
)
returns void
language plpgsql
set search_path = ''
as $$
begin
    raise exception 'pgstream: subscription "%" (stream %, % on %.%): %: %',
        p_key, p_stream_id, p_op, p_schema, p_table, p_part, p_message
        using errcode = 'invalid_parameter_value',
              hint = 'Fix the subscription; nothing was changed.';
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Lexical guard for user-supplied SQL expressions (when_clause, extension expressions). The text is
-- later embedded in generated code, so it must be exactly one expression: no statement separator,
-- no comments, no dollar quoting or parameters, balanced quotes and parentheses that never close
-- more than they opened. Returns null when the text is acceptable, else the reason.
create or replace function pgstream._expression_lexical_error(p_text text)
returns text
language plpgsql
immutable
set search_path = ''
as $$
declare
    v_len   integer := length(p_text);
    v_i     integer := 1;
    v_c     text;
    v_depth integer := 0;
    v_esc   boolean;
begin
    while v_i <= v_len loop
        v_c := substr(p_text, v_i, 1);
        if v_c = '''' then
            -- E'...' strings allow backslash escapes
            v_esc := v_i > 1 and lower(substr(p_text, v_i - 1, 1)) = 'e'
                     and (v_i = 2 or substr(p_text, v_i - 2, 1) !~ '[A-Za-z0-9_]');
            v_i := v_i + 1;
            loop
                if v_i > v_len then
                    return 'unterminated quoted string';
                end if;
                v_c := substr(p_text, v_i, 1);
                if v_esc and v_c = '\' then
                    v_i := v_i + 2;
                    continue;
                end if;
                if v_c = '''' then
                    if substr(p_text, v_i + 1, 1) = '''' then
                        v_i := v_i + 2;
                        continue;
                    end if;
                    exit;
                end if;
                v_i := v_i + 1;
            end loop;
        elsif v_c = '"' then
            v_i := v_i + 1;
            loop
                if v_i > v_len then
                    return 'unterminated quoted identifier';
                end if;
                if substr(p_text, v_i, 1) = '"' then
                    if substr(p_text, v_i + 1, 1) = '"' then
                        v_i := v_i + 2;
                        continue;
                    end if;
                    exit;
                end if;
                v_i := v_i + 1;
            end loop;
        elsif v_c = ';' then
            return 'statement separator ";" is not allowed';
        elsif v_c = '$' then
            return 'dollar quoting and parameters ("$") are not allowed';
        elsif v_c = '-' and substr(p_text, v_i + 1, 1) = '-' then
            return 'comments ("--") are not allowed';
        elsif v_c = '/' and substr(p_text, v_i + 1, 1) = '*' then
            return 'comments ("/*") are not allowed';
        elsif v_c = '(' then
            v_depth := v_depth + 1;
        elsif v_c = ')' then
            v_depth := v_depth - 1;
            if v_depth < 0 then
                return 'unbalanced parentheses: ")" without "("';
            end if;
        end if;
        v_i := v_i + 1;
    end loop;
    if v_depth <> 0 then
        return 'unbalanced parentheses: "(" without ")"';
    end if;
    return null;
end
$$;

-- The FROM clause that gives an expression the row variables its trigger has:
-- INSERT -> new, DELETE -> old, UPDATE -> new and old.
create or replace function pgstream._row_sources(p_op pgstream.operation_type, p_schema text, p_table text)
returns text
language sql
immutable
set search_path = ''
as $$
    select case p_op
        when 'INSERT' then format('from %I.%I as new', p_schema, p_table)
        when 'DELETE' then format('from %I.%I as old', p_schema, p_table)
        else format('from %I.%I as new cross join %I.%I as old', p_schema, p_table, p_schema, p_table)
    end
$$;

-- Type-checks one expression against the table's row without evaluating it: the expression
-- becomes the single column of a temporary view (created and dropped in a subtransaction) and
-- the column's type is returned. Raises a subscription error on any parse or type error.
create or replace function pgstream._expression_type(
    p_sub pgstream.subscriptions, p_part text, p_expr text
)
returns regtype
language plpgsql
set search_path = ''
as $$
declare
    v_reason text := pgstream._expression_lexical_error(p_expr);
    v_view   text := 'pgstream_check_' || replace(gen_random_uuid()::text, '-', '');
    v_type   regtype;
    v_msg    text;
begin
    if v_reason is not null then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, p_part, v_reason);
    end if;
    begin
        execute format('create temporary view %I as select (%s) as v %s limit 0',
                       v_view, p_expr, pgstream._row_sources(p_sub.operation, p_sub.schema_name, p_sub.table_name));
        select a.atttypid::regtype into v_type
        from pg_catalog.pg_attribute a
        join pg_catalog.pg_class c on c.oid = a.attrelid
        where c.relname = v_view and c.relnamespace = pg_catalog.pg_my_temp_schema() and a.attname = 'v';
        execute format('drop view pg_temp.%I', v_view);
    exception when others then
        get stacked diagnostics v_msg = message_text;
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, p_part, v_msg);
    end;
    return v_type;
end
$$;

-- Validates a subscription completely (table, columns, when_clause, payload extensions) without
-- changing anything. Raises on the first problem, naming the subscription and the part.
create or replace function pgstream.validate_subscription(p_sub pgstream.subscriptions)
returns void
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_rel      oid;
    v_col      text;
    v_ext      jsonb;
    v_path     text;
    v_type     regtype;
    v_paths    text[] := '{}';
    v_reserved constant text[] := array['tg_name', 'tg_op', 'tg_table_name', 'tg_table_schema',
                                        'timestamp', 'new', 'old'];
    v_i        integer := 0;
begin
    select c.oid into v_rel
    from pg_catalog.pg_class c
    join pg_catalog.pg_namespace n on n.oid = c.relnamespace
    where n.nspname = p_sub.schema_name and c.relname = p_sub.table_name and c.relkind in ('r', 'p');
    if v_rel is null then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'table',
            format('table %I.%I does not exist', p_sub.schema_name, p_sub.table_name));
    end if;
    if p_sub.schema_name = 'pgstream' then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'table', 'tables in the pgstream schema cannot be subscribed');
    end if;

    foreach v_col in array coalesce(p_sub.column_names, '{}') loop
        if v_col is null or not exists (
            select 1 from pg_catalog.pg_attribute
            where attrelid = v_rel and attname = v_col and attnum > 0 and not attisdropped
        ) then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, 'column_names',
                format('column %s does not exist on %I.%I', coalesce(quote_ident(v_col), 'NULL'),
                       p_sub.schema_name, p_sub.table_name));
        end if;
    end loop;

    if p_sub.when_clause is not null then
        v_type := pgstream._expression_type(p_sub, 'when_clause', p_sub.when_clause);
        if v_type <> 'boolean'::regtype then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, 'when_clause',
                format('must be a boolean expression, got type %s', v_type));
        end if;
    end if;

    if jsonb_typeof(p_sub.payload_extensions) is distinct from 'array' then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'payload_extensions',
            'must be a JSON array of {"json_path": ..., "expression": ...} objects');
    end if;
    for v_ext in select e from jsonb_array_elements(p_sub.payload_extensions) e loop
        v_i := v_i + 1;
        if jsonb_typeof(v_ext) <> 'object'
           or jsonb_typeof(v_ext -> 'json_path') is distinct from 'string'
           or jsonb_typeof(v_ext -> 'expression') is distinct from 'string'
           or exists (select 1 from jsonb_object_keys(v_ext) k where k not in ('json_path', 'expression')) then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, format('payload_extensions[%s]', v_i),
                format('expected {"json_path": "<a.b.c>", "expression": "<sql>"}, got %s', v_ext));
        end if;
        v_path := v_ext ->> 'json_path';
        if v_path !~ '^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$' then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, format('payload_extensions[%s].json_path', v_i),
                format('malformed json_path %L: use dot-separated names of letters, digits and "_"', v_path));
        end if;
        if split_part(v_path, '.', 1) = any (v_reserved) then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, format('payload_extensions[%s].json_path', v_i),
                format('json_path %L would overwrite the payload key %L', v_path, split_part(v_path, '.', 1)));
        end if;
        if exists (select 1 from unnest(v_paths) p
                   where p = v_path or p like v_path || '.%' or v_path like p || '.%') then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, format('payload_extensions[%s].json_path', v_i),
                format('json_path %L conflicts with another extension path', v_path));
        end if;
        v_paths := v_paths || v_path;
        perform pgstream._expression_type(p_sub, format('payload_extensions[%s].expression', v_i),
                                          v_ext ->> 'expression');
    end loop;
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Code generation helpers.

-- jsonb_build_object() takes at most 100 arguments: chunk the pairs and concatenate.
create or replace function pgstream._jsonb_object_sql(p_pairs text[])
returns text
language sql
immutable
set search_path = ''
as $$
    select coalesce(
        string_agg(format('jsonb_build_object(%s)', chunk), ' || ' order by n),
        '''{}''::jsonb')
    from (
        select (ord - 1) / 50 as n, string_agg(pair, ', ' order by ord) as chunk
        from unnest(p_pairs) with ordinality as t(pair, ord)
        group by 1
    ) chunks
$$;

create or replace function pgstream._row_object_sql(p_alias text, p_columns text[])
returns text
language sql
immutable
set search_path = ''
as $$
    select pgstream._jsonb_object_sql(coalesce(
        array(select format('%L, %s.%I', c, p_alias, c)
              from unnest(p_columns) with ordinality as t(c, ord) order by ord),
        '{}'))
$$;

-- Builds the jsonb expression for payload extensions. p_items is an array of
-- {"parts": [path elements], "expr": sql}; paths sharing a top key merge into one object.
create or replace function pgstream._extensions_sql(p_items jsonb)
returns text
language plpgsql
immutable
set search_path = ''
as $$
declare
    v_group record;
    v_pairs text[] := '{}';
begin
    for v_group in
        select e -> 'parts' ->> 0 as k,
               bool_or(jsonb_array_length(e -> 'parts') = 1) as leaf,
               min(e ->> 'expr') as expr,
               jsonb_agg(jsonb_build_object('parts', (e -> 'parts') - 0, 'expr', e -> 'expr')) as rest
        from jsonb_array_elements(p_items) e
        group by 1
        order by 1
    loop
        if v_group.leaf then
            v_pairs := v_pairs || format('%L, (%s)', v_group.k, v_group.expr);
        else
            v_pairs := v_pairs || format('%L, %s', v_group.k, pgstream._extensions_sql(v_group.rest));
        end if;
    end loop;
    return pgstream._jsonb_object_sql(v_pairs);
end
$$;

create or replace function pgstream.trigger_function_name(
    p_schema text, p_table text, p_op pgstream.operation_type
)
returns text
language sql
immutable
set search_path = ''
as $$
    -- hashed on the quoted, schema-qualified name: public.users and auth.users never collide
    select '_publish_' || lower(p_op::text) || '_' || substr(md5(format('%I.%I', p_schema, p_table)), 1, 16)
$$;

create or replace function pgstream.trigger_name(p_op pgstream.operation_type)
returns text
language sql
immutable
as $$ select 'pgstream_' || lower(p_op::text) $$;

-- The generated trigger (function source and WHEN clause) for one target, or null when no
-- subscription targets it. Deterministic: subscriptions are emitted in (stream_id, key, id) order.
create or replace function pgstream.generated_trigger(
    p_schema text, p_table text, p_op pgstream.operation_type,
    out function_body text, out when_clause text
)
language plpgsql
stable
set search_path = ''
as $$
declare
    v_blocks text;
    v_new    text;
    v_old    text;
begin
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
               pgstream._extensions_sql(coalesce((
                   select jsonb_agg(jsonb_build_object('parts', to_jsonb(string_to_array(x ->> 'json_path', '.')),
                                                       'expr', x ->> 'expression') order by o)
                   from jsonb_array_elements(s.payload_extensions) with ordinality as e(x, o)), '[]'::jsonb)),
               s.stream_id,
               s.metadata), '' order by s.stream_id, s.key, s.id)
    into when_clause, v_blocks
    from pgstream.subscriptions s
    where s.schema_name = p_schema and s.table_name = p_table and s.operation = p_op;

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
end
$$;

-- Regenerates the trigger of one (schema, table, operation) from the current subscriptions. A
-- definition identical to the installed one is left untouched (same trigger oid), which is what
-- makes set_subscriptions() with unchanged input free.
create or replace function pgstream.regenerate_trigger(
    p_schema text, p_table text, p_op pgstream.operation_type
)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_fn      text := pgstream.trigger_function_name(p_schema, p_table, p_op);
    v_trg     text := pgstream.trigger_name(p_op);
    v_rel     regclass := to_regclass(format('%I.%I', p_schema, p_table));
    v_gen     record;
    v_hash    text;
    v_current text;
    v_guard   text := coalesce(current_setting('pgstream.internal_ddl', true), '');
begin
    perform pg_advisory_xact_lock(pg_catalog.hashtext('pgstream.regenerate'));
    select * into v_gen from pgstream.generated_trigger(p_schema, p_table, p_op);

    if v_rel is not null then
        select obj_description(t.oid, 'pg_trigger') into v_current
        from pg_catalog.pg_trigger t where t.tgrelid = v_rel and t.tgname = v_trg;
    end if;
    v_hash := 'pgstream generated ' || md5(coalesce(v_gen.function_body, '') || '|' || coalesce(v_gen.when_clause, ''));
    if v_gen.function_body is not null and v_current is not distinct from v_hash then
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
                       format('pgstream trigger function for %s on %I.%I', p_op, p_schema, p_table));
        execute format('create constraint trigger %I after %s on %s deferrable initially deferred '
                       'for each row %s execute function pgstream.%I()',
                       v_trg, p_op, v_rel,
                       case when v_gen.when_clause is null then '' else format('when (%s)', v_gen.when_clause) end,
                       v_fn);
        execute format('comment on trigger %I on %s is %L', v_trg, v_rel, v_hash);
    end if;
    perform set_config('pgstream.internal_ddl', v_guard, true);
    return true;
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Triggers on pgstream.subscriptions.

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
    if tg_op = 'UPDATE' then
        new.updated_at := now();
    end if;
    perform pgstream.validate_subscription(new);
    perform pgstream.ensure_stream(new.stream_id);
    return new;
end
$$;

drop trigger if exists validate_subscription on pgstream.subscriptions;
create trigger validate_subscription
before insert or update on pgstream.subscriptions
for each row execute function pgstream._subscription_before_write();

create or replace function pgstream._subscriptions_changed()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
declare
    v_target record;
begin
    -- transition tables exist per trigger event: new_rows for INSERT/UPDATE, old_rows for UPDATE/DELETE
    for v_target in execute format(
        'select distinct schema_name, table_name, operation from (%s) t order by 1, 2, 3',
        case tg_op
            when 'INSERT' then 'select schema_name, table_name, operation from new_rows'
            when 'DELETE' then 'select schema_name, table_name, operation from old_rows'
            else 'select schema_name, table_name, operation from new_rows
                  union all select schema_name, table_name, operation from old_rows'
        end)
    loop
        perform pgstream.regenerate_trigger(v_target.schema_name, v_target.table_name, v_target.operation);
    end loop;
    return null;
end
$$;

drop trigger if exists subscriptions_inserted on pgstream.subscriptions;
create trigger subscriptions_inserted after insert on pgstream.subscriptions
referencing new table as new_rows
for each statement execute function pgstream._subscriptions_changed();

drop trigger if exists subscriptions_updated on pgstream.subscriptions;
create trigger subscriptions_updated after update on pgstream.subscriptions
referencing old table as old_rows new table as new_rows
for each statement execute function pgstream._subscriptions_changed();

drop trigger if exists subscriptions_deleted on pgstream.subscriptions;
create trigger subscriptions_deleted after delete on pgstream.subscriptions
referencing old table as old_rows
for each statement execute function pgstream._subscriptions_changed();

-- ---------------------------------------------------------------------------------------------
-- set_subscriptions: make the subscriptions of one stream exactly p_subscriptions, in one
-- transaction. Identity is (stream_id, key, schema_name, table_name, operation), the table's
-- unique key. Unchanged subscriptions are not written, so their triggers are not recreated.
-- With p_managed_by set, only subscriptions carrying that marker are removed when absent, and
-- written ones get the marker; subscriptions created by hand are left alone.
-- Returns one row per change: action in ('inserted', 'updated', 'deleted').
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

    create temporary table if not exists pgstream_set_subscriptions_input (
        key text, operation pgstream.operation_type, schema_name text, table_name text,
        when_clause text, column_names text[], metadata jsonb, payload_extensions jsonb,
        managed_by text
    ) on commit drop;
    truncate pg_temp.pgstream_set_subscriptions_input;
    insert into pg_temp.pgstream_set_subscriptions_input
    select s.key, s.operation, coalesce(nullif(btrim(s.schema_name), ''), 'public'), s.table_name,
           nullif(btrim(s.when_clause), ''), coalesce(s.column_names, '{}'), s.metadata,
           coalesce(s.payload_extensions, '[]'::jsonb), coalesce(p_managed_by, s.managed_by)
    from unnest(coalesce(p_subscriptions, '{}')) s;

    return query
    delete from pgstream.subscriptions t
    where t.stream_id = p_stream_id
      and (p_managed_by is null or t.managed_by is not distinct from p_managed_by)
      and not exists (
          select 1 from pg_temp.pgstream_set_subscriptions_input i
          where i.key = t.key and i.schema_name = t.schema_name
            and i.table_name = t.table_name and i.operation = t.operation)
    returning 'deleted'::text, t.key, t.schema_name, t.table_name, t.operation;

    return query
    update pgstream.subscriptions t
    set when_clause = i.when_clause,
        column_names = i.column_names,
        metadata = i.metadata,
        payload_extensions = i.payload_extensions,
        managed_by = i.managed_by
    from pg_temp.pgstream_set_subscriptions_input i
    where t.stream_id = p_stream_id
      and i.key = t.key and i.schema_name = t.schema_name
      and i.table_name = t.table_name and i.operation = t.operation
      and (t.when_clause is distinct from i.when_clause
           or t.column_names is distinct from i.column_names
           or t.metadata is distinct from i.metadata
           or t.payload_extensions is distinct from i.payload_extensions
           or t.managed_by is distinct from i.managed_by)
    returning 'updated'::text, t.key, t.schema_name, t.table_name, t.operation;

    return query
    insert into pgstream.subscriptions as t
        (key, stream_id, operation, schema_name, table_name, when_clause, column_names,
         metadata, payload_extensions, managed_by)
    select i.key, p_stream_id, i.operation, i.schema_name, i.table_name, i.when_clause,
           i.column_names, i.metadata, i.payload_extensions, i.managed_by
    from pg_temp.pgstream_set_subscriptions_input i
    where not exists (
        select 1 from pgstream.subscriptions t
        where t.stream_id = p_stream_id and t.key = i.key and t.schema_name = i.schema_name
          and t.table_name = i.table_name and t.operation = i.operation)
    order by i.key, i.schema_name, i.table_name, i.operation
    returning 'inserted'::text, t.key, t.schema_name, t.table_name, t.operation;

    truncate pg_temp.pgstream_set_subscriptions_input;
end
$$;
