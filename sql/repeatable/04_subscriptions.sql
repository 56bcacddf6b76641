-- Repeatable: subscriptions. Validation, trigger generation, the triggers on
-- pgstream.subscriptions and set_subscriptions(): everything that turns a subscription into
-- generated code, in one file, so that whatever changes how a trigger is generated re-applies
-- this file, whose last step brings every generated trigger up to date.
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.
--
-- Every change to pgstream.subscriptions is validated row by row *before* it is written, then the
-- trigger of each affected (schema, table, operation) is regenerated once per statement. Any error
-- aborts the statement, so triggers stay exactly as they were. Least privilege:
--   * Generated trigger functions are owned by pgstream_writer, a NOLOGIN, non-superuser role that
--     may do nothing but insert into pgstream.events (plus what an operator grants it for the
--     functions that expressions call). Everything a trigger runs (when_clause, payload and
--     metadata extensions, casts of column types to json, functions those call) runs as
--     pgstream_writer.
--   * Generated code qualifies every function, type and operator.
--   * Expressions are checked by a lexer that refuses anything whose token boundaries Postgres
--     could read differently, then by Postgres's parser in an always-rolled-back subtransaction,
--     as pgstream_writer (a temporary view created by a SECURITY DEFINER function that
--     pgstream_writer owns and that exists only inside that subtransaction): parsing a literal runs
--     its type's input function and a domain's CHECK, which must never run as the owner.
--     Aggregates, window functions, set-returning functions and subqueries are refused; every
--     function an expression calls must be executable by pgstream_writer.
--   * A when_clause is put into the trigger's WHEN (parsed by CREATE TRIGGER as the owner,
--     evaluated as the writing role before the trigger function is queued) only when it references
--     nothing but built-in functions that PUBLIC may execute and built-in types; otherwise it is
--     evaluated inside the trigger function, as pgstream_writer. The table is locked before the
--     check, so that its owner cannot retype a column between the check and CREATE TRIGGER.
--
-- Statement mode (subscriptions.trigger_mode = 'statement', INSERT and DELETE only): an AFTER ...
-- FOR EACH STATEMENT trigger with a transition table whose function writes all events of the
-- statement with one INSERT ... SELECT. Same payloads, same order (rows of the statement, then
-- subscriptions in (stream_id, key, id) order). Events are written at the end of the statement
-- rather than at commit; tg_table_name/tg_table_schema name the subscribed table. A table's
-- subscriptions for one operation may mix modes: each mode gets its own trigger (pgstream_<op>,
-- pgstream_<op>_stmt) and trigger function.
--
-- Metadata extensions (subscriptions.metadata_extensions) are payload extensions for the event's
-- metadata: validated and evaluated the same way, merged over the static metadata (computed values
-- win; along a path the static objects' other keys stay). A subscription without them generates
-- the static metadata literal, as before they existed.

-- ---------------------------------------------------------------------------------------------
-- Transactions running pgstream's own DDL (trigger regeneration) are recorded in
-- pgstream.internal_ddl, a table only the owner can write, so no session can pretend to be
-- pgstream to the drift guard.
-- The relation a subscription names, found by name in the catalog (null: none). Every role may read
-- pg_class and pg_namespace, so this needs no USAGE on the table's schema, unlike to_regclass: the
-- drift guard runs as the owner on every role's DDL, in schemas the owner may not use.
create or replace function pgstream._relid(p_schema text, p_table text)
returns pg_catalog.oid
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select c.oid from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
    where n.nspname = p_schema and c.relname = p_table
$$;
revoke all on function pgstream._relid(text, text) from public;

create or replace function pgstream._internal_ddl_begin()
returns boolean
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    insert into pgstream.internal_ddl (xid) values (pg_catalog.pg_current_xact_id())
    on conflict (xid) do nothing
    returning true
$$;
revoke all on function pgstream._internal_ddl_begin() from public;

create or replace function pgstream._internal_ddl_end(p_begun boolean)
returns void
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    delete from pgstream.internal_ddl where p_begun and xid = pg_catalog.pg_current_xact_id()
$$;
revoke all on function pgstream._internal_ddl_end(boolean) from public;

create or replace function pgstream._in_internal_ddl()
returns boolean
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select 1 from pgstream.internal_ddl
                   where xid = pg_catalog.pg_current_xact_id_if_assigned())
$$;
revoke all on function pgstream._in_internal_ddl() from public;

-- ---------------------------------------------------------------------------------------------
-- Error helper: every validation error names the subscription and the offending part.
create or replace function pgstream._subscription_error(
    p_key text, p_stream_id bigint, p_op pgstream.operation_type, p_schema text, p_table text,
    p_part text, p_message text
)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    raise exception 'pgstream: subscription "%" (stream %, % on %.%): %: %',
        p_key, p_stream_id, p_op, p_schema, p_table, p_part, p_message
        using errcode = 'invalid_parameter_value',
              hint = 'Fix the subscription; nothing was changed.';
end
$$;
revoke all on function pgstream._subscription_error(text, bigint, pgstream.operation_type, text, text, text, text) from public;

-- ---------------------------------------------------------------------------------------------
-- Lexical guard. The text is embedded in generated code, so it must be exactly one expression:
-- no statement separator, comment, dollar quote or parameter; balanced parentheses that never
-- close more than they opened; and every string literal must end at the same place whether
-- Postgres reads it as an escape string (E'...', or any string with standard_conforming_strings
-- off) or as a standard one, so that no prefix rule can make Postgres see a token boundary this
-- check did not see. Returns null when acceptable, else the reason.
create or replace function pgstream._string_literal_end(p_text text, p_start integer, p_escapes boolean)
returns integer
language plpgsql
immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_len integer := pg_catalog.length(p_text);
    v_i   integer := p_start + 1;
    v_c   text;
begin
    while v_i <= v_len loop
        v_c := pg_catalog.substr(p_text, v_i, 1);
        if p_escapes and v_c = E'\\' then
            v_i := v_i + 2;
        elsif v_c = '''' then
            if pg_catalog.substr(p_text, v_i + 1, 1) = '''' then
                v_i := v_i + 2;
            else
                return v_i;
            end if;
        else
            v_i := v_i + 1;
        end if;
    end loop;
    return null;
end
$$;
revoke all on function pgstream._string_literal_end(text, integer, boolean) from public;

create or replace function pgstream._expression_lexical_error(p_text text)
returns text
language plpgsql
immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_len   integer := pg_catalog.length(p_text);
    v_i     integer := 1;
    v_c     text;
    v_depth integer := 0;
    v_std   integer;
    v_esc   integer;
