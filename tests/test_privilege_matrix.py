"""Which role user-controlled code runs as, at every pgstream entry point that touches it.

A hostile table owner (``attacker``) owns a schema, a table and code of every kind pgstream may run:
a cast of its type to JSON, a domain CHECK (which parsing a literal runs, through the array type's
input function), an operator, a function called from an expression, a row-level security policy and
a trigger on the table. Each piece calls ``spy()``, which counts, outside any transaction (a sequence),
whether it ran as ``pgstream_writer``, as the attacker itself, or as any other role, and tries to
make the attacker superuser. The matrix runs every entry point
against every kind of code, each from a fresh connection, and asserts that nothing ran as the owner
and that the attacker gained nothing. The three attacks of issue 28 (privilege) follow it.

A type's own input and output functions can only be written in C by a superuser; the input path a
table owner controls is a domain's CHECK, which array_in and record_in run through domain_in for a
literal of an array (or composite) of the domain, and which the domain_check kind covers."""

# ruff: noqa: S608 -- the attacks are SQL built from the test's own role and schema names
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from pgstream_dagster.engine.migrations import WRITER_ROLE, install_drift_guard, migrate

from .test_security import connect, is_super, roles, run, subscribe

__all__ = ["roles"]  # the fixture, shared with test_security

#: the kinds of user code; where the subscription uses it (column_names, when_clause), see _hostile_table
KINDS = ["cast", "domain_check", "operator", "function", "rls_policy", "trigger"]

#: pgstream's entry points that touch user-controlled code
ENTRY_POINTS = ["insert_subscription", "set_subscriptions", "regenerate_trigger", "repair_trigger",
                "drift_guard_alter_table", "drift_guard_partitions", "backfill_start", "backfill_chunk",
                "generated_trigger"]

#: where the code must run as pgstream_writer: the matrix also proves each of these cells exercised it
#: (parsing an array literal of the domain's array type runs the CHECK; a backfill's filter is
#: "new.tags = '{1}'"; the other kinds run when a subscription's code is evaluated)
RUNS_AT = {
    ("domain_check", e) for e in ("insert_subscription", "set_subscriptions", "regenerate_trigger",
                                  "repair_trigger", "drift_guard_alter_table", "drift_guard_partitions",
                                  "backfill_start")
} | {(k, e) for k in ("cast", "operator", "function") for e in ("backfill_chunk", "generated_trigger")}


def _counts(url: str, schema: str) -> dict[str, int]:
    """How often spy() ran as pgstream_writer, as the attacker and as any other role (from sequences:
    counted even when the transaction it ran in rolled back)."""
    with connect(url) as c:
        return {who: int(c.execute(f"select case when is_called then last_value else 0 end from {schema}.as_{who}"
                                   ).fetchone()[0])  # type: ignore[index]
                for who in ("writer", "attacker", "other")}


