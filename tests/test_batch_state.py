"""The batch state machine alone (engine/batches.py): every decision of the sensor as a row of a
table, without a database or a Dagster instance."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest

from pgstream_dagster.config import StreamConfig
from pgstream_dagster.engine.batches import (
    NO_RUN,
    Action,
    Batch,
    BatchStatus,
    Extend,
    FailRun,
    Launch,
    LeaveFailover,
    Reissue,
    Requeue,
    RunOrder,
    RunStatus,
    RunView,
    StreamState,
    Wait,
    Warm,
    decide,
    notes,
    tick_notes,
)

NOW = dt.datetime(2026, 3, 4, 12, 0, 0, tzinfo=dt.UTC)
SID = 7
HEAD = 10
RUN_KEY = "pgstream-s7-inc0-b10-a1"
OPEN_KEY = "pgstream-s7-inc0-b9-a1"


def stream_config(mode: str = "open") -> StreamConfig:
    return StreamConfig.model_validate({
        "id": SID, "sink": {"type": "file", "path": "/dev/null"},
        "retry": {"initial_backoff_secs": 5, "max_backoff_secs": 300},
        "delivery": {"mode": mode}})


OPEN = stream_config()
WARM_KEY = "pgstream-s7-inc0-warm-1772625600000000"  # NOW's epoch microsecond
PER_BATCH = stream_config("per_batch")


def batch(status: BatchStatus, **over: Any) -> Batch:
    fields: dict[str, Any] = {
        "id": HEAD, "stream_id": SID, "kind": "stream", "event_count": 3, "first_event_id": 100,
        "last_event_id": 102, "status": status, "attempts": 0, "run_key": None, "incarnation": "inc0",
        "run_id": None, "error": None, "next_attempt_at": None, "first_commit_at": NOW,
        "created_at": NOW - dt.timedelta(minutes=1)}
    return Batch(**{**fields, **over})


PENDING = batch(BatchStatus.PENDING)
PENDING_RETRIED = batch(BatchStatus.PENDING, attempts=2)  # its run failed at an earlier batch
LAUNCHED = batch(BatchStatus.LAUNCHED, attempts=1, run_key=RUN_KEY)
LAUNCHED_3 = batch(BatchStatus.LAUNCHED, attempts=3, run_key=RUN_KEY)
FAILED_LATER = batch(BatchStatus.FAILED, attempts=1, run_key=RUN_KEY, error="run r1: HTTP 500",
                     next_attempt_at=NOW + dt.timedelta(seconds=30))
FAILED_DUE = batch(BatchStatus.FAILED, attempts=1, run_key=RUN_KEY, error="run r1: HTTP 500", next_attempt_at=NOW)
FAILED_NOW = batch(BatchStatus.FAILED, attempts=1, run_key=RUN_KEY, error="run r1: HTTP 500")  # retry_now

NEXT_RUN = (HEAD, 11, 12)
SINCE = NOW - dt.timedelta(hours=1)


def state(head: Batch | None, **over: Any) -> StreamState:
    if head is not None and head.status is BatchStatus.PENDING and not over.get("paused"):
        over.setdefault("next_run", NEXT_RUN)
    return StreamState(SID, head=head, **over)


def run(status: RunStatus, outcome: str = "", error: str | None = None) -> RunView:
    return RunView(status, "r1", outcome, error)


def launch(head: Batch, ids: tuple[int, ...], *, keep_open: bool, replaces: str | None = None) -> Launch:
    return Launch(RunOrder(head, ids, head.attempts + 1), keep_open, replaces)


PAUSED = "stream 7 is paused: batch 10 waits (`pgstream-dagster resume 7`)"
CAUGHT_UP = "stream 7 caught up: failover over"


def failed(head: Batch, after_secs: float, reason: str, outcome: str) -> FailRun:
    retry_at = NOW + dt.timedelta(seconds=after_secs)
    return FailRun(head, f"run r1: {reason}", retry_at,
                   note=f"stream 7 in failover at batch 10: run r1 {outcome} ({reason}); retry at {retry_at:%H:%M:%S}")


# (what happens, the stream's state, its run as Dagster shows it, the configuration, the action)
ROWS: list[tuple[str, StreamState, RunView, StreamConfig, Action]] = [
    # nothing recorded
    ("empty stream, mode per_batch", state(None), NO_RUN, PER_BATCH, Wait()),
    ("empty stream in failover, mode per_batch: failover ends", state(None, failover_since=SINCE), NO_RUN, PER_BATCH,
     LeaveFailover(Wait(), CAUGHT_UP)),
    # mode open: with nothing open, an open run with no batch (a warm run) is kept ready
    ("empty, no open run: a warm run", state(None, incarnation="inc0"), NO_RUN, OPEN,
     Warm(WARM_KEY)),
    ("empty, warm run live: wait", state(None, open_run_key=WARM_KEY), run(RunStatus.LIVE), OPEN, Wait()),
    ("empty, warm run failed: not replaced before the next batch",
     state(None, open_run_key=WARM_KEY), run(RunStatus.FAILED, "FAILURE", "boom"), OPEN, Wait()),
    ("empty, paused: nothing", state(None, paused=True), NO_RUN, OPEN, Wait()),
    ("empty, in failover: failover ends, then a warm run", state(None, failover_since=SINCE), NO_RUN, OPEN,
     LeaveFailover(Warm("pgstream-s7--warm-1772625600000000"), CAUGHT_UP)),
    ("empty, open run idle (mode open): wait", state(None, open_run_key=OPEN_KEY), run(RunStatus.LIVE), OPEN,
     Wait()),
    # an open run that ended without closing, nothing left: it stays the open run until the next batch's run
    # replaces it (a run that cannot start is not requested again every tick)
    ("empty, open run died: wait", state(None, open_run_key=OPEN_KEY), run(RunStatus.DEAD, "FAILURE"), OPEN,
     Wait()),
    ("empty, open run succeeded without closing: wait", state(None, open_run_key=OPEN_KEY), run(RunStatus.SUCCEEDED),
     OPEN, Wait()),
    # paused: nothing starts, whatever the head and its run
    ("paused, pending head", state(PENDING, paused=True), NO_RUN, OPEN, Wait(PAUSED)),
    ("paused, launched head (its run is not looked at)", state(LAUNCHED, paused=True), NO_RUN, OPEN,
     Wait(PAUSED)),
    ("paused, failed head due", state(FAILED_DUE, paused=True, failover_since=SINCE), NO_RUN, OPEN, Wait(PAUSED)),
    # pending head: a new run takes the backlog, or the open run does
    ("pending, no open run: launch, open", state(PENDING), NO_RUN, OPEN,
     launch(PENDING, NEXT_RUN, keep_open=True)),
    ("pending, no open run, mode per_batch: launch, not open", state(PENDING), NO_RUN, PER_BATCH,
     launch(PENDING, NEXT_RUN, keep_open=False)),
    ("pending after a failed run: the next attempt", state(PENDING_RETRIED), NO_RUN, OPEN,
     launch(PENDING_RETRIED, NEXT_RUN, keep_open=True)),
    ("pending, open run live: hand it the batches", state(PENDING, open_run_key=OPEN_KEY), run(RunStatus.LIVE),
     OPEN, Extend(OPEN_KEY, otherwise=launch(PENDING, NEXT_RUN, keep_open=True))),
    ("pending, open run started but dead (reported failed): forget it, launch at once",
     state(PENDING, open_run_key=OPEN_KEY), run(RunStatus.DEAD, "FAILURE"), OPEN,
     launch(PENDING, NEXT_RUN, keep_open=True, replaces=OPEN_KEY)),
    ("pending, open run failed without closing: forget it, launch",
     state(PENDING, open_run_key=OPEN_KEY), run(RunStatus.FAILED, "FAILURE", "boom"), OPEN,
     launch(PENDING, NEXT_RUN, keep_open=True, replaces=OPEN_KEY)),
    ("pending, open run succeeded without closing: forget it, launch",
     state(PENDING, open_run_key=OPEN_KEY), run(RunStatus.SUCCEEDED), OPEN,
     launch(PENDING, NEXT_RUN, keep_open=True, replaces=OPEN_KEY)),
    ("pending, open run unknown to Dagster: forget it, launch",
     state(PENDING, open_run_key=OPEN_KEY), NO_RUN, OPEN,
     launch(PENDING, NEXT_RUN, keep_open=True, replaces=OPEN_KEY)),
    ("pending, open run canceling: forget it, launch",
     state(PENDING, open_run_key=OPEN_KEY), run(RunStatus.OTHER), OPEN,
     launch(PENDING, NEXT_RUN, keep_open=True, replaces=OPEN_KEY)),
    # pending head in failover: catch-up runs never stay open; caught up ends failover
    ("failover, nothing delivered since: catch-up run", state(PENDING, failover_since=SINCE), NO_RUN, OPEN,
     launch(PENDING, NEXT_RUN, keep_open=False)),
    ("failover, head older than the last successful launch: catch-up run",
     state(PENDING, failover_since=SINCE, last_delivered_launch=PENDING.created_at + dt.timedelta(seconds=1)),
     NO_RUN, OPEN, launch(PENDING, NEXT_RUN, keep_open=False)),
    ("failover, head recorded after the last successful launch: failover ends, the run may stay open",
     state(PENDING, failover_since=SINCE, last_delivered_launch=PENDING.created_at), NO_RUN, OPEN,
     LeaveFailover(launch(PENDING, NEXT_RUN, keep_open=True), CAUGHT_UP)),
    ("failover caught up, paused: failover ends, then the pause",
     state(PENDING, paused=True, failover_since=SINCE, last_delivered_launch=PENDING.created_at), NO_RUN, OPEN,
     LeaveFailover(Wait(PAUSED), CAUGHT_UP)),
    # failed head: the failover checkpoint, retried alone after its backoff
    ("failed, backoff not over", state(FAILED_LATER, failover_since=SINCE), NO_RUN, OPEN,
     Wait("stream 7 in failover at batch 10 (run r1: HTTP 500); retry at 12:00:30")),
    ("failed, backoff over: the probe, alone, not open", state(FAILED_DUE, failover_since=SINCE), NO_RUN, OPEN,
     launch(FAILED_DUE, (HEAD,), keep_open=False)),
    ("failed, made due by retry_now", state(FAILED_NOW, failover_since=SINCE), NO_RUN, OPEN,
     launch(FAILED_NOW, (HEAD,), keep_open=False)),
    ("failed, outside failover: the probe may stay open", state(FAILED_DUE), NO_RUN, OPEN,
     launch(FAILED_DUE, (HEAD,), keep_open=True)),
    # launched head: what became of its run
    ("launched, run never created: request it again", state(LAUNCHED), NO_RUN, OPEN, Reissue(LAUNCHED)),
    ("launched, run live: hand it what was recorded behind", state(LAUNCHED), run(RunStatus.LIVE), OPEN,
     Extend(RUN_KEY)),
    ("launched in failover (catching up), run live", state(LAUNCHED, failover_since=SINCE), run(RunStatus.LIVE),
     OPEN, Extend(RUN_KEY)),
    ("launched, run failed: failover, backoff of attempt 1",
     state(LAUNCHED), run(RunStatus.FAILED, "FAILURE", "HTTP 500 from sink"), OPEN,
     failed(LAUNCHED, 5, "HTTP 500 from sink", "FAILURE")),
    ("launched, run interrupted by the shutdown before this start: launched again, no failover",
     state(LAUNCHED), RunView(RunStatus.FAILED, "r1", "FAILURE", "DagsterExecutionInterruptedError", interrupted=True),
     OPEN, Requeue(LAUNCHED, checkpoint=False,
                     note="stream 7: run r1 was interrupted by the shutdown before this start; batch 10 is launched "
                          "again (not a failure: no failover, no attempt counted)")),
    ("launched in failover, third attempt interrupted: the checkpoint again at once, not counted",
     state(LAUNCHED_3, failover_since=SINCE), RunView(RunStatus.FAILED, "r1", "FAILURE", None, interrupted=True),
     OPEN, Requeue(LAUNCHED_3, checkpoint=True,
                     note="stream 7: run r1 was interrupted by the shutdown before this start; batch 10 is launched "
                          "again (not a failure: no failover, no attempt counted)")),
    ("launched, run canceled (no step failed)", state(LAUNCHED), run(RunStatus.FAILED, "CANCELED"), OPEN,
     failed(LAUNCHED, 5, "CANCELED", "CANCELED")),
    ("launched, third attempt failed: backoff doubled twice",
     state(LAUNCHED_3, failover_since=SINCE), run(RunStatus.FAILED, "FAILURE", "refused"), OPEN,
     failed(LAUNCHED_3, 20, "refused", "FAILURE")),
    ("launched, run died (no lease): reported, then failover",
     state(LAUNCHED), run(RunStatus.DEAD, "FAILURE"), OPEN, failed(LAUNCHED, 5, "FAILURE", "FAILURE")),
    ("launched, run succeeded without confirming: failed, due now", state(LAUNCHED), run(RunStatus.SUCCEEDED),
     OPEN, FailRun(LAUNCHED, "run r1 succeeded without confirming batch 10", NOW)),
    ("launched, run canceling: wait", state(LAUNCHED), run(RunStatus.OTHER), OPEN, Wait()),
]


@pytest.mark.parametrize(("state", "run", "stream", "expected"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_decide(state: StreamState, run: RunView, stream: StreamConfig, expected: Action) -> None:
    assert decide(state, run, NOW, stream) == expected


def test_a_warm_run_made_again_within_the_second_has_its_own_key() -> None:
    """A group delivery run hosts a run key once: the warm run made after one closed, in the same second, must
    not carry the closed one's key (it would wait for a host for good)."""
    closed = decide(state(None, incarnation="inc0"), NO_RUN, NOW, OPEN)
    again = decide(state(None, incarnation="inc0"), NO_RUN, NOW + dt.timedelta(milliseconds=300), OPEN)
    assert isinstance(closed, Warm) and isinstance(again, Warm) and closed.run_key != again.run_key


