"""Open delivery runs, hosted by their reader group's delivery run: while a stream's run is open the group's reader
hands it every batch it records, no new run is requested, order and counts hold; the run stays open when idle, and a
stream with nothing open gets one before its first event; a failure in a later round puts the stream into failover and
loses nothing; a pause waits for the publish in flight; a backlog is delivered in direct rounds without Spark; the
group's sensor records for the members while its run's reader cannot read; close and assign never race."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.config import StreamConfig, load_config
from pgstream_dagster.defs.names import member_tag
from pgstream_dagster.engine import ingest, migrations, spark
from pgstream_dagster.engine.batches import BatchStatus, CloseRun, Extend, Launch, RunStatus, RunView, decide
from pgstream_dagster.engine.controls import apply_control
from pgstream_dagster.engine.delivery import sources
from pgstream_dagster.engine.ledger import locks
from pgstream_dagster.engine.ledger import state as ledger_state
from pgstream_dagster.engine.publish import owed_spans
from pgstream_dagster.engine.status import render_status, stream_status
from pgstream_dagster.sinks import Event

from .support.endpoint import Endpoint
from .support.faults import sent_ids, stream_row
from .support.harness import (
    Background,
    Driver,
    at_least,
    insert_events,
    run_metadata,
    slot_of,
    tick_until,
    write_config,
)

STREAM = 1
GROUP = "default"


def _config(endpoint: Endpoint, **delivery: Any) -> dict[str, Any]:
    """Stream 1 in mode open with the product's ``max_run_secs`` (its run stays open through the test)."""
    return {"id": STREAM, "batch": {"max_size": 20, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
            "retry": {"initial_backoff_secs": 0.2, "max_backoff_secs": 0.5},
            "delivery": {"chunk_size": 10, "mode": "open", **delivery}, "sink": endpoint.sink()}


def _wait(done: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _group_run(driver: Driver) -> Background:
    """The group's delivery run (one per test here: it lives until the test ends)."""
    (run,) = driver.group_runs[GROUP]
    return run


def _member(driver: Driver) -> dict[str, Any]:
    """What the group's delivery run says of the stream's member run (its tag: run key, state, error; none
    before the group's delivery run was launched)."""
    if not driver.group_runs.get(GROUP):
        return {}
    run_id = _group_run(driver).run_id
    run = driver.instance.get_run_by_id(run_id) if run_id is not None else None
    raw = run.tags.get(member_tag(STREAM)) if run is not None else None
    return dict(json.loads(raw)) if raw else {}


#: what the group delivery run's reader says when every WAL sender is taken
_NO_SENDER = "the group delivery run's reader stopped (cannot open a replication connection"


def _messages(instance: dg.DagsterInstance, run_id: str | None) -> list[str]:
    return [e.message for e in instance.all_logs(run_id) if e.message] if run_id else []


def _ended(driver: Driver) -> dict[str, Any]:
    """The group delivery run's result, once asked to end (as at the end of every test)."""
    driver.stop_group_runs()
    result = _group_run(driver).wait(timeout=30)
    assert result.success
    return {"rounds": run_metadata(result, "ASSET_MATERIALIZATION"), "run_id": result.run_id}


def _open_run_key(url: str) -> str | None:
    with psycopg.connect(url) as c:
        row = c.execute("select open_run_key from pgstream.streams where id = %s", [STREAM]).fetchone()
    return row[0] if row else None


def _run_keys(url: str) -> list[str]:
    """The run keys the stream's batches were delivered by, in batch order, each once."""
    with psycopg.connect(url) as c:
        keys = [r[0] for r in c.execute("select run_key from pgstream.batches where stream_id = %s order by id",
                                        [STREAM])]
    return list(dict.fromkeys(keys))


def test_open_run_takes_every_new_batch_and_stays_open_when_idle(db_url: str, tmp_path: Path,
                                                                 instance: dg.DagsterInstance,
                                                                 endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint)]), instance)
    driver.tick(STREAM)  # the group's delivery run, launched
    insert_events(db_url, STREAM, 30)
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 30)
    key = _open_run_key(db_url)  # the warm run the stream had before its first event took its batches
    assert key is not None and _run_keys(db_url) == [key]
    latencies = []
    for wave in range(4):  # the run is open: each wave is delivered by it, no new run is requested
        insert_events(db_url, STREAM, 25, 1000 * (wave + 1))
        committed = time.monotonic()
        expected = len(sent_ids(db_url))
        assert tick_until(driver, STREAM, at_least(lambda: len(endpoint.unique()), expected)) == []
        latencies.append(time.monotonic() - committed)
    assert _run_keys(db_url) == [key] and _open_run_key(db_url) == key
    assert _member(driver) == {"run_key": key, "state": "running", "error": None}
    with psycopg.connect(db_url) as c:
        assert f"open run: {key}" in render_status(stream_status(c, STREAM))
    time.sleep(1.5)  # idle: it stays open
    assert _open_run_key(db_url) == key and _member(driver)["state"] == "running"
    sent = sent_ids(db_url)
    assert endpoint.unique() == set(sent) and endpoint.duplicates() == 0
    assert endpoint.first_seen_order() == sent  # one writer: commit order is id order
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.batches where status <> %s",
                         [BatchStatus.DELIVERED]).fetchone() == (0,)
    assert max(latencies) < 5, latencies  # handed over within a tick or two, not a new run

    # after the quiet spell the same run takes the next batch
    insert_events(db_url, STREAM, 5, 9000)
    assert tick_until(driver, STREAM, lambda: endpoint.unique() == set(sent_ids(db_url))) == []
    assert _run_keys(db_url) == [key]
    rounds = _ended(driver)["rounds"]
    assert _member(driver) == {"run_key": key, "state": "ended", "error": None}  # asked to end: closed, not failed
    # the first load plus one round per wave at least (reported together at most every report_every_secs)
    assert sum(m["rounds"] for m in rounds) >= 6
    assert sum(m["events"] for m in rounds) == len(sent_ids(db_url))


