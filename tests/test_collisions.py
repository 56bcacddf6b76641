"""Operator slips and configuration collisions (issue 12): slot names shared by two streams, a
tear-down that would drop the user's own objects or leave a slot behind, concurrent partition
maintenance. Against a real Postgres."""

from __future__ import annotations

import datetime as dt
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.config import DEFAULT_READER, load_config
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine import replication
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.ingest import consume_group
from pgstream_dagster.engine.ledger import streams
from pgstream_dagster.engine.migrations import MigrationError, TearDownRefused, migrate, tear_down

from .support.harness import event_ids, insert_events, slot_of, write_config
from .support.legacy_streams import SlotInUse, ensure_stream
from .support.releases import released_sql

MEMORY = {"type": "memory"}


def _streams_and_slots(url: str) -> dict[str, Any]:
    """Everything a stream is made of: rows, slots and their positions, publications, ledger."""
    with psycopg.connect(url) as c:
        return {
            "streams": c.execute("select id, slot, recovery_pending from pgstream.streams order by 1").fetchall(),
            "slots": c.execute("select slot_name, confirmed_flush_lsn::text, restart_lsn::text from "
                               "pg_replication_slots where database = current_database() order by 1").fetchall(),
            "publications": c.execute("select pubname from pg_publication order by 1").fetchall(),
            "batches": c.execute("select stream_id, event_ids from pgstream.batches order by id").fetchall(),
        }


# --------------------------------------------------------------------------------------------
# one slot, one stream


