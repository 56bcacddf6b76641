"""Attacks on what pgstream runs in the database, each from a fresh connection as an unprivileged role.

Every test asserts afterwards that no role gained ``rolsuper`` (or another privilege it did not
have) and that an ordinary INSERT by a role holding nothing but INSERT on the table still produces
its event. PL/pgSQL caches compiled functions per session, so attacks run in new sessions.
"""

# ruff: noqa: S608 -- the attacks are SQL built from the test's own role and schema names
from __future__ import annotations

import datetime as dt
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pgstream_dagster.config import HousekeepingConfig
from pgstream_dagster.engine.housekeeping import HousekeepingReport, run_housekeeping
from pgstream_dagster.engine.ledger import locks, streams
from pgstream_dagster.engine.migrations import WRITER_ROLE, migrate

from .support.releases import released_sql

_ids = itertools.count()

# PL/pgSQL that tries to make ROLE superuser and swallows the failure, so that the attacker's
# statement goes on and the test can tell "ran, but without privilege" from "did not run".
ESCALATE = "begin execute 'alter role {role} superuser'; exception when others then null; end;"


def connect(url: str, role: str | None = None) -> psycopg.Connection[Any]:
    if role is None:
        return psycopg.connect(url, autocommit=True)
    return psycopg.connect(url, user=role, autocommit=True)


def run(url: str, *statements: str, role: str | None = None) -> None:
    with connect(url, role) as c:
        for statement in statements:
            c.execute(statement)


def is_super(url: str, role: str) -> bool:
    with connect(url) as c:
        row = c.execute("select rolsuper from pg_roles where rolname = %s", [role]).fetchone()
    assert row is not None
    return bool(row[0])


def superusers(url: str) -> set[str]:
    with connect(url) as c:
        return {r[0] for r in c.execute("select rolname from pg_roles where rolsuper").fetchall()}


def events(url: str) -> list[dict[str, Any]]:
    with connect(url) as c:
        return [r[0] for r in c.execute("select payload from pgstream.events order by id").fetchall()]


def metadata(url: str) -> list[Any]:
    with connect(url) as c:
        return [r[0] for r in c.execute("select metadata from pgstream.events order by id").fetchall()]


#: where an extension's value lands: the payload (payload_extensions) or the metadata (metadata_extensions)
EXTENSION_KINDS = ["payload_extensions", "metadata_extensions"]


def computed(url: str, kind: str) -> list[Any]:
    """What the extensions of ``kind`` wrote into each event (the payload, or the metadata)."""
    return events(url) if kind == "payload_extensions" else metadata(url)


def subscribe(url: str, key: str, table: str, *, schema: str = "public", op: str = "INSERT",
              columns: list[str] | None = None, when: str | None = None,
              extensions: list[dict[str, str]] | None = None, metadata: dict[str, Any] | None = None,
              mode: str = "row", kind: str = "payload_extensions") -> None:
    """``extensions`` are payload extensions, or metadata extensions with ``kind="metadata_extensions"``."""
    sub = {"key": key, "stream_id": 1, "operation": op, "schema_name": schema, "table_name": table,
           "when_clause": when, "column_names": columns or [], "payload_extensions": [], "metadata": metadata,
           "trigger_mode": mode}
    sub[kind] = extensions or []  # metadata_extensions only when asked: older schemas lack the column
    cols = ", ".join(sub)
    run(url, f"insert into pgstream.subscriptions ({cols}) select {cols} from "
             f"jsonb_populate_record(null::pgstream.subscriptions, {sql.quote(json.dumps(sub))}::jsonb)")


@pytest.fixture
def roles(db_url: str) -> Iterator[Callable[..., str]]:
    """Creates LOGIN roles with nothing but what the test grants; drops them afterwards."""
    made: list[str] = []

    def make(*grants: str) -> str:
        name = f"attacker_{next(_ids)}_{db_url.rsplit('/', 1)[1]}"
        run(db_url, f"create role {name} login")
        for grant in grants:
            run(db_url, grant.format(role=name))
        made.append(name)
        return name

    yield make
    with connect(db_url) as c:
        c.execute("delete from pgstream.subscriptions")  # else the drift guard refuses DROP OWNED
        for name in made:
            c.execute(sql.SQL("alter role {} nosuperuser").format(sql.Identifier(name)))
            c.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(name)))
            c.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))


@pytest.fixture
def table(db_url: str) -> str:
    """public.t, owned by the pgstream owner, subscribed on INSERT (columns id, note; metadata null)."""
    run(db_url, "create table public.t (id bigint generated always as identity primary key, note text)")
    subscribe(db_url, "t-insert", "t", columns=["id", "note"])
    return "public.t"


def app_role(roles: Callable[..., str]) -> str:
    """A role with nothing but INSERT on public.t."""
    return roles("grant insert on public.t to {role}")


def assert_insert_still_produces_its_event(db_url: str, roles: Callable[..., str]) -> None:
    plain = app_role(roles)
    before = [e for e in events(db_url) if e["tg_name"] == "t-insert"]
    run(db_url, "insert into public.t (note) values ('plain')", role=plain)
    after = [e for e in events(db_url) if e["tg_name"] == "t-insert"]
    assert len(after) == len(before) + 1
    assert after[-1]["new"]["note"] == "plain"


# --------------------------------------------------------------------------------------------
# 1. pg_temp cannot shadow the types of owner-run or generated code


@pytest.mark.parametrize("shadowed", ["jsonb", "text", "int8", "numeric", "bool", "name"])
def test_pg_temp_types_do_not_shadow_generated_trigger_code(db_url: str, table: str, roles: Callable[..., str],
                                                            shadowed: str) -> None:
    app = app_role(roles)
    before = superusers(db_url)
    with connect(db_url, app) as c:  # a new session: nothing compiled yet
        c.execute(f"create type pg_temp.{shadowed} as enum ('{{}}', 'x', 'true')")
        for src, dst in ((f"pg_catalog.{shadowed}", f"pg_temp.{shadowed}"),
                         (f"pg_temp.{shadowed}", f"pg_catalog.{shadowed}")):
            fn = f"pg_temp.esc_{next(_ids)}"
            value = "'{}'" if dst.startswith("pg_temp") else "null"
            c.execute(f"create function {fn}({src}) returns {dst} language plpgsql called on null input as "
                      f"$$ begin {ESCALATE.format(role=app)} return {value}; end $$")
            c.execute(f"create cast ({src} as {dst}) with function {fn}({src}) as implicit")
        c.execute("insert into public.t (note) values ('from a shadowing session')")
    assert not is_super(db_url, app)
    assert superusers(db_url) == before
    assert events(db_url)[-1]["new"]["note"] == "from a shadowing session"
    assert_insert_still_produces_its_event(db_url, roles)


