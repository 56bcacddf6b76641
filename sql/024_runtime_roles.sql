-- 024: a least-privilege runtime. Three kinds of roles connect to pgstream:
--   * the owner (runs `pgstream-dagster migrate` and `init`): owns the schema, its tables and
--     functions; the only role that may write pgstream.subscriptions or change a definition;
--   * the runtime (the code location, its sensors and schedules, every run, the CLI's operations):
--     a LOGIN role with REPLICATION that is a member of the group role pgstream_runtime;
--   * the Spark executors: a LOGIN role that is a member of the group role pgstream_executor.
-- This version creates the two NOLOGIN group roles; what each may do (the grants, and the owner's
-- SECURITY DEFINER functions that do what needs ownership) is in repeatable/99_runtime.sql, which
-- is the one place that grants anything to them.
do $$
declare
    v_role text;
begin
    foreach v_role in array array['pgstream_runtime', 'pgstream_executor'] loop
        if not exists (select 1 from pg_catalog.pg_roles r where r.rolname operator(pg_catalog.=) v_role) then
            begin
                execute pg_catalog.format('create role %I nologin', v_role);
            exception when insufficient_privilege then
                raise exception 'pgstream: migrate must create the role % and cannot (it needs CREATEROLE)', v_role
                    using hint = pg_catalog.format('Create it once as a superuser: create role %I nologin;', v_role);
            end;
        end if;
        -- a group role: it logs in never and holds no attribute; its members are the login roles
        if exists (select 1 from pg_catalog.pg_roles r
                   where r.rolname operator(pg_catalog.=) v_role
                     and (r.rolsuper or r.rolcanlogin or r.rolcreaterole or r.rolcreatedb or r.rolreplication
                          or r.rolbypassrls)) then
            raise exception 'pgstream: role % must be NOLOGIN and hold no attribute (superuser, createrole, '
                            'createdb, replication, bypassrls): its members log in', v_role;
        end if;
        -- it must not inherit anything: a member of another role would pass that role's rights on
        if exists (select 1 from pg_catalog.pg_auth_members m
                   where m.member operator(pg_catalog.=) v_role::pg_catalog.regrole) then
            raise exception 'pgstream: role % must not be a member of any role (its members would inherit that '
                            'role''s privileges)', v_role;
        end if;
    end loop;
end
$$;