def test_every_status_is_covered() -> None:
    """Every open status is the head of some row; a done batch is never a stream's head."""
    heads = {r[1].head.status for r in ROWS if r[1].head is not None}
    assert heads == {s for s in BatchStatus if s.is_open}
    for status in BatchStatus:
        if not status.is_open:
            with pytest.raises(ValueError, match="a stream's head is an open batch"):
                state(batch(status))
    assert {s for s in BatchStatus if not s.is_open} == {BatchStatus.DELIVERED, BatchStatus.SKIPPED}


def test_every_run_status_and_action_is_covered() -> None:
    assert {r[2].status for r in ROWS} == set(RunStatus)
    kinds = {type(r[4]) for r in ROWS} | {type(r[4].then) for r in ROWS if isinstance(r[4], LeaveFailover)}
    assert kinds == {Wait, Launch, Warm, Extend, Reissue, FailRun, Requeue, LeaveFailover}


@pytest.mark.parametrize(("state", "watched"), [
    (state(None), None),
    (state(None, open_run_key=OPEN_KEY), OPEN_KEY),  # an open run with nothing left, or a warm one
    (state(None, open_run_key=OPEN_KEY, paused=True), None),
    (state(PENDING), None),
    (state(PENDING, open_run_key=OPEN_KEY), OPEN_KEY),
    (state(PENDING, open_run_key=OPEN_KEY, paused=True), None),
    (state(LAUNCHED), RUN_KEY),
    (state(LAUNCHED, paused=True), None),
    (state(FAILED_DUE, open_run_key=OPEN_KEY), None),
])
def test_watched_run(state: StreamState, watched: str | None) -> None:
    """The run the sensor asks Dagster about: the one decide looks at."""
    assert state.watched_run_key == watched