@pytest.mark.parametrize("mode", ["row", "statement"])
def test_pg_temp_types_do_not_shadow_computed_metadata(db_url: str, roles: Callable[..., str], mode: str) -> None:
    """Metadata extensions are generated code too: a session that shadows the types they produce
    (and jsonb, text) still writes the computed metadata, and gains nothing."""
    run(db_url, "create table public.t (id bigint generated always as identity primary key, note text)")
    subscribe(db_url, "t-insert", "t", columns=["id", "note"], metadata={"static": {"kept": True}}, mode=mode,
              kind="metadata_extensions",
              extensions=[{"json_path": "static.note", "expression": "upper(new.note)"},
                          {"json_path": "n", "expression": "new.id::numeric * 2"},
                          {"json_path": "flag", "expression": "new.note is not null"}])
    app = app_role(roles)
    before = superusers(db_url)
    with connect(db_url, app) as c:  # a new session: nothing compiled yet
        for shadowed in ("jsonb", "text", "numeric", "bool"):
            c.execute(f"create type pg_temp.{shadowed} as enum ('{{}}', 'x', 'true')")
            fn = f"pg_temp.esc_{next(_ids)}"
            c.execute(f"create function {fn}(pg_catalog.{shadowed}) returns pg_temp.{shadowed} language plpgsql "
                      f"called on null input as $$ begin {ESCALATE.format(role=app)} return 'x'; end $$")
            c.execute(f"create cast (pg_catalog.{shadowed} as pg_temp.{shadowed}) with function "
                      f"{fn}(pg_catalog.{shadowed}) as implicit")
        c.execute("insert into public.t (note) values ('shadowed')")
    assert not is_super(db_url, app)
    assert superusers(db_url) == before
    assert metadata(db_url) == [{"static": {"kept": True, "note": "SHADOWED"}, "n": 2, "flag": True}]


def test_pg_temp_text_does_not_shadow_the_drift_guard(db_url: str, table: str, roles: Callable[..., str]) -> None:
    """Dropping any table the role owns runs the (superuser-owned) drift guard: no subscription needed."""
    app = roles()
    run(db_url, f"create schema own_{app} authorization {app}")
    run(db_url, f"create table own_{app}.mine (id int, x int)", f"alter table own_{app}.mine owner to {app}")
    with connect(db_url, app) as c:
        c.execute("create type pg_temp.text as enum ('x')")
        c.execute("create function pg_temp.esc(pg_catalog.text) returns pg_temp.text language plpgsql as "
                  f"$$ begin {ESCALATE.format(role=app)} return 'x'; end $$")
        c.execute("create cast (pg_catalog.text as pg_temp.text) with function pg_temp.esc(pg_catalog.text) "
                  "as implicit")
        c.execute(f"alter table own_{app}.mine drop column x")  # ddl_command_end and sql_drop
        c.execute(f"alter table own_{app}.mine rename to mine2")
        c.execute(f"drop table own_{app}.mine2")
    assert not is_super(db_url, app)
    assert_insert_still_produces_its_event(db_url, roles)


# --------------------------------------------------------------------------------------------
# 2. casts of the table owner's own types run as pgstream_writer


def test_user_cast_on_the_table_owners_type_runs_without_privilege(db_url: str, roles: Callable[..., str]) -> None:
    app = roles()
    schema = f"own_{app}"
    run(db_url, f"create schema {schema} authorization {app}")
    run(db_url, f"create type {schema}.st as enum ('new', 'paid')", f"alter type {schema}.st owner to {app}",
        f"create table {schema}.orders (id int primary key, status {schema}.st, note text)",
        f"alter table {schema}.orders owner to {app}")
    subscribe(db_url, "orders", "orders", schema=schema, columns=["id", "status"])
    with connect(db_url, app) as c:
        c.execute(f"create function {schema}.st_json({schema}.st) returns json language plpgsql as "
                  f"$$ begin {ESCALATE.format(role=app)} return '\"cast ran\"'::json; end $$")
        c.execute(f"create cast ({schema}.st as json) with function {schema}.st_json({schema}.st)")
    with connect(db_url, app) as c:
        c.execute(f"insert into {schema}.orders values (1, 'new', 'a')")
    assert not is_super(db_url, app)
    got = events(db_url)
    assert len(got) == 1 and got[0]["new"]["id"] == 1  # the event is written (by pgstream_writer)

    # retyping a published column to the attacker's type is refused, as documented
    run(db_url, f"create table {schema}.other (id int primary key, status text)",
        f"alter table {schema}.other owner to {app}")
    subscribe(db_url, "other", "other", schema=schema, columns=["id", "status"])
    with pytest.raises(psycopg.errors.DependentObjectsStillExist, match=r"column status of .* type would change"):
        run(db_url, f"alter table {schema}.other alter column status type {schema}.st using status::{schema}.st",
            role=app)
    with connect(db_url) as c:
        assert c.execute("select atttypid::regtype::text from pg_attribute "
                         f"where attrelid = '{schema}.other'::regclass and attname = 'status'").fetchone() == ("text",)
    # a column no subscription publishes may change type
    run(db_url, f"alter table {schema}.orders alter column note type varchar(10)", role=app)


# --------------------------------------------------------------------------------------------
# 3. functions called from expressions run as pgstream_writer, who must be allowed to call them


@pytest.mark.parametrize("kind", EXTENSION_KINDS)
def test_function_in_an_expression_replaced_by_its_owner_runs_without_privilege(
        db_url: str, table: str, roles: Callable[..., str], kind: str) -> None:
    app = roles("grant insert on public.t to {role}")
    schema = f"fn_{app}"
    run(db_url, f"create schema {schema} authorization {app}")
    run(db_url, f"create function {schema}.tag(bigint) returns text language sql as $$ select 'id-' || $1 $$",
        f"alter function {schema}.tag(bigint) owner to {app}")
    # pgstream_writer evaluates it and has no USAGE on the schema yet: refused, naming what to grant
    tag = [{"json_path": "tag", "expression": f"{schema}.tag(new.id)"}]
    with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
        subscribe(db_url, "tagged", "t", columns=["id"], extensions=tag, kind=kind)
    assert f"grant usage on schema {schema}" in str(err.value) and "pgstream_writer" in str(err.value)
    assert 'subscription "tagged"' in str(err.value) and f"{kind}[1].expression" in str(err.value)
    run(db_url, f"grant usage on schema {schema} to {WRITER_ROLE}")
    subscribe(db_url, "tagged", "t", columns=["id"], extensions=tag, kind=kind)
    run(db_url, "insert into public.t (note) values ('x')", role=app)
    assert computed(db_url, kind)[-1]["tag"].startswith("id-")

    # the function's owner replaces its body
    run(db_url, f"create or replace function {schema}.tag(bigint) returns text language plpgsql as "
                f"$$ begin {ESCALATE.format(role=app)} return 'replaced'; end $$", role=app)
    with connect(db_url, app) as c:
        c.execute("insert into public.t (note) values ('y')")
    assert not is_super(db_url, app)
    tagged = [c for e, c in zip(events(db_url), computed(db_url, kind), strict=True) if e["tg_name"] == "tagged"]
    assert [c.get("tag") for c in tagged] == [tagged[0]["tag"], "replaced"]
    assert_insert_still_produces_its_event(db_url, roles)


