-- Repeatable: backfills (tables in 017_backfills.sql). What turns existing rows into events.
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.
--
-- Security. A backfill is started and run as the owner (nothing here is executable by PUBLIC):
-- the functions the runtime and the Spark executors call (backfill_start, _claim, _chunk,
-- _next_key, _backlog, _release, _stop) are SECURITY DEFINER; their grants are in 99_runtime.sql.
--   * Everything a subscription's definition evaluates (when_clause, payload and metadata
--     extensions, casts of column types to JSON) and the backfill's own filter runs as
--     pgstream_writer, in a SECURITY DEFINER function it owns that exists only inside each chunk's
--     transaction (created in the session's temporary schema, called once, found unchanged,
--     dropped): the owner never calls a function that a role running user code could have
--     changed. It receives the rows as an array of the table's row type, so pgstream_writer needs
--     no privilege on the table. A chunk after which that code left a temporary object of its own
--     in the session fails (nothing is written).
--   * The owner reads the rows (pgstream.backfill_chunk, as the owner: it needs SELECT, and
--     UPDATE on one column for the FOR SHARE locks, on the table), with row_security off: a table
--     whose row-level security applies to the owner is refused (its policies never run as the
--     owner). The only text it executes is built from catalog names (format %I) and key types
--     from pg_catalog that are on an allow-list; key values travel as parameters.
--   * The filter is checked like a when_clause (lexer, parser as pgstream_writer in a rolled-back
--     subtransaction, no subquery, aggregate, window or set-returning function; only functions
--     pgstream_writer may execute) before it is put into the generated function.
--
-- Consistency with live changes. Each chunk reads its rows FOR SHARE and writes their events in
-- the same transaction: a change to one of those rows either committed before the chunk read it
-- (its event precedes the READ event, which carries the newer state) or waits for the chunk to
-- commit (its event follows the READ event). Events are delivered in commit order, so a consumer
-- applying them in order ends with every row's current state.

-- ---------------------------------------------------------------------------------------------
-- Names and keys.

-- The generated function of backfill p_id.
create or replace function pgstream.backfill_function_name(p_id bigint)
returns text
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$ select '_backfill_' || p_id::text $$;
revoke all on function pgstream.backfill_function_name(bigint) from public;

-- Key column types a backfill can range over: built-in types whose text form round-trips exactly
-- through JSON (the cursor is stored as JSON) and that have a default btree order.
create or replace function pgstream._backfill_key_type_ok(p_type pg_catalog.oid)
returns boolean
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select p_type operator(pg_catalog.=) any (array[
        'pg_catalog.int2'::pg_catalog.regtype, 'pg_catalog.int4'::pg_catalog.regtype,
        'pg_catalog.int8'::pg_catalog.regtype, 'pg_catalog.numeric'::pg_catalog.regtype,
        'pg_catalog.text'::pg_catalog.regtype, 'pg_catalog.varchar'::pg_catalog.regtype,
        'pg_catalog.bpchar'::pg_catalog.regtype, 'pg_catalog.uuid'::pg_catalog.regtype,
        'pg_catalog.date'::pg_catalog.regtype, 'pg_catalog.timestamp'::pg_catalog.regtype,
        'pg_catalog.timestamptz'::pg_catalog.regtype, 'pg_catalog.bytea'::pg_catalog.regtype,
        'pg_catalog.oid'::pg_catalog.regtype]::pg_catalog.oid[])
$$;
revoke all on function pgstream._backfill_key_type_ok(pg_catalog.oid) from public;

-- The key columns of a table (its primary key, in key order) with their types as SQL; raises
-- when the table has no primary key or a key column's type is not supported.
create or replace function pgstream._backfill_key(p_schema text, p_table text)
returns table (column_name text, type_sql text)
language plpgsql
stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rel pg_catalog.oid := pgstream._relid(p_schema, p_table);
    v_bad text;
begin
    if v_rel is null then
        raise exception 'pgstream: backfill: table %.% does not exist', pg_catalog.quote_ident(p_schema),
            pg_catalog.quote_ident(p_table) using errcode = 'undefined_table';
    end if;
    if not exists (select 1 from pg_catalog.pg_index i where i.indrelid operator(pg_catalog.=) v_rel and i.indisprimary) then
        raise exception 'pgstream: backfill: table %.% has no primary key: a backfill reads a table in key ranges '
                        'and needs one to read every row exactly once while it changes', pg_catalog.quote_ident(p_schema),
            pg_catalog.quote_ident(p_table)
            using errcode = 'feature_not_supported',
                  hint = 'Add a primary key (alter table ... add primary key (...)), then start the backfill again.';
    end if;
    select pg_catalog.string_agg(pg_catalog.format('%I %s', a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod)), ', ')
    into v_bad
    from pg_catalog.pg_index i
    cross join lateral pg_catalog.unnest(i.indkey::pg_catalog.int2[]) as k(attnum)
    join pg_catalog.pg_attribute a on a.attrelid operator(pg_catalog.=) v_rel and a.attnum operator(pg_catalog.=) k.attnum
    where i.indrelid operator(pg_catalog.=) v_rel and i.indisprimary and not pgstream._backfill_key_type_ok(a.atttypid);
    if v_bad is not null then
        raise exception 'pgstream: backfill: the primary key of %.% has columns of types a backfill cannot range over: %',
            pg_catalog.quote_ident(p_schema), pg_catalog.quote_ident(p_table), v_bad
            using errcode = 'feature_not_supported',
                  hint = 'Supported key types: smallint, integer, bigint, numeric, text, varchar, char, uuid, date, '
                         'timestamp, timestamptz, bytea, oid.';
    end if;
    return query
    select a.attname::text, pg_catalog.format('%I.%I', tn.nspname, t.typname)
    from pg_catalog.pg_index i
    cross join lateral pg_catalog.unnest(i.indkey::pg_catalog.int2[]) with ordinality as k(attnum, ord)
    join pg_catalog.pg_attribute a on a.attrelid operator(pg_catalog.=) v_rel and a.attnum operator(pg_catalog.=) k.attnum
    join pg_catalog.pg_type t on t.oid operator(pg_catalog.=) a.atttypid
    join pg_catalog.pg_namespace tn on tn.oid operator(pg_catalog.=) t.typnamespace
    where i.indrelid operator(pg_catalog.=) v_rel and i.indisprimary
    order by k.ord;
