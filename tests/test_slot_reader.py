"""An open run reads its stream's slot over the replication protocol (``delivery.tuning.read_slot``):
events reach the sink with no sensor tick in between, the sensor only decides while the run holds
the slot, and takes over when the run closes or dies. Killed between recording and confirming,
or with the slot dropped under it, nothing is lost and nothing is recorded twice."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import psycopg.sql
import pytest

from pgstream_dagster.config import load_config
from pgstream_dagster.defs.names import WARM_TAG
from pgstream_dagster.engine import handoff, ingest, migrations, replication, spark
from pgstream_dagster.engine.batches import BatchStatus, CloseRun
from pgstream_dagster.engine.delivery import sources
from pgstream_dagster.engine.ledger import recording, state, streams
from pgstream_dagster.engine.publish import owed_spans
from pgstream_dagster.engine.status import render_status, stream_status
from pgstream_dagster.sinks import Event

from .support import reader_child
from .support.endpoint import Endpoint
from .support.faults import sent_ids
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
RUN_KEY = "test-run"


def _config(endpoint: Endpoint, linger: float, mode: str = "open", **tuning: Any) -> dict[str, Any]:
    return {"id": STREAM, "batch": {"max_size": 50, "max_fill_secs": 0.2}, "sensor": {"tick_budget_secs": 0.3},
            "delivery": {"mode": mode, "chunk_size": 20, "tuning": {"linger_secs": linger, **tuning}},
            "sink": endpoint.sink()}


def _slot_reader(url: str) -> str | None:
    """The application name of the connection that holds the stream's slot, if any."""
    with psycopg.connect(url) as c:
        row = c.execute("select a.application_name from pg_replication_slots s "
                        "join pg_stat_activity a on a.pid = s.active_pid where s.slot_name = %s",
                        [slot_of(url, STREAM)]).fetchone()
    return row[0] if row else None


def _wait(done: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _ledger_ids(url: str) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select unnest(event_ids) from pgstream.batches where stream_id = %s "
                                        "order by id", [STREAM])]


def test_open_run_reads_the_slot_and_delivers_without_sensor_ticks(db_url: str, tmp_path: Path,
                                                                   instance: dg.DagsterInstance,
                                                                   endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint, linger=3)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 30)
    (request,) = tick_until(driver, STREAM, lambda: False if not driver.cursors else _launched(db_url), timeout=60) \
        or [None]  # type: ignore[list-item]
    assert request is not None
    run = Background(driver, request)
    _wait(lambda: (_slot_reader(db_url) or "").startswith("pgstream reader "))
    # from now on no tick: the run records, hands itself and delivers what commits
    for wave in range(5):  # a round each
        insert_events(db_url, STREAM, 40, 1000 * (wave + 1))
        _wait(lambda wave=wave: len(endpoint.unique()) >= 70 + 40 * wave)
    # a tick meanwhile finds the slot in use, reads nothing and requests nothing
    tick = driver.tick(STREAM)
    assert not tick.run_requests
    with psycopg.connect(db_url) as c:  # the operator sees who reads the slot
        assert f"open run: {request.run_key} (it reads the slot: " in render_status(stream_status(c, STREAM))
    result = run.wait(timeout=60)  # idle for linger_secs: it stops reading, closes and succeeds
    assert result.success
    sent = sent_ids(db_url)
    assert len(sent) == 230
    assert endpoint.unique() == set(sent) and endpoint.duplicates() == 0
    assert endpoint.first_seen_order() == sent
    assert sorted(_ledger_ids(db_url)) == sorted(sent)  # each event recorded once
    with psycopg.connect(db_url) as c:
        keys = Counter(r[0] for r in c.execute("select run_key from pgstream.batches"))
        assert set(keys) == {request.run_key} and keys[request.run_key] >= 2  # the run recorded and took them
        assert c.execute("select count(*) from pgstream.batches where status <> %s",
                         [BatchStatus.DELIVERED]).fetchone() == (0,)
        assert c.execute("select open_run_key from pgstream.streams where id = %s", [STREAM]).fetchone() == (None,)
    # every round is in a materialization, but a materialization holds the rounds of report_every_secs
    rounds = run_metadata(result, "ASSET_MATERIALIZATION")
    assert sum(m["events"] for m in rounds) == 230
    assert sum(m["rounds"] for m in rounds) >= 6 > len(rounds) >= 2
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert any(f"this open run reads slot {slot_of(db_url, STREAM)}" in m for m in logs)
    # the 200 it recorded, it delivered as it read them: not one read back from the table
    assert any(f"stopped reading slot {slot_of(db_url, STREAM)}: 200 events recorded" in m and
               "; 200 of the events delivered were taken as read" in m for m in logs)
    assert _slot_reader(db_url) is None

    # closed: the sensor reads the slot again and requests a new run for what commits next
    insert_events(db_url, STREAM, 5, 9000)
    requests = tick_until(driver, STREAM, lambda: _launched(db_url))
    assert len(requests) == 1 and requests[0].run_key != request.run_key
    assert driver.execute(requests[0]).success
    assert endpoint.unique() == set(sent_ids(db_url)) and endpoint.duplicates() == 0