def test_a_members_state_put_back_by_another_processs_tag_write_is_written_again(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dagster writes a run's tags by reading the run and writing it back whole: another process adding a tag
    (the group's sensor asking the run to end, an operator) while a member's run ends puts its older state
    back. The group run writes its members' states again within a stop check (a second)."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 5)
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 5)
    run_id = _group_run(driver).run_id
    assert run_id is not None and _member(driver)["state"] == "running"
    stale = instance.get_run_by_id(run_id)  # what the other process read...
    with psycopg.connect(db_url, autocommit=True) as c:
        apply_control(c, STREAM, "pause")  # the member's run closes
    _wait(lambda: _member(driver).get("state") == "ended")
    storage = instance.run_storage
    with monkeypatch.context() as m:  # ... and writes back with its tag, after the member's run ended
        m.setattr(storage, "_get_run_by_id", lambda _run_id: stale)
        storage.add_run_tags(run_id, {"team": "payments"})
    assert _member(driver)["state"] == "running"  # Dagster shows the older state for a moment
    _wait(lambda: _member(driver).get("state") == "ended", timeout=5)
    assert sent_ids(db_url) == sorted(endpoint.unique()) and endpoint.duplicates() == 0
    _ended(driver)
    assert _member(driver)["state"] == "ended"


def test_sink_failure_in_a_later_round_enters_failover_and_loses_nothing(db_url: str, tmp_path: Path,
                                                                          instance: dg.DagsterInstance,
                                                                          endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 20)
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 20)
    (key,) = _run_keys(db_url)
    endpoint.mode = "error"  # the open run's next round fails
    insert_events(db_url, STREAM, 40, 100)
    tick_until(driver, STREAM, lambda: stream_row(db_url)["failover_since"] is not None)
    member = _member(driver)
    assert member["run_key"] == key and member["state"] == "failed" and member["error"]
    assert stream_row(db_url)["open_run_key"] is None  # a failed run is closed: nothing is handed to it again
    endpoint.mode = "ok"
    insert_events(db_url, STREAM, 10, 500)
    tick_until(driver, STREAM, lambda: endpoint.unique() == set(sent_ids(db_url))
               and stream_row(db_url)["failover_since"] is None)
    assert endpoint.unique() == set(sent_ids(db_url))
    order = endpoint.first_seen_order()
    assert order == sorted(order)
    assert _group_run(driver).thread.is_alive()  # a member's failure does not end its group's run


