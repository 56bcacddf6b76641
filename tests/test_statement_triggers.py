"""Statement-level trigger mode (``trigger_mode: statement``): the same events as row mode from one
trigger per statement, bulk inserts, rollbacks, mode switches, drift guard and tear-down."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest

from pgstream_dagster.engine.migrations import (
    tear_down,
)

from .support.schema import events, set_subscriptions, subscribe, trigger_state

MIXED_SUBS: list[dict[str, Any]] = [
    {"key": "c-all", "columns": ["id", "email"], "metadata": {"team": "growth"}},
    {"key": "a-adults", "when": "new.age >= 18", "columns": ["id", "age"],
     "extensions": [{"json_path": "info.upper", "expression": "upper(new.name)"},
                    {"json_path": "info.flags.verified", "expression": "new.email_verified"},
                    {"json_path": "group_id", "expression": "new.id::text"}]},
    {"key": "b-verified", "when": "new.email_verified", "columns": ["email", "created_at"], "stream_id": 2},
    {"key": "d-gone", "op": "DELETE", "when": "old.age < 30", "columns": ["id", "name"]},
    {"key": "e-gone-all", "op": "DELETE", "columns": ["id"], "stream_id": 2},
]

WORKLOAD = [
    "insert into users (name, email, age, email_verified) values ('ada', 'a@x', 36, true), ('bob', 'b@x', 12, false)",
    "insert into users (name, email, age, email_verified) "
    "select 'n' || g, 'n' || g || '@x', g, g % 3 = 0 from generate_series(1, 60) g",
    "insert into users (name) values (null)",
    "delete from users where age between 10 and 40",
    "insert into users (name, age) select 'none', 5 where false",
    "delete from users",
]


def _run_workload(conn: psycopg.Connection) -> list[tuple[int, dict[str, Any], Any]]:
    # not TRUNCATE: it is refused on a table with DELETE subscriptions that take no TRUNCATE events
    conn.execute("delete from users")
    conn.execute("alter sequence users_id_seq restart")
    conn.execute("delete from pgstream.events")
    for stmt in WORKLOAD:
        conn.execute(stmt)
    out = []
    for _, stream_id, payload, metadata in events(conn):
        payload.pop("timestamp")
        out.append((stream_id, payload, metadata))
    return out


def _subscribe_all(conn: psycopg.Connection, subs: list[dict[str, Any]], mode: str) -> None:
    for sub in subs:
        subscribe(conn, **{**sub, "mode": mode})


@pytest.mark.parametrize("subs", [[MIXED_SUBS[1], MIXED_SUBS[3]], [MIXED_SUBS[0], MIXED_SUBS[4]]],
                         ids=["one-per-operation-filtered", "one-per-operation-unfiltered"])
def test_statement_mode_single_subscription_matches_row_mode(users: psycopg.Connection,
                                                             subs: list[dict[str, Any]]) -> None:
    _subscribe_all(users, subs, "row")
    by_row = _run_workload(users)
    assert {p["tg_op"] for _, p, _ in by_row} == {"INSERT", "DELETE"}
    users.execute("update pgstream.subscriptions set trigger_mode = 'statement'")
    bodies = [r[0] for r in users.execute("select prosrc from pg_proc where proname like '\\_publish\\_%\\_stmt\\_%'")]
    assert len(bodies) == 2 and not any("lateral" in b for b in bodies)  # the one-subscription form
    assert _run_workload(users) == by_row


def test_statement_mode_produces_the_row_modes_events(users: psycopg.Connection) -> None:
    _subscribe_all(users, MIXED_SUBS, "row")
    by_row = _run_workload(users)
    assert len(by_row) > 100
    assert {p["tg_name"] for _, p, _ in by_row} == {s["key"] for s in MIXED_SUBS}
    users.execute("update pgstream.subscriptions set trigger_mode = 'statement'")
    names = {r[0] for r in users.execute("select tgname from pg_trigger where tgrelid = 'users'::regclass")}
    assert names == {"pgstream_insert_stmt", "pgstream_delete_stmt", "pgstream_truncate"}
    by_statement = _run_workload(users)
    assert by_statement == by_row
    # row 1: subscriptions in (stream_id, key) order
    assert [(s, p["tg_name"]) for s, p, _ in by_statement[:3]] == [(1, "a-adults"), (1, "c-all"), (2, "b-verified")]
    assert by_statement[0][1] == {"tg_name": "a-adults", "tg_op": "INSERT", "tg_table_name": "users",
                                  "tg_table_schema": "public", "new": {"id": 1, "age": 36}, "old": None,
                                  "group_id": "1", "info": {"upper": "ADA", "flags": {"verified": True}}}
    assert by_statement[1][2] == {"team": "growth"}
    assert by_statement[-1][1]["tg_op"] == "DELETE" and by_statement[-1][1]["new"] is None


def test_statement_mode_payload_timestamp_is_transaction_time(users: psycopg.Connection) -> None:
    subscribe(users, "s", mode="statement")
    users.execute("insert into users (email) values ('a')")
    [(_, _, payload, _)] = events(users)
    assert abs(payload["timestamp"] / 1000 - dt.datetime.now(dt.UTC).timestamp()) < 60


def test_statement_mode_bulk_insert_of_10000_rows(users: psycopg.Connection) -> None:
    subscribe(users, "z-all", columns=["id"], mode="statement")
    subscribe(users, "a-even", when="new.age % 2 = 0", columns=["age"], mode="statement", stream_id=2)
    users.execute("insert into users (age) select g from generate_series(1, 10000) g")
    got = [(s, p["tg_name"], p["new"]) for _, s, p, _ in events(users)]
    expected = []
    for g in range(1, 10001):  # row order, then subscriptions in (stream_id, key) order
        expected.append((1, "z-all", {"id": g}))
        if g % 2 == 0:
            expected.append((2, "a-even", {"age": g}))
    assert got == expected
    # one statement, one trigger call: every event has the same transaction-start timestamp
    assert users.execute("select count(distinct payload->'timestamp') from pgstream.events").fetchone() == (1,)


def test_statement_mode_rolls_back_with_the_statement(users: psycopg.Connection) -> None:
    subscribe(users, "s", mode="statement")
    with pytest.raises(psycopg.errors.NotNullViolation):
        users.execute("insert into users (email, email_verified) values ('a', false), ('b', null)")
    with users.transaction():
        users.execute("insert into users (email) values ('kept')")
        with pytest.raises(psycopg.errors.RaiseException), users.transaction():
            users.execute("insert into users (email) values ('savepoint')")
            users.execute("do $$ begin raise exception 'boom'; end $$")
    assert [p["new"]["email"] for _, _, p, _ in events(users)] == ["kept"]


def test_statement_mode_with_column_names_like_plpgsql_variables(conn: psycopg.Connection) -> None:
    conn.execute("create table public.odd (id int, tg_op text, found boolean, v_ts int)")
    subscribe(conn, "odd", table="odd", columns=["tg_op", "found", "v_ts"], when="new.found and new.tg_op = 'x'",
              extensions=[{"json_path": "e", "expression": "new.v_ts + 1"}], mode="statement")
    conn.execute("insert into odd values (1, 'x', true, 7), (2, 'y', true, 8), (3, 'x', false, 9)")
    [(_, _, p, _)] = events(conn)
    assert (p["tg_op"], p["new"], p["e"]) == ("INSERT", {"tg_op": "x", "found": True, "v_ts": 7}, 8)


def test_mode_switch_row_statement_row(users: psycopg.Connection) -> None:
    subscribe(users, "a", when="new.age > 1", columns=["id"])
    subscribe(users, "gone", op="DELETE", columns=["id"])
    row_state = trigger_state(users)
    delete_trigger = [r for r in row_state if r[0] == "trigger" and "pgstream_delete" in r[3]]

    users.execute("update pgstream.subscriptions set trigger_mode = 'statement' where key = 'a'")
    state = trigger_state(users)
    assert delete_trigger[0] in state  # the other operation's trigger is untouched
    defs = [r[3] for r in state if r[0] == "trigger"]
    assert any("pgstream_insert_stmt AFTER INSERT" in d and "REFERENCING NEW TABLE AS pgstream_new" in d
               and "FOR EACH STATEMENT" in d for d in defs)
    assert not any("pgstream_insert " in d for d in defs)
    assert users.execute("select count(*) from pg_proc where proname like '\\_publish\\_insert\\_%' "
                         "and proname not like '%\\_stmt\\_%'").fetchone() == (0,)
    users.execute("insert into users (age) values (5), (0)")

    users.execute("update pgstream.subscriptions set trigger_mode = 'row' where key = 'a'")
    back = trigger_state(users)
    assert sorted(r[3] for r in back) == sorted(r[3] for r in row_state)  # same definitions as before
    users.execute("insert into users (age) values (6), (0)")
    users.execute("delete from users")
    got = [(p["tg_op"], p["new"], p["old"]) for _, _, p, _ in events(users)]
    assert got == [("INSERT", {"id": 1}, None), ("INSERT", {"id": 3}, None),
                   ("DELETE", None, {"id": 1}), ("DELETE", None, {"id": 2}), ("DELETE", None, {"id": 3}),
                   ("DELETE", None, {"id": 4})]


def test_row_and_statement_subscriptions_on_one_table(users: psycopg.Connection) -> None:
    subscribe(users, "by-row", columns=["id"])
    subscribe(users, "by-statement", columns=["id"], mode="statement", stream_id=2)
    names = sorted(r[0] for r in users.execute("select tgname from pg_trigger where tgrelid = 'users'::regclass"))
    assert names == ["pgstream_insert", "pgstream_insert_stmt"]
    users.execute("insert into users (email) values ('a'), ('b')")
    got = sorted((s, p["tg_name"], p["new"]["id"]) for _, s, p, _ in events(users))
    assert got == [(1, "by-row", 1), (1, "by-row", 2), (2, "by-statement", 1), (2, "by-statement", 2)]
    users.execute("delete from pgstream.subscriptions where key = 'by-row'")
    assert [r[0] for r in users.execute("select tgname from pg_trigger where tgrelid = 'users'::regclass")] == [
        "pgstream_insert_stmt"]


BAD_MODE = [
    ({"op": "UPDATE", "mode": "statement"}, "statement mode supports INSERT and DELETE only"),
    ({"mode": "rows"}, "must be 'row' or 'statement', got 'rows'"),
    ({"mode": "statement", "when": "new.nope"}, "does not exist"),
    ({"mode": "statement", "op": "DELETE", "when": "new.id = 1"}, 'missing FROM-clause entry for table "new"'),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_MODE, ids=[f"badmode{i}" for i in range(len(BAD_MODE))])
def test_bad_statement_mode_subscription_changes_nothing(users: psycopg.Connection, kwargs: dict[str, Any],
                                                          message: str) -> None:
    subscribe(users, "good", mode="statement")
    subscribe(users, "good-update", op="UPDATE")
    before = trigger_state(users)
    subs_before = users.execute("select * from pgstream.subscriptions order by id").fetchall()
    with pytest.raises(psycopg.Error) as err:
        subscribe(users, "the-bad-one", **kwargs)
    assert 'subscription "the-bad-one"' in str(err.value) and message in str(err.value)
    with pytest.raises(psycopg.Error, match="statement mode supports INSERT and DELETE only"):
        users.execute("update pgstream.subscriptions set trigger_mode = 'statement' where key = 'good-update'")
    assert trigger_state(users) == before
    assert users.execute("select * from pgstream.subscriptions order by id").fetchall() == subs_before


def test_statement_mode_in_set_subscriptions_and_noop_keeps_oids(users: psycopg.Connection) -> None:
    desired: list[dict[str, Any]] = [
        {"key": "s", "table_name": "users", "trigger_mode": "statement", "when_clause": "new.age > 3"},
        {"key": "r", "table_name": "users", "operation": "DELETE"},
    ]
    assert sorted(set_subscriptions(users, 1, desired)) == [("inserted", "r"), ("inserted", "s")]
    state = trigger_state(users)
    assert len(state) == 6  # pgstream_insert_stmt, pgstream_delete, pgstream_truncate and their functions
    assert set_subscriptions(users, 1, desired) == []
    assert trigger_state(users) == state
    desired[0]["trigger_mode"] = "row"
    assert set_subscriptions(users, 1, desired) == [("updated", "s")]
    assert users.execute("select tgname from pg_trigger where tgrelid = 'users'::regclass order by 1").fetchall() == [
        ("pgstream_delete",), ("pgstream_insert",), ("pgstream_truncate",)]
    desired[0].pop("trigger_mode")  # omitted: row
    assert set_subscriptions(users, 1, desired) == []
    with pytest.raises(psycopg.Error, match="statement mode supports INSERT and DELETE only"):
        set_subscriptions(users, 1, [{"key": "u", "table_name": "users", "operation": "UPDATE",
                                      "trigger_mode": "statement"}])
    assert len(trigger_state(users)) == 6


@pytest.mark.parametrize("ddl", ["drop trigger pgstream_insert_stmt on users", "alter table users drop column age",
                                 "drop table users"])
def test_drift_guard_covers_statement_triggers(users: psycopg.Connection, ddl: str) -> None:
    subscribe(users, "guarded", when="new.age > 1", mode="statement")
    before = trigger_state(users)
    with pytest.raises(psycopg.Error, match="pgstream: refusing"):
        users.execute(ddl)
    assert trigger_state(users) == before


def test_tear_down_removes_statement_triggers(users: psycopg.Connection, db_url: str) -> None:
    subscribe(users, "a", mode="statement")
    subscribe(users, "b", op="DELETE", mode="statement")
    removed = tear_down(db_url)
    assert "trigger pgstream_insert_stmt on public.users" in removed
    assert "trigger pgstream_delete_stmt on public.users" in removed
    assert users.execute("select count(*) from pg_trigger where tgrelid = 'public.users'::regclass").fetchone() == (0,)
    users.execute("insert into users (email) values ('plain')")