end
$$;
revoke all on function pgstream._backfill_key(text, text) from public;

-- SQL for a backfill's key: the key columns of alias p_alias as a row (p_json is null), or the
-- values of the JSON array p_json (SQL text, e.g. '$1') as a row of the key's types.
create or replace function pgstream._backfill_key_sql(p_schema text, p_table text, p_alias text, p_json text)
returns text
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select 'row(' || pg_catalog.string_agg(
        case when p_json is null then pg_catalog.format('%I.%I', p_alias, k.column_name)
             else pg_catalog.format('(%s operator(pg_catalog.->>) %s)::%s', p_json, k.ord - 1, k.type_sql) end,
        ', ' order by k.ord) || ')'
    from pgstream._backfill_key(p_schema, p_table) with ordinality as k(column_name, type_sql, ord)
$$;
revoke all on function pgstream._backfill_key_sql(text, text, text, text) from public;

-- The condition selecting a backfill's range (from_key and to_key, both inclusive, as $3 and $4)
-- and, when given, the rows after p_after_sql / up to p_upto_sql (SQL text of JSON keys), over
-- alias t.
create or replace function pgstream._backfill_where(p_b pgstream.backfills, p_after_sql text, p_upto_sql text)
returns text
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.concat_ws(' and ', 'true',
        case when p_b.from_key is not null then pg_catalog.format('%s operator(pg_catalog.>=) %s',
            pgstream._backfill_key_sql(p_b.schema_name, p_b.table_name, 't', null),
            pgstream._backfill_key_sql(p_b.schema_name, p_b.table_name, null, '$3')) end,
        case when p_b.to_key is not null then pg_catalog.format('%s operator(pg_catalog.<=) %s',
            pgstream._backfill_key_sql(p_b.schema_name, p_b.table_name, 't', null),
            pgstream._backfill_key_sql(p_b.schema_name, p_b.table_name, null, '$4')) end,
        case when p_after_sql is not null then pg_catalog.format('%s operator(pg_catalog.>) %s',
            pgstream._backfill_key_sql(p_b.schema_name, p_b.table_name, 't', null),
            pgstream._backfill_key_sql(p_b.schema_name, p_b.table_name, null, p_after_sql)) end,
        case when p_upto_sql is not null then pg_catalog.format('%s operator(pg_catalog.<=) %s',
            pgstream._backfill_key_sql(p_b.schema_name, p_b.table_name, 't', null),
            pgstream._backfill_key_sql(p_b.schema_name, p_b.table_name, null, p_upto_sql)) end)
$$;
revoke all on function pgstream._backfill_where(pgstream.backfills, text, text) from public;

-- The key columns of alias t as a JSON array (the stored form of a key), and as an ORDER BY list.
create or replace function pgstream._backfill_key_json_sql(p_schema text, p_table text)
returns text
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select 'pg_catalog.jsonb_build_array(' || pg_catalog.string_agg(pg_catalog.format('t.%I', k.column_name), ', ' order by k.ord) || ')'
    from pgstream._backfill_key(p_schema, p_table) with ordinality as k(column_name, type_sql, ord)
$$;
revoke all on function pgstream._backfill_key_json_sql(text, text) from public;

create or replace function pgstream._backfill_order_sql(p_schema text, p_table text, p_prefix text,
                                                        p_desc boolean default false)
returns text
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    -- p_prefix: an alias (t) or a whole-row value ((c.pgstream_r)); a key column is p_prefix.column
    select pg_catalog.string_agg(pg_catalog.format('%s.%I%s', p_prefix, k.column_name,
                                                   case when p_desc then ' desc' else '' end), ', ' order by k.ord)
    from pgstream._backfill_key(p_schema, p_table) with ordinality as k(column_name, type_sql, ord)
$$;
revoke all on function pgstream._backfill_order_sql(text, text, text, boolean) from public;

