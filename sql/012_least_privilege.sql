-- 012: least privilege. No code that a less privileged role controls runs with more privilege than
-- that role has.
--
--   * Generated trigger functions are owned by pgstream_writer, a NOLOGIN, non-superuser role that
--     may do nothing but insert into pgstream.events (plus what an operator grants it for the
--     functions that expressions call). Everything a trigger runs (when_clause, payload
--     extensions, casts of column types to json, functions those call) runs as pgstream_writer.
--   * Every function in the pgstream schema runs with search_path = pg_catalog, pg_temp: the
--     temporary schema comes last, so a session cannot shadow pg_catalog types or relations.
--     Generated code qualifies every function, type and operator.
--   * Expressions are checked by a lexer that refuses anything whose token boundaries Postgres
--     could read differently, then by Postgres's parser in an always-rolled-back subtransaction
--     (a temporary view; nothing is evaluated). Aggregates, window functions, set-returning
--     functions and subqueries are refused; every function an expression calls must be
--     executable by pgstream_writer.
--   * A when_clause is put into the trigger's WHEN (evaluated as the writing role, before the
--     trigger function is queued) only when it calls nothing but built-in functions that PUBLIC
--     may execute; otherwise it is evaluated inside the trigger function, as pgstream_writer.
--   * The drift guard has no session-settable bypass: pgstream's own DDL marks its transaction in
--     pgstream.internal_ddl, a table only the owner can write. Generated triggers cannot be
--     disabled, renamed or dropped, generated functions cannot be altered or dropped, and the
--     type of a column_names column cannot change while subscribed. A stale subscription no
--     longer blocks DDL on other tables.

-- ---------------------------------------------------------------------------------------------
-- The writer role.
do $$
begin
    if not exists (select 1 from pg_catalog.pg_roles where rolname = 'pgstream_writer') then
        begin
            create role pgstream_writer nologin noinherit;
        exception when insufficient_privilege then
            raise exception 'pgstream: migrate must create the role pgstream_writer and cannot (it needs CREATEROLE)'
                using hint = 'Create it once as a superuser: create role pgstream_writer nologin noinherit; '
                             'grant pgstream_writer to <the role that runs migrate>;';
        end;
    end if;
    if exists (select 1 from pg_catalog.pg_roles
               where rolname = 'pgstream_writer'
                 and (rolsuper or rolcanlogin or rolcreaterole or rolcreatedb or rolreplication or rolbypassrls)) then
        raise exception 'pgstream: role pgstream_writer must be NOLOGIN and hold no attribute (superuser, createrole, createdb, replication, bypassrls)';
    end if;
    if exists (select 1 from pg_catalog.pg_auth_members m
               where m.member = 'pgstream_writer'::pg_catalog.regrole) then
        raise exception 'pgstream: role pgstream_writer must not be a member of any role (it would inherit its privileges)';
    end if;
    -- the owner manages the generated functions (they belong to pgstream_writer): a superuser can
    -- do that anyway, anyone else must be a member
    if not pg_catalog.pg_has_role(current_user, 'pgstream_writer', 'USAGE')
       and not (select rolsuper from pg_catalog.pg_roles where rolname = current_user) then
        begin
            execute pg_catalog.format('grant pgstream_writer to %I', current_user);
        exception when insufficient_privilege then
            raise exception 'pgstream: role % must be a member of pgstream_writer to manage the generated trigger functions, and cannot grant that to itself', current_user
                using hint = pg_catalog.format('As a superuser: grant pgstream_writer to %I;', current_user);
        end;
    end if;
end
$$;

grant usage on schema pgstream to pgstream_writer;
grant insert on pgstream.events to pgstream_writer;
grant usage on sequence pgstream.events_id_seq to pgstream_writer;

-- ---------------------------------------------------------------------------------------------
-- Transactions running pgstream's own DDL (trigger regeneration, migrations). Only the owner can
-- write this table, so no session can pretend to be pgstream.
create table if not exists pgstream.internal_ddl (
    xid        pg_catalog.xid8 primary key,
    started_at pg_catalog.timestamptz not null default pg_catalog.now()
);
revoke all on pgstream.internal_ddl from public;

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

create or replace function pgstream._internal_ddl_end(p_begun boolean)
returns void
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    delete from pgstream.internal_ddl where p_begun and xid = pg_catalog.pg_current_xact_id()
$$;

