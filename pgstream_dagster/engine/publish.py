"""Publishing events through a sink in the order owed: chunks, progress, vanished events and
permanent rejections. Plain Python (no Spark, no Dagster): the delivery job and replays feed it
rows in delivery order from the driver, ``ordering: by_key`` partitions from the executors.

* **Order.** Rows carry their position ``(batch_id, ord)``; one that is not after the previous
  one stops everything before it is published (:class:`OrderError`).
* **Nothing vanishes unnoticed.** Given the positions a run owes (:class:`Owed`), a position that
  is neither read nor set aside stops the run before anything after it is published
  (:class:`MissingEventsError`, naming the positions): the events before it are confirmed, the
  rest waits for the operator (set the vanished events aside, or skip the batch).
* **Set aside.** Positions in ``skip`` (events with a dead letter) are not published and count as
  handled.
* **Rejections** (:class:`~pgstream_dagster.sinks.SinkError` with ``permanent``): with no
  :class:`RejectPolicy` (``on_reject: block``) the error stops the run, as any other. With one
  (``on_reject: dead_letter``), the rejected event is isolated (the events before it in its
  chunk were confirmed, per the sink contract; a multi-event request the sink rejected as a whole
  is bisected), published alone up to ``max_attempts`` times, then handed to
  ``set_aside`` (which records the dead letter durably) and the next event goes on. More than
  ``max_consecutive`` events set aside in a row stops the run instead: a sink that rejects every
  event is misconfigured, and its events must wait, not be set aside.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..sinks import Event, SinkConfig, SinkError

Position = tuple[int, int]
"""``(batch_id, ord)``: an event's place in the delivery order (ledger batch, 1-based ordinal in it)."""
Positioned = tuple[int, int, Event]
"""``(batch_id, ord, event)``: an event and its place in the delivery order."""
BatchDone = Callable[[int, int], None]
"""Called with ``(batch_id, events)`` once every event of a batch in the run is handled."""
Confirmed = Callable[[int, int], None]
"""Called after every confirmed publish with the ``(batch_id, ord)`` of its last event."""
SetAside = Callable[[int, int, Event, str, int], None]
"""``(batch_id, ord, event, error, attempts)``: record the event as a dead letter, durably, before
the next event is published."""


class OrderError(RuntimeError):
    """Rows reached the publisher out of order: nothing after them is published."""


class MissingEventsError(RuntimeError):
    """Events the ledger owes are no longer in ``pgstream.events``: nothing after the first one is
    published. ``positions``: the ``(batch_id, ord)`` of the missing events found."""

    def __init__(self, positions: list[Position]) -> None:
        shown = ", ".join(f"batch {b} #{o}" for b, o in positions[:20])
        more = f" and {len(positions) - 20} more" if len(positions) > 20 else ""
        super().__init__(f"{len(positions)} events owed are no longer in pgstream.events ({shown}{more})")
        self.positions = positions


class RejectStormError(SinkError):
    """``max_consecutive`` events in a row were rejected: the sink, not the events, is at fault."""


@dataclass(frozen=True)
class RejectPolicy:
    """``on_reject: dead_letter``: how a permanently rejected event is retried, then set aside."""

    set_aside: SetAside
    max_attempts: int = 3
    max_consecutive: int = 20
    backoff_secs: float = 0.5


@dataclass(frozen=True)
class Owed:
    """The positions a run owes, in delivery order: per batch its first and last ordinal."""

    batches: tuple[tuple[int, int, int], ...]  # (batch_id, first_ord, last_ord)


@dataclass
class _State:
    handled: int = 0  # published + set aside + skipped
    consecutive_rejects: int = 0
    # per batch: events handled (for on_batch_done)
    counts: dict[int, int] = field(default_factory=dict)


def publish(sink_config: SinkConfig, rows: Iterator[Positioned], chunk_size: int, *,
            on_batch_done: BatchDone | None = None, on_progress: Callable[[int], None] | None = None,
            on_confirmed: Confirmed | None = None, skip: frozenset[Position] = frozenset(),
            reject: RejectPolicy | None = None, owed: Owed | None = None) -> int:
    """Publish ``rows`` (in the order owed) in chunks through a fresh sink; returns the events
    handled (confirmed by the sink, set aside, or skipped). A batch is reported done only after
    the publish call that carried its last event returned. See the module docstring."""
    publisher = _Publisher(sink_config, chunk_size, on_batch_done, on_progress, on_confirmed, skip, reject)
    try:
        publisher.run(rows, owed)
    finally:
        publisher.sink.close()
    return publisher.state.handled