-- ---------------------------------------------------------------------------------------------
-- The generated function. Owned by pgstream_writer, like a generated trigger function: it writes
-- one event per row of p_rows that passes the backfill's filter and the subscription's
-- when_clause, built by the subscription's own payload and metadata code with tg_op 'READ' and
-- old null (an UPDATE subscription's expressions see old.* as null). Returns the events written.

-- The subscription a backfill reads for (null when it was deleted).
create or replace function pgstream._backfill_subscription(p_b pgstream.backfills)
returns pgstream.subscriptions
language sql
stable
set search_path = pg_catalog, pg_temp
as $$ select s from pgstream.subscriptions s where s.id operator(pg_catalog.=) p_b.subscription_id $$;
revoke all on function pgstream._backfill_subscription(pgstream.backfills) from public;

-- The payload of a READ event, built the way the subscription's trigger builds it but from two
-- typed rows (pgstream_n: the subscription's columns of new; pgstream_p: the payload's keys), so
-- that to_jsonb resolves each column's type once per statement rather than jsonb_build_object once
-- per value (about a third of a chunk's time in Postgres). Returns the FROM items (lateral, after
-- new and old) and the expression over them; the value is the same jsonb as the trigger's payload
-- with tg_op 'READ' and old null (tests/test_backfill.py checks it byte for byte).
create or replace function pgstream._backfill_payload_sql(p_sub pgstream.subscriptions, p_ts_sql text,
                                                          out from_sql text, out payload_sql text)
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format(
               '%1$s    cross join lateral (select %2$s) as pgstream_n'
               '%1$s    cross join lateral (select %3$L::pg_catalog.text as tg_name, ''READ''::pg_catalog.text as tg_op, '
               '%4$L::pg_catalog.text as tg_table_name, %5$L::pg_catalog.text as tg_table_schema, %6$s as "timestamp", '
               'pgstream_n as "new", null::pg_catalog.jsonb as "old") as pgstream_p',
               pg_catalog.chr(10),
               coalesce((select pg_catalog.string_agg('new."' || pg_catalog.replace(c, '"', '""') || '"', ', ' order by ord)
                         from pg_catalog.unnest(p_sub.column_names) with ordinality as t(c, ord)), ''),
               p_sub.key, p_sub.table_name, p_sub.schema_name, p_ts_sql),
           'pg_catalog.to_jsonb(pgstream_p)'
           || case when pg_catalog.jsonb_array_length(p_sub.payload_extensions) = 0 then ''
                   else ' operator(pg_catalog.||) ' || pgstream._subscription_extensions_sql(p_sub) end
$$;
revoke all on function pgstream._backfill_payload_sql(pgstream.subscriptions, text) from public;

-- The body of backfill p_b's function for subscription p_sub (its current definition and the
-- backfill's filter): text only, nothing is parsed or run here.
create or replace function pgstream._backfill_body(p_b pgstream.backfills, p_sub pgstream.subscriptions)
returns text
language plpgsql
stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_read pgstream.subscriptions := p_sub;
    v_ts   constant text := '(pg_catalog.extract(''epoch''::pg_catalog.text, pg_catalog.now()) '
                            'operator(pg_catalog.*) 1000::pg_catalog.numeric)::pg_catalog.int8';
    v_payload record;
begin
    -- the rows are new rows: new = the row, old = null
    v_read.operation := 'INSERT';
    v_payload := pgstream._backfill_payload_sql(v_read, 'pgstream_ts.pgstream_ts_ms');
    return pg_catalog.format(
$f$
#variable_conflict use_column
declare
    v_count pg_catalog.int8;
begin
    insert into pgstream.events (payload, stream_id, metadata)
    select %s,
           %s::pg_catalog.int8, %s
    from (select %s) as pgstream_ts(pgstream_ts_ms)
    cross join (select * from pg_catalog.unnest(p_rows) as new where %s) as new%s%s
    where %s;
    get diagnostics v_count = row_count;
    return v_count;
end
$f$,
        v_payload.payload_sql,
        p_sub.stream_id, pgstream._metadata_sql(p_sub), v_ts,
        coalesce('(' || p_b.filter || ')', 'true'),
        -- old: the table's columns, all null (an empty set of the same rows, left-joined: the table's
        -- name is not needed, so pgstream_writer needs no USAGE on its schema)
        case when p_sub.operation operator(pg_catalog.=) 'UPDATE'
             then E'\n    left join (select * from pg_catalog.unnest(p_rows) limit 0) as old on true'
             else '' end,
        v_payload.from_sql,
        coalesce('(' || p_sub.when_clause || ')', 'true'));
end
$$;
revoke all on function pgstream._backfill_body(pgstream.backfills, pgstream.subscriptions) from public;

-- Checks backfill p_id against its subscription's current definition: its filter parses (as
-- pgstream_writer, like every expression) as a boolean over the table's rows. Records the
-- definition it was checked against (a chunk of a changed subscription stops: claim again). A
-- function pgstream._backfill_<id> left by an earlier version (owned by pgstream_writer, across
-- transactions) is dropped: a backfill's function now lives only inside each chunk's transaction.
create or replace function pgstream.backfill_prepare(p_id bigint)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    v_b     pgstream.backfills;
    v_sub   pgstream.subscriptions;
    v_read  pgstream.subscriptions;
    v_type  pg_catalog.regtype;
begin
    select * into v_b from pgstream.backfills b where b.id operator(pg_catalog.=) p_id;
    if v_b.id is null then
        raise exception 'pgstream: backfill % does not exist', p_id using errcode = 'no_data_found';
    end if;
    v_sub := pgstream._backfill_subscription(v_b);
    if v_sub.id is null then
        raise exception 'pgstream: backfill %: its subscription "%" (% on %.%) was deleted', p_id, v_b.subscription_key,
            v_b.operation, v_b.schema_name, v_b.table_name using errcode = 'no_data_found';
    end if;
    -- the rows are new rows: new = the row, old = null
    v_read := v_sub;
    v_read.operation := 'INSERT';
    if v_b.filter is not null then
        v_type := pgstream._expression_type(v_read, 'where', v_b.filter);
        if v_type operator(pg_catalog.<>) 'pg_catalog.bool'::pg_catalog.regtype then
            perform pgstream._subscription_error(v_sub.key, v_sub.stream_id, v_sub.operation, v_sub.schema_name,
                v_sub.table_name, 'where', pg_catalog.format('must be a boolean expression, got type %s', v_type));
        end if;
    end if;
    perform pgstream._backfill_drop_function(p_id);
    update pgstream.backfills set subscription_updated_at = v_sub.updated_at, updated_at = pg_catalog.now()
    where id operator(pg_catalog.=) p_id;
