"""A delivery run owns one sink for its whole life: every round of an open run publishes
through it, and it is closed when the run ends, whether the run succeeds or fails. The stream's runs are member
runs of its reader group's delivery run (``default``: the stream names no group)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from pgstream_dagster.defs.names import member_tag
from pgstream_dagster.sinks import MemorySink

from .support.faults import STREAM, sent_ids, stream_row
from .support.harness import Background, Driver, at_least, insert_events, joined, run_metadata, tick_until, write_config


@pytest.fixture
def name() -> Iterator[str]:
    """The memory sink's name for this test (its deliveries and sink counts)."""
    sink = f"run-sink-{uuid.uuid4().hex[:8]}"
    yield sink
    MemorySink.reset(sink)


def _config(name: str) -> dict[str, Any]:
    return {"id": STREAM, "batch": {"max_size": 20, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
            "retry": {"initial_backoff_secs": 0.2, "max_backoff_secs": 0.5},
            "delivery": {"mode": "open", "chunk_size": 10}, "sink": {"type": "memory", "name": name}}


def _delivered(name: str) -> list[int]:
    return [e.id for e in MemorySink.delivered(name)]


def _member(instance: dg.DagsterInstance, run: Background) -> dict[str, Any]:
    """What the group delivery run ``run`` says of the stream's member run (its tag: run key, state, error)."""
    dagster_run = instance.get_run_by_id(run.run_id or "")
    raw = dagster_run.tags.get(member_tag(STREAM)) if dagster_run is not None else None
    return dict(json.loads(raw)) if raw else {}


def _until(done: Callable[[], bool], timeout: float = 60) -> None:
    """Wait for ``done()`` without ticking (the group delivery run works in the background)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _open_run(db_url: str, tmp_path: Path, instance: dg.DagsterInstance, name: str,
              events: int) -> tuple[Driver, Background]:
    """The stream's group delivery run (in the background), once the stream's member run in it delivered
    ``events`` events (it stays open)."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(name)]), instance)
    tick_until(driver, STREAM, lambda: joined(db_url, STREAM))
    insert_events(db_url, STREAM, events)
    tick_until(driver, STREAM, lambda: len(_delivered(name)) >= events)
    (run,) = driver.group_runs[driver.group_of(STREAM)]
    return driver, run


def test_an_open_run_delivers_every_round_through_one_sink(db_url: str, tmp_path: Path,
                                                           instance: dg.DagsterInstance, name: str) -> None:
    driver, run = _open_run(db_url, tmp_path, instance, name, events=30)
    for wave in range(3):  # each wave is a round of the open run
        insert_events(db_url, STREAM, 25, 1000 * (wave + 1))
        expected = len(sent_ids(db_url))
        assert tick_until(driver, STREAM, at_least(lambda: len(_delivered(name)), expected)) == []
        assert (MemorySink.opened(name), MemorySink.closed(name)) == (1, 0)  # the same sink, still open
    driver.stop_group_runs()  # the group run is asked to end: the member's run closes, then it ends
    result = run.wait(timeout=30)
    assert _member(instance, run).get("state") == "ended"
    assert (MemorySink.opened(name), MemorySink.closed(name)) == (1, 1)  # closed when the run ended
    assert result.success
    rounds = run_metadata(result, "ASSET_MATERIALIZATION")
    # the first load and a round per wave at least (reported together at most every report_every_secs)
    assert sum(m["rounds"] for m in rounds) >= 4
    assert _delivered(name) == sent_ids(db_url)  # each event once, in commit order (one writer: id order)


def test_a_run_that_fails_in_a_later_round_closes_its_sink(db_url: str, tmp_path: Path,
                                                           instance: dg.DagsterInstance, name: str) -> None:
    driver, run = _open_run(db_url, tmp_path, instance, name, events=20)
    MemorySink.fail_next(name)  # the open run's next publish call fails
    insert_events(db_url, STREAM, 40, 100)
    # (not ticked: the group run's reader records the events and hands them to the open member run)
    _until(lambda: _member(instance, run).get("state") == "failed")
    assert _member(instance, run)["error"]
    # (no tick decided a retry yet: no other run opened a sink)
    assert (MemorySink.opened(name), MemorySink.closed(name)) == (1, 1)  # closed on failure too
    assert run.thread.is_alive()  # a member's failure does not end its group run
    # failover: catch-up runs (which close once done) deliver the rest, each through a sink of its own; then the
    # stream's next open run (a warm run, hosted at once) holds one sink open, and no other is
    def recovered() -> bool:
        row = stream_row(db_url)
        open_sinks = MemorySink.opened(name) - MemorySink.closed(name)
        member = _member(instance, run)
        hosted = row["open_run_key"] is not None and member == {**member, "run_key": row["open_run_key"],
                                                                 "state": "running"}
        return _delivered(name) == sent_ids(db_url) and row["failover_since"] is None \
            and open_sinks == (1 if hosted else 0)

    deadline = time.monotonic() + 120
    while not recovered():
        assert time.monotonic() < deadline, "did not recover"
        assert driver.tick(STREAM).run_requests == []
    assert MemorySink.opened(name) >= 2
    assert _delivered(name) == sent_ids(db_url)  # nothing lost or repeated: the failed call delivered nothing


def test_runs_and_ticks_collect_garbage_less_often_while_they_move_events(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a run delivers and while its group's slot is read and recorded (by the group run's reader, or the
    group's sensor's tick), the garbage collector runs at the bulk thresholds (a young collection per 50,000
    tracked objects, not 700: the rounds are not garbage); the process's own come back when they end."""
    import gc

    from pgstream_dagster.defs import jobs, sensors
    from pgstream_dagster.engine.collector import BULK_THRESHOLDS
    from pgstream_dagster.engine.ingest import consume_group

    published: list[tuple[int, ...]] = []
    recorded: list[tuple[int, ...]] = []
    publish = MemorySink.publish

    def recording_publish(self: MemorySink, events: Any) -> None:
        published.append(gc.get_threshold())
        publish(self, events)

    def recording(read: Callable[..., Any]) -> Callable[..., Any]:
        def reading(*args: Any, **kwargs: Any) -> Any:
            recorded.append(gc.get_threshold())
            return read(*args, **kwargs)
        return reading

    monkeypatch.setattr(MemorySink, "publish", recording_publish)
    monkeypatch.setattr(sensors, "consume_group", recording(consume_group))
    monkeypatch.setattr(jobs, "consume_group", recording(consume_group))
    before = gc.get_threshold()
    assert before != BULK_THRESHOLDS
    driver, run = _open_run(db_url, tmp_path, instance, name, events=30)
    driver.stop_group_runs()
    assert run.wait(timeout=30).success
    assert published and set(published) == {BULK_THRESHOLDS}
    assert recorded and set(recorded) == {BULK_THRESHOLDS}
    assert gc.get_threshold() == before
    assert _delivered(name) == sent_ids(db_url)
