"""The ingest stage (engine/ingest/): one recording loop and one batching rule for both sources (a peek,
the replication protocol), and the slot's declared reader (``pgstream.streams.slot_reader``): the
sensor reads only when it is the declared reader, the reader changes in the same UPDATE as the open
run, and a run killed while it reads leaves the slot to the sensor through the state machine."""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.config import StreamConfig, load_config
from pgstream_dagster.engine import batches, ingest, replication
from pgstream_dagster.engine.batches import CloseRun, GiveSlotBack, RunStatus, RunView, TakeSlot
from pgstream_dagster.engine.ingest.recorder import Batching, Pending
from pgstream_dagster.engine.ledger import recording, streams
from pgstream_dagster.engine.ledger import state as ledger_state
from pgstream_dagster.engine.replication import DecodedEvent, Transaction
from pgstream_dagster.engine.status import render_status, stream_status

from .support import reader_child
from .support.endpoint import Endpoint
from .support.faults import delivered_all, drive, sent_ids, stream_config
from .support.harness import Driver, insert_events, slot_of, tick_until, write_config

RUN_KEY = "test-run"
NOW = dt.datetime(2026, 3, 4, 12, 0, 0, tzinfo=dt.UTC)


def _streams(tmp_path: Path, url: str, batch: dict[str, Any], ids: tuple[int, ...] = (1,),
             **delivery: Any) -> list[StreamConfig]:
    config = load_config(write_config(tmp_path / "pgstream.yaml", url, [
        {"id": i, "batch": batch, "delivery": {"mode": "open", "tuning": {"linger_secs": 60}, **delivery},
         "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in ids]))
    with psycopg.connect(url, autocommit=True) as c:
        for stream in config.streams:
            replication.create_slot(c, streams.ensure_stream(c, stream.id))
    return list(config.streams)


def _wait(done: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _batches(url: str, stream_id: int) -> list[list[int]]:
    """The stream's batches, each as its events' ordinals among the stream's events (ids differ by stream)."""
    with psycopg.connect(url) as c:
        ids = [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id",
                                       [stream_id])]
        rank = {e: i for i, e in enumerate(ids)}
        return [[rank[e] for e in r[0]] for r in c.execute(
            "select event_ids from pgstream.batches where stream_id = %s order by id", [stream_id])]


def _recorded(url: str, stream_id: int) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select unnest(event_ids) from pgstream.batches where stream_id = %s "
                                        "order by id", [stream_id])]


def _events(url: str, stream_id: int) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id",
                                        [stream_id])]


def _reader_row(url: str, stream_id: int) -> tuple[Any, ...]:
    with psycopg.connect(url) as c:
        row = c.execute("select open_run_key, slot_reader from pgstream.streams where id = %s", [stream_id]).fetchone()
    assert row is not None
    return tuple(row)


# --- one batching rule ------------------------------------------------------------------------------

def _txn(events: int, commit: dt.datetime, row_bytes: int = 0) -> Transaction:
    return Transaction(xid=5, commit_time=commit,
                       events=[DecodedEvent(i, commit, (1, "{}", None, row_bytes) if row_bytes else None)
                               for i in range(events)])


RULE = Batching(max_size=10, max_fill_secs=2.0, max_bytes=1000)


@pytest.mark.parametrize(("txns", "drained", "since_record", "due"), [
    ([], True, 9.0, False),  # nothing waits
    ([_txn(10, NOW)], False, 0.0, True),  # max_size events wait
    ([_txn(4, NOW), _txn(6, NOW)], False, 0.0, True),
    ([_txn(3, NOW, row_bytes=400)], False, 0.0, True),  # max_bytes of kept rows wait
    ([_txn(3, NOW - dt.timedelta(seconds=2))], False, 0.0, True),  # the oldest committed max_fill_secs ago
    ([_txn(3, NOW)], False, 9.0, False),  # more is coming, not full, not old: it waits
    ([_txn(3, NOW)], True, 9.0, True),  # the source sent everything committed: recorded now
    ([_txn(3, NOW)], True, 0.01, False),  # ... but at most every RECORD_EVERY_SECS
    ([_txn(0, NOW)], False, 0.0, True),  # only empty transactions: confirmed at once
])
def test_the_batching_rule(txns: list[Transaction], drained: bool, since_record: float, due: bool) -> None:
    pending = Pending()
    pending.add(txns)
    assert RULE.due(pending, drained=drained, now=NOW, since_record=since_record) is due


@pytest.mark.parametrize("batch", [{"max_size": 7, "max_fill_secs": 3600}, {"max_size": 50, "max_fill_secs": 0},
                                   {"max_size": 1, "max_fill_secs": 0.5}])