end
$$;
revoke all on function pgstream.backfill_prepare(bigint) from public;

-- Raises, naming the table and the fix, when reading it as the current role would apply a
-- row-level security policy: a policy is the table owner's code, and never runs as pgstream's
-- owner. The backfill's reads also run with row_security off, so that Postgres raises rather than
-- apply a policy.
create or replace function pgstream._backfill_rls_check(p_schema text, p_table text)
returns void
language plpgsql
stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_catalog.row_security_active(pg_catalog.format('%I.%I', p_schema, p_table)) then
        raise exception 'pgstream: backfill: table %.% has row-level security that applies to role %: a backfill '
                        'never runs the table''s policies as pgstream''s owner',
            pg_catalog.quote_ident(p_schema), pg_catalog.quote_ident(p_table), current_user
            using errcode = 'insufficient_privilege',
                  hint = pg_catalog.format('Grant the owner BYPASSRLS (as a superuser: alter role %I bypassrls), or '
                                           'disable row-level security on %I.%I for the backfill.',
                                           current_user, p_schema, p_table);
    end if;
end
$$;
revoke all on function pgstream._backfill_rls_check(text, text) from public;

-- Drops backfill p_id's function (when it ends).
create or replace function pgstream._backfill_drop_function(p_id bigint)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    v_begun boolean := pgstream._internal_ddl_begin();
begin
    execute pg_catalog.format('drop function if exists pgstream.%I', pgstream.backfill_function_name(p_id));
    perform pgstream._internal_ddl_end(v_begun);
end
$$;
revoke all on function pgstream._backfill_drop_function(bigint) from public;

-- ---------------------------------------------------------------------------------------------
-- Starting: the subscription, the key, the range, the partitions.

-- Starts a backfill of the subscription p_key of stream p_stream_id on table p_schema.p_table
-- (its INSERT subscription, else its UPDATE one; DELETE subscriptions have no rows to read):
-- validates everything (nothing is written when anything is wrong), splits the key range
-- [p_from, p_to] (JSON arrays of key values, inclusive, null: unbounded) into at most
-- p_parallelism partitions of about equal row counts, creates its function. Returns its id; it
-- is 'stopped' until a run claims it (backfill_claim).
create or replace function pgstream.backfill_start(
    p_stream_id bigint, p_key text, p_schema text, p_table text, p_filter text,
    p_from jsonb, p_to jsonb, p_parallelism integer
)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_sub   pgstream.subscriptions;
    v_keys  text[];
    v_id    bigint;
    v_b     pgstream.backfills;
    v_n     integer;
    v_which text;
    v_val   jsonb;
begin
    if p_parallelism is null or p_parallelism operator(pg_catalog.<) 1 or p_parallelism operator(pg_catalog.>) 1024 then
        raise exception 'pgstream: backfill: parallelism must be between 1 and 1024, got %', p_parallelism
            using errcode = 'invalid_parameter_value';
    end if;
    select s.* into v_sub from pgstream.subscriptions s
    where s.stream_id operator(pg_catalog.=) p_stream_id and s.key operator(pg_catalog.=) p_key
      and s.schema_name operator(pg_catalog.=) p_schema and s.table_name operator(pg_catalog.=) p_table
      and s.operation operator(pg_catalog.<>) 'DELETE'
    order by s.operation  -- INSERT before UPDATE (enum order)
    limit 1;
    if v_sub.id is null then
        raise exception 'pgstream: backfill: stream % has no INSERT or UPDATE subscription "%" on %.%', p_stream_id,
            p_key, pg_catalog.quote_ident(p_schema), pg_catalog.quote_ident(p_table)
            using errcode = 'no_data_found',
                  hint = 'A backfill writes READ events for a subscription that takes new rows (INSERT, else UPDATE); '
                         'list them with: select key, operation, schema_name, table_name from pgstream.subscriptions;';
    end if;
    select pg_catalog.array_agg(k.column_name order by k.ord) into v_keys
    from pgstream._backfill_key(p_schema, p_table) with ordinality as k(column_name, type_sql, ord);
    v_n := pg_catalog.cardinality(v_keys);
    foreach v_which in array array['from', 'to'] loop
        v_val := case v_which when 'from' then p_from else p_to end;
        if v_val is not null and (pg_catalog.jsonb_typeof(v_val) operator(pg_catalog.<>) 'array'
                                  or pg_catalog.jsonb_array_length(v_val) operator(pg_catalog.<>) v_n
                                  or exists (select 1 from pg_catalog.jsonb_array_elements(v_val) e
                                             where pg_catalog.jsonb_typeof(e) not in ('string', 'number'))) then
            raise exception 'pgstream: backfill: "%" must give one value for each primary key column of %.% (%), got %',
                v_which, pg_catalog.quote_ident(p_schema), pg_catalog.quote_ident(p_table),
                pg_catalog.array_to_string(v_keys, ', '), v_val using errcode = 'invalid_parameter_value';
        end if;
    end loop;

    begin
        insert into pgstream.backfills (stream_id, subscription_id, subscription_key, schema_name, table_name, operation,
                                        filter, key_columns, from_key, to_key, status)
        values (p_stream_id, v_sub.id, v_sub.key, p_schema, p_table, v_sub.operation,
                nullif(pg_catalog.btrim(p_filter), ''), v_keys, p_from, p_to, 'stopped')
        returning * into v_b;
    exception when unique_violation then
        raise exception 'pgstream: backfill: subscription "%" on %.% of stream % already has an unfinished backfill (%)',
            p_key, pg_catalog.quote_ident(p_schema), pg_catalog.quote_ident(p_table), p_stream_id,
            (select pg_catalog.format('id %s, %s', b.id, b.status) from pgstream.backfills b
             where b.stream_id operator(pg_catalog.=) p_stream_id and b.subscription_key operator(pg_catalog.=) p_key
               and b.schema_name operator(pg_catalog.=) p_schema and b.table_name operator(pg_catalog.=) p_table
               and b.status in ('running', 'stopped', 'failed'))
            using errcode = 'unique_violation',
                  hint = 'Resume it (launch the backfill again without changing its filter or range), or cancel it first.';
    end;
    v_id := v_b.id;
    -- the bounds parse as the key's types (an error names the value)
    begin
        execute pg_catalog.format('select %s, %s',
                                  pgstream._backfill_key_sql(p_schema, p_table, null, '$1'),
                                  pgstream._backfill_key_sql(p_schema, p_table, null, '$2'))
        using coalesce(p_from, p_to, '[]'), coalesce(p_to, p_from, '[]');
    exception when data_exception then
        raise exception 'pgstream: backfill: "from"/"to" %/% do not fit the primary key (%) of %.%: %', p_from, p_to,
            pg_catalog.array_to_string(v_keys, ', '), pg_catalog.quote_ident(p_schema), pg_catalog.quote_ident(p_table),
            sqlerrm using errcode = 'invalid_parameter_value';
    end;
    perform pgstream.backfill_prepare(v_id);
    perform pgstream._backfill_split(v_id, p_parallelism);
    return v_id;
