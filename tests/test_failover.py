"""The fault matrix: each row injects a fault into a real pipeline (real Postgres with logical
replication, real Dagster instance storage, real runs on Spark, a real HTTP endpoint) and counts
events end to end: every event sent is delivered, duplicates are counted (at-least-once), the
first delivery of each event follows the ledger's commit order, and the stream recovers.

Each row prints ``FAULT-MATRIX {...}`` (sent, delivered, duplicates, seconds to recover) for the
closing note: ``pytest tests/test_failover.py -s | grep FAULT-MATRIX``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
import sqlalchemy.exc

from pgstream_dagster.devdb import LocalPostgres, ensure_running
from pgstream_dagster.engine import replication
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.migrations import migrate

from .conftest import drop_database, fresh_database
from .support.endpoint import Endpoint
from .support.faults import (
    GROUP,
    STREAM,
    check_and_report,
    database_url,
    delivered_all,
    drive,
    drop_slot,
    fail_into_failover,
    hosted,
    ledger_order,
    member_runs,
    sent_ids,
    slot_has_events,
    start,
    stream_config,
    stream_row,
    tick_failing_until,
)
from .support.harness import Driver, backdated, insert_events, slot_of, write_config

pytestmark = pytest.mark.usefixtures("delivery_mode")  # every row on every delivery mode (faults.MODES)


def _short_ticks(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with a tick that reads the slot for 0.1 s (not stream_config's 0.3 s) in mode per_batch: there the tick
    reads its whole budget (no group run reads for it), and these rows tick some 30 times after everything was
    inserted, reading nothing new. A tick reads at least once whatever its budget, and the rows tick until what
    they wait for is done. (Modes open and warm keep stream_config's.)"""
    if not hosted():
        cfg["sensor"] = {**cfg["sensor"], "tick_budget_secs": 0.1}
    return cfg


def test_sink_down_500_then_refused_then_back(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                              endpoint: Endpoint) -> None:
    # a backoff of 2 s: the tick after the failover must find the retry not due yet, and a tick on a loaded
    # machine took longer than 0.5 s (an open run's mode: seen once in the matrix)
    cfg = _short_ticks(stream_config(endpoint, retry={"initial_backoff_secs": 2, "max_backoff_secs": 2}))
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [cfg]), instance)
    start(driver)
    insert_events(db_url, STREAM, 100)
    drive(driver, lambda: len(endpoint.unique()) >= 100)

    endpoint.mode = "error"
    insert_events(db_url, STREAM, 100, 100)
    first_failed = min(set(sent_ids(db_url)) - endpoint.unique())
    # the run fails (per_batch: executed here; open: the member run the group run hosts), and the tick that
    # sees it failed: checkpoint + failover
    fail_into_failover(driver, db_url)
    state = stream_row(db_url)
    assert state["failover_since"] is not None
    assert state["failover_checkpoint_id"] == first_failed
    assert "500" in state["failover_error"]
    assert state["failover_retry_at"] > dt.datetime.now(dt.UTC)
    # the backoff is honoured: nothing is launched before the retry time (no run requested, no batch handed to
    # a member run)
    assert not driver.tick(STREAM).run_requests
    assert _launched(db_url) == 0 and stream_row(db_url)["failover_attempts"] == 1

    endpoint.down()  # now connection refused; events keep coming and WAL keeps being released
    for wave in range(3):
        insert_events(db_url, STREAM, 100, 200 + 100 * wave)
        # recorded in the ledger, released from the slot
        tick_failing_until(driver, lambda: not slot_has_events(db_url), f"wave {wave} to leave the slot")
    # the retry after the backoff (2 s) meets the refused connection
    tick_failing_until(driver, lambda: stream_row(db_url)["failover_attempts"] >= 2, "a second attempt")
    state = stream_row(db_url)
    assert state["failover_attempts"] >= 2 and state["failover_checkpoint_id"] == first_failed
    assert "refused" in state["failover_error"].lower() or "connect" in state["failover_error"].lower()
    with psycopg.connect(db_url) as c:
        probes = c.execute("select count(*) from pgstream.batches where status in (%s, %s)",
                           [BatchStatus.FAILED, BatchStatus.LAUNCHED]).fetchone()
        waiting = c.execute("select count(*) from pgstream.batches where status = %s", [BatchStatus.PENDING]).fetchone()
    # only the checkpoint batch is retried; the rest waits
    assert probes == (1,) and waiting is not None and waiting[0] >= 6

    endpoint.mode = "ok"
    endpoint.up()
    recover = drive(driver, delivered_all(endpoint, db_url))
    check_and_report("sink down (500, then refused), then back", endpoint, db_url, recover)
    with psycopg.connect(db_url) as c:
        history = c.execute("select checkpoint_event_id, attempts, ended_at is not null from pgstream.failovers"
                            ).fetchall()
    assert len(history) == 1 and history[0][0] == first_failed and history[0][2]