def test_the_same_batch_settings_give_the_same_batches_through_both_sources(
        db_url: str, tmp_path: Path, batch: dict[str, Any]) -> None:
    """Stream 1 is read by the sensor (a peek), stream 2 by an open run's reader (the replication
    protocol), the same transactions committed on each, one at a time: the same batches, event for
    event (a peek sees a backlog at once, a stream as it arrives: what one recording holds may differ
    then, but never how it is cut)."""
    peeked, streamed = _streams(tmp_path, db_url, batch, ids=(1, 2))
    with psycopg.connect(db_url, autocommit=True) as c:
        ledger_state.open_run(c, streamed.id, RUN_KEY)
    stop, stats = threading.Event(), ingest.FollowStats()
    reader = threading.Thread(target=ingest.follow, args=(db_url, streamed, RUN_KEY, stop, stats),
                              kwargs={"application_name": "pgstream reader t"})
    reader.start()
    total = 0
    try:
        with psycopg.connect(db_url, autocommit=True) as c:
            for n, size in enumerate([1, 5, 12, 3, 30, 2, 9]):  # one transaction each
                for stream in (peeked, streamed):
                    insert_events(db_url, stream.id, size, 100 * n)
                total += size
                while len(_recorded(db_url, peeked.id)) < total:
                    assert not ingest.consume(c, peeked, 1.0).slot_busy
                _wait(lambda total=total: stats.events >= total)
    finally:
        stop.set()
        reader.join(timeout=10)
    assert stats.events == total == 62 and stats.batches == len(_batches(db_url, 2))
    assert _batches(db_url, 1) == _batches(db_url, 2)
    size = batch["max_size"]
    assert [len(b) for b in _batches(db_url, 1)] == [len(t[i:i + size]) for t in
                                                     [[0] * n for n in [1, 5, 12, 3, 30, 2, 9]]
                                                     for i in range(0, len(t), size)]


# --- the declared reader ----------------------------------------------------------------------------

def test_the_sensor_backs_off_while_another_connection_still_holds_its_slot(db_url: str, tmp_path: Path) -> None:
    """The sensor is the declared reader, but a reader that has not seen the change yet (a closed run's,
    between two looks at the ledger) still streams the slot: the sensor's tick backs off (SlotBusy),
    records nothing and touches nothing, and records every event once when the slot is let go."""
    (stream,) = _streams(tmp_path, db_url, {"max_size": 100, "max_fill_secs": 0})
    insert_events(db_url, 1, 20)
    stale = ingest.StreamSource(db_url, slot_of(db_url, 1), stream.publication, "stale reader",
                                max_bytes=stream.delivery.tuning.max_read_bytes)
    with psycopg.connect(db_url, autocommit=True) as c:
        try:
            assert ledger_state.slot_reader(c, 1) == ledger_state.SENSOR
            result = ingest.consume(c, stream, 0.3)
            assert result.slot_busy and not result.batches and result.events == 0
            assert _recorded(db_url, 1) == []
        finally:
            stale.close()

        def ticked() -> bool:
            ingest.consume(c, stream, 0.3)
            return len(_recorded(db_url, 1)) >= 20

        _wait(ticked)
    assert sorted(_recorded(db_url, 1)) == _recorded(db_url, 1) and len(set(_recorded(db_url, 1))) == 20


def test_the_sensor_does_not_read_while_a_run_is_the_declared_reader(db_url: str, tmp_path: Path) -> None:
    (stream,) = _streams(tmp_path, db_url, {"max_size": 100, "max_fill_secs": 0})
    with psycopg.connect(db_url, autocommit=True) as c:
        assert ledger_state.slot_reader(c, 1) == ledger_state.SENSOR
        ledger_state.open_run(c, 1, RUN_KEY)
        insert_events(db_url, 1, 20)
        confirmed = c.execute("select confirmed_flush_lsn from pg_replication_slots where slot_name = %s",
                              [slot_of(db_url, 1)]).fetchone()
        for _ in range(3):
            result = ingest.consume(c, stream, 0.3)
            assert result.slot_busy and not result.batches and result.events == 0
        # it did not touch the slot either
        assert c.execute("select confirmed_flush_lsn from pg_replication_slots where slot_name = %s",
                         [slot_of(db_url, 1)]).fetchone() == confirmed
        assert _recorded(db_url, 1) == []
        # the operator sees who is to read it
        assert f"open run: {RUN_KEY} (the slot's declared reader; its reader is not reading yet)" in \
            render_status(stream_status(c, 1))
        # the run closes: the sensor reads again, from where the slot was
        assert ledger_state.apply_run(c, CloseRun(1, RUN_KEY))
        assert ledger_state.slot_reader(c, 1) == ledger_state.SENSOR
        assert ingest.consume(c, stream, 1.0).events == 20
    assert _recorded(db_url, 1) == _events(db_url, 1)


