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
--
-- This version creates the role, its grants and the tables the model needs. The functions (all
-- with that search_path, none executable by PUBLIC) are in repeatable/*.sql: code generation and
-- validation in 04_subscriptions.sql, whose last step recreates every generated trigger of an
-- earlier install under this model (owner pgstream_writer); the drift guard in 05_drift_guard.sql.

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

-- The drift guard of an earlier install let any session through that set pgstream.internal_ddl:
-- its event triggers go here, and repeatable/05_drift_guard.sql installs the guard of this model
-- (until then pgstream's own DDL, regenerating the triggers, meets no guard of the old model).
do $$
begin
    drop event trigger if exists pgstream_drift_guard_drop;
    drop event trigger if exists pgstream_drift_guard_alter;
exception when insufficient_privilege then
    null;  -- not a superuser: the guard could not have been installed
end
$$;

-- Replaced by functions with other signatures (repeatable/04_subscriptions.sql,
-- repeatable/05_drift_guard.sql): gone from earlier installs.
drop function if exists pgstream._regenerate_trigger_mode(text, text, pgstream.operation_type, text);
drop function if exists pgstream._drift_check_unresolved(text);