def test_flapping_sink_makes_progress(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                      endpoint: Endpoint) -> None:
    cfg = _short_ticks(stream_config(endpoint, retry={"initial_backoff_secs": 0, "max_backoff_secs": 0}))
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [cfg]), instance)
    start(driver)
    endpoint.mode = "flap"  # every other request fails
    insert_events(db_url, STREAM, 300)
    recover = drive(driver, delivered_all(endpoint, db_url))
    assert endpoint.refused_answers >= 5
    check_and_report("sink flapping (every other call fails)", endpoint, db_url, recover,
                     failed_calls=endpoint.refused_answers)


def _launched(url: str) -> int:
    """The stream's batches handed to a run (status launched)."""
    with psycopg.connect(url) as c:
        row = c.execute("select count(*) from pgstream.batches where stream_id = %s and status = %s",
                        [STREAM, BatchStatus.LAUNCHED]).fetchone()
    return int(row[0]) if row else 0


def _tick_through_outage(driver: Driver, done: Callable[[], bool], timeout: float = 120) -> float:
    """Tick (and execute the runs of mode per_batch) until ``done``, while Postgres (the ledger's and Dagster's
    storage) restarts: a tick that loses its server is tried again, as the daemon would. Returns the seconds it
    took."""
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < timeout, "timed out"
        try:
            for request in driver.tick(STREAM).run_requests:
                driver.execute(request)
        except (psycopg.OperationalError, dg.DagsterError, sqlalchemy.exc.OperationalError):
            time.sleep(0.5)  # the tick itself lost its connection: the daemon would tick again
        time.sleep(0.05)
    return time.monotonic() - started