def test_the_cursor_and_the_status_asset_follow_what_the_open_runs_reader_records(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """The sensor's cursor and the status asset's cursor_last_event_id / cursor_last_lsn are the
    ledger's: while the open run reads the slot (no sensor reads), they advance with what it records."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint, linger=2)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 10)
    (request,) = tick_until(driver, STREAM, lambda: _launched(db_url), timeout=60)
    run = Background(driver, request)
    _wait(lambda: (_slot_reader(db_url) or "").startswith("pgstream reader "))
    insert_events(db_url, STREAM, 20, 1000)  # recorded by the run's reader only
    _wait(lambda: len(endpoint.unique()) >= 30)
    last_id = max(sent_ids(db_url))
    with psycopg.connect(db_url) as c:
        row = c.execute("select end_lsn::text from pgstream.batches where stream_id = %s order by end_lsn desc "
                        "limit 1", [STREAM]).fetchone()
    assert row is not None
    tick = driver.tick(STREAM)
    assert not tick.run_requests
    cursor = json.loads(tick.cursor or "{}")
    assert (cursor["last_event_id"], cursor["last_lsn"]) == (last_id, row[0])
    seen = driver.observations[-1].metadata
    assert (seen["cursor_last_event_id"].value, seen["cursor_last_lsn"].value) == (last_id, row[0])
    result = run.wait(timeout=60)
    assert result.success
    # the run's own observations show the ledger's cursor too
    observed = run_metadata(result, "ASSET_OBSERVATION")
    assert observed and observed[-1]["cursor_last_event_id"] == last_id


def _event_rows(read: Iterable[tuple[int, int, Any]], as_json: bool = False) -> list[tuple[Any, ...]]:
    """(batch, ordinal, id, stream, created_at, payload, metadata[, JSON]) of each event read (none too large)."""
    rows: list[tuple[Any, ...]] = []
    for batch, ordinal, event in read:
        assert isinstance(event, Event)
        rows.append((batch, ordinal, event.id, event.stream_id, event.created_at, event.payload_json,
                     event.metadata_json, *([event.to_json()] if as_json else [])))
    return rows


def _launched(url: str) -> bool:
    with psycopg.connect(url) as c:
        return c.execute("select count(*) from pgstream.batches where status = %s",
                         [BatchStatus.LAUNCHED]).fetchone() != (0,)


# --- the engine's reader, without Dagster --------------------------------------------------------------

def _engine_stream(tmp_path: Path, url: str) -> Any:
    config = load_config(write_config(tmp_path / "pgstream.yaml", url, [
        {"id": STREAM, "batch": {"max_size": 100, "max_fill_secs": 0.2}, "delivery": {"tuning": {"linger_secs": 60}},
         "sink": {"type": "file", "path": str(tmp_path / "out.jsonl")}}]))
    return config.streams[0]


def _open_stream(url: str) -> None:
    """The stream, its slot and an open run ``RUN_KEY`` (as the sensor leaves them when it launches one)."""
    with psycopg.connect(url, autocommit=True) as c:
        replication.create_slot(c, streams.ensure_stream(c, STREAM))
        state.open_run(c, STREAM, RUN_KEY)


def _writer(url: str, stop: threading.Event, written: list[int]) -> None:
    n = 0
    with psycopg.connect(url, autocommit=True) as c:
        while not stop.is_set():
            written += [r[0] for r in c.execute(
                "insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g), %s "
                "from generate_series(%s::int, %s::int) g returning id", [STREAM, n, n + 24])]
            n += 25
            time.sleep(0.005)


def _catch_up_with_sensor(url: str, stream: Any) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        state.clear_open_run(c, STREAM, RUN_KEY)
        for _ in range(50):
            result = ingest.consume(c, stream, 0.5)
            if not result.batches and not result.slot_busy:
                return
        raise AssertionError("the sensor did not catch up")


def test_reader_killed_while_recording_loses_nothing_and_records_nothing_twice(db_url: str, tmp_path: Path) -> None:
    stream = _engine_stream(tmp_path, db_url)
    _open_stream(db_url)
    stop = threading.Event()
    written: list[int] = []
    writer = threading.Thread(target=_writer, args=(db_url, stop, written))
    writer.start()
    try:
        for _round in range(3):  # kill -9 the reading process three times mid-stream
            before = len(_ledger_ids(db_url))
            child = multiprocessing.get_context("spawn").Process(
                target=reader_child.follow, args=(db_url, str(tmp_path / "pgstream.yaml"), RUN_KEY))
            child.start()
            _wait(lambda before=before: len(_ledger_ids(db_url)) >= before + 300)
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)
            child.join()
        _wait(lambda: _slot_reader(db_url) is None)  # the server noticed: the slot is free again
    finally:
        stop.set()
        writer.join()
    # in the meantime the reader confirmed only what it had recorded: the sensor finds the rest
    _catch_up_with_sensor(db_url, stream)
    recorded = _ledger_ids(db_url)
    assert len(recorded) == len(set(recorded))  # none twice
    assert set(recorded) == set(written) and len(written) > 900  # none lost


def _start_reader(url: str, tmp_path: Path) -> tuple[Any, threading.Thread, threading.Event, ingest.FollowStats]:
    """The stream with an open run, and :func:`ingest.follow` for it in a thread ("pgstream reader t")."""
    stream = _engine_stream(tmp_path, url)
    _open_stream(url)
    stop, stats = threading.Event(), ingest.FollowStats()
    reader = threading.Thread(target=ingest.follow, args=(url, stream, RUN_KEY, stop, stats),
                              kwargs={"application_name": "pgstream reader t"})
    reader.start()
    return stream, reader, stop, stats


def test_reader_hands_batches_to_its_run_confirms_and_stops_when_the_run_closes(db_url: str, tmp_path: Path) -> None:
    stream, reader, _stop, stats = _start_reader(db_url, tmp_path)
    _wait(lambda: _slot_reader(db_url) == "pgstream reader t")
    with psycopg.connect(db_url, autocommit=True) as c:
        # the sensor's peek meanwhile: the slot is in use, nothing is read twice
        busy = ingest.consume(c, stream, 0.1)
        assert busy.slot_busy and not busy.batches
        insert_events(db_url, STREAM, 250)
        _wait(lambda: stats.events == 250)
        batches = c.execute("select status, run_key, event_count from pgstream.batches order by id").fetchall()
        assert {(s, k) for s, k, _n in batches} == {(BatchStatus.LAUNCHED, RUN_KEY)}
        assert sum(n for _s, _k, n in batches) == 250 and max(n for _s, _k, n in batches) <= 100
        # confirmed after recording: the slot's position is past the last batch
        (confirmed,) = c.execute("select confirmed_flush_lsn::text from pg_replication_slots "
                                 "where slot_name = %s", [slot_of(db_url, STREAM)]).fetchone()  # type: ignore[misc]
        assert replication.lsn_to_int(confirmed) >= (recording.last_end_lsn(c, STREAM) or 0)
        # the reader records how far it has read (retention keeps what it has not)
        _wait(lambda: c.execute("select consumed_through > now() - interval '10 seconds' from pgstream.streams "
                                "where id = %s", [STREAM]).fetchone() == (True,))
        # the run closes: the reader sees it and lets go of the slot
        for b in [r[0] for r in c.execute("select id from pgstream.batches")]:
            state.mark_delivered(c, b, "r")
        assert state.apply_run(c, CloseRun(STREAM, RUN_KEY))
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert _slot_reader(db_url) is None
    insert_events(db_url, STREAM, 5, 1000)
    with psycopg.connect(db_url, autocommit=True) as c:
        assert sum(len(b) for b in [ingest.consume(c, stream, 2.0).batches]) >= 1  # the sensor reads again
    assert sorted(_ledger_ids(db_url)) == sorted(r for r in _all_ids(db_url))


def _all_ids(url: str) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s", [STREAM])]


def test_reader_survives_its_slot_being_dropped(db_url: str, tmp_path: Path) -> None:
    stream, reader, stop, stats = _start_reader(db_url, tmp_path)
    try:
        _wait(lambda: _slot_reader(db_url) == "pgstream reader t")
        insert_events(db_url, STREAM, 120)
        _wait(lambda: stats.events == 120)
        with psycopg.connect(db_url, autocommit=True) as c:
            # an operator (or max_slot_wal_keep_size) takes the slot away: end the walsender, drop it
            slot = slot_of(db_url, STREAM)
            c.execute("select pg_terminate_backend(active_pid) from pg_replication_slots where slot_name = %s", [slot])
            _wait(lambda: _slot_reader(db_url) is None)
            c.execute("select pg_drop_replication_slot(%s)", [slot])
            insert_events(db_url, STREAM, 80, 1000)  # written while no slot exists
            _wait(lambda: any(slot in n for n in stats.notes))
            # the sensor's next tick replaces the slot and recovers what no batch covers from the table
            result = ingest.consume(c, stream, 0.5)
            assert result.slot_created and result.recovered
        insert_events(db_url, STREAM, 60, 2000)  # the reader reads the new slot
        _wait(lambda: len(_ledger_ids(db_url)) == 260)
        _wait(lambda: _slot_reader(db_url) == "pgstream reader t")
        # its ledger connection breaks (a database restart, an operator's pg_terminate_backend): it reconnects
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                      "where application_name = 'pgstream reader t' and backend_type = 'client backend'")
        _wait(lambda: any("lost its database connection" in n for n in stats.notes))
        insert_events(db_url, STREAM, 40, 3000)
        _wait(lambda: len(_ledger_ids(db_url)) == 300)
    finally:
        stop.set()
        reader.join(timeout=10)
    recorded = _ledger_ids(db_url)
    assert len(recorded) == len(set(recorded)) and set(recorded) == set(_all_ids(db_url))


@pytest.mark.parametrize("routing_key", ["group_id", "metadata:team"])
def test_a_round_read_directly_equals_the_spark_read(db_url: str, tmp_path: Path, routing_key: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's own read (5,000 events a query; 50 here, so that batches are read in pieces) gives
    the same events, positions and texts as the Spark source."""
    monkeypatch.setattr(sources, "FETCH_ROWS", 50)
    stream = _engine_stream(tmp_path, db_url)
    with psycopg.connect(db_url, autocommit=True) as c:
        streams.ensure_stream(c, STREAM)
        replication.create_slot(c, streams.stream_slot(c, STREAM))
        c.execute("insert into pgstream.events (payload, metadata, stream_id) select "
                  "jsonb_build_object('n', g, 'group_id', g %% 3, 's', 'ünï \"q\"', 'big', 12345678901234567890), "
                  "case when g %% 2 = 0 then jsonb_build_object('team', 'a') end, %s "
                  "from generate_series(1, 120) g", [STREAM])
        ingest.consume(c, stream, 0.5)
        batches = state.batches_between(c, STREAM, 0, 10**9)
        spans = owed_spans(batches, resume=True)
        direct = list(sources.TableSource(c, spans, routing_key).events())
    session = spark.open_session(load_config(tmp_path / "pgstream.yaml"))
    frames = spark.load_batches(session, db_url, spans, routing_key, packed=True)
    assert isinstance(frames, list)
    via_spark = list(spark.frame_events(frames, prefetch=False))
    assert len(direct) == 120
    assert _event_rows(direct) == _event_rows(via_spark)


def test_keep_warm_stream_has_an_open_run_before_its_first_event(db_url: str, tmp_path: Path,
                                                                   instance: dg.DagsterInstance,
                                                                   endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url,
                                 [_config(endpoint, linger=0.5, mode="warm")]), instance)
    (request,) = tick_until(driver, STREAM, lambda: bool(driver.cursors) and _open_run_key(db_url) is not None)
    assert request.tags[WARM_TAG] == "true" and request.run_key == _open_run_key(db_url)
    # until Dagster has made the run the sensor asks again for the same one (Dagster skips a run key it
    # has seen); nothing else
    assert [r.run_key for r in driver.tick(STREAM).run_requests or []] == [request.run_key]
    run = Background(driver, request)
    _wait(lambda: (_slot_reader(db_url) or "").startswith("pgstream reader "))
    assert not driver.tick(STREAM).run_requests  # it runs: nothing to ask for
    insert_events(db_url, STREAM, 15)
    _wait(lambda: len(endpoint.unique()) == 15)
    time.sleep(1.5)  # idle past linger_secs: a warm run stays open
    insert_events(db_url, STREAM, 15, 100)
    _wait(lambda: len(endpoint.unique()) == 30)
    assert _open_run_key(db_url) == request.run_key
    # paused: it closes; resumed: the sensor requests the next warm run
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("update pgstream.streams set paused = true where id = %s", [STREAM])
    result = run.wait(timeout=30)
    assert result.success and _open_run_key(db_url) is None
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("update pgstream.streams set paused = false where id = %s", [STREAM])
    time.sleep(1.1)  # another second: another key
    (again,) = tick_until(driver, STREAM, lambda: _open_run_key(db_url) is not None)
    assert again.run_key != request.run_key and again.tags[WARM_TAG] == "true"
    # a warm run that is not (any more) the stream's open run ends at once, delivering nothing
    stale = driver.execute(request)
    assert stale.success
    sent = sent_ids(db_url)
    assert endpoint.unique() == set(sent) and endpoint.duplicates() == 0 and endpoint.first_seen_order() == sent


