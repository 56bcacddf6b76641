"""Memory is bounded by bytes, not rows: a run delivers events that are large as text (small
stored: ``repeat``) in order while its peak resident memory stays within a bound, measured in a
child process of its own (tests/support/memory_child.py)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.config import StreamConfig
from pgstream_dagster.engine import deadletters
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.publish import BatchDone, Confirmed, TooLarge, publish
from pgstream_dagster.sinks import Event
from pgstream_dagster.sinks.http import HttpSinkConfig

from .support.endpoint import Endpoint
from .support.harness import Driver, event_ids, write_config

EVENTS, MIB = 8, 20
#: what a run may hold while it delivers them (measured: 120-202 MiB on a loaded machine; 480-920 MiB when
#: reads were bounded by rows only): the open run's hand-off (four reads of delivery.tuning.max_read_bytes, 32 MiB)
#: plus the largest event as text, bytes and the sink's copy; half of the row-bounded figures
BOUND_MIB = 12 * MIB


def _child(tmp_path: Path, db_url: str, storage: str, mode: str, **delivery: Any) -> dict[str, Any]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"tmp": str(tmp_path), "db_url": db_url, "dagster_storage_url": storage,
                                "events": EVENTS, "mib": MIB, "mode": mode, "delivery": delivery}))
    done = subprocess.run([sys.executable, "-m", "tests.support.memory_child", str(spec)],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    # where each thread was, written only by a child that hung (no file: one that failed before it opened it)
    stacks = Path(str(spec) + ".stacks")
    assert done.returncode == 0, (stacks.read_text() if stacks.exists() else "") + done.stderr[-3000:]
    measured: dict[str, Any] = json.loads(Path(str(spec) + ".out").read_text())
    return measured


@pytest.mark.parametrize("mode", ["run", "open", "replay"])
def test_large_events_are_delivered_in_order_within_a_memory_bound(mode: str, db_url: str, tmp_path: Path,
                                                                    dagster_storage_url: str) -> None:
    result = _child(tmp_path, db_url, dagster_storage_url, mode)
    grown_mib = (result["peak_kb"] - result["rss_kb"]) / 1024
    print(f"{mode}: peak {grown_mib:.0f} MiB over {result['rss_kb'] / 1024:.0f} MiB")
    assert result["ids"] == result["expected"]
    assert grown_mib < BOUND_MIB, f"the {mode} grew {grown_mib:.0f} MiB delivering {EVENTS} events of {MIB} MiB as text"


def test_an_event_larger_than_the_sink_takes_is_set_aside_before_sending(db_url: str, tmp_path: Path,
                                                                          instance: dg.DagsterInstance,
                                                                          endpoint: Endpoint) -> None:
    """on_reject: block, and still: an event the sink can never take (a webhook's max_body_bytes) is not
    read, not sent and not retried; it becomes a dead letter saying why, the events after it go on."""
    sink = {**endpoint.sink(), "max_body_bytes": 2**20}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 100, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
         "delivery": {"on_reject": "block"}, "sink": sink}]), instance)
    driver.tick(1)
    with psycopg.connect(db_url) as c:  # 3 MiB as text, a few KiB stored
        c.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g, 'pad', "
                  "repeat('x', case when g = 2 then 3 * 2^20 else 10 end::int)), 1 from generate_series(1, 4) g")
    ids = event_ids(db_url, 1)
    driver.run_until(1, lambda: len(endpoint.unique()) >= 3, timeout=60)
    assert endpoint.accepted == [ids[0], ids[2], ids[3]]  # in order, once each, the large one never sent
    assert all(r.success for r in driver.results)
    with psycopg.connect(db_url) as c:
        ((event_id, stage, error, attempts, size),) = c.execute(
            "select event_id, stage, error, attempts, octet_length(payload->>'pad') from pgstream.dead_letters")
        assert c.execute("select count(*) from pgstream.batches where status <> %s",
                         [BatchStatus.DELIVERED]).fetchone() == (0,)
    assert (event_id, stage, attempts, size) == (ids[1], "deliver", 1, 3 * 2**20)  # the payload kept whole
    assert "more than the sink can ever take (1048576 bytes)" in error


def test_the_publish_loop_sets_aside_what_a_reader_could_not_check(endpoint: Endpoint) -> None:
    """Spark reads events whatever their size: the publish loop checks each against the sink's limit and
    sets a larger one aside (after confirming those before it) instead of sending it; the next go on."""
    created = dt.datetime.now(dt.UTC)
    rows = [(7, i, Event(100 + i, 1, {"pad": "é" * (600 if i == 2 else 5)}, created_at=created)) for i in range(1, 5)]
    set_aside: list[tuple[int, int, TooLarge]] = []
    with HttpSinkConfig(**{**endpoint.sink(), "max_body_bytes": 1024}).build() as sink:
        steps = list(publish(sink, rows, 10, too_large=lambda b, o, row: set_aside.append((b, o, row))))
    assert endpoint.accepted == [101, 103, 104]
    assert set_aside == [(7, 2, TooLarge(102, 1210, 1024))]  # 600 characters, 1,200 bytes in UTF-8
    # (the last call ends batch 7: its BatchDone says so, with every event of it handled)
    assert [s for s in steps if isinstance(s, Confirmed | BatchDone)] == [Confirmed(7, 1), Confirmed(7, 2),
                                                                           BatchDone(7, 4)]


def test_dead_letters_are_redelivered_a_read_budget_at_a_time(db_url: str, endpoint: Endpoint) -> None:
    """Redelivery lists sizes, not payloads, and reads and sends each chunk's payloads within
    delivery.tuning.max_read_bytes (2 MiB): three dead letters of 1.5 MiB as text are three requests, in order."""
    stream = StreamConfig.model_validate({"id": 1, "sink": endpoint.sink(),
                                          "delivery": {"tuning": {"max_read_bytes": 2**21}}})
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
        ids = [r[0] for r in c.execute(
            "insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g, 'pad', "
            "repeat('x', 1572864)), 1 from generate_series(1, 3) g returning id")]
        for n, event_id in enumerate(ids, start=1):
            c.execute("insert into pgstream.dead_letters (stream_id, event_id, stage, lsn, event_created_at, payload, "
                      "metadata, error) select 1, e.id, 'read', %s::pg_lsn, e.created_at, e.payload, e.metadata, 'x' "
                      "from pgstream.events e where e.id = %s", [f"0/{n}", event_id])
        report = deadletters.redeliver(c, stream, None, "tester")
    assert report.complete and len(report.redelivered) == 3
    assert endpoint.accepted == sorted(ids) and endpoint.requests == 3