def test_postgres_restarted_in_the_middle_of_a_batch(db_url: str, pg: LocalPostgres, tmp_path: Path,
                                                     instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    start(driver)
    insert_events(db_url, STREAM, 200)
    restarted = threading.Event()

    def restart_once(n: int) -> None:
        if n == 3:
            pg.restart()  # while the run waits for this answer
            restarted.set()
    endpoint.hook = restart_once
    started = time.monotonic()
    _tick_through_outage(driver, restarted.is_set)
    endpoint.hook = None
    recover = _tick_through_outage(driver, delivered_all(endpoint, db_url), timeout=300)
    check_and_report("Postgres restarted mid-batch", endpoint, db_url, time.monotonic() - started,
                     after_restart_secs=round(recover, 1))


_RUN_SCRIPT = """
import json, os, sys
import dagster as dg
from pgstream_dagster.defs.location import build_definitions
config_path, storage_url, home, request = sys.argv[1:5]
request = json.loads(request)
with dg.instance_for_test(overrides={"storage": {"postgres": {"postgres_url": storage_url}}}, temp_dir=home) as inst:
    job = build_definitions(__import__("pathlib").Path(config_path)).resolve_job_def(request["job"])
    job.execute_in_process(run_config=request["run_config"], instance=inst, tags=request["tags"],
                           raise_on_error=False)
"""


class _RunProcess:
    """The run that delivers, executed in a process of its own (as the run launcher would): in mode per_batch the
    stream's run the tick requested; in mode open the group delivery run the tick requests (the driver's
    next launch of one: ``launch``), hosting the member's runs."""

    def __init__(self, tmp_path: Path, driver: Driver, dagster_storage_url: str) -> None:
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.driver = driver
        self.storage_url = dagster_storage_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.request: dg.RunRequest | None = None

    def launch(self, request: dg.RunRequest) -> None:
        self.request = request
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RUN_SCRIPT, str(self.driver.config_path), self.storage_url, str(self.home),
             json.dumps({"job": request.job_name, "run_config": request.run_config,
                         "tags": {**request.tags, "dagster/run_key": request.run_key}})],
            env={**os.environ}, start_new_session=True)
        deadline = time.monotonic() + 120  # as the daemon does, the run exists before the next tick looks
        while not self.driver.instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": request.run_key or ""})):
            assert self.proc.poll() is None and time.monotonic() < deadline, "the run's process did not start it"
            time.sleep(0.05)

    def host_group_run(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The driver's next group delivery run is launched here; those after it in its threads again."""
        launch = self.driver.launch_group_run

        def once(group: str, request: dg.RunRequest) -> Any:
            monkeypatch.setattr(self.driver, "launch_group_run", launch)
            self.launch(request)
        monkeypatch.setattr(self.driver, "launch_group_run", once)

    def dagster_run(self) -> dg.DagsterRun:
        assert self.request is not None
        (run,) = self.driver.instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": self.request.run_key or ""}))
        return run

    def stop_midway(self, endpoint: Endpoint, stop: Callable[[subprocess.Popen[bytes]], None]) -> int:
        """Deliver slowly (``endpoint.delay``) and ``stop`` the run's process once 60 events reached the
        endpoint: part of the way through (the group run's members' runs are decided by the ticks meanwhile).
        Returns the events delivered by then (fewer than all)."""
        assert self.proc is not None
        proc = self.proc
        try:
            deadline = time.monotonic() + 240
            while len(endpoint.accepted) < 60:  # part of the way through
                assert proc.poll() is None and time.monotonic() < deadline
                if hosted():
                    self.driver.tick(STREAM)  # (the group run live: the tick decides the member's runs)
                time.sleep(0.05)
            stop(proc)
            proc.wait(120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        endpoint.delay = 0
        delivered = len(endpoint.unique())
        assert delivered < 300
        return delivered


def _start_slowly_in_a_process(tmp_path: Path, driver: Driver, dagster_storage_url: str, endpoint: Endpoint,
                               monkeypatch: pytest.MonkeyPatch) -> _RunProcess:
    """300 events, delivered slowly by a run in a process of its own (the stream's run in mode per_batch, the
    group delivery run otherwise)."""
    process = _RunProcess(tmp_path, driver, dagster_storage_url)
    endpoint.delay = 0.2
    if hosted():
        process.host_group_run(monkeypatch)
    start(driver)
    insert_events(database_url(driver), STREAM, 300)
    if not hosted():
        (request,) = driver.tick(STREAM).run_requests
        process.launch(request)
    return process


def test_run_process_killed_mid_delivery(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                         dagster_storage_url: str, endpoint: Endpoint,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 of the process that delivers (and its Spark JVM): the stream's run in mode per_batch, the group
    delivery run hosting the member's run in mode open."""
    config_path = write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)])
    driver = Driver(config_path, instance)
    process = _start_slowly_in_a_process(tmp_path, driver, dagster_storage_url, endpoint, monkeypatch)
    delivered_before_kill = process.stop_midway(endpoint, lambda proc: os.killpg(proc.pid, signal.SIGKILL))
    killed_at = time.monotonic()
    recover = drive(driver, delivered_all(endpoint, db_url))
    # the sensor saw the lease gone (the run's, the group run's) and failed it
    assert process.dagster_run().status == dg.DagsterRunStatus.FAILURE
    check_and_report("run process SIGKILLed mid-delivery", endpoint, db_url, time.monotonic() - killed_at,
                     delivered_before_kill=delivered_before_kill, drive_secs=round(recover, 1))