def test_a_stream_cannot_be_pointed_at_another_streams_slot_and_changes_nothing(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v1 = write_config(tmp_path / "v1.yaml", db_url, [{"id": 1, "sink": MEMORY}, {"id": 2, "sink": MEMORY}])
    init(v1)
    insert_events(db_url, 1, 3)
    insert_events(db_url, 2, 2)
    before = _streams_and_slots(db_url)
    with psycopg.connect(db_url) as c:
        slot1, slot2 = (streams.stream_slot(c, i) for i in (1, 2))
    assert [r[:2] for r in before["streams"]] == [(1, slot1), (2, slot2)]
    # pgstream.yaml changed: stream 2 names stream 1's slot (what earlier versions read): refused at load, in
    # one line, before anything is changed
    v2 = write_config(tmp_path / "v2.yaml", db_url, [{"id": 3, "sink": MEMORY},
                                                     {"id": 2, "sink": MEMORY, "slot_name": slot1}])
    assert cli_main(["init", "--config", str(v2)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "streams[1]: Value error, streams[].slot_name is no longer read" in err[0], err
    assert _streams_and_slots(db_url) == before

    # stream 2 is a member of its reader group (the default group): the group's reads for it never read stream
    # 1's slot, and its registration changes nothing of stream 1
    stream2 = load_config(v1).stream(2)
    with psycopg.connect(db_url, autocommit=True) as conn:
        read = consume_group(conn, stream2.reader, [stream2], 0.1)
        assert read.slot != slot1 and read.left_out == {}
        # and the database refuses it whoever writes
        with pytest.raises(psycopg.errors.UniqueViolation, match="streams_slot_key"):
            conn.execute("update pgstream.streams set slot_name = %s where id = 2", [slot1])
    after = _streams_and_slots(db_url)
    # the same rows, slots and publications; each stream's events recorded in its own ledger only
    assert [after[k] for k in ("streams", "publications")] == [before[k] for k in ("streams", "publications")]
    assert [s[0] for s in after["slots"]] == [s[0] for s in before["slots"]]
    assert after["batches"] == [(1, event_ids(db_url, 1)), (2, event_ids(db_url, 2))]


def _dbname(url: str) -> str:
    return url.rsplit("/", 1)[1]


def test_two_databases_of_one_cluster_each_run_their_stream_77(
        db_url: str, empty_db_url: str, tmp_path: Path) -> None:
    """Slots are the cluster's. A tenant of database B that may create slots (REPLICATION) takes the
    name stream 77's slot had before every stream read its reader group's, from a fresh connection, before A
    installs: A's and B's stream 77 (group default) both create and read their group's own slot. Each
    database's orphaned_slots lists its own slots only."""
    a, b = db_url, empty_db_url
    migrate(b)
    tenant = f"tenant_{_dbname(b)}"
    with psycopg.connect(b, autocommit=True) as c:
        c.execute(f"create role {tenant} login replication")
    try:
        with psycopg.connect(b, user=tenant, autocommit=True) as t:  # the attack: a name known in advance
            t.execute("select pg_create_logical_replication_slot('pgstream_stream_77', 'pgoutput')")
        slots: dict[str, str] = {}
        for url in (a, b):
            cfg = write_config(tmp_path / f"{_dbname(url)}.yaml", url, [{"id": 77, "sink": MEMORY}])
            out = init(cfg)
            slots[url] = slot_of(url, 77)
            assert f"created slot {slots[url]} for reader group {DEFAULT_READER} (streams 77)" in out
            insert_events(url, 77, 3)
            with psycopg.connect(url, autocommit=True) as c:
                # (the first pass joins stream 77: what it has in the table is recovered from there)
                result = consume_group(c, DEFAULT_READER, list(load_config(cfg).streams), 1.0)
                assert (result.slot, result.slot_created) == (slots[url], False)
                recorded = [i for (ids,) in c.execute("select event_ids from pgstream.batches where stream_id = 77")
                            for i in ids]
                assert sorted(recorded) == event_ids(url, 77) and len(recorded) == 3  # each once
                assert c.execute("select database from pg_replication_slots where slot_name = %s",
                                 [slots[url]]).fetchone() == (_dbname(url),)
        assert len(set(slots.values()) | {"pgstream_stream_77"}) == 3
        # the tenant's slot is B's orphan, not A's
        with psycopg.connect(b, autocommit=True) as c:
            assert {r[0] for r in c.execute("select slot_name from pgstream.orphaned_slots")} == {"pgstream_stream_77"}
        with psycopg.connect(a, autocommit=True) as c:
            assert c.execute("select slot_name from pgstream.orphaned_slots").fetchall() == []
    finally:
        with psycopg.connect(b, autocommit=True) as c:
            c.execute("select pg_drop_replication_slot('pgstream_stream_77')")
            c.execute(f"drop role {tenant}")


def test_an_install_of_release_0_1_joins_the_default_group_and_loses_or_repeats_no_event(
        empty_db_url: str, tmp_path: Path) -> None:
    """An install of release 0.1: stream 1 reads slot pgstream_stream_1 (three committed events wait in
    it), stream 2's slot was never created. After the upgrade both streams (their entries name no group)
    join the default group: stream 1's own slot is drained and dropped, each event is recorded once, and the
    database has the group's one slot."""
    migrate(empty_db_url, directory=released_sql(tmp_path / "sql", upto=14))
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id) values (1), (2)")
        c.execute("select pg_create_logical_replication_slot('pgstream_stream_1', 'pgoutput')")
    insert_events(empty_db_url, 1, 3)
    migrate(empty_db_url)
    cfg = write_config(tmp_path / "pgstream.yaml", empty_db_url, [{"id": 1, "sink": MEMORY}, {"id": 2, "sink": MEMORY}])
    members = list(load_config(cfg).streams)
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        assert streams.stream_slot(c, 1) == "pgstream_stream_1"  # what 0.1 read
        insert_events(empty_db_url, 1, 2, start=10)  # written after the upgrade, before the join
        deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
        while True:  # the group's sensor's ticks
            assert dt.datetime.now(dt.UTC) < deadline, "stream 1 did not join"
            consume_group(c, DEFAULT_READER, members, 0.2)
            joined = c.execute("select count(*) from pgstream.streams where slot_reader = %s",
                               [f"group:{DEFAULT_READER}"]).fetchone()
            slots = [r[0] for r in c.execute("select slot_name from pg_replication_slots where database = "
                                             "current_database()")]
            if joined == (2,) and "pgstream_stream_1" not in slots:
                break
        recorded = [i for (ids,) in c.execute("select event_ids from pgstream.batches where stream_id = 1")
                    for i in ids]
        assert sorted(recorded) == event_ids(empty_db_url, 1) and len(recorded) == 5  # each once
        (group_slot,) = c.execute("select slot from pgstream.reader_groups where name = %s",
                                  [DEFAULT_READER]).fetchone()  # type: ignore[misc]
        assert slots == [group_slot]  # one slot for the database's streams


def test_a_copied_database_reads_slots_of_its_own(db_url: str, pg: LocalPostgres) -> None:
    """A database copied with CREATE DATABASE ... TEMPLATE (as pg_dump and a restore would) carries the
    stream rows with the original's default slot names. The copy has another oid: it derives its own
    names the first time it looks, and creates its slots next to the original's."""
    with psycopg.connect(db_url, autocommit=True) as c:
        original = ensure_stream(c, 5)
    copy = f"{_dbname(db_url)}_copy"
    with psycopg.connect(pg.url, autocommit=True) as c:
        c.execute(f"create database {copy} template {_dbname(db_url)}")
    try:
        with psycopg.connect(pg.url_for(copy), autocommit=True) as c:
            assert c.execute("select slot from pgstream.streams where id = 5").fetchone() == (original,)
            mine = ensure_stream(c, 5)
            assert mine != original and mine.startswith("pgstream_stream_5_d")
            assert c.execute("select slot from pgstream.streams where id = 5").fetchone() == (mine,)
            replication.create_slot(c, mine)
            c.execute("select pg_drop_replication_slot(%s)", [mine])
        with psycopg.connect(db_url, autocommit=True) as c:
            assert streams.stream_slot(c, 5) == original
            replication.create_slot(c, original)
    finally:
        with psycopg.connect(pg.url, autocommit=True) as c:
            c.execute(f"drop database if exists {copy} with (force)")


def test_a_new_stream_whose_default_slot_is_taken_is_refused(conn: psycopg.Connection) -> None:
    conn.execute("create table public.users (id serial primary key, email text)")
    slot2 = streams.stream_slot(conn, 2)  # what stream 2 would read, before it exists
    ensure_stream(conn, 1, slot2)  # stream 1 reads a slot named like stream 2's default
    with pytest.raises(psycopg.errors.UniqueViolation, match=f"stream 2: slot {slot2} is already used by stream 1"):
        conn.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                     "values ('a', 2, 'INSERT', 'users', '{id}')")
    with pytest.raises(SlotInUse, match=f"stream 2: slot {slot2} is already used by stream 1"):
        ensure_stream(conn, 2)
    assert conn.execute("select id from pgstream.streams").fetchall() == [(1,)]
    assert conn.execute("select count(*) from pgstream.subscriptions").fetchone() == (0,)
    # a stream created with its own slot name is fine, and so is the largest stream id
    ensure_stream(conn, 2, "users_slot")
    ensure_stream(conn, 2**63 - 1, None)
    assert conn.execute("select id, coalesce(slot_name, '-') from pgstream.streams order by 1").fetchall() == [
        (1, slot2), (2, "users_slot"), (2**63 - 1, "-")]
    assert len(streams.stream_slot(conn, 2**63 - 1)) <= 63  # a slot name's limit
    assert conn.execute("select count(*) from pg_publication where pubname = %s",
                        [f"pgstream_stream_{2**63 - 1}"]).fetchone() == (1,)


def test_migration_refuses_an_install_where_streams_share_a_slot(empty_db_url: str, tmp_path: Path) -> None:
    migrate(empty_db_url, directory=released_sql(tmp_path / "sql", upto=12))
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id, slot_name) values (1, null), (2, 'pgstream_stream_1'), "
                  "(3, 'x'), (4, 'x'), (5, null)")
    with pytest.raises(MigrationError) as err:
        migrate(empty_db_url)
    message = str(err.value)
    assert "013_collisions.sql failed" in message
    assert ("streams share a replication slot (slot pgstream_stream_1 is used by streams 1, 2; "
            "slot x is used by streams 3, 4)") in message
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        assert c.execute("select max(version) from pgstream.schema_migrations").fetchone() == (12,)
        assert c.execute("select to_regclass('pgstream.streams_slot_key')").fetchone() == (None,)
        # the operator fixes it; the migration goes on
        c.execute("delete from pgstream.streams where id = 2")
        c.execute("update pgstream.streams set slot_name = 'y' where id = 4")
    assert "013_collisions.sql" in migrate(empty_db_url)