begin
    if p_text is null or pg_catalog.btrim(p_text) = '' then
        return 'the expression is empty';
    end if;
    while v_i <= v_len loop
        v_c := pg_catalog.substr(p_text, v_i, 1);
        if v_c = '''' then
            v_std := pgstream._string_literal_end(p_text, v_i, false);
            v_esc := pgstream._string_literal_end(p_text, v_i, true);
            if v_std is null and v_esc is null then
                return 'unterminated quoted string';
            end if;
            if v_std is distinct from v_esc then
                return pg_catalog.format(
                    'ambiguous string literal at character %s: a backslash before a quote ends the string in '
                    '''...'' but not in E''...'' (or with standard_conforming_strings off); write '''' for a quote',
                    v_i);
            end if;
            v_i := v_std + 1;
            continue;
        elsif v_c = '"' then
            v_i := v_i + 1;
            loop
                if v_i > v_len then
                    return 'unterminated quoted identifier';
                end if;
                if pg_catalog.substr(p_text, v_i, 1) = '"' then
                    if pg_catalog.substr(p_text, v_i + 1, 1) = '"' then
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
            return 'dollar quoting, parameters and "$" in names are not allowed';
        elsif v_c = '-' and pg_catalog.substr(p_text, v_i + 1, 1) = '-' then
            return 'comments ("--") are not allowed';
        elsif v_c = '/' and pg_catalog.substr(p_text, v_i + 1, 1) = '*' then
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
revoke all on function pgstream._expression_lexical_error(text) from public;

-- The FROM clause that gives an expression the row variables its trigger has:
-- INSERT -> new, DELETE -> old, UPDATE -> new and old.
create or replace function pgstream._row_sources(p_op pgstream.operation_type, p_schema text, p_table text)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select case p_op
        when 'INSERT' then format('from %I.%I as new', p_schema, p_table)
        when 'DELETE' then format('from %I.%I as old', p_schema, p_table)
        else format('from %I.%I as new cross join %I.%I as old', p_schema, p_table, p_schema, p_table)
    end
$$;
revoke all on function pgstream._row_sources(pgstream.operation_type, text, text) from public;

-- Whether a table is partitioned: its subscriptions' triggers are then statement triggers on it
-- and on each of its partitions, in both modes (see _sync_partition_triggers).
create or replace function pgstream._is_partitioned(p_schema text, p_table text)
returns boolean
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce((select c.relkind = 'p' from pg_catalog.pg_class c
                     where c.oid = pgstream._relid(p_schema, p_table)), false)
$$;
revoke all on function pgstream._is_partitioned(text, text) from public;

-- ---------------------------------------------------------------------------------------------
-- Runs p_sql as pgstream_writer, inside the caller's always-rolled-back subtransaction: a SECURITY
-- DEFINER function owned by pgstream_writer, created in this session's temporary schema inside that
-- subtransaction, so no other transaction ever sees it and whatever the code it runs does (to the
-- function or anything else) is rolled back with it. Used for every parse of an expression a
-- non-owner role controls: parsing a literal runs its type's input function (and a domain's CHECK),
-- which must never run as the owner. pgstream_writer needs TEMP on the database (PUBLIC has it by
-- default). Only _expression_check calls it, and only inside its subtransaction.
-- Raises, naming the grant, when pgstream_writer may not create temporary objects (p_what: what
-- needs them).
create or replace function pgstream._writer_temp_check(p_what text)
returns void
language plpgsql
stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pg_catalog.has_database_privilege('pgstream_writer', pg_catalog.current_database(), 'TEMP') then
        raise exception 'pgstream: role pgstream_writer has no TEMP privilege on database %: pgstream''s % runs '
                        'user code as that role, in a function of the session''s temporary schema: grant temp on '
                        'database % to pgstream_writer',
            pg_catalog.current_database(), p_what, pg_catalog.quote_ident(pg_catalog.current_database())
            using errcode = 'insufficient_privilege',
                  hint = pg_catalog.format('As a superuser or the database owner: grant temp on database %I to pgstream_writer;',
                                           pg_catalog.current_database());
    end if;
end
$$;
revoke all on function pgstream._writer_temp_check(text) from public;

-- Raises when this session's temporary schema holds a relation named p_name that the current role
-- does not own: code that ran as pgstream_writer in this session (a backfill chunk, a trigger fired
-- by the owner's own writes) may have created it, with triggers or rules that would run as whoever
-- writes it. Owner code that keeps a temporary table by a fixed name checks it first.
create or replace function pgstream._temp_table_check(p_name text)
returns void
language plpgsql
stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_owner pg_catalog.oid;
begin
    select c.relowner into v_owner from pg_catalog.pg_class c
    where c.relnamespace = pg_catalog.pg_my_temp_schema() and c.relname = p_name;
    if v_owner is not null and v_owner <> (select r.oid from pg_catalog.pg_roles r where r.rolname = current_user) then
        raise exception 'pgstream: refusing to use temporary table pg_temp.%: it belongs to role %, not %',
            p_name, v_owner::pg_catalog.regrole, current_user
            using errcode = 'insufficient_privilege',
                  hint = 'Code that ran as that role in this session created it; end the session (or drop the table) and retry.';
    end if;
end
$$;
revoke all on function pgstream._temp_table_check(text) from public;

create or replace function pgstream._parse_as_writer(p_sql text)
returns void
language plpgsql
volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    v_fn text := 'pgstream_as_writer_' || pg_catalog.replace(pg_catalog.gen_random_uuid()::text, '-', '');
begin
    perform pgstream._writer_temp_check('expression check');
    execute pg_catalog.format(
        'create function pg_temp.%I(p_sql pg_catalog.text) returns pg_catalog.void language plpgsql '
        'security definer set search_path = pg_catalog, pg_temp as %L', v_fn,
        'begin execute p_sql; end');
    execute pg_catalog.format('alter function pg_temp.%I(pg_catalog.text) owner to pgstream_writer', v_fn);
    execute pg_catalog.format('select pg_temp.%I($1)', v_fn) using p_sql;
end
$$;
revoke all on function pgstream._parse_as_writer(text) from public;

-- The FROM clause of an expression's check: the row variables its trigger has, over p_src, a
-- temporary table with the subscribed table's columns (pgstream_writer, which parses, needs no
-- USAGE on the table's schema).
create or replace function pgstream._row_sources_of(p_op pgstream.operation_type, p_src text)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select case p_op
        when 'INSERT' then pg_catalog.format('from pg_temp.%I as new', p_src)
        when 'DELETE' then pg_catalog.format('from pg_temp.%I as old', p_src)
        else pg_catalog.format('from pg_temp.%I as new cross join pg_temp.%I as old', p_src, p_src)
    end
$$;
revoke all on function pgstream._row_sources_of(pgstream.operation_type, text) from public;

-- Parses and type-checks one expression against the table's row, in an always-rolled-back
-- subtransaction, as pgstream_writer (_parse_as_writer): the expression becomes the single column
-- of a temporary view over a temporary copy of the table's columns, whose stored query tree the
-- owner then reads from the catalog. Raises a subscription error (naming the part) when it does not
-- parse, when it contains an aggregate, window function, set-returning function or subquery, or
-- when pgstream_writer, which evaluates it, may not use an object it references. Returns the
-- expression's type and whether it references nothing but built-in functions that PUBLIC may
-- execute and built-in types (then it may go into a trigger's WHEN, which CREATE TRIGGER parses as
-- the owner and the writing role evaluates).
create or replace function pgstream._expression_check(
    p_sub pgstream.subscriptions, p_part text, p_expr text,
    out expr_type pg_catalog.regtype, out builtin_only boolean
)
language plpgsql
volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_reason text := pgstream._expression_lexical_error(p_expr);
    v_id     text := pg_catalog.replace(pg_catalog.gen_random_uuid()::text, '-', '');
    v_view   text := 'pgstream_check_' || v_id;
    v_src    text := 'pgstream_row_' || v_id;
    v_table  pg_catalog.oid := pgstream._relid(p_sub.schema_name, p_sub.table_name);
    v_srcrel pg_catalog.oid;
    v_rel    pg_catalog.oid;
    v_rule   pg_catalog.oid;
    v_query  text;
    v_funcs  pg_catalog.oid[];  -- every function it calls, built-ins and operators' functions included
    v_done   boolean := false;  -- not rolled back: tells our own rollback from one raised by the parsed code
begin
    if v_reason is null and v_table is null then
        v_reason := pg_catalog.format('table %I.%I does not exist', p_sub.schema_name, p_sub.table_name);
    end if;
    if v_reason is null then
        begin
            -- the row source: the table's columns (types, typmods, collations), no data, no code
            execute pg_catalog.format('create temporary table %I (%s)', v_src, coalesce((
                select pg_catalog.string_agg(pg_catalog.format('%I %s%s', a.attname,
                           pg_catalog.format_type(a.atttypid, a.atttypmod),
                           case when a.attcollation <> 0
                                then ' collate ' || a.attcollation::pg_catalog.regcollation::text else '' end),
                           ', ' order by a.attnum)
                from pg_catalog.pg_attribute a
                where a.attrelid = v_table and a.attnum > 0 and not a.attisdropped), ''));
            v_srcrel := pg_catalog.to_regclass(pg_catalog.format('pg_temp.%I', v_src));
            perform pgstream._parse_as_writer(pg_catalog.format(
                'create temporary view %I as select (%s) as v %s limit 0',
                v_view, p_expr, pgstream._row_sources_of(p_sub.operation, v_src)));
            select c.oid into v_rel from pg_catalog.pg_class c
            where c.relname = v_view and c.relnamespace = pg_catalog.pg_my_temp_schema()
              and c.relowner = 'pgstream_writer'::pg_catalog.regrole;
            if v_rel is null then
                raise exception 'the expression''s check view is missing';
            end if;
            select a.atttypid::pg_catalog.regtype into expr_type
            from pg_catalog.pg_attribute a where a.attrelid = v_rel and a.attname = 'v';
            select r.oid, r.ev_action::text into v_rule, v_query
            from pg_catalog.pg_rewrite r where r.ev_class = v_rel;
            v_funcs := array(
                select m[1]::pg_catalog.oid
                from pg_catalog.regexp_matches(v_query, ':(?:funcid|opfuncid|hashfuncid|negfuncid) ([0-9]+)', 'g') m);

            v_reason := case
                when v_query ~ ':hasAggs true' then 'aggregate functions are not allowed'
                when v_query ~ ':hasWindowFuncs true' then 'window functions are not allowed'
                when v_query ~ ':hasTargetSRFs true' then 'set-returning functions are not allowed'
                when v_query ~ ':hasSubLinks true' then 'subqueries are not allowed'
            end;

            -- objects the expression references other than the row source (built-in objects
            -- are pinned and never recorded), and every function it calls: pgstream_writer, which
            -- evaluates it, must be able to use each of them
            if v_reason is null then
                select pg_catalog.format('uses %s %s, which role pgstream_writer may not use: %s',
                                         o.type, n.name, pg_catalog.concat_ws('; ', g.usage, g.execute))
                into v_reason
                from pg_catalog.pg_depend d
                cross join lateral pg_catalog.pg_identify_object(d.refclassid, d.refobjid, 0) o
                cross join lateral (select case when d.refclassid = 'pg_catalog.pg_proc'::pg_catalog.regclass
                                                then d.refobjid::pg_catalog.regprocedure::text
                                                else o.identity end) as n(name)
                cross join lateral (
                    select case when o.schema is not null
                                     and not pg_catalog.has_schema_privilege('pgstream_writer', o.schema, 'USAGE')
                                then pg_catalog.format('grant usage on schema %I to pgstream_writer', o.schema) end,
                           case when d.refclassid = 'pg_catalog.pg_proc'::pg_catalog.regclass
                                     and not pg_catalog.has_function_privilege('pgstream_writer', d.refobjid, 'EXECUTE')
                                then pg_catalog.format('grant execute on function %s to pgstream_writer', n.name) end
                ) as g(usage, execute)
                where d.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass and d.objid = v_rule
                  and not (d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass and d.refobjid in (v_rel, v_srcrel))
                  and coalesce(g.usage, g.execute) is not null
                limit 1;
            end if;
            if v_reason is null then
                select pg_catalog.format(
                           'calls %s, which role pgstream_writer may not execute: grant execute on function %s to pgstream_writer',
                           f::pg_catalog.regprocedure, f::pg_catalog.regprocedure)
                into v_reason
                from pg_catalog.unnest(v_funcs) f
                where not pg_catalog.has_function_privilege('pgstream_writer', f, 'EXECUTE')
                limit 1;
            end if;

            -- built-in only: no object recorded as a dependency but the row source, every function
            -- in pg_catalog and executable by PUBLIC, and every type the tree names (constants,
            -- columns, casts, results) created at initdb (oid < 16384: no domain, enum, composite
            -- or array of the table owner's, whose input function or CHECK could run user code)
            builtin_only := not exists (
                    select 1 from pg_catalog.pg_depend d
                    where d.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass and d.objid = v_rule
                      and not (d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
                               and d.refobjid in (v_rel, v_srcrel)))
                and not exists (
                    select 1 from pg_catalog.unnest(v_funcs) f
                    join pg_catalog.pg_proc p on p.oid = f
                    where p.pronamespace <> 'pg_catalog'::pg_catalog.regnamespace
                       or p.oid >= 16384
                       or not pg_catalog.has_function_privilege('public', f, 'EXECUTE'))
                and not exists (
                    select 1
                    from pg_catalog.regexp_matches(v_query, ':[a-z_]*(?:type|typeid|typid) ([0-9]+)', 'g') m
                    where m[1]::pg_catalog.oid >= 16384);
            v_done := true;
            -- roll back: the view never outlives the check, whatever the expression did to the parser
            raise exception using errcode = 'PGSRB', message = 'pgstream expression check rolled back';
        exception
            when sqlstate 'PGSRB' then
                if not v_done then
                    v_reason := 'the expression raised while it was parsed';
                end if;
            when others then
                get stacked diagnostics v_reason = message_text;
                -- pgstream_writer parses: a name in a schema it may not use does not resolve
                if v_reason ~ '^permission denied for schema ' then
                    v_reason := pg_catalog.format(
                        'uses schema %s, which role pgstream_writer may not use: grant usage on schema %s to pgstream_writer',
                        pg_catalog.substr(v_reason, 30), pg_catalog.quote_ident(pg_catalog.substr(v_reason, 30)));
                end if;
        end;
    end if;
    builtin_only := coalesce(builtin_only, false);
    if v_reason is not null then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, p_part, v_reason);
    end if;
end
$$;
revoke all on function pgstream._expression_check(pgstream.subscriptions, text, text) from public;

-- The type of an expression (used by _validate_subscription_003).
create or replace function pgstream._expression_type(
    p_sub pgstream.subscriptions, p_part text, p_expr text
)
returns pg_catalog.regtype
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    select c.expr_type from pgstream._expression_check(p_sub, p_part, p_expr) c
$$;
revoke all on function pgstream._expression_type(pgstream.subscriptions, text, text) from public;

-- Validates the extensions of one kind (p_field: 'payload_extensions' or 'metadata_extensions'):
-- a JSON array of {"json_path", "expression"} objects, each path well-formed, not starting with a
-- reserved key (p_reserved: the base payload's keys) and not clashing with another path, each
-- expression checked by _expression_check. Raises on the first problem, naming the element.
create or replace function pgstream._validate_extensions(
    p_sub pgstream.subscriptions, p_field text, p_items jsonb, p_reserved text[]
)
returns void
language plpgsql
volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_ext   jsonb;
    v_path  text;
    v_paths text[] := '{}';
    v_i     integer := 0;
begin
    if pg_catalog.jsonb_typeof(p_items) is distinct from 'array' then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, p_field,
            'must be a JSON array of {"json_path": ..., "expression": ...} objects');
    end if;
    for v_ext in select e from pg_catalog.jsonb_array_elements(p_items) e loop
        v_i := v_i + 1;
        if pg_catalog.jsonb_typeof(v_ext) <> 'object'
           or pg_catalog.jsonb_typeof(v_ext -> 'json_path') is distinct from 'string'
           or pg_catalog.jsonb_typeof(v_ext -> 'expression') is distinct from 'string'
           or exists (select 1 from pg_catalog.jsonb_object_keys(v_ext) k where k not in ('json_path', 'expression')) then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, pg_catalog.format('%s[%s]', p_field, v_i),
                pg_catalog.format('expected {"json_path": "<a.b.c>", "expression": "<sql>"}, got %s', v_ext));
        end if;
        v_path := v_ext ->> 'json_path';
        if v_path !~ '^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$' then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, pg_catalog.format('%s[%s].json_path', p_field, v_i),
                pg_catalog.format('malformed json_path %L: use dot-separated names of letters, digits and "_"', v_path));
        end if;
        if pg_catalog.split_part(v_path, '.', 1) = any (p_reserved) then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, pg_catalog.format('%s[%s].json_path', p_field, v_i),
                pg_catalog.format('json_path %L would overwrite the payload key %L', v_path,
                                  pg_catalog.split_part(v_path, '.', 1)));
        end if;
        if exists (select 1 from pg_catalog.unnest(v_paths) p
                   where p = v_path or p like v_path || '.%' or v_path like p || '.%') then
            perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
                p_sub.schema_name, p_sub.table_name, pg_catalog.format('%s[%s].json_path', p_field, v_i),
                pg_catalog.format('json_path %L conflicts with another extension path', v_path));
        end if;
        v_paths := v_paths || v_path;
        perform pgstream._expression_type(p_sub, pg_catalog.format('%s[%s].expression', p_field, v_i),
                                          v_ext ->> 'expression');
    end loop;
end
$$;
revoke all on function pgstream._validate_extensions(pgstream.subscriptions, text, jsonb, text[]) from public;

-- Validates a subscription's table, columns, when_clause, payload extensions and metadata
-- extensions without changing anything. Raises on the first problem, naming the subscription and
-- the part. (Its name is the one installs have carried since statement mode: validate_subscription
-- below adds the mode.)
create or replace function pgstream._validate_subscription_003(p_sub pgstream.subscriptions)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rel      oid;
    v_col      text;
    v_type     regtype;
    v_reserved constant text[] := array['tg_name', 'tg_op', 'tg_table_name', 'tg_table_schema',
                                        'timestamp', 'new', 'old'];
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

    perform pgstream._validate_extensions(p_sub, 'payload_extensions', p_sub.payload_extensions, v_reserved);

    perform pgstream._validate_extensions(p_sub, 'metadata_extensions',
                                          coalesce(p_sub.metadata_extensions, '[]'::jsonb), '{}');
    -- computed metadata is merged into the static metadata: that must be an object (or null)
    if pg_catalog.jsonb_array_length(coalesce(p_sub.metadata_extensions, '[]'::jsonb)) > 0
       and pg_catalog.jsonb_typeof(p_sub.metadata) not in ('object', 'null') then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'metadata',
            format('must be a JSON object (or null) for metadata_extensions to be merged into it, got a JSON %s',
                   pg_catalog.jsonb_typeof(p_sub.metadata)));
    end if;
end
$$;
revoke all on function pgstream._validate_subscription_003(pgstream.subscriptions) from public;

-- Validates a subscription completely (its trigger mode, then the rest) without changing anything.
create or replace function pgstream.validate_subscription(p_sub pgstream.subscriptions)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_sub.trigger_mode is null or p_sub.trigger_mode not in ('row', 'statement') then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'trigger_mode',
            format('must be ''row'' or ''statement'', got %s', coalesce(quote_literal(p_sub.trigger_mode), 'NULL')));
    end if;
    if p_sub.trigger_mode = 'statement' and p_sub.operation = 'UPDATE'
       and not pgstream._is_partitioned(p_sub.schema_name, p_sub.table_name) then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'trigger_mode',
            'statement mode supports INSERT and DELETE only (and UPDATE on a partitioned table): an UPDATE '
            'statement''s old and new rows cannot be paired without a key; use trigger_mode ''row''');
    end if;
    -- a partitioned table's UPDATE trigger numbers the statement's old and new rows in this column
    if p_sub.operation = 'UPDATE' and pgstream._is_partitioned(p_sub.schema_name, p_sub.table_name)
       and exists (select 1 from pg_catalog.pg_attribute a
                   where a.attrelid = pgstream._relid(p_sub.schema_name, p_sub.table_name)
                     and a.attname = 'pgstream_pos' and a.attnum > 0 and not a.attisdropped) then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'table',
            'the column name pgstream_pos is reserved on a partitioned table with UPDATE subscriptions (it pairs '
            'a statement''s old and new rows): rename the column');
    end if;
    if coalesce(p_sub.emit_truncate, false) and p_sub.operation <> 'DELETE' then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, 'emit_truncate',
            'only a DELETE subscription takes TRUNCATE events (a TRUNCATE deletes rows); set it on the DELETE subscription');
    end if;
    perform pgstream._validate_subscription_003(p_sub);