def test_run_interrupted_by_the_shutdown_closes_and_its_batches_go_on_without_backoff(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, dagster_storage_url: str,
        endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped by SIGINT mid-delivery (what `dg dev` shutting down, Ctrl-C or `make stop`, does to its
    runs; in mode open the group delivery run hosting the member's run, which closes once its round is
    delivered): it closes instead of failing (Dagster records a success, its log says it was interrupted), the
    batches it held go back to the ledger, and
    the next tick launches them at once (not after the backoff, here 600 s): no failover, no attempt failed,
    every event delivered in order."""
    # a run takes 100 events at a time (two batches): a member's run of the group run ends after its round
    # (open), with batches left for the next run
    stream = {**stream_config(endpoint, delivery={"chunk_size": 20, "run_grace_secs": 10, "max_events_per_run": 100}),
              "retry": {"initial_backoff_secs": 600, "max_backoff_secs": 600}}
    config_path = write_config(tmp_path / "pgstream.yaml", db_url, [stream])
    driver = Driver(config_path, instance)
    process = _start_slowly_in_a_process(tmp_path, driver, dagster_storage_url, endpoint, monkeypatch)
    # the run's process alone, as Dagster interrupts a run (and a terminal's Ctrl-C reaches it)
    delivered_before = process.stop_midway(endpoint, lambda proc: proc.send_signal(signal.SIGINT))
    run = process.dagster_run()
    assert run.status == dg.DagsterRunStatus.SUCCESS
    logs = [e.user_message for e in instance.all_logs(run.run_id)]
    closed = ("reader group default: group delivery run ended (interrupted (shutdown): its members' runs closed; "
              "what they held waits for the next group run)") if hosted() else \
        "the run was interrupted (shutdown) and closed; batches "
    assert any(closed in m for m in logs), logs
    with psycopg.connect(db_url) as c:
        assert c.execute("select open_run_key from pgstream.streams where id = %s", [STREAM]).fetchone() == (None,)
        assert c.execute("select count(*) from pgstream.batches where status = 'launched'").fetchone() == (0,)
    restarted_at = time.monotonic()
    retry: list[dg.RunRequest] = []
    # the batches' run again, within a few ticks (the backoff would be 600 s): a run of the stream's own
    # requested, or a member run the next group delivery run hosts
    while not (retry or (hosted() and _launched(db_url))):
        assert time.monotonic() - restarted_at < 30, "the interrupted run's batches wait for the backoff"
        retry = driver.tick(STREAM).run_requests or []
    # no failure was counted: no failover, no attempt
    with psycopg.connect(db_url) as c:
        assert c.execute("select failover_since, failover_attempts from pgstream.streams where id = %s",
                         [STREAM]).fetchone() == (None, 0)
        assert c.execute("select count(*) from pgstream.failovers").fetchone() == (0,)
        assert c.execute("select count(*) from pgstream.batches where status = 'failed' or error is not null"
                         ).fetchone() == (0,)
    for again in retry:
        driver.execute(again)
    recover = drive(driver, delivered_all(endpoint, db_url))
    check_and_report("run process interrupted (SIGINT) mid-delivery", endpoint, db_url,
                     time.monotonic() - restarted_at, delivered_before_interrupt=delivered_before,
                     drive_secs=round(recover, 1))


def _tick_dropping_the_group_run(driver: Driver, monkeypatch: pytest.MonkeyPatch) -> list[dg.RunRequest]:
    """A tick whose group delivery run request is lost (the daemon dies before Dagster creates the run)."""
    dropped: list[dg.RunRequest] = []
    monkeypatch.setattr(driver, "launch_group_run", lambda group, request: dropped.append(request))
    driver.tick(STREAM)
    return dropped


def test_sensor_restarted_and_crashing_between_steps(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                                     endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Crash 1: whoever reads the group's slot (the sensor's peek in mode per_batch; the group delivery run's
    reader, over the replication protocol, in mode open) crashes after the ledger recorded the batches,
    before the slot advanced. Crash 2: the tick requested a run (per_batch: the stream's; open: the group
    delivery run) but the daemon died before Dagster created it. Nothing is lost or delivered twice."""
    config_path = write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)])
    driver = Driver(config_path, instance)
    start(driver)
    crashed = threading.Event()
    if hosted():
        from pgstream_dagster.engine.ingest.source import StreamSource
        real_confirm = StreamSource.confirm

        def crash_once(self: StreamSource, lsn: int) -> None:
            if not crashed.is_set():
                crashed.set()
                raise RuntimeError("injected crash before the slot advanced")
            real_confirm(self, lsn)
        monkeypatch.setattr(StreamSource, "confirm", crash_once)
        insert_events(db_url, STREAM, 120)
        deadline = time.monotonic() + 60
        while not crashed.is_set():  # the group run's reader records them (no tick: the sensor reads nothing)...
            assert time.monotonic() < deadline, "the group run's reader did not record"
            time.sleep(0.05)
        # ...then crashes before the slot advanced
        recorded = ledger_order(db_url)
        assert recorded
        # the daemon restarts (the group run lives on): a new sensor evaluation with no cursor; the group run
        # ends, the next one is requested...
        driver.stop_group_runs("the group run ends")
        driver = Driver(config_path, instance)
        # ...but the daemon dies before Dagster created it
        (lost,) = _tick_dropping_the_group_run(driver, monkeypatch)
        assert not instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": lost.run_key or ""}))
        driver = Driver(config_path, instance)
    else:
        insert_events(db_url, STREAM, 120)
        real_advance = replication.advance

        def crash(*args: Any) -> None:
            raise RuntimeError("injected crash before advance")
        monkeypatch.setattr(replication, "advance", crash)
        with pytest.raises(Exception, match="injected crash"):
            driver.tick(STREAM)
        monkeypatch.setattr(replication, "advance", real_advance)
        # the daemon restarts: a new sensor evaluation with no cursor
        driver = Driver(config_path, instance)
        (request,) = driver.tick(STREAM).run_requests
        # crash 2: the tick requested a run but the daemon died before Dagster created it
        driver = Driver(config_path, instance)
        (again,) = driver.tick(STREAM).run_requests
        assert again.run_key == request.run_key  # same run key: Dagster would run it once
    insert_events(db_url, STREAM, 80, 1000)
    started = time.monotonic()
    drive(driver, delivered_all(endpoint, db_url))
    check_and_report("sensor/daemon restarted, crashes between record/advance and request/run", endpoint, db_url,
                     time.monotonic() - started)
    assert endpoint.duplicates() == 0
    if hosted():  # each member run was hosted once
        keys = [k for k in member_runs(driver)]
        assert len(keys) == len(set(keys))


