"""The database core: subscriptions -> triggers, payloads, validation, drift guard,
set_subscriptions, partitions, privileges and tear-down, against a real Postgres."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.ledger import locks
from pgstream_dagster.engine.migrations import (
    migrate,
    sql_dir,
    tear_down,
)

from .support.harness import backdated
from .support.schema import events, set_subscriptions, subscribe, trigger_state

# --------------------------------------------------------------------------------------------
# streams and publications


def test_stream_row_owns_its_publication(conn: psycopg.Connection) -> None:
    conn.execute("insert into pgstream.streams (id) values (7)")
    row = conn.execute(
        "select p.pubinsert, p.pubupdate, p.pubdelete, p.pubviaroot, pg_get_expr(r.prqual, r.prrelid) "
        "from pg_publication p join pg_publication_rel r on r.prpubid = p.oid "
        "where p.pubname = 'pgstream_stream_7'").fetchone()
    assert row is not None
    assert row[:4] == (True, False, False, True)
    assert "stream_id = 7" in row[4]
    # the reader's publication: the same filter, the whole event
    row = conn.execute(
        "select p.pubinsert, p.pubupdate, p.pubdelete, p.pubviaroot, pg_get_expr(r.prqual, r.prrelid) "
        "from pg_publication p join pg_publication_rel r on r.prpubid = p.oid "
        "where p.pubname = 'pgstream_stream_7_rows'").fetchone()
    assert row is not None and row[:4] == (True, False, False, True) and "stream_id = 7" in row[4]
    assert _published_columns(conn, 7, "_rows") == ["created_at", "id", "metadata", "payload", "stream_id"]
    conn.execute("delete from pgstream.streams where id = 7")
    assert conn.execute("select count(*) from pg_publication where pubname like 'pgstream\\_stream\\_7%'"
                        ).fetchone() == (0,)


def _published_columns(conn: psycopg.Connection, stream_id: int, suffix: str = "") -> list[str]:
    row = conn.execute("select attnames from pg_publication_tables where pubname = %s",
                       [f"pgstream_stream_{stream_id}{suffix}"]).fetchone()
    assert row is not None
    return sorted(row[0])


def test_streams_of_an_earlier_version_get_the_readers_publication(conn: psycopg.Connection) -> None:
    """019 creates the reader's publication for streams created before it, once; it leaves alone
    one that exists."""
    conn.execute("insert into pgstream.streams (id) values (9), (10)")
    conn.execute("drop publication pgstream_stream_9_rows")
    conn.execute("alter publication pgstream_stream_10_rows set table pgstream.events (id, stream_id, created_at, "
                 "payload, metadata) where (stream_id = 10)")
    for _ in range(2):
        conn.execute((sql_dir() / "019_reader_publication.sql").read_text())
        assert _published_columns(conn, 9, "_rows") == ["created_at", "id", "metadata", "payload", "stream_id"]
    row = conn.execute("select pg_get_expr(r.prqual, r.prrelid) from pg_publication p join pg_publication_rel r "
                       "on r.prpubid = p.oid where p.pubname = 'pgstream_stream_9_rows'").fetchone()
    assert row is not None and "stream_id = 9" in row[0]


def test_publication_carries_only_what_the_sensor_reads(conn: psycopg.Connection) -> None:
    conn.execute("insert into pgstream.streams (id) values (8)")
    assert _published_columns(conn, 8) == ["created_at", "id", "stream_id"]
    # a publication of an earlier version (every column) gets the column list from 011, idempotently
    conn.execute("alter publication pgstream_stream_8 set table pgstream.events where (stream_id = 8)")
    assert "payload" in _published_columns(conn, 8)
    for _ in range(2):
        conn.execute((sql_dir() / "011_publication_columns.sql").read_text())
        assert _published_columns(conn, 8) == ["created_at", "id", "stream_id"]
    row = conn.execute("select pg_get_expr(r.prqual, r.prrelid) from pg_publication p join pg_publication_rel r "
                       "on r.prpubid = p.oid where p.pubname = 'pgstream_stream_8'").fetchone()
    assert row is not None and "stream_id = 8" in row[0]


def test_subscription_creates_its_stream(users: psycopg.Connection) -> None:
    subscribe(users, "s", stream_id=42)
    assert users.execute("select id from pgstream.streams").fetchall() == [(42,)]
    assert users.execute("select count(*) from pg_publication where pubname = 'pgstream_stream_42'").fetchone() == (1,)


# --------------------------------------------------------------------------------------------
# seed scenarios: payloads


def test_insert_payload_matches_the_seed_contract(users: psycopg.Connection) -> None:
    subscribe(users, "user-signup", when="new.email_verified = true", columns=["id", "email", "created_at"])
    users.execute("insert into users (email, email_verified) values ('user@example.com', true)")
    [(_, stream_id, payload, _)] = events(users)
    assert stream_id == 1
    ts = payload.pop("timestamp")
    assert isinstance(ts, int) and abs(ts / 1000 - dt.datetime.now(dt.UTC).timestamp()) < 60
    assert payload == {
        "tg_name": "user-signup", "tg_op": "INSERT", "tg_table_name": "users", "tg_table_schema": "public",
        "new": {"id": 1, "email": "user@example.com", "created_at": "2024-12-12T10:30:00+00:00"},
        "old": None,
    }


def test_update_and_delete_payloads(users: psycopg.Connection) -> None:
    subscribe(users, "user-updated", op="UPDATE", columns=["id", "email"])
    subscribe(users, "user-deleted", op="DELETE", columns=["id", "email"])
    users.execute("insert into users (email) values ('a@x')")
    users.execute("update users set email = 'b@x'")
    users.execute("delete from users")
    got = [(p["tg_name"], p["tg_op"], p["new"], p["old"]) for _, _, p, _ in events(users)]
    assert got == [
        ("user-updated", "UPDATE", {"id": 1, "email": "b@x"}, {"id": 1, "email": "a@x"}),
        ("user-deleted", "DELETE", None, {"id": 1, "email": "b@x"}),
    ]


def test_when_clause_filters(users: psycopg.Connection) -> None:
    subscribe(users, "verified", when="new.email_verified = true")
    users.execute("insert into users (email, email_verified) values ('no@x', false), ('yes@x', true)")
    assert [p["new"]["email"] for _, _, p, _ in events(users)] == ["yes@x"]


def test_two_subscriptions_on_one_table(users: psycopg.Connection) -> None:
    subscribe(users, "adults", when="new.age >= 18", columns=["id"])
    subscribe(users, "all-signups", columns=["email"])
    trig = users.execute("select pg_get_triggerdef(oid) from pg_trigger where tgname = 'pgstream_insert'").fetchone()
    assert trig is not None and "WHEN" not in trig[0]  # one subscription has no filter -> no WHEN
    users.execute("insert into users (email, age) values ('kid@x', 10), ('grown@x', 40)")
    got = [(p["tg_name"], p["new"]) for _, _, p, _ in events(users)]
    assert got == [("all-signups", {"email": "kid@x"}), ("adults", {"id": 2}), ("all-signups", {"email": "grown@x"})]


def test_when_clauses_are_ored_in_the_trigger(users: psycopg.Connection) -> None:
    subscribe(users, "a", when="new.age > 60")
    subscribe(users, "b", when="new.email_verified")
    (definition,) = users.execute(
        "select pg_get_triggerdef(oid) from pg_trigger where tgname = 'pgstream_insert'").fetchone() or ()
    assert "WHEN" in definition and " OR " in definition
    users.execute("insert into users (email, age, email_verified) values ('x', 10, false), ('y', 70, false), "
                  "('z', 1, true)")
    assert [p["new"]["email"] for _, _, p, _ in events(users)] == ["y", "z"]


def test_nested_extensions_with_expressions(users: psycopg.Connection) -> None:
    subscribe(users, "ext", columns=["id"], extensions=[
        {"json_path": "group_id", "expression": "new.id::text"},
        {"json_path": "queue_name", "expression": "'orders-high-priority'"},
        {"json_path": "info.name_upper", "expression": "upper(new.name)"},
        {"json_path": "info.flags.senior", "expression": "new.age >= 30"},
        {"json_path": "info.flags.verified", "expression": "new.email_verified"},
    ])
    users.execute("insert into users (name, age) values ('ada', 36)")
    [(_, _, p, _)] = events(users)
    assert p["group_id"] == "1"
    assert p["queue_name"] == "orders-high-priority"
    assert p["info"] == {"name_upper": "ADA", "flags": {"senior": True, "verified": False}}
    assert p["new"] == {"id": 1}


def test_subscription_metadata_goes_to_the_event(users: psycopg.Connection) -> None:
    subscribe(users, "m", metadata={"team": "growth"})
    users.execute("insert into users (email) values ('a')")
    assert events(users)[0][3] == {"team": "growth"}


def test_deleting_a_subscription_removes_its_trigger(users: psycopg.Connection) -> None:
    subscribe(users, "a")
    assert len(trigger_state(users)) == 2
    users.execute("delete from pgstream.subscriptions where key = 'a'")
    assert trigger_state(users) == []
    users.execute("insert into users (email) values ('a')")
    assert events(users) == []


def test_events_carry_an_lsn(users: psycopg.Connection) -> None:
    subscribe(users, "a")
    before = users.execute("select pg_current_wal_insert_lsn()").fetchall()[0][0]
    users.execute("insert into users (email) values ('a')")
    (lsn,) = users.execute("select lsn from pgstream.events").fetchone() or ()
    assert lsn is not None
    assert users.execute("select %s::pg_lsn >= %s::pg_lsn", [lsn, before]).fetchone() == (True,)


def test_application_insert_into_events_directly(conn: psycopg.Connection) -> None:
    conn.execute("insert into pgstream.streams (id) values (3)")
    conn.execute("""insert into pgstream.events (payload, stream_id) values ('{"kind": "manual"}', 3)""")
    [(_, stream_id, payload, _)] = events(conn)
    assert (stream_id, payload) == (3, {"kind": "manual"})


def test_wide_tables_beyond_jsonb_build_object_argument_limit(conn: psycopg.Connection) -> None:
    cols = [f"c{i}" for i in range(80)]
    conn.execute(sql.SQL("create table public.wide ({})").format(sql.SQL(", ").join(
        sql.SQL("{} int default {}").format(sql.Identifier(c), sql.Literal(i)) for i, c in enumerate(cols))))
    subscribe(conn, "wide", table="wide", columns=cols)
    conn.execute("insert into wide default values")
    assert events(conn)[0][2]["new"] == {c: i for i, c in enumerate(cols)}


#: column names PL/pgSQL reads as its own keywords after ``new.`` / ``old.`` unless quoted (SQL leaves
#: them bare: they are not reserved there), and names that need quoting in any case
KEYWORD_COLUMNS = ["by", "begin", "if", "loop", "strict", "while", "execute", "declare", "Mixed Case", 'quo"te']


@pytest.mark.parametrize("mode", ["row", "statement"])
def test_columns_named_like_plpgsql_keywords_are_published(conn: psycopg.Connection, mode: str) -> None:
    """A column named ``by`` or ``loop`` failed the application's own write in row mode ("record new has
    no field by"): every column reference in a generated trigger is quoted."""
    conn.execute(sql.SQL("create table public.kw (id int primary key, {})").format(sql.SQL(", ").join(
        sql.SQL("{} text").format(sql.Identifier(c)) for c in KEYWORD_COLUMNS)))
    for op in ("INSERT", "UPDATE", "DELETE"):
        subscribe(conn, f"kw-{op.lower()}", op=op, table="kw", columns=["id", *KEYWORD_COLUMNS],
                  mode="row" if op == "UPDATE" else mode)  # statement mode pairs no UPDATE rows
    row = {c: f"v-{i}" for i, c in enumerate(KEYWORD_COLUMNS)}
    conn.execute(sql.SQL("insert into public.kw (id, {}) values (1, {})").format(
        sql.SQL(", ").join(map(sql.Identifier, KEYWORD_COLUMNS)), sql.SQL(", ").join(map(sql.Literal, row.values()))))
    conn.execute('update public.kw set "by" = \'changed\'')
    conn.execute("delete from public.kw")
    got = [(p["tg_op"], p["new"], p["old"]) for _, _, p, _ in events(conn)]
    assert got == [("INSERT", {"id": 1, **row}, None),
                   ("UPDATE", {"id": 1, **row, "by": "changed"}, {"id": 1, **row}),
                   ("DELETE", None, {"id": 1, **row, "by": "changed"})]