class _Publisher:
    def __init__(self, sink_config: SinkConfig, chunk_size: int, on_batch_done: BatchDone | None,
                 on_progress: Callable[[int], None] | None, on_confirmed: Confirmed | None,
                 skip: frozenset[Position], reject: RejectPolicy | None) -> None:
        self.sink = sink_config.build()
        self.chunk_size = chunk_size
        self.on_batch_done, self.on_progress, self.on_confirmed = on_batch_done, on_progress, on_confirmed
        self.skip, self.reject = skip, reject
        self.state = _State()
        self.chunk: list[Event] = []
        self.where: list[Position] = []  # the position of each event of ``chunk``
        self.finished: list[int] = []  # batches whose last event is in ``chunk`` (or before)
        self.current: int | None = None  # the batch of the last position accounted for
        self.owed: list[tuple[int, int, int]] | None = None
        self.oi = 0
        self.next_ord = 0

    def run(self, rows: Iterator[Positioned], owed: Owed | None) -> None:
        self.owed = list(owed.batches) if owed is not None else None
        self.oi = 0  # the owed batch of the next position owed
        self.next_ord = self.owed[0][1] if self.owed else 0
        owed_list = self.owed
        last: Position | None = None
        skip = self.skip
        counts = self.state.counts
        for batch_id, ord, event in rows:
            position = (batch_id, ord)
            if last is not None and position <= last:
                raise OrderError(f"row {position} arrived after {last}: refusing to publish out of order")
            if owed_list is not None:
                # fast path: the row is the next position owed
                entry = owed_list[self.oi] if self.oi < len(owed_list) else None
                if entry is not None and entry[0] == batch_id and self.next_ord == ord:
                    self._advance()
                else:
                    self._account(position)
            last = position
            if batch_id != self.current:
                self._batch_ends()
                self.current = batch_id
            counts[batch_id] = counts.get(batch_id, 0) + 1
            if skip and position in skip:
                self.state.handled += 1
                continue
            self.chunk.append(event)
            self.where.append(position)
            if len(self.chunk) >= self.chunk_size:
                self.flush()
        if owed_list is not None:
            self._account(None)
        self._batch_ends()
        self.flush()

    def _advance(self) -> None:
        """Move to the next position owed."""
        assert self.owed is not None
        if self.next_ord < self.owed[self.oi][2]:
            self.next_ord += 1
            return
        self.oi += 1
        self.next_ord = self.owed[self.oi][1] if self.oi < len(self.owed) else 0

    def _batch_ends(self) -> None:
        if self.current is not None and self.current not in self.finished:
            self.finished.append(self.current)

    def _account(self, upto: Position | None) -> None:
        """Walk the owed positions up to ``upto`` (the row just read; None: to the end). Each one
        passed over without a row must be set aside (``skip``), else it vanished."""
        assert self.owed is not None
        missing: list[Position] = []
        counts = self.state.counts
        while self.oi < len(self.owed):
            position = (self.owed[self.oi][0], self.next_ord)
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
                self.state.handled += 1
                counts[position[0]] = counts.get(position[0], 0) + 1
                continue
            missing.append(position)
        else:
            if upto is not None:
                raise OrderError(f"row {upto} is not a position this run owes")
        if missing:
            self.flush()  # what came before the first gap is delivered (and its batches done); nothing after
            raise MissingEventsError(missing)

    def flush(self) -> None:
        self.flush_chunk()
        if self.on_batch_done is not None:
            for batch_id in self.finished:
                self.on_batch_done(batch_id, self.state.counts.get(batch_id, 0))
        self.finished = []

    def flush_chunk(self) -> None:
        if not self.chunk:
            return
        events, where = self.chunk, self.where
        self.chunk, self.where = [], []
        self._publish(events, where, 0, len(events))

    def _publish(self, events: list[Event], where: list[Position], lo: int, hi: int) -> None:
        """Publish ``events[lo:hi]``; with a reject policy, isolate and set aside what the sink rejects
        for good. A request the sink refused as a whole (it names several events) is bisected: about
        log2(n) calls find the bad event instead of one call per event."""
        while lo < hi:
            try:
                self.sink.publish(events[lo:hi] if lo or hi < len(events) else events)
            except SinkError as exc:
                if self.reject is None or not exc.permanent:
                    raise
                # the events before the first rejected one were confirmed (sink contract)
                ids = set(exc.event_ids)
                named = [i for i in range(lo, hi) if events[i].id in ids]
                first = named[0] if named else lo
                self._confirmed(where, lo, first)
                if len(named) <= 1:
                    self._alone(events[first], where[first], exc)
                    lo = first + 1
                    continue
                end = named[-1] + 1
                mid = (first + end) // 2
                self._publish(events, where, first, mid)
                self._publish(events, where, mid, end)
                lo = end
                continue
            self._confirmed(where, lo, hi)
            return

    def _confirmed(self, where: list[Position], start: int, end: int) -> None:
        if end <= start:
            return
        self.state.handled += end - start
        self.state.consecutive_rejects = 0
        if self.on_confirmed is not None:
            self.on_confirmed(*where[end - 1])
        if self.on_progress is not None:
            self.on_progress(self.state.handled)

    def _alone(self, event: Event, position: Position, first_error: SinkError) -> None:
        """Publish a rejected event on its own, retrying; set it aside when the sink keeps rejecting it."""
        policy = self.reject
        assert policy is not None
        error: SinkError = first_error
        attempts = 0
        for attempt in range(1, policy.max_attempts + 1):
            attempts = attempt
            if attempt > 1:
                time.sleep(min(policy.backoff_secs * 2 ** (attempt - 2), 30.0))
            try:
                self.sink.publish([event])
            except SinkError as exc:
                if not exc.permanent:
                    raise
                error = exc
                continue
            self._confirmed([position], 0, 1)
            return
        if self.state.consecutive_rejects + 1 >= policy.max_consecutive:
            raise RejectStormError(
                f"{policy.max_consecutive} events in a row were rejected (the last: event {event.id}, {error}); "
                f"a sink that rejects everything is misconfigured: the stream waits instead of setting them aside",
                sink=error.sink, event_ids=[event.id])
        policy.set_aside(position[0], position[1], event, str(error), attempts)
        self.state.consecutive_rejects += 1
        self.state.handled += 1
        if self.on_confirmed is not None:
            self.on_confirmed(*position)