end
$$;
revoke all on function pgstream.validate_subscription(pgstream.subscriptions) from public;

-- ---------------------------------------------------------------------------------------------
-- Code generation: every function, type and operator qualified.
create or replace function pgstream._jsonb_object_sql(p_pairs text[])
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(
        pg_catalog.string_agg(pg_catalog.format('pg_catalog.jsonb_build_object(%s)', chunk),
                              ' operator(pg_catalog.||) ' order by n),
        '''{}''::pg_catalog.jsonb')
    from (
        select (ord - 1) / 50 as n, pg_catalog.string_agg(pair, ', ' order by ord) as chunk
        from pg_catalog.unnest(p_pairs) with ordinality as t(pair, ord)
        group by 1
    ) chunks
$$;
revoke all on function pgstream._jsonb_object_sql(text[]) from public;

create or replace function pgstream._row_object_sql(p_alias text, p_columns text[])
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select pgstream._jsonb_object_sql(coalesce(
        -- %I leaves SQL's unreserved keywords bare, and PL/pgSQL reads its own reserved words that SQL does
        -- not reserve (pl_reserved_kwlist.h) as keywords after new. / old.: those are quoted too (only
        -- those: every other trigger keeps its code, so an upgrade regenerates none of them)
        array(select pg_catalog.format('%L::pg_catalog.text, %s.%s', c, p_alias,
                                       case when c operator(pg_catalog.=) any ('{begin,by,declare,execute,foreach,if,'
                                                                                'loop,strict,while}'::pg_catalog.text[])
                                            then '"' || c || '"' else pg_catalog.quote_ident(c) end)
              from pg_catalog.unnest(p_columns) with ordinality as t(c, ord) order by ord),
        '{}'))
$$;
revoke all on function pgstream._row_object_sql(text, text[]) from public;

-- The jsonb expression of a tree of extensions (p_items: [{"parts": [...], "expr": ...}]), built
-- over p_base (a JSON object, or null): at every level the object of computed keys is
-- concatenated onto the base's object at that path, so a computed value replaces its leaf only and
-- the base's other keys along the path stay (a base value that is not an object is replaced).
create or replace function pgstream._extensions_sql(p_items jsonb, p_base jsonb)
returns text
language plpgsql
immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_group record;
    v_pairs text[] := '{}';
    v_sql   text;
begin
    for v_group in
        select e -> 'parts' ->> 0 as k,
               pg_catalog.bool_or(pg_catalog.jsonb_array_length(e -> 'parts') = 1) as leaf,
               pg_catalog.min(e ->> 'expr') as expr,
               pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object('parts', (e -> 'parts') - 0, 'expr', e -> 'expr')) as rest
        from pg_catalog.jsonb_array_elements(p_items) e
        group by 1
        order by 1
    loop
        if v_group.leaf then
            v_pairs := v_pairs || pg_catalog.format('%L::pg_catalog.text, (%s)', v_group.k, v_group.expr);
        else
            v_pairs := v_pairs || pg_catalog.format('%L::pg_catalog.text, %s', v_group.k,
                pgstream._extensions_sql(v_group.rest,
                    case when pg_catalog.jsonb_typeof(p_base -> v_group.k) = 'object' then p_base -> v_group.k end));
        end if;
    end loop;
    v_sql := pgstream._jsonb_object_sql(v_pairs);
    if pg_catalog.jsonb_typeof(p_base) = 'object' and p_base <> '{}'::jsonb then
        v_sql := pg_catalog.format('%L::pg_catalog.jsonb operator(pg_catalog.||) %s', p_base, v_sql);
    end if;
    return v_sql;
end
$$;
revoke all on function pgstream._extensions_sql(jsonb, jsonb) from public;

-- The same without a base (payload extensions).
create or replace function pgstream._extensions_sql(p_items jsonb)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$ select pgstream._extensions_sql(p_items, null) $$;
revoke all on function pgstream._extensions_sql(jsonb) from public;

-- Extensions ([{"json_path": "a.b", "expression": ...}]) as the tree _extensions_sql takes.
create or replace function pgstream._extension_items(p_extensions jsonb)
returns jsonb
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce((
        select pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
                   'parts', pg_catalog.to_jsonb(pg_catalog.string_to_array(x ->> 'json_path', '.')),
                   'expr', x ->> 'expression') order by o)
        from pg_catalog.jsonb_array_elements(p_extensions) with ordinality as e(x, o)), '[]'::pg_catalog.jsonb)
$$;
revoke all on function pgstream._extension_items(jsonb) from public;

-- The extensions expression of one subscription.
create or replace function pgstream._subscription_extensions_sql(p_sub pgstream.subscriptions)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$ select pgstream._extensions_sql(pgstream._extension_items(p_sub.payload_extensions)) $$;
revoke all on function pgstream._subscription_extensions_sql(pgstream.subscriptions) from public;

-- The metadata expression of one subscription: its static metadata as a literal when it has no
-- metadata extensions (the code generated before metadata extensions existed, byte for byte), else
-- the computed keys merged over the static metadata (_extensions_sql).
create or replace function pgstream._metadata_sql(p_sub pgstream.subscriptions)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when pg_catalog.jsonb_array_length(coalesce(p_sub.metadata_extensions, '[]'::pg_catalog.jsonb)) = 0
                then pg_catalog.format('%L::pg_catalog.jsonb', p_sub.metadata)
                else pgstream._extensions_sql(pgstream._extension_items(p_sub.metadata_extensions), p_sub.metadata)
           end
$$;
revoke all on function pgstream._metadata_sql(pgstream.subscriptions) from public;

-- The payload expression of one subscription (row and statement mode; p_op_sql and the table
-- names are SQL: tg_* variables in row mode, literals in statement mode).
create or replace function pgstream._payload_sql(
    p_sub pgstream.subscriptions, p_name_sql text, p_op_sql text, p_table_sql text, p_schema_sql text, p_ts_sql text
)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format(
        'pg_catalog.jsonb_build_object(''tg_name''::pg_catalog.text, %s, ''tg_op''::pg_catalog.text, %s, '
        '''tg_table_name''::pg_catalog.text, %s, ''tg_table_schema''::pg_catalog.text, %s, '
        '''timestamp''::pg_catalog.text, %s, ''new''::pg_catalog.text, %s, ''old''::pg_catalog.text, %s)%s',
        p_name_sql, p_op_sql, p_table_sql, p_schema_sql, p_ts_sql,
        case when p_sub.operation = 'DELETE' then 'null::pg_catalog.jsonb'
             else pgstream._row_object_sql('new', p_sub.column_names) end,
        case when p_sub.operation = 'INSERT' then 'null::pg_catalog.jsonb'
             else pgstream._row_object_sql('old', p_sub.column_names) end,
        case when pg_catalog.jsonb_array_length(p_sub.payload_extensions) = 0 then ''
             else ' operator(pg_catalog.||) ' || pgstream._subscription_extensions_sql(p_sub) end)
$$;
revoke all on function pgstream._payload_sql(pgstream.subscriptions, text, text, text, text, text) from public;

-- Whether a subscription's when_clause may go into the trigger's WHEN (evaluated as the writing
-- role): it calls only built-in functions that PUBLIC may execute.
create or replace function pgstream._when_in_trigger(p_sub pgstream.subscriptions)
returns boolean
language plpgsql
volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_sub.when_clause is null then
        return false;
    end if;
    return (select c.builtin_only from pgstream._expression_check(p_sub, 'when_clause', p_sub.when_clause) c);
exception when others then
    -- an expression that no longer checks (its table changed while the guard was off) stays out of
    -- the WHEN: the trigger function reports the error when it runs
    return false;
end
$$;
revoke all on function pgstream._when_in_trigger(pgstream.subscriptions) from public;

-- ---------------------------------------------------------------------------------------------
-- Names. The row-mode names without a mode argument are the original signatures, still callable.
create or replace function pgstream.trigger_name(p_op pgstream.operation_type)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$ select 'pgstream_' || lower(p_op::text) $$;
revoke all on function pgstream.trigger_name(pgstream.operation_type) from public;

-- Names per mode: row mode has the names above, statement mode adds "_stmt"; mode 'truncate' (of
-- a table's DELETE subscriptions: the TRUNCATE trigger) is pgstream_truncate.
create or replace function pgstream.trigger_name(p_op pgstream.operation_type, p_mode text)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when p_mode = 'truncate' then 'pgstream_truncate'
                else 'pgstream_' || lower(p_op::text) || case when p_mode = 'statement' then '_stmt' else '' end end
$$;
revoke all on function pgstream.trigger_name(pgstream.operation_type, text) from public;

create or replace function pgstream.trigger_function_name(
    p_schema text, p_table text, p_op pgstream.operation_type
)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    -- hashed on the quoted, schema-qualified name: public.users and auth.users never collide
    select '_publish_' || lower(p_op::text) || '_' || substr(md5(format('%I.%I', p_schema, p_table)), 1, 16)
$$;
revoke all on function pgstream.trigger_function_name(text, text, pgstream.operation_type) from public;

create or replace function pgstream.trigger_function_name(
    p_schema text, p_table text, p_op pgstream.operation_type, p_mode text
)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select '_publish_' || case when p_mode = 'truncate' then 'truncate'
                               else lower(p_op::text) || case when p_mode = 'statement' then '_stmt' else '' end end
           || '_' || substr(md5(format('%I.%I', p_schema, p_table)), 1, 16)
$$;
revoke all on function pgstream.trigger_function_name(text, text, pgstream.operation_type, text) from public;

-- The generated triggers of one table, as (operation, mode): one per operation and trigger_mode
-- of its subscriptions, plus (DELETE, 'truncate') when it has a DELETE subscription.
create or replace function pgstream._trigger_modes(p_schema text, p_table text)
returns table (operation pgstream.operation_type, mode text)
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select distinct s.operation, s.trigger_mode from pgstream.subscriptions s
    where s.schema_name = p_schema and s.table_name = p_table
    union
    select 'DELETE'::pgstream.operation_type, 'truncate' from pgstream.subscriptions s
    where s.schema_name = p_schema and s.table_name = p_table and s.operation = 'DELETE'
$$;
revoke all on function pgstream._trigger_modes(text, text) from public;

-- The TRUNCATE trigger of a table with DELETE subscriptions (any mode): when one of them has not
-- opted in (emit_truncate), the TRUNCATE is refused, naming them; else each writes one event,
-- tg_op 'TRUNCATE', new and old null, named after the table truncated (a partition's TRUNCATE, or
-- each table of a partitioned table's TRUNCATE, is its own), with the static metadata. There is no
-- row: the when_clause and the extensions (expressions over rows) are not evaluated.
create or replace function pgstream._truncate_trigger_body(p_schema text, p_table text)
returns text
language plpgsql
stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_refused text;
    v_values  text;
    v_ts      constant text := '(pg_catalog.extract(''epoch''::pg_catalog.text, pg_catalog.now()) '
                               'operator(pg_catalog.*) 1000::pg_catalog.numeric)::pg_catalog.int8';
begin
    select pg_catalog.string_agg(pg_catalog.format('"%s" (stream %s)', s.key, s.stream_id), ', '
                                 order by s.stream_id, s.key, s.id) filter (where not s.emit_truncate),
           pg_catalog.string_agg(pg_catalog.format(
               '(pg_catalog.jsonb_build_object(''tg_name''::pg_catalog.text, %L::pg_catalog.text, '
               '''tg_op''::pg_catalog.text, ''TRUNCATE''::pg_catalog.text, '
               '''tg_table_name''::pg_catalog.text, tg_table_name, ''tg_table_schema''::pg_catalog.text, tg_table_schema, '
               '''timestamp''::pg_catalog.text, pgstream_ts.pgstream_ts_ms, '
               '''new''::pg_catalog.text, null::pg_catalog.jsonb, ''old''::pg_catalog.text, null::pg_catalog.jsonb), '
               '%s::pg_catalog.int8, %L::pg_catalog.jsonb)',
               s.key, s.stream_id, s.metadata),
               E',\n            ' order by s.stream_id, s.key, s.id) filter (where s.emit_truncate)
    into v_refused, v_values
    from pgstream.subscriptions s
    where s.schema_name = p_schema and s.table_name = p_table and s.operation = 'DELETE';

    if v_refused is not null then
        return pg_catalog.format(
$f$
begin
    raise exception 'pgstream: refusing TRUNCATE of %%.%%: DELETE subscriptions %% of %% take no TRUNCATE events (emit_truncate) and would silently keep its rows',
        tg_table_schema, tg_table_name, %L, %L
        using errcode = 'object_not_in_prerequisite_state',
              hint = 'Delete the rows instead, or set emit_truncate = true on those subscriptions to send them a TRUNCATE event.';
end
$f$, v_refused, pg_catalog.format('%I.%I', p_schema, p_table));
    end if;
    if v_values is null then
        return null;
    end if;
    return pg_catalog.format(
$f$
begin
    insert into pgstream.events (payload, stream_id, metadata)
    select e.payload, e.stream_id, e.metadata
    from (select %s) as pgstream_ts(pgstream_ts_ms)
    cross join lateral (values
            %s
    ) as e(payload, stream_id, metadata);
    return null;
end
$f$, v_ts, v_values);
end
$$;
revoke all on function pgstream._truncate_trigger_body(text, text) from public;

-- The generated trigger for one target and mode, or null when no subscription of that mode
-- targets it. Deterministic: subscriptions in (stream_id, key, id) order. Row mode: the WHEN is
-- the OR of the when_clauses when every subscription has one and each calls only built-ins;
-- each subscription's when_clause is (also) evaluated inside the function. Statement mode: no
-- WHEN; the filters go into the INSERT ... SELECT.
create or replace function pgstream.generated_trigger(
    p_schema text, p_table text, p_op pgstream.operation_type, p_mode text,
    out function_body text, out when_clause text
)
language plpgsql
volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_blocks text;
    v_count  integer;
    v_when   boolean;
    v_src    text := case p_op when 'DELETE' then 'old' else 'new' end;
    v_ts     constant text := '(pg_catalog.extract(''epoch''::pg_catalog.text, pg_catalog.now()) '
                              'operator(pg_catalog.*) 1000::pg_catalog.numeric)::pg_catalog.int8';
    v_parted boolean := pgstream._is_partitioned(p_schema, p_table);
    -- the statement's rows: INSERT and DELETE read their transition table; UPDATE pairs the old and
    -- new tables by position (Postgres fills both in the same order, a row moved to another
    -- partition included), and writes the events in that order
    v_from   text := case when p_op = 'UPDATE'
                          then 'cross join (select pg_catalog.row_number() over () as pgstream_pos, * from pgstream_old) as old
    join (select pg_catalog.row_number() over () as pgstream_pos, * from pgstream_new) as new
      on new.pgstream_pos operator(pg_catalog.=) old.pgstream_pos'
                          else pg_catalog.format('cross join pgstream_%s as %s', v_src, v_src) end;
    v_check  text := case when p_op = 'UPDATE' then $c$
    if (select pg_catalog.count(*) from pgstream_old) operator(pg_catalog.<>) (select pg_catalog.count(*) from pgstream_new) then
        raise exception 'pgstream: an UPDATE of % changed rows that cannot be paired (a trigger dropped a moved row?): no event written', tg_table_name
            using errcode = 'cardinality_violation';
    end if;$c$ else '' end;
begin
    if p_mode = 'row' and not v_parted then
        select pg_catalog.bool_and(pgstream._when_in_trigger(s)),
               pg_catalog.string_agg(pg_catalog.format('(%s)', s.when_clause), ' or ' order by s.stream_id, s.key, s.id),
               pg_catalog.string_agg(pg_catalog.format(
$b$    if %s then
        insert into pgstream.events (payload, stream_id, metadata)
        values (%s,
                %s::pg_catalog.int8, %s);
    end if;
$b$,
                   case when s.when_clause is null then 'true' else pg_catalog.format('(%s)', s.when_clause) end,
                   pgstream._payload_sql(s, pg_catalog.format('%L::pg_catalog.text', s.key), 'tg_op', 'tg_table_name',
                                         'tg_table_schema', 'v_ts'),
                   s.stream_id,
                   pgstream._metadata_sql(s)), '' order by s.stream_id, s.key, s.id)
        into v_when, when_clause, v_blocks
        from pgstream.subscriptions s
        where s.schema_name = p_schema and s.table_name = p_table and s.operation = p_op
          and s.trigger_mode = 'row';

        if v_blocks is null then
            function_body := null;
            when_clause := null;
            return;
        end if;
        if not v_when then
            when_clause := null;
        end if;
        function_body := pg_catalog.format(
$f$
declare
    v_ts pg_catalog.int8 := %s;
begin
%s    return null;
end
$f$, v_ts, v_blocks);
        return;
    end if;

    when_clause := null;
    if p_mode = 'truncate' then
        function_body := case when p_op = 'DELETE' then pgstream._truncate_trigger_body(p_schema, p_table) end;
        return;
    end if;
    if p_mode not in ('row', 'statement') or (p_op = 'UPDATE' and not v_parted) then
        function_body := null;
        return;
    end if;

    -- Per subscription: one row of (payload or null when filtered out, stream_id, metadata) for the
    -- VALUES list, and the whole body for when it is the only one (a plain filtered INSERT ... SELECT,
    -- about a third cheaper than the VALUES list). Computed metadata is filtered like the payload
    -- (no expression runs for a row the subscription does not take); static metadata is a literal.
    select pg_catalog.count(*),
           pg_catalog.string_agg(pg_catalog.format(
               '(case when %s then %s end, %s::pg_catalog.int8, %s%s)',
               x.filter, x.payload, s.stream_id,
               case when pg_catalog.jsonb_array_length(s.metadata_extensions) = 0 then x.metadata
                    else pg_catalog.format('case when %s then %s end', x.filter, x.metadata) end,
               case when p_op = 'UPDATE' then ', ' || x.n end),
               E',\n            ' order by s.stream_id, s.key, s.id),
           pg_catalog.min(pg_catalog.format(
$f$
#variable_conflict use_column
begin%s
    insert into pgstream.events (payload, stream_id, metadata)
    select %s,
           %s::pg_catalog.int8, %s
    from (select %s) as pgstream_ts(pgstream_ts_ms)
    %s
    where %s%s;
    return null;
end
$f$, v_check, x.payload, s.stream_id, x.metadata, v_ts, v_from, x.filter,
     case when p_op = 'UPDATE' then E'\n    order by old.pgstream_pos' else '' end))
    into v_count, v_blocks, function_body
    from pgstream.subscriptions s
    cross join lateral (select
        case when s.when_clause is null then 'true' else pg_catalog.format('(%s)', s.when_clause) end,
        pgstream._payload_sql(s, pg_catalog.format('%L::pg_catalog.text', s.key),
                              pg_catalog.format('%L::pg_catalog.text', p_op::text),
                              pg_catalog.format('%L::pg_catalog.text', p_table),
                              pg_catalog.format('%L::pg_catalog.text', p_schema), 'pgstream_ts.pgstream_ts_ms'),
        pgstream._metadata_sql(s),
        (select pg_catalog.count(*) from pgstream.subscriptions o
         where o.schema_name = p_schema and o.table_name = p_table and o.operation = p_op
           and o.trigger_mode = p_mode and (o.stream_id, o.key, o.id) <= (s.stream_id, s.key, s.id))
    ) as x(filter, payload, metadata, n)
    where s.schema_name = p_schema and s.table_name = p_table and s.operation = p_op
      and s.trigger_mode = p_mode;

    if v_count <= 1 then
        return;  -- none: null (min of no rows); one: its plain INSERT ... SELECT
    end if;
    function_body := pg_catalog.format(
$f$
#variable_conflict use_column
begin%s
    insert into pgstream.events (payload, stream_id, metadata)
    select e.payload, e.stream_id, e.metadata
    from (select %s) as pgstream_ts(pgstream_ts_ms)
    %s
    cross join lateral (values
            %s
    ) as e(payload, stream_id, metadata%s)
    where e.payload is not null%s;
    return null;
end
$f$, v_check, v_ts, v_from, v_blocks,
     case when p_op = 'UPDATE' then ', pgstream_sub' else '' end,
     case when p_op = 'UPDATE' then E'\n    order by old.pgstream_pos, e.pgstream_sub' else '' end);
end
$$;
revoke all on function pgstream.generated_trigger(text, text, pgstream.operation_type, text) from public;

-- The row-mode trigger (the original signature).
create or replace function pgstream.generated_trigger(
    p_schema text, p_table text, p_op pgstream.operation_type,
    out function_body text, out when_clause text
)
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    select g.function_body, g.when_clause from pgstream.generated_trigger(p_schema, p_table, p_op, 'row') g
$$;
revoke all on function pgstream.generated_trigger(text, text, pgstream.operation_type) from public;

-- The hash stored in the generated trigger's comment.
create or replace function pgstream.generated_trigger_hash(p_function_body text, p_when_clause text)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when p_function_body is not null
                then 'pgstream generated ' || pg_catalog.md5(p_function_body || '|' || coalesce(p_when_clause, ''))
           end
$$;
revoke all on function pgstream.generated_trigger_hash(text, text) from public;

-- The types of the columns subscriptions publish (column_names), as they are when the table's
-- triggers are generated: the drift guard refuses a change.
create or replace function pgstream._record_subscribed_columns(p_schema text, p_table text)
returns void
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    delete from pgstream.subscribed_columns where schema_name = p_schema and table_name = p_table;
    insert into pgstream.subscribed_columns (schema_name, table_name, column_name, type_oid, typmod)
    select distinct p_schema, p_table, a.attname::text, a.atttypid, a.atttypmod
    from pgstream.subscriptions s
    cross join lateral pg_catalog.unnest(s.column_names) as c(name)
    join pg_catalog.pg_attribute a
      on a.attrelid = pgstream._relid(p_schema, p_table)
     and a.attname = c.name and a.attnum > 0 and not a.attisdropped
    where s.schema_name = p_schema and s.table_name = p_table;
$$;
revoke all on function pgstream._record_subscribed_columns(text, text) from public;

-- The DDL of a generated trigger of one (operation, mode) on one table: a deferred constraint
-- trigger for each row (row mode on a table that is not partitioned), else a statement trigger with
-- the transition tables its operation reads (statement mode; both modes on a partitioned table and
-- on each of its partitions, where Postgres clones no statement trigger and moves a row as a delete
-- and an insert); mode 'truncate': AFTER TRUNCATE for each statement.
create or replace function pgstream._create_trigger_sql(
    p_trg text, p_op pgstream.operation_type, p_mode text, p_rel pg_catalog.regclass, p_partitioned boolean,
    p_when text, p_fn text
)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select case
        when p_mode = 'truncate' then pg_catalog.format(
            'create trigger %I after truncate on %s for each statement execute function pgstream.%I()',
            p_trg, p_rel, p_fn)
        when p_mode = 'row' and not p_partitioned then pg_catalog.format(
            'create constraint trigger %I after %s on %s deferrable initially deferred '
            'for each row %s execute function pgstream.%I()',
            p_trg, p_op, p_rel, case when p_when is null then '' else pg_catalog.format('when (%s)', p_when) end, p_fn)
        else pg_catalog.format(
            'create trigger %I after %s on %s %s for each statement execute function pgstream.%I()',
            p_trg, p_op, p_rel,
            case p_op when 'DELETE' then 'referencing old table as pgstream_old'
                      when 'INSERT' then 'referencing new table as pgstream_new'
                      else 'referencing old table as pgstream_old new table as pgstream_new' end,
            p_fn)
    end
$$;
revoke all on function pgstream._create_trigger_sql(text, pgstream.operation_type, text, pg_catalog.regclass, boolean, text, text) from public;

-- The copies of the generated statement trigger of one (operation, mode) on the partitions of a
-- partitioned subscribed table: every partition of its tree gets one (same name, function
-- and comment), and a table that carries one but is no longer in the tree (detached) loses it, as
-- does every table when the subscribed table has none. A copy is a trigger that calls the generated
-- function, whatever its name: one renamed (while the drift guard was off) is dropped and made
-- again under its name. A trigger of that name on a partition that calls anything else is not
-- pgstream's: p_what null (trigger regeneration, the owner's call) replaces it, with a WARNING naming
-- it; else (p_what names the DDL the drift guard checks) the DDL is refused, naming it. Called in
-- pgstream's own DDL (pgstream.internal_ddl) by trigger regeneration and by the drift guard after
-- CREATE TABLE ... PARTITION OF and ALTER TABLE ... ATTACH / DETACH PARTITION.
drop function if exists pgstream._sync_partition_triggers(text, text, pgstream.operation_type, text);
create or replace function pgstream._sync_partition_triggers(
    p_schema text, p_table text, p_op pgstream.operation_type, p_mode text, p_what text
)
returns void
language plpgsql
volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rel   pg_catalog.regclass := pgstream._relid(p_schema, p_table);
    v_trg   text := pgstream.trigger_name(p_op, p_mode);
    v_name  text := pgstream.trigger_function_name(p_schema, p_table, p_op, p_mode);
    v_fn    pg_catalog.oid := pg_catalog.to_regprocedure(pg_catalog.format('pgstream.%I()', v_name));
    v_root  record;
    v_part  record;
    v_other pg_catalog.regproc;
begin
    if v_fn is null then
        return;
    end if;
    select t.oid, pg_catalog.obj_description(t.oid, 'pg_trigger') as hash into v_root
    from pg_catalog.pg_trigger t
    where t.tgrelid = v_rel and t.tgname = v_trg and t.tgfoid = v_fn;
    for v_part in select t.tgrelid::pg_catalog.regclass as rel, t.tgname from pg_catalog.pg_trigger t
                  where t.tgfoid = v_fn and t.tgparentid = 0
                    and t.tgrelid is distinct from v_rel::pg_catalog.oid
                    and (v_root.oid is null or t.tgname <> v_trg
                         or not exists (select 1 from pg_catalog.pg_partition_tree(v_rel) p where p.relid = t.tgrelid)) loop
        execute pg_catalog.format('drop trigger %I on %s', v_part.tgname, v_part.rel);
    end loop;
    if v_root.oid is null or not pgstream._is_partitioned(p_schema, p_table) then
        return;
    end if;
    for v_part in select p.relid::pg_catalog.regclass as rel from pg_catalog.pg_partition_tree(v_rel) p
                  where p.relid <> v_rel
                    and not exists (select 1 from pg_catalog.pg_trigger t
                                    where t.tgrelid = p.relid and t.tgname = v_trg and t.tgfoid = v_fn)
                  order by p.level, p.relid loop
        -- a trigger of the generated name that is not pgstream's (it would keep the copy off the partition)
        select t.tgfoid::pg_catalog.regproc into v_other
        from pg_catalog.pg_trigger t where t.tgrelid = v_part.rel and t.tgname = v_trg;
        if found then
            if p_what is not null then
                raise exception 'pgstream: refusing %: the trigger % on % calls %(), not pgstream''s generated function, '
                                'and the subscriptions of % need that name on each of its partitions',
                    p_what, pg_catalog.quote_ident(v_trg), v_part.rel, v_other, v_rel
                    using errcode = 'duplicate_object',
                          hint = 'Rename or drop that trigger, then repeat the DDL (on a partition attached with it while '
                                 'the guard was off, pgstream.repair_trigger, run by pgstream''s owner, replaces it).';
            end if;
            raise warning 'pgstream: replacing the trigger % on % (it called %()): the subscriptions of % need that '
                          'name on each of its partitions', pg_catalog.quote_ident(v_trg), v_part.rel, v_other, v_rel;
            execute pg_catalog.format('drop trigger %I on %s', v_trg, v_part.rel);
        end if;
        execute pgstream._create_trigger_sql(v_trg, p_op, p_mode, v_part.rel, true, null, v_name);
        execute pg_catalog.format('comment on trigger %I on %s is %L', v_trg, v_part.rel, v_root.hash);
    end loop;
end
$$;
revoke all on function pgstream._sync_partition_triggers(text, text, pgstream.operation_type, text, text) from public;

-- Regenerates the trigger of one (schema, table, operation, mode). An identical definition is
-- left untouched (same trigger oid) unless p_force. The function belongs to pgstream_writer.
create or replace function pgstream._regenerate_trigger_mode(
    p_schema text, p_table text, p_op pgstream.operation_type, p_mode text, p_force boolean default false
)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    v_fn      text := pgstream.trigger_function_name(p_schema, p_table, p_op, p_mode);
    v_trg     text := pgstream.trigger_name(p_op, p_mode);
    v_rel     pg_catalog.regclass := pgstream._relid(p_schema, p_table);
    v_gen     record;
    v_old     record;
    v_hash    text;
    v_current text;
    v_owner   pg_catalog.name;
    v_fn_ok   boolean;  -- the function is as generated: its source, SECURITY DEFINER, its search_path
    v_begun   boolean;
    v_super   boolean := (select r.rolsuper from pg_catalog.pg_roles r where r.rolname = current_user);
begin
    -- first without a lock: a trigger that is as generated stays, and application writes never wait
    select * into v_gen from pgstream.generated_trigger(p_schema, p_table, p_op, p_mode);

    if v_rel is not null then
        select pg_catalog.obj_description(t.oid, 'pg_trigger') into v_current
        from pg_catalog.pg_trigger t where t.tgrelid = v_rel and t.tgname = v_trg;
    end if;
    select r.rolname,
           p.prosrc = v_gen.function_body and p.prosecdef
           and p.proconfig = array['search_path=pg_catalog, pg_temp']::text[]
    into v_owner, v_fn_ok
    from pg_catalog.pg_proc p join pg_catalog.pg_roles r on r.oid = p.proowner
    where p.oid = pg_catalog.to_regprocedure(pg_catalog.format('pgstream.%I()', v_fn));
    v_hash := pgstream.generated_trigger_hash(v_gen.function_body, v_gen.when_clause);
    if not p_force and v_gen.function_body is not null and v_current is not distinct from v_hash
       and v_owner = 'pgstream_writer' and v_fn_ok then
        -- unchanged; the partitions created or detached since get or lose their copy
        v_begun := pgstream._internal_ddl_begin();
        perform pgstream._sync_partition_triggers(p_schema, p_table, p_op, p_mode, null);
        perform pgstream._internal_ddl_end(v_begun);
        return false;
    end if;
    if v_gen.function_body is null and v_current is null and v_owner is null then
        return false;
    end if;

    -- something to create: the lock CREATE TRIGGER takes, then the check again under it, so the
    -- table's owner cannot retype a column between the check (built-in types only, parsed as
    -- pgstream_writer) and CREATE TRIGGER, which parses the WHEN as the owner
    if v_rel is not null then
        execute pg_catalog.format('lock table %s in share row exclusive mode', v_rel);
        select * into v_gen from pgstream.generated_trigger(p_schema, p_table, p_op, p_mode);
        v_hash := pgstream.generated_trigger_hash(v_gen.function_body, v_gen.when_clause);
    end if;
    v_begun := pgstream._internal_ddl_begin();
    if v_rel is not null then
        execute pg_catalog.format('drop trigger if exists %I on %s', v_trg, v_rel);
    end if;
    -- every trigger that calls the function, whatever its name and table: its copies on partitions,
    -- on tables detached while the guard was off, and one renamed while the guard was off
    for v_old in select t.tgname, t.tgrelid::pg_catalog.regclass as rel from pg_catalog.pg_trigger t
                 where t.tgfoid = pg_catalog.to_regprocedure(pg_catalog.format('pgstream.%I()', v_fn))
                   and t.tgparentid = 0 loop
        execute pg_catalog.format('drop trigger %I on %s', v_old.tgname, v_old.rel);
    end loop;
    execute pg_catalog.format('drop function if exists pgstream.%I()', v_fn);
    if v_gen.function_body is not null then
        execute pg_catalog.format(
            'create function pgstream.%I() returns trigger language plpgsql '
            'security definer set search_path = pg_catalog, pg_temp as %L', v_fn, v_gen.function_body);
        execute pg_catalog.format('revoke all on function pgstream.%I() from public', v_fn);
        execute pg_catalog.format('comment on function pgstream.%I() is %L', v_fn,
            pg_catalog.format('pgstream %s-mode trigger function for %s on %I.%I', p_mode, p_op, p_schema, p_table));
        -- a non-superuser owner needs CREATE on the schema for the new owner, for this moment only
        if not v_super then
            execute 'grant create on schema pgstream to pgstream_writer';
        end if;
        execute pg_catalog.format('alter function pgstream.%I() owner to pgstream_writer', v_fn);
        if not v_super then
            execute 'revoke create on schema pgstream from pgstream_writer';
        end if;
        execute pgstream._create_trigger_sql(v_trg, p_op, p_mode, v_rel, pgstream._is_partitioned(p_schema, p_table),
                                             v_gen.when_clause, v_fn);
        execute pg_catalog.format('comment on trigger %I on %s is %L', v_trg, v_rel, v_hash);
    end if;
    perform pgstream._sync_partition_triggers(p_schema, p_table, p_op, p_mode, null);
    perform pgstream._internal_ddl_end(v_begun);
    return true;
end
$$;
revoke all on function pgstream._regenerate_trigger_mode(text, text, pgstream.operation_type, text, boolean) from public;

-- Both modes of one (schema, table, operation), and the recorded types of its published columns.
-- p_force recreates them even when their comment matches (a function changed by hand, a trigger
-- dropped while the guard was off).
create or replace function pgstream._regenerate_triggers(
    p_schema text, p_table text, p_op pgstream.operation_type, p_force boolean
)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_row   boolean;
    v_stmt  boolean;
    v_trunc boolean := false;
begin
    perform pgstream.lock_for_transaction('regenerate');
    v_row := pgstream._regenerate_trigger_mode(p_schema, p_table, p_op, 'row', p_force);
    v_stmt := pgstream._regenerate_trigger_mode(p_schema, p_table, p_op, 'statement', p_force);
    if p_op = 'DELETE' then
        v_trunc := pgstream._regenerate_trigger_mode(p_schema, p_table, p_op, 'truncate', p_force);
    end if;
    perform pgstream._record_subscribed_columns(p_schema, p_table);
    return v_row or v_stmt or v_trunc;
end
$$;
revoke all on function pgstream._regenerate_triggers(text, text, pgstream.operation_type, boolean) from public;

-- Regenerates the triggers of one (schema, table, operation) from its subscriptions.
create or replace function pgstream.regenerate_trigger(p_schema text, p_table text, p_op pgstream.operation_type)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$ select pgstream._regenerate_triggers(p_schema, p_table, p_op, false) $$;
revoke all on function pgstream.regenerate_trigger(text, text, pgstream.operation_type) from public;

-- Recreates the triggers of one (schema, table, operation) even when their comment matches.
create or replace function pgstream.repair_trigger(p_schema text, p_table text, p_op pgstream.operation_type)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$ select pgstream._regenerate_triggers(p_schema, p_table, p_op, true) $$;
revoke all on function pgstream.repair_trigger(text, text, pgstream.operation_type) from public;

-- ---------------------------------------------------------------------------------------------
-- Triggers on pgstream.subscriptions: validate each row before it is written, then regenerate the
-- triggers of every (schema, table, operation) the statement touched.

create or replace function pgstream._subscription_before_write()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    new.schema_name := coalesce(nullif(btrim(new.schema_name), ''), 'public');
    new.when_clause := nullif(btrim(new.when_clause), '');
    new.column_names := coalesce(new.column_names, '{}');
    new.payload_extensions := coalesce(new.payload_extensions, '[]'::jsonb);
    new.metadata_extensions := coalesce(new.metadata_extensions, '[]'::jsonb);
    new.trigger_mode := coalesce(new.trigger_mode, 'row');
    new.emit_truncate := coalesce(new.emit_truncate, false);
    if tg_op = 'UPDATE' then
        new.updated_at := now();
    end if;
    perform pgstream.validate_subscription(new);
    perform pgstream.ensure_stream(new.stream_id);
    return new;
end
$$;
revoke all on function pgstream._subscription_before_write() from public;

create or replace trigger validate_subscription
before insert or update on pgstream.subscriptions
for each row execute function pgstream._subscription_before_write();

create or replace function pgstream._subscriptions_changed()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
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
revoke all on function pgstream._subscriptions_changed() from public;

create or replace trigger subscriptions_inserted after insert on pgstream.subscriptions
referencing new table as new_rows
for each statement execute function pgstream._subscriptions_changed();

create or replace trigger subscriptions_updated after update on pgstream.subscriptions
referencing old table as old_rows new table as new_rows
for each statement execute function pgstream._subscriptions_changed();

create or replace trigger subscriptions_deleted after delete on pgstream.subscriptions
referencing old table as old_rows
for each statement execute function pgstream._subscriptions_changed();

-- ---------------------------------------------------------------------------------------------
-- set_subscriptions: make the subscriptions of one stream exactly p_subscriptions, in one
-- transaction. Identity is (stream_id, key, schema_name, table_name, operation), the table's
-- unique key; trigger_mode is part of the definition. Unchanged subscriptions are not written, so
-- their triggers are not recreated. With p_managed_by set, only subscriptions carrying that marker
-- are removed when absent, and written ones get the marker; subscriptions created by hand are left
-- alone. Returns one row per change: action in ('inserted', 'updated', 'deleted').
create or replace function pgstream.set_subscriptions(
    p_stream_id bigint,
    p_subscriptions pgstream.subscriptions[],
    p_managed_by text default null
)
returns table (action text, key text, schema_name text, table_name text, operation pgstream.operation_type)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_bad record;
begin
    if p_stream_id is null then
        raise exception 'pgstream.set_subscriptions: p_stream_id must not be null'
            using errcode = 'invalid_parameter_value';
    end if;
    perform pgstream.lock_for_transaction('regenerate');

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

    -- (v4: emit_truncate; a new name, so that a table of an earlier shape created earlier in
    -- the same transaction is never reused)
    perform pgstream._temp_table_check('pgstream_set_subscriptions_input_v4');
    create temporary table if not exists pgstream_set_subscriptions_input_v4 (
        key text, operation pgstream.operation_type, schema_name text, table_name text,
        when_clause text, column_names text[], metadata jsonb, payload_extensions jsonb,
        managed_by text, trigger_mode text, metadata_extensions jsonb, emit_truncate boolean
    ) on commit drop;
    truncate pg_temp.pgstream_set_subscriptions_input_v4;
    insert into pg_temp.pgstream_set_subscriptions_input_v4
    select s.key, s.operation, coalesce(nullif(btrim(s.schema_name), ''), 'public'), s.table_name,
           nullif(btrim(s.when_clause), ''), coalesce(s.column_names, '{}'), s.metadata,
           coalesce(s.payload_extensions, '[]'::jsonb), coalesce(p_managed_by, s.managed_by),
           coalesce(s.trigger_mode, 'row'), coalesce(s.metadata_extensions, '[]'::jsonb),
           coalesce(s.emit_truncate, false)
    from unnest(coalesce(p_subscriptions, '{}')) s;

    return query
    delete from pgstream.subscriptions t
    where t.stream_id = p_stream_id
      and (p_managed_by is null or t.managed_by is not distinct from p_managed_by)
      and not exists (
          select 1 from pg_temp.pgstream_set_subscriptions_input_v4 i
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
        trigger_mode = i.trigger_mode,
        metadata_extensions = i.metadata_extensions,
        emit_truncate = i.emit_truncate
    from pg_temp.pgstream_set_subscriptions_input_v4 i
    where t.stream_id = p_stream_id
      and i.key = t.key and i.schema_name = t.schema_name
      and i.table_name = t.table_name and i.operation = t.operation
      and (t.when_clause is distinct from i.when_clause
           or t.column_names is distinct from i.column_names
           or t.metadata is distinct from i.metadata
           or t.payload_extensions is distinct from i.payload_extensions
           or t.managed_by is distinct from i.managed_by
           or t.trigger_mode is distinct from i.trigger_mode
           or t.metadata_extensions is distinct from i.metadata_extensions
           or t.emit_truncate is distinct from i.emit_truncate)
    returning 'updated'::text, t.key, t.schema_name, t.table_name, t.operation;

    return query
    insert into pgstream.subscriptions as t
        (key, stream_id, operation, schema_name, table_name, when_clause, column_names,
         metadata, payload_extensions, managed_by, trigger_mode, metadata_extensions, emit_truncate)
    select i.key, p_stream_id, i.operation, i.schema_name, i.table_name, i.when_clause,
           i.column_names, i.metadata, i.payload_extensions, i.managed_by, i.trigger_mode, i.metadata_extensions,
           i.emit_truncate
    from pg_temp.pgstream_set_subscriptions_input_v4 i
    where not exists (
        select 1 from pgstream.subscriptions t
        where t.stream_id = p_stream_id and t.key = i.key and t.schema_name = i.schema_name
          and t.table_name = i.table_name and t.operation = i.operation)
    order by i.key, i.schema_name, i.table_name, i.operation
    returning 'inserted'::text, t.key, t.schema_name, t.table_name, t.operation;

    truncate pg_temp.pgstream_set_subscriptions_input_v4;
end
$$;
revoke all on function pgstream.set_subscriptions(bigint, pgstream.subscriptions[], text) from public;

-- ---------------------------------------------------------------------------------------------
-- Every generated trigger up to date with the code above. Runs each time this file is applied:
-- on an install that predates a change to trigger generation (or to the execution model: owner
-- pgstream_writer, search_path), each trigger whose generated text, WHEN or owner differs is
-- recreated; the others are left untouched (same trigger oid). A generated function whose target
-- has no subscription any more is dropped.
do $$
declare
    v_target record;
    v_begun  boolean := pgstream._internal_ddl_begin();
begin
    for v_target in select p.oid::pg_catalog.regprocedure as fn from pg_catalog.pg_proc p
                    where p.pronamespace = 'pgstream'::pg_catalog.regnamespace and p.proname like '\_publish\_%'
                      and not exists (select 1 from pgstream.subscriptions s
                                      cross join lateral pgstream._trigger_modes(s.schema_name, s.table_name) m
                                      where pgstream.trigger_function_name(s.schema_name, s.table_name, m.operation,
                                                                           m.mode) = p.proname) loop
        execute pg_catalog.format('drop function %s cascade', v_target.fn);
    end loop;
    for v_target in select distinct s.schema_name, s.table_name, s.operation from pgstream.subscriptions s
                    where pgstream._relid(s.schema_name, s.table_name) is not null
                    order by 1, 2, 3 loop
        perform pgstream.regenerate_trigger(v_target.schema_name, v_target.table_name, v_target.operation);
    end loop;
    perform pgstream._internal_ddl_end(v_begun);
end
$$;