def test_pause_waits_for_the_publish_in_flight_and_nothing_is_published_after_it(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """`pause` on a warm open run: it returns only once the publish call in flight has ended, and nothing of
    the stream is published after it returned (neither what the run was handed nor what commits next: the run
    closes, not failed, its batches back to pending); after `resume` the backlog is delivered, each event
    once, in commit order."""
    config = {"id": STREAM, "batch": {"max_size": 5, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
              "delivery": {"mode": "open", "chunk_size": 5, "tuning": {"max_run_secs": 300}}, "sink": endpoint.sink()}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [config]), instance)
    assert driver.tick(STREAM).run_requests == []  # the stream's open run is the group delivery run's
    tick_until(driver, STREAM, lambda: _member(driver).get("state") == "running")
    insert_events(db_url, STREAM, 10)
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 10)
    warm = _open_run_key(db_url)

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
    # it closed: the pause is no failure
    _wait(lambda: _member(driver) == {"run_key": warm, "state": "ended", "error": None}, timeout=30)
    row = stream_row(db_url)
    assert row["open_run_key"] is None and row["failover_since"] is None
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.batches where status = 'launched'").fetchone() == (0,)
        apply_control(c, STREAM, "resume")
    sent = sent_ids(db_url)
    assert len(sent) == 30 and published < 30
    tick_until(driver, STREAM, lambda: endpoint.unique() == set(sent), timeout=120)
    assert endpoint.first_seen_order() == sent  # commit order, each event once at least
    _ended(driver)


def test_a_replay_executed_in_process_takes_the_delivery_lease_from_the_open_run(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """A replay executed in process (what ``dagster job execute`` does: no run queue) while events are
    inserted and an open run delivers them: the open run yields the delivery lease to the replay, the
    run the sensor launches meanwhile (hosted by the group's delivery run) waits for the replay to end. At
    the sink the replayed range arrives as one contiguous block, live events before or after it, none in the
    middle; every event arrives, first arrivals in commit order."""
    from pgstream_dagster.defs.location import build_definitions
    from pgstream_dagster.defs.names import REPLAY_JOB, REPLAY_OP

    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint)])
    driver = Driver(cfg, instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 150)
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
    try:
        while replayer.is_alive():
            assert driver.tick(STREAM).run_requests == []
        time.sleep(0.3)  # live events after the replay too
    finally:
        stop.set()
        writer.join()
    assert replay and replay[0].success
    tick_until(driver, STREAM, lambda: endpoint.unique() >= set(sent_ids(db_url)))
    assert len(_run_keys(db_url)) >= 2  # the open run closed for the replay; the next one delivered after it
    _ended(driver)

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
    stream = {**_config(endpoint), "sink": {"type": "http", "url": endpoint.url, "timeout_secs": 30}}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 10)
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 10)

    def window(first: int, secs: float = 6.0) -> int:
        """Write 5 events every 0.1 s for ``secs``; the events delivered meanwhile."""
        before = len(endpoint.unique())
        started = time.monotonic()
        for k in range(int(secs * 10)):
            insert_events(db_url, STREAM, 5, first + 5 * k)  # the group run's reader hands them to the open run
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
    assert len(_run_keys(db_url)) == 1 and _member(driver)["state"] == "running"  # one open run throughout: no
    assert stream_row(db_url)["failover_since"] is None  # failover, no new run
    assert endpoint.first_seen_order() == sent_ids(db_url)  # one writer: commit order is id order