def _hostile_table(url: str, attacker: str, kind: str) -> str:
    """Schema s_<attacker> owned by the attacker, with spy(), table t and the code of ``kind``;
    returns the schema. The subscription (made by the caller) takes key "hostile"."""
    s = f"s_{attacker}"
    esc = f"begin execute 'alter role {attacker} superuser'; exception when others then null; end;"
    run(url, f"create schema {s} authorization {attacker}", f"grant usage on schema {s} to {WRITER_ROLE}")
    run(url,
        f"create sequence {s}.as_writer", f"create sequence {s}.as_attacker", f"create sequence {s}.as_other",
        f"grant usage, update on sequence {s}.as_writer, {s}.as_attacker, {s}.as_other to public",
        f"create function {s}.spy() returns boolean language plpgsql as $$ begin "
        f"perform pg_catalog.nextval(case current_user when '{WRITER_ROLE}' then '{s}.as_writer' "
        f"when '{attacker}' then '{s}.as_attacker' else '{s}.as_other' end::regclass); {esc} return true; end $$",
        f"create function {s}.spy_int(int) returns boolean language sql as $$ select {s}.spy() $$",
        f"create function {s}.spy_eq(int, int) returns boolean language sql as $$ select {s}.spy() and $1 = $2 $$",
        f"create operator {s}.=== (leftarg = int, rightarg = int, function = {s}.spy_eq)",
        f"create type {s}.st as enum ('x')",
        f"create function {s}.st_json({s}.st) returns json language sql as "
        f"$$ select {s}.spy(); select '\"x\"'::json $$",
        f"create cast ({s}.st as json) with function {s}.st_json({s}.st)",
        f"create domain {s}.d as int check ({s}.spy_int(value))",
        f"create table {s}.t (id int primary key, st {s}.st default 'x', tags {s}.d[], n int default 1)",
        role=attacker)
    if kind == "rls_policy":
        run(url, f"alter table {s}.t enable row level security", f"alter table {s}.t force row level security",
            f"create policy p on {s}.t using ({s}.spy())", role=attacker)
    if kind == "trigger":
        run(url, f"create function {s}.trg() returns trigger language plpgsql as $$ begin perform {s}.spy(); "
                 "return new; end $$",
            f"create trigger spy before insert or update or delete on {s}.t for each row execute function {s}.trg()",
            role=attacker)
    return s


def _subscription(schema: str, kind: str) -> dict[str, Any]:
    """The subscription that makes pgstream meet the code of ``kind``."""
    when = {"domain_check": "new.tags = '{1}'", "operator": f"new.n operator({schema}.===) 1",
            "function": f"{schema}.spy()"}.get(kind)
    return {"columns": ["id", "st"] if kind == "cast" else ["id"], "when": when}


def _subscribe(url: str, schema: str, kind: str) -> None:
    sub = _subscription(schema, kind)
    subscribe(url, "hostile", "t", schema=schema, columns=sub["columns"], when=sub["when"])


def _backfill(url: str, key: str = "hostile", where: str | None = None) -> int:
    with connect(url) as c:
        row = c.execute("select pgstream.backfill_start(1, s.key, s.schema_name, 't', %s, null, null, 1) "
                        "from pgstream.subscriptions s where s.key = %s", [where, key]).fetchone()
    assert row is not None
    return int(row[0])


def _chunks(url: str, backfill_id: int, chunks: int = 1, size: int = 1) -> None:
    with connect(url) as c:
        token = uuid.uuid4()
        c.execute("select pgstream.backfill_claim(%s, %s, 'matrix')", [backfill_id, token])
        for _ in range(chunks):
            c.execute("select * from pgstream.backfill_chunk(%s, 0, %s, %s)", [backfill_id, token, size])