def _open_run_key(url: str) -> str | None:
    with psycopg.connect(url) as c:
        row = c.execute("select open_run_key from pgstream.streams where id = %s", [STREAM]).fetchone()
    return row[0] if row else None


def test_tear_down_ends_a_reading_run_and_drops_its_slot(db_url: str, tmp_path: Path) -> None:
    _stream, reader, stop, _stats = _start_reader(db_url, tmp_path)
    try:
        _wait(lambda: _slot_reader(db_url) == "pgstream reader t")
        slot = slot_of(db_url, STREAM)
        removed = migrations.tear_down(db_url)
        assert f"replication slot {slot}" in removed
        reader.join(timeout=15)  # its next look at the ledger finds no pgstream schema: it ends
        assert not reader.is_alive()
        with psycopg.connect(db_url) as c:
            assert c.execute("select count(*) from pg_replication_slots").fetchone() == (0,)
    finally:
        stop.set()
        reader.join(timeout=15)


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


def test_no_free_wal_sender_the_sensor_records_for_the_run_until_one_is_free(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """Every WAL sender taken (max_wal_senders): the open run's reader cannot connect and says so in
    the run log, the sensor keeps recording and handing batches to the run; once a sender is free the
    run reads the slot itself. Each event once, in commit order."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_config(endpoint, linger=3)]), instance)
    driver.tick(STREAM)  # the slot
    holders = _take_every_wal_sender(db_url)
    try:
        insert_events(db_url, STREAM, 30)
        (request,) = tick_until(driver, STREAM, lambda: _launched(db_url))
        run = Background(driver, request)
        for wave in range(3):  # the sensor records; the open run takes the batches
            insert_events(db_url, STREAM, 20, 1000 * (wave + 1))
            tick_until(driver, STREAM, at_least(lambda: len(endpoint.unique()), 50 + 20 * wave))
        assert not (_slot_reader(db_url) or "").startswith("pgstream reader ")
    finally:
        for holder in holders:
            holder.close()
    _wait(lambda: (_slot_reader(db_url) or "").startswith("pgstream reader "))
    insert_events(db_url, STREAM, 25, 9000)  # no tick from now on: the run reads it
    _wait(lambda: len(endpoint.unique()) >= 115)
    result = run.wait(timeout=60)
    assert result.success
    sent = sent_ids(db_url)
    assert len(sent) == 115 and endpoint.first_seen_order() == sent and endpoint.duplicates() == 0
    assert sorted(_ledger_ids(db_url)) == sorted(sent)
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert any("cannot open a replication connection" in m and "max_wal_senders" in m for m in logs), logs
    assert any(f"this open run reads slot {slot_of(db_url, STREAM)}" in m for m in logs)


def test_a_sensor_peeking_back_to_back_leaves_the_slot_to_the_open_runs_reader(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """Under a steady write load the sensor's tick peeks again as soon as a batch is full: the run is
    the slot's declared reader from when it is opened, the sensor stops peeking, and from then on the
    run records what commits. Each event once, in commit order."""
    config = _config(endpoint, linger=3)
    config["batch"] = {"max_size": 20, "max_fill_secs": 0.05}  # every peek finds a full batch
    config["sensor"] = {"tick_budget_secs": 2}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [config]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 30)
    (request,) = tick_until(driver, STREAM, lambda: _launched(db_url))
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            insert_events(db_url, STREAM, 25, 10_000 + n)
            n += 25

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    run = Background(driver, request)
    try:
        deadline = time.monotonic() + 30
        busy = 0
        while busy < 3:  # ticks back to back, as a daemon with a backlog does
            assert time.monotonic() < deadline, "the reader never got the slot"
            # the launched run may be asked for again (same run key: the daemon launches it once)
            others = [r.run_key for r in driver.tick(STREAM).run_requests or [] if r.run_key != request.run_key]
            assert not others, f"a new run while one is open: {others}"
            busy = busy + 1 if (_slot_reader(db_url) or "").startswith("pgstream reader ") else 0
    finally:
        stop.set()
        writer.join(10)
    _wait(lambda: len(endpoint.unique()) >= len(sent_ids(db_url)))
    result = run.wait(timeout=60)
    assert result.success
    sent = sent_ids(db_url)
    assert endpoint.first_seen_order() == sent and endpoint.duplicates() == 0
    assert sorted(_ledger_ids(db_url)) == sorted(sent)
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    recorded = next(m for m in logs if f"stopped reading slot {slot_of(db_url, STREAM)}" in m)
    assert " 0 events recorded" not in recorded, recorded


def _reader_with_handoff(url: str, stream: Any) -> tuple[threading.Thread, threading.Event, ingest.FollowStats,
                                                         handoff.Handoff]:
    """:func:`ingest.follow` in a thread ("pgstream reader t") with a hand-off, as an open run starts it."""
    stop, stats = threading.Event(), ingest.FollowStats()
    kept = handoff.Handoff(max_events=10_000)
    reader = threading.Thread(target=ingest.follow, args=(url, stream, RUN_KEY, stop, stats),
                              kwargs={"application_name": "pgstream reader t", "handoff": kept})
    reader.start()
    return reader, stop, stats, kept


def test_what_the_reader_hands_its_run_equals_what_the_table_holds(db_url: str, tmp_path: Path) -> None:
    """The reader keeps the rows it decoded from the WAL (``Handoff``) and the run delivers them
    without reading them back: they must be the table's rows exactly, as the run would read them
    (ids, positions, stream, timestamps, the JSON texts byte for byte), whatever the server's time
    zone and however odd the JSON; and a batch taken once is gone."""
    with psycopg.connect(db_url, autocommit=True) as c:  # the WAL sender renders timestamps in +05:45
        c.execute(psycopg.sql.SQL("alter database {} set timezone = 'Asia/Kathmandu'").format(
            psycopg.sql.Identifier(c.info.dbname)))
    stream = _engine_stream(tmp_path, db_url)
    _open_stream(db_url)
    reader, stop, stats, kept = _reader_with_handoff(db_url, stream)
    try:
        _wait(lambda: _slot_reader(db_url) == "pgstream reader t")
        odd = ['{"s": "ünï \\"q\\" \\\\ \\n\\t\\u0001 \\u2028 😀", "n": 1e400, "big": 12345678901234567890}',
               '{"nested": {"a": [1, 2.50, null, true, {"b": []}]}, "e": ""}', '[]', '"text"', '0', 'null']
        with psycopg.connect(db_url, autocommit=True) as c:
            for round_ in range(3):  # several transactions, some over the batch size (100)
                c.execute("insert into pgstream.events (payload, metadata, stream_id) "
                          "select (%s::text[])[1 + g %% %s]::jsonb, "
                          "case when g %% 3 = 0 then jsonb_build_object('team', g) end, %s "
                          "from generate_series(1, %s) g",
                          [odd, len(odd), STREAM, 70 + 60 * round_])
        _wait(lambda: stats.events == 70 + 130 + 190)
    finally:
        stop.set()
        reader.join(timeout=10)
    assert kept.events == 390
    with psycopg.connect(db_url) as c:
        batches = state.batches_between(c, STREAM, 0, 10**9)
        assert sum(b.event_count for b in batches) == 390 and max(b.event_count for b in batches) == 100
        offsets = {event.created_at.utcoffset() for events, _size in kept._batches.values() for event in events}
        assert offsets == {dt.timedelta(hours=5, minutes=45)}  # as the WAL sender rendered them
        spans = owed_spans(batches, resume=True)
        from_table = list(sources.TableSource(c, spans, "group_id").events())
        # a span that starts mid-batch (a retried run resumes after what the sink confirmed)
        spans[0] = dataclasses.replace(spans[0], first=7)
        taken = [e for span in spans for e in kept.take(span.batch_id, span.first, span.last) or []]
    assert kept.events == 0 and kept.taken == 390 - 6 and kept.take(spans[0].batch_id, 1, 1) is None
    assert _event_rows(from_table[6:], as_json=True) == _event_rows(taken, as_json=True)
    assert all(row[4].utcoffset() == dt.timedelta(0) for row in _event_rows(taken))


def test_handoff_is_bounded_and_forgets_what_was_delivered_another_way() -> None:
    """Full (events or bytes), it keeps no more batches, so the run reads those from the table;
    batches a round delivered through Spark, or whose recording rolled back, are dropped."""
    created = dt.datetime(2026, 11, 22, tzinfo=dt.UTC)

    def txn(first: int, n: int, payload: str = "{}") -> replication.Transaction:
        return replication.Transaction(xid=first, events=[
            replication.DecodedEvent(i, created, (STREAM, payload, None, len(payload)))
            for i in range(first, first + n)])

    kept = handoff.Handoff(max_events=240, max_bytes=10_000)
    assert kept.put([1, 2, 3], [txn(1, 150), txn(151, 100)], 100) == 200  # batches of 100, 100, 50: 3 is over
    assert kept.events == 200 and kept.take(3, 1, 50) is None
    kept.forget_through(1)
    assert kept.events == 100 and kept.take(1, 1, 100) is None
    assert kept.put([4], [txn(301, 10, "x" * 2000)], 100) == 0  # 20,000 bytes of WAL messages: over max_bytes
    assert kept.put([5], [txn(311, 1)], 100) == 1
    kept.discard([5])
    assert kept.events == 100
    # an event decoded without its row (not UTF-8): the batch is read from the table
    no_row = replication.Transaction(xid=9, events=[replication.DecodedEvent(400, created)])
    assert kept.put([6], [no_row], 100) == 0
    got = kept.take(2, 1, 100)
    assert got is not None and [(b, o, e.id) for b, o, e in got[:2]] == [(2, 1, 101), (2, 2, 102)]
    assert kept.events == 0


def test_reader_without_its_publication_reads_with_the_sensors_and_loses_nothing(db_url: str, tmp_path: Path) -> None:
    """The whole-event publication dropped by hand (Postgres 18 then sends nothing, without an
    error): the reader does not confirm past what it received, says so and reads with the sensor's
    publication; what it records is read back from the table, none of it is kept."""
    stream = _engine_stream(tmp_path, db_url)
    _open_stream(db_url)
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("drop publication pgstream_stream_1_rows")
    reader, stop, stats, kept = _reader_with_handoff(db_url, stream)
    try:
        insert_events(db_url, STREAM, 150)
        _wait(lambda: stats.events == 150)
    finally:
        stop.set()
        reader.join(timeout=10)
    assert any("publication pgstream_stream_1_rows is missing" in n for n in stats.notes)
    assert kept.events == 0 and sorted(_ledger_ids(db_url)) == sorted(_all_ids(db_url))


def test_open_run_delivers_a_backlog_in_direct_rounds_without_spark(db_url: str, tmp_path: Path,
                                                                   instance: dg.DagsterInstance, endpoint: Endpoint,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A backlog larger than direct_max_events, in the batches a run is launched with and then
    while it is open: it delivers it in rounds of at most that many events (whole batches), in
    order, and never loads a round through Spark."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url,
                                 [_config(endpoint, linger=3, direct_max_events=120)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 300)  # launched with batches of 50: 2 in the first round, the rest after
    (request,) = tick_until(driver, STREAM, lambda: False if not driver.cursors else _launched(db_url), timeout=60) \
        or [None]  # type: ignore[list-item]
    assert request is not None

    def no_spark(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("an open run loaded a round of global order through Spark")

    monkeypatch.setattr(spark, "load_batches", no_spark)
    run = Background(driver, request)
    _wait(lambda: (_slot_reader(db_url) or "").startswith("pgstream reader "))
    with psycopg.connect(db_url, autocommit=True) as c:  # one transaction of 600 events: a backlog at once
        c.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g), %s "
                  "from generate_series(1, 600) g", [STREAM])
    _wait(lambda: len(endpoint.unique()) >= 900)
    result = run.wait(timeout=60)
    assert result.success
    sent = sent_ids(db_url)
    assert len(sent) == 900 and endpoint.unique() == set(sent) and endpoint.duplicates() == 0
    assert endpoint.first_seen_order() == sent
    rounds = run_metadata(result, "ASSET_MATERIALIZATION")
    assert sum(m["rounds"] for m in rounds) >= 900 // 100  # batches of 50: at most 2 a round
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert any("; the other " in m and " batches in the next rounds" in m for m in logs)  # the launched round


def test_the_reader_waits_for_a_slow_run_instead_of_recording_what_it_would_read_back(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """A sink slower than the reader: once the hand-off is full (direct_max_events 100: two batches
    of 50) the reader stops reading until the run has taken half, so every event the run delivers was
    taken as decoded, none read back from the table; all in order, once."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url,
                                 [_config(endpoint, linger=3, direct_max_events=100)]), instance)
    driver.tick(STREAM)
    insert_events(db_url, STREAM, 10)
    (request,) = tick_until(driver, STREAM, lambda: False if not driver.cursors else _launched(db_url), timeout=60) \
        or [None]  # type: ignore[list-item]
    assert request is not None
    run = Background(driver, request)
    _wait(lambda: (_slot_reader(db_url) or "").startswith("pgstream reader "))
    endpoint.delay = 0.05  # a chunk of 20 a call: 2.5 ms an event, slower than reading
    for wave in range(30):  # 30 transactions of 25 events, committed faster than the sink takes them
        insert_events(db_url, STREAM, 25, 1000 * (wave + 1))
    _wait(lambda: len(endpoint.unique()) >= 760, timeout=120)
    endpoint.delay = 0.0
    result = run.wait(timeout=60)
    assert result.success
    sent = sent_ids(db_url)
    assert len(sent) == 760 and endpoint.unique() == set(sent) and endpoint.duplicates() == 0
    assert endpoint.first_seen_order() == sent
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert any(f"stopped reading slot {slot_of(db_url, STREAM)}: 750 events recorded" in m and
               "; 750 of the events delivered were taken as read" in m and "(0 batches were)" in m
               for m in logs), [m for m in logs if "stopped reading" in m]


