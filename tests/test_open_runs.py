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
import pytest

from pgstream_dagster.engine.batches import BatchStatus, CloseRun
from pgstream_dagster.engine.controls import apply_control
from pgstream_dagster.engine.ledger import locks
from pgstream_dagster.engine.ledger import state as ledger_state
from pgstream_dagster.engine.status import render_status, stream_status

from .support.endpoint import Endpoint
from .support.faults import sent_ids, stream_row
from .support.harness import Background, Driver, at_least, insert_events, run_metadata, tick_until, write_config

STREAM = 1


def _config(endpoint: Endpoint, linger: float, **delivery: Any) -> dict[str, Any]:
    return {"id": STREAM, "batch": {"max_size": 20, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
            "retry": {"initial_backoff_secs": 0.2, "max_backoff_secs": 0.5},
            "delivery": {"chunk_size": 10, "tuning": {"linger_secs": linger}, **delivery}, "sink": endpoint.sink()}


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


def test_pause_waits_for_the_publish_in_flight_and_nothing_is_published_after_it(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """`pause` on a warm open run reading the slot: it returns only once the publish call in flight has
    ended, and nothing of the stream is published after it returned (neither what the run was handed nor
    what commits next: the run closes, not failed, its batches back to pending); after `resume` the
    backlog is delivered, each event once, in commit order."""
    config = {"id": STREAM, "batch": {"max_size": 5, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
              "delivery": {"mode": "warm", "chunk_size": 5, "tuning": {"max_run_secs": 300}}, "sink": endpoint.sink()}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [config]), instance)
    (request,) = driver.tick(STREAM).run_requests  # the warm run
    run = Background(driver, request)
    insert_events(db_url, STREAM, 10)
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 10)

    in_flight, release = threading.Event(), threading.Event()

    def hang(_request: int) -> None:  # the next publish call hangs until released
        in_flight.set()
        release.wait(30)

    endpoint.hook = hang
    insert_events(db_url, STREAM, 10, 100)
    assert in_flight.wait(30)
    paused = threading.Event()

    def pause() -> None:
        with psycopg.connect(db_url, autocommit=True) as c:
            apply_control(c, STREAM, "pause")
        paused.set()

    threading.Thread(target=pause, daemon=True).start()
    assert not paused.wait(1.5), "pause returned while a publish call was in flight"
    endpoint.hook = None
    release.set()
    assert paused.wait(30)
    published = len(endpoint.accepted)
    insert_events(db_url, STREAM, 10, 200)  # committed after the pause: recorded, not published
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert driver.tick(STREAM).run_requests == []
    assert len(endpoint.accepted) == published, "published after pause returned"
    result = run.wait(timeout=30)
    assert result.success  # it closed: the pause is no failure
    row = stream_row(db_url)
    assert row["open_run_key"] is None and row["failover_since"] is None
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.batches where status = 'launched'").fetchone() == (0,)
        apply_control(c, STREAM, "resume")
    sent = sent_ids(db_url)
    assert len(sent) == 30 and published < 30
    runs: list[Background] = []
    deadline = time.monotonic() + 120
    while endpoint.unique() != set(sent):
        assert time.monotonic() < deadline, "the backlog was not delivered after resume"
        runs += [Background(driver, r) for r in driver.tick(STREAM).run_requests]
    assert endpoint.first_seen_order() == sent  # commit order, each event once at least
    with psycopg.connect(db_url, autocommit=True) as c:  # the warm run closes
        apply_control(c, STREAM, "pause")
    assert all(r.wait(timeout=30).success for r in runs)


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
        ledger_state.launch(c, STREAM, [first], "run-a", keep_open=True)
        second = batch(2)
        assert ledger_state.extend_run(c, STREAM, "run-a", 1000) == [second]
        assert ledger_state.extend_run(c, STREAM, "run-x", 1000) == []  # not the open run
        assert not ledger_state.apply_run(c, CloseRun(STREAM, "run-a"))  # batches assigned and not delivered
        for b in (first, second):
            ledger_state.mark_delivered(c, b, "r")
        assert [b.id for b in ledger_state.assigned_after(c, "run-a", first)] == []
        assert ledger_state.apply_run(c, CloseRun(STREAM, "run-a"))
        batch(3)
        assert ledger_state.extend_run(c, STREAM, "run-a", 1000) == []  # closed: never handed a batch again

        # the lock: a close waiting behind an assignment sees it and refuses
        third = ledger_state.stream_state(c, STREAM, 1000).head
        assert third is not None
        ledger_state.launch(c, STREAM, [third.id], "run-b", keep_open=True)
        fourth = batch(3)
        with psycopg.connect(db_url) as sensor:
            sensor.execute("select 1 from pgstream.streams where id = %s for update", [STREAM])
            sensor.execute("update pgstream.batches set status = %s, run_key = 'run-b' where id = %s",
                           [BatchStatus.LAUNCHED, fourth])
            ledger_state.mark_delivered(c, third.id, "r")
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
        return ledger_state.apply_run(c, CloseRun(STREAM, run_key))