def test_when_clause_with_a_function_only_the_writer_may_execute(db_url: str, roles: Callable[..., str]) -> None:
    """Validated for, and evaluated as, pgstream_writer: an application role needs no EXECUTE on it."""
    run(db_url, "create table public.t (id bigint generated always as identity primary key, note text)",
        "create schema ops",
        "create function ops.wanted(text) returns boolean language sql as $$ select $1 like 'keep%' $$",
        "revoke execute on function ops.wanted(text) from public")
    with pytest.raises(psycopg.errors.InvalidParameterValue,
                       match=r"when_clause: uses schema ops, which role pgstream_writer may not use: "
                             r"grant usage on schema ops to pgstream_writer"):
        subscribe(db_url, "t-insert", "t", columns=["id", "note"], when="ops.wanted(new.note)")
    run(db_url, f"grant usage on schema ops to {WRITER_ROLE}")
    with pytest.raises(psycopg.errors.InvalidParameterValue,
                       match=r"grant execute on function ops.wanted\(text\) to pgstream_writer"):
        subscribe(db_url, "t-insert", "t", columns=["id", "note"], when="ops.wanted(new.note)")
    run(db_url, f"grant execute on function ops.wanted(text) to {WRITER_ROLE}")
    subscribe(db_url, "t-insert", "t", columns=["id", "note"], when="ops.wanted(new.note)")
    with connect(db_url) as c:
        (definition,) = c.execute("select pg_get_triggerdef(oid) from pg_trigger "
                                  "where tgname = 'pgstream_insert'").fetchone()  # type: ignore[misc]
    assert " WHEN " not in definition  # evaluated inside the function, as pgstream_writer
    app = app_role(roles)
    run(db_url, "insert into public.t (note) values ('keep me'), ('drop me'), ('keep too')", role=app)
    assert [e["new"]["note"] for e in events(db_url)] == ["keep me", "keep too"]


def test_builtin_when_clause_stays_in_the_trigger_when(db_url: str, table: str) -> None:
    subscribe(db_url, "filtered", "t", op="UPDATE", columns=["id"], when="old.note is distinct from new.note")
    with connect(db_url) as c:
        (definition,) = c.execute("select pg_get_triggerdef(oid) from pg_trigger "
                                  "where tgname = 'pgstream_update'").fetchone()  # type: ignore[misc]
    assert "WHEN ((old.note IS DISTINCT FROM new.note))" in definition


def test_an_application_role_cannot_write_metadata_extensions(db_url: str, table: str,
                                                             roles: Callable[..., str]) -> None:
    """Subscriptions belong to the owner: neither the table nor set_subscriptions is open to others."""
    app = roles("grant insert on public.t to {role}", "grant usage on schema pgstream to {role}")
    ext = json.dumps([{"json_path": "x", "expression": "1"}])
    attempts = [
        f"update pgstream.subscriptions set metadata_extensions = '{ext}'",
        "insert into pgstream.subscriptions (key, stream_id, operation, table_name, metadata_extensions) "
        f"values ('mine', 1, 'INSERT', 't', '{ext}')",
        "select * from pgstream.set_subscriptions(1, array[jsonb_populate_record(null::pgstream.subscriptions, "
        f"""'{{"key": "mine", "operation": "INSERT", "table_name": "t", "metadata_extensions": {ext}}}')])""",
        "select pgstream.regenerate_trigger('public', 't', 'INSERT')",
    ]
    for attempt in attempts:
        with connect(db_url, app) as c, pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(attempt)
    with connect(db_url) as c:
        assert c.execute("select key, metadata_extensions from pgstream.subscriptions").fetchall() == [
            ("t-insert", [])]
    assert_insert_still_produces_its_event(db_url, roles)


def test_a_role_wrongly_granted_subscriptions_gains_nothing_through_metadata_extensions(
        db_url: str, table: str, roles: Callable[..., str]) -> None:
    """docs/security.md says not to grant writing pgstream.subscriptions to another role. One that has it
    anyway writes a metadata extension calling its own function that tries to escalate: validation
    only parses it (the function never runs as the owner), and the trigger runs it as
    pgstream_writer, so the role gains nothing."""
    app = roles("grant usage on schema pgstream to {role}",
                "grant select, insert, update, delete on pgstream.subscriptions to {role}",
                "grant insert on public.t to {role}")
    schema = f"fn_{app}"
    run(db_url, f"create schema {schema} authorization {app}", f"grant usage on schema {schema} to {WRITER_ROLE}")
    # counts runs as the owner: only the owner (a superuser) may advance this sequence
    run(db_url, "create sequence public.escalation_runs")
    with connect(db_url, app) as c:
        c.execute(f"create function {schema}.region(bigint) returns text language plpgsql as "
                  f"$$ begin {ESCALATE.format(role=app)} "
                  "begin perform nextval('public.escalation_runs'); exception when others then null; end; "
                  "return 'eu'; end $$")
    ext = json.dumps([{"json_path": "region", "expression": f"{schema}.region(new.id)"}])
    with connect(db_url, app) as c:  # a fresh session of the role, validated and generated as the owner
        c.execute(f"update pgstream.subscriptions set metadata_extensions = '{ext}' where key = 't-insert'")
    assert not is_super(db_url, app)
    with connect(db_url) as c:
        assert c.execute("select last_value, is_called from public.escalation_runs").fetchone() == (1, False)
        (owner,) = c.execute("select p.proowner::regrole::text from pg_trigger t join pg_proc p on p.oid = t.tgfoid "
                             "where t.tgrelid = 'public.t'::regclass").fetchone()  # type: ignore[misc]
    assert owner == WRITER_ROLE
    with connect(db_url, app) as c:
        c.execute("insert into public.t (note) values ('x')")
    assert not is_super(db_url, app) and not is_super(db_url, WRITER_ROLE)
    assert metadata(db_url)[-1] == {"region": "eu"}  # it ran, as pgstream_writer: the sequence stayed untouched
    with connect(db_url) as c:
        assert c.execute("select last_value, is_called from public.escalation_runs").fetchone() == (1, False)


# --------------------------------------------------------------------------------------------
# 4. validation executes nothing but the expression under test


@pytest.mark.parametrize("kind", EXTENSION_KINDS)
def test_lexer_cannot_be_fooled_into_running_a_second_statement(db_url: str, kind: str) -> None:
    # the server runs as another user: a place it could write to
    marker = Path(f"/tmp/pgstream-pwned-{uuid.uuid4().hex}")
    run(db_url, "create table public.t (id int primary key, note text)", 'create domain public."ée" as text')
    # Read as an escape string (old lexer: "é" is no identifier character), the text is two string
    # literals; Postgres reads a standard string '\' and then code: ") as v; copy ... to program ..."
    expression = f"public.ée'\\') as v; copy (select 1) to program 'touch {marker}'; select 1 --'"
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="ambiguous string literal") as err:
        subscribe(db_url, "smuggler", "t", extensions=[{"json_path": "x", "expression": expression}], kind=kind)
    assert f'pgstream: subscription "smuggler" (stream 1, INSERT on public.t): {kind}[1].expression:' \
        in str(err.value)
    assert not marker.exists()
    with connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.subscriptions").fetchone() == (0,)


@pytest.mark.parametrize(("text", "reason"), [
    ("ée'\\' = 'x'", "ambiguous string literal"),
    ("e'\\'' = ''", "ambiguous string literal"),
    ("x = 'a\\'", "ambiguous string literal"),
    ("1e'\\'' = 'x'", "ambiguous string literal"),
    ("a$b", '"$"'),
    ("'a'; select 1", "statement separator"),
    ("\"a;b\" = 1 and 1 = 1; select", "statement separator"),
    ("true --x", "comments"),
    ("true /* */", "comments"),
    ("(true", "unbalanced"),
    ("true)", "unbalanced"),
    ("'abc", "unterminated quoted string"),
    ("\"abc", "unterminated quoted identifier"),
    ("", "empty"),
])
def test_lexer_refuses(conn: psycopg.Connection[Any], text: str, reason: str) -> None:
    (got,) = conn.execute("select pgstream._expression_lexical_error(%s)", [text]).fetchone()  # type: ignore[misc]
    assert got is not None and reason in got