create or replace function pgstream._in_internal_ddl()
returns boolean
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select 1 from pgstream.internal_ddl
                   where xid = pg_catalog.pg_current_xact_id_if_assigned())
$$;

-- The types of the columns subscriptions publish (column_names), as they were when the table's
-- triggers were last generated: the drift guard refuses a change.
create table if not exists pgstream.subscribed_columns (
    schema_name text not null,
    table_name  text not null,
    column_name text not null,
    type_oid    pg_catalog.oid not null,
    typmod      integer not null,
    primary key (schema_name, table_name, column_name)
);
revoke all on pgstream.subscribed_columns from public;

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
      on a.attrelid = pg_catalog.to_regclass(pg_catalog.format('%I.%I', p_schema, p_table))
     and a.attname = c.name and a.attnum > 0 and not a.attisdropped
    where s.schema_name = p_schema and s.table_name = p_table;
$$;

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

-- ---------------------------------------------------------------------------------------------
-- Parses and type-checks one expression against the table's row without evaluating it, in an
-- always-rolled-back subtransaction: the expression becomes the single column of a temporary
-- view, whose stored query tree tells what it contains. Raises a subscription error (naming the
-- part) when it does not parse, when it contains an aggregate, window function, set-returning
-- function or subquery, or when pgstream_writer, which evaluates it, may not use an object it
-- references. Returns the expression's type and whether it calls nothing but built-in functions
-- that PUBLIC may execute (then it may go into a trigger's WHEN, evaluated as the writing role).
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
    v_view   text := 'pgstream_check_' || pg_catalog.replace(pg_catalog.gen_random_uuid()::text, '-', '');
    v_table  pg_catalog.oid := pg_catalog.to_regclass(pg_catalog.format('%I.%I', p_sub.schema_name, p_sub.table_name));
    v_rel    pg_catalog.oid;
    v_rule   pg_catalog.oid;
    v_query  text;
    v_funcs  pg_catalog.oid[];  -- every function it calls, built-ins and operators' functions included
begin
    if v_reason is null then
        begin
            execute pg_catalog.format('create temporary view %I as select (%s) as v %s limit 0',
                                      v_view, p_expr,
                                      pgstream._row_sources(p_sub.operation, p_sub.schema_name, p_sub.table_name));
            select c.oid into v_rel from pg_catalog.pg_class c
            where c.relname = v_view and c.relnamespace = pg_catalog.pg_my_temp_schema();
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

            -- objects the expression references other than the subscribed table (built-in objects
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
                  and not (d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass and d.refobjid in (v_rel, v_table))
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

            builtin_only := not exists (
                    select 1 from pg_catalog.pg_depend d
                    where d.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass and d.objid = v_rule
                      and not (d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
                               and d.refobjid in (v_rel, v_table)))
                and not exists (
                    select 1 from pg_catalog.unnest(v_funcs) f
                    join pg_catalog.pg_proc p on p.oid = f
                    where p.pronamespace <> 'pg_catalog'::pg_catalog.regnamespace
                       or not pg_catalog.has_function_privilege('public', f, 'EXECUTE'));

            -- roll back: the view never outlives the check, whatever the expression did to the parser
            raise exception using errcode = 'PGSRB', message = 'pgstream expression check rolled back';
        exception
            when sqlstate 'PGSRB' then
                null;
            when others then
                get stacked diagnostics v_reason = message_text;
        end;
    end if;
    if v_reason is not null then
        perform pgstream._subscription_error(p_sub.key, p_sub.stream_id, p_sub.operation,
            p_sub.schema_name, p_sub.table_name, p_part, v_reason);
    end if;
end
$$;

-- The type of an expression (validation; used by the 003 validator).
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

create or replace function pgstream._row_object_sql(p_alias text, p_columns text[])
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select pgstream._jsonb_object_sql(coalesce(
        array(select pg_catalog.format('%L::pg_catalog.text, %s.%I', c, p_alias, c)
              from pg_catalog.unnest(p_columns) with ordinality as t(c, ord) order by ord),
        '{}'))
$$;

create or replace function pgstream._extensions_sql(p_items jsonb)
returns text
language plpgsql
immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_group record;
    v_pairs text[] := '{}';
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
                                                    pgstream._extensions_sql(v_group.rest));
        end if;
    end loop;
    return pgstream._jsonb_object_sql(v_pairs);
end
$$;

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
begin
    if p_mode = 'row' then
        select pg_catalog.bool_and(pgstream._when_in_trigger(s)),
               pg_catalog.string_agg(pg_catalog.format('(%s)', s.when_clause), ' or ' order by s.stream_id, s.key, s.id),
               pg_catalog.string_agg(pg_catalog.format(
$b$    if %s then
        insert into pgstream.events (payload, stream_id, metadata)
        values (%s,
                %s::pg_catalog.int8, %L::pg_catalog.jsonb);
    end if;
$b$,
                   case when s.when_clause is null then 'true' else pg_catalog.format('(%s)', s.when_clause) end,
                   pgstream._payload_sql(s, pg_catalog.format('%L::pg_catalog.text', s.key), 'tg_op', 'tg_table_name',
                                         'tg_table_schema', 'v_ts'),
                   s.stream_id,
                   s.metadata), '' order by s.stream_id, s.key, s.id)
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
    if p_mode is distinct from 'statement' or p_op = 'UPDATE' then
        function_body := null;
        return;
    end if;

    -- Per subscription: one row of (payload or null when filtered out, stream_id, metadata) for the
    -- VALUES list, and the whole body for when it is the only one (a plain filtered INSERT ... SELECT,
    -- about a third cheaper than the VALUES list).
    select pg_catalog.count(*),
           pg_catalog.string_agg(pg_catalog.format(
               '(case when %s then %s end, %s::pg_catalog.int8, %L::pg_catalog.jsonb)',
               x.filter, x.payload, s.stream_id, s.metadata), E',\n            ' order by s.stream_id, s.key, s.id),
           pg_catalog.min(pg_catalog.format(
$f$
#variable_conflict use_column
begin
    insert into pgstream.events (payload, stream_id, metadata)
    select %s,
           %s::pg_catalog.int8, %L::pg_catalog.jsonb
    from (select %s) as pgstream_ts(pgstream_ts_ms)
    cross join pgstream_%s as %s
    where %s;
    return null;
end
$f$, x.payload, s.stream_id, s.metadata, v_ts, v_src, v_src, x.filter))
    into v_count, v_blocks, function_body
    from pgstream.subscriptions s
    cross join lateral (select
        case when s.when_clause is null then 'true' else pg_catalog.format('(%s)', s.when_clause) end,
        pgstream._payload_sql(s, pg_catalog.format('%L::pg_catalog.text', s.key),
                              pg_catalog.format('%L::pg_catalog.text', p_op::text),
                              pg_catalog.format('%L::pg_catalog.text', p_table),
                              pg_catalog.format('%L::pg_catalog.text', p_schema), 'pgstream_ts.pgstream_ts_ms')
    ) as x(filter, payload)
    where s.schema_name = p_schema and s.table_name = p_table and s.operation = p_op
      and s.trigger_mode = 'statement';

    if v_count <= 1 then
        return;  -- none: null (min of no rows); one: its plain INSERT ... SELECT
    end if;
    function_body := pg_catalog.format(
$f$
#variable_conflict use_column
begin
    insert into pgstream.events (payload, stream_id, metadata)
    select e.payload, e.stream_id, e.metadata
    from (select %s) as pgstream_ts(pgstream_ts_ms)
    cross join pgstream_%s as %s
    cross join lateral (values
            %s
    ) as e(payload, stream_id, metadata)
    where e.payload is not null;
    return null;
end
$f$, v_ts, v_src, v_src, v_blocks);
end
$$;

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
    v_rel     pg_catalog.regclass := pg_catalog.to_regclass(pg_catalog.format('%I.%I', p_schema, p_table));
    v_gen     record;
    v_hash    text;
    v_current text;
    v_owner   pg_catalog.name;
    v_begun   boolean;
    v_super   boolean := (select r.rolsuper from pg_catalog.pg_roles r where r.rolname = current_user);
begin
    select * into v_gen from pgstream.generated_trigger(p_schema, p_table, p_op, p_mode);

    if v_rel is not null then
        select pg_catalog.obj_description(t.oid, 'pg_trigger') into v_current
        from pg_catalog.pg_trigger t where t.tgrelid = v_rel and t.tgname = v_trg;
    end if;
    select r.rolname into v_owner
    from pg_catalog.pg_proc p join pg_catalog.pg_roles r on r.oid = p.proowner
    where p.oid = pg_catalog.to_regprocedure(pg_catalog.format('pgstream.%I()', v_fn));
    v_hash := pgstream.generated_trigger_hash(v_gen.function_body, v_gen.when_clause);
    if not p_force and v_gen.function_body is not null and v_current is not distinct from v_hash
       and v_owner = 'pgstream_writer' then
        return false;
    end if;
    if v_gen.function_body is null and v_current is null and v_owner is null then
        return false;
    end if;

    v_begun := pgstream._internal_ddl_begin();
    if v_rel is not null then
        execute pg_catalog.format('drop trigger if exists %I on %s', v_trg, v_rel);
    end if;
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
        if p_mode = 'row' then
            execute pg_catalog.format(
                'create constraint trigger %I after %s on %s deferrable initially deferred '
                'for each row %s execute function pgstream.%I()',
                v_trg, p_op, v_rel,
                case when v_gen.when_clause is null then '' else pg_catalog.format('when (%s)', v_gen.when_clause) end,
                v_fn);
        else
            execute pg_catalog.format(
                'create trigger %I after %s on %s referencing %s table as %I '
                'for each statement execute function pgstream.%I()',
                v_trg, p_op, v_rel,
                case p_op when 'DELETE' then 'old' else 'new' end,
                case p_op when 'DELETE' then 'pgstream_old' else 'pgstream_new' end,
                v_fn);
        end if;
        execute pg_catalog.format('comment on trigger %I on %s is %L', v_trg, v_rel, v_hash);
    end if;
    perform pgstream._internal_ddl_end(v_begun);
    return true;
end
$$;

drop function if exists pgstream._regenerate_trigger_mode(text, text, pgstream.operation_type, text);

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
    v_row  boolean;
    v_stmt boolean;
begin
    perform pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext('pgstream.regenerate'));
    v_row := pgstream._regenerate_trigger_mode(p_schema, p_table, p_op, 'row', p_force);
    v_stmt := pgstream._regenerate_trigger_mode(p_schema, p_table, p_op, 'statement', p_force);
    perform pgstream._record_subscribed_columns(p_schema, p_table);
    return v_row or v_stmt;
