"""Publishing events through a sink in the order owed, in plain Python: :func:`publish` yields what happened,
suspended while the caller records each step. A position out of order (:class:`OrderError`), or one owed neither
read nor set aside (:class:`MissingEventsError`), stops it before anything after it is published; so does a permanent
rejection, unless a :class:`RejectPolicy` isolates the event (bisecting), retries it and sets it aside. After
``max_consecutive`` rejections in a row, or a call's first, the sink's last confirmed event is sent again: refused
too (or none), the sink is misconfigured and the run stops (:class:`RejectStormError`) instead of setting events aside.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from ..sinks import Event, Sink, SinkError


@dataclass(frozen=True)
class TooLarge:
    """In place of an event not read: its payload (``size`` bytes as JSON text) is over the sink's ``limit``."""

    id: int
    size: int
    limit: int

    @property
    def reason(self) -> str:
        return (f"event {self.id}: its payload is {self.size} bytes as JSON text, more than the sink can ever take "
                f"({self.limit} bytes): set aside before sending")


Position = tuple[int, int]
"""``(batch_id, ord)``: an event's place in the delivery order (ledger batch, 1-based ordinal in it)."""
Positioned = tuple[int, int, "Event | TooLarge"]
"""``(batch_id, ord, event)``: an event (or a :class:`TooLarge` in its place) at its place in the delivery order."""
SetAside = Callable[[int, int, Event, str, int], None]
"""``(batch_id, ord, event, error, attempts)``: record the event as a dead letter, durably, before the next is sent."""
SetAsideTooLarge = Callable[[int, int, TooLarge], None]
"""``(batch_id, ord, too_large)``: as :data:`SetAside`, the payload copied by the database (never read by the run)."""


@dataclass(frozen=True)
class Span:
    """Ordinals ``first..last`` (1-based, inclusive) of ledger batch ``batch_id``: what a run owes of a batch,
    what a Spark partition reads of it. Empty when ``first > last`` (an earlier attempt confirmed it all)."""

    batch_id: int
    first: int
    last: int

    @property
    def events(self) -> int:
        return max(0, self.last - self.first + 1)

    def split(self, size: int) -> list[Span]:
        """The span in pieces of at most ``size`` ordinals, in order."""
        return [Span(self.batch_id, lo, min(lo + size - 1, self.last)) for lo in range(self.first, self.last + 1, size)]


class BatchProgress(Protocol):
    """What :func:`owed_spans` reads of a ledger batch (:class:`~.ledger.state.Batch`)."""

    @property
    def id(self) -> int: ...
    @property
    def event_count(self) -> int: ...
    @property
    def confirmed_count(self) -> int: ...


def owed_spans(batches: Iterable[BatchProgress], *, resume: bool) -> list[Span]:
    """One span per batch: every event, or (``resume``) those after the prefix an earlier attempt confirmed."""
    return [Span(b.id, (b.confirmed_count if resume else 0) + 1, b.event_count) for b in batches]


# --- what the publisher yields ----------------------------------------------------------------------

@dataclass(frozen=True)
class Confirmed:
    """Every position owed up to ``(batch_id, ord)`` is handled: a retry of the batch may resume after ``ord``."""

    batch_id: int
    ord: int


@dataclass(frozen=True)
class BatchDone:
    """Every event of batch ``batch_id`` read or owed in this call is handled: ``events`` of them."""

    batch_id: int
    events: int


@dataclass(frozen=True)
class Progress:
    """Events handled so far (confirmed by the sink, set aside, or skipped)."""

    handled: int


@dataclass(frozen=True)
class Finished:
    """Every row was handled: ``handled`` events in all. Always the last."""

    handled: int


Delivery: TypeAlias = Confirmed | BatchDone | Progress | Finished
#: a publish loop: close it to stop it (nothing more is published)
Deliveries: TypeAlias = Generator[Delivery, None, None]


class OrderError(RuntimeError):
    """Rows reached the publisher out of order: nothing after them is published."""


class MissingEventsError(RuntimeError):
    """Events the ledger owes (``positions``) are gone from ``pgstream.events``: nothing after the first is sent."""

    def __init__(self, positions: list[Position]) -> None:
        shown = ", ".join(f"batch {b} #{o}" for b, o in positions[:20])
        more = f" and {len(positions) - 20} more" if len(positions) > 20 else ""
        super().__init__(f"{len(positions)} events owed are no longer in pgstream.events ({shown}{more})")
        self.positions = positions