# --------------------------------------------------------------------------------------------
# the fixes


def test_same_table_name_in_two_schemas(users: psycopg.Connection) -> None:
    users.execute("create schema auth")
    users.execute("create table auth.users (id int, email text)")
    subscribe(users, "public-users")
    subscribe(users, "auth-users", schema="auth")
    users.execute("insert into public.users (email) values ('p')")
    users.execute("insert into auth.users values (1, 'a')")
    assert [(p["tg_table_schema"], p["tg_name"]) for _, _, p, _ in events(users)] == [
        ("public", "public-users"), ("auth", "auth-users")]
    users.execute("delete from pgstream.subscriptions where key = 'auth-users'")
    users.execute("insert into public.users (email) values ('p2')")
    users.execute("insert into auth.users values (2, 'a2')")
    assert [p["tg_name"] for _, _, p, _ in events(users)][-1] == "public-users"
    assert len(events(users)) == 3


def test_each_subscription_writes_to_its_own_stream(users: psycopg.Connection) -> None:
    subscribe(users, "to-one", stream_id=1)
    subscribe(users, "to-two", stream_id=2, when="new.age > 10")
    users.execute("insert into users (email, age) values ('a', 5), ('b', 50)")
    got = [(s, p["tg_name"], p["new"]["email"]) for _, s, p, _ in events(users)]
    assert got == [(1, "to-one", "a"), (1, "to-one", "b"), (2, "to-two", "b")]


