"""The streaming core against a real slot, real Dagster instance storage and real runs on Spark."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pgstream_dagster import replication
from pgstream_dagster.devdb import LocalPostgres

from .harness import Driver, write_config


@pytest.fixture(scope="session")
def dagster_storage_url(pg: LocalPostgres) -> str:
    pg.create_database("dagster_storage")
    # SQLAlchemy 2.1 defaults to psycopg 3 for postgresql://; Dagster's storage wants psycopg2
    return pg.url_for("dagster_storage").replace("postgresql://", "postgresql+psycopg2://")


@pytest.fixture
def instance(dagster_storage_url: str, tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(overrides={"storage": {"postgres": {"postgres_url": dagster_storage_url}}},
                              temp_dir=str(tmp_path / "dagster_home")) as inst:
        yield inst


def insert_events(url: str, stream_id: int, n: int, start: int = 0) -> None:
    with psycopg.connect(url) as conn:
        conn.execute("insert into pgstream.events (payload, stream_id) "
                     "select jsonb_build_object('n', g), %s from generate_series(%s::int, %s::int) g",
                     [stream_id, start, start + n - 1])


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_decoder_returns_transactions_in_commit_order(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
        replication.create_slot(c, "pgstream_stream_1")
    first = psycopg.connect(db_url)
    second = psycopg.connect(db_url)
    first.execute("insert into pgstream.events (payload, stream_id) values ('{\"who\": \"first\"}', 1)")
    second.execute("insert into pgstream.events (payload, stream_id) values ('{\"who\": \"second\"}', 1)")
    second.commit()  # the higher id commits first
    first.commit()
    first.close()
    second.close()
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into pgstream.events (payload, stream_id) values ('{}', 2)")  # other stream: filtered
        txns = replication.peek(c, "pgstream_stream_1", "pgstream_stream_1", 100)
        ids = [e.id for t in txns for e in t.events]
        assert ids == [2, 1]
        assert txns[0].commit_lsn < txns[1].commit_lsn
        replication.advance(c, "pgstream_stream_1", txns[-1].end_lsn)
        assert [t for t in replication.peek(c, "pgstream_stream_1", "pgstream_stream_1", 100) if t.events] == []


def test_tick_records_batches_and_rerun_requests_nothing_twice(db_url: str, tmp_path: Path,
                                                               instance: dg.DagsterInstance) -> None:
    out = tmp_path / "sink.jsonl"
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 10, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 1}, "sink": {"type": "file", "path": str(out)}}])
    driver = Driver(cfg, instance)
    first = driver.tick(1)  # creates the slot
    assert not first.run_requests
    insert_events(db_url, 1, 25)
    tick = driver.tick(1)
    with psycopg.connect(db_url) as c:
        (inc,) = c.execute("select incarnation from pgstream.streams where id = 1").fetchone()
    assert [r.run_key for r in tick.run_requests] == [f"pgstream-s1-{inc}-b1-a1"]
    with psycopg.connect(db_url) as c:
        rows = c.execute("select id, event_count, status from pgstream.batches order by id").fetchall()
        assert rows == [(1, 10, "launched"), (2, 10, "pending"), (3, 5, "pending")]
        # WAL released at once: nothing left in the slot
        assert [t for t in replication.peek(c, "pgstream_stream_1", "pgstream_stream_1", 100) if t.events] == []
    # re-evaluating (the same cursor, as after a crash of the tick) asks for the same run key only
    again = driver.tick(1)
    assert [r.run_key for r in again.run_requests] == [f"pgstream-s1-{inc}-b1-a1"]
    driver.execute(tick.run_requests[0])
    again2 = driver.tick(1)
    assert [r.run_key for r in again2.run_requests] == [f"pgstream-s1-{inc}-b2-a1"]
    cursor = json.loads(driver.cursors[1] or "{}")
    assert cursor["last_event_id"] == 25
    assert len(read_jsonl(out)) == 10