def _enter(url: str, attacker: str, schema: str, kind: str, entry: str) -> None:
    """Runs one entry point (as the owner, or as the attacker where the attacker starts it)."""
    if entry == "insert_subscription":
        _subscribe(url, schema, kind)
        return
    if entry == "set_subscriptions":
        sub = _subscription(schema, kind)
        with connect(url) as c:
            c.execute("select * from pgstream.set_subscriptions(1, array[jsonb_populate_record("
                      "null::pgstream.subscriptions, "
                      "jsonb_build_object('key', 'hostile', 'operation', 'INSERT', 'schema_name', %s::text, "
                      "'table_name', 't', 'when_clause', %s::text, 'column_names', %s::text[]))])",
                      [schema, sub["when"], sub["columns"]])
        return
    run(url, f"insert into {schema}.t (id, tags) values (1, '{{1}}'), (2, '{{2}}')", role=attacker)
    if entry == "drift_guard_partitions":
        # t, rows and code, attached to a subscribed partitioned table and detached again: the guard
        # validates the subscriptions, gives t the triggers' copies, then reads whether t holds rows
        # (its DELETE subscriber opted in: the detach is its TRUNCATE event)
        run(url, f"create table {schema}.pp (like {schema}.t including defaults) partition by range (id)",
            role=attacker)
        sub = _subscription(schema, kind)
        subscribe(url, "hostile", "pp", schema=schema, columns=sub["columns"], when=sub["when"])
        subscribe(url, "hostile-gone", "pp", schema=schema, op="DELETE", columns=["id"])
        run(url, "update pgstream.subscriptions set emit_truncate = true where key = 'hostile-gone'")
        run(url, f"alter table {schema}.pp attach partition {schema}.t for values from (0) to (100)",
            f"alter table {schema}.pp detach partition {schema}.t", role=attacker)
        with connect(url) as c:  # the cell exercised the read: t's rows left as its TRUNCATE event
            assert c.execute("select count(*) from pgstream.events where payload ->> 'tg_op' = 'TRUNCATE' "
                             "and payload ->> 'tg_table_name' = 't'").fetchone() == (1,)
        return
    _subscribe(url, schema, kind)
    if entry in ("regenerate_trigger", "repair_trigger"):
        run(url, f"select pgstream.{entry}('{schema}', 't', 'INSERT')")
    elif entry == "drift_guard_alter_table":
        run(url, f"alter table {schema}.t add column extra int", role=attacker)
    elif entry == "backfill_start":
        _backfill(url, where="new.tags = '{1}'")
    elif entry == "backfill_chunk":
        backfill_id = _backfill(url, where="new.tags = '{1}'")
        _chunks(url, backfill_id, chunks=2)
    elif entry == "generated_trigger":
        run(url, f"insert into {schema}.t (id, tags) values (3, '{{3}}')", role=attacker)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_user_code_never_runs_as_the_owner(db_url: str, roles: Callable[..., str], kind: str, entry: str) -> None:
    attacker = roles()
    schema = _hostile_table(db_url, attacker, kind)
    _enter(db_url, attacker, schema, kind, entry)
    ran = _counts(db_url, schema)
    assert ran["other"] == 0, f"{kind} ran as a role other than pgstream_writer or its owner at {entry}"
    assert not is_super(db_url, attacker)
    if (kind, entry) in RUNS_AT:
        assert ran["writer"] > 0, f"{kind} did not run at {entry}: the cell proves nothing"


# --------------------------------------------------------------------------------------------
# The three privilege findings of issue 28, as attacks


def test_code_run_as_the_writer_cannot_change_the_function_a_backfill_chunk_calls(
        db_url: str, roles: Callable[..., str]) -> None:
    """A cast on the table owner's type runs as pgstream_writer inside a backfill chunk and makes every
    function pgstream_writer owns (but the trigger functions) SECURITY INVOKER: the next chunk must not
    run the cast as the owner."""
    attacker = roles()
    s = _hostile_table(db_url, attacker, "cast")
    sabotage = (f"begin for f in select p.oid::regprocedure from pg_proc p where p.proowner = '{WRITER_ROLE}'::regrole "
                f"and p.proname not like '\\_publish\\_%' loop "
                "execute format('alter function %s security invoker', f); "
                f"end loop; exception when others then null; end;")
    run(db_url, f"create or replace function {s}.st_json({s}.st) returns json language plpgsql as $$ "
                f"declare f regprocedure; begin perform {s}.spy(); {sabotage} return '\"x\"'::json; end $$",
        f"insert into {s}.t (id) select g from generate_series(1, 4) g", role=attacker)
    _subscribe(db_url, s, "cast")
    backfill_id = _backfill(db_url)
    with connect(db_url) as c:
        token = uuid.uuid4()
        c.execute("select pgstream.backfill_claim(%s, %s, 'attack')", [backfill_id, token])
        for _ in range(3):
            try:
                c.execute("select * from pgstream.backfill_chunk(%s, 0, %s, 1)", [backfill_id, token])
            except psycopg.errors.InsufficientPrivilege as exc:
                assert "its function was changed or dropped while it ran" in str(exc)
    ran = _counts(db_url, s)
    assert ran["writer"] > 0 and ran["other"] == 0
    assert not is_super(db_url, attacker)
    with connect(db_url) as c:  # nothing pgstream_writer owns outlives a transaction but the trigger functions
        assert c.execute("select p.oid::regprocedure::text from pg_proc p where p.proowner = %s::regrole "
                         "and p.proname not like '\\_publish\\_%%'", [WRITER_ROLE]).fetchall() == []