@pytest.mark.parametrize("dropped", ["pgstream_stream_1", "pgstream_stream_1_rows"])
def test_a_publication_dropped_by_hand_is_put_back_and_nothing_is_lost(db_url: str, tmp_path: Path,
                                                                        dropped: str) -> None:
    """Postgres 18 decodes with a missing publication without an error (it warns "skipped loading
    publication" and sends nothing): a sensor that then advanced the slot would lose every event
    committed meanwhile. The sensor's next tick creates the publication again and recovers those
    events from the table; each is recorded once."""
    stream = _engine_stream(tmp_path, db_url)
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume(c, stream, 0.5)  # the stream, its publications and slot
        insert_events(db_url, STREAM, 30)
        _wait(lambda: not ingest.consume(c, stream, 0.5).batches and len(_ledger_ids(db_url)) == 30)
        c.execute(psycopg.sql.SQL("drop publication {}").format(psycopg.sql.Identifier(dropped)))
        insert_events(db_url, STREAM, 40, 1000)  # committed while it is missing
        result = ingest.consume(c, stream, 0.5)
        assert result.publications_created == [dropped] and result.recovered
        assert c.execute("select count(*) from pg_publication where pubname = %s", [dropped]).fetchone() == (1,)
        insert_events(db_url, STREAM, 20, 2000)  # read from the slot again
        _wait(lambda: not ingest.consume(c, stream, 0.5).batches and len(_ledger_ids(db_url)) >= 90)
    recorded = _ledger_ids(db_url)
    assert len(recorded) == len(set(recorded)) == 90 and set(recorded) == set(_all_ids(db_url))