end
$$;

create or replace function pgstream.regenerate_trigger(p_schema text, p_table text, p_op pgstream.operation_type)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$ select pgstream._regenerate_triggers(p_schema, p_table, p_op, false) $$;

-- Recreates the triggers of one (schema, table, operation) even when their comment matches.
create or replace function pgstream.repair_trigger(p_schema text, p_table text, p_op pgstream.operation_type)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$ select pgstream._regenerate_triggers(p_schema, p_table, p_op, true) $$;

-- ---------------------------------------------------------------------------------------------
-- Drift guard.

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

-- Why the generated triggers of one table no longer serve its subscriptions, or null: each
-- (operation, mode) that has subscriptions needs its trigger, enabled, calling its function.
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
    from pg_catalog.pg_class c
    join pg_catalog.pg_namespace n on n.oid = c.relnamespace
    join lateral (select distinct s.operation, s.trigger_mode from pgstream.subscriptions s
                  where s.schema_name = n.nspname and s.table_name = c.relname) w on true
    left join pg_catalog.pg_trigger t
      on t.tgrelid = c.oid and t.tgname = pgstream.trigger_name(w.operation, w.trigger_mode)
    where c.oid = p_rel
      and (t.oid is null or t.tgenabled not in ('O', 'A')
           or t.tgfoid is distinct from pg_catalog.to_regprocedure(pg_catalog.format('pgstream.%I()',
                  pgstream.trigger_function_name(n.nspname, c.relname, w.operation, w.trigger_mode))))
    order by w.operation, w.trigger_mode
    limit 1