end
$$;
revoke all on function pgstream.backfill_start(bigint, text, text, text, text, jsonb, jsonb, integer) from public;

-- Splits backfill p_id's range into at most p_parts partitions of about equal row counts (key
-- quantiles over the rows, or over a sample of a large table) and counts its rows (rows_total).
create or replace function pgstream._backfill_split(p_id bigint, p_parts integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set row_security = off
as $$
declare
    v_b      pgstream.backfills;
    v_total  bigint;
    v_bounds jsonb[];
    v_sample text := '';
    v_i      integer;
    v_last   jsonb;
begin
    select * into v_b from pgstream.backfills where id operator(pg_catalog.=) p_id;
    perform pgstream._backfill_rls_check(v_b.schema_name, v_b.table_name);
    execute pg_catalog.format('select pg_catalog.count(*) from %I.%I as t where %s',
                              v_b.schema_name, v_b.table_name, pgstream._backfill_where(v_b, null, null))
    into v_total using null::jsonb, null::jsonb, v_b.from_key, v_b.to_key;
    if p_parts operator(pg_catalog.>) 1 and v_total operator(pg_catalog.>) p_parts then
        if v_total operator(pg_catalog.>) 1000000 then
            -- about 100,000 sampled rows (whole pages) are enough for quantiles
            v_sample := pg_catalog.format(' tablesample system (%s)',
                greatest(0.01, 100.0 operator(pg_catalog.*) 100000 operator(pg_catalog./) v_total));
        end if;
        -- boundaries: the key of every (rows / p_parts)-th row in key order, p_parts - 1 of them
        execute pg_catalog.format(
            'select pg_catalog.array_agg(q.pgstream_k order by q.pgstream_i) from ('
            '  select x.pgstream_k, x.pgstream_i from ('
            '    select %s as pgstream_k, pg_catalog.row_number() over (order by %s) as pgstream_i,'
            '           pg_catalog.count(*) over () as pgstream_c'
            '    from %I.%I%s as t where %s) as x'
            '  where x.pgstream_i operator(pg_catalog.<) x.pgstream_c'
            '    and x.pgstream_i operator(pg_catalog.%%) greatest(x.pgstream_c operator(pg_catalog./) %s, 1) operator(pg_catalog.=) 0'
            '  order by x.pgstream_i limit %s) as q',
            pgstream._backfill_key_json_sql(v_b.schema_name, v_b.table_name),
            pgstream._backfill_order_sql(v_b.schema_name, v_b.table_name, 't'),
            v_b.schema_name, v_b.table_name, v_sample, pgstream._backfill_where(v_b, null, null), p_parts, p_parts - 1)
        into v_bounds using null::jsonb, null::jsonb, v_b.from_key, v_b.to_key;
    end if;
    -- the range ends at the last key there is now: rows inserted later have their INSERT events (a
    -- backfill of a table being filled must end)
    execute pg_catalog.format('select %s from %I.%I as t where %s order by %s limit 1',
        pgstream._backfill_key_json_sql(v_b.schema_name, v_b.table_name), v_b.schema_name, v_b.table_name,
        pgstream._backfill_where(v_b, null, null),
        pgstream._backfill_order_sql(v_b.schema_name, v_b.table_name, 't', true))
    into v_last using null::jsonb, null::jsonb, v_b.from_key, v_b.to_key;
    v_bounds := coalesce(v_bounds, '{}');
    for v_i in 0 .. pg_catalog.cardinality(v_bounds) loop
        insert into pgstream.backfill_partitions (backfill_id, part, lower_key, upper_key, done)
        values (p_id, v_i, case when v_i operator(pg_catalog.>) 0 then v_bounds[v_i] end,
                coalesce(v_bounds[v_i + 1], v_last), v_last is null);
    end loop;
    update pgstream.backfills set rows_total = v_total where id operator(pg_catalog.=) p_id;
end
$$;
revoke all on function pgstream._backfill_split(bigint, integer) from public;

-- ---------------------------------------------------------------------------------------------
-- Running.

-- The lock a run's session holds on the backfill it owns (pgstream.try_lock('backfill', id),
-- repeatable/00_locks.sql): true when taken (no other live session holds it). Free again once the
-- run's session ends, however it ends.
create or replace function pgstream.backfill_try_lock(p_id bigint)
returns boolean
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    select pgstream.try_lock('backfill', p_id)
$$;
revoke all on function pgstream.backfill_try_lock(bigint) from public;