class RejectStormError(SinkError):
    """Rejections in a row, and the sink refused an event it confirmed before (or none): the sink is at fault."""


@dataclass(frozen=True)
class RejectPolicy:
    """``on_reject: dead_letter``: how a permanently rejected event is retried, then set aside."""

    set_aside: SetAside
    max_attempts: int = 3
    max_consecutive: int = 20
    backoff_secs: float = 0.5
    #: the stream's last event the sink confirmed before this call, sent again to check the sink (None: none)
    known_good: Callable[[], Event | None] | None = None


#: bytes of payload and metadata (JSON text) in one publish call at most, unless one event is larger
CHUNK_BYTES = 32 * 2**20
#: what each publish call runs in (a delivery run's: the stream is not paused, :func:`~.ledger.state.publishing`)
Gate = Callable[[], AbstractContextManager[None]]


def publish(sink: Sink, rows: Iterable[Positioned], chunk_size: int, *, skip: frozenset[Position] = frozenset(),
            reject: RejectPolicy | None = None, owed: Sequence[Span] | None = None,
            too_large: SetAsideTooLarge | None = None, chunk_bytes: int = CHUNK_BYTES,
            gate: Gate = nullcontext, ended_below: int = 0) -> Deliveries:
    """Publish ``rows`` (in the order owed) through the caller's ``sink`` in chunks of ``chunk_size`` events and
    ``chunk_bytes`` of JSON text (one at least), yielding what happened. ``owed``: the spans the rows must cover;
    ``too_large``: records a :class:`TooLarge` row (else :class:`EventTooLargeError`); ``gate``: each call's;
    ``ended_below``: the first event id of the database's timeline (events below it were written on a former
    primary, which may have published them: a sink keyed by positions is given them by id, batch 0)."""
    return _Publisher(sink, chunk_size, skip, reject, owed, too_large, chunk_bytes, gate, ended_below).run(rows)


def max_event_bytes(sink: Sink) -> int | None:
    """The sink's ``max_event_bytes()`` (None for a sink not derived from ``sinks.base.Sink``)."""
    limit = getattr(sink, "max_event_bytes", None)
    return limit() if limit is not None else None


class EventTooLargeError(SinkError):
    """An event is larger than the sink can ever take and there is nowhere to set it aside."""