@pytest.mark.parametrize("text", [
    "new.note ~ '\\d+'",                 # a backslash that is not before a quote: same in both readings
    "new.note = 'it''s'",
    "new.note = E'tab\\there'",
    "new.note = U&'d\\0061t\\+000061'",
    "\"weird;name\" is null",
    "new.note = 'a;b--c/*d$e'",
    "ée = 1",
])
def test_lexer_accepts(conn: psycopg.Connection[Any], text: str) -> None:
    assert conn.execute("select pgstream._expression_lexical_error(%s)", [text]).fetchone() == (None,)


BAD_EXPRESSIONS = [
    ("when", "count(*) > 0", "aggregate functions are not allowed"),
    ("when", "sum(new.id) over () > 0", "window functions are not allowed"),
    ("when", "generate_series(1, new.id) > 0", "set-returning functions are not allowed"),
    ("when", "exists (select 1)", "subqueries are not allowed"),
    ("when", "new.id in (select 1)", "subqueries are not allowed"),
    ("extension", "array_agg(new.id)", "aggregate functions are not allowed"),
    ("extension", "row_number() over ()", "window functions are not allowed"),
    ("extension", "jsonb_array_elements('[1, 2]')", "set-returning functions are not allowed"),
    ("extension", "(select 1)", "subqueries are not allowed"),
    ("extension", "array(select 1)", "subqueries are not allowed"),
    ("metadata", "array_agg(new.id)", "aggregate functions are not allowed"),
    ("metadata", "row_number() over ()", "window functions are not allowed"),
    ("metadata", "jsonb_array_elements('[1, 2]')", "set-returning functions are not allowed"),
    ("metadata", "(select 1)", "subqueries are not allowed"),
    ("metadata", "exists (select 1)", "subqueries are not allowed"),
]


@pytest.mark.parametrize("mode", ["row", "statement"])
@pytest.mark.parametrize(("where", "expression", "reason"), BAD_EXPRESSIONS)
def test_aggregates_windows_srfs_and_subqueries_are_refused(db_url: str, mode: str, where: str, expression: str,
                                                            reason: str) -> None:
    run(db_url, "create table public.t (id int primary key, note text)")
    subscribe(db_url, "good", "t", columns=["id"], mode=mode)
    with connect(db_url) as c:
        before = c.execute("select t.oid, p.prosrc from pg_trigger t join pg_proc p on p.oid = t.tgfoid "
                           "where t.tgrelid = 'public.t'::regclass").fetchall()
    kind = "metadata_extensions" if where == "metadata" else "payload_extensions"
    kwargs: dict[str, Any] = ({"when": expression} if where == "when"
                              else {"extensions": [{"json_path": "x", "expression": expression}], "kind": kind})
    part = "when_clause" if where == "when" else f"{kind}[1].expression"
    with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
        subscribe(db_url, "bad", "t", columns=["id"], mode=mode, **kwargs)
    assert f'pgstream: subscription "bad" (stream 1, INSERT on public.t): {part}: {reason}' in str(err.value)
    with connect(db_url) as c:
        assert c.execute("select t.oid, p.prosrc from pg_trigger t join pg_proc p on p.oid = t.tgfoid "
                         "where t.tgrelid = 'public.t'::regclass").fetchall() == before
        assert c.execute("select key from pgstream.subscriptions").fetchall() == [("good",)]
        c.execute("insert into public.t values (1, 'a'), (2, 'b')")
    assert len(events(db_url)) == 2


# --------------------------------------------------------------------------------------------
# 5. the drift guard cannot be switched off or walked around


def test_drift_guard_has_no_session_bypass_and_protects_the_triggers(db_url: str, roles: Callable[..., str]) -> None:
    app = roles()
    schema = f"own_{app}"
    run(db_url, f"create schema {schema} authorization {app}",
        f"create table {schema}.t (id int primary key, note text)", f"alter table {schema}.t owner to {app}")
    subscribe(db_url, "mine", "t", schema=schema, columns=["id", "note"])
    subscribe(db_url, "mine-bulk", "t", schema=schema, op="DELETE", columns=["id"], mode="statement")
    attempts = [
        f"drop table {schema}.t",
        f"drop schema {schema} cascade",
        f"alter table {schema}.t disable trigger pgstream_insert",
        f"alter table {schema}.t disable trigger all",
        f"alter table {schema}.t disable trigger user",
        f"alter table {schema}.t enable replica trigger pgstream_insert",
        f"alter table {schema}.t disable trigger pgstream_delete_stmt",
        f"alter trigger pgstream_insert on {schema}.t rename to renamed",
        f"drop trigger pgstream_insert on {schema}.t",
        f"drop trigger pgstream_delete_stmt on {schema}.t",
        f"alter table {schema}.t rename to t2",
        f"alter table {schema}.t alter column note type varchar(5)",
        f"alter table {schema}.t drop column note",
        f"alter table {schema}.t rename column note to note2",
    ]
    for attempt in attempts:
        with connect(db_url, app) as c:
            c.execute("set pgstream.internal_ddl = on")
            c.execute("select set_config('pgstream.internal_ddl', 'on', false)")
            with pytest.raises(psycopg.errors.DependentObjectsStillExist, match="pgstream: refusing") as err:
                c.execute(attempt)
            message = str(err.value)
            assert '"mine"' in message or '"mine-bulk"' in message or "generated trigger" in message
    # renaming the schema needs CREATE on the database: the database owner tries
    with pytest.raises(psycopg.errors.DependentObjectsStillExist, match=f"refusing ALTER SCHEMA .*{schema}.t"):
        run(db_url, f"alter schema {schema} rename to elsewhere_{app}")
    with connect(db_url) as c:
        rows = c.execute("select tgname, tgenabled from pg_trigger where tgrelid = %s::regclass order by 1",
                         [f"{schema}.t"]).fetchall()
    assert rows == [("pgstream_delete_stmt", "O"), ("pgstream_insert", "O"), ("pgstream_truncate", "O")]
    run(db_url, f"insert into {schema}.t values (1, 'a')", f"delete from {schema}.t", role=app)
    assert [e["tg_op"] for e in events(db_url)] == ["INSERT", "DELETE"]
    # harmless DDL still passes
    run(db_url, f"alter table {schema}.t add column extra int", f"alter table {schema}.t drop column extra",
        role=app)