def test_the_declared_reader_changes_with_the_open_run(db_url: str, tmp_path: Path) -> None:
    """Opening, replacing, failing and closing the open run go through batches.decide / ledger.state.apply
    (the sensor's) and ledger.state.apply_run (the run's: CloseRun, TakeSlot, GiveSlotBack);
    an opened run becomes the slot's reader when its reader takes the slot (the sensor reads until
    then: no moment without a reader), and ending it gives the slot back in the same UPDATE; the
    database refuses a run as reader that is not the open run."""
    (stream,) = _streams(tmp_path, db_url, {"max_size": 5, "max_fill_secs": 0})
    insert_events(db_url, 1, 12)
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume(c, stream, 1.0)

        def decide_and_apply(view: RunView) -> Any:
            state = ledger_state.stream_state(c, 1, stream.delivery.max_events_per_run)
            action = batches.decide(state, view, dt.datetime.now(dt.UTC), stream)
            ledger_state.apply(c, stream, action)
            return action

        launch = decide_and_apply(batches.NO_RUN)
        assert isinstance(launch, batches.Launch) and launch.keep_open
        key = launch.order.run_key
        assert _reader_row(db_url, 1) == (key, ledger_state.SENSOR)  # a run queued or starting: the sensor reads
        assert ledger_state.apply_run(c, TakeSlot(1, key))  # its reader began
        assert _reader_row(db_url, 1) == (key, f"run:{key}")
        # the run failed: failover, the open run forgotten, the slot the sensor's, in one transaction
        failed = decide_and_apply(RunView(RunStatus.FAILED, "r1", "FAILURE", "boom"))
        assert isinstance(failed, batches.FailRun)
        assert _reader_row(db_url, 1) == (None, ledger_state.SENSOR)
        # a run that does not read the slot (delivery.tuning.read_slot: false) leaves it to the sensor
        ledger_state.launch(c, 1, (), "other-run", keep_open=True, reads_slot=False)
        assert _reader_row(db_url, 1) == ("other-run", ledger_state.SENSOR)
        # the reader cannot read for a while: it gives the slot back, then takes it again
        assert ledger_state.apply_run(c, TakeSlot(1, "other-run"))
        assert _reader_row(db_url, 1) == ("other-run", "run:other-run")
        assert not ledger_state.apply_run(c, TakeSlot(1, "not-open"))  # refused: not the open run
        assert ledger_state.apply_run(c, GiveSlotBack(1, "other-run"))
        assert _reader_row(db_url, 1) == ("other-run", ledger_state.SENSOR)
        assert not ledger_state.apply_run(c, GiveSlotBack(1, "other-run"))  # refused: not the reader any more
        # only the open run may be the reader, whoever writes the row
        with pytest.raises(psycopg.errors.CheckViolation):
            c.execute("update pgstream.streams set slot_reader = 'run:not-open' where id = 1")
        ledger_state.apply_run(c, TakeSlot(1, "other-run"))
        with pytest.raises(psycopg.errors.CheckViolation):
            c.execute("update pgstream.streams set open_run_key = null where id = 1")
        ledger_state.clear_open_run(c, 1, "other-run")
        assert _reader_row(db_url, 1) == (None, ledger_state.SENSOR)


