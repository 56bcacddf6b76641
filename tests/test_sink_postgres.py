"""The Postgres table sink against the tests' Postgres: a target database of its own per test, roles
with and without privileges, a password-checked role, and a real pipeline through an outage."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql
from pydantic import SecretStr, ValidationError

from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.sinks import Event, PostgresSinkConfig, SinkError, build_sink
from pgstream_dagster.sinks.base import redact_url

from .support.faults import STREAM, drive, fail_into_failover, in_failover, sent_ids, stream_config
from .support.harness import Driver, insert_events, write_config
from .support.sinks import BASE_TIME, free_port, make_events, unique

SINKS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "sinks.md"


@pytest.fixture
def target(pg: LocalPostgres) -> Iterator[str]:
    """The URL of an empty database of its own (the sink's target, not a pgstream database)."""
    name = unique("sinktarget").replace("-", "_")
    pg.create_database(name)
    yield pg.url_for(name)
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def rows(url: str, table: str = "public.events") -> list[dict[str, Any]]:
    """The table's rows in id order (none while the sink has not created it yet)."""
    with psycopg.connect(url) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        schema, name = table.split(".")
        if cur.execute("select pg_catalog.to_regclass(%s)", [f'"{schema}"."{name}"']).fetchone() == {
                "to_regclass": None}:
            return []
        return cur.execute(sql.SQL("select * from {} order by id").format(sql.Identifier(schema, name))).fetchall()


def readme_ddl() -> str:
    """The ``create table`` statement the documentation gives for the postgres sink (docs/sinks.md)."""
    text = SINKS_PAGE.read_text()
    found = re.search(r"```sql\n(create table [^`]*?pgstream_sink_events[^`]*?)```", text)
    assert found is not None, "docs/sinks.md: the postgres sink's DDL"
    return found.group(1)


def as_row(event: Event) -> tuple[Any, ...]:
    return (event.id, event.stream_id, event.created_at, event.payload, event.metadata)


def test_events_in_equal_rows_out_and_a_replay_writes_each_once(target: str) -> None:
    events = make_events(60)
    config = PostgresSinkConfig(url=SecretStr(target), table="public.events", create_table=True)
    with config.build() as sink:
        sink.publish(events[:25])
        sink.publish(events[25:])
        sink.publish(events[10:40])  # a retried call, a replay: each event stays one row
    found = rows(target)
    assert [(r["id"], r["stream_id"], r["created_at"], r["payload"], r["metadata"]) for r in found] == [
        as_row(e) for e in events]
    assert all(r["received_at"] is not None for r in found)
    with psycopg.connect(target) as conn:  # one transaction per call: one received_at per call
        assert conn.execute("select count(distinct received_at) from public.events").fetchone() == (2,)


def test_insert_keeps_the_first_write_and_upsert_the_last(target: str) -> None:
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute(readme_ddl().replace("myschema.pgstream_sink_events", "public.events"))
    first = make_events(5)
    changed = [Event(id=e.id, stream_id=9, payload={"v": 2}, metadata={"m": 1}, created_at=BASE_TIME) for e in first]
    with build_sink({"type": "postgres", "url": target, "table": "public.events"}) as sink:
        sink.publish(first)
        sink.publish(changed)
    assert [as_row(e) for e in first] == [(r["id"], r["stream_id"], r["created_at"], r["payload"], r["metadata"])
                                          for r in rows(target)]
    with build_sink({"type": "postgres", "url": target, "table": "public.events", "mode": "upsert"}) as sink:
        sink.publish(changed[:3] + changed[:1])  # an event twice in one call: one row, no error
        sink.publish(changed)
    found = rows(target)
    assert [(r["id"], r["stream_id"], r["payload"], r["metadata"]) for r in found] == [
        (e.id, 9, {"v": 2}, {"m": 1}) for e in first]


def test_a_row_the_target_refuses_is_a_permanent_rejection_after_the_rows_before_it(target: str) -> None:
    table = "public.events"
    with build_sink({"type": "postgres", "url": target, "table": table, "create_table": True}) as sink:
        sink.publish([Event(id=1, stream_id=7, payload={"name": "first"}, created_at=BASE_TIME)])
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("alter table public.events add constraint small check (pg_catalog.length(payload::text) < 200)")
        conn.execute("create unique index events_name on public.events ((payload->>'name'))")
    events = make_events(6)
    events[3] = Event(id=104, stream_id=7, payload={"blob": "x" * 300}, created_at=BASE_TIME)
    with build_sink({"type": "postgres", "url": target, "table": table}) as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
        assert err.value.permanent and err.value.event_ids == (104,)
        assert str(err.value) == (f"postgres sink: event 104: table public.events at {redact_url(target)} refused "
                                  'the row: CheckViolation (23514): new row for relation "events" violates check '
                                  'constraint "small"')
        assert [r["id"] for r in rows(target)] == [1, 101, 102, 103]  # the rows before it committed, none after
        sink.publish(events[4:])  # the caller set 104 aside
        assert [r["id"] for r in rows(target)] == [1, 101, 102, 103, 105, 106]

        # two events of one call colliding on a unique index of the target: the later one is rejected
        clash = [Event(id=201 + i, stream_id=7, payload={"name": name}, created_at=BASE_TIME)
                 for i, name in enumerate(["p", "q", "p", "r"])]
        with pytest.raises(SinkError) as err:
            sink.publish(clash)
        assert err.value.permanent and err.value.event_ids == (203,)
        assert "UniqueViolation (23505)" in str(err.value) and '"events_name"' in str(err.value)
        assert "Key (" not in str(err.value)  # no DETAIL: it would quote the row
        assert [r["id"] for r in rows(target)][-2:] == [201, 202]


def test_a_deferred_constraint_failing_at_commit_blames_no_event(target: str) -> None:
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute(readme_ddl().replace("myschema.pgstream_sink_events", "public.events"))
        conn.execute("create table public.parents (name text primary key)")
        conn.execute("alter table public.events add column name text generated always as (payload->>'name') stored")
        conn.execute("alter table public.events add constraint parent foreign key (name) references public.parents "
                     "deferrable initially deferred")
    with build_sink({"type": "postgres", "url": target, "table": "public.events"}) as sink, \
            pytest.raises(SinkError) as err:
        sink.publish(make_events(3))
    assert not err.value.permanent and err.value.event_ids == (101, 102, 103)
    assert "ForeignKeyViolation (23503)" in str(err.value) and rows(target) == []


def test_errors_about_the_target_are_not_permanent(target: str, pg: LocalPostgres) -> None:
    events = make_events(3)
    with build_sink({"type": "postgres", "url": target, "table": "public.missing"}) as sink, \
            pytest.raises(SinkError) as err:
        sink.publish(events)
    assert not err.value.permanent and err.value.event_ids == (101, 102, 103)
    assert 'UndefinedTable (42P01): relation "public.missing" does not exist' in str(err.value)
    assert "set create_table: true" in str(err.value)

    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("create table public.no_key (id bigint, stream_id bigint, created_at timestamptz, "
                     "payload jsonb, metadata jsonb)")
        conn.execute("create table public.events (like public.no_key, primary key (id))")
        conn.execute("create role pgstream_sink_reader login")
        conn.execute("grant usage on schema public to pgstream_sink_reader")
        conn.execute("grant select on public.events to pgstream_sink_reader")
    try:
        with build_sink({"type": "postgres", "url": target, "table": "public.no_key"}) as sink, \
                pytest.raises(SinkError) as err:
            sink.publish(events)
        assert not err.value.permanent and "needs a primary key or unique index on id" in str(err.value)

        reader = target.replace("postgres@", "pgstream_sink_reader@")
        with build_sink({"type": "postgres", "url": reader, "table": "public.events"}) as sink, \
                pytest.raises(SinkError) as err:
            sink.publish(events)
        assert not err.value.permanent and "InsufficientPrivilege (42501)" in str(err.value)
        with build_sink({"type": "postgres", "url": reader, "table": "public.other",
                         "create_table": True}) as sink, pytest.raises(SinkError) as err:
            sink.publish(events)
        assert not err.value.permanent and "InsufficientPrivilege (42501)" in str(err.value)
        assert rows(target) == []
    finally:
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute("drop owned by pgstream_sink_reader")
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("drop role pgstream_sink_reader")


def test_an_unreachable_server_is_a_clear_error_without_the_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()
    config = PostgresSinkConfig(url=SecretStr(f"postgresql://app:pg-unreach-pw@127.0.0.1:{port}/target"),
                                table="public.events", timeout_secs=2)
    assert "pg-unreach-pw" not in repr(config)
    started = time.monotonic()
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(2))
    assert time.monotonic() - started < 10
    assert str(err.value).startswith(f"postgres sink: events 101..102 (2 events): cannot connect to table "
                                     f"public.events at postgresql://127.0.0.1:{port}/target: ")
    assert "Connection refused" in str(err.value) and err.value.sink == "postgres" and not err.value.permanent
    for text in (str(err.value), repr(err.value), caplog.text):
        assert "pg-unreach-pw" not in text