def _writer(url: str, stop: threading.Event, n_per_txn: int = 5) -> threading.Thread:
    def run() -> None:
        with psycopg.connect(url, autocommit=True) as c:
            while not stop.is_set():
                c.execute("insert into pgstream.events (payload, stream_id) "
                          "select jsonb_build_object('n', g), 1 from generate_series(1, %s) g", [n_per_txn])
                time.sleep(0.01)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_slot_dropped_while_events_flow(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                        endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    start(driver)
    stop = threading.Event()
    writer = _writer(db_url, stop)

    def kinds() -> list[str]:
        """The kinds of the stream's batches, in ledger order."""
        with psycopg.connect(db_url) as c:
            return [r[0] for r in c.execute("select kind from pgstream.batches order by id")]

    def recovered_then_read_again() -> bool:
        ledger = kinds()
        return "recovery" in ledger and "stream" in ledger[ledger.index("recovery") + 1:]

    try:
        # the stream delivers while the writer writes
        drive(driver, lambda: len(endpoint.unique()) >= 20 and len(kinds()) >= 2, timeout=60)
        drop_slot(db_url)
        dropped_at = time.monotonic()
        # events keep flowing: what committed without a slot is recovered from the table, what commits
        # next is read from the new slot (a stream batch after the recovery batch)
        drive(driver, recovered_then_read_again, timeout=60)
    finally:
        stop.set()
        writer.join()
    drive(driver, delivered_all(endpoint, db_url))
    assert "recovery" in kinds()
    check_and_report("slot dropped while events flow", endpoint, db_url, time.monotonic() - dropped_at)


@pytest.fixture(scope="module")
def small_wal_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A Postgres of its own whose slots are invalidated past 1 MB of retained WAL, with a migrated
    database ``app`` to copy (for the row on each delivery mode)."""
    server = ensure_running(tmp_path_factory.mktemp("smallwal") / "data", extra_settings={
        "fsync": "off", "max_slot_wal_keep_size": "1MB", "wal_keep_size": "0", "min_wal_size": "32MB",
        "max_wal_size": "32MB"})
    server.create_database("app")
    migrate(server.url_for("app"))
    yield server
    server.destroy()


@pytest.fixture
def small_wal_url(small_wal_pg: LocalPostgres) -> Iterator[str]:
    """A fresh copy of ``app`` on that Postgres, dropped with its slots after the test."""
    name = fresh_database(small_wal_pg, "app")
    yield small_wal_pg.url_for(name)
    drop_database(small_wal_pg, name)


def test_slot_invalidated_by_wal_limit(small_wal_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                       endpoint: Endpoint) -> None:
    url = small_wal_url
    driver = Driver(write_config(tmp_path / "pgstream.yaml", url, [stream_config(endpoint)]), instance)
    start(driver)
    insert_events(url, STREAM, 100)
    drive(driver, lambda: len(endpoint.unique()) >= 100)
    # nothing reads the slot until the next tick: the group delivery run (open) ends; the sensor (per_batch)
    # reads only when it ticks
    driver.stop_group_runs("the slot is to be invalidated")
    insert_events(url, STREAM, 150, 100)  # committed, not yet read from the slot...
    with psycopg.connect(url, autocommit=True) as c:  # ...when the WAL runs past the limit
        c.execute("create table filler (x text)")
        for _ in range(6):
            c.execute("insert into filler select repeat('x', 1000) from generate_series(1, 10000)")
            c.execute("select pg_switch_wal()")
            c.execute("checkpoint")
        status = c.execute("select wal_status from pg_replication_slots where slot_name = %s",
                           [slot_of(url, STREAM)]).fetchone()
    assert status == ("lost",)
    started = time.monotonic()
    drive(driver, delivered_all(endpoint, url))
    with psycopg.connect(url) as c:
        assert c.execute("select wal_status from pg_replication_slots where slot_name = %s",
                         [slot_of(url, STREAM)]).fetchone() == ("reserved",)
        recovered = c.execute("select coalesce(sum(event_count), 0) from pgstream.batches "
                              "where kind = 'recovery'").fetchone()
    assert recovered == (150,)
    check_and_report("slot invalidated by max_slot_wal_keep_size", endpoint, url, time.monotonic() - started)


def _recorded_all(url: str) -> Callable[[], bool]:
    return lambda: set(ledger_order(url)) >= set(sent_ids(url))


def test_out_of_order_commits_straddling_failover(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                                  endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    start(driver)
    early = psycopg.connect(db_url)  # takes the low ids, commits last
    low = [r[0] for r in early.execute(
        "insert into pgstream.events (payload, stream_id) select jsonb_build_object('early', g), 1 "
        "from generate_series(1, 30) g returning id")]
    insert_events(db_url, STREAM, 40)  # higher ids, committed first
    endpoint.mode = "error"
    fail_into_failover(driver, db_url)
    checkpoint = stream_row(db_url)["failover_checkpoint_id"]
    assert checkpoint > max(low)  # an id-range replay from the checkpoint would skip the early ones
    early.commit()  # the low ids commit during the failover
    early.close()
    insert_events(db_url, STREAM, 20, 100)
    tick_failing_until(driver, _recorded_all(db_url), "the events committed during the failover to be recorded")
    endpoint.mode = "ok"
    started = time.monotonic()
    drive(driver, delivered_all(endpoint, db_url))
    assert set(low) <= endpoint.unique()
    order = endpoint.first_seen_order()
    assert order.index(low[0]) > order.index(checkpoint)  # delivered in commit order, not id order
    check_and_report("out-of-order commits straddling failover", endpoint, db_url, time.monotonic() - started)


def test_backlog_spanning_midnight_survives_housekeeping(db_url: str, tmp_path: Path,
                                                         instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    today = dt.datetime.now(dt.UTC).date()
    midnight = dt.datetime.combine(today, dt.time(), dt.UTC)
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.create_partitions(2, %s)", [today - dt.timedelta(days=1)])
    start(driver)
    endpoint.mode = "error"
    with psycopg.connect(db_url) as c:  # a backlog from 23:59:59 yesterday to 00:00:01 today
        backdated(c, "insert into pgstream.events (payload, stream_id, created_at) "
                  "select jsonb_build_object('n', g), 1, %s + (g - 100) * interval '10 milliseconds' "
                  "from generate_series(0, 199) g", [midnight])
    fail_into_failover(driver, db_url)
    yesterday = "events_" + (today - dt.timedelta(days=1)).strftime("%Y%m%d")
    with psycopg.connect(db_url, autocommit=True) as c:
        # "tomorrow + 1" makes yesterday's partition expire under a 1-day retention: it is kept...
        dropped = c.execute("select pgstream.drop_partitions(1, %s)", [today + dt.timedelta(days=1)]).fetchall()
        assert (yesterday,) not in dropped
        # ...and the fail policy refuses to drop anything, naming the stream
        with pytest.raises(psycopg.errors.RaiseException) as err:
            c.execute("select pgstream.drop_partitions(1, %s, 'fail')", [today + dt.timedelta(days=1)])
        assert "undelivered" in str(err.value) and "stream 1" in (err.value.diag.message_detail or "")
    endpoint.mode = "ok"
    started = time.monotonic()
    drive(driver, delivered_all(endpoint, db_url))
    with psycopg.connect(db_url) as c:
        days = c.execute("select count(distinct (created_at at time zone 'UTC')::date) from pgstream.events"
                         ).fetchone()
    assert days == (2,)
    check_and_report("backlog spanning midnight (+ retention edge)", endpoint, db_url, time.monotonic() - started)


def test_run_whose_lease_session_ended_is_failed_at_the_next_tick(db_url: str, tmp_path: Path,
                                                                  instance: dg.DagsterInstance,
                                                                  endpoint: Endpoint,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A run Dagster shows started (the stream's run in mode per_batch, the group delivery run in modes open and
    warm): while it has not taken its delivery lease the tick says so and waits (``run_grace_secs``); once the
    database session that held its lease has ended (its process died) the next tick marks it failed, whatever
    ``run_grace_secs`` says, and the next run delivers."""
    from pgstream_dagster.defs.names import DELIVERY_JOB, GROUP_DELIVERY_JOB
    from pgstream_dagster.engine.ledger import locks

    cfg = stream_config(endpoint, delivery={"chunk_size": 20, "run_grace_secs": 120})
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [cfg]), instance)
    requested: list[dg.RunRequest] = []
    launch = driver.launch_group_run
    if hosted():  # the group delivery run requested is not launched: the test plays the daemon
        monkeypatch.setattr(driver, "launch_group_run", lambda group, request: requested.append(request))
        driver.tick(STREAM)
    else:
        start(driver)
    insert_events(db_url, STREAM, 30)
    if not hosted():
        (request,) = driver.tick(STREAM).run_requests
    else:
        (request,) = requested
    # the requested run, as the daemon launches it: started, its process not yet at its lease
    job = driver.defs.resolve_job_def(GROUP_DELIVERY_JOB if hosted() else DELIVERY_JOB)
    run = instance.create_run_for_job(job, run_config=request.run_config,
                                      tags={**request.tags, "dagster/run_key": request.run_key or ""})
    instance.handle_run_event(run.run_id, dg.DagsterEvent(dg.DagsterEventType.RUN_START.value, job_name=run.job_name))
    held, ended = (("the group's delivery lease", "the group's delivery lease") if hosted() else
                   ("the delivery lease", "its delivery lease"))

    def tick_until_recorded() -> Any:
        deadline = time.monotonic() + 60
        while True:  # (open: the sensor reads the group's slot meanwhile, and hands the batch to the member)
            tick = driver.tick(STREAM)
            if "30 undelivered events in 1 batches" in str(tick.skip_message) or time.monotonic() > deadline:
                return tick
    tick = tick_until_recorded()
    assert not tick.run_requests
    assert tick.skip_message is not None
    waiting = "group delivery run" if hosted() else "stream 1 waiting for run"
    assert re.search(f"30 undelivered events in 1 batches; {waiting} {run.run_id}: started \\d+ s ago, has not "
                     r"taken its delivery lease yet \(run_grace_secs 120\)", tick.skip_message), tick.skip_message
    # its process takes the lease, then dies (kill -9: the session ends, the lease was not given up)
    if hosted():
        lease = locks.acquire_group_lease(db_url, GROUP, run.run_id)
    else:
        lease = locks.acquire_lease(db_url, STREAM, run.run_id)
    tick = driver.tick(STREAM)
    assert not tick.run_requests and f"{run.run_id} (it holds {held})" in str(tick.skip_message), \
        tick.skip_message
    lease.close()
    if hosted():
        monkeypatch.setattr(driver, "launch_group_run", launch)
        # a group run riding out the database's absence takes its lease again a moment after the database is back:
        # the tick looks again for LOST_RECHECK_SECS before it takes the run for dead, and sees it held
        again: list[psycopg.Connection] = []
        taker = threading.Timer(0.5, lambda: again.append(locks.acquire_group_lease(db_url, GROUP, run.run_id)))
        taker.start()
        tick = driver.tick(STREAM)
        taker.join()
        assert not tick.run_requests and "(it took the group's delivery lease again: it rode out the database's " \
            "absence)" in str(tick.skip_message), tick.skip_message
        assert (instance.get_run_by_id(run.run_id) or run).status == dg.DagsterRunStatus.STARTED
        again[0].close()  # and now its process dies
    driver.tick(STREAM)  # marks it failed: the stream enters failover at its batch (retry in 0.5 s)
    dead = instance.get_run_by_id(run.run_id)
    assert dead is not None and dead.status == dg.DagsterRunStatus.FAILURE
    (failure,) = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE).records
    message = failure.event_log_entry.dagster_event.message  # type: ignore[union-attr]
    assert message is not None and f"session holding {ended} has ended" in message, message
    recover = drive(driver, delivered_all(endpoint, db_url), timeout=60)
    check_and_report("run's lease session ended (process died) before run_grace_secs", endpoint, db_url, recover)