@dataclass
class _Publisher:
    sink: Sink
    chunk_size: int
    skip: frozenset[Position]
    reject: RejectPolicy | None
    owed: Sequence[Span] | None
    too_large: SetAsideTooLarge | None = None
    chunk_bytes: int = CHUNK_BYTES
    gate: Gate = nullcontext
    ended_below: int = 0  # (publish's)
    handled: int = 0  # published + set aside + skipped
    consecutive_rejects: int = 0
    last_good: Event | None = None  # the last event the sink confirmed in this call (or its known_good)
    looked_up: bool = False  # RejectPolicy.known_good was called
    counts: dict[int, int] = field(default_factory=dict)  # per batch: events handled (for BatchDone)
    chunk: list[Event] = field(default_factory=list)
    where: list[Position] = field(default_factory=list)  # the position of each event of ``chunk``
    finished: list[int] = field(default_factory=list)  # batches whose last event is in ``chunk`` (or before)
    current: int | None = None  # the batch of the last position accounted for
    oi: int = 0  # the owed span of the next position owed
    next_ord: int = 0
    chunk_size_bytes: int = 0  # JSON text in ``chunk``

    def __post_init__(self) -> None:
        self.limit = max_event_bytes(self.sink)
        if self.owed is not None:
            self.owed = [s for s in self.owed if s.events]
            self.next_ord = self.owed[0].first if self.owed else 0

    def run(self, rows: Iterable[Positioned]) -> Deliveries:
        owed, skip, counts = self.owed, self.skip, self.counts
        last: Position | None = None
        for batch_id, ord, event in rows:
            position = (batch_id, ord)
            if last is not None and position <= last:
                raise OrderError(f"row {position} arrived after {last}: refusing to publish out of order")
            if owed is not None:
                # fast path: the row is the next position owed
                span = owed[self.oi] if self.oi < len(owed) else None
                if span is not None and span.batch_id == batch_id and self.next_ord == ord:
                    self._advance()
                elif missing := self._account(position):
                    yield from self._stop(missing)
            last = position
            if batch_id != self.current:
                self._batch_ends()
                self.current = batch_id
            counts[batch_id] = counts.get(batch_id, 0) + 1
            if skip and position in skip:
                self.handled += 1
                continue
            if event.__class__ is TooLarge:
                yield from self._set_aside_too_large(position, event)
                continue
            text, limit = event.payload_json, self.limit  # type: ignore[union-attr]  # (an Event)
            if limit is not None and len(text) * 4 > limit:  # (UTF-8: at most 4 bytes a character)
                # read by a reader that could not check it (Spark): set aside, never sent
                payload_bytes = len(text) if len(text) > limit else len(text.encode())
                if payload_bytes > limit:
                    yield from self._set_aside_too_large(position, TooLarge(event.id, payload_bytes, limit))
                    continue
            size = len(text) + len(event._metadata_json or "")  # type: ignore[union-attr]
            if self.chunk and self.chunk_size_bytes + size > self.chunk_bytes:
                yield from self._flush()
            self.chunk.append(event)  # type: ignore[arg-type]
            self.where.append(position)
            self.chunk_size_bytes += size
            if len(self.chunk) >= self.chunk_size:
                yield from self._flush()
        if owed is not None and (missing := self._account(None)):
            yield from self._stop(missing)
        self._batch_ends()
        yield from self._flush()
        yield Finished(self.handled)

    def _advance(self) -> None:  # to the next position owed
        assert self.owed is not None
        if self.next_ord < self.owed[self.oi].last:
            self.next_ord += 1
            return
        self.oi += 1
        self.next_ord = self.owed[self.oi].first if self.oi < len(self.owed) else 0

    def _batch_ends(self) -> None:
        if self.current is not None and self.current not in self.finished:
            self.finished.append(self.current)

    def _account(self, upto: Position | None) -> list[Position]:
        """Walk the owed positions up to ``upto`` (None: the end); those passed over, not set aside, vanished."""
        assert self.owed is not None
        missing: list[Position] = []
        counts = self.counts
        while self.oi < len(self.owed):
            position = (self.owed[self.oi].batch_id, self.next_ord)
            if position == upto:
                self._advance()
                break
            if upto is not None and position > upto:
                raise OrderError(f"row {upto} is not a position this run owes")
            if position[0] != self.current and not missing:
                self._batch_ends()  # every earlier position of the batch before was accounted for
                self.current = position[0]
            self._advance()
            if position in self.skip:
                self.handled += 1
                counts[position[0]] = counts.get(position[0], 0) + 1
            else:
                missing.append(position)
        else:
            if upto is not None:
                raise OrderError(f"row {upto} is not a position this run owes")
        return missing

    def _stop(self, missing: list[Position]) -> Iterator[Delivery]:
        """What came before the first gap is delivered (and its batches done); nothing after."""
        yield from self._flush()
        raise MissingEventsError(missing)

    def _set_aside_too_large(self, position: Position, row: TooLarge) -> Iterator[Delivery]:
        """What comes before it is published first; then it is recorded, never sent."""
        yield from self._flush()
        if self.too_large is None:
            raise EventTooLargeError(row.reason, event_ids=[row.id])
        self.too_large(position[0], position[1], row)
        self.handled += 1
        yield Confirmed(*position)
        yield Progress(self.handled)

    def _flush(self) -> Iterator[Delivery]:
        if self.chunk:
            events, where = self.chunk, self.where
            self.chunk, self.where, self.chunk_size_bytes = [], [], 0
            yield from self._publish(events, where, 0, len(events))
        finished, self.finished = self.finished, []
        for batch_id in finished:
            yield BatchDone(batch_id, self.counts.get(batch_id, 0))

    def _publish(self, events: list[Event], where: list[Position], lo: int, hi: int) -> Iterator[Delivery]:
        """Publish ``events[lo:hi]``; with a reject policy, isolate what the sink rejects for good by bisecting."""
        while lo < hi:
            try:
                self._send(events[lo:hi] if lo or hi < len(events) else events,
                           where[lo:hi] if lo or hi < len(where) else where)
            except SinkError as exc:
                if self.reject is None or not exc.permanent:
                    raise
                rejected = exc
            else:
                # the whole chunk in one call, its last batch done with it: the BatchDone that follows says it
                done = lo == 0 and hi == len(events) and where[-1][0] in self.finished
                yield from self._confirmed(events, where, lo, hi, then_done=done)
                return
            # the events before the first rejected one were confirmed (sink contract)
            ids = set(rejected.event_ids)
            named = [i for i in range(lo, hi) if events[i].id in ids]
            first = named[0] if named else lo
            yield from self._confirmed(events, where, lo, first)
            if len(named) <= 1:
                yield from self._alone(events[first], where[first], rejected)
                lo = first + 1
                continue
            end = named[-1] + 1
            mid = (first + end) // 2
            yield from self._publish(events, where, first, mid)
            yield from self._publish(events, where, mid, end)
            lo = end

    def _send(self, events: Sequence[Event], where: Sequence[Position]) -> None:
        """One publish call, inside the gate: with the events' positions for a sink that takes them (the lakes)."""
        with self.gate():
            if getattr(self.sink, "accepts_positions", False):
                if self.ended_below:  # a former primary's events: by id
                    where = [(0, e.id) if e.id < self.ended_below else w for e, w in zip(events, where, strict=True)]
                self.sink.publish_at(events, where)
            else:
                self.sink.publish(events)

    def _confirmed(self, events: Sequence[Event], where: Sequence[Position], start: int,
                   end: int, *, then_done: bool = False) -> Iterator[Delivery]:
        """The sink confirmed ``events[start:end]``; ``then_done``: the ``BatchDone`` that follows says it."""
        if end <= start:
            return
        self.handled += end - start
        self.consecutive_rejects = 0
        self.last_good = events[end - 1]
        if not then_done:
            yield Confirmed(*where[end - 1])
        yield Progress(self.handled)

    def _check_sink(self, event: Event, error: SinkError, *, storm: bool) -> bool:
        """Whether the sink took its last good event again (:class:`RejectStormError`: refused; none in a storm)."""
        policy = self.reject
        assert policy is not None
        probe = self.last_good
        if probe is None and policy.known_good is not None and not self.looked_up:
            self.looked_up = True
            probe = policy.known_good()
        what = (f"{policy.max_consecutive} events in a row were rejected (the last: event {event.id}, {error})"
                if storm else f"event {event.id} was rejected ({error})")
        if probe is None:
            if not storm:
                return False
            raise RejectStormError(
                f"{what}, and the sink has confirmed no event of the stream to check it with: a sink that "
                f"rejects everything is misconfigured, so the stream waits instead of setting them aside",
                sink=error.sink, event_ids=[event.id])
        try:
            with self.gate():
                self.sink.publish([probe])
        except SinkError as exc:
            if not exc.permanent:
                raise
            raise RejectStormError(
                f"{what}, and the sink now also rejects event {probe.id}, which it confirmed before ({exc}): "
                f"the sink is misconfigured, not the events, so the stream waits instead of setting them aside",
                sink=error.sink, event_ids=[event.id]) from None
        self.last_good = probe
        return True

    def _alone(self, event: Event, position: Position, first_error: SinkError) -> Iterator[Delivery]:
        """Publish a rejected event on its own, retrying; set it aside when the sink keeps rejecting it."""
        policy = self.reject
        assert policy is not None
        error: SinkError = first_error
        for attempt in range(1, policy.max_attempts + 1):
            if attempt > 1:
                time.sleep(min(policy.backoff_secs * 2 ** (attempt - 2), 30.0))
            try:
                self._send([event], [position])
            except SinkError as exc:
                if not exc.permanent:
                    raise
                error = exc
                continue
            yield from self._confirmed([event], [position], 0, 1)
            return
        storm = self.consecutive_rejects + 1 >= policy.max_consecutive
        if (storm or self.last_good is None) and self._check_sink(event, error, storm=storm):
            self.consecutive_rejects = 0  # the sink takes what it took before: the rejections are the events'
        policy.set_aside(position[0], position[1], event, str(error), policy.max_attempts)
        self.consecutive_rejects += 1
        self.handled += 1
        yield Confirmed(*position)