def test_parsing_an_expression_runs_the_table_owners_domain_check_as_the_writer(
        db_url: str, roles: Callable[..., str]) -> None:
    """The table owner retypes a column a when_clause compares with an array literal to an array of its
    own domain: the drift guard re-parses the when_clause, which runs the domain's CHECK (array_in ->
    domain_in), and so do trigger regeneration and repair. The parse is rolled back, but what the CHECK
    does outside the transaction (COPY ... TO PROGRAM, counted here by a sequence) is not: it must
    run as pgstream_writer."""
    attacker = roles()
    s = _hostile_table(db_url, attacker, "cast")
    run(db_url, f"alter table {s}.t add column tags2 int[]")
    subscribe(db_url, "tagged", "t", schema=s, columns=["id"], when="new.tags2 = '{1}'")
    subscribe(db_url, "all", "t", schema=s, columns=["id"])  # so the trigger has no WHEN to pin the column
    with connect(db_url, attacker) as c:
        c.execute(f"alter table {s}.t alter column tags2 type {s}.d[]")
    ran = _counts(db_url, s)
    assert ran["writer"] > 0 and ran["other"] == 0
    for entry in ("regenerate_trigger", "repair_trigger"):
        run(db_url, f"select pgstream.{entry}('{s}', 't', 'INSERT')")
    ran = _counts(db_url, s)
    assert ran["writer"] > 1 and ran["other"] == 0
    assert not is_super(db_url, attacker)


@dataclass(frozen=True)
class _Install:
    """A database pgstream is installed in by a non-superuser owner, and a hostile role that may create in it."""

    name: str
    owner: str
    attacker: str
    owner_url: str
    attacker_url: str


@contextmanager
def _non_superuser_install(pg: Any, roles: Callable[..., str], prefix: str) -> Iterator[_Install]:
    """Database ``<prefix>_<owner>`` owned and migrated by a non-superuser owner (a member of pgstream_writer,
    later of the attacker's role, as a migrator that subscribes an application's tables can be); dropped after."""
    owner = roles("alter role {role} createrole replication")
    attacker = roles()
    name = f"{prefix}_{owner}"
    run(pg.url, f"create database {name} owner {owner}", f"grant {WRITER_ROLE} to {owner}")
    install = _Install(name, owner, attacker, pg.url_for(name).replace("postgres@", f"{owner}@", 1),
                       pg.url_for(name).replace("postgres@", f"{attacker}@", 1))
    try:
        migrate(install.owner_url)
        run(install.owner_url, f"grant create on database {name} to {attacker}")
        yield install
    finally:
        run(pg.url, f"drop database if exists {name} with (force)", f"revoke {WRITER_ROLE} from {owner}",
            f"revoke {attacker} from {owner}")