def test_a_stream_has_an_open_run_before_its_first_event_and_after_a_pause(db_url: str, tmp_path: Path,
                                                                           instance: dg.DagsterInstance,
                                                                           endpoint: Endpoint) -> None:
    """Mode open: with nothing to deliver the stream has an open run (a warm run, hosted by the group's delivery
    run), so its first event finds a run ready; idle it stays open; paused it closes, resumed the sensor opens
    the next one."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint)]), instance)
    assert tick_until(driver, STREAM, lambda: _member(driver).get("state") == "running") == []
    key = _open_run_key(db_url)
    assert key is not None and _member(driver)["run_key"] == key
    insert_events(db_url, STREAM, 15)
    _wait(lambda: len(endpoint.unique()) == 15)  # no tick: the group run's reader hands them to the warm run
    time.sleep(1.5)  # idle: it stays open
    insert_events(db_url, STREAM, 15, 100)
    _wait(lambda: len(endpoint.unique()) == 30)
    assert _open_run_key(db_url) == key and _run_keys(db_url) == [key]
    # paused: it closes; resumed: the sensor opens the next warm run
    with psycopg.connect(db_url, autocommit=True) as c:
        apply_control(c, STREAM, "pause")
    _wait(lambda: _member(driver) == {"run_key": key, "state": "ended", "error": None}, timeout=30)
    assert _open_run_key(db_url) is None
    with psycopg.connect(db_url, autocommit=True) as c:
        apply_control(c, STREAM, "resume")
    tick_until(driver, STREAM, lambda: _member(driver).get("state") == "running"
               and _member(driver)["run_key"] != key)
    assert _open_run_key(db_url) == _member(driver)["run_key"]
    sent = sent_ids(db_url)
    assert endpoint.unique() == set(sent) and endpoint.duplicates() == 0 and endpoint.first_seen_order() == sent
    _ended(driver)


def test_open_run_delivers_a_backlog_in_direct_rounds_without_spark(db_url: str, tmp_path: Path,
                                                                   instance: dg.DagsterInstance, endpoint: Endpoint,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A backlog larger than direct_max_events, in the batches a run is launched with and then while it is
    open: it delivers it in rounds of at most that many events (whole batches), in order, and never loads a
    round through Spark."""

    def no_spark(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("an open run loaded a round of global order through Spark")

    monkeypatch.setattr(spark, "load_batches", no_spark)
    stream = {**_config(endpoint, tuning={"direct_max_events": 120}),
              "batch": {"max_size": 50, "max_fill_secs": 0.2}}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream]), instance)
    driver.tick(STREAM)  # the group's delivery run
    insert_events(db_url, STREAM, 300)  # launched with batches of 50: 2 in the first round, the rest after
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 300)
    with psycopg.connect(db_url, autocommit=True) as c:  # one transaction of 600 events: a backlog at once
        c.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g), %s "
                  "from generate_series(1, 600) g", [STREAM])
    tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 900)
    sent = sent_ids(db_url)
    assert len(sent) == 900 and endpoint.unique() == set(sent) and endpoint.duplicates() == 0
    assert endpoint.first_seen_order() == sent
    ended = _ended(driver)
    assert sum(m["rounds"] for m in ended["rounds"]) >= 900 // 100  # batches of 50: at most 2 a round
    assert sum(m["events"] for m in ended["rounds"]) == 900
    logs = [e.message for e in instance.all_logs(ended["run_id"]) if e.message]
    assert any("; the other " in m and " batches in the next rounds" in m for m in logs)  # the launched round


def _slot_reader(url: str) -> str | None:
    """The application name of the connection that holds the stream's slot (its group's), if any."""
    with psycopg.connect(url) as c:
        row = c.execute("select a.application_name from pg_replication_slots s "
                        "join pg_stat_activity a on a.pid = s.active_pid where s.slot_name = %s",
                        [slot_of(url, STREAM)]).fetchone()
    return row[0] if row else None


def _take_every_wal_sender(url: str) -> list[psycopg.Connection]:
    """Replication connections until the server refuses one (max_wal_senders reached): held by the caller."""
    holders: list[psycopg.Connection] = []
    while True:
        try:
            holders.append(psycopg.connect(url, replication="database", autocommit=True))
        except psycopg.OperationalError as exc:
            assert "max_wal_senders" in str(exc), exc
            return holders
        assert len(holders) < 200, "max_wal_senders never reached"


GROUP_READER = "pgstream group slot reader "