$$;

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
    v_rel   pg_catalog.oid := pg_catalog.to_regclass(pg_catalog.format('%I.%I', p_schema, p_table));
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

drop function if exists pgstream._drift_check_unresolved(text);

create or replace function pgstream._drift_guard_sql_drop()
returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_obj  record;
    v_subs text;
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
    for v_obj in select * from pg_catalog.pg_event_trigger_dropped_objects() d
                 where d.object_type = 'trigger' and not d.is_temporary
                   and d.object_identity ~ '^pgstream_(insert|update|delete)(_stmt)? on ' loop
        raise exception 'pgstream: refusing % that drops the generated trigger %: its subscriptions would silently stop producing events',
            tg_tag, v_obj.object_identity
            using errcode = 'dependent_objects_still_exist',
                  hint = 'Delete or change the subscriptions instead; the trigger follows them.';
    end loop;
    for v_obj in select * from pg_catalog.pg_event_trigger_dropped_objects() d
                 where d.object_type = 'function' and d.schema_name = 'pgstream'
                   and d.object_name like '\_publish\_%' loop
        raise exception 'pgstream: refusing % that drops the generated function %', tg_tag, v_obj.object_identity
            using errcode = 'dependent_objects_still_exist',
                  hint = 'Delete or change the subscriptions instead; the function follows them.';
    end loop;
    for v_obj in select * from pg_catalog.pg_event_trigger_dropped_objects() d
                 where d.object_type = 'table column' and not d.is_temporary loop
        perform pgstream._drift_check_table(v_obj.address_names[1], v_obj.address_names[2],
            pg_catalog.format('%s dropping column %s', tg_tag, v_obj.object_identity));
    end loop;