def test_code_running_as_the_writer_cannot_break_the_triggers(db_url: str, roles: Callable[..., str]) -> None:
    """A cast function (run by pgstream_writer inside the trigger) tries to drop or alter what it owns."""
    app = roles()
    schema = f"own_{app}"
    run(db_url, f"create schema {schema} authorization {app}")
    run(db_url, f"create type {schema}.st as enum ('a')", f"alter type {schema}.st owner to {app}",
        f"create table {schema}.t (id int primary key, status {schema}.st)", f"alter table {schema}.t owner to {app}")
    subscribe(db_url, "mine", "t", schema=schema, columns=["id", "status"])
    with connect(db_url) as c:
        (fn,) = c.execute(f"select tgfoid::regprocedure::text from pg_trigger where tgrelid = '{schema}.t'::regclass"
                          ).fetchone()  # type: ignore[misc]
    sabotage = [f"drop function {fn} cascade", f"alter function {fn} security invoker",
                f"alter function {fn} set search_path = {schema}", f"alter function {fn} rename to gone",
                f"drop owned by {WRITER_ROLE} cascade",
                "alter role pgstream_writer superuser", f"grant {WRITER_ROLE} to {app}",
                "delete from pgstream.events", "update pgstream.streams set paused = true"]
    attempts = " ".join(f"begin execute {sql.quote(s)}; raise notice 'sabotage ran: %', {sql.quote(s)}; "
                        "exception when others then null; end;" for s in sabotage)
    run(db_url, f"create function {schema}.st_json({schema}.st) returns json language plpgsql as "
                f"$$ begin {attempts} return '\"a\"'::json; end $$",
        f"create cast ({schema}.st as json) with function {schema}.st_json({schema}.st)", role=app)
    notices: list[str] = []
    with connect(db_url, app) as c:
        c.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        c.execute(f"insert into {schema}.t values (1, 'a')")
        c.execute(f"insert into {schema}.t values (2, 'a')")
    assert [n for n in notices if n.startswith("sabotage ran")] == []
    assert not is_super(db_url, app) and not is_super(db_url, WRITER_ROLE)
    with connect(db_url) as c:
        assert c.execute("select tgfoid::regprocedure::text, tgenabled from pg_trigger "
                         f"where tgrelid = '{schema}.t'::regclass").fetchall() == [(fn, "O")]
        assert c.execute("select prosecdef, proconfig from pg_proc where oid = %s::regprocedure",
                         [fn]).fetchone() == (True, ["search_path=pg_catalog, pg_temp"])
        assert c.execute("select pg_has_role(%s, %s, 'member')", [app, WRITER_ROLE]).fetchone() == (False,)
    assert [e["new"]["id"] for e in events(db_url)] == [1, 2]


def test_a_stale_subscription_does_not_block_ddl_on_other_tables(db_url: str, table: str,
                                                                 roles: Callable[..., str]) -> None:
    app = roles()
    run(db_url, f"create schema own_{app} authorization {app}")
    run(db_url, "alter event trigger pgstream_drift_guard_drop disable",
        "drop table public.t",  # the guard was off: the subscription is stale now
        "alter event trigger pgstream_drift_guard_drop enable")
    run(db_url, f"create table own_{app}.x (id int)", f"alter table own_{app}.x add column y int",
        f"alter table own_{app}.x rename to z", role=app)
    run(db_url, "create table public.unrelated (id int)", "alter table public.unrelated add column y int")


# --------------------------------------------------------------------------------------------
# 6. the privilege model as installed