create or replace function pgstream.backfill_unlock(p_id bigint)
returns boolean
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    select pgstream.unlock('backfill', p_id)
$$;
revoke all on function pgstream.backfill_unlock(bigint) from public;

-- A run claims backfill p_id (its caller holds backfill_try_lock): status running, owned by
-- p_token (chunks of any other owner stop), its function recreated when the subscription changed
-- since it was made. Raises when the backfill is finished.
create or replace function pgstream.backfill_claim(p_id bigint, p_token uuid, p_run_id text)
returns pgstream.backfills
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_b   pgstream.backfills;
    v_sub pgstream.subscriptions;
begin
    select * into v_b from pgstream.backfills where id operator(pg_catalog.=) p_id for update;
    if v_b.id is null then
        raise exception 'pgstream: backfill % does not exist', p_id using errcode = 'no_data_found';
    end if;
    if v_b.status in ('done', 'cancelled') then
        raise exception 'pgstream: backfill % is %', p_id, v_b.status using errcode = 'object_not_in_prerequisite_state';
    end if;
    v_sub := pgstream._backfill_subscription(v_b);
    if v_sub.id is not null and v_sub.updated_at is distinct from v_b.subscription_updated_at then
        perform pgstream.backfill_prepare(p_id);
    elsif v_sub.id is null then
        perform pgstream.backfill_prepare(p_id);  -- raises: the subscription was deleted
    end if;
    update pgstream.backfills
    set status = 'running', owner_token = p_token, run_id = p_run_id, error = null, updated_at = pg_catalog.now()
    where id operator(pg_catalog.=) p_id
    returning * into v_b;
    return v_b;
end
$$;
revoke all on function pgstream.backfill_claim(bigint, uuid, text) from public;

-- One chunk of one partition: reads up to p_limit rows after the partition's cursor, FOR SHARE,
-- writes their events through the backfill's function and moves the cursor, all in the caller's
-- transaction (commit it). Returns what happened: 'read' (maybe more), 'done' (the partition is
-- finished), 'stopped' (the backfill is not running for owner p_token), 'changed' (the
-- subscription changed since the function was made: claim again), 'gone' (it was deleted).
create or replace function pgstream.backfill_chunk(p_id bigint, p_part integer, p_token uuid, p_limit integer)
returns table (chunk_status text, chunk_rows bigint, chunk_events bigint)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set row_security = off
set client_min_messages = warning
as $$
declare
    v_fn     text;
    v_oid    pg_catalog.oid;
    v_sig    text;
    v_planted text;
    v_me     pg_catalog.oid := (select r.oid from pg_catalog.pg_roles r where r.rolname operator(pg_catalog.=) current_user);
    v_b      pgstream.backfills;
    v_p      pgstream.backfill_partitions;
    v_sub    pgstream.subscriptions;
    v_after  jsonb;
    v_rows   bigint;
    v_events bigint;
    v_last   jsonb;