@pytest.fixture
def password_role(pg: LocalPostgres, target: str) -> Iterator[str]:
    """A role whose password the server checks (scram-sha-256 for it alone; the tests' server trusts
    everyone else): the name of the role, password ``right-pg-pw``."""
    role = "pgstream_sink_pw"
    hba = pg.datadir / "pg_hba.conf"
    original = hba.read_text()
    hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n" + original)
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("select pg_catalog.pg_reload_conf()")
        conn.execute(sql.SQL("create role {} login password 'right-pg-pw'").format(sql.Identifier(role)))
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute(sql.SQL("grant create on schema public to {}").format(sql.Identifier(role)))
    try:
        yield role
    finally:
        hba.write_text(original)
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute(sql.SQL("drop owned by {}").format(sql.Identifier(role)))
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("select pg_catalog.pg_reload_conf()")
            conn.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


def test_a_wrong_password_never_shows(target: str, password_role: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    right = target.replace("postgres@", f"{password_role}:right-pg-pw@")
    with build_sink({"type": "postgres", "url": right, "table": "public.events", "create_table": True}) as sink:
        sink.publish(make_events(2))  # the password is checked, and right
    wrong = target.replace("postgres@", f"{password_role}:wr0ng-pg-pw@")
    with build_sink({"type": "postgres", "url": wrong, "table": "public.events"}) as sink, \
            pytest.raises(SinkError) as err:
        sink.publish(make_events(2, first_id=201))
    assert "password authentication failed" in str(err.value) and not err.value.permanent
    assert f"at {redact_url(target)}: " in str(err.value)
    for text in (str(err.value), repr(err.value), caplog.text):
        assert "wr0ng-pg-pw" not in text and "right-pg-pw" not in text
    assert [r["id"] for r in rows(target)] == [101, 102]


def test_a_connection_the_server_closed_meanwhile_is_replaced(target: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with build_sink({"type": "postgres", "url": target, "table": "public.events", "create_table": True}) as sink:
        sink.publish(make_events(2))
        with psycopg.connect(target, autocommit=True) as conn:
            killed = conn.execute("select pg_catalog.pg_terminate_backend(pid) from pg_catalog.pg_stat_activity "
                                  "where datname = pg_catalog.current_database() and application_name = "
                                  "'pgstream-dagster'").fetchall()
        assert killed == [(True,)]
        sink.publish(make_events(2, first_id=201))  # noticed, reconnected once, written
    assert [r["id"] for r in rows(target)] == [101, 102, 201, 202]
    assert "was closed (AdminShutdown" in caplog.text and "reconnecting" in caplog.text


def test_table_names_are_validated_and_quoted(target: str) -> None:
    for bad in ("events", "public.events; drop table x", 'public."events"', "a.b.c", "public.1abc", "public.",
                "pgstream.events", "pg_catalog.pg_class", "information_schema.x", "PG_temp.x", "public." + "x" * 64):
        with pytest.raises(ValidationError) as err:
            PostgresSinkConfig(url=SecretStr(target), table=bad)
        assert "table" in str(err.value), bad
    with pytest.raises(ValidationError, match="postgresql:// URL"):
        PostgresSinkConfig(url=SecretStr("mysql://u:p@h/db"), table="public.events")
    # a valid name is used as written (quoted): mixed case and $ survive
    with build_sink({"type": "postgres", "url": target, "table": "public.Events$Log", "create_table": True}) as sink:
        sink.publish(make_events(3))
    assert [r["id"] for r in rows(target, "public.Events$Log")] == [101, 102, 103]


def test_the_target_roles_search_path_cannot_redirect_the_sinks_sql(target: str) -> None:
    """Every name the sink uses is qualified and its session's search_path is pg_catalog, pg_temp: a
    schema the target's role puts first in its search_path (hostile functions and operators) is never used."""
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("create schema trap")
        for signature in ("unnest(anyarray)", "now()"):
            conn.execute(f"create function trap.{signature} returns setof int language plpgsql as "
                         "$$ begin raise exception 'trap called'; end $$")
        conn.execute("alter database " + target.rsplit("/", 1)[1] + " set search_path = trap, public")
    with build_sink({"type": "postgres", "url": target, "table": "public.events", "create_table": True,
                     "mode": "upsert"}) as sink:
        sink.publish(make_events(3))
        sink.publish(make_events(3))
    assert [r["id"] for r in rows(target)] == [101, 102, 103]


def test_delivery_runs_to_a_table_survive_an_outage(db_url: str, target: str, tmp_path: Path,
                                                    instance: dg.DagsterInstance) -> None:
    """A real pipeline (sensor ticks, runs on Spark, a real Dagster instance) writing to a table of
    another database that stops accepting connections: the stream enters failover and, once the
    database is back, drains the backlog; each event is one row, nothing lost."""
    dbname = target.rsplit("/", 1)[1]
    sink = {"type": "postgres", "url": target, "table": "public.events", "create_table": True, "timeout_secs": 5}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(sink)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 100)
    drive(driver, lambda: len(rows(target)) >= 100)

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("alter database {} allow_connections false").format(sql.Identifier(dbname)))
        conn.execute("select pg_catalog.pg_terminate_backend(pid) from pg_catalog.pg_stat_activity where datname = %s",
                     [dbname])
    try:
        insert_events(db_url, STREAM, 150, 100)
        error = fail_into_failover(driver, db_url)
        assert "postgres sink" in error and f'database "{dbname}" is not currently accepting connections' in error
    finally:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("alter database {} allow_connections true").format(sql.Identifier(dbname)))

    sent = sent_ids(db_url)
    drive(driver, lambda: len(rows(target)) >= len(sent) and not in_failover(db_url))
    found = rows(target)
    assert [r["id"] for r in found] == sorted(sent) and len(sent) == 250  # each event once, nothing lost
    assert [r["payload"] for r in found] == [{"n": n} for n in range(250)]
