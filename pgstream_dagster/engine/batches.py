"""The batch state machine, without I/O: :class:`BatchStatus`, :class:`Batch`, a stream's state
(:class:`StreamState`, ``ledger.state.stream_state``) and its run's view in Dagster (:class:`RunView`), and
:func:`decide`, which turns them into one :class:`Action` (``ledger.state.apply``). A batch's status::

    pending --(launch, extend: assigned to a run)--> launched --(the sink confirmed it)--> delivered
    launched --(its run failed, the first open batch of the run)--> failed   (the failover checkpoint)
    launched --(its run failed, the others)--> pending
    failed --(launch: the probe, alone, once next_attempt_at has come)--> launched
    pending, launched, failed --(an operator: pgstream.skip_batch)--> skipped

Only the oldest open batch (the *head*) may start a run. The open run (``streams.open_run_key``; a *warm* run,
:class:`Warm`, is one opened with no batch) changes only by these actions and the run's own :data:`RunAction`
(docs/architecture.md, "The open run's state machine")."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from ..config import StreamConfig


class BatchStatus(StrEnum):
    PENDING = "pending"  # recorded, waiting for a run
    LAUNCHED = "launched"  # assigned to the run ``run_key``
    FAILED = "failed"  # its run failed: the failover checkpoint, retried alone at ``next_attempt_at``
    DELIVERED = "delivered"  # the sink confirmed every event
    SKIPPED = "skipped"  # an operator gave up on it (``pgstream.skip_batch``)

    @property
    def is_open(self) -> bool:
        """Not done yet: neither delivered nor skipped (in SQL: ``pgstream.batch_is_open(status)``)."""
        return self not in (BatchStatus.DELIVERED, BatchStatus.SKIPPED)


@dataclass(frozen=True)
class Batch:
    """A row of the ledger (with its stream's ``incarnation``)."""

    id: int
    stream_id: int
    kind: str
    event_count: int
    first_event_id: int
    last_event_id: int
    status: BatchStatus
    attempts: int
    run_key: str | None
    incarnation: str
    run_id: str | None
    error: str | None
    next_attempt_at: dt.datetime | None
    first_commit_at: dt.datetime | None
    created_at: dt.datetime
    confirmed_count: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", BatchStatus(self.status))  # the database gives text


def backoff_secs(stream: StreamConfig, attempts: int) -> float:
    """How long a failed batch waits before its next attempt (doubling, capped)."""
    # the exponent is capped: 2 ** 1024 no longer converts to a float (a sink down for weeks)
    doubled: float = stream.retry.initial_backoff_secs * 2 ** min(max(0, attempts - 1), 64)
    return min(stream.retry.max_backoff_secs, doubled)


def run_key(stream_id: int, incarnation: str, batch_ids: tuple[int, ...], attempt: int) -> str:
    """Dagster launches a run key once, so a re-evaluated tick requests nothing twice."""
    span = f"b{batch_ids[0]}" if len(batch_ids) == 1 else f"b{batch_ids[0]}-{batch_ids[-1]}"
    return f"pgstream-s{stream_id}-{incarnation}-{span}-a{attempt}"


@dataclass(frozen=True)
class StreamState:
    """What one decision needs to know of a stream, read at once (``ledger.state.stream_state``)."""

    stream_id: int
    head: Batch | None = None  # the oldest open batch: the only one that may start a run
    paused: bool = False
    failover_since: dt.datetime | None = None
    open_run_key: str | None = None  # the run that takes every new batch while it is open
    #: what a new run takes: the head and the pending batches behind it, up to ``delivery.max_events_per_run``
    next_run: tuple[int, ...] = ()
    #: when the newest delivered batch was launched (read in failover while the head is pending)
    last_delivered_launch: dt.datetime | None = None
    incarnation: str = ""  # of the stream row (run keys carry it)

    def __post_init__(self) -> None:
        head = self.head
        if head is None:
            return
        if not head.status.is_open:
            raise ValueError(f"batch {head.id} is {head.status}: a stream's head is an open batch")
        if head.status is BatchStatus.PENDING and not self.paused and self.next_run[:1] != (head.id,):
            raise ValueError(f"the next run of stream {self.stream_id} must start at its head, batch {head.id}")

    @property
    def in_failover(self) -> bool:
        return self.failover_since is not None

    @property
    def caught_up(self) -> bool:
        """Failover is over once every batch that existed when the last successful run was requested has been
        delivered: what is left is fresh, not backlog."""
        head = self.head
        if head is None:
            return True
        return head.status is BatchStatus.PENDING and self.last_delivered_launch is not None \
            and head.created_at >= self.last_delivered_launch

    @property
    def watched_run_key(self) -> str | None:
        """The run :func:`decide` needs a :class:`RunView` of: the head's, or the open run a pending head goes to."""
        head = self.head
        if self.paused:
            return None
        if head is None or head.status is BatchStatus.PENDING:  # (no head: an open run with nothing left to deliver)
            return self.open_run_key
        return (head.run_key or "") if head.status is BatchStatus.LAUNCHED else None


class RunStatus(StrEnum):
    """A delivery run as the sensor sees it in Dagster."""

    NOT_FOUND = "not found"  # no run has the key (the tick that requested it died first)
    LIVE = "live"  # queued, starting or started
    #: Dagster shows it started, but its lease's session ended, or it took none in ``delivery.run_grace_secs``
    DEAD = "started but dead"
    FAILED = "failed or canceled"
    SUCCEEDED = "succeeded"
    OTHER = "other"  # between states (canceling): looked at again next time


@dataclass(frozen=True)
class RunView:
    status: RunStatus
    run_id: str = ""
    outcome: str = ""  # how it ended in Dagster's words (FAILURE, CANCELED; a dead run: FAILURE)
    error: str | None = None  # the root cause of its failure, if Dagster recorded one (dead: why it is)
    #: it failed because its process was interrupted with no termination requested (Dagster's
    #: ``UNEXPECTED_TERMINATION``) before the sensor's code location started: the shutdown before a restart
    interrupted: bool = False


NO_RUN = RunView(RunStatus.NOT_FOUND)


# --- actions --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunOrder:
    """A delivery run to request: ``batch_ids`` (the first is ``head``), as attempt ``attempt``."""

    head: Batch
    batch_ids: tuple[int, ...]
    attempt: int

    @property
    def run_key(self) -> str:
        return run_key(self.head.stream_id, self.head.incarnation, self.batch_ids, self.attempt)


@dataclass(frozen=True)
class Wait:
    """Nothing to do now; ``reason`` goes to the tick log (``None``: nothing worth saying), for a lasting state
    once, then ``short`` at most every :data:`REMIND_EVERY_SECS` while it lasts (:func:`tick_notes`)."""

    reason: str | None = None
    short: str | None = field(default=None, compare=False)
    #: what the state is, when its reason says more (a failover: its batch and retry time, :func:`failover_key`)
    key: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Launch:
    """A new run of the order's batches; ``replaces``: an open run that ended without closing, forgotten first."""

    order: RunOrder
    keep_open: bool
    replaces: str | None = None


@dataclass(frozen=True)
class Warm:
    """Nothing is open and nothing runs (mode ``open``): make ``run_key``, a run with no batch, the open run."""

    run_key: str


@dataclass(frozen=True)
class Extend:
    """Hand the open run ``run_key`` the pending batches behind its own; ``otherwise``: what to do if it closed."""

    run_key: str
    otherwise: Launch | None = None


@dataclass(frozen=True)
class Reissue:
    """The head's run was never created (the tick that requested it died first): request it again, same run key."""

    head: Batch


@dataclass(frozen=True)
class FailRun:
    """The head's run failed: the head becomes the failover checkpoint (retried alone at ``retry_at``), the run's
    other batches go back to pending (they were not refused)."""

    head: Batch
    error: str
    retry_at: dt.datetime
    note: str | None = None  # for the tick log


@dataclass(frozen=True)
class Requeue:
    """The head's run was interrupted by a shutdown before this code location started (nothing said of the sink):
    its batches go back to pending, nothing counted (``checkpoint``: the head stays the failover's, due now)."""

    head: Batch
    checkpoint: bool = False
    note: str | None = None  # for the tick log


@dataclass(frozen=True)
class LeaveFailover:
    """The stream caught up: failover ends, then ``then`` (decided as for a healthy stream)."""

    then: Action
    note: str


Action = Wait | Launch | Warm | Extend | Reissue | FailRun | Requeue | LeaveFailover


# --- the run's transitions: its own, not the sensor's decisions (ledger.state.apply_run) ---------------

@dataclass(frozen=True)
class CloseRun:
    """The open run ``run_key`` stops taking batches (idle, paused, a replay waits...). Refused (``apply_run``
    false) while batches assigned to it are not delivered: it delivers them first."""

    stream_id: int
    run_key: str


RunAction = CloseRun


def decide(state: StreamState, run: RunView, now: dt.datetime, stream: StreamConfig) -> Action:
    """What the sensor does next: ``run`` views ``state.watched_run_key`` (:data:`NO_RUN` when that is None)."""
    if state.in_failover and state.caught_up:
        return LeaveFailover(_next(state, run, now, stream, in_failover=False),
                             note=f"stream {state.stream_id} caught up: failover over")
    return _next(state, run, now, stream, in_failover=state.in_failover)


def _next(state: StreamState, run: RunView, now: dt.datetime, stream: StreamConfig, *, in_failover: bool) -> Action:
    head = state.head
    if head is None:
        return _keep_warm(state, now, stream, in_failover=in_failover)
    sid = state.stream_id
    if state.paused:
        return Wait(f"stream {sid} is paused: batch {head.id} waits (`pgstream-dagster resume {sid}`)",
                    short=f"stream {sid} still paused")
    # a run stays open for new batches only on a healthy stream: catch-up runs end when done
    keep_open = stream.delivery.keeps_open and not in_failover
    if head.status is BatchStatus.PENDING:
        launch = Launch(RunOrder(head, state.next_run, head.attempts + 1), keep_open)
        if state.open_run_key is None:
            return launch
        if run.status is RunStatus.LIVE:
            return Extend(state.open_run_key, otherwise=launch)
        # it ended without closing (failed, canceled) or died (reported failed by the sensor)
        return replace(launch, replaces=state.open_run_key)
    if head.status is BatchStatus.FAILED:
        if head.next_attempt_at is not None and head.next_attempt_at > now:
            return Wait(f"stream {sid} in failover at batch {head.id} ({head.error}); "
                        f"retry at {head.next_attempt_at:%H:%M:%S}",
                        short=f"stream {sid} still in failover at batch {head.id} (attempt {head.attempts}); "
                              f"retry at {head.next_attempt_at:%H:%M:%S}",
                        key=failover_key(head.id, head.next_attempt_at))
        # the failover probe: the failed batch is retried alone
        return Launch(RunOrder(head, (head.id,), head.attempts + 1), keep_open)
    # launched: what became of its run
    if run.status is RunStatus.NOT_FOUND:
        return Reissue(head)
    if run.status is RunStatus.LIVE:
        return Extend(head.run_key or "")  # it may be open: hand it what was recorded behind its batches
    if run.status is RunStatus.FAILED and run.interrupted:
        # a shutdown stopped it, which says nothing about its batch or the sink: no failure counted
        return Requeue(head, checkpoint=in_failover,
                       note=f"stream {sid}: run {run.run_id} was interrupted by the shutdown before this start; "
                            f"batch {head.id} is launched again (not a failure: no failover, no attempt counted)")
    if run.status in (RunStatus.FAILED, RunStatus.DEAD):
        retry_at = now + dt.timedelta(seconds=backoff_secs(stream, head.attempts))
        reason = run.error or run.outcome
        return FailRun(head, f"run {run.run_id}: {reason}", retry_at,
                       note=f"stream {sid} in failover at batch {head.id}: run {run.run_id} {run.outcome} "
                            f"({reason}); retry at {retry_at:%H:%M:%S}")
    if run.status is RunStatus.SUCCEEDED:
        # a successful run delivers all its batches; a success without it is an inconsistency
        return FailRun(head, f"run {run.run_id} succeeded without confirming batch {head.id}", now)
    return Wait()


def warm_run_key(stream_id: int, incarnation: str, now: dt.datetime) -> str:
    """To the microsecond: a group run hosts a run key once, so one made again would be left without a host."""
    return f"pgstream-s{stream_id}-{incarnation}-warm-{round(now.timestamp() * 1_000_000)}"


def _keep_warm(state: StreamState, now: dt.datetime, stream: StreamConfig, *, in_failover: bool) -> Action:
    """Mode ``open``: an open run kept ready (one that ended without closing: replaced by the next batch's run)."""
    if stream.delivery.keeps_open and not state.paused and not in_failover and state.open_run_key is None:
        return Warm(warm_run_key(state.stream_id, state.incarnation, now))
    return Wait()


def notes(action: Action) -> list[str]:
    """What the tick log says about ``action``: why nothing was launched, failover entered or left."""
    match action:
        case LeaveFailover(then=then, note=note):
            return [note, *notes(then)]
        case Wait(reason=note) | FailRun(note=note) | Requeue(note=note) if note is not None:
            return [note]
    return []


#: how often a state the tick log said (paused, failover waiting for its retry) is recalled while it lasts
REMIND_EVERY_SECS = 60.0


def _lasting(action: Action) -> Wait | None:
    match action:
        case LeaveFailover(then=then):
            return _lasting(then)
        case Wait(reason=reason) if reason is not None:
            return action
    return None


def failover_key(batch_id: int, retry_at: dt.datetime) -> str:
    """What a failover waiting for its retry is (:attr:`Wait.key`): its checkpoint and retry time."""
    return f"failover at {batch_id} until {retry_at.timestamp():.6f}"


def tick_notes(action: Action, said: dict[str, Any], now: float) -> list[str]:
    """:func:`notes` for a sensor deciding many times: a transition each time, a lasting state once, then its short
    form every :data:`REMIND_EVERY_SECS` (``now``: epoch seconds); ``said``: what was said (its cursor)."""
    state = _lasting(action)
    lines = [n for n in notes(action) if state is None or n != state.reason]
    if isinstance(action, FailRun):  # its note tells the failover it starts: the wait that follows was said
        said["state"], said["at"] = failover_key(action.head.id, action.retry_at), now
        return lines
    if state is None or state.reason is None:
        said.pop("state", None)
        said.pop("at", None)
        return lines
    if said.get("state") != (state.key or state.reason):
        said["state"], said["at"] = state.key or state.reason, now
        return [*lines, state.reason]
    if now - float(said.get("at") or 0) >= REMIND_EVERY_SECS:
        said["at"] = now
        return [*lines, state.short or state.reason]
    return lines