def test_writer_role_and_function_settings(db_url: str, table: str) -> None:
    with connect(db_url) as c:
        assert c.execute(
            "select rolsuper, rolcanlogin, rolinherit, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls "
            "from pg_roles where rolname = %s", [WRITER_ROLE]).fetchone() == (False,) * 7
        assert c.execute("select count(*) from pg_auth_members where member = %s::regrole",
                         [WRITER_ROLE]).fetchone() == (0,)
        privileges = {
            (rel, priv): c.execute("select has_table_privilege(%s, %s, %s)", [WRITER_ROLE, rel, priv]).fetchall()[0][0]
            for rel in ("pgstream.events", "pgstream.subscriptions", "pgstream.streams", "pgstream.batches",
                        "pgstream.internal_ddl", "public.t")
            for priv in ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE")}
        assert {k for k, v in privileges.items() if v} == set()  # INSERT on events is per column
        columns = {col: c.execute("select has_column_privilege(%s, 'pgstream.events', %s, 'INSERT')",
                                  [WRITER_ROLE, col]).fetchall()[0][0]
                   for col in ("id", "payload", "metadata", "stream_id", "created_at", "lsn")}
        assert {col for col, ok in columns.items() if ok} == {"payload", "metadata", "stream_id"}
        assert c.execute("select has_schema_privilege(%s, 'pgstream', 'CREATE')", [WRITER_ROLE]).fetchone() == (False,)
        # every function of the schema: temporary schema last. The one function with a SQL-standard
        # body, pgstream.batch_is_open, had its names bound when it was created: it needs no
        # search_path (and a SET would keep Postgres from inlining it)
        bad = c.execute(
            "select p.oid::regprocedure::text, p.proconfig from pg_proc p "
            "where p.pronamespace = 'pgstream'::regnamespace "
            "and p.prosqlbody is null and (p.proconfig is null "
            "                              or not 'search_path=pg_catalog, pg_temp' = any (p.proconfig))").fetchall()
        assert bad == []
        # executable by PUBLIC: only the pure functions pgstream's views call (so that a monitoring role
        # granted a view can read it: stream_status, orphaned_slots), neither SECURITY DEFINER nor volatile
        public = c.execute(
            "select p.oid::regprocedure::text, p.prosecdef, p.provolatile from pg_proc p "
            "where p.pronamespace = 'pgstream'::regnamespace and has_function_privilege('public', p.oid, 'EXECUTE') "
            "order by 1").fetchall()
        assert public == [("pgstream.batch_is_open(text)", False, "i"), ("pgstream.default_slot_pattern()", False, "i"),
                          ("pgstream.utc_today()", False, "s")]
        assert c.execute("select array_agg(p.oid::regprocedure::text) from pg_proc p "
                         "where p.pronamespace = 'pgstream'::regnamespace and p.prosqlbody is not null"
                         ).fetchone() == (["pgstream.batch_is_open(text)"],)
        owners = c.execute("select p.proname, p.proowner::regrole::text from pg_proc p "
                           "where p.pronamespace = 'pgstream'::regnamespace and p.proname like '\\_publish\\_%'"
                           ).fetchall()
        assert owners and {o for _, o in owners} == {WRITER_ROLE}
        # generated code qualifies every function and type it names
        (src,) = c.execute("select prosrc from pg_proc where proname = %s", [owners[0][0]]).fetchone()  # type: ignore[misc]
        assert "pg_catalog.jsonb_build_object(" in src and "::pg_catalog.jsonb" in src
        assert " jsonb_build_object(" not in src and "::jsonb" not in src and "bigint" not in src


def test_upgrade_from_the_last_released_schema_regenerates_triggers(empty_db_url: str, tmp_path: Path) -> None:
    migrate(empty_db_url, directory=released_sql(tmp_path / "sql", upto=11))
    run(empty_db_url, "create table public.t (id int primary key, note text)")
    subscribe(empty_db_url, "t-insert", "t", columns=["id", "note"], when="new.note <> 'skip'",
              extensions=[{"json_path": "a.b", "expression": "upper(new.note)"}], metadata={"team": "x"})
    run(empty_db_url, "insert into public.t values (1, 'old')")
    with connect(empty_db_url) as c:
        (old_owner,) = c.execute("select p.proowner::regrole::text from pg_trigger t join pg_proc p "
                                 "on p.oid = t.tgfoid where t.tgname = 'pgstream_insert'").fetchone()  # type: ignore[misc]
    assert old_owner != WRITER_ROLE

    assert "012_least_privilege.sql" in migrate(empty_db_url)  # and what came after it
    with connect(empty_db_url) as c:
        row = c.execute("select p.proowner::regrole::text, p.proconfig, obj_description(t.oid, 'pg_trigger'), "
                        "pg_get_triggerdef(t.oid) from pg_trigger t join pg_proc p on p.oid = t.tgfoid "
                        "where t.tgname = 'pgstream_insert'").fetchone()
        assert row is not None
        assert row[0] == WRITER_ROLE and row[1] == ["search_path=pg_catalog, pg_temp"]
        expected = c.execute("select pgstream.generated_trigger_hash(g.function_body, g.when_clause) "
                             "from pgstream.generated_trigger('public', 't', 'INSERT', 'row') g").fetchone()
        assert expected == (row[2],)
        assert "WHEN ((new.note <> 'skip'::text))" in row[3]
    run(empty_db_url, "insert into public.t values (2, 'new'), (3, 'skip')")
    got = events(empty_db_url)
    assert [(e["new"]["id"], e["a"]["b"]) for e in got] == [(1, "OLD"), (2, "NEW")]
    strip = {"timestamp"}
    assert ({k for k in got[0] if k not in strip} == {k for k in got[1] if k not in strip})


def test_a_non_superuser_owner_installs_the_same_model(pg: Any, roles: Callable[..., str]) -> None:
    """Without superuser there is no drift guard (event triggers), but the execution model is the same:
    generated functions belong to pgstream_writer, which never keeps CREATE on the schema."""
    owner = roles("alter role {role} createrole replication")
    name = f"nosuper_{owner}"
    run(pg.url, f"create database {name} owner {owner}")
    owner_url = pg.url_for(name).replace("postgres@", f"{owner}@", 1)
    try:
        with pytest.raises(Exception, match=f"As a superuser: grant pgstream_writer to {owner}"):
            migrate(owner_url)
        run(pg.url, f"grant {WRITER_ROLE} to {owner}")
        assert migrate(owner_url)[0] == "012_least_privilege.sql"  # then the later ones
        run(owner_url, "create table public.t (id int primary key, note text)")
        subscribe(owner_url, "t-insert", "t", columns=["id", "note"], when="new.note <> 'skip'")
        with connect(owner_url) as c:
            assert c.execute("select p.proowner::regrole::text from pg_trigger t join pg_proc p on p.oid = t.tgfoid "
                             "where t.tgname = 'pgstream_insert'").fetchone() == (WRITER_ROLE,)
            assert c.execute("select has_schema_privilege(%s, 'pgstream', 'CREATE')",
                             [WRITER_ROLE]).fetchone() == (False,)
            c.execute("insert into public.t values (1, 'a'), (2, 'skip')")
        assert [e["new"]["id"] for e in events(owner_url)] == [1]
        assert not is_super(owner_url, owner)
    finally:
        run(pg.url, f"drop database if exists {name} with (force)", f"revoke {WRITER_ROLE} from {owner}")


def test_a_monitoring_role_granted_the_status_view_reads_it_and_nothing_else(db_url: str, table: str,
                                                                               roles: Callable[..., str]) -> None:
    """stream_status calls pgstream.batch_is_open as the reading role: a role granted only the view
    (and the schema) reads it; the batches behind it stay closed to that role."""
    run(db_url, f"insert into {table} (note) values ('a'), ('b')")
    monitor = roles("grant usage on schema pgstream to {role}", "grant select on pgstream.stream_status to {role}")
    with connect(db_url, monitor) as c:
        (row,) = c.execute("select * from pgstream.stream_status").fetchall()
        assert row[0] == 1, row
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("select * from pgstream.batches")


def test_an_application_role_cannot_touch_the_streams_publications_or_their_recording(
        db_url: str, table: str, roles: Callable[..., str]) -> None:
    """What the slot reader's work installed (the whole-event publication, ensure_publications, the
    stream row lock that serialises recording) gives an application role nothing, from a fresh
    connection: it cannot create, alter or drop the publications, call their functions, lock the
    stream row, nor publish the events table itself; and its own pg_temp objects change nothing for
    the owner, whose next tick still finds both publications."""
    app = app_role(roles)
    schema_user = roles("grant usage on schema pgstream to {role}")  # then the functions' own grants decide
    with connect(db_url) as c:
        assert {r[0] for r in c.execute("select pubname from pg_publication")} == {
            "pgstream_stream_1", "pgstream_stream_1_rows"}
    attempts = [
        "select pgstream.ensure_publications(1)",
        "select pgstream.rows_publication_name(1)",
        "select 1 from pgstream.streams where id = 1 for no key update",
        "drop publication pgstream_stream_1_rows",
        "alter publication pgstream_stream_1_rows set table pgstream.events where (stream_id = 2)",
        "create publication mine for table pgstream.events",
    ]
    for role, statement in itertools.product((app, schema_user), attempts):
        with connect(db_url, role) as c:  # a fresh connection each time
            c.execute("create function pg_temp.format(text, variadic text[]) returns text language sql "
                      "as $$ select 'drop publication pgstream_stream_1' $$")
            with pytest.raises((psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedObject)):
                c.execute(statement)
    with connect(db_url) as c:
        assert {r[0] for r in c.execute("select pubname from pg_publication")} == {
            "pgstream_stream_1", "pgstream_stream_1_rows"}
        assert c.execute("select count(*) from pgstream.ensure_publications(1)").fetchone() == (0,)
        row = c.execute("select attnames from pg_publication_tables "
                        "where pubname = 'pgstream_stream_1_rows'").fetchone()
        assert row is not None and sorted(row[0]) == ["created_at", "id", "metadata", "payload", "stream_id"]
    assert_insert_still_produces_its_event(db_url, roles)


#: the advisory locks pgstream took before its own locks (sql/020_locks.sql), as (class, key) pairs and
#: single keys: a hostile role holds them all in the test below, and nothing of pgstream waits for it
OLD_ADVISORY_PAIRS = [(0x70677364, 1), (0x70677372, 1), (0x7067646C, 1)]  # delivery lease, slot reader, redelivery
OLD_ADVISORY_KEYS = [0x70677374, 0x70677370]  # migrations, partitions


def test_an_application_role_can_neither_take_nor_hold_pgstreams_locks(
        db_url: str, table: str, roles: Callable[..., str]) -> None:
    """Every lock pgstream takes (the delivery lease, the slot reader's claim, redelivery, backfills,
    partition maintenance, trigger regeneration, migrations) is one no other role can take or hold.
    A role with USAGE on the schema holds every advisory key pgstream used before, names its session
    like a run's lease, and tries pgstream's lock table and functions from fresh connections that
    shadow ``text`` and ``pg_backend_pid`` in pg_temp (with an escalating implicit cast): all refused,
    and it gains nothing. Meanwhile the owner takes each lock at once, migrate and partition maintenance finish,
    and the spoofed session passes for no run."""
    app = app_role(roles)
    schema_user = roles("grant usage on schema pgstream to {role}")
    attempts = [
        "select pgstream.try_lock('reader', 1)",
        "select pgstream.unlock('delivery', 1)",
        "select pgstream.lock_holder('delivery', 1)",
        "select pgstream.lock_for_transaction('partitions')",
        "select pgstream.backend_alive(pg_backend_pid(), now(), 10)",
        "select pgstream.backfill_try_lock(1)",
        "insert into pgstream.locks values ('delivery', 1, pg_backend_pid(), now(), 10, 'r1', now())",
        "update pgstream.locks set holder = 'x'",
        "select 1 from pgstream.locks for update",
        "lock table pgstream.locks in access share mode",
        "lock table pgstream.schema_migrations in access share mode",
        "select 1 from pgstream.schema_migrations for update",
    ]
    for role, statement in itertools.product((app, schema_user), attempts):
        with connect(db_url, role) as c:  # a fresh connection, with its own pg_temp shadows first
            c.execute("create type pg_temp.text as enum ('x')")
            c.execute("create function pg_temp.esc(pg_catalog.text) returns pg_temp.text language plpgsql as "
                      f"$$ begin {ESCALATE.format(role=role)} return 'x'; end $$")
            c.execute("create cast (pg_catalog.text as pg_temp.text) with function pg_temp.esc(pg_catalog.text) "
                      "as implicit")
            c.execute("create function pg_temp.pg_backend_pid() returns integer language sql as 'select 1'")
            with pytest.raises((psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedTable,
                                psycopg.errors.UndefinedFunction)), c.transaction():
                c.execute(statement)
    assert not is_super(db_url, app) and not is_super(db_url, schema_user)
    hostile = psycopg.connect(db_url, user=schema_user, autocommit=True, application_name="pgstream run r1")
    try:
        for cls, key in OLD_ADVISORY_PAIRS:
            hostile.execute("select pg_advisory_lock(%s, %s)", [cls, key])
        for key in OLD_ADVISORY_KEYS:
            hostile.execute("select pg_advisory_lock(%s)", [key])
        hostile.execute("select pg_advisory_lock(hashtext('pgstream.regenerate'))")
        hostile.execute("select pg_advisory_lock(hashtext('pgstream.backfill'), 1)")
        with psycopg.connect(db_url, autocommit=True, options="-c statement_timeout=20000") as owner:
            lease = locks.acquire_lease(db_url, 1, "r2")
            try:
                assert locks.lock_holder(owner, locks.DELIVERY_LOCK, 1) == "r2"
                held = locks.LeaseState.HELD
                assert locks.lease_state(owner, "r1") is not held and locks.lease_state(owner, "r2") is held
            finally:
                lease.close()
            assert locks.try_lock(owner, locks.REDELIVERY_LOCK, 1)
            locks.unlock(owner, locks.REDELIVERY_LOCK, 1)
            assert owner.execute("select pgstream.backfill_try_lock(1), pgstream.backfill_unlock(1)").fetchone() == (
                True, True)
            owner.execute("select pgstream.regenerate_trigger('public', 't', 'INSERT')")
            owner.execute("select * from pgstream.create_partitions(2)")
            owner.execute("select * from pgstream.drop_partitions(30)")
        migrate(db_url + ("&" if "?" in db_url else "?") + "options=-c%20statement_timeout%3D20000")
        assert hostile.execute("select count(*) from pg_locks where pid = pg_backend_pid() "
                               "and locktype = 'advisory'").fetchone() == (7,)  # still held all along
    finally:
        hostile.close()
    assert_insert_still_produces_its_event(db_url, roles)


def _waiting_for_a_lock(url: str) -> list[tuple[int, str]]:
    """The backends of this database that wait for a lock, with what they run."""
    with connect(url) as c:
        return [(r[0], r[1]) for r in c.execute(
            "select a.pid, a.query from pg_stat_activity a where a.datname = current_database() "
            "and a.wait_event_type = 'Lock'").fetchall()]


@pytest.mark.parametrize("where", ["partition", "default"])
def test_an_idle_application_transaction_never_makes_housekeeping_stop_writes(
        db_url: str, table: str, roles: Callable[..., str], where: str) -> None:
    """An application role writes a subscribed table with its constraints IMMEDIATE (the trigger
    writes the event at once: ROW EXCLUSIVE on pgstream.events and the partition the event went to,
    today's or ``events_default``, as a statement-mode trigger always does) and leaves its
    transaction idle. Housekeeping runs: its DETACH (ACCESS EXCLUSIVE on pgstream.events) and,
    with the event in ``events_default``, its ATTACH (ACCESS EXCLUSIVE on the default partition) wait
    at most their lock timeout, a few times, and give up: the pass returns, reporting the partitions
    it left for the next pass, and another session of the application role, which wrote while
    housekeeping was queued, has committed, with nothing left waiting for a lock. Once the idle
    transaction ends, the next pass drops (and creates) what it left."""
    app = app_role(roles)
    cfg = HousekeepingConfig(days_ahead=2, retention_days=3, lock_timeout_ms=200, lock_attempts=3)
    with connect(db_url) as owner:
        (d0,) = owner.execute("select pgstream.utc_today()").fetchone()  # type: ignore[misc]
        if where == "default":  # today has no partition: the application's events land in events_default
            owner.execute(sql.SQL("alter table pgstream.events detach partition {0}; drop table {0}").format(
                sql.Identifier("pgstream", f"events_{d0:%Y%m%d}")))
        later = d0 + dt.timedelta(days=10)  # a simulated calendar: days d0 .. d0 + 6 are past retention
        owner.execute("update pgstream.streams set consumed_through = %s",
                      [dt.datetime.combine(later, dt.time(), dt.UTC)])
        expired = [r[0] for r in owner.execute(
            "select c.relname::text from pg_inherits i join pg_class c on c.oid = i.inhrelid "
            "where i.inhparent = 'pgstream.events'::regclass and c.relname ~ '^events_[0-9]{8}$' "
            "and c.relname < %s order by 1", [f"events_{later - dt.timedelta(days=3):%Y%m%d}"]).fetchall()]
    assert expired
    idle = psycopg.connect(db_url, user=app)  # not autocommit: the insert's transaction stays open
    housekeeper = psycopg.connect(db_url, autocommit=True)
    writer = connect(db_url, app)
    hk_pid, writer_pid = housekeeper.info.backend_pid, writer.info.backend_pid
    reports: list[HousekeepingReport] = []
    wrote: list[bool] = []
    housekeeping = threading.Thread(target=lambda: reports.append(run_housekeeping(housekeeper, cfg, later)),
                                    daemon=True)
    writing = threading.Thread(target=lambda: wrote.append(
        writer.execute("insert into public.t (note) values ('while housekeeping waits')").rowcount == 1),
                               daemon=True)
    try:
        # the row trigger is deferred to commit: IMMEDIATE (any role may ask) writes the event now
        idle.execute("set constraints all immediate")
        idle.execute("insert into public.t (note) values ('idle')")
        housekeeping.start()
        # the application writes while housekeeping's lock request is queued (if it is seen queued)
        while housekeeping.is_alive() and hk_pid not in dict(_waiting_for_a_lock(db_url)):
            time.sleep(0.005)
        writing.start()
        housekeeping.join(60)  # a liveness bound: without lock timeouts both wait for ever
        writing.join(60)
        assert not housekeeping.is_alive(), f"housekeeping waits for a lock: {_waiting_for_a_lock(db_url)}"
        assert not writing.is_alive(), f"the application's insert waits: {_waiting_for_a_lock(db_url)}"
        assert wrote == [True]
        assert _waiting_for_a_lock(db_url) == []
        (report,) = reports
        assert report.dropped == [] and report.busy == expired and report.rows_dropped == 0
        assert any(f"partition {expired[0]} not dropped this pass" in w for w in report.warnings), report.warnings
        if where == "default":  # ATTACH needs the default partition, which the idle transaction wrote
            assert report.created == []
            assert any(f"partition events_{later:%Y%m%d} not created this pass" in w for w in report.warnings)
        else:
            assert report.created == [f"events_{later + dt.timedelta(days=i):%Y%m%d}" for i in range(3)]
        with connect(db_url) as owner:
            assert owner.execute("select partitions_busy, partitions_dropped from pgstream.housekeeping_runs "
                                 "order by id desc limit 1").fetchone() == (len(expired), 0)
            assert owner.execute("select count(*) from pgstream.events where payload->'new'->>'note' = "
                                 "'while housekeeping waits'").fetchone() == (1,)
    finally:
        idle.rollback()
        for pid in (hk_pid, writer_pid):  # only if a thread is still stuck (the failing case)
            with connect(db_url) as owner:
                owner.execute("select pg_terminate_backend(%s) where %s", [pid, housekeeping.is_alive()
                                                                          or writing.is_alive()])
        for c in (idle, housekeeper, writer):
            c.close()
    # the idle transaction has ended: the next pass drops (and creates) what this one left
    with connect(db_url) as c:
        again = run_housekeeping(c, cfg, later)
    assert again.busy == [] and again.dropped == expired
    assert again.created == ([f"events_{later + dt.timedelta(days=i):%Y%m%d}" for i in range(3)]
                             if where == "default" else [])
    assert not is_super(db_url, app)
    assert_insert_still_produces_its_event(db_url, roles)


def test_the_views_migrate_creates_bind_nothing_from_the_migrators_search_path(empty_db_url: str) -> None:
    """A view binds the operators it names when it is created. In a database whose public schema every
    role may write (the default before Postgres 15), a role's ``||(text, bigint)`` in public would win
    over the built-in one in a view created with the migrator's search_path (``"$user", public``), and
    run, with the reader's rights, whenever the owner reads the stream status. migrate runs every file
    with ``search_path = pg_catalog, pg_temp``: the views bind the built-ins, and reading them escalates
    nothing."""
    mallory = f"mallory_{next(_ids)}_{empty_db_url.rsplit('/', 1)[1]}"
    run(empty_db_url, "grant create, usage on schema public to public", f"create role {mallory} login")
    try:
        run(empty_db_url,
            "create function public.cat(text, bigint) returns text language plpgsql as "
            f"$$ begin {ESCALATE.format(role=mallory)} return 'pwned'; end $$",
            "create operator public.|| (leftarg = text, rightarg = bigint, function = public.cat)", role=mallory)
        migrate(empty_db_url)  # as the owner, with the connection's default search_path
        with connect(empty_db_url) as c:
            foreign = c.execute(
                """select distinct r.ev_class::regclass::text, d.refobjid::regoperator::text
                   from pg_depend d join pg_rewrite r on r.oid = d.objid
                   join pg_operator o on o.oid = d.refobjid and d.refclassid = 'pg_operator'::regclass
                   where r.ev_class::regclass::text like 'pgstream.%'
                     and o.oprnamespace not in ('pg_catalog'::regnamespace, 'pgstream'::regnamespace)""").fetchall()
            assert foreign == []
            c.execute("select pgstream.ensure_stream(1), pgstream.ensure_stream(2)")
            c.execute("select pg_create_logical_replication_slot('pgstream_stream_9', 'pgoutput')")
            try:
                statuses = c.execute("select slot_name from pgstream.stream_status order by id").fetchall()
                assert statuses == [(streams.stream_slot(c, 1),), (streams.stream_slot(c, 2),)]
                assert c.execute("select slot_name from pgstream.orphaned_slots").fetchall() == [("pgstream_stream_9",)]
                c.execute("select * from pgstream.metrics").fetchall()
            finally:
                c.execute("select pg_drop_replication_slot('pgstream_stream_9')")
        with connect(empty_db_url, mallory) as c:  # a fresh connection: what the role can do afterwards
            assert c.execute("select rolsuper from pg_roles where rolname = current_user").fetchone() == (False,)
        assert not is_super(empty_db_url, mallory)
    finally:
        with connect(empty_db_url) as c:
            c.execute(sql.SQL("alter role {} nosuperuser").format(sql.Identifier(mallory)))
            c.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(mallory)))
            c.execute(sql.SQL("drop role {}").format(sql.Identifier(mallory)))


