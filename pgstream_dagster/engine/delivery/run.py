"""A delivery run, without Dagster: a stream's consecutive ledger batches delivered in order through its sink,
round after round (each confirmation written to the ledger before more is published), then, mode ``open``, what
commits next (:class:`OpenRun`) until ``tuning.max_run_secs``, a pause, failover, a replay or
:attr:`Host.stop_check`; rounds are told through :attr:`Host.report` (:class:`Summary`)."""

from __future__ import annotations

import datetime as dt
import gc
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ...config import StreamConfig
from ...sinks import Sink, SinkError, build_sink
from .. import dbconn, replication, status
from ..batches import CloseRun
from ..collector import fewer_collections
from ..handoff import Handoff
from ..ledger import deadletters, keyprogress, locks, state
from ..publish import (
    BatchDone,
    Confirmed,
    Finished,
    MissingEventsError,
    Progress,
    RejectPolicy,
    owed_spans,
)
from ..runlog import Log
from .sources import (
    KeyedSource,
    Owed,
    Readers,
    Source,
    SparkLoader,
    choose_source,
    publish_in_order,
)


class DeliveryError(RuntimeError):
    """The run cannot go on: the message says why and what to do; ``metadata`` what the host may show."""

    def __init__(self, message: str, metadata: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.metadata = metadata or {}


class LedgerConnectionBroken(DeliveryError):
    """The run's ledger connection broke mid-round: says nothing of the sink."""


@dataclass(frozen=True)
class RoundReport:
    """One round delivered: its batches, the events handled, when its read started, its source's class."""

    batches: list[state.Batch]
    delivered: int
    started: float
    route: str


@dataclass(frozen=True)
class Summary:
    """The rounds of a reporting period, told to the host at once (:attr:`Host.report`)."""

    stream_id: int
    sink_type: str
    first: state.Batch
    last: state.Batch
    batches: int
    rounds: int
    events: int
    kinds: list[str]
    duration_secs: float
    max_lag_secs: float | None  # the slowest round's first batch: commit -> delivered


@dataclass(frozen=True)
class Host:
    """What the run needs from whoever runs it; ``run_id`` marks its batches and names its connections."""

    run_id: str
    log: Log
    spark: SparkLoader | None = None  # the Spark session, started when a round first goes to Spark
    stop_check: Callable[[], str | None] = lambda: None  # a reason to close only the host knows (asked once a second)
    report: Callable[[Summary], None] = lambda _summary: None  # told what the rounds delivered (:class:`Summary`)
    control: str = "the control job"  # how the host names its control job (an error tells the operator to use it)
    #: waits up to the given seconds for a sign the ledger moved (true: one came); None: the run listens and polls
    wake: Callable[[float], bool] | None = None
    report_every_secs: float | None = None  # reported at most this often (None: ``tuning.report_every_secs``)


@dataclass
class DeliveryRun:
    """A run of ``stream``: ``batch_id`` .. ``through_batch_id``, or (None) a warm run: the open run ``run_key``."""

    stream: StreamConfig
    database_url: str
    executor_url: str
    run_id: str
    batch_id: int | None = None
    through_batch_id: int | None = None
    run_key: str | None = None
    batches: list[state.Batch] = field(default_factory=list)
    started: float = 0.0
    connections: locks.RunConnections | None = None  # where it holds its lease and does ledger work (None: its own)
    handoff: Handoff | None = None  # what its group run's reader recorded for it (None: every round is read)

    def __post_init__(self) -> None:
        self.ledger: locks.RunConnections = self.connections or locks.OwnConnection(self.database_url)

    def start(self, log: Log) -> DeliveryRun:
        """Take the stream's delivery lease (waiting for a replay that holds it) and check the batches may run;
        raises :class:`DeliveryError` (the lease given up) or :class:`~..ledger.locks.LeaseTaken`."""
        stream_id = self.stream.id
        self.started = time.monotonic()
        self.ledger.take_lease(stream_id, self.run_id,
                               lambda replay: log.info(f"stream {stream_id}: waiting for replay {replay} to end "
                                                       "(it holds the delivery lease)"))
        if self.batch_id is None:
            log.info(f"stream {stream_id}: open run, ready for what commits")
            return self
        try:
            with self.ledger.connection() as conn:
                batches = state.batches_between(conn, stream_id, self.batch_id, self.through_batch_id or self.batch_id)
                if not batches or batches[0].id != self.batch_id:
                    raise DeliveryError(f"batch {self.batch_id} of stream {stream_id} does not exist")
                if done := [b.id for b in batches if not b.status.is_open]:
                    raise DeliveryError(f"batches {done} of stream {stream_id} are already delivered or skipped")
                if (earlier := state.earlier_open(conn, stream_id, self.batch_id)) is not None:
                    raise DeliveryError(f"batch {self.batch_id} would overtake open batch {earlier} of stream "
                                        f"{stream_id}; batches are delivered in order")
        except BaseException:
            self.ledger.give_up_lease(stream_id)
            raise
        self.batches = batches
        return self

    def give_back(self) -> list[int]:
        """After a shutdown ended the run: the batches it held go back to pending, on a connection of its own."""
        run_key = self.batches[0].run_key if self.batches else self.run_key
        if not run_key:
            return []
        with dbconn.connect(self.database_url, autocommit=True, application_name=locks.lease_name(self.run_id)) as conn:
            return state.give_back(conn, self.stream.id, run_key)

    def deliver(self, host: Host) -> Generator[RoundReport, None, None]:
        """Deliver the run's batches, then (an open run) what the sensor assigns to it, round by round."""
        stream, ledger = self.stream, self.ledger
        run_key = self.batches[0].run_key if self.batches else self.run_key
        with ledger.connection() as conn:
            wanted = bool(self.batches) or bool(run_key and state.run_is_open(conn, stream.id, run_key))
            if not wanted:  # a warm run the stream no longer wants (another run is open): nothing to do
                ledger.give_up_lease(stream.id)
                host.log.info(f"stream {stream.id}: not the stream's open run; nothing to deliver")
                return
            if host.wake is None:  # (a host that wakes the run listens for it)
                state.listen_runs(conn, stream.id)
        run_key = run_key or ""
        # the lease is given up when the run ends; the sink serves every round (by_key: the tasks' own sinks)
        with fewer_collections(), ExitStack() as leasing:
            leasing.callback(ledger.give_up_lease, stream.id)
            sink = leasing.enter_context(build_sink(stream.sink))
            open_run = OpenRun(host, ledger, stream, run_key)
            reports = Reports(host, stream)
            batches, started = direct_round(stream, self.batches), self.started
            after, more = 0, len(batches) < len(self.batches)
            if batches:
                total = sum(b.event_count for b in batches)
                kinds = ", ".join(sorted({b.kind for b in batches}))
                rest = f"; the other {len(self.batches) - len(batches)} batches in the next rounds" if more else ""
                host.log.info(f"stream {stream.id}: {len(batches)} batches {batches[0].id}..{batches[-1].id}, "
                              f"{total} events ({kinds}){rest}")
            try:
                while True:
                    if batches:
                        with ledger.connection() as conn:  # (the round's: what the sink confirms is recorded on it)
                            recording = sink.go_on = locks.RecordingCheck(conn)  # once broken, nothing more is sent
                            readers = Readers(self.database_url, self.executor_url, conn, host.spark, sink,
                                              self.handoff)
                            round_ = _Round(host, conn, recording, ledger, stream, sink, batches, self.database_url,
                                            self.executor_url)
                            source = choose_source(stream.delivery, Owed(round_.owed), readers)
                            try:
                                delivered = round_.deliver(source)
                            except state.StreamPaused:
                                waiting = state.give_back(conn, stream.id, run_key)
                                host.log.info(f"stream {stream.id} paused: the run stopped publishing and closed; "
                                              f"{waiting_batches(waiting)} for `pgstream-dagster resume {stream.id}`")
                                return
                        done = RoundReport(batches, delivered, started, type(source).__name__)
                        reports.add(done)
                        after = batches[-1].id
                        if self.handoff is not None:  # (a round not read from it: through Spark)
                            self.handoff.forget(stream.id, after)
                        yield done
                    handed = open_run.next_batches(after, more=more)
                    batches = direct_round(stream, handed)
                    more = len(batches) < len(handed)  # the rest was handed over already: the next round's
                    if not batches:
                        break
                    if (earlier := open_run.earlier_open) is not None:  # (read with the batches): never overtake
                        raise DeliveryError(f"batch {batches[0].id} would overtake open batch {earlier} of "
                                            f"stream {stream.id}")
                    started = time.monotonic()
            finally:
                reports.flush()  # what was delivered before the run ended, however it ended


def direct_round(stream: StreamConfig, batches: list[state.Batch]) -> list[state.Batch]:
    """The first ``batches`` up to ``direct_max_events`` events (one at least; ordering global; bench/sustained.py)."""
    limit = stream.delivery.direct_max_events
    if stream.delivery.ordering != "global" or limit <= 0:
        return batches
    total = 0
    for i, batch in enumerate(batches):
        total += batch.event_count
        if total > limit and i > 0:
            return batches[:i]
    return batches


def dead_letters(stream: StreamConfig, database_url: str, token: str | None = None) -> deadletters.DeadLetterWriter:
    """What ``on_reject: dead_letter`` sets aside, and events too large for the sink whatever ``on_reject`` says."""
    return deadletters.DeadLetterWriter(database_url, stream.id, stream.sink.type,
                                        resumes=stream.delivery.ordering == "global", token=token)


def reject_policy(stream: StreamConfig, database_url: str, token: str | None = None) -> RejectPolicy | None:
    delivery = stream.delivery
    if delivery.on_reject != "dead_letter":
        return None
    writer = dead_letters(stream, database_url, token)
    return RejectPolicy(writer, max_attempts=delivery.max_attempts,
                        max_consecutive=delivery.max_consecutive_rejects,
                        backoff_secs=min(stream.retry.initial_backoff_secs, 5.0), known_good=writer.known_good)


class _Round:
    """One round: ``batches`` read from a source, delivered through the run's ``sink``, each marked."""

    def __init__(self, host: Host, conn: psycopg.Connection, recording: locks.RecordingCheck,
                 ledger: locks.RunConnections, stream: StreamConfig, sink: Sink, batches: list[state.Batch],
                 database_url: str, executor_url: str) -> None:
        self.host, self.conn, self.stream, self.sink, self.batches = host, conn, stream, sink, batches
        self.recording = recording  # whether ``conn`` still answers (the sink asks it before each request)
        self.ledger = ledger  # (the lease's session: only the lease's holder is given a by_key round's token)
        # what runs on the executors (by_key tasks) connects with the executors' URL, what runs here with the runtime's
        self.database_url = executor_url if stream.delivery.ordering == "by_key" else database_url
        # global order resumes after what the sink confirmed (by_key tasks skip what ``key_progress`` holds)
        self.owed = owed_spans(batches, resume=stream.delivery.ordering == "global")
        self.expected = {span.batch_id: span.events for span in self.owed}

    def deliver(self, source: Source) -> int:
        """The events handled (confirmed, or set aside). Once ``conn`` is broken (``recording``) the run stops
        before the sink's next request: nothing it confirms could be recorded."""
        try:
            return self._deliver(source)
        except state.LeaseLost as exc:
            raise DeliveryError(str(exc)) from None
        except (psycopg.Error, SinkError):
            if self.recording():  # the connection still answers: not what stopped the run
                raise
            raise LedgerConnectionBroken(
                f"stream {self.stream.id}: the run's ledger connection is broken ({self.recording.broken}): what the "
                f"sink confirms can no longer be recorded, so the run stopped publishing; the next run resumes "
                f"after the last confirmation recorded") from None

    def _deliver(self, source: Source) -> int:
        conn, stream = self.conn, self.stream
        batch_ids = [b.id for b in self.batches]
        skip = deadletters.dead_letter_positions(conn, stream.id, batch_ids)
        for batch_id in [b for b, events in self.expected.items() if events == 0]:
            self._mark_delivered(batch_id, 0)  # confirmed in full by a run that died before marking it
        try:
            if isinstance(source, KeyedSource):
                # the Spark tasks write (resume points, dead letters) with the round's delivery token only
                with self.ledger.lease_session() as session:
                    token = keyprogress.issue_delivery_token(session, stream.id, self.host.run_id)
                delivered = self._by_key(source, skip, reject_policy(stream, self.database_url, token), token)
            else:
                assert hasattr(source, "events"), f"{type(source).__name__} is no source of a delivery round"
                delivered = self._in_order(source, skip, reject_policy(stream, self.database_url))
        except MissingEventsError:
            raise vanished_error(conn, stream.id, batch_ids, self.host.control) from None
        missing, dead = state.round_outcome(conn, stream.id, batch_ids)
        if missing:
            raise DeliveryError(f"batches {missing} had no events in pgstream.events; refusing to mark them delivered")
        if set_aside := dead - len(skip):  # (the round skipped those set aside before it)
            self.host.log.warning(
                f"stream {stream.id}: {set_aside} events were rejected by the sink or larger than it can ever take "
                f"and set aside as dead letters (pgstream-dagster dead-letters list {stream.id})")
        return delivered

    def _mark_delivered(self, batch_id: int, handled: int) -> None:
        if handled != self.expected[batch_id]:
            raise DeliveryError(f"batch {batch_id}: {self.expected[batch_id]} events were owed but {handled} "
                                f"were handled; refusing to mark it delivered")
        if not state.mark_delivered(self.conn, batch_id, self.host.run_id):
            raise DeliveryError(f"batch {batch_id} was already marked delivered by another run")

    def _in_order(self, source: Any, skip: frozenset[tuple[int, int]], reject: RejectPolicy | None) -> int:
        """Global order: each step recorded before more is published; the events handled (progress logged)."""
        stream, conn = self.stream, self.conn
        total, chunk_size = sum(self.expected.values()), stream.delivery.chunk_size
        step = max(chunk_size, total // 10)
        next_log, delivered = step, 0
        every, logged_at = stream.delivery.tuning.report_every_secs, time.monotonic()
        too_large = dead_letters(stream, self.database_url).too_large
        # a sink keyed by ledger positions (the lakes) gets a former primary's events by id: after a failover the
        # new primary's ledger holds some of them in batches the old one never had
        ended_below = replication.timeline_floor(conn) if getattr(self.sink, "accepts_positions", False) else 0
        # each publish call holds the stream row against a pause (``state.publishing``): none after one
        with closing(publish_in_order(source, self.sink, chunk_size, skip=skip, reject=reject, owed=self.owed,
                                      too_large=too_large, chunk_bytes=stream.delivery.tuning.max_read_bytes,
                                      gate=self._publishing, ended_below=ended_below)) as deliveries:
            for delivery in deliveries:
                match delivery:
                    case Confirmed(batch_id, ord):  # a retry resumes after it
                        state.mark_confirmed(conn, batch_id, ord)
                    case BatchDone(batch_id, events):
                        self._mark_delivered(batch_id, events)
                    case Progress(handled) if next_log <= handled < total:
                        next_log = handled + step
                        if time.monotonic() - logged_at >= every:
                            self.host.log.info(f"stream {stream.id}: {handled}/{total} events handled")
                            logged_at = time.monotonic()
                    case Finished(handled):
                        delivered = handled
        return delivered

    @contextmanager
    def _publishing(self) -> Iterator[None]:
        """A publish call's gate (``state.publishing``): the connection has just answered (``RecordingCheck``)."""
        with state.publishing(self.conn, self.stream.id, self.host.run_id):
            self.recording.answered()
            yield

    def _by_key(self, source: KeyedSource, skip: frozenset[tuple[int, int]], reject: RejectPolicy | None,
                token: str) -> int:
        """Per routing key, on the executors; each batch marked delivered once the tasks' counts add up."""
        from .. import spark

        stream, conn, expected = self.stream, self.conn, self.expected
        batch_ids = list(expected)
        # no resume point per batch: every event must be there (or set aside) before anything is sent
        gone = [(b, o) for b, o, _e in deadletters.vanished(conn, batch_ids)]
        if any(p not in skip for p in gone):
            raise MissingEventsError([p for p in gone if p not in skip])
        # an interrupted attempt's resume points hold for its partitioning: keep it until the round is delivered
        parallelism = stream.delivery.parallelism
        partitions = keyprogress.key_progress_partitions(conn, stream.id, batch_ids[0]) or parallelism
        keyprogress.clear_key_progress(conn, stream.id, keep_partitions=partitions)
        if partitions != parallelism:
            self.host.log.info(f"stream {stream.id}: resuming an interrupted by_key attempt with its {partitions} "
                               f"partitions (delivery.parallelism {parallelism} applies from the next round)")
        progress = keyprogress.KeyProgress(self.database_url, stream.id, partitions, token=token)
        # the whole round's tasks publish holding the stream row against a pause (it waits for the round)
        with state.publishing(conn, stream.id, self.host.run_id):
            result = spark.deliver_by_key(source.frame, stream.sink, stream.delivery.chunk_size, partitions,
                                          skip=skip, reject=reject, progress=progress,
                                          too_large=dead_letters(stream, self.database_url, token).too_large,
                                          chunk_bytes=stream.delivery.tuning.max_read_bytes)
        vanished_in = {b: sum(1 for g, _o in gone if g == b) for b in batch_ids}
        wrong = {b: (result.handled.get(b, 0), events) for b, events in expected.items()
                 if result.handled.get(b, 0) + vanished_in[b] != events}
        if wrong:
            shown = ", ".join(f"batch {b}: {got} of {events}" for b, (got, events) in list(wrong.items())[:10])
            raise DeliveryError(f"the ledger and the events handled by the Spark tasks disagree ({shown}); "
                                f"refusing to mark batches delivered")
        for b, events in expected.items():
            self._mark_delivered(b, events)
        keyprogress.clear_key_progress(conn, stream.id, through_batch_id=batch_ids[-1])
        if result.resumed:
            self.host.log.info(f"stream {stream.id}: {result.resumed} events confirmed by an interrupted attempt "
                               f"were not published again")
        return result.total


def waiting_batches(batch_ids: list[int]) -> str:
    """What a run that closed early left waiting, as its log says it: ``batches 3..7 wait`` or ``no batch waits``."""
    return f"batches {batch_ids[0]}..{batch_ids[-1]} wait" if batch_ids else "no batch waits"


def vanished_error(conn: psycopg.Connection, stream_id: int, batch_ids: list[int],
                   control: str = "the control job") -> DeliveryError:
    """The run stops at events that vanished from pgstream.events: say which, and how to go on."""
    skip = deadletters.dead_letter_positions(conn, stream_id, batch_ids)
    gone = [(b, o, e) for b, o, e in deadletters.vanished(conn, batch_ids) if (b, o) not in skip]
    ids = [e for _b, _o, e in gone]
    shown = ", ".join(f"{e} (batch {b} #{o})" for b, o, e in gone[:20]) + (" ..." if len(gone) > 20 else "")
    return DeliveryError(
        f"stream {stream_id}: {len(gone)} events the ledger owes are no longer in pgstream.events: {shown}. "
        f"Nothing after the first of them was delivered. To go on without them, set them aside (they become dead "
        f"letters without payload): `pgstream-dagster dead-letters set-aside {stream_id} "
        f"{' '.join(map(str, ids[:20]))} --reason vanished --yes`, or {control} with "
        f"action set_aside; or skip their batch.",
        metadata={"vanished_event_ids": ids[:1000]})


WOKEN_POLL_SECS = 5.0  # a run its host wakes still looks at the ledger this often (what the host does not watch)

_freeze_lock = threading.Lock()
_frozen_process = threading.Event()  # set once a run of this process froze what the process holds


def _freeze_once() -> None:
    """A full collection, then what survives it is left out of later ones (``gc.freeze``): once a process."""
    with _freeze_lock:
        if _frozen_process.is_set():
            return
        gc.collect()
        gc.freeze()
        _frozen_process.set()


class OpenRun:
    """Keeps a run open after its batches (sql/010_open_runs.sql), waiting for those handed to it until it closes."""

    def __init__(self, host: Host, ledger: locks.RunConnections, stream: StreamConfig, run_key: str) -> None:
        self.host, self.ledger, self.stream, self.run_key = host, ledger, stream, run_key
        self.opened = time.monotonic()
        self._frozen = not stream.delivery.keeps_open
        self.earlier_open: int | None = None  # the oldest open batch before the first next_batches returned
        self._looked = False

    def next_batches(self, after: int, *, more: bool = False) -> list[state.Batch]:
        """The batches assigned to the run after batch ``after``; empty once the run is closed. ``more``: the last
        round took part of what it was handed: looked up at once, not once woken."""
        stays, max_run_secs = self.stream.delivery.keeps_open, self.stream.delivery.tuning.max_run_secs
        if not self._frozen:
            # frozen once per process, after the first round: what the process holds stops being scanned
            _freeze_once()
            self._frozen = True
        wake, checked_at = self.host.wake, 0.0
        woken, polled_at = True, 0.0
        if wake is not None and self._looked and not more and not wake(0.0):
            # a run its host wakes looks again only once woken, or at its safety interval
            woken, polled_at = False, time.monotonic()
        self._looked = True
        while True:
            now = time.monotonic()
            # woken by the host (or its safety interval passed), or polling on its own: look at the ledger
            look = wake is None or woken or now - polled_at >= WOKEN_POLL_SECS
            with self.ledger.connection() as conn:  # (one for this look: given back while the run waits)
                batches: list[state.Batch] = []
                replay, close = False, None
                if look:
                    polled_at = now
                    # a replay waits for the lease: take nothing more, deliver what was handed over, close
                    seen = state.next_assigned(conn, self.stream.id, self.run_key, after, self.host.run_id)
                    batches, replay, self.earlier_open, close = (seen.batches, seen.replay_waiting,
                                                                 seen.earlier_open, seen.close)
                if batches:
                    return batches
                now = time.monotonic()
                reason = None
                if replay:
                    reason = "a replay of the stream waits for the delivery lease"
                elif not stays:
                    reason = "its batches are delivered (delivery.mode per_batch)"
                elif now - self.opened >= max_run_secs:
                    reason = f"open for {max_run_secs:g}s (delivery.tuning.max_run_secs)"
                elif look and (wake is not None or now - checked_at >= 1.0):
                    checked_at = now
                    reason = close or self.host.stop_check()
                if reason is not None:
                    if state.apply_run(conn, CloseRun(self.stream.id, self.run_key)):
                        if stays:
                            self.host.log.info(f"stream {self.stream.id}: run closed ({reason})")
                        return []
                    continue  # the sensor assigned batches just before: deliver them first
                if wake is None:
                    for _ in conn.notifies(timeout=0.5, stop_after=1):
                        pass
                    continue
            woken = wake(max(0.01, WOKEN_POLL_SECS - (time.monotonic() - polled_at)))


class Reports:
    """What the rounds delivered: the first at once, later ones together every ``report_every_secs``, the end. After
    the first, each stream's reports keep a phase of their own (its id's): the members of a group run, started
    together, do not all report in the same second of every period (100 members: 100 event-log writes at once
    every 20 s held the group run's other threads for seconds)."""

    def __init__(self, host: Host, stream: StreamConfig) -> None:
        self.host, self.stream = host, stream
        self.reported_at = -float("inf")
        self.phase = status.phase(stream.id)
        self._reset()

    def _reset(self) -> None:
        self.first: state.Batch | None = None
        self.last: state.Batch | None = None
        self.kinds: set[str] = set()
        self.batches = self.events = self.rounds = 0
        self.started = 0.0
        self.max_lag: float | None = None

    def add(self, done: RoundReport) -> None:
        batches = done.batches
        if self.first is None:
            self.first, self.started = batches[0], done.started
        self.last = batches[-1]
        self.kinds |= {b.kind for b in batches}
        self.batches += len(batches)
        self.events += done.delivered
        self.rounds += 1
        if batches[0].first_commit_at is not None:
            lag = (dt.datetime.now(dt.UTC) - batches[0].first_commit_at).total_seconds()
            self.max_lag = lag if self.max_lag is None else max(self.max_lag, lag)
        if time.monotonic() - self.reported_at >= self.every:
            self.flush()

    @property
    def every(self) -> float:
        return self.host.report_every_secs or self.stream.delivery.tuning.report_every_secs

    def flush(self) -> None:
        first, last = self.first, self.last
        if first is None or last is None:
            return
        # (no status read here: the group's sensor observes each member's status)
        self.host.report(Summary(
            stream_id=self.stream.id, sink_type=self.stream.sink.type, first=first, last=last, batches=self.batches,
            rounds=self.rounds, events=self.events, kinds=sorted(self.kinds),
            duration_secs=round(time.monotonic() - self.started, 3),
            max_lag_secs=round(self.max_lag, 3) if self.max_lag is not None else None))
        opening = self.reported_at == -float("inf")  # (the first report: the next one at the stream's phase)
        self.reported_at = time.monotonic() + (self.every * self.phase if opening else 0.0)
        self._reset()
