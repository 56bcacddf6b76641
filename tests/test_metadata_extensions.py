"""metadata_extensions: metadata computed per event by the generated triggers (row and statement
mode), merged over the subscription's static metadata; validated like payload extensions; kept by
set_subscriptions, the drift guard and upgrades (a subscription without them generates the code it
generated before they existed)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgstream_dagster.engine.migrations import migrate

from .support.releases import released_sql
from .support.schema import events, set_subscriptions, subscribe, trigger_state

#: static metadata, and computed keys merged over it: a new top key, a leaf inside a static object
#: (its sibling "kind" stays), a static key replaced, a nested object built from nothing
STATIC = {"team": "growth", "route": {"kind": "user", "region": "default"}, "tier": "free"}


def computed(var: str) -> list[dict[str, str]]:
    return [
        {"json_path": "region", "expression": f"case when {var}.age >= 18 then 'eu' else 'us' end"},
        {"json_path": "route.region", "expression": f"upper({var}.name)"},
        {"json_path": "tier", "expression": f"{var}.email_verified"},
        {"json_path": "ids.row.id", "expression": f"{var}.id"},
    ]


def expected(row: dict[str, Any]) -> dict[str, Any]:
    return {"team": "growth", "region": "eu" if row["age"] >= 18 else "us",
            "route": {"kind": "user", "region": row["name"].upper()}, "tier": row["email_verified"],
            "ids": {"row": {"id": row["id"]}}}


ROWS = [{"id": 1, "name": "ada", "age": 36, "email_verified": True},
        {"id": 2, "name": "bob", "age": 12, "email_verified": False},
        {"id": 3, "name": "cyd", "age": 18, "email_verified": False}]


def _insert_rows(conn: psycopg.Connection) -> None:
    conn.execute("insert into users (id, name, email, age, email_verified) "
                 "select (r ->> 'id')::int, r ->> 'name', (r ->> 'name') || '@x', (r ->> 'age')::int, "
                 "(r ->> 'email_verified')::boolean from jsonb_array_elements(%s::jsonb) r", [Jsonb(ROWS)])


def _of(state: list[tuple[Any, ...]], trigger: str) -> list[tuple[Any, ...]]:
    """The rows of ``trigger_state`` about one generated trigger (``pgstream_insert_stmt``) and its function."""
    function = re.compile("_publish_" + trigger.removeprefix("pgstream_") + "_[0-9a-f]{16}")
    return [r for r in state if (r[0] == "trigger" and f"TRIGGER {trigger} " in r[3])
            or (r[0] == "function" and function.fullmatch(r[2]))]


def _metadata(conn: psycopg.Connection) -> list[tuple[str, Any]]:
    return [(p["tg_op"], m) for _, _, p, m in events(conn)]


@pytest.mark.parametrize("mode", ["row", "statement"])
def test_insert_and_delete_compute_metadata_per_event(users: psycopg.Connection, mode: str) -> None:
    subscribe(users, "in", columns=["id"], metadata=STATIC, metadata_extensions=computed("new"), mode=mode)
    subscribe(users, "out", op="DELETE", columns=["id"], metadata=STATIC, metadata_extensions=computed("old"),
              mode=mode)
    _insert_rows(users)
    users.execute("delete from users where id in (1, 2)")
    assert _metadata(users) == ([("INSERT", expected(r)) for r in ROWS]
                                + [("DELETE", expected(r)) for r in ROWS[:2]])


def test_update_computes_metadata_from_old_and_new(users: psycopg.Connection) -> None:
    subscribe(users, "aged", op="UPDATE", columns=["id"], when="old.age is distinct from new.age",
              metadata={"team": "growth"},
              metadata_extensions=[{"json_path": "age.before", "expression": "old.age"},
                                   {"json_path": "age.after", "expression": "new.age"},
                                   {"json_path": "region", "expression": "case when new.age >= 18 then 'eu' end"}])
    _insert_rows(users)
    users.execute("update users set age = age + 6 where id in (2, 3)")
    users.execute("update users set name = 'same age'")  # filtered out by the when_clause
    assert _metadata(users) == [
        ("UPDATE", {"team": "growth", "age": {"before": 12, "after": 18}, "region": "eu"}),
        ("UPDATE", {"team": "growth", "age": {"before": 18, "after": 24}, "region": "eu"})]


@pytest.mark.parametrize("mode", ["row", "statement"])
def test_statement_and_row_mode_write_the_same_metadata_for_several_subscriptions(users: psycopg.Connection,
                                                                                  mode: str) -> None:
    """Two subscriptions of one table and operation (statement mode: the VALUES form); a computed
    value that would fail for rows a subscription filters out is never evaluated for them."""
    subscribe(users, "adults", columns=["id"], when="new.age > 0",
              metadata_extensions=[{"json_path": "per_year", "expression": "100 / new.age"}], mode=mode)
    subscribe(users, "all", columns=["id"], metadata={"static": True}, mode=mode)
    users.execute("insert into users (name, age) values ('a', 50), ('zero', 0), ('b', 20)")
    got = [(p["tg_name"], p["new"]["id"], m) for _, _, p, m in events(users)]
    assert got == [("adults", 1, {"per_year": 2}), ("all", 1, {"static": True}), ("all", 2, {"static": True}),
                   ("adults", 3, {"per_year": 5}), ("all", 3, {"static": True})]


def test_merging_computed_over_static_metadata(users: psycopg.Connection) -> None:
    """null static metadata: the computed keys alone; a computed null is JSON null (it wins); a
    static scalar where a computed path goes through is replaced by the object."""
    subscribe(users, "a", columns=["id"], metadata_extensions=[{"json_path": "x.y", "expression": "new.id"}])
    subscribe(users, "b", columns=["id"], metadata={"team": "t", "x": 5, "keep": [1, 2]},
              metadata_extensions=[{"json_path": "team", "expression": "null::text"},
                                   {"json_path": "x.y", "expression": "new.name"}])
    subscribe(users, "c", columns=["id"], metadata={"only": "static"})  # no extensions: as before
    users.execute("insert into users (name) values ('n')")
    assert [m for _, _, _, m in events(users)] == [
        {"x": {"y": 1}}, {"team": None, "x": {"y": "n"}, "keep": [1, 2]}, {"only": "static"}]


def test_a_path_may_start_with_what_the_payload_reserves(users: psycopg.Connection) -> None:
    """Metadata has no reserved keys: "new", "old", "tg_op"... are ordinary metadata keys."""
    subscribe(users, "k", columns=["id"], metadata_extensions=[{"json_path": "new.id", "expression": "new.id"},
                                                               {"json_path": "tg_op", "expression": "'mine'"}])
    users.execute("insert into users (name) values ('n')")
    ((_, _, payload, metadata),) = events(users)
    assert metadata == {"new": {"id": 1}, "tg_op": "mine"} and payload["tg_op"] == "INSERT"


# --------------------------------------------------------------------------------------------
# validation: the same checks and messages as payload extensions, nothing changed on error

BAD = [
    ([{"json_path": "x", "expression": "new.nope"}], "metadata_extensions[1].expression", "does not exist"),
    ([{"json_path": "x", "expression": "1 +"}], "metadata_extensions[1].expression", "syntax error"),
    ([{"json_path": "x", "expression": "new.age + 'a'::text"}], "metadata_extensions[1].expression",
     "operator does not exist"),
    ([{"json_path": "x", "expression": "old.id"}], "metadata_extensions[1].expression",
     'missing FROM-clause entry for table "old"'),
    ([{"json_path": "x..y", "expression": "1"}], "metadata_extensions[1].json_path", "malformed"),
    ([{"json_path": "x y", "expression": "1"}], "metadata_extensions[1].json_path", "malformed"),
    ([{"json_path": "a", "expression": "1"}, {"json_path": "a.b", "expression": "2"}],
     "metadata_extensions[2].json_path", "conflicts with another extension path"),
    ([{"path": "a", "expression": "1"}], "metadata_extensions[1]", "expected"),
    ({"json_path": "a", "expression": "1"}, "metadata_extensions", "must be a JSON array"),
    ([{"json_path": "a", "expression": "1; drop table users"}], "metadata_extensions[1].expression",
     'statement separator ";"'),
    ([{"json_path": "a", "expression": "new.name = E'\\''; drop table users; --'"}],
     "metadata_extensions[1].expression", "ambiguous string literal"),
    ([{"json_path": "a", "expression": "1) ; drop table users; select (1"}], "metadata_extensions[1].expression",
     "unbalanced parentheses"),
    ([{"json_path": "a", "expression": "count(*)"}], "metadata_extensions[1].expression",
     "aggregate functions are not allowed"),
    ([{"json_path": "a", "expression": "(select 1)"}], "metadata_extensions[1].expression",
     "subqueries are not allowed"),
]


@pytest.mark.parametrize("mode", ["row", "statement"])
@pytest.mark.parametrize(("extensions", "part", "message"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_metadata_extensions_are_refused_like_payload_extensions(users: psycopg.Connection, mode: str,
                                                                     extensions: Any, part: str,
                                                                     message: str) -> None:
    subscribe(users, "good", when="new.age > 1", metadata_extensions=[{"json_path": "a", "expression": "new.id"}],
              mode=mode)
    before = trigger_state(users)
    subs_before = users.execute("select * from pgstream.subscriptions order by id").fetchall()
    with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
        users.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names, "
                      "trigger_mode, metadata_extensions) values ('the-bad-one', 1, 'INSERT', 'users', '{id}', %s, %s)",
                      [mode, Jsonb(extensions)])
    assert f'pgstream: subscription "the-bad-one" (stream 1, INSERT on public.users): {part}: ' in str(err.value)
    assert message in str(err.value)
    # the same expression as a payload extension fails with the same message
    if isinstance(extensions, list) and part.startswith("metadata_extensions["):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as payload_err:
            subscribe(users, "the-bad-one", columns=["id"], extensions=extensions, mode=mode)
        payload_message = payload_err.value.diag.message_primary or ""
        assert payload_message.replace("payload_extensions", "metadata_extensions") == err.value.diag.message_primary
    assert trigger_state(users) == before
    assert users.execute("select * from pgstream.subscriptions order by id").fetchall() == subs_before


def test_static_metadata_must_be_an_object_to_merge_into(users: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue,
                       match=r'subscription "s" .*: metadata: must be a JSON object \(or null\) for '
                             r"metadata_extensions to be merged into it, got a JSON array"):
        subscribe(users, "s", metadata=[1, 2], metadata_extensions=[{"json_path": "a", "expression": "1"}])
    subscribe(users, "s", metadata=[1, 2])  # without extensions any JSON is kept, as before
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=r": metadata: must be a JSON object"):
        users.execute("update pgstream.subscriptions set metadata_extensions = %s",
                      [Jsonb([{"json_path": "a", "expression": "1"}])])
    assert users.execute("select metadata_extensions from pgstream.subscriptions").fetchone() == ([],)


def test_an_update_of_metadata_extensions_regenerates_only_that_trigger(users: psycopg.Connection) -> None:
    subscribe(users, "in", metadata_extensions=[{"json_path": "a", "expression": "new.id"}])
    subscribe(users, "out", op="DELETE")
    before = trigger_state(users)
    users.execute("update pgstream.subscriptions set metadata_extensions = %s where key = 'in'",
                  [Jsonb([{"json_path": "a", "expression": "new.id * 2"}])])
    after = trigger_state(users)
    assert len(_of(before, "pgstream_delete")) == 2 and _of(after, "pgstream_delete") == _of(before, "pgstream_delete")
    assert not set(_of(after, "pgstream_insert")) & set(_of(before, "pgstream_insert"))  # new oids, new code
    users.execute("insert into users (name) values ('n')")
    assert [m for _, _, _, m in events(users)] == [{"a": 2}]


# --------------------------------------------------------------------------------------------
# set_subscriptions, drift guard


def test_set_subscriptions_writes_metadata_extensions_and_a_noop_keeps_trigger_oids(users: psycopg.Connection) -> None:
    desired: list[dict[str, Any]] = [
        {"key": "in", "table_name": "users", "metadata": {"team": "t"},
         "metadata_extensions": [{"json_path": "region", "expression": "coalesce(new.name, 'none')"}]},
        {"key": "bulk", "table_name": "users", "trigger_mode": "statement",
         "metadata_extensions": [{"json_path": "n", "expression": "new.id"}]},
        {"key": "bye", "table_name": "users", "operation": "DELETE"},
    ]
    assert sorted(set_subscriptions(users, 1, desired)) == [("inserted", "bulk"), ("inserted", "bye"),
                                                            ("inserted", "in")]
    state = trigger_state(users)
    assert set_subscriptions(users, 1, desired) == []
    assert trigger_state(users) == state  # same trigger and function oids, same code

    desired[0]["metadata_extensions"] = [{"json_path": "region", "expression": "upper(new.name)"}]
    assert set_subscriptions(users, 1, desired) == [("updated", "in")]
    after = trigger_state(users)
    assert not set(_of(after, "pgstream_insert")) & set(_of(state, "pgstream_insert"))  # regenerated...
    for kept in ("pgstream_insert_stmt", "pgstream_delete"):  # ... the others were not
        assert len(_of(state, kept)) == 2 and _of(after, kept) == _of(state, kept)
    users.execute("insert into users (name) values ('ada')")
    assert sorted((p["tg_name"], m) for _, _, p, m in events(users)) == [
        ("bulk", {"n": 1}), ("in", {"team": "t", "region": "ADA"})]


@pytest.mark.parametrize("ddl", ["alter table users drop column age", "alter table users rename column age to years",
                                 "alter table users alter column age type text"])
def test_drift_guard_protects_columns_metadata_expressions_use(users: psycopg.Connection, ddl: str) -> None:
    subscribe(users, "guarded", columns=["id"],
              metadata_extensions=[{"json_path": "adult", "expression": "new.age >= 18"}])
    before = trigger_state(users)
    with pytest.raises(psycopg.errors.DependentObjectsStillExist,
                       match=r'pgstream: refusing .*subscription "guarded" .*metadata_extensions\[1\]\.expression'):
        users.execute(ddl)
    assert trigger_state(users) == before
    users.execute("alter table users drop column name")  # a column no expression uses
    users.execute("insert into users (age) values (20)")
    assert [m for _, _, _, m in events(users)] == [{"adult": True}]


# --------------------------------------------------------------------------------------------
# without metadata_extensions, the generated code is what it was


UPGRADE_SUBS: list[dict[str, Any]] = [
    {"key": "signup", "op": "INSERT", "columns": ["id", "email"], "when": "new.email is not null",
     "extensions": [{"json_path": "group_id", "expression": "new.id::text"}], "metadata": {"team": "growth"}},
    {"key": "changed", "op": "UPDATE", "columns": ["id", "name"], "metadata": {"nested": {"a": [1, "it's"]}}},
    {"key": "gone", "op": "DELETE", "columns": ["id"], "mode": "statement", "stream_id": 2},
    {"key": "bulk", "op": "INSERT", "columns": ["id", "age"], "mode": "statement", "when": "new.age > 1",
     "metadata": {"bulk": True}},
    {"key": "bulk-2", "op": "INSERT", "columns": ["id"], "mode": "statement", "stream_id": 2},
]


def _generated(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """Every generated trigger and function as installed, and as the installed code generates it."""
    return conn.execute(
        """select t.oid::bigint, t.tgname::text, pg_get_triggerdef(t.oid), p.oid::bigint, p.prosrc,
                  obj_description(t.oid, 'pg_trigger'), g.function_body, g.when_clause
           from pg_trigger t join pg_proc p on p.oid = t.tgfoid
           cross join lateral (select case when t.tgname like '%%\\_stmt' then 'statement'
                                           when t.tgname = 'pgstream_truncate' then 'truncate' else 'row' end) m(mode)
           cross join lateral pgstream.generated_trigger('public', 'users',
               case when m.mode = 'truncate' then 'DELETE'
                    else upper(split_part(t.tgname, '_', 2)) end::pgstream.operation_type, m.mode) g
           where t.tgrelid = 'public.users'::regclass and not t.tgisinternal order by t.tgname""").fetchall()


def test_without_metadata_extensions_the_upgrade_keeps_every_trigger_and_its_code(empty_db_url: str,
                                                                                   tmp_path: Path) -> None:
    """An install of release 0.1 (tests/fixtures) with row- and statement-mode subscriptions, static
    metadata included: after the upgrade every generated trigger and function is the same object
    (oid) with the same source, and the new code generates exactly that source."""
    migrate(empty_db_url, directory=released_sql(tmp_path / "released"))
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        c.execute("create table public.users (id serial primary key, name text, email text, "
                  "email_verified boolean not null default false, age integer)")
        for sub in UPGRADE_SUBS:
            c.execute("""insert into pgstream.subscriptions (key, stream_id, operation, table_name, when_clause,
                                column_names, payload_extensions, metadata, trigger_mode)
                         values (%s, %s, %s, 'users', %s, %s, %s, %s, %s)""",
                      [sub["key"], sub.get("stream_id", 1), sub["op"], sub.get("when"), sub["columns"],
                       Jsonb(sub.get("extensions", [])), Jsonb(sub["metadata"]) if "metadata" in sub else None,
                       sub.get("mode", "row")])
        released = _generated(c)
    assert len(released) == 4 and all(r[4] == r[6] for r in released)  # installed = what 0.1 generates

    migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        assert c.execute("select count(*) from pgstream.subscriptions where metadata_extensions = '[]'"
                         ).fetchone() == (5,)
        upgraded = _generated(c)
        # same oids, same source, and the current generator agrees; the DELETE subscriptions' table gains
        # its TRUNCATE trigger (generated as the code generates it)
        assert [g for g in upgraded if g[1] != "pgstream_truncate"] == released
        assert [(g[1], g[4] == g[6]) for g in upgraded if g[1] == "pgstream_truncate"] == [("pgstream_truncate", True)]
        c.execute("insert into users (name, email, age) values ('a', 'a@x', 30), ('b', null, 1)")
        c.execute("update users set name = 'c'")
        c.execute("delete from users")
        got = [(s, p["tg_name"], m) for _, s, p, m in events(c)]
    # statement mode writes at the statement's end, row mode at commit
    assert got == [(1, "bulk", {"bulk": True}), (2, "bulk-2", None), (2, "bulk-2", None),
                   (1, "signup", {"team": "growth"}),
                   (1, "changed", {"nested": {"a": [1, "it's"]}}), (1, "changed", {"nested": {"a": [1, "it's"]}}),
                   (2, "gone", None), (2, "gone", None)]