def test_no_free_wal_sender_the_sensor_records_for_the_run_until_one_is_free(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """Every WAL sender taken (max_wal_senders): the group delivery run's reader cannot connect and says so in
    the run log, the group's sensor keeps recording and handing batches to the open run; once a sender is
    free the run's reader reads the group's slot itself (it tries again every few seconds). Each event
    once, in commit order."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint)]), instance)
    holders = _take_every_wal_sender(db_url)
    try:
        driver.tick(STREAM)  # the group's delivery run: its reader cannot open a replication connection
        insert_events(db_url, STREAM, 30)
        tick_until(driver, STREAM, lambda: len(endpoint.unique()) >= 30)
        for wave in range(3):  # the sensor records; the open run takes the batches
            insert_events(db_url, STREAM, 20, 1000 * (wave + 1))
            tick_until(driver, STREAM, at_least(lambda: len(endpoint.unique()), 50 + 20 * wave))
        assert not (_slot_reader(db_url) or "").startswith(GROUP_READER)
        # the run's reader has tried meanwhile, and said why it could not (the waves may be delivered before the
        # run's process is up: the senders stay taken until it has)
        _wait(lambda: any(_NO_SENDER in m and "max_wal_senders" in m for m in _messages(
            instance, _group_run(driver).run_id)), 120)
    finally:
        for holder in holders:
            holder.close()
    _wait(lambda: (_slot_reader(db_url) or "").startswith(GROUP_READER))
    insert_events(db_url, STREAM, 25, 9000)  # no tick from now on: the group run's reader reads it
    _wait(lambda: len(endpoint.unique()) >= 115)
    sent = sent_ids(db_url)
    assert len(sent) == 115 and endpoint.first_seen_order() == sent and endpoint.duplicates() == 0
    run_id = _ended(driver)["run_id"]
    logs = [e.message for e in instance.all_logs(run_id) if e.message]
    assert any(_NO_SENDER in m and "max_wal_senders" in m for m in logs), logs
    assert any("the group delivery run reads the group's slot again" in m for m in logs), logs


def _stream(tmp_path: Path, url: str) -> Any:
    config = load_config(write_config(tmp_path / "pgstream.yaml", url, [
        {"id": STREAM, "batch": {"max_size": 100, "max_fill_secs": 0.2}, "delivery": {"mode": "open"},
         "sink": {"type": "file", "path": str(tmp_path / "out.jsonl")}}]))
    return config.streams[0]


def test_tear_down_ends_a_reading_group_run_and_drops_its_slot(db_url: str, tmp_path: Path) -> None:
    """The group's slot held by a group delivery run's reader (a replication connection kept open across its
    reads): tear-down ends it and drops the slot."""
    stream = _stream(tmp_path, db_url)
    kept = ingest.GroupStream(db_url, GROUP_READER + "t")
    try:
        with psycopg.connect(db_url, autocommit=True) as c:
            ingest.consume_group(c, GROUP, [stream], 0)  # the slot
            ingest.consume_group(c, GROUP, [stream], 0.2, kept=kept)
        assert _slot_reader(db_url) == GROUP_READER + "t"
        slot = slot_of(db_url, STREAM)
        removed = migrations.tear_down(db_url)
        assert f"replication slot {slot}" in removed
        with psycopg.connect(db_url) as c:
            assert c.execute("select count(*) from pg_replication_slots where database = current_database()"
                             ).fetchone() == (0,)
    finally:
        kept.close()


def _event_rows(read: Iterable[tuple[int, int, Any]]) -> list[tuple[Any, ...]]:
    """(batch, ordinal, id, stream, created_at, payload, metadata) of each event read (none too large)."""
    rows: list[tuple[Any, ...]] = []
    for batch, ordinal, event in read:
        assert isinstance(event, Event)
        rows.append((batch, ordinal, event.id, event.stream_id, event.created_at, event.payload_json,
                     event.metadata_json))
    return rows


@pytest.mark.parametrize("routing_key", ["group_id", "metadata:team"])
def test_a_round_read_directly_equals_the_spark_read(db_url: str, tmp_path: Path, routing_key: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's own read (5,000 events a query; 50 here, so that batches are read in pieces) gives
    the same events, positions and texts as the Spark source."""
    monkeypatch.setattr(sources, "FETCH_ROWS", 50)
    stream = _stream(tmp_path, db_url)
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, GROUP, [stream], 0)  # the slot
        c.execute("insert into pgstream.events (payload, metadata, stream_id) select "
                  "jsonb_build_object('n', g, 'group_id', g %% 3, 's', 'ünï \"q\"', 'big', 12345678901234567890), "
                  "case when g %% 2 = 0 then jsonb_build_object('team', 'a') end, %s "
                  "from generate_series(1, 120) g", [STREAM])
        _wait(lambda: sum(ingest.consume_group(c, GROUP, [stream], 0.3).events.values()) == 0
              and len(ledger_state.batches_between(c, STREAM, 0, 10**9)) > 0)
        batches = ledger_state.batches_between(c, STREAM, 0, 10**9)
        spans = owed_spans(batches, resume=True)
        direct = list(sources.TableSource(c, spans, routing_key).events())
    session = spark.open_session(load_config(tmp_path / "pgstream.yaml"))
    frames = spark.load_batches(session, db_url, spans, routing_key, packed=True)
    assert isinstance(frames, list)
    via_spark = list(spark.frame_events(frames, prefetch=False))
    assert len(direct) == 120
    assert _event_rows(direct) == _event_rows(via_spark)


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
        seen = ledger_state.next_assigned(c, STREAM, "run-a", first, "r")
        assert seen.batches == [] and seen.close == ledger_state.lease_lost("r")  # (no run holds the lease)
        assert ledger_state.apply_run(c, CloseRun(STREAM, "run-a"))
        assert ledger_state.next_assigned(c, STREAM, "run-a", first, "r").close == (
            "the sensor hands it no more batches (failover or catch-up)")
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