def test_the_installers_run_no_operator_of_a_role_on_the_owners_search_path(empty_db_url: str,
                                                                           tmp_path: Path) -> None:
    """``init``, ``migrate`` and ``tear-down`` run as the owner or a superuser. A role that may create in a
    schema on their search path (``public``: the default before Postgres 15, and a database's owner's on
    any version) defines ``~~(name, name)``, which an unqualified ``trigger name like 'pgstream\\_%'`` would
    pick over the built-in ``~~(name, text)``: their connections pin ``search_path = pg_catalog, pg_temp``,
    so it never runs; the role is no superuser afterwards, from a fresh connection."""
    from pgstream_dagster.engine.bootstrap import init
    from pgstream_dagster.engine.migrations import tear_down

    from .support.harness import write_config

    mallory = f"mallory_{next(_ids)}_{empty_db_url.rsplit('/', 1)[1]}"
    run(empty_db_url, "grant create, usage on schema public to public", f"create role {mallory} login",
        "create table public.t (id int primary key)")
    try:
        run(empty_db_url,
            "create table public.ran (who text)", "grant insert on public.ran to public",
            "create function public.spy(name, name) returns boolean language plpgsql as "
            f"$$ begin insert into public.ran values (current_user); {ESCALATE.format(role=mallory)} "
            "return $1::text operator(pg_catalog.~~) $2::text; end $$",
            "create operator public.~~ (leftarg = name, rightarg = name, function = public.spy)", role=mallory)
        config = write_config(tmp_path / "pgstream.yaml", empty_db_url, [{"id": 1, "sink": {"type": "memory"}}],
                              subscriptions=[{"key": "t-insert", "schema_name": "public", "table_name": "t",
                                              "stream_id": 1, "operation": "INSERT"}])
        init(config)  # migrate, housekeeping, the streams, the subscription's trigger on public.t
        run(empty_db_url, "insert into public.t values (1)")
        tear_down(empty_db_url)  # lists every trigger of the database by name
        with connect(empty_db_url) as c:
            assert c.execute("select count(*) from public.ran").fetchone() == (0,)
            assert c.execute("select count(*) from pg_namespace where nspname = 'pgstream'").fetchone() == (0,)
        with connect(empty_db_url, mallory) as c:  # a fresh connection: what the role can do afterwards
            assert c.execute("select rolsuper from pg_roles where rolname = current_user").fetchone() == (False,)
        assert not is_super(empty_db_url, mallory)
    finally:
        with connect(empty_db_url) as c:
            c.execute(sql.SQL("alter role {} nosuperuser").format(sql.Identifier(mallory)))
            c.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(mallory)))
            c.execute(sql.SQL("drop role {}").format(sql.Identifier(mallory)))


