"""What an open run's slot reader recorded, handed to the run's delivery in memory.

The reader (:func:`~.ingest.follow`) decodes each event's INSERT from the WAL, with the whole row
(``PgOutputDecoder(keep_rows=True)``), and records the batches in the ledger, putting their events
here in the same step (before the commit that wakes the run; dropped again if it fails); when the
run delivers those batches it takes them instead of reading them from ``pgstream.events``
(:class:`~.delivery.sources.TableSource`). What it cannot take (a batch recorded
by the sensor or an earlier run, a round too large to be kept, a run that restarted) is read from
the table as before, so this only saves work: the ledger stays the source of truth.

The rows are the ones the table holds: the WAL carries each column's text output, which is what
``payload::text`` returns. Bounded: once ``max_events`` events or ``max_bytes`` bytes of WAL messages
are kept, further batches are not (they are read from the table). The reader waits for room before
it reads on (:func:`~.ingest.follow`): what it would record meanwhile would have to be read back."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from ..sinks.base import Event, event_from_text
from .publish import Positioned, TooLarge
from .replication import DecodedEvent, Transaction

if TYPE_CHECKING:
    from ..config import StreamConfig

#: bytes of the events' WAL messages kept at most (payload and metadata, mostly), whatever ``max_events``
MAX_BYTES = 128 * 2**20


class Handoff:
    """Rows of recorded batches, by batch id, until the run takes them. Thread-safe: the reader puts,
    the run's thread takes."""

    def __init__(self, max_events: int, max_bytes: int = MAX_BYTES) -> None:
        self.max_events, self.max_bytes = max_events, max_bytes
        self._batches: dict[int, tuple[list[DecodedEvent], int]] = {}  # batch id -> (events with rows, bytes)
        self._events = self._bytes = 0
        self._lock = threading.Lock()
        #: events taken from here, and batches asked for that were not here (read from the table)
        self.taken = self.missed = 0

    def put(self, batch_ids: Sequence[int], txns: Sequence[Transaction], max_size: int) -> int:
        """The rows of batches just recorded by :func:`~.ledger.recording.record` from ``txns`` with
        ``max_size``: batch ``batch_ids[i]`` holds events ``i * max_size`` to ``(i + 1) * max_size``
        of the transactions' events in order, as there. Returns the events kept."""
        events: list[DecodedEvent] = [e for t in txns for e in t.events]
        kept = 0
        for i, batch_id in enumerate(batch_ids):
            chunk = events[i * max_size:(i + 1) * max_size]
            rows = [e.row for e in chunk]
            if not rows or None in rows:  # not decoded with their rows, or not UTF-8: read from the table
                continue
            size = sum([row[3] for row in rows if row is not None])
            with self._lock:
                if self._events + len(chunk) > self.max_events or self._bytes + size > self.max_bytes:
                    break  # full: the run reads these from the table; the older ones it takes first
                self._batches[batch_id] = (chunk, size)
                self._events += len(chunk)
                self._bytes += size
            kept += len(chunk)
        return kept

    def take(self, batch_id: int, first: int, last: int, event_bytes: int | None = None) -> list[Positioned] | None:
        """Ordinals ``first`` to ``last`` of the batch as events (the batch is then forgotten), or
        None when it is not here. An event whose payload is larger than ``event_bytes`` (the sink's
        limit) comes as :class:`~.publish.TooLarge`."""
        with self._lock:
            entry = self._batches.pop(batch_id, None)
            if entry is not None:
                self._events -= len(entry[0])
                self._bytes -= entry[1]
        if entry is None or not 1 <= first <= last <= len(entry[0]):
            self.missed += 1
            return None
        utc = dt.UTC
        taken: list[Positioned] = [
            (batch_id, ord_, event_from_text(event_id, row[0], created.astimezone(utc), row[1], row[2]))
            for ord_, (event_id, created, row, _stream) in enumerate(entry[0][first - 1:last], start=first)
            if row is not None]  # (put keeps no batch with an event without its row)
        if event_bytes is not None:
            taken = [(b, o, _checked(event, row[3], event_bytes)) for (b, o, event), (_i, _c, row, _s)
                     in zip(taken, entry[0][first - 1:last], strict=True) if row is not None]
        self.taken += len(taken)
        return taken

    def forget_through(self, batch_id: int) -> None:
        """Drop the batches up to ``batch_id`` (delivered another way, e.g. by Spark)."""
        with self._lock:
            self._drop([b for b in self._batches if b <= batch_id])

    def discard(self, batch_ids: Sequence[int]) -> None:
        """Drop these batches (their recording rolled back)."""
        with self._lock:
            self._drop([b for b in batch_ids if b in self._batches])

    def _drop(self, batch_ids: list[int]) -> None:
        for batch_id in batch_ids:
            rows, size = self._batches.pop(batch_id)
            self._events -= len(rows)
            self._bytes -= size

    def room(self) -> int:
        """Events that can still be kept (by events; bytes are checked at put)."""
        return max(0, self.max_events - self._events) if self._bytes < self.max_bytes else 0

    def half_empty(self) -> bool:
        """At most half of either bound is in use."""
        return self._events <= self.max_events // 2 and self._bytes <= self.max_bytes // 2

    @property
    def events(self) -> int:
        """Events kept now."""
        return self._events


def _checked(event: Event | TooLarge, message_bytes: int, limit: int) -> Event | TooLarge:
    """``event``, or :class:`~.publish.TooLarge` when its payload is larger than ``limit`` bytes (the
    WAL message, larger than the payload, says when it cannot be)."""
    if message_bytes <= limit or not isinstance(event, Event):
        return event
    size = len(event.payload_json.encode())
    return TooLarge(event.id, size, limit) if size > limit else event


class Log(Protocol):
    """Where a run writes its log lines (a Dagster op's ``context.log``, a ``logging.Logger``)."""

    def info(self, msg: str) -> Any: ...
    def warning(self, msg: str) -> Any: ...
    def error(self, msg: str) -> Any: ...


class RunReader(Protocol):
    """The open run's slot reader, as the delivery run meets it: started on entering, stopped (what
    it received recorded and handed over) by :meth:`stop` or on leaving; :meth:`report` writes what
    it has to say to the run log from the run's thread; :attr:`handoff`: what it records, kept for the
    run (None: the run reads every round back from the table)."""

    handoff: Handoff | None

    def __enter__(self) -> RunReader: ...
    def __exit__(self, *_exc: object) -> None: ...
    def stop(self) -> None: ...
    def report(self) -> None: ...


#: makes the open run's reader: (database URL, stream, run key, slot, hand-off, run id, log)
ReaderFactory: TypeAlias = "Callable[[str, StreamConfig, str, str, Handoff | None, str, Log], RunReader]"