def test_postgres_restart_stops_publishing_within_the_publish_call(db_url: str, pg: LocalPostgres, tmp_path: Path,
                                                                   instance: dg.DagsterInstance,
                                                                   endpoint: Endpoint) -> None:
    """A slow receiver, one request per event, the batch in one publish call: Postgres restarts while
    the run (per_batch: the stream's run; open: the member's run in the group delivery run) waits for an
    answer. The run sends nothing more once its ledger connection (which records what the sink confirms) is
    broken: it fails with an error saying so, and the next run resumes after the last confirmation recorded.
    Duplicates: what was sent in that call before the restart."""
    cfg = stream_config(endpoint.sink("per_event"), batch={"max_size": 100, "max_fill_secs": 0},
                        delivery={"chunk_size": 100, "run_grace_secs": 120})
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [cfg]), instance)
    start(driver)
    endpoint.delay = 0.05
    sent_before_restart: list[int] = []
    restarted = threading.Event()

    sent_after: list[float] = []  # when each request after the one the restart held came

    def restart_once(n: int) -> None:
        if n == 10:
            pg.restart()  # while the run waits for this answer
            sent_before_restart.append(len(endpoint.accepted) + 1)  # with this one
            restarted.set()
        elif n > 10:
            sent_after.append(time.time())
    endpoint.hook = restart_once
    insert_events(db_url, STREAM, 100)
    if hosted():
        _tick_through_outage(driver, restarted.is_set)
        # the group run that hosted the member's run rides the restart out: the member's run stopped publishing, in
        # one line saying why, and is hosted again once Postgres is back (no failure counted: nothing of the sink)
        (hosting,) = driver.group_runs[GROUP]
        hosting_id = hosting.run_id
        assert hosting_id is not None

        def stopped() -> list[dg.EventLogEntry]:
            return [e for e in instance.all_logs(hosting_id)
                    if "member run" in e.user_message and "stopped (" in e.user_message]
        deadline = time.monotonic() + 60
        while not stopped():
            assert time.monotonic() < deadline and hosting.thread.is_alive(), "the member's run did not stop"
            time.sleep(0.1)
        (entry,) = stopped()
        message = entry.user_message
        # nothing sent after the request it waited for until it stopped (the run hosted again sends afterwards)
        assert not sent_after or sent_after[0] > entry.timestamp, (sent_after[:3], entry.timestamp)
    else:
        (request,) = driver.tick(STREAM).run_requests
        result = driver.execute(request)
        assert not result.success
        (failure,) = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
        message = failure.step_failure_data.error.message if failure.step_failure_data.error else ""
        assert endpoint.requests == 10, endpoint.requests  # nothing sent after the request it waited for
    endpoint.hook = None
    assert "the run's ledger connection is broken" in message and "stopped publishing" in message, message
    endpoint.delay = 0
    recover = _tick_through_outage(driver, delivered_all(endpoint, db_url))
    assert endpoint.duplicates() <= sent_before_restart[0], (endpoint.duplicates(), sent_before_restart)
    assert not hosted() or len(driver.group_runs[GROUP]) == 1, "the group run did not ride the restart out"
    check_and_report("Postgres restarted mid-call (per_event, slow receiver)", endpoint, db_url, recover)