def test_the_event_check_ignores_a_manual_roles_temporary_objects(db_url: str, manual_role: str) -> None:
    """pgstream._check_event runs as the owner: a role allowed to insert events shadows the tables and
    types it names in pg_temp, from a fresh connection, and gains nothing (the manual-event grant: conftest's
    ``manual_role``)."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
    with connect(db_url, manual_role) as app:
        app.execute("create temporary table streams (id bigint)")
        app.execute("insert into pg_temp.streams values (99)")  # a stream only the shadow knows
        app.execute("create domain pg_temp.timestamptz as pg_catalog.timestamptz check (value is null)")
        app.execute("create domain pg_temp.interval as pg_catalog.interval check (value is null)")
        app.execute("create domain pg_temp.regclass as pg_catalog.regclass check (value is null)")
        with pytest.raises(psycopg.errors.ForeignKeyViolation, match="stream 99 does not exist"):
            app.execute("insert into pgstream.events (payload, stream_id) values ('{}', 99)")
        app.execute("insert into pgstream.events (payload, stream_id) values ('{\"shadowed\": true}', 1)")
        assert app.execute("select rolsuper from pg_roles where rolname = current_user").fetchone() == (False,)
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.events where stream_id = 99").fetchone() == (0,)
        assert c.execute("select count(*) from pgstream.events where stream_id = 1 and payload ? 'shadowed' "
                         "and created_at <= now()").fetchone() == (1,)