def test_a_backfill_never_runs_the_table_owners_rls_policy_as_a_non_superuser_owner(
        pg: Any, roles: Callable[..., str]) -> None:
    """The table owner's forced RLS policy would run as pgstream's (non-superuser) owner when a backfill
    reads the table, and could then rewrite pgstream.subscriptions: the backfill refuses instead, naming
    the table and the fix. (pgstream's owner is a member of the table's owner role, as a migrator that
    subscribes an application's tables can be.)"""
    with _non_superuser_install(pg, roles, "rls") as db:
        owner, attacker, owner_url, attacker_url = db.owner, db.attacker, db.owner_url, db.attacker_url
        s = f"s_{attacker}"
        run(attacker_url, f"create schema {s}",
            f"create table {s}.t (id int primary key, note text)",
            f"insert into {s}.t values (1, 'a'), (2, 'b')",
            f"create function {s}.pol() returns boolean language plpgsql as $$ begin "
            "begin update pgstream.subscriptions set when_clause = 'false'; exception when others then null; end; "
            "return true; end $$",
            f"alter table {s}.t enable row level security", f"alter table {s}.t force row level security",
            f"create policy p on {s}.t using ({s}.pol())",
            f"grant usage on schema {s} to {owner}, {WRITER_ROLE}",
            f"grant select, update, trigger on {s}.t to {owner}")
        run(pg.url, f"grant {attacker} to {owner}")
        subscribe(owner_url, "mine", "t", schema=s, columns=["id", "note"])
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
            _backfill(owner_url, "mine")
        assert f"table {s}.t has row-level security that applies to role {owner}" in str(err.value)
        assert err.value.diag.message_hint is not None and "bypassrls" in err.value.diag.message_hint
        with connect(owner_url) as c:
            assert c.execute("select when_clause from pgstream.subscriptions").fetchall() == [(None,)]
            assert c.execute("select count(*) from pgstream.backfills").fetchone() == (0,)
        # granted BYPASSRLS, the owner reads every row, and no policy runs
        run(pg.url, f"alter role {owner} bypassrls")
        backfill_id = _backfill(owner_url, "mine")
        _chunks(owner_url, backfill_id, chunks=1, size=10)
        with connect(owner_url) as c:
            assert c.execute("select when_clause from pgstream.subscriptions").fetchall() == [(None,)]
            assert c.execute("select count(*) from pgstream.events where payload->>'tg_op' = 'READ'"
                             ).fetchone() == (2,)
        run(pg.url, f"alter role {owner} nobypassrls")


def test_a_detach_never_runs_the_table_owners_rls_policy_as_a_non_superuser_owner(
        pg: Any, roles: Callable[..., str]) -> None:
    """After DETACH PARTITION the drift guard reads, as pgstream's owner, whether the detached table
    holds rows. On an install whose owner is no superuser (a superuser added the guard's event triggers)
    the table owner's forced RLS policy would run as that owner: the read refuses it instead, and the
    table counts as holding rows (its DELETE subscriber, opted in, gets the TRUNCATE event)."""
    with _non_superuser_install(pg, roles, "rlsd") as db:
        owner, attacker, owner_url, attacker_url = db.owner, db.attacker, db.owner_url, db.attacker_url
        install_drift_guard(pg.url_for(db.name))
        s = f"s_{attacker}"
        run(attacker_url, f"create schema {s}", f"grant usage on schema {s} to {owner}, {WRITER_ROLE}",
            f"create sequence {s}.as_owner", f"grant usage, update on sequence {s}.as_owner to public",
            f"create function {s}.pol() returns boolean language plpgsql as $$ begin "
            f"if current_user = '{owner}' then perform pg_catalog.nextval('{s}.as_owner'); end if; "
            "return true; end $$",
            f"create table {s}.pt (id int, k int) partition by range (k)",
            f"create table {s}.p1 partition of {s}.pt for values from (0) to (10)",
            f"insert into {s}.pt values (1, 1)",
            f"alter table {s}.p1 enable row level security", f"alter table {s}.p1 force row level security",
            f"create policy p on {s}.p1 using ({s}.pol())",
            f"grant select, trigger on {s}.pt, {s}.p1 to {owner}")
        run(pg.url, f"grant {attacker} to {owner}")
        subscribe(owner_url, "gone", "pt", schema=s, op="DELETE", columns=["id"])
        run(owner_url, "update pgstream.subscriptions set emit_truncate = true")
        run(attacker_url, f"alter table {s}.pt detach partition {s}.p1")
        with connect(owner_url) as c:
            assert c.execute(f"select is_called from {s}.as_owner").fetchone() == (False,)
            assert c.execute("select payload ->> 'tg_table_name' from pgstream.events "
                             "where payload ->> 'tg_op' = 'TRUNCATE'").fetchall() == [("p1",)]
        assert not is_super(pg.url, attacker)


