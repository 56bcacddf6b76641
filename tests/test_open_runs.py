"""Open (lingering) delivery runs: while a run is open the sensor hands it every batch it records,
no new run is requested, order and counts hold; the run closes when idle; a failure in a later
round puts the stream into failover and loses nothing; close and assign never race."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg

from pgstream_dagster.engine import ledger
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.status import render_status, stream_status

from .support.endpoint import Endpoint
from .support.faults import sent_ids, stream_row
from .support.harness import Background, Driver, at_least, insert_events, run_metadata, tick_until, write_config

STREAM = 1


def _config(endpoint: Endpoint, linger: float, **delivery: Any) -> dict[str, Any]:
    return {"id": STREAM, "batch": {"max_size": 20, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
            "retry": {"initial_backoff_secs": 0.2, "max_backoff_secs": 0.5},
            "delivery": {"linger_secs": linger, "chunk_size": 10, **delivery}, "sink": endpoint.sink()}


def test_open_run_takes_every_new_batch_then_closes_when_idle(db_url: str, tmp_path: Path,
                                                              instance: dg.DagsterInstance,
                                                              endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint, linger=4)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 30)
    (request,) = driver.tick(STREAM).run_requests
    run = Background(driver, request)
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 30)
    latencies = []
    for wave in range(4):  # the run is open: each wave is delivered by it, no new run is requested
        insert_events(db_url, STREAM, 25, 1000 * (wave + 1))
        committed = time.monotonic()
        expected = len(sent_ids(db_url))
        assert tick_until(driver, STREAM, at_least(lambda: len(endpoint.unique()), expected)) == []
        latencies.append(time.monotonic() - committed)
    with psycopg.connect(db_url) as c:
        (open_key,) = c.execute("select open_run_key from pgstream.streams where id = %s", [STREAM]).fetchone() or ()
        assert open_key == request.run_key
        keys = {r[0] for r in c.execute("select distinct run_key from pgstream.batches")}
        assert keys == {request.run_key}
        assert f"open run: {request.run_key}" in render_status(stream_status(c, STREAM))
    result = run.wait(timeout=30)  # idle for linger_secs: it closes and succeeds
    assert result.success
    sent = sent_ids(db_url)
    assert endpoint.unique() == set(sent) and endpoint.duplicates() == 0
    assert endpoint.first_seen_order() == sent  # one writer: commit order is id order
    with psycopg.connect(db_url) as c:
        assert c.execute("select open_run_key from pgstream.streams where id = %s", [STREAM]).fetchone() == (None,)
        assert c.execute("select count(*) from pgstream.batches where status <> %s",
                         [BatchStatus.DELIVERED]).fetchone() == (0,)
    rounds = run_metadata(result, "ASSET_MATERIALIZATION")
    # the first load plus one round per wave at least (reported together at most every report_every_secs)
    assert sum(m["rounds"] for m in rounds) >= 5
    assert sum(m["events"] for m in rounds) == len(sent)
    assert max(latencies) < 5, latencies  # handed over within a tick or two, not a new run

    # once closed, a new batch gets a new run
    insert_events(db_url, STREAM, 5, 9000)
    requests = tick_until(driver, STREAM, lambda: bool(driver.cursors) and _pending_launched(db_url))
    assert len(requests) == 1 and requests[0].run_key != request.run_key
    assert driver.execute(requests[0]).success
    assert endpoint.unique() == set(sent_ids(db_url))


def _pending_launched(url: str) -> bool:
    with psycopg.connect(url) as c:
        return c.execute("select count(*) from pgstream.batches where status = %s",
                         [BatchStatus.LAUNCHED]).fetchone() != (0,)


def test_sink_failure_in_a_later_round_enters_failover_and_loses_nothing(db_url: str, tmp_path: Path,
                                                                          instance: dg.DagsterInstance,
                                                                          endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint, linger=30)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 20)
    (request,) = driver.tick(STREAM).run_requests
    run = Background(driver, request)
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 20)
    endpoint.mode = "error"  # the open run's next round fails
    insert_events(db_url, STREAM, 40, 100)
    tick_until(driver, STREAM, lambda: not run.thread.is_alive())
    assert not run.wait(timeout=5).success
    tick_until(driver, STREAM, lambda: stream_row(db_url)["failover_since"] is not None)
    state = stream_row(db_url)
    assert state["open_run_key"] is None  # a failed run is closed: nothing is handed to it again
    endpoint.mode = "ok"
    insert_events(db_url, STREAM, 10, 500)
    deadline = time.monotonic() + 120
    while endpoint.unique() != set(sent_ids(db_url)) or stream_row(db_url)["failover_since"] is not None:
        assert time.monotonic() < deadline, "did not recover"
        for req in driver.tick(STREAM).run_requests or []:
            Background(driver, req).wait(timeout=120)  # catch-up runs do not linger: they end
    assert endpoint.unique() == set(sent_ids(db_url))
    order = endpoint.first_seen_order()
    assert order == sorted(order)


def test_close_and_assign_are_ordered_by_the_stream_lock(db_url: str) -> None:
    """A run that closed is never handed a batch; a run handed a batch cannot close before delivering it."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(%s)", [STREAM])
        insert_events(db_url, STREAM, 3)

        def batch(event_id: int) -> int:
            (bid,) = c.execute("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, "
                               "last_event_id, min_created_at, max_created_at) values (%s, %s, 1, %s, %s, now(), "
                               "now()) returning id", [STREAM, [event_id], event_id, event_id]).fetchone() or ()
            return int(bid)

        first = batch(1)
        ledger.launch(c, STREAM, [first], "run-a", keep_open=True)
        second = batch(2)
        assert ledger.extend_run(c, STREAM, "run-a", 1000) == [second]
        assert ledger.extend_run(c, STREAM, "run-x", 1000) == []  # not the open run
        assert not ledger.close_run(c, STREAM, "run-a")  # batches assigned and not delivered
        for b in (first, second):
            ledger.mark_delivered(c, b, "r")
        assert [b.id for b in ledger.assigned_after(c, "run-a", first)] == []
        assert ledger.close_run(c, STREAM, "run-a")
        batch(3)
        assert ledger.extend_run(c, STREAM, "run-a", 1000) == []  # closed: never handed a batch again

        # the lock: a close waiting behind an assignment sees it and refuses
        third = ledger.stream_state(c, STREAM, 1000).head
        assert third is not None
        ledger.launch(c, STREAM, [third.id], "run-b", keep_open=True)
        fourth = batch(3)
        with psycopg.connect(db_url) as sensor:
            sensor.execute("select 1 from pgstream.streams where id = %s for update", [STREAM])
            sensor.execute("update pgstream.batches set status = %s, run_key = 'run-b' where id = %s",
                           [BatchStatus.LAUNCHED, fourth])
            ledger.mark_delivered(c, third.id, "r")
            outcome: list[bool] = []
            closer = threading.Thread(target=lambda: outcome.append(_close(db_url, "run-b")))
            closer.start()
            time.sleep(0.5)
            assert closer.is_alive()  # waits for the sensor's lock
            sensor.commit()
            closer.join(10)
        assert outcome == [False]  # it saw the batch assigned while it waited


def _close(url: str, run_key: str) -> bool:
    with psycopg.connect(url, autocommit=True) as c:
        return ledger.close_run(c, STREAM, run_key)