def test_what_the_reader_records_right_after_the_sensors_peek_is_recorded_once(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sensor peeks (it is the slot's declared reader), and before it records, a run is opened
    (the run becomes the declared reader in the same UPDATE) and its reader records the same
    transactions: the sensor checks the declared reader under the stream row's lock and records
    nothing (a test under load caught 25 events recorded twice before the reader was declared)."""
    stream = _engine_stream(tmp_path, db_url)
    with psycopg.connect(db_url, autocommit=True) as c:
        replication.create_slot(c, streams.ensure_stream(c, STREAM))
    insert_events(db_url, STREAM, 30)
    time.sleep(0.3)  # older than max_fill_secs: the sensor records what it peeks at once
    real = ingest.PeekSource.read
    started: list[tuple[threading.Thread, threading.Event, ingest.FollowStats, handoff.Handoff]] = []

    def reader_meanwhile(self: ingest.PeekSource, timeout: float) -> list[Any]:
        txns = real(self, timeout)
        if txns and not started:  # right after the sensor's peek
            with psycopg.connect(db_url, autocommit=True) as c:
                state.open_run(c, STREAM, RUN_KEY)
                assert state.slot_reader(c, STREAM) == state.run_reader(RUN_KEY)
            started.append(_reader_with_handoff(db_url, stream))
            _wait(lambda: started[0][2].events == 30)
        return txns

    monkeypatch.setattr(ingest.PeekSource, "read", reader_meanwhile)
    with psycopg.connect(db_url, autocommit=True) as c:
        result = ingest.consume(c, stream, 0.5)
    assert result.slot_busy and not result.batches and result.events == 0
    reader, stop, _stats, _kept = started[0]
    stop.set()
    reader.join(timeout=10)
    recorded = _ledger_ids(db_url)
    assert len(recorded) == len(set(recorded)) == 30 and set(recorded) == set(_all_ids(db_url))