# --------------------------------------------------------------------------------------------
# partition maintenance is serialised


def _concurrently(db_url: str, calls: Sequence[tuple[str, Sequence[object]]]) -> list[list[str] | BaseException]:
    """Run each (query, params) on its own connection, all released at once by a barrier."""
    barrier = threading.Barrier(len(calls))
    results: list[list[str] | BaseException] = [[] for _ in calls]

    def work(i: int, query: str, params: list[object]) -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                barrier.wait()
                results[i] = [r[0] for r in c.execute(query, params).fetchall()]
        except BaseException as exc:  # reported by the test
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i, q, p)) for i, (q, p) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_create_partitions_never_deadlock(db_url: str) -> None:
    base = dt.date(2040, 1, 1)
    for rep in range(8):
        start = base + dt.timedelta(days=40 * rep)
        # four callers, overlapping ranges: start .. start+9, start+2 .. start+11, ...
        calls = [("select * from pgstream.create_partitions(%s, %s)", [9, start + dt.timedelta(days=2 * i)])
                 for i in range(4)]
        results = _concurrently(db_url, calls)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        created = Counter(name for r in results for name in r)  # type: ignore[union-attr]
        expected = {f"events_{start + dt.timedelta(days=d):%Y%m%d}" for d in range(16)}
        assert set(created) == expected
        assert all(n == 1 for n in created.values()), created