end
$$;

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
            end loop;
        elsif v_cmd.object_type in ('function', 'procedure', 'routine') and v_cmd.schema_name = 'pgstream'
              and exists (select 1 from pg_catalog.pg_proc p where p.oid = v_cmd.objid
                          and p.proname like '\_publish\_%') then
            raise exception 'pgstream: refusing % of a generated trigger function: its subscriptions define it', v_what
                using errcode = 'dependent_objects_still_exist',
                      hint = 'Change the subscriptions instead; pgstream.repair_trigger(schema, table, operation) recreates it.';
        end if;
    end loop;
end
$$;

do $$
begin
    drop event trigger if exists pgstream_drift_guard_drop;
    drop event trigger if exists pgstream_drift_guard_alter;
    create event trigger pgstream_drift_guard_drop on sql_drop
        execute function pgstream._drift_guard_sql_drop();
    create event trigger pgstream_drift_guard_alter on ddl_command_end
        when tag in ('ALTER TABLE', 'ALTER SCHEMA', 'ALTER TRIGGER', 'ALTER FUNCTION', 'ALTER ROUTINE',
                     'ALTER PROCEDURE')
        execute function pgstream._drift_guard_ddl_end();
exception when insufficient_privilege then
    raise warning 'pgstream: the schema-drift guard needs superuser to install event triggers; it is NOT active';
end
$$;

-- ---------------------------------------------------------------------------------------------
-- Every function of the schema: temporary schema last, never executable by PUBLIC.
do $$
declare
    v_fn pg_catalog.regprocedure;
begin
    for v_fn in select p.oid from pg_catalog.pg_proc p
                where p.pronamespace = 'pgstream'::pg_catalog.regnamespace
                  and p.proname not like '\_publish\_%' loop
        execute pg_catalog.format('alter function %s set search_path = pg_catalog, pg_temp', v_fn);
        execute pg_catalog.format('revoke all on function %s from public', v_fn);
    end loop;
end
$$;

-- Existing installs: every generated trigger recreated under the new model.
do $$
declare
    v_target record;
    v_begun  boolean := pgstream._internal_ddl_begin();
begin
    -- functions of targets that no longer have subscriptions
    for v_target in select p.oid::pg_catalog.regprocedure as fn from pg_catalog.pg_proc p
                    where p.pronamespace = 'pgstream'::pg_catalog.regnamespace and p.proname like '\_publish\_%'
                      and not exists (select 1 from pgstream.subscriptions s
                                      where pgstream.trigger_function_name(s.schema_name, s.table_name, s.operation,
                                                                           s.trigger_mode) = p.proname) loop
        execute pg_catalog.format('drop function %s cascade', v_target.fn);
    end loop;
    for v_target in select distinct s.schema_name, s.table_name, s.operation from pgstream.subscriptions s
                    where pg_catalog.to_regclass(pg_catalog.format('%I.%I', s.schema_name, s.table_name)) is not null
                    order by 1, 2, 3 loop
        perform pgstream.repair_trigger(v_target.schema_name, v_target.table_name, v_target.operation);
    end loop;
    perform pgstream._internal_ddl_end(v_begun);
end
$$;
