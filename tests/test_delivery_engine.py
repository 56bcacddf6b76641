"""The delivery engine without Dagster (``engine/delivery``): a :class:`DeliveryRun` against real
Postgres (slot, ledger, lease) and a real file sink, driven as the op drives it but with plain
callables for the host (a log, a stop check, a reporter; a Spark session only for mode ``per_batch``).
Every test counts what the sink got: each event once, in commit order."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
import yaml

from pgstream_dagster.config import StreamConfig, load_config
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine import ingest, spark
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.delivery.reads import BATCH_QUERY, BATCH_QUERY_BOUNDED, BATCH_SIZES, READ_BYTES
from pgstream_dagster.engine.delivery.run import DeliveryError, DeliveryRun, Host, Summary
from pgstream_dagster.engine.delivery.sources import Owed, Readers, Route, Selection, route
from pgstream_dagster.engine.ledger import locks, state
from pgstream_dagster.engine.publish import Span
from pgstream_dagster.engine.status import stream_status

from .support.endpoint import Endpoint
from .support.harness import event_ids, insert_events, read_jsonl, write_config

STREAM = 1
RUN_KEY = "engine-run"


class Log:
    """The run's log lines, by level."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, msg: str) -> None:
        self.lines.append(("info", msg))

    def warning(self, msg: str) -> None:
        self.lines.append(("warning", msg))

    def error(self, msg: str) -> None:
        self.lines.append(("error", msg))

    def has(self, text: str) -> bool:
        return any(text in m for _level, m in self.lines)


def _stream(tmp_path: Path, url: str, **delivery: Any) -> StreamConfig:
    """The stream as ``pgstream.yaml`` declares it (``delivery`` as given: no harness default)."""
    path = tmp_path / "pgstream.yaml"
    path.write_text(yaml.safe_dump({"database_url": url, "spark": {"master": "local[2]"}, "streams": [
        {"id": STREAM, "batch": {"max_size": 50, "max_fill_secs": 0.1},
         "delivery": {"chunk_size": 20, **delivery}, "sink": {"type": "file", "path": str(tmp_path / "out.jsonl")}}]}))
    return load_config(path).streams[0]


def _insert(c: psycopg.Connection, n: int, start: int = 0) -> list[int]:
    return [r[0] for r in c.execute(
        "insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g, 'group_id', g %% 4), %s "
        "from generate_series(%s::int, %s::int) g returning id", [STREAM, start, start + n - 1])]


def _recorded(url: str, stream: StreamConfig, n: int) -> list[state.Batch]:
    """The stream in its reader group, ``n`` events recorded in batches by the group sensor's read (nothing
    delivered)."""
    with psycopg.connect(url, autocommit=True) as c:
        ingest.consume_group(c, stream.reader, [stream], 0)
        _insert(c, n)
        while sum(b.event_count for b in state.batches_between(c, STREAM, 0, 10**9)) < n:
            ingest.consume_group(c, stream.reader, [stream], 0.5)
        return state.batches_between(c, STREAM, 0, 10**9)


def _run(stream: StreamConfig, url: str, batches: list[state.Batch], log: Log, *,
         run_key: str | None = None) -> DeliveryRun:
    return DeliveryRun(stream, url, url, "engine-test", batches[0].id if batches else None,
                       batches[-1].id if batches else None, run_key).start(log)


def _ids(tmp_path: Path) -> list[int]:
    return [e["id"] for e in read_jsonl(tmp_path / "out.jsonl")]


def _statuses(url: str) -> set[str]:
    with psycopg.connect(url) as c:
        return {r[0] for r in c.execute("select status from pgstream.batches where stream_id = %s", [STREAM])}


def test_a_run_delivers_its_batches_in_order_marks_them_and_reports(db_url: str, tmp_path: Path) -> None:
    """A run launched with recorded batches (not the open run): read by its own connection, delivered
    through the file sink, each batch marked delivered, the rounds reported once; it closes then (the sensor hands
    batches to the stream's open run, which it is not)."""
    stream = _stream(tmp_path, db_url, tuning={"report_every_secs": 0})
    batches = _recorded(db_url, stream, 230)
    with psycopg.connect(db_url, autocommit=True) as c:
        state.launch(c, STREAM, [b.id for b in batches], RUN_KEY, keep_open=False)
    summaries: list[Summary] = []
    log = Log()
    run = _run(stream, db_url, batches, log)
    rounds = list(run.deliver(Host("engine-test", log, report=summaries.append)))
    with psycopg.connect(db_url) as c:
        sent = [r[0] for r in c.execute("select id from pgstream.events order by id")]
    assert _ids(tmp_path) == sent and len(sent) == 230  # each once, in commit order
    assert _statuses(db_url) == {BatchStatus.DELIVERED}
    assert [r.route for r in rounds] == ["TableSource"]
    assert sum(r.delivered for r in rounds) == 230
    assert sum(s.events for s in summaries) == 230 and summaries[-1].last.id == batches[-1].id
    # a reader group's member (every stream is one): its group's sensor observes its status at each tick, its
    # run's reports do not ask for it
    assert stream.reader == "default"
    with psycopg.connect(db_url) as c:
        (status,) = stream_status(c, STREAM)
    assert int(status["undelivered_events"]) == 0