def test_a_replay_executed_in_process_takes_the_delivery_lease_from_the_open_run(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """A replay executed in process (what ``dagster job execute`` does: no run queue) while events are
    inserted and an open run delivers them: the open run yields the delivery lease to the replay, the
    run the sensor requests meanwhile waits for the replay to end. At the sink the replayed range arrives
    as one contiguous block, live events before or after it, none in the middle; every event arrives,
    first arrivals in commit order."""
    from pgstream_dagster.defs.location import build_definitions
    from pgstream_dagster.defs.names import REPLAY_JOB, REPLAY_OP

    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint, linger=2)])
    driver = Driver(cfg, instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 150)
    (request,) = driver.tick(STREAM).run_requests
    runs = [Background(driver, request)]
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 150)
    replayed = sent_ids(db_url)
    endpoint.delay = 0.01  # the replay's 15 calls take a while: live events have time to come in between

    stop = threading.Event()

    def write() -> None:
        n = 10_000
        while not stop.is_set():
            insert_events(db_url, STREAM, 2, n)
            n += 2
            time.sleep(0.03)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    time.sleep(0.3)  # the open run delivers live events
    replay: list[dg.ExecuteInProcessResult] = []
    job = build_definitions(cfg).resolve_job_def(REPLAY_JOB)
    replayer = threading.Thread(target=lambda: replay.append(job.execute_in_process(
        run_config={"ops": {REPLAY_OP: {"config": {"stream_id": STREAM, "from_event_id": replayed[0],
                                                   "to_event_id": replayed[-1]}}}},
        instance=instance, raise_on_error=False)), daemon=True)
    replayer.start()
    launched = {request.run_key}
    try:
        while replayer.is_alive():
            # as the daemon does, a run key is launched once (a tick that decides before the run's record
            # exists asks for it again)
            for r in driver.tick(STREAM).run_requests or []:
                if r.run_key not in launched:
                    launched.add(r.run_key)
                    runs.append(Background(driver, r))
            time.sleep(0.05)
        time.sleep(0.3)  # live events after the replay too
    finally:
        stop.set()
        writer.join()
    assert replay and replay[0].success
    tick_until(driver, STREAM, lambda: endpoint.unique() >= set(sent_ids(db_url)))
    for run in runs:
        assert run.wait(timeout=60).success

    arrivals = endpoint.accepted[len(replayed):]  # after the first delivery of the replayed range
    again = [i for i, event_id in enumerate(arrivals) if event_id <= replayed[-1]]
    assert [arrivals[i] for i in again] == replayed
    assert again[-1] - again[0] + 1 == len(replayed), "live events arrived in the middle of the replay"
    live = [e for e in arrivals if e > replayed[-1]]
    assert live[:1] and [e for e in arrivals[again[-1] + 1:]], "live events before and after the replay"
    sent = sent_ids(db_url)
    assert endpoint.first_seen_order() == sent  # one writer: commit order is id order


def test_a_flaky_receiver_costs_a_retry_per_failure_not_a_backoff_window(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """50 events/s are written while an open run delivers them to an HTTP receiver (the sink's default
    retry settings, one request per event): first for 6 s with every call answered, then for 6 s with
    a random 20% (seeded) answered 500. The sink retries a failed request at once, so the flaky window
    delivers at least half as many events as the fault-free one; in the end every event arrives, first
    arrivals in commit order, and the run never failed over."""
    stream = {**_config(endpoint, linger=3), "sink": {"type": "http", "url": endpoint.url, "timeout_secs": 30}}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 10)
    (request,) = driver.tick(STREAM).run_requests
    runs = [Background(driver, request)]
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 10)

    def window(first: int, secs: float = 6.0) -> int:
        """Write 5 events every 0.1 s for ``secs``; the events delivered meanwhile."""
        before = len(endpoint.unique())
        started = time.monotonic()
        for k in range(int(secs * 10)):
            insert_events(db_url, STREAM, 5, first + 5 * k)  # the open run reads the slot itself
            time.sleep(max(0.0, started + (k + 1) * 0.1 - time.monotonic()))
        return len(endpoint.unique()) - before

    fault_free = window(100_000)
    endpoint.fail_rate = 0.2
    flaky = window(200_000)
    refused = endpoint.refused_answers
    endpoint.fail_rate = 0.0
    assert refused > 0.1 * flaky
    assert flaky >= 0.5 * fault_free, f"{flaky} events delivered with 20% failures, {fault_free} without"
    tick_until(driver, STREAM, lambda: endpoint.unique() >= set(sent_ids(db_url)))
    for run in runs:
        assert run.wait(timeout=60).success
    assert len(runs) == 1  # one open run throughout: no failover, no new run
    assert endpoint.first_seen_order() == sent_ids(db_url)  # one writer: commit order is id order