def test_a_killed_runs_slot_returns_to_the_sensor(db_url: str, tmp_path: Path) -> None:
    """The open run's reader is killed (-9) while it reads: the slot stays declared to the run, the
    sensor does not read; once the sensor's decision sees the run dead, the slot is the sensor's again
    and it records what committed meanwhile: every event once."""
    (stream,) = _streams(tmp_path, db_url, {"max_size": 50, "max_fill_secs": 0})
    with psycopg.connect(db_url, autocommit=True) as c:
        ledger_state.open_run(c, 1, RUN_KEY)
    child = multiprocessing.get_context("spawn").Process(target=reader_child.follow,
                                                         args=(db_url, str(tmp_path / "pgstream.yaml"), RUN_KEY))
    child.start()
    insert_events(db_url, 1, 40)
    _wait(lambda: len(_recorded(db_url, 1)) == 40)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    insert_events(db_url, 1, 30, 1000)  # committed after the reader died
    assert _reader_row(db_url, 1) == (RUN_KEY, f"run:{RUN_KEY}")
    with psycopg.connect(db_url, autocommit=True) as c:
        _wait(lambda: c.execute("select active from pg_replication_slots where slot_name = %s",
                                [slot_of(db_url, 1)]).fetchone() == (False,))
        assert ingest.consume(c, stream, 0.3).slot_busy
        # every batch recorded was handed to the run, delivered by nobody: mark them delivered so the
        # stream's head is empty, as after a run that delivered everything and then died
        for (batch_id,) in c.execute("select id from pgstream.batches where stream_id = 1").fetchall():
            ledger_state.mark_delivered(c, batch_id, "r1")
        state = ledger_state.stream_state(c, 1, stream.delivery.max_events_per_run)
        action = batches.decide(state, RunView(RunStatus.DEAD, "r1", "FAILURE", "its process died"),
                                dt.datetime.now(dt.UTC), stream)
        assert action == batches.ReclaimSlot(RUN_KEY, "stream 1: open run r1 ended (FAILURE); the sensor reads "
                                                      "the slot")
        ledger_state.apply(c, stream, action)
        assert _reader_row(db_url, 1) == (RUN_KEY, ledger_state.SENSOR)
        assert ingest.consume(c, stream, 1.0).events == 30
    recorded = _recorded(db_url, 1)
    assert len(recorded) == len(set(recorded)) == 70 and recorded == _events(db_url, 1)


_RUN_SCRIPT = """
import json, sys
import dagster as dg
from pgstream_dagster.defs.names import DELIVERY_JOB
from pgstream_dagster.defs.location import build_definitions
config_path, storage_url, home, request = sys.argv[1:5]
request = json.loads(request)
with dg.instance_for_test(overrides={"storage": {"postgres": {"postgres_url": storage_url}}}, temp_dir=home) as inst:
    job = build_definitions(__import__("pathlib").Path(config_path)).resolve_job_def(DELIVERY_JOB)
    job.execute_in_process(run_config=request["run_config"], instance=inst, tags=request["tags"],
                           raise_on_error=False)
"""


def _reading(url: str) -> bool:
    with psycopg.connect(url) as c:
        row = c.execute("select a.application_name from pg_replication_slots s join pg_stat_activity a "
                        "on a.pid = s.active_pid where s.slot_name = %s", [slot_of(url, 1)]).fetchone()
    return row is not None and str(row[0]).startswith("pgstream reader ")


def test_an_open_run_killed_while_it_reads_leaves_the_slot_to_the_sensor_and_loses_nothing(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, dagster_storage_url: str,
        endpoint: Endpoint) -> None:
    """Through Dagster: an open run is the slot's declared reader from its launch; its process is
    killed (-9) while it reads; what commits then is read by nobody until the sensor sees the run dead,
    fails it (the slot back to the sensor in the same transaction) and launches the next run. Every
    event reaches the sink, the declared reader ends with the sensor."""
    config_path = write_config(tmp_path / "pgstream.yaml", db_url, [
        stream_config(endpoint, delivery={"chunk_size": 20, "run_grace_secs": 2, "mode": "open",
                                                    "tuning": {"linger_secs": 5, "max_run_secs": 2}})])
    driver = Driver(config_path, instance)
    driver.tick(1)
    insert_events(db_url, 1, 100)
    (request,) = tick_until(driver, 1, lambda: _reader_row(db_url, 1)[0] is not None)
    assert _reader_row(db_url, 1) == (request.run_key, ledger_state.SENSOR)  # not started: the sensor reads
    (tmp_path / "home").mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_SCRIPT, str(config_path), dagster_storage_url, str(tmp_path / "home"),
         json.dumps({"run_config": request.run_config, "tags": {**request.tags, "dagster/run_key": request.run_key}})],
        env={**os.environ}, start_new_session=True)
    try:
        _wait(lambda: _reading(db_url) and len(endpoint.unique()) >= 100, timeout=240)
        insert_events(db_url, 1, 50, 1000)  # recorded by the run's reader, not the sensor
        _wait(lambda: len(endpoint.unique()) >= 150, timeout=60)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with psycopg.connect(db_url) as c:
        keys = {r[0] for r in c.execute("select distinct run_key from pgstream.batches")}
    assert keys == {request.run_key}  # every batch so far was handed to the run
    insert_events(db_url, 1, 40, 2000)  # committed after the run died: nobody reads them yet
    assert _reader_row(db_url, 1) == (request.run_key, f"run:{request.run_key}")
    drive(driver, delivered_all(endpoint, db_url), timeout=240)
    (run,) = instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": request.run_key or ""}))
    assert run.status == dg.DagsterRunStatus.FAILURE  # the sensor saw its lease gone and failed it
    sent = sent_ids(db_url)
    assert len(sent) == 190 and endpoint.unique() == set(sent)
    assert sorted(_recorded(db_url, 1)) == sent  # each event recorded once
    _wait(lambda: _reader_row(db_url, 1) == (None, ledger_state.SENSOR), timeout=30)