def test_the_members_of_a_group_run_report_at_phases_of_their_own_not_all_in_one_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten members started together, a round each every second, reports every 20 s (a group run's
    ``report_every_secs``): each reports its first round at once, and its later ones at a phase of its own (its
    stream id's), so the group's event-log writes are spread over the period instead of all in the same second of
    it (100 members' reports at once held the group run's other threads for seconds: bench/RESULTS.md); none
    reports again sooner than the period."""
    import datetime as dt

    from pgstream_dagster.engine.delivery import run as run_module
    from pgstream_dagster.engine.delivery.run import Reports, RoundReport

    clock = [1000.0]
    monkeypatch.setattr(run_module, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    base = _stream(tmp_path, "postgresql://localhost/unused")
    told: dict[int, list[float]] = {}
    members = []
    for stream_id in range(1, 11):
        stream = base.model_copy(update={"id": stream_id})
        host = Host(f"group/{stream_id}", Log(), report_every_secs=20,
                    report=lambda summary: told.setdefault(summary.stream_id, []).append(clock[0] - 1000.0))
        members.append((stream_id, Reports(host, stream)))
    now = dt.datetime.now(dt.UTC)
    for second in range(70):
        clock[0] = 1000.0 + second
        for stream_id, reports in members:
            batch = state.Batch(second + 1, stream_id, "stream", 1, second + 1, second + 1, BatchStatus.DELIVERED, 1,
                                "key", "i", None, None, None, now, now)
            reports.add(RoundReport([batch], 1, clock[0], "Handed"))
    assert all(times[0] == 0 for times in told.values()), told  # the first round at once
    seconds = {times[1] for times in told.values()}
    assert len(seconds) >= 8 and min(seconds) >= 20 and max(seconds) <= 40, told  # spread over the next period
    assert all(b - a >= 20 for times in told.values() for a, b in itertools.pairwise(times)), told


def test_an_open_run_handed_more_than_a_round_takes_the_rest_at_once_not_when_next_woken(db_url: str,
                                                                                        tmp_path: Path) -> None:
    """A backlog handed to an open run beyond ``tuning.direct_max_events``: round after round, each taking the next
    of the batches handed over already; it waits for a sign from its host (``Host.wake``: a batch handed over, or
    the safety poll, 5 s later) only once none is left (it waited for one after every round: a backlog went at one
    round per 5 s)."""
    stream = _stream(tmp_path, db_url, tuning={"direct_max_events": 100, "report_every_secs": 0})
    batches = _recorded(db_url, stream, 230)  # batches of 50: two a round
    with psycopg.connect(db_url, autocommit=True) as c:
        assert state.launch(c, STREAM, [b.id for b in batches], RUN_KEY, keep_open=True)
    waits: list[tuple[float, int]] = []  # (the wait asked for, the events delivered then)

    def wake(timeout: float) -> bool:
        delivered = len(_ids(tmp_path)) if (tmp_path / "out.jsonl").exists() else 0
        waits.append((timeout, delivered))
        if delivered == 230:
            return True  # a sign: the run looks, and its host's stop check closes it
        time.sleep(min(timeout, 0.05))
        return False

    log = Log()
    host = Host("engine-test", log, wake=wake,
                stop_check=lambda: "the test ends" if len(_ids(tmp_path)) == 230 else None)
    rounds = list(_run(stream, db_url, batches, log, run_key=RUN_KEY).deliver(host))
    assert [len(r.batches) for r in rounds] == [2, 2, 1] and _ids(tmp_path) == event_ids(db_url, STREAM)
    assert [w for w in waits if w[0] > 0 and w[1] < 230] == [], waits  # no wait while batches were handed over
    assert _statuses(db_url) == {BatchStatus.DELIVERED}


@pytest.mark.parametrize("every, lines", [(0, True), (5, False)])
def test_a_round_logs_its_progress_only_when_it_lasts(db_url: str, tmp_path: Path, every: float,
                                                       lines: bool) -> None:
    """A round logs its progress (every tenth of it) at most every ``tuning.report_every_secs``: each
    line is a write to Dagster's event log, which a round delivered in a fraction of a second does
    not need (0: every tenth)."""
    stream = _stream(tmp_path, db_url, tuning={"report_every_secs": every})
    batches = _recorded(db_url, stream, 230)
    with psycopg.connect(db_url, autocommit=True) as c:
        state.launch(c, STREAM, [b.id for b in batches], RUN_KEY, keep_open=False)
    log = Log()
    rounds = list(_run(stream, db_url, batches, log).deliver(Host("engine-test", log)))
    assert sum(r.delivered for r in rounds) == 230 and len(_ids(tmp_path)) == 230
    progress = [m for _level, m in log.lines if "events handled" in m]
    assert bool(progress) is lines, log.lines
    if lines:  # chunks of 20 of 230 events: a line for each tenth reached
        assert progress[0] == f"stream {STREAM}: 40/230 events handled", progress


def test_a_run_that_would_overtake_or_names_no_batch_fails_and_gives_up_the_lease(db_url: str,
                                                                                  tmp_path: Path) -> None:
    stream = _stream(tmp_path, db_url)
    batches = _recorded(db_url, stream, 120)
    assert len(batches) >= 2
    log = Log()
    with pytest.raises(DeliveryError, match=f"batch {batches[1].id} would overtake open batch {batches[0].id}"):
        DeliveryRun(stream, db_url, db_url, "engine-test", batches[1].id).start(log)
    with pytest.raises(DeliveryError, match="does not exist"):
        DeliveryRun(stream, db_url, db_url, "engine-test", batches[-1].id + 100).start(log)
    run = _run(stream, db_url, batches, log)  # the lease was given up each time: this one takes it
    run.ledger.give_up_lease(STREAM)
    assert _ids(tmp_path) == []


def test_per_batch_delivers_through_pyspark(db_url: str, tmp_path: Path) -> None:
    """Mode ``per_batch``: the design card's run per batch, its events read by PySpark."""
    stream = _stream(tmp_path, db_url, mode="per_batch")
    batches = _recorded(db_url, stream, 90)
    with psycopg.connect(db_url, autocommit=True) as c:
        state.launch(c, STREAM, [b.id for b in batches], RUN_KEY, keep_open=False)
    session = spark.open_session(load_config(tmp_path / "pgstream.yaml"))
    log = Log()
    rounds = list(_run(stream, db_url, batches, log).deliver(Host("engine-test", log, spark=lambda: session)))
    with psycopg.connect(db_url) as c:
        sent = [r[0] for r in c.execute("select id from pgstream.events order by id")]
    assert _ids(tmp_path) == sent and len(sent) == 90
    assert [r.route for r in rounds] == ["SparkSource"]
    assert _statuses(db_url) == {BatchStatus.DELIVERED}


@pytest.mark.parametrize(("delivery", "want", "conn", "expected"), [
    ({}, "round", True, Route.TABLE),
    ({}, "round", False, Route.SPARK),
    ({"tuning": {"direct_max_events": 10}}, "round", True, Route.SPARK),
    ({"mode": "per_batch"}, "round", True, Route.SPARK),
    ({"mode": "per_batch", "tuning": {"direct_max_events": 500}}, "round", True, Route.TABLE),
    ({"mode": "per_batch"}, "replay", False, Route.RANGE),
    ({"ordering": "by_key"}, "round", True, Route.BY_KEY),
    ({}, "replay", False, Route.RANGE),
    ({"tuning": {"direct_max_events": 0}}, "replay", False, Route.SPARK),
])
def test_one_function_chooses_every_source(tmp_path: Path, delivery: dict[str, Any], want: str, conn: bool,
                                          expected: Route) -> None:
    """Where a delivery round and a replay read (no database needed: the choice is the configuration's)."""
    stream = StreamConfig.model_validate({"id": 1, "sink": {"type": "memory", "name": "x"}, "delivery": delivery})
    readers = Readers("", conn=cast(psycopg.Connection, object()) if conn else None)
    what = Owed([Span(1, 1, 20)]) if want == "round" else Selection({})
    assert route(stream.delivery, what, readers) is expected


def _delivered(tmp_path: Path, n: int) -> Callable[[], bool]:
    return lambda: len(_ids(tmp_path)) >= n


def _file_members(tmp_path: Path, db_url: str, group: str, ids: list[int]) -> list[StreamConfig]:
    """Streams ``ids`` of reader group ``group`` in mode open (batches of 50 at most), each to ``out<id>.jsonl``."""
    return list(load_config(write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": i, "reader": group, "batch": {"max_size": 50, "max_fill_secs": 0},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 300}},
         "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in ids])).streams)


def _group_run(group: str, streams: list[StreamConfig], db_url: str, run_id: str, logs: Log,
               claim: Callable[[list[tuple[int, str]]], list[tuple[int, str]]] = lambda wanted: wanted,
               ) -> tuple[Any, dict[int, str | None], threading.Event]:
    """A group delivery run ``run_id`` of ``streams`` without Dagster (``max_run_secs`` 300): the run, what each
    member's run ended with (stream id: its error, None when it closed), and the event that asks it to end."""
    from pgstream_dagster.engine.delivery import group as group_delivery

    ended: dict[int, str | None] = {}
    stopping = threading.Event()
    host = group_delivery.GroupHost(run_id, logs, lambda stream, member: Host(member, logs), claim=claim,
                                    ended=lambda stream_id, _key, error: ended.__setitem__(stream_id, error),
                                    stop_check=lambda: "the test ends" if stopping.is_set() else None)
    return (group_delivery.GroupDelivery(group, streams, db_url, db_url, host, max_run_secs=300, run_grace_secs=120),
            ended, stopping)


def _out(tmp_path: Path, i: int) -> list[int]:
    """The event ids in stream ``i``'s file sink (``out<i>.jsonl``), in order."""
    sink = tmp_path / f"out{i}.jsonl"
    return [e["id"] for e in read_jsonl(sink)] if sink.exists() else []


def _wait(done: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_one_process_hosts_a_groups_runs_in_threads_and_a_failing_sink_stops_only_its_own(
        db_url: str, tmp_path: Path) -> None:
    """Four streams of one reader group, each delivered by a warm run (an open run with no batch yet) of its own in a
    thread of this process (each with its own sink, lease and ledger connection), fed by the group's recording loop:
    stream 4's sink refuses every call, its run fails in its thread and gives its lease up, and streams 1-3 get every
    event once, in commit order, before and after that failure."""
    ids, failing = [1, 2, 3, 4], 4
    path = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": i, "reader": "hosted", "batch": {"max_size": 50, "max_fill_secs": 0},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 300}},
         "sink": ({"type": "http", "url": "http://127.0.0.1:9/refused", "timeout_secs": 1, "max_retry_secs": 0}
                  if i == failing else {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")})}
        for i in ids])
    streams = list(load_config(path).streams)
    stop = threading.Event()
    errors: dict[int, BaseException] = {}
    logs = {i: Log() for i in ids}

    def host(stream: StreamConfig) -> None:
        run = DeliveryRun(stream, db_url, db_url, f"hosted-{stream.id}", run_key=f"hosted-{stream.id}").start(
            logs[stream.id])
        try:
            for _round in run.deliver(Host(f"hosted-{stream.id}", logs[stream.id],
                                           stop_check=lambda: "the host says stop" if stop.is_set() else None)):
                pass
        except Exception as exc:  # (the test looks at it)
            errors[stream.id] = exc

    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, "hosted", streams, 0)  # the group's slot; every member joined
        for i in ids:
            assert state.open_warm_run(c, i, f"hosted-{i}")
        threads = [threading.Thread(target=host, args=(s,), daemon=True) for s in streams]
        for thread in threads:
            thread.start()

        def out(i: int) -> list[int]:
            return [e["id"] for e in read_jsonl(tmp_path / f"out{i}.jsonl")]

        for wave in range(3):
            for i in ids:
                insert_events(db_url, i, 20, start=100 * wave)
            deadline = time.monotonic() + 60
            while not all(len(out(i)) >= 20 * (wave + 1) for i in ids if i != failing):
                assert time.monotonic() < deadline, {i: len(out(i)) for i in ids}
                ingest.consume_group(c, "hosted", streams, 0.2)
            if wave == 0:
                threads[failing - 1].join(30)  # its first round failed: its thread ended, the others go on
                assert not threads[failing - 1].is_alive()
        stop.set()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive()
        for i in ids:
            sent = [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id", [i])]
            assert len(sent) == 60
            if i != failing:
                assert out(i) == sent, i  # each once, in commit order
                assert logs[i].has("run closed (the host says stop)")
        assert set(errors) == {failing}
        assert "connection failed" in str(errors[failing]), errors[failing]
        # the failed run gave its lease up (its thread ended, the process lives on): a new run may take it
        assert locks.lease_state(c, f"hosted-{failing}") is not locks.LeaseState.HELD
        assert {r[0] for r in c.execute("select status from pgstream.batches where stream_id <> %s",
                                        [failing])} == {BatchStatus.DELIVERED}


def test_a_group_delivery_hosts_its_members_wakes_idle_ones_and_a_failing_member_ends_alone(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group delivery run without Dagster (:class:`GroupDelivery`): it takes the runs the members' sensors
    decided (here: warm runs written in the ledger, one run key already hosted elsewhere), hosts each in a
    thread as member run ``<group run>/<stream>`` holding the member's lease; idle members do not poll the ledger
    (the group watches their rows in one query and wakes the one whose batches were handed over: delivered
    within a second), and the one a replay waits for (it closes, the replay takes the lease); stream 4's sink
    refuses, its run ends alone and is told; the group run ends once idle."""
    from pgstream_dagster.engine.delivery import group as group_delivery
    from pgstream_dagster.engine.delivery import run as delivery_run

    ids, failing, elsewhere = [1, 2, 3, 4, 5], 4, 5
    path = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": i, "reader": "hosted", "batch": {"max_size": 50, "max_fill_secs": 0},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 300}},
         "sink": ({"type": "http", "url": "http://127.0.0.1:9/refused", "timeout_secs": 1, "max_retry_secs": 0}
                  if i == failing else {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")})}
        for i in ids])
    streams = list(load_config(path).streams)
    polls: dict[str, int] = {}
    next_assigned = state.next_assigned

    def counted(conn: psycopg.Connection, stream_id: int, run_key: str, after: int, run_id: str) -> state.Assigned:
        polls[run_key] = polls.get(run_key, 0) + 1
        return next_assigned(conn, stream_id, run_key, after, run_id)

    monkeypatch.setattr(state, "next_assigned", counted)
    ended: dict[int, str | None] = {}
    logs = Log()
    stopping = threading.Event()
    host = group_delivery.GroupHost("grp", logs, lambda stream, run_id: Host(run_id, logs),
                                    claim=lambda wanted: [(sid, key) for sid, key in wanted if sid != elsewhere],
                                    ended=lambda stream_id, _key, error: ended.__setitem__(stream_id, error),
                                    stop_check=lambda: "the test ends" if stopping.is_set() else None)
    delivery = group_delivery.GroupDelivery("hosted", streams, db_url, db_url, host, max_run_secs=300,
                                              run_grace_secs=120)
    outcome: list[str] = []

    def out(i: int) -> list[int]:
        sink = tmp_path / f"out{i}.jsonl"
        return [e["id"] for e in read_jsonl(sink)] if sink.exists() else []

    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, "hosted", streams, 0)
        for i in ids:  # what the members' sensors decide: a warm run each (the group's reader hands them batches)
            assert state.open_warm_run(c, i, f"warm-{i}")
        insert_events(db_url, failing, 5)
        # handed to its run: its sink refuses them
        while not state.next_assigned(c, failing, f"warm-{failing}", 0, "").batches:
            ingest.consume_group(c, "hosted", streams, 0.05)
        thread = threading.Thread(target=lambda: outcome.append(delivery.run()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while locks.lease_state(c, "grp/1") is not locks.LeaseState.HELD or failing not in ended:
            assert time.monotonic() < deadline and thread.is_alive(), (ended, logs.lines[-5:])
            time.sleep(0.1)
        assert ended == {failing: ended[failing]} and "connection failed" in str(ended[failing])  # it alone ended
        assert locks.lease_state(c, "grp/5") is locks.LeaseState.NOT_TAKEN  # hosted elsewhere: left alone
        polls.clear()
        time.sleep(1.5)  # idle: the members wait to be woken
        assert sum(polls.values()) <= 3, polls  # a run polling on its own looks about 3 times each in 1.5 s
        for i in (1, 2, 3):
            insert_events(db_url, i, 10)
        handed = time.monotonic()
        while not all(len(out(i)) == 10 for i in (1, 2, 3)):
            assert time.monotonic() - handed < 10
            ingest.consume_group(c, "hosted", streams, 0.05)
        assert time.monotonic() - handed < 3  # woken when the group's reader handed the batches over
        for i in (1, 2, 3):
            sent = [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id", [i])]
            assert out(i) == sent
        # a replay of stream 1 waits for its delivery lease: the group wakes the member's idle run, which closes
        took = time.monotonic()
        locks.acquire_replay_lease(db_url, 1, "replay-test").close()
        assert time.monotonic() - took < 4
        assert any("stream 1: run closed (a replay of the stream waits" in m for _level, m in logs.lines)
        stopping.set()  # the group run is asked to end: its members' runs close, then it ends
        thread.join(30)
        assert not thread.is_alive() and outcome == ["the test ends"], (outcome, logs.lines[-5:])
        assert set(ended) == {1, 2, 3, failing} and all(ended[i] is None for i in (1, 2, 3))
        assert locks.group_lease_state(c, "hosted", "grp") is locks.LeaseState.NOT_TAKEN  # given up
    assert delivery_run.WOKEN_POLL_SECS > 1.5


def test_a_successor_waits_for_the_groups_lease_and_takes_over_as_the_run_it_succeeds_ends(
        db_url: str, tmp_path: Path) -> None:
    """A group delivery run's successor (requested before its ``max_run_secs``) starts while it delivers: it waits
    for the group's lease, its wait a lock of its session (the sensor tells a live wait from a dead run: killed
    while waiting, it is seen lost at once); the run ends (asked to, as the sensor does once the successor waits)
    and the successor takes the lease within a poll and hosts the members' next runs: every event once, in commit
    order. One whose wait outlasts its bound (its lead and ``run_grace_secs``) fails in one line, leaving no wait
    behind; one asked to end while it waits ends without the lease."""
    from pgstream_dagster.engine.delivery import group as group_delivery

    ids = [1, 2]
    streams = _file_members(tmp_path, db_url, "relay", ids)
    logs = Log()
    asked: set[str] = set()  # the runs asked to end
    outcome: dict[str, Any] = {}

    def start(run_id: str, max_run_secs: float = 300, grace: float = 120) -> threading.Thread:
        host = group_delivery.GroupHost(run_id, logs, lambda stream, member: Host(member, logs),
                                        claim=lambda wanted: wanted,
                                        stop_check=lambda: f"{run_id} asked to end" if run_id in asked else None)
        delivery = group_delivery.GroupDelivery("relay", streams, db_url, db_url, host, max_run_secs=max_run_secs,
                                                run_grace_secs=grace)

        def run() -> None:
            try:
                outcome[run_id] = delivery.run()
            except Exception as exc:  # (the test looks at it)
                outcome[run_id] = exc
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def out(i: int) -> list[int]:
        sink = tmp_path / f"out{i}.jsonl"
        return [e["id"] for e in read_jsonl(sink)] if sink.exists() else []

    def lease(c: psycopg.Connection, run_id: str) -> locks.LeaseState:
        return locks.group_lease_state(c, "relay", run_id)

    def runs_of(c: psycopg.Connection) -> set[str]:
        """The run keys that delivered batches."""
        return {r[0] for r in c.execute("select run_key from pgstream.batches where status = 'delivered'")}

    def until(c: psycopg.Connection, done: Callable[[], bool], timeout: float = 10) -> float:
        began = time.monotonic()
        while not done():
            assert time.monotonic() - began < timeout, (outcome, logs.lines[-5:])
            ingest.consume_group(c, "relay", streams, 0.05)
        return time.monotonic() - began

    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, "relay", streams, 0)
        for i in ids:  # the members' runs, as their sensor decides them
            assert state.open_warm_run(c, i, f"first-{i}")
        first = start("grp-1")
        until(c, lambda: lease(c, "grp-1") is locks.LeaseState.HELD)
        successor = start("grp-2")
        until(c, lambda: lease(c, "grp-2") is locks.LeaseState.WAITING)
        for i in ids:  # delivered by the first run while its successor waits
            insert_events(db_url, i, 10)
        until(c, lambda: all(len(out(i)) == 10 for i in ids))
        assert lease(c, "grp-2") is locks.LeaseState.WAITING and successor.is_alive()
        assert runs_of(c) == {"first-1", "first-2"}

        asked.add("grp-1")  # the sensor asks the run to end once its successor waits
        took = until(c, lambda: lease(c, "grp-2") is locks.LeaseState.HELD)
        first.join(10)
        assert outcome["grp-1"] == "grp-1 asked to end" and took < 5
        for i in ids:
            assert state.open_warm_run(c, i, f"second-{i}")
            insert_events(db_url, i, 10, start=100)
        until(c, lambda: all(len(out(i)) == 20 for i in ids))
        assert runs_of(c) == {"first-1", "first-2", "second-1", "second-2"}

        # a successor whose wait outlasts its bound (lead 1 s and run_grace_secs 1 s): one line, no wait left
        began = time.monotonic()
        start("grp-3", max_run_secs=4, grace=1).join(10)
        assert isinstance(outcome["grp-3"], locks.LeaseTaken) and 1.5 < time.monotonic() - began < 6
        assert "(grp-2) hosts the deliveries of reader group relay" in str(outcome["grp-3"])
        assert lease(c, "grp-3") is locks.LeaseState.NOT_TAKEN
        # one asked to end while it waits: it ends without the lease
        waiting = start("grp-4")
        until(c, lambda: lease(c, "grp-4") is locks.LeaseState.WAITING)
        asked.add("grp-4")
        waiting.join(10)
        assert outcome["grp-4"] == "grp-4 asked to end" and lease(c, "grp-2") is locks.LeaseState.HELD
        # one killed while it waits (its session ended, as its process's would): lost at once
        start("grp-5")
        until(c, lambda: lease(c, "grp-5") is locks.LeaseState.WAITING)
        c.execute("select pg_terminate_backend(pid) from pgstream.locks where holder = 'grp-5'")
        until(c, lambda: lease(c, "grp-5") is locks.LeaseState.LOST)

        asked.add("grp-2")
        successor.join(30)
        assert outcome["grp-2"] == "grp-2 asked to end"
        for i in ids:
            sent = [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id", [i])]
            assert out(i) == sent, i  # each once, in commit order


def test_a_run_opened_for_a_member_is_hosted_at_once_not_at_the_group_runs_next_look(
        db_url: str, tmp_path: Path) -> None:
    """The group delivery run looks at what its members want once a second; a run opened for a member (its sensor's
    warm run, a launch) wakes it on the member's run channel at commit, so each member's run holds its lease well
    within that second of being opened, and delivers."""
    ids = [1, 2, 3, 4]
    streams = _file_members(tmp_path, db_url, "woken", ids)
    logs, outcome = Log(), list[str]()
    delivery, ended, stopping = _group_run("woken", streams, db_url, "grp", logs)
    thread = threading.Thread(target=lambda: outcome.append(delivery.run()), daemon=True)
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, "woken", streams, 0)
        assert state.open_warm_run(c, 1, "warm-1")
        thread.start()
        deadline = time.monotonic() + 30
        while locks.lease_state(c, "grp/1") is not locks.LeaseState.HELD:
            assert time.monotonic() < deadline and thread.is_alive(), logs.lines[-5:]
            time.sleep(0.01)
        took = []
        for i in (2, 3, 4):
            time.sleep(0.3)  # (at another phase of the group run's look each time)
            opened = time.monotonic()
            assert state.open_warm_run(c, i, f"warm-{i}")
            while locks.lease_state(c, f"grp/{i}") is not locks.LeaseState.HELD:
                assert time.monotonic() - opened < 10, logs.lines[-5:]
                time.sleep(0.01)
            took.append(time.monotonic() - opened)
        assert max(took) < 0.5, took
        for i in ids:
            insert_events(db_url, i, 5)
        deadline = time.monotonic() + 10
        while not all(len(_out(tmp_path, i)) == 5 for i in ids):
            assert time.monotonic() < deadline, logs.lines[-5:]
            ingest.consume_group(c, "woken", streams, 0.05)
        stopping.set()
        thread.join(30)
        assert outcome == ["the test ends"] and not any(ended.values()), (outcome, ended)


def test_a_member_whose_run_still_closes_in_the_run_taken_over_from_is_hosted_once_that_one_lets_it_go(
        db_url: str, tmp_path: Path) -> None:
    """The run a group delivery run took over from gave the group's lease up while its member run of stream 1 still
    closes (its sink call under way: it holds stream 1's delivery lease). The new run hosts stream 2 at once and
    leaves stream 1 alone (no run of it started and failed on the lease), then hosts it within a poll once the
    lease is free: each stream's events delivered once, in commit order."""
    ids = [1, 2]
    streams = _file_members(tmp_path, db_url, "closing", ids)
    logs, outcome = Log(), list[str]()
    delivery, ended, stopping = _group_run("closing", streams, db_url, "new", logs)

    def out(i: int) -> list[int]:
        return _out(tmp_path, i)

    with psycopg.connect(db_url, autocommit=True) as c:
        def until(done: Callable[[], bool], timeout: float = 10) -> None:
            deadline = time.monotonic() + timeout
            while not done():
                assert time.monotonic() < deadline and thread.is_alive(), (ended, logs.lines[-5:])
                ingest.consume_group(c, "closing", streams, 0.05)

        ingest.consume_group(c, "closing", streams, 0)
        for i in ids:  # the members' runs, as their sensor decided them (stream 1's still in the old run)
            assert state.open_warm_run(c, i, f"warm-{i}")
        old = locks.acquire_lease(db_url, 1, "old/1")
        thread = threading.Thread(target=lambda: outcome.append(delivery.run()), daemon=True)
        thread.start()
        for i in ids:
            insert_events(db_url, i, 10)
        until(lambda: len(out(2)) == 10)
        time.sleep(1.5)  # (the run looks at what its members want every second)
        assert not out(1) and not ended and locks.lease_state(c, "new/1") is locks.LeaseState.NOT_TAKEN, logs.lines
        locks.give_up_lease(old, 1)  # the old run's member let it go (its key left open: an outage, say)
        until(lambda: len(out(1)) == 10)
        assert not ended and locks.lease_state(c, "new/1") is locks.LeaseState.HELD
        stopping.set()
        thread.join(30)
        assert outcome == ["the test ends"] and set(ended) == {1, 2}, (outcome, ended)
        for i in ids:
            sent = [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id", [i])]
            assert out(i) == sent, i  # each once, in commit order


def test_a_members_hanging_sink_call_holds_no_other_member_back_when_the_database_comes_back(
        db_url: str, pg: LocalPostgres, tmp_path: Path) -> None:
    """Postgres restarts while stream 1's webhook hangs in a call (up to its 30 s timeout): the group delivery run
    rides the outage out and hosts stream 2 again once the database accepts writes (its wait for its members' runs
    to stop is bounded for all of them together: ``OUTAGE_JOIN_SECS``), not once stream 1's call has returned;
    stream 1 is hosted again once it has. Every event once, in commit order."""
    hanging, release, armed = Endpoint(), threading.Event(), threading.Event()

    def hang(_request: int) -> None:  # once armed, every call waits until the test lets it through
        if armed.is_set():
            release.wait(120)

    hanging.hook = hang
    path = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": i, "reader": "outage", "batch": {"max_size": 50, "max_fill_secs": 0},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 300}},
         "sink": hanging.sink() if i == 1 else {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}}
        for i in (1, 2)])
    streams = list(load_config(path).streams)
    logs, outcome = Log(), list[str]()
    delivery, _ended, stopping = _group_run("outage", streams, db_url, "grp", logs)
    thread = threading.Thread(target=lambda: outcome.append(delivery.run()), daemon=True)

    def until(done: Callable[[], bool], timeout: float) -> float:
        """Record what commits (as the group's sensor does) until ``done``; how long it took."""
        began = time.monotonic()
        while not done():
            assert time.monotonic() - began < timeout and thread.is_alive(), (outcome, logs.lines[-8:])
            with contextlib.suppress(psycopg.OperationalError), \
                    psycopg.connect(db_url, autocommit=True, connect_timeout=2) as c:
                ingest.consume_group(c, "outage", streams, 0.05)
            time.sleep(0.05)
        return time.monotonic() - began

    try:
        with psycopg.connect(db_url, autocommit=True) as c:
            ingest.consume_group(c, "outage", streams, 0)
            for i in (1, 2):  # the members' runs, as their sensor decided them
                assert state.open_warm_run(c, i, f"warm-{i}")
        thread.start()
        for i in (1, 2):
            insert_events(db_url, i, 5)
        until(lambda: len(_out(tmp_path, 2)) == 5 and len(hanging.unique()) == 5, 30)
        armed.set()
        calls = hanging.requests
        insert_events(db_url, 1, 5, start=100)
        until(lambda: hanging.requests > calls, 20)

        pg.restart()  # while stream 1's call hangs
        insert_events(db_url, 2, 5, start=200)
        took = until(lambda: len(_out(tmp_path, 2)) == 10, 25)
        assert took < 15 and len(hanging.unique()) == 5, (took, logs.lines[-8:])  # (stream 1's call hangs on)
        release.set()
        insert_events(db_url, 1, 5, start=300)
        until(lambda: len(hanging.unique()) == 15, 60)
        stopping.set()
        thread.join(30)
        assert outcome == ["the test ends"], (outcome, logs.lines[-8:])
        with psycopg.connect(db_url) as c:
            for i in (1, 2):
                sent = [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id",
                                                [i])]
                assert (hanging.first_seen_order() if i == 1 else _out(tmp_path, i)) == sent, i  # once, in order
    finally:
        release.set()
        stopping.set()
        hanging.down()


def test_a_groups_members_share_one_lease_session_and_one_whose_session_ended_publishes_nothing(
        db_url: str, tmp_path: Path) -> None:
    """A group delivery run's members hold their leases on one session of its own and take a pooled connection
    only for a round or a look at the ledger (at most one each). That session killed (``pg_terminate_backend``,
    as a cut connection or a server restart would end it), every member's lease is lost at once: another run
    may take them; a member whose lease another run took publishes nothing of the batch it is handed (its
    pause gate checks the lease) and fails in one line, an idle one closes at its next look."""

    ids = [1, 2, 3]
    streams = _file_members(tmp_path, db_url, "shared", ids)
    logs = Log()
    delivery, ended, stopping = _group_run("shared", streams, db_url, "grp", logs)

    def out(i: int) -> list[int]:
        return _out(tmp_path, i)

    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, "shared", streams, 0)
        for i in ids:
            assert state.open_warm_run(c, i, f"warm-{i}")
        thread = threading.Thread(target=delivery.run, daemon=True)
        thread.start()
        for i in ids:
            insert_events(db_url, i, 5)
        deadline = time.monotonic() + 30
        while not all(len(out(i)) == 5 for i in ids):
            assert time.monotonic() < deadline and thread.is_alive(), (ended, logs.lines[-5:])
            ingest.consume_group(c, "shared", streams, 0.05)
        # one session holds the three leases; the pool holds at most one connection per member
        (sessions,) = c.execute("select array_agg(distinct pid) from pgstream.locks where name = %s and holder = "
                                "any(%s)", [locks.DELIVERY_LOCK, [f"grp/{i}" for i in ids]]).fetchone() or [None]
        assert sessions is not None and len(sessions) == 1
        (pooled,) = c.execute("select count(*) from pg_stat_activity where application_name = %s "
                              "and pid <> %s", ["pgstream group members grp", sessions[0]]).fetchone() or [0]
        assert 1 <= pooled <= len(ids)

        c.execute("select pg_terminate_backend(%s)", [sessions[0]])
        deadline = time.monotonic() + 10
        while locks.lease_state(c, "grp/1") is not locks.LeaseState.LOST:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        thief = locks.acquire_lease(db_url, 1, "next-1")  # another run takes stream 1's lease
        insert_events(db_url, 1, 5, start=100)
        deadline = time.monotonic() + 30
        while set(ended) != set(ids):  # 1: handed a batch, fails at its gate; 2 and 3 close at their next look
            assert time.monotonic() < deadline, (ended, logs.lines[-5:])
            ingest.consume_group(c, "shared", streams, 0.1)
        assert "run grp/1 no longer holds the stream's delivery lease" in str(ended[1]), ended
        assert ended[2] is None and ended[3] is None
        assert [m for _l, m in logs.lines if "stream 2: run closed" in m] == [
            "stream 2: run closed (run grp/2 no longer holds the stream's delivery lease (the session "
            "holding it ended: the server restarted or the connection was cut); it publishes nothing more, the next "
            "run resumes after the last confirmation recorded)"]
        assert len(out(1)) == 5  # nothing of the batch handed over after the session ended
        thief.close()
        for i in (2, 3):
            assert locks.lease_state(c, f"grp/{i}") is locks.LeaseState.LOST
            locks.acquire_lease(db_url, i, f"next-{i}").close()  # free for another run
        stopping.set()
        thread.join(30)
        assert not thread.is_alive()


def test_the_members_pool_bounds_the_connections_working_at_once_and_never_waits_on_one_held_long(
        db_url: str) -> None:
    """The members' pool hands out at most its size of connections working at once: a member that wants one more
    waits for one to be given back (and gets that one). A connection held ``POOL_HELD_SECS`` (a sink call that
    hangs) stops counting: the members behind it get another at once. What is given back beyond the size is
    closed."""
    name = "pgstream pool test"
    pool = locks.SharedConnections(db_url, name, size=2)

    def opened() -> int:
        with psycopg.connect(db_url, autocommit=True) as c:
            row = c.execute("select count(*) from pg_stat_activity where application_name = %s", [name]).fetchone()
            return int(row[0]) if row else 0

    def settled(n: int) -> bool:
        deadline = time.monotonic() + 5
        while opened() != n and time.monotonic() < deadline:
            time.sleep(0.05)
        return opened() == n

    hung_in, hang = threading.Event(), threading.Event()

    def hung_member() -> None:  # its sink call hangs, holding its connection
        with pool.connection():
            hung_in.set()
            hang.wait(30)

    hung = threading.Thread(target=hung_member, daemon=True)
    hung.start()
    assert hung_in.wait(10)
    got: list[tuple[int, float]] = []

    def member() -> None:
        asked = time.monotonic()
        with pool.connection() as conn:
            got.append((conn.info.backend_pid, time.monotonic() - asked))

    try:
        with pool.connection() as mine:  # the second working connection: at once
            pid = mine.info.backend_pid
            # (a runtime connection: the search path pinned, dbconn.connect)
            assert mine.execute("show search_path").fetchone() == ("pg_catalog,pg_temp",)
            waiting = threading.Thread(target=member, daemon=True)
            waiting.start()
            time.sleep(0.3)
            assert got == []  # two working: the third waits
        waiting.join(10)
        assert [p for p, _w in got] == [pid] and got[0][1] >= 0.25  # it got the one given back
        assert opened() == 2

        time.sleep(max(0.0, locks.POOL_HELD_SECS - 0.3))  # the hung member's connection no longer counts
        got.clear()
        with pool.connection():
            others = [threading.Thread(target=member, daemon=True)]
            others[0].start()
            others[0].join(10)
            assert len(got) == 1 and got[0][1] < 0.5, got  # not waiting for the hung one
        assert opened() == 3
    finally:
        hang.set()
        hung.join(10)
    # what was given back beyond the pool's size is closed (a closed connection's backend ends a moment later)
    assert settled(2)
    pool.close()
    assert settled(0)


def test_a_batch_is_read_by_its_event_ids_on_a_day_not_analyzed_yet(db_url: str) -> None:
    """A day partition autovacuum has not analyzed yet (a new day, or a day filled faster than it analyzes) has no
    statistics: every read of a batch (the run's, its sizes, the read cut at a byte budget) still looks each event
    up by id on the primary key and never scans the day (joined, it did: 10.6 s for 5,000 events of a day of 2M,
    bench/sustained.py in statement mode, delivery stalled until autovacuum analyzed the day)."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(%s)", [STREAM])
        c.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g), %s "
                  "from generate_series(1, 300000) g", [STREAM])
        c.execute("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
                  "min_created_at, max_created_at, status) "
                  "select %s, array_agg(id order by id), count(*), min(id), max(id), min(created_at), "
                  "max(created_at), 'delivered' from pgstream.events group by (id - 1) / 10000", [STREAM])
        c.execute("analyze pgstream.batches")  # (the ledger is analyzed: its batches hold 10,000 events)
        batch_id, first_id = c.execute("select id, first_event_id from pgstream.batches order by id desc "
                                       "offset 2 limit 1").fetchone()  # type: ignore[misc]
        days = [r[0] for r in c.execute("select distinct tableoid::regclass::text from pgstream.events")]
        for day in days:  # as autovacuum has not analyzed it yet: no statistics, no row count
            c.execute("update pg_catalog.pg_class set reltuples = -1, relpages = 0, relallvisible = 0 "
                      "where oid = %s::regclass", [day])
            c.execute("delete from pg_catalog.pg_statistic where starelid = %s::regclass", [day])
        params = {"batch_id": batch_id, "lo": 1, "hi": 5000, "budget": READ_BYTES, "limit": None,
                  "routing_source": "payload", "path": []}
        for query in (BATCH_QUERY, BATCH_SIZES, BATCH_QUERY_BOUNDED):
            ((plan,),) = c.execute(f"explain (format json) {query}", params).fetchall()
            scans = {(node["Node Type"], node.get("Relation Name")) for node in _plan_nodes(plan[0]["Plan"])}
            days_scanned = {(kind, name) for kind, name in scans if name and name.startswith("events_")}
            assert days_scanned and all(kind in ("Index Scan", "Bitmap Heap Scan", "Index Only Scan")
                                        for kind, _name in days_scanned), (query, days_scanned)
            rows = c.execute(query, params).fetchall()
            assert len(rows) == 5000 and rows[0][1 if query is BATCH_SIZES else 2] == first_id


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *[n for child in node.get("Plans", []) for n in _plan_nodes(child)]]