def test_the_next_run_starts_at_the_head() -> None:
    with pytest.raises(ValueError, match="must start at its head"):
        StreamState(SID, head=PENDING, next_run=(11, 12))
    with pytest.raises(ValueError, match="must start at its head"):
        StreamState(SID, head=PENDING)
    assert StreamState(SID, head=PENDING, paused=True).next_run == ()  # not read while paused


def test_run_keys() -> None:
    assert RunOrder(PENDING, NEXT_RUN, 1).run_key == "pgstream-s7-inc0-b10-12-a1"
    assert RunOrder(FAILED_DUE, (HEAD,), 2).run_key == "pgstream-s7-inc0-b10-a2"


def test_notes() -> None:
    """What the tick log says: why nothing started, failover entered or left."""
    by_name = {r[0]: decide(r[1], r[2], NOW, r[3]) for r in ROWS}
    assert notes(by_name["paused, pending head"]) == [PAUSED]
    assert notes(by_name["failover caught up, paused: failover ends, then the pause"]) == [CAUGHT_UP, PAUSED]
    assert notes(by_name["launched, run failed: failover, backoff of attempt 1"]) == [
        "stream 7 in failover at batch 10: run r1 FAILURE (HTTP 500 from sink); retry at 12:00:05"]
    for name in ("empty stream, mode per_batch", "pending, no open run: launch, open",
                 "launched, run live: hand it what was recorded behind",
                 "launched, run never created: request it again",
                 "launched, run succeeded without confirming: failed, due now"):
        assert notes(by_name[name]) == [], name