def test_a_decision_the_group_reader_overtook_changes_nothing(db_url: str) -> None:
    """The sensor decides from what it read (the stream's open warm run, a batch waiting); the group's reader then
    hands the batch and one more to the open run before the decision is applied. The sensor's launch must then do
    nothing: taking the first batch for a new run would leave the second with the warm run, which no host runs any
    more once the new run is the stream's open one (stream stalled). The open run delivers both."""
    stream = StreamConfig.model_validate({"id": STREAM, "sink": {"type": "file", "path": "/dev/null"}})
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(%s)", [STREAM])
        insert_events(db_url, STREAM, 2)
        assert ledger_state.open_warm_run(c, STREAM, "warm-w")
        first, second = (_pending_batch(c, event_id) for event_id in (1, 2))
        seen = ledger_state.stream_state(c, STREAM, 1000)
        decided = decide(seen, RunView(RunStatus.LIVE, "warm-w"), dt.datetime.now(dt.UTC), stream)
        assert isinstance(decided, Extend) and isinstance(decided.otherwise, Launch)  # (launch if it closed)

        assert ledger_state.extend_run(c, STREAM, "warm-w", 1000) == [first, second]  # the reader, meanwhile
        assert ledger_state.apply(c, stream, decided) is None
        rows = c.execute("select id, status, run_key from pgstream.batches where stream_id = %s order by id",
                         [STREAM]).fetchall()
        assert rows == [(first, "launched", "warm-w"), (second, "launched", "warm-w")]
        assert stream_row(db_url)["open_run_key"] == "warm-w"
        # a run kept open never replaces another open run than the one it was decided to replace
        third = _pending_batch(c, 2)
        assert not ledger_state.launch(c, STREAM, [third], "run-b", keep_open=True)
        assert not ledger_state.launch(c, STREAM, [third], "run-b", keep_open=True, replaces="run-gone")
        assert ledger_state.launch(c, STREAM, [third], "run-b", keep_open=True, replaces="warm-w")
        assert stream_row(db_url)["open_run_key"] == "run-b"


def _pending_batch(c: psycopg.Connection, event_id: int) -> int:
    (bid,) = c.execute("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, "
                       "last_event_id, min_created_at, max_created_at) values (%s, %s, 1, %s, %s, now(), now()) "
                       "returning id", [STREAM, [event_id], event_id, event_id]).fetchone() or ()
    return int(bid)


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
        # waiting, and alive for the sensor
        until(lambda: locks.lease_state(observer, "run-2") is locks.LeaseState.HELD)
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