begin
    if p_limit is null or p_limit operator(pg_catalog.<) 1 then
        raise exception 'pgstream: backfill: chunk size must be positive, got %', p_limit
            using errcode = 'invalid_parameter_value';
    end if;
    -- FOR SHARE: a stop or cancel (an update of this row) waits for the chunks in flight
    select * into v_b from pgstream.backfills where id operator(pg_catalog.=) p_id for share;
    if v_b.id is null or v_b.status operator(pg_catalog.<>) 'running' or v_b.owner_token is distinct from p_token then
        return query select 'stopped'::text, 0::bigint, 0::bigint;
        return;
    end if;
    select * into v_p from pgstream.backfill_partitions
    where backfill_id operator(pg_catalog.=) p_id and part operator(pg_catalog.=) p_part for update;
    if v_p.backfill_id is null then
        raise exception 'pgstream: backfill % has no partition %', p_id, p_part using errcode = 'no_data_found';
    end if;
    if v_p.done then
        return query select 'done'::text, 0::bigint, 0::bigint;
        return;
    end if;
    v_sub := pgstream._backfill_subscription(v_b);
    if v_sub.id is null then
        return query select 'gone'::text, 0::bigint, 0::bigint;
        return;
    end if;
    if v_sub.updated_at is distinct from v_b.subscription_updated_at then
        return query select 'changed'::text, 0::bigint, 0::bigint;
        return;
    end if;
    v_after := coalesce(v_p.cursor_key, v_p.lower_key);
    perform pgstream._backfill_rls_check(v_b.schema_name, v_b.table_name);
    -- The function that turns the rows into events, owned by pgstream_writer, exists only in this
    -- transaction (this session's temporary schema): created, called once, found unchanged, dropped.
    -- No other transaction ever sees it, and nothing the owner runs later was ever owned by a role
    -- the subscription's code runs as.
    perform pgstream._writer_temp_check('backfill');
    v_fn := 'pgstream_backfill_' || pg_catalog.replace(pg_catalog.gen_random_uuid()::text, '-', '');
    execute pg_catalog.format(
        'create function pg_temp.%I(p_rows %I.%I[]) returns pg_catalog.int8 language plpgsql '
        'security definer set search_path = pg_catalog, pg_temp as %L',
        v_fn, v_b.schema_name, v_b.table_name, pgstream._backfill_body(v_b, v_sub));
    v_oid := pg_catalog.to_regprocedure(pg_catalog.format('pg_temp.%I(%I.%I[])', v_fn, v_b.schema_name, v_b.table_name));
    execute pg_catalog.format('revoke all on function %s from public', v_oid::pg_catalog.regprocedure);
    execute pg_catalog.format('alter function %s owner to pgstream_writer', v_oid::pg_catalog.regprocedure);
    select pg_catalog.format('%s %s %s %s %s', p.ctid, p.xmin, p.prosecdef, p.proowner, p.proconfig) into v_sig
    from pg_catalog.pg_proc p where p.oid operator(pg_catalog.=) v_oid;
    execute pg_catalog.format(
        'select pg_catalog.count(*), (pg_catalog.array_agg(c.pgstream_k order by %s))[1], '
        '       %s(pg_catalog.array_agg(c.pgstream_r order by %s)) '
        -- row(t.*): the whole row even when the table has a column named t (a bare t would be the
        -- column); a cast from record cannot be user-defined (record is a pseudo-type)
        'from (select row(t.*)::%I.%I as pgstream_r, %s as pgstream_k from %I.%I as t where %s order by %s '
        'limit $5 for share of t) as c',
        pgstream._backfill_order_sql(v_b.schema_name, v_b.table_name, '(c.pgstream_r)', true),
        pg_catalog.format('pg_temp.%I', v_fn),
        pgstream._backfill_order_sql(v_b.schema_name, v_b.table_name, '(c.pgstream_r)'),
        v_b.schema_name, v_b.table_name,
        pgstream._backfill_key_json_sql(v_b.schema_name, v_b.table_name),
        v_b.schema_name, v_b.table_name,
        pgstream._backfill_where(v_b, case when v_after is not null then '$1' end,
                                 case when v_p.upper_key is not null then '$2' end),
        pgstream._backfill_order_sql(v_b.schema_name, v_b.table_name, 't'))
    into v_rows, v_last, v_events
    using v_after, v_p.upper_key, v_b.from_key, v_b.to_key, p_limit;
    if not exists (select 1 from pg_catalog.pg_proc p where p.oid operator(pg_catalog.=) v_oid
                   and pg_catalog.format('%s %s %s %s %s', p.ctid, p.xmin, p.prosecdef, p.proowner, p.proconfig)
                       operator(pg_catalog.=) v_sig) then
        raise exception 'pgstream: backfill %: its function was changed or dropped while it ran (by the code of '
                        'subscription "%" on %.%, which runs as pgstream_writer); nothing of this chunk was written',
            p_id, v_sub.key, pg_catalog.quote_ident(v_b.schema_name), pg_catalog.quote_ident(v_b.table_name)
            using errcode = 'insufficient_privilege';
    end if;
    -- nor may it leave anything in this session for the owner's later statements to find: a temporary
    -- relation or type comes first in a search path that does not name pg_temp (a view or a type of
    -- the same name as one the owner's client names without its schema would run code as the owner)
    select pg_catalog.format('%s %s', x.kind, x.name) into v_planted
    from (select 'relation' as kind, c.oid::pg_catalog.regclass::text as name from pg_catalog.pg_class c
          where c.relnamespace operator(pg_catalog.=) pg_catalog.pg_my_temp_schema()
            and c.relowner operator(pg_catalog.<>) v_me
          union all
          select 'type', t.oid::pg_catalog.regtype::text from pg_catalog.pg_type t
          where t.typnamespace operator(pg_catalog.=) pg_catalog.pg_my_temp_schema()
            and t.typowner operator(pg_catalog.<>) v_me
          union all
          select 'function', p.oid::pg_catalog.regprocedure::text from pg_catalog.pg_proc p
          where p.pronamespace operator(pg_catalog.=) pg_catalog.pg_my_temp_schema()
            and p.proowner operator(pg_catalog.<>) v_me and p.oid operator(pg_catalog.<>) v_oid
          union all
          select 'operator', o.oid::pg_catalog.regoperator::text from pg_catalog.pg_operator o
          where o.oprnamespace operator(pg_catalog.=) pg_catalog.pg_my_temp_schema()
            and o.oprowner operator(pg_catalog.<>) v_me) as x
    order by x.kind, x.name
    limit 1;
    if v_planted is not null then
        raise exception 'pgstream: backfill %: the code of subscription "%" on %.% created % in this session as '
                        'pgstream_writer; nothing of this chunk was written',
            p_id, v_sub.key, pg_catalog.quote_ident(v_b.schema_name), pg_catalog.quote_ident(v_b.table_name), v_planted
            using errcode = 'insufficient_privilege';
    end if;
    execute pg_catalog.format('drop function %s', v_oid::pg_catalog.regprocedure);
    update pgstream.backfill_partitions
    set cursor_key = coalesce(v_last, cursor_key), done = v_rows operator(pg_catalog.<) p_limit,
        rows_read = rows_read operator(pg_catalog.+) v_rows,
        events_written = events_written operator(pg_catalog.+) coalesce(v_events, 0),
        chunks = chunks operator(pg_catalog.+) 1, updated_at = pg_catalog.now()
    where backfill_id operator(pg_catalog.=) p_id and part operator(pg_catalog.=) p_part;
    return query select case when v_rows operator(pg_catalog.<) p_limit then 'done' else 'read' end,
                        v_rows, coalesce(v_events, 0::bigint);
end
$$;
revoke all on function pgstream.backfill_chunk(bigint, integer, uuid, integer) from public;

-- The key of the row a partition reads next (null when none is left), as JSON: names the row a
-- failing chunk stopped at.
create or replace function pgstream.backfill_next_key(p_id bigint, p_part integer)
returns jsonb
language plpgsql
stable
security definer
set search_path = pg_catalog, pg_temp
set row_security = off
as $$
declare
    v_b     pgstream.backfills;
    v_p     pgstream.backfill_partitions;
    v_after jsonb;
    v_key   jsonb;
begin
    select * into v_b from pgstream.backfills where id operator(pg_catalog.=) p_id;
    select * into v_p from pgstream.backfill_partitions
    where backfill_id operator(pg_catalog.=) p_id and part operator(pg_catalog.=) p_part;
    v_after := coalesce(v_p.cursor_key, v_p.lower_key);
    execute pg_catalog.format('select %s from %I.%I as t where %s order by %s limit 1',
        pgstream._backfill_key_json_sql(v_b.schema_name, v_b.table_name), v_b.schema_name, v_b.table_name,
        pgstream._backfill_where(v_b, case when v_after is not null then '$1' end,
                                 case when v_p.upper_key is not null then '$2' end),
        pgstream._backfill_order_sql(v_b.schema_name, v_b.table_name, 't'))
    into v_key using v_after, v_p.upper_key, v_b.from_key, v_b.to_key;
    return v_key;
end
$$;
revoke all on function pgstream.backfill_next_key(bigint, integer) from public;

-- The stream's events recorded but not yet delivered or skipped, from the durable counters (no
-- ledger scan): a backfill waits while it is above its max_backlog.
create or replace function pgstream.backfill_backlog(p_stream_id bigint)
returns bigint
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select (coalesce(pg_catalog.sum(c.value) filter (where c.name operator(pg_catalog.=) 'events_recorded'), 0)
            operator(pg_catalog.-)
            coalesce(pg_catalog.sum(c.value) filter (where c.name operator(pg_catalog.=) 'events_done'), 0))::pg_catalog.int8
    from pgstream.stream_counters c
    where c.stream_id operator(pg_catalog.=) p_stream_id and c.name in ('events_recorded', 'events_done')
$$;
revoke all on function pgstream.backfill_backlog(bigint) from public;

-- Ends a run's ownership of backfill p_id: 'done' when every partition is (its function is
-- dropped), else p_status ('stopped' or 'failed', with p_error). Only the owner p_token can;
-- returns the backfill's status afterwards.
create or replace function pgstream.backfill_release(p_id bigint, p_token uuid, p_status text, p_error text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_b pgstream.backfills;
begin
    if p_status not in ('stopped', 'failed') then
        raise exception 'pgstream: backfill_release: status must be stopped or failed, got %', p_status
            using errcode = 'invalid_parameter_value';
    end if;
    select * into v_b from pgstream.backfills where id operator(pg_catalog.=) p_id for update;
    if v_b.owner_token is distinct from p_token or v_b.status operator(pg_catalog.<>) 'running' then
        return v_b.status;
    end if;
    if not exists (select 1 from pgstream.backfill_partitions p
                   where p.backfill_id operator(pg_catalog.=) p_id and not p.done) then
        update pgstream.backfills set status = 'done', owner_token = null, error = null,
               finished_at = pg_catalog.now(), updated_at = pg_catalog.now()
        where id operator(pg_catalog.=) p_id;
        perform pgstream._backfill_drop_function(p_id);
        return 'done';
    end if;
    update pgstream.backfills set status = p_status, owner_token = null, error = p_error, updated_at = pg_catalog.now()
    where id operator(pg_catalog.=) p_id;
    return p_status;
end
$$;
revoke all on function pgstream.backfill_release(bigint, uuid, text, text) from public;

-- Operator: stop (resumable) or cancel (final) backfill p_id, whoever runs it: its chunks in
-- flight commit, the next ones stop. Returns the status before.
create or replace function pgstream.backfill_stop(p_id bigint, p_cancel boolean)
returns text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_b pgstream.backfills;
begin
    select * into v_b from pgstream.backfills where id operator(pg_catalog.=) p_id for update;
    if v_b.id is null then
        raise exception 'pgstream: backfill % does not exist', p_id using errcode = 'no_data_found';
    end if;
    if v_b.status in ('done', 'cancelled') then
        return v_b.status;
    end if;
    update pgstream.backfills
    set status = case when p_cancel then 'cancelled' else 'stopped' end, owner_token = null,
        finished_at = case when p_cancel then pg_catalog.now() end, updated_at = pg_catalog.now()
    where id operator(pg_catalog.=) p_id;
    if p_cancel then
        perform pgstream._backfill_drop_function(p_id);
    end if;
    return v_b.status;
end
$$;
revoke all on function pgstream.backfill_stop(bigint, boolean) from public;

-- ---------------------------------------------------------------------------------------------
-- Progress: one row per backfill.
create or replace view pgstream.backfill_progress
with (security_barrier) as
select b.id, b.stream_id, b.subscription_key, b.schema_name, b.table_name, b.operation, b.filter,
       b.key_columns, b.from_key, b.to_key, b.status, b.run_id, b.error, b.rows_total,
       coalesce(p.rows_read, 0) as rows_read, coalesce(p.events_written, 0) as events_written,
       coalesce(p.partitions, 0) as partitions, coalesce(p.partitions_done, 0) as partitions_done,
       b.created_at, b.updated_at, b.finished_at
from pgstream.backfills b
left join lateral (
    select pg_catalog.sum(x.rows_read)::bigint as rows_read, pg_catalog.sum(x.events_written)::bigint as events_written,
           pg_catalog.count(*)::integer as partitions, (pg_catalog.count(*) filter (where x.done))::integer as partitions_done
    from pgstream.backfill_partitions x where x.backfill_id operator(pg_catalog.=) b.id
) p on true;
revoke all on pgstream.backfill_progress from public;