def test_the_drift_guard_never_needs_rights_on_a_schema_pgstream_does_not_subscribe(
        pg: Any, roles: Callable[..., str]) -> None:
    """The guard's event triggers run as pgstream's owner on every DDL command of every role. In a schema
    the owner may not use (no subscription there), another role's DDL goes through as without the guard:
    the guard finds tables by name in the catalog, never by resolving a name that needs USAGE."""
    with _non_superuser_install(pg, roles, "nouse") as db:
        install_drift_guard(pg.url_for(db.name))
        run(db.owner_url, "create table public.mine (id int primary key)")
        subscribe(db.owner_url, "mine", "mine", schema="public", op="DELETE", columns=["id"])
        s = f"priv_{db.attacker}"
        run(db.attacker_url, f"create schema {s}", f"revoke all on schema {s} from public",
            f"create table {s}.t (id int, note text)", f"alter table {s}.t add column extra int",
            f"create function {s}.f() returns trigger language plpgsql as $$ begin return new; end $$",
            f"create trigger tr before insert on {s}.t for each row execute function {s}.f()",
            f"drop trigger tr on {s}.t", f"alter table {s}.t drop column note",
            f"create table {s}.pt (id int, k int) partition by range (k)",
            f"create table {s}.p1 partition of {s}.pt for values from (0) to (10)",
            f"insert into {s}.pt values (1, 1)",
            f"alter table {s}.pt detach partition {s}.p1", f"drop table {s}.p1", f"drop schema {s} cascade")
        with connect(db.owner_url) as c:
            assert c.execute("select has_schema_privilege(current_user, 'pgstream', 'usage')").fetchone() == (True,)
            assert c.execute("select count(*) from pg_namespace where nspname = %s", [s]).fetchone() == (0,)


# --------------------------------------------------------------------------------------------
# What code that ran as pgstream_writer could leave behind for the owner


def test_every_function_in_pgstream_changes_only_with_pgstreams_own_ddl(db_url: str) -> None:
    """By schema, not by name: creating, replacing, altering or dropping any function in pgstream
    outside pgstream's own DDL is refused, even for a superuser by hand; migrate still applies."""
    attempts = [
        "create function pgstream.planted() returns int language sql as $$ select 1 $$",
        "create or replace function pgstream.backfill_function_name(p_id bigint) returns text language sql "
        "as $$ select 'x' $$",
        "alter function pgstream.backfill_function_name(bigint) security definer",
        f"alter function pgstream.backfill_function_name(bigint) owner to {WRITER_ROLE}",
        "alter function pgstream.backfill_function_name(bigint) set search_path = public",
        "drop function pgstream.backfill_function_name(bigint)",
    ]
    with connect(db_url) as c:
        before = c.execute("select p.oid, p.prosecdef, p.proowner, p.proconfig, p.prosrc from pg_proc p "
                           "where p.oid = 'pgstream.backfill_function_name(bigint)'::regprocedure").fetchone()
    for attempt in attempts:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="change only with pgstream's own DDL"):
            run(db_url, attempt)
    with connect(db_url) as c:
        assert c.execute("select p.oid, p.prosecdef, p.proowner, p.proconfig, p.prosrc from pg_proc p "
                         "where p.oid = 'pgstream.backfill_function_name(bigint)'::regprocedure").fetchone() == before
        assert c.execute("select to_regprocedure('pgstream.planted()')").fetchone() == (None,)
        c.execute("update pgstream.schema_repeatables set checksum = 'changed' where name = '10_backfills.sql'")
    assert migrate(db_url) == ["repeatable/10_backfills.sql"]