def test_concurrent_drop_and_create_partitions_drop_each_partition_once(db_url: str) -> None:
    old = dt.date(2001, 1, 1)
    for rep in range(4):
        start = old + dt.timedelta(days=100 * rep)
        with psycopg.connect(db_url, autocommit=True) as c:
            made = [r[0] for r in c.execute("select * from pgstream.create_partitions(9, %s)", [start])]
        assert len(made) == 10
        today = start + dt.timedelta(days=30)  # retention 1: all ten expired
        ahead = dt.date(2060, 1, 1) + dt.timedelta(days=100 * rep)  # never expires here
        calls = [("select * from pgstream.drop_partitions(1, %s)", [today]) for _ in range(2)]
        calls += [("select * from pgstream.create_partitions(4, %s)", [ahead + dt.timedelta(days=i)]) for i in range(2)]
        results = _concurrently(db_url, calls)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        dropped = Counter(name for r in results[:2] for name in r)  # type: ignore[union-attr]
        assert dropped == Counter(made)  # each dropped exactly once
        created = Counter(name for r in results[2:] for name in r)  # type: ignore[union-attr]
        assert created == Counter(f"events_{ahead + dt.timedelta(days=d):%Y%m%d}" for d in range(6))


# --------------------------------------------------------------------------------------------
# tear-down: every slot pgstream made, and none of the user's objects without --cascade

USER_OBJECTS = [
    "function public.op_label(pgstream.operation_type)",
    "table column public.audit.op",
    "view public.recent_events",
    "view public.recent_ids",
]


def _install_with_user_objects(conn: psycopg.Connection) -> None:
    conn.execute("create table public.users (id serial primary key, email text)")
    conn.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                 "values ('a', 1, 'INSERT', 'users', '{id}')")  # a generated trigger: pgstream's own
    ensure_stream(conn, 1, "orders_cdc")  # a custom slot name
    ensure_stream(conn, 2, None)
    for slot in ("orders_cdc", "pgstream_stream_2", "pgstream_peer"):  # pgstream_peer: not ours
        conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [slot])
    conn.execute("insert into public.users (email) values ('a')")
    # the user's objects that depend on pgstream
    conn.execute("create table public.audit (id int primary key, op pgstream.operation_type)")
    conn.execute("insert into public.audit values (1, 'INSERT')")
    conn.execute("create view public.recent_events as select id, payload from pgstream.events")
    conn.execute("create view public.recent_ids as select id from public.recent_events")
    conn.execute("create function public.op_label(o pgstream.operation_type) returns text "
                 "language sql as $$ select o::text $$")