def test_batch_status_from_the_database() -> None:
    """The ledger gives statuses as text; a batch holds the enum member."""
    row = dataclasses.asdict(PENDING) | {"status": "launched"}
    assert Batch(**row).status is BatchStatus.LAUNCHED
    with pytest.raises(ValueError):
        Batch(**(row | {"status": "lost"}))


def test_a_lasting_state_is_said_once_then_recalled_at_most_once_a_minute() -> None:
    """The sensor decides about every second and ticks every few: the failover it waits in is said when
    it starts or changes, then in short once a minute; a transition each time; nothing once it is over."""
    by_name = {r[0]: decide(r[1], r[2], NOW, r[3]) for r in ROWS}
    waiting = by_name["failed, backoff not over"]
    failed = by_name["launched, run failed: failover, backoff of attempt 1"]
    said: dict[str, Any] = {}
    t0 = 1_000_000.0
    lines = [line for i in range(180) for line in tick_notes(waiting, said, t0 + i * 0.5)]  # 90 s, twice a second
    assert lines == ["stream 7 in failover at batch 10 (run r1: HTTP 500); retry at 12:00:30",
                     "stream 7 still in failover at batch 10 (attempt 1); retry at 12:00:30"]
    assert tick_notes(failed, said, t0 + 91) == [failed.note]  # type: ignore[union-attr]
    assert tick_notes(failed, said, t0 + 92) == [failed.note]  # type: ignore[union-attr]
    assert tick_notes(waiting, said, t0 + 93) == ["stream 7 in failover at batch 10 (run r1: HTTP 500); retry at "
                                                  "12:00:30"]  # said again: it had ended
    paused = by_name["failover caught up, paused: failover ends, then the pause"]
    assert tick_notes(paused, said, t0 + 94) == [CAUGHT_UP, PAUSED]
    assert tick_notes(by_name["paused, pending head"], said, t0 + 95) == []
    assert tick_notes(by_name["paused, pending head"], said, t0 + 155) == ["stream 7 still paused"]


def test_a_failed_run_and_the_failover_it_starts_are_one_line() -> None:
    """A run fails: its note says the failover and its retry time; the wait the sensor's next decision (the
    same tick) finds is that failover, not said again, and recalled in short a minute later."""
    fail = failed(LAUNCHED, 30, "HTTP 500", "FAILURE")
    assert fail.note is not None
    head = dataclasses.replace(FAILED_LATER, next_attempt_at=fail.retry_at, error=fail.error)
    waiting = decide(state(head, failover_since=SINCE), NO_RUN, NOW, OPEN)
    said: dict[str, Any] = {}
    t0 = 1_000_000.0
    assert [*tick_notes(fail, said, t0), *tick_notes(waiting, said, t0 + 1)] == [fail.note]
    assert tick_notes(waiting, said, t0 + 61) == ["stream 7 still in failover at batch 10 (attempt 1); retry at "
                                                  f"{fail.retry_at:%H:%M:%S}"]