def test_events_of_one_statement_keep_row_then_subscription_order(users: psycopg.Connection) -> None:
    for key in ["c", "a", "b"]:
        subscribe(users, key, columns=["name"])
    users.execute("insert into users (name) select 'n' || g from generate_series(1, 50) g")
    got = [(p["new"]["name"], p["tg_name"]) for _, _, p, _ in events(users)]
    assert got == [(f"n{g}", k) for g in range(1, 51) for k in ["a", "b", "c"]]


# --------------------------------------------------------------------------------------------
# validation: rejected input changes nothing

BAD = [
    ({"table": "nope"}, "table", "does not exist"),
    ({"columns": ["id", "emial"]}, "column_names", 'column emial does not exist'),
    ({"when": "new.nope = 1"}, "when_clause", "does not exist"),
    ({"when": "new.name"}, "when_clause", "must be a boolean expression, got type text"),
    ({"when": "old.id = 1"}, "when_clause", 'missing FROM-clause entry for table "old"'),
    ({"when": "true; drop table users"}, "when_clause", 'statement separator ";"'),
    ({"when": "true) ; drop table users; select (1"}, "when_clause", "unbalanced parentheses"),
    ({"when": "true) or (true"}, "when_clause", "unbalanced parentheses"),
    ({"when": "true -- and false"}, "when_clause", "comments"),
    ({"when": "true /* x */"}, "when_clause", "comments"),
    ({"when": "new.name = 'x"}, "when_clause", "unterminated quoted string"),
    ({"when": "new.name = $$x$$"}, "when_clause", "dollar quoting"),
    ({"when": "new.name = E'\\''; drop table users; --'"}, "when_clause", "ambiguous string literal"),
    ({"when": "(new.age > 1"}, "when_clause", "unbalanced parentheses"),
    ({"extensions": [{"json_path": "x", "expression": "new.nope"}]}, "payload_extensions[1].expression",
     "does not exist"),
    ({"extensions": [{"json_path": "x", "expression": "1 +"}]}, "payload_extensions[1].expression", "syntax error"),
    ({"extensions": [{"json_path": "x", "expression": "new.age + 'a'::text"}]},
     "payload_extensions[1].expression", "operator does not exist"),
    ({"extensions": [{"json_path": "x..y", "expression": "1"}]}, "payload_extensions[1].json_path", "malformed"),
    ({"extensions": [{"json_path": "x y", "expression": "1"}]}, "payload_extensions[1].json_path", "malformed"),
    ({"extensions": [{"json_path": "new.id", "expression": "1"}]}, "payload_extensions[1].json_path",
     "overwrite the payload key"),
    ({"extensions": [{"json_path": "a", "expression": "1"}, {"json_path": "a.b", "expression": "2"}]},
     "payload_extensions[2].json_path", "conflicts"),
    ({"extensions": [{"path": "a", "expression": "1"}]}, "payload_extensions[1]", "expected"),
    ({"extensions": [{"json_path": "a", "expression": "1; drop table users"}]},
     "payload_extensions[1].expression", "statement separator"),
]