def _everything(conn: psycopg.Connection) -> dict[str, Any]:
    return {
        "schema": conn.execute("select to_regnamespace('pgstream') is not null").fetchone(),
        "slots": conn.execute("select slot_name from pg_replication_slots where database = current_database() "
                              "order by 1").fetchall(),
        "publications": conn.execute("select pubname from pg_publication order by 1").fetchall(),
        "triggers": conn.execute("select tgname, tgrelid::regclass::text from pg_trigger where not tgisinternal "
                                 "and tgrelid::regclass::text not like 'pgstream.%' order by 1, 2").fetchall(),
        "event_triggers": conn.execute("select evtname from pg_event_trigger order by 1").fetchall(),
        "public": conn.execute("select relname, relkind from pg_class where relnamespace = 'public'::regnamespace "
                               "order by 1").fetchall(),
        "functions": conn.execute("select oid::regprocedure::text from pg_proc "
                                  "where pronamespace = 'public'::regnamespace").fetchall(),
        "audit": conn.execute("select * from public.audit").fetchall(),
    }


def test_tear_down_refuses_to_drop_user_objects_and_changes_nothing(conn: psycopg.Connection, db_url: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _install_with_user_objects(conn)
    before = _everything(conn)
    assert before["slots"] == [("orders_cdc",), ("pgstream_peer",), ("pgstream_stream_2",)]
    with pytest.raises(TearDownRefused) as err:
        tear_down(db_url)
    assert err.value.objects == USER_OBJECTS
    assert "--cascade" in str(err.value)
    assert _everything(conn) == before

    assert cli_main(["tear-down", "--yes", "--database-url", db_url]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("error: tear-down would also drop these objects outside schema pgstream")
    assert lines[1:-1] == USER_OBJECTS  # one per line
    assert "--cascade" in lines[-1]
    assert _everything(conn) == before  # schema, slots, publications, triggers all still there
    conn.execute("insert into public.users (email) values ('b')")
    assert conn.execute("select count(*) from pgstream.events").fetchone() == (2,)


def test_tear_down_cascade_drops_and_lists_them_and_every_slot_of_a_stream(conn: psycopg.Connection, db_url: str,
                                                                            capsys: pytest.CaptureFixture[str]
                                                                            ) -> None:
    _install_with_user_objects(conn)
    assert cli_main(["tear-down", "--yes", "--cascade", "--database-url", db_url]) == 0
    out = capsys.readouterr().out.splitlines()
    for obj in USER_OBJECTS:
        assert f"removed {obj} (it depended on schema pgstream)" in out
    for item in ["trigger pgstream_insert on public.users", "publication pgstream_stream_1",
                 "publication pgstream_stream_2", "replication slot orders_cdc", "replication slot pgstream_stream_2",
                 "event trigger pgstream_drift_guard_drop", "schema pgstream (events, streams, subscriptions, "
                 "functions)"]:
        assert f"removed {item}" in out, out
    after = _everything(conn)
    assert after["schema"] == (False,)
    assert after["slots"] == [("pgstream_peer",)]  # a slot pgstream did not make stays
    assert after["publications"] == [] and after["triggers"] == [] and after["event_triggers"] == []
    assert after["functions"] == []
    assert after["audit"] == [(1,)]  # the table stays, without its pgstream column
    assert {r[0] for r in after["public"]} == {"users", "users_pkey", "users_id_seq", "audit", "audit_pkey"}
    conn.execute("insert into public.users (email) values ('plain table again')")
    assert tear_down(db_url) == []


def test_tear_down_without_dependents_needs_no_cascade(conn: psycopg.Connection, db_url: str) -> None:
    ensure_stream(conn, 7, "custom_slot")
    conn.execute("select pg_create_logical_replication_slot('custom_slot', 'pgoutput')")
    removed = tear_down(db_url)
    assert "replication slot custom_slot" in removed and "publication pgstream_stream_7" in removed
    assert not any("depended on" in item for item in removed)
    assert conn.execute("select count(*) from pg_replication_slots where database = current_database()"
                        ).fetchone() == (0,)