def test_one_pass_records_several_streams_ledgers(db_url: str, tmp_path: Path) -> None:
    """The recorder's pass takes a map stream id -> ledger (issue 30: one reader for several streams):
    each stream's transactions go to its own ledger, cut by its own max_size, in one database
    transaction; a stream whose declared reader is no longer the loop's records nothing, and says so."""
    s1, s2 = _streams(tmp_path, db_url, {"max_size": 4, "max_fill_secs": 0}, ids=(1, 2))
    insert_events(db_url, 1, 6)
    insert_events(db_url, 2, 3)
    with psycopg.connect(db_url, autocommit=True) as c:
        def read(stream: StreamConfig) -> list[Transaction]:
            return ingest.PeekSource(c, slot_of(db_url, stream.id), stream.publication, 1000).read(0)

        ledgers = {1: ingest.StreamLedger(s1, ledger_state.SENSOR), 2: ingest.StreamLedger(s2, ledger_state.SENSOR)}
        assert ingest.record_pass(c, ledgers, {1: read(s1), 2: read(s2)}) == set()
        assert _batches(db_url, 1) == [[0, 1, 2, 3], [4, 5]] and _batches(db_url, 2) == [[0, 1, 2]]
        assert (ledgers[1].events, ledgers[2].events) == (6, 3)
        # read again (nothing confirmed): what the ledgers hold is not recorded twice
        assert ingest.record_pass(c, ledgers, {1: read(s1), 2: read(s2)}) == set()
        assert len(_recorded(db_url, 1)) == 6 and len(_recorded(db_url, 2)) == 3
        # stream 2's run became its reader: stream 2 records nothing in the pass, stream 1 does
        ledger_state.open_run(c, 2, RUN_KEY)
        insert_events(db_url, 1, 2, 100)
        insert_events(db_url, 2, 2, 100)
        assert ingest.record_pass(c, ledgers, {1: read(s1), 2: read(s2)}) == {2}
        assert len(_recorded(db_url, 1)) == 8 and len(_recorded(db_url, 2)) == 3


def test_a_recording_pass_is_one_transaction_without_savepoints(db_url: str, tmp_path: Path) -> None:
    """The reader's recording pass (the batches, then the hand-over to the open run) is one database
    transaction: the ledger functions it calls take the caller's transaction, without a SAVEPOINT and
    its RELEASE each (two round trips per function, on the reader's path); called alone, each is still a
    transaction of its own."""
    (stream,) = _streams(tmp_path, db_url, {"max_size": 4, "max_fill_secs": 0})
    insert_events(db_url, 1, 6)
    trace = tmp_path / "trace.txt"
    with psycopg.connect(db_url, autocommit=True) as c, trace.open("w") as out:
        ledger_state.open_run(c, 1, RUN_KEY)
        ledger_state.apply_run(c, TakeSlot(1, RUN_KEY))
        txns = ingest.PeekSource(c, slot_of(db_url, 1), stream.publication, 1000).read(0)
        c.pgconn.trace(out.fileno())
        target = ingest.StreamLedger(stream, ledger_state.run_reader(RUN_KEY), run_key=RUN_KEY)
        assert ingest.record_pass(c, {1: target}, {1: txns}) == set()
        c.pgconn.untrace()
    sent = trace.read_text()
    assert "pgstream.batches" in sent and "BEGIN" in sent and "COMMIT" in sent
    assert "SAVEPOINT" not in sent.upper(), [line for line in sent.splitlines() if "SAVEPOINT" in line.upper()]
    assert len(_recorded(db_url, 1)) == 6
    with psycopg.connect(db_url, autocommit=True) as c:  # alone: a transaction of its own
        assert [b.run_key for b in ledger_state.batches_between(c, 1, 0, 10**9)] == [RUN_KEY, RUN_KEY]
        insert_events(db_url, 1, 2, 100)
        recording.record(c, 1, ingest.PeekSource(c, slot_of(db_url, 1), stream.publication, 1000).read(0)[-1:], 4)
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert len(_recorded(db_url, 1)) == 8