def test_a_temporary_table_planted_by_writer_code_in_the_owners_session_is_refused(
        db_url: str, roles: Callable[..., str]) -> None:
    """Code that runs as pgstream_writer in the owner's session (a backfill chunk; a generated trigger
    fired by the owner's own write) may create temporary objects, which come first in a search path
    that does not name pg_temp: here a table by the name set_subscriptions keeps its input in, with a
    trigger whose function would run as whoever writes the table. A chunk that leaves such an object
    behind fails and writes nothing; owner code refuses a fixed-name temporary table it does not own."""
    attacker = roles()
    s = _hostile_table(db_url, attacker, "cast")
    plant = ("begin create table pg_temp.pgstream_set_subscriptions_input_v4 (key text, operation "
             "pgstream.operation_type, schema_name text, table_name text, when_clause text, column_names text[], "
             "metadata jsonb, payload_extensions jsonb, managed_by text, trigger_mode text, "
             "metadata_extensions jsonb, emit_truncate boolean); "
             f"create function pg_temp.planted() returns trigger language plpgsql as $p$ begin perform {s}.spy(); "
             "return new; end $p$; create trigger planted before insert on pg_temp.pgstream_set_subscriptions_input_v4 "
             "for each row execute function pg_temp.planted(); exception when others then null; end;")
    run(db_url, f"create or replace function {s}.st_json({s}.st) returns json language plpgsql as $$ "
                f"begin {plant} return '\"x\"'::json; end $$",
        f"insert into {s}.t (id) values (1)", role=attacker)
    _subscribe(db_url, s, "cast")
    backfill_id = _backfill(db_url)
    set_subscriptions = ("select * from pgstream.set_subscriptions(2, array[jsonb_populate_record("
                         "null::pgstream.subscriptions, jsonb_build_object('key', 'x', 'operation', 'INSERT', "
                         "'schema_name', %s::text, 'table_name', 't'))])")
    with connect(db_url) as c:  # one session: the owner's
        token = uuid.uuid4()
        c.execute("select pgstream.backfill_claim(%s, %s, 'attack')", [backfill_id, token])
        with pytest.raises(psycopg.errors.InsufficientPrivilege,
                           match=r"the code of subscription \"hostile\" on .* created .*pg_temp_\d+\..* in this "
                                 r"session as pgstream_writer; nothing of this chunk was written"):
            c.execute("select * from pgstream.backfill_chunk(%s, 0, %s, 10)", [backfill_id, token])
        assert c.execute("select count(*) from pg_class where relname = 'pgstream_set_subscriptions_input_v4'"
                         ).fetchone() == (0,)
        c.execute(set_subscriptions, [s])  # nothing was left behind
        # the owner writes the subscribed table itself: its trigger runs the cast as pgstream_writer
        c.execute(f"insert into {s}.t (id) values (2)")
        assert c.execute("select relowner::regrole::text from pg_class "
                         "where relname = 'pgstream_set_subscriptions_input_v4'").fetchall() == [(WRITER_ROLE,)]
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="refusing to use temporary table"):
            c.execute(set_subscriptions, [s])
    ran = _counts(db_url, s)
    assert ran["other"] == 0
    assert not is_super(db_url, attacker)


def test_without_temp_for_the_writer_validation_and_backfills_name_the_grant(db_url: str) -> None:
    """pgstream_writer parses and backfills in the session's temporary schema: without TEMP on the
    database (PUBLIC has it by default) both stop with an error naming the grant, and change nothing."""
    database = db_url.rsplit("/", 1)[1]
    run(db_url, "create table public.t (id int primary key, note text)", "insert into public.t values (1, 'a')")
    subscribe(db_url, "t-insert", "t", columns=["id", "note"])
    backfill_id = _backfill(db_url, "t-insert")
    run(db_url, f"revoke temp on database {database} from public")
    grant = f"grant temp on database {database} to pgstream_writer"
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=grant):
        subscribe(db_url, "filtered", "t", columns=["id"], when="new.note <> 'x'")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match=grant):
        _chunks(db_url, backfill_id, chunks=1, size=10)
    with connect(db_url) as c:
        assert c.execute("select key from pgstream.subscriptions").fetchall() == [("t-insert",)]
        assert c.execute("select count(*) from pgstream.events where payload->>'tg_op' = 'READ'").fetchone() == (0,)
    run(db_url, f"grant temp on database {database} to {WRITER_ROLE}")
    subscribe(db_url, "filtered", "t", columns=["id"], when="new.note <> 'x'")
    _chunks(db_url, backfill_id, chunks=1, size=10)