@pytest.mark.parametrize(("kwargs", "part", "message"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_subscription_is_rejected_and_changes_nothing(users: psycopg.Connection, kwargs: dict[str, Any],
                                                          part: str, message: str) -> None:
    subscribe(users, "good", when="new.age > 1")
    before = trigger_state(users)
    subs_before = users.execute("select * from pgstream.subscriptions order by id").fetchall()
    with pytest.raises(psycopg.Error) as err:
        subscribe(users, "the-bad-one", **kwargs)
    text = str(err.value)
    assert 'subscription "the-bad-one"' in text
    assert f": {part}: " in text
    assert message in text
    assert trigger_state(users) == before
    assert users.execute("select * from pgstream.subscriptions order by id").fetchall() == subs_before
    assert users.execute("select to_regclass('public.users') is not null").fetchone() == (True,)


def test_bad_update_of_existing_subscription_keeps_old_trigger(users: psycopg.Connection) -> None:
    subscribe(users, "a", when="new.age > 1")
    before = trigger_state(users)
    with pytest.raises(psycopg.Error, match=r'subscription "a".*when_clause'):
        users.execute("update pgstream.subscriptions set when_clause = 'new.missing > 1'")
    assert trigger_state(users) == before


# --------------------------------------------------------------------------------------------
# schema-drift guard (policy: refuse)

DRIFT = [
    ("alter table users drop column email", "email"),
    ("alter table users drop column age cascade", "age"),
    ("alter table users rename column email to mail", "email"),
    ("alter table users rename column age to years", "age"),
    ("alter table users alter column age type text", "age"),
    ("drop table users", "users"),
    ("alter table users rename to people", "users"),
    ("alter schema public rename to app", "users"),
    ("drop trigger pgstream_insert on users", "pgstream_insert"),
]


@pytest.mark.parametrize(("ddl", "what"), DRIFT, ids=[d[0] for d in DRIFT])
def test_drift_guard_refuses_ddl_that_breaks_a_trigger(users: psycopg.Connection, ddl: str, what: str) -> None:
    subscribe(users, "guarded", when="new.email_verified", columns=["id", "email"],
              extensions=[{"json_path": "next_age", "expression": "new.age + 1"}])
    before = trigger_state(users)
    with pytest.raises(psycopg.Error) as err:
        users.execute(ddl)
    assert "pgstream: refusing" in str(err.value)
    assert "guarded" in str(err.value) or "pgstream_insert" in str(err.value)
    assert trigger_state(users) == before
    users.execute("insert into public.users (email, email_verified, age) values ('ok', true, 5)")
    assert len(events(users)) == 1


def test_drift_guard_allows_harmless_ddl(users: psycopg.Connection) -> None:
    subscribe(users, "guarded", columns=["id", "email"])
    users.execute("alter table users add column nickname text")
    users.execute("alter table users drop column nickname")
    users.execute("alter table users alter column name type varchar(50)")
    users.execute("create table other (id int)")
    users.execute("drop table other")
    users.execute("insert into users (email) values ('still works')")
    assert len(events(users)) == 1


def test_ddl_after_removing_the_subscription_goes_through(users: psycopg.Connection) -> None:
    subscribe(users, "guarded", columns=["email"])
    users.execute("delete from pgstream.subscriptions")
    users.execute("alter table users drop column email")
    users.execute("drop table users")


# --------------------------------------------------------------------------------------------
# set_subscriptions

def test_set_subscriptions_applies_a_set_and_noop_keeps_trigger_oids(users: psycopg.Connection) -> None:
    users.execute("create table orders (id int, user_id int, total numeric)")
    desired: list[dict[str, Any]] = [
        {"key": "signup", "table_name": "users", "when_clause": "new.email_verified"},
        {"key": "bye", "table_name": "users", "operation": "DELETE"},
        {"key": "order", "table_name": "orders", "column_names": ["id", "total"],
         "payload_extensions": [{"json_path": "group_id", "expression": "new.user_id::text"}]},
    ]
    assert sorted(set_subscriptions(users, 1, desired)) == [("inserted", "bye"), ("inserted", "order"),
                                                            ("inserted", "signup")]
    state = trigger_state(users)
    assert len(state) == 8  # "bye" (DELETE) brings pgstream_truncate and its function
    assert set_subscriptions(users, 1, desired) == []
    assert trigger_state(users) == state  # no-op: same trigger and function oids

    desired[0]["when_clause"] = "new.email_verified and new.age > 17"
    assert set_subscriptions(users, 1, desired) == [("updated", "signup")]
    after = trigger_state(users)
    changed = {(r[0], r[2]) for r in after if r not in state}
    assert ("trigger", "users") in changed
    unchanged = [r for r in state if r[2] == "orders"]
    assert unchanged and all(r in after for r in unchanged)

    assert set_subscriptions(users, 1, desired[1:]) == [("deleted", "signup")]
    assert users.execute("select count(*) from pg_trigger where tgname = 'pgstream_insert' "
                         "and tgrelid = 'public.users'::regclass").fetchone() == (0,)


def test_set_subscriptions_rejects_bad_input_atomically(users: psycopg.Connection) -> None:
    set_subscriptions(users, 1, [{"key": "a", "table_name": "users"}])
    state = trigger_state(users)
    with pytest.raises(psycopg.Error, match=r'subscription "b".*column_names'):
        set_subscriptions(users, 1, [{"key": "a", "table_name": "users", "when_clause": "new.age > 3"},
                        {"key": "b", "table_name": "users", "column_names": ["nope"]}])
    assert trigger_state(users) == state
    assert users.execute("select key, when_clause from pgstream.subscriptions").fetchall() == [("a", None)]
    with pytest.raises(psycopg.Error, match='"a" appears more than once'):
        set_subscriptions(users, 1, [{"key": "a", "table_name": "users"}, {"key": "a", "table_name": "users"}])


def test_set_subscriptions_managed_by_leaves_hand_made_ones(users: psycopg.Connection) -> None:
    subscribe(users, "by-hand")
    set_subscriptions(users, 1, [{"key": "from-yaml", "table_name": "users"}], managed_by="yaml")
    assert set_subscriptions(users, 1, [], managed_by="yaml") == [("deleted", "from-yaml")]
    assert users.execute("select key from pgstream.subscriptions").fetchall() == [("by-hand",)]


def test_set_subscriptions_touches_only_its_stream(users: psycopg.Connection) -> None:
    subscribe(users, "other-stream", stream_id=2)
    set_subscriptions(users, 1, [{"key": "mine", "table_name": "users"}])
    set_subscriptions(users, 1, [])
    assert users.execute("select key from pgstream.subscriptions").fetchall() == [("other-stream",)]


# --------------------------------------------------------------------------------------------
# partitions


def _partitions(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute(
        "select c.relname from pg_inherits i join pg_class c on c.oid = i.inhrelid "
        "where i.inhparent = 'pgstream.events'::regclass and c.relname <> 'events_default' order by 1")]


def test_partition_maintenance_across_a_simulated_date_change(conn: psycopg.Connection) -> None:
    conn.execute("insert into pgstream.streams (id) values (1)")
    for name in _partitions(conn):
        conn.execute(sql.SQL("drop table pgstream.{}").format(sql.Identifier(name)))  # a known calendar
    day0 = dt.date(2030, 1, 1)
    created = [r[0] for r in conn.execute("select pgstream.create_partitions(2, %s)", [day0])]
    assert created == ["events_20300101", "events_20300102", "events_20300103"]
    assert conn.execute("select pgstream.create_partitions(2, %s)", [day0]).fetchall() == []
    for day in ["2030-01-01 12:00", "2030-01-02 23:59:59", "2030-01-03 00:00"]:
        backdated(conn, "insert into pgstream.events (payload, stream_id, created_at) "
                        "values ('{}', 1, %s::timestamptz)", [day + "+00"])
    assert conn.execute("select tableoid::regclass::text, count(*) from pgstream.events group by 1 order by 1"
                        ).fetchall() == [("pgstream.events_20300101", 1), ("pgstream.events_20300102", 1),
                                         ("pgstream.events_20300103", 1)]
    # ten days later: housekeeping drops the expired days and creates the new ones
    day10 = day0 + dt.timedelta(days=10)
    conn.execute("select pgstream.create_partitions(1, %s)", [day10])
    # simulated calendar: stream 1's sensor has read its slot only up to day 0...
    conn.execute("update pgstream.streams set consumed_through = %s", [dt.datetime(2030, 1, 1, tzinfo=dt.UTC)])
    assert conn.execute("select pgstream.drop_partitions(7, %s)", [day10]).fetchall() == []  # may be unread
    with pytest.raises(psycopg.errors.RaiseException, match="hold undelivered events; nothing dropped"):
        conn.execute("select pgstream.drop_partitions(7, %s, 'fail')", [day10])
    # the sensor read its slot up to day 10: the expired days go
    conn.execute("update pgstream.streams set consumed_through = %s", [dt.datetime(2030, 1, 11, tzinfo=dt.UTC)])
    dropped = [r[0] for r in conn.execute("select pgstream.drop_partitions(7, %s)", [day10])]
    assert dropped == ["events_20300101", "events_20300102", "events_20300103"]
    assert _partitions(conn) == ["events_20300111", "events_20300112"]
    assert conn.execute("select count(*) from pgstream.events").fetchone() == (0,)


def test_insert_never_fails_for_a_missing_partition(users: psycopg.Connection) -> None:
    subscribe(users, "a")
    for name in _partitions(users):
        users.execute(sql.SQL("drop table pgstream.{}").format(sql.Identifier(name)))
    users.execute("insert into users (email) values ('a')")  # lands in the default partition
    assert users.execute("select tableoid::regclass::text from pgstream.events").fetchall() == [
        ("pgstream.events_default",)]
    # the day that has rows parked in default is not partitioned (moving them would replay them)
    today = users.execute("select pgstream.utc_today()").fetchall()[0][0]
    created = [r[0] for r in users.execute("select pgstream.create_partitions(1)")]
    assert created == [f"events_{today + dt.timedelta(days=1):%Y%m%d}"]
    # expired rows in the default partition are deleted by drop_partitions once a batch delivered
    # them (here simulated), not before: read past by the sensor is not enough
    users.execute("update pgstream.streams set consumed_through = %s",
                  [dt.datetime.combine(today + dt.timedelta(days=8), dt.time(), dt.UTC)])
    users.execute("select pgstream.drop_partitions(7, %s)", [today + dt.timedelta(days=8)])
    assert users.execute("select count(*) from pgstream.events").fetchone() == (1,)
    users.execute("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
                  "min_created_at, max_created_at, status, delivered_at) "
                  "select stream_id, array[id], 1, id, id, created_at, created_at, %s, now() "
                  "from pgstream.events", [BatchStatus.DELIVERED])
    users.execute("select pgstream.drop_partitions(7, %s)", [today + dt.timedelta(days=8)])
    assert users.execute("select count(*) from pgstream.events").fetchone() == (0,)


def test_partition_functions_reject_bad_arguments(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error, match="p_days_ahead must be >= 0"):
        conn.execute("select pgstream.create_partitions(-1)")
    with pytest.raises(psycopg.Error, match="p_retention_days must be >= 1"):
        conn.execute("select pgstream.drop_partitions(0)")
    with pytest.raises(psycopg.Error, match=r"^pgstream.create_partitions: p_lock_timeout_ms must be >= 1, got 0\n"):
        conn.execute("select pgstream.create_partitions(1, p_lock_timeout_ms => 0)")
    with pytest.raises(psycopg.Error, match=r"^pgstream.drop_partitions: p_lock_attempts must be >= 1, got 0\n"):
        conn.execute("select pgstream.drop_partitions(7, p_lock_attempts => 0)")


# --------------------------------------------------------------------------------------------
# privileges


def test_application_role_cannot_escalate(users: psycopg.Connection, db_url: str) -> None:
    subscribe(users, "a", when="new.age > 0")
    users.execute("do $$ begin create role pgstream_test_app login; exception when duplicate_object then null; end $$")
    users.execute("grant usage on schema public to pgstream_test_app")
    users.execute("grant insert, select on public.users to pgstream_test_app")
    users.execute("grant usage on sequence public.users_id_seq to pgstream_test_app")
    app_url = db_url.replace("postgres@", "pgstream_test_app@")
    with psycopg.connect(app_url, autocommit=True) as app:
        app.execute("insert into public.users (email, age) values ('from app', 3)")
        for stmt in [
            "insert into pgstream.subscriptions (key, stream_id, operation, table_name) "
            "values ('x', 1, 'INSERT', 'users')",
            "select * from pgstream.events",
            "insert into pgstream.events (payload, stream_id) values ('{}', 1)",
            "select pgstream.regenerate_trigger('public', 'users', 'INSERT')",
            "select pgstream.set_subscriptions(1, '{}')",
            "create function pgstream.evil() returns int language sql as 'select 1'",
        ]:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute(stmt)
    assert [p["new"]["email"] for _, _, p, _ in events(users)] == ["from app"]


# --------------------------------------------------------------------------------------------
# tear-down


def test_tear_down_removes_everything_and_says_what(users: psycopg.Connection, db_url: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    subscribe(users, "a")
    users.execute("select pg_create_logical_replication_slot('pgstream_stream_1', 'pgoutput')")
    assert cli_main(["tear-down", "--database-url", db_url]) == 2  # needs --yes
    assert cli_main(["tear-down", "--yes", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    for item in ["event trigger pgstream_drift_guard_drop", "trigger pgstream_insert on public.users",
                 "publication pgstream_stream_1", "schema pgstream", "replication slot pgstream_stream_1"]:
        assert f"removed {item}" in out
    assert users.execute("select to_regnamespace('pgstream')").fetchone() == (None,)
    assert users.execute("select count(*) from pg_trigger where tgrelid = 'public.users'::regclass").fetchone() == (0,)
    users.execute("insert into users (email) values ('plain table again')")
    assert tear_down(db_url) == []
    # and it can be installed again
    migrate(db_url)
    assert json.dumps(users.execute("select count(*) from pgstream.subscriptions").fetchone()) == "[0]"


def test_pgstreams_own_locks_are_held_by_a_live_session(db_url: str) -> None:
    """pgstream.locks (sql/repeatable/00_locks.sql): a lock is held by the session that took it, again
    and again, until it lets go or ends (however it ends); a row naming a live pid with another
    backend_start (a reused pid) holds nothing; only the holder can let go; a transaction lock waits."""
    a = psycopg.connect(db_url, autocommit=True)
    b = psycopg.connect(db_url, autocommit=True)
    try:
        assert locks.try_lock(a, "test", 7, "a") and locks.try_lock(a, "test", 7, "a")
        assert not locks.try_lock(b, "test", 7, "b")
        assert locks.lock_holder(b, "test", 7) == "a" and locks.lock_holder(b, "test", 8) is None
        locks.unlock(b, "test", 7)  # not b's: nothing happens
        assert locks.lock_holder(b, "test", 7) == "a"
        pid = a.info.backend_pid
        a.close()
        # the session ends once its backend has left (a moment after the client closed it)
        for _ in range(200):
            if b.execute("select count(*) from pg_stat_activity where pid = %s", [pid]).fetchone() == (0,):
                break
            time.sleep(0.05)
        assert locks.lock_holder(b, "test", 7) is None
        assert locks.try_lock(b, "test", 7)
        assert locks.lock_holder(b, "test", 7) == ""
        locks.unlock(b, "test", 7)
        assert locks.lock_holder(b, "test", 7) is None
        # a pid that was reused: alive, but not the backend that took the lock
        row = b.execute("select backend_start, usesysid from pg_stat_activity where pid = pg_backend_pid()").fetchone()
        assert row is not None
        started, role = row
        b.execute("update pgstream.locks set pid = pg_backend_pid(), backend_start = %s - interval '1 day', "
                  "usesysid = %s, holder = 'old' where name = 'test' and key = 7", [started, role])
        assert locks.lock_holder(b, "test", 7) is None
        # ... and alive, started then, but of another role
        b.execute("update pgstream.locks set backend_start = %s, usesysid = 1 where name = 'test' and key = 7",
                  [started])
        assert locks.lock_holder(b, "test", 7) is None
        b.execute("update pgstream.locks set usesysid = %s where name = 'test' and key = 7", [role])
        assert locks.lock_holder(b, "test", 7) == "old"  # (the row as this session would have written it)
        b.execute("update pgstream.locks set pid = null, backend_start = null, usesysid = null "
                  "where name = 'test' and key = 7")
        c = psycopg.connect(db_url, autocommit=True)
        try:
            assert locks.try_lock(c, "test", 7, "c")
        finally:
            c.close()
        with pytest.raises(ValueError, match="autocommit"):
            with psycopg.connect(db_url) as tx:
                locks.try_lock(tx, "test", 7)
        # a transaction lock: the second transaction waits for the first to end
        a = psycopg.connect(db_url, autocommit=True)
        with a.transaction():
            a.execute("select pgstream.lock_for_transaction('test-tx')")
            b.execute("set lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable), b.transaction():
                b.execute("select pgstream.lock_for_transaction('test-tx')")
        with b.transaction():
            b.execute("select pgstream.lock_for_transaction('test-tx')")
    finally:
        a.close()
        b.close()
