"""A delivery run owns one sink for its whole life: every round of an open (lingering) run publishes
through it, and it is closed when the run ends, whether the run succeeds or fails."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from pgstream_dagster.sinks import MemorySink

from .support.faults import STREAM, sent_ids, stream_row
from .support.harness import Background, Driver, at_least, insert_events, run_metadata, tick_until, write_config


@pytest.fixture
def name() -> Iterator[str]:
    """The memory sink's name for this test (its deliveries and sink counts)."""
    sink = f"run-sink-{uuid.uuid4().hex[:8]}"
    yield sink
    MemorySink.reset(sink)


def _config(name: str, linger: float) -> dict[str, Any]:
    return {"id": STREAM, "batch": {"max_size": 20, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
            "retry": {"initial_backoff_secs": 0.2, "max_backoff_secs": 0.5},
            "delivery": {"tuning": {"linger_secs": linger}, "chunk_size": 10}, "sink": {"type": "memory", "name": name}}


def _delivered(name: str) -> list[int]:
    return [e.id for e in MemorySink.delivered(name)]


def _open_run(db_url: str, tmp_path: Path, instance: dg.DagsterInstance, name: str, linger: float,
              events: int) -> tuple[Driver, Background]:
    """A run of ``events`` events, in the background, once it delivered them (it stays open)."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(name, linger)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, events)
    (request,) = driver.tick(STREAM).run_requests
    run = Background(driver, request)
    tick_until(driver, STREAM, lambda: len(_delivered(name)) >= events)
    return driver, run


def test_an_open_run_delivers_every_round_through_one_sink(db_url: str, tmp_path: Path,
                                                           instance: dg.DagsterInstance, name: str) -> None:
    driver, run = _open_run(db_url, tmp_path, instance, name, linger=4, events=30)
    for wave in range(3):  # each wave is a round of the open run
        insert_events(db_url, STREAM, 25, 1000 * (wave + 1))
        expected = len(sent_ids(db_url))
        assert tick_until(driver, STREAM, at_least(lambda: len(_delivered(name)), expected)) == []
        assert (MemorySink.opened(name), MemorySink.closed(name)) == (1, 0)  # the same sink, still open
    result = run.wait(timeout=30)  # idle for linger_secs: the run closes and succeeds
    assert result.success
    rounds = run_metadata(result, "ASSET_MATERIALIZATION")
    # the first load and a round per wave at least (reported together at most every report_every_secs)
    assert sum(m["rounds"] for m in rounds) >= 4
    assert (MemorySink.opened(name), MemorySink.closed(name)) == (1, 1)  # closed when the run ended
    assert _delivered(name) == sent_ids(db_url)  # each event once, in commit order (one writer: id order)


def test_a_run_that_fails_in_a_later_round_closes_its_sink(db_url: str, tmp_path: Path,
                                                           instance: dg.DagsterInstance, name: str) -> None:
    driver, run = _open_run(db_url, tmp_path, instance, name, linger=30, events=20)
    MemorySink.fail_next(name)  # the open run's next publish call fails
    insert_events(db_url, STREAM, 40, 100)
    tick_until(driver, STREAM, lambda: not run.thread.is_alive())
    assert not run.wait(timeout=5).success
    assert (MemorySink.opened(name), MemorySink.closed(name)) == (1, 1)  # closed on failure too
    # failover: catch-up runs (which do not linger) deliver the rest, each through a sink of its own
    deadline = time.monotonic() + 120
    while _delivered(name) != sent_ids(db_url) or stream_row(db_url)["failover_since"] is not None:
        assert time.monotonic() < deadline, "did not recover"
        for req in driver.tick(STREAM).run_requests or []:
            assert Background(driver, req).wait(timeout=120).success
    runs = len(driver.results)
    assert runs >= 2 and MemorySink.opened(name) == MemorySink.closed(name) == runs
    assert _delivered(name) == sent_ids(db_url)  # nothing lost or repeated: the failed call delivered nothing


def test_runs_and_ticks_collect_garbage_less_often_while_they_move_events(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a run delivers and while a sensor tick records, the garbage collector runs at the bulk
    thresholds (a young collection per 50,000 tracked objects, not 700: the rounds are not garbage);
    the process's own come back when they end."""
    import gc

    from pgstream_dagster.defs import sensors
    from pgstream_dagster.engine.collector import BULK_THRESHOLDS

    published: list[tuple[int, ...]] = []
    ticked: list[tuple[int, ...]] = []
    publish, tick = MemorySink.publish, sensors.tick

    def recording_publish(self: MemorySink, events: Any) -> None:
        published.append(gc.get_threshold())
        publish(self, events)

    def recording_tick(*args: Any) -> Any:
        ticked.append(gc.get_threshold())
        return tick(*args)

    monkeypatch.setattr(MemorySink, "publish", recording_publish)
    monkeypatch.setattr(sensors, "tick", recording_tick)
    before = gc.get_threshold()
    assert before != BULK_THRESHOLDS
    _driver, run = _open_run(db_url, tmp_path, instance, name, linger=0.5, events=30)
    assert run.wait(timeout=30).success
    assert published and set(published) == {BULK_THRESHOLDS}
    assert ticked and set(ticked) == {BULK_THRESHOLDS}
    assert gc.get_threshold() == before
    assert _delivered(name) == sent_ids(db_url)