def test_the_delivery_lease_goes_to_a_waiting_replay_and_back_without_deadlock(db_url: str) -> None:
    """The lease as a replay and the delivery runs take it: a replay waits for the run holding it; a run
    starting meanwhile waits for the replay (alive for the sensor, not dead) and gets the lease when the
    replay ends; without a replay a second run is refused at once."""
    results: dict[str, psycopg.Connection] = {}

    def take(name: str, take: Any) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(name, take()), daemon=True)
        thread.start()
        return thread

    def until(done: Any) -> None:
        deadline = time.monotonic() + 30
        while not done():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)

    with psycopg.connect(db_url, autocommit=True) as observer:
        first = locks.acquire_lease(db_url, STREAM, "run-1")
        try:
            locks.acquire_lease(db_url, STREAM, "run-0")
            raise AssertionError("two runs held the lease")
        except locks.LeaseTaken:
            pass
        replay = take("replay", lambda: locks.acquire_replay_lease(db_url, STREAM, "replay-1"))
        until(lambda: locks.replay_waiting(observer, STREAM))
        second = take("run-2", lambda: locks.acquire_lease(db_url, STREAM, "run-2"))
        until(lambda: locks.lease_alive(observer, "run-2"))  # waiting, and alive for the sensor
        assert locks.lock_holder(observer, locks.DELIVERY_LOCK, STREAM) == "run-1"
        assert replay.is_alive() and second.is_alive()
        first.close()  # the open run closed: the lease goes to the replay, not to the run waiting
        replay.join(30)
        assert locks.lock_holder(observer, locks.DELIVERY_LOCK, STREAM) == "replay-1"
        assert second.is_alive()
        results["replay"].close()  # the replay ended
        second.join(30)
        assert locks.lock_holder(observer, locks.DELIVERY_LOCK, STREAM) == "run-2"
        assert not locks.replay_waiting(observer, STREAM)
        assert locks.lock_holder(observer, locks.LEASE_WAIT_LOCK, STREAM) is None
        results["run-2"].close()


def test_the_sensor_says_a_failover_once_and_recalls_it_at_most_once_a_minute(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream in failover waits for its retry (backoff 600 s): the sensor decides about every second of
    its tick. Over several ticks it logs the failed run once, which says the failover it starts; while it
    lasts, a short reminder at most every REMIND_EVERY_SECS."""
    from pgstream_dagster.engine import batches

    config = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": STREAM, "batch": {"max_size": 20, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 2.5},
         "retry": {"initial_backoff_secs": 600, "max_backoff_secs": 600}, "delivery": {"mode": "per_batch"},
         "sink": {"type": "http", "url": "http://127.0.0.1:9/refused", "timeout_secs": 1}}])
    driver = Driver(config, instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 5)
    (request,) = driver.tick(STREAM).run_requests
    assert not driver.execute(request).success
    capfd.readouterr()

    def failover_lines() -> list[str]:
        """The sensor's warnings since the last call (its context.log writes to the process's stderr)."""
        return [line for line in capfd.readouterr().err.splitlines() if " - WARNING - " in line and "failover" in line]

    started = time.monotonic()
    for _ in range(3):  # about 3 decisions a tick
        assert not driver.tick(STREAM).run_requests
    assert time.monotonic() - started >= 6
    lines = failover_lines()
    assert len(lines) == 1, lines  # the failed run, and the failover it waits in: one line
    assert "stream 1 in failover at batch" in lines[0] and "FAILURE" in lines[0] and "; retry at " in lines[0]
    monkeypatch.setattr(batches, "REMIND_EVERY_SECS", 2.0)
    started = time.monotonic()
    for _ in range(2):
        assert not driver.tick(STREAM).run_requests
    elapsed = time.monotonic() - started
    reminders = failover_lines()
    assert 1 <= len(reminders) <= elapsed / 2.0 + 1, reminders
    assert all("stream 1 still in failover at batch" in line and "(attempt 1)" in line for line in reminders)
