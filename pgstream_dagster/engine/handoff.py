"""What a group delivery run's reader recorded (each event decoded from the WAL with the text ``payload::text``
returns), handed to its members' runs in memory instead of being read back from ``pgstream.events``. What is not
here (recorded by the sensor or recovery, put when full, a run that restarted) is read from the table: this only
saves work, the ledger stays the source of truth. Bounded per group run; what no run took in :data:`KEEP_SECS` goes."""

from __future__ import annotations

import collections
import datetime as dt
import itertools
import threading
import time
from collections.abc import Sequence

from ..sinks.base import event_from_text
from .publish import Positioned, TooLarge
from .replication import DecodedEvent, Transaction

#: events, and characters of payload and metadata text, kept at most for a whole group
MAX_EVENTS = 200_000
MAX_BYTES = 128 * 2**20
KEEP_SECS = 60.0  # a batch no run took within this many seconds is dropped


class Handoff:
    """Events of recorded batches, by batch id, until a member's run takes them. Thread-safe."""

    def __init__(self, max_events: int = MAX_EVENTS, max_bytes: int = MAX_BYTES) -> None:
        self.max_events, self.max_bytes = max_events, max_bytes
        #: batch id -> (stream id, events with their text, characters, when put), in the order put (oldest first)
        self._batches: dict[int, tuple[int, list[DecodedEvent], int, float]] = {}
        #: per stream, its batch ids in the order put (some may be gone: taken, discarded, expired)
        self._streams: dict[int, collections.deque[int]] = {}
        self._events = self._bytes = 0
        self._lock = threading.Lock()

    def put(self, stream_id: int, batch_ids: Sequence[int], txns: Sequence[Transaction], max_size: int) -> list[int]:
        """The events of the stream's batches ``batch_ids`` just recorded from ``txns``, cut in ``max_size`` as
        ``ledger.recording.record`` cuts them; the batch ids kept (not all when full, or an event without text)."""
        events = [e for t in txns for e in t.events]
        kept: list[int] = []
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            for i, batch_id in enumerate(batch_ids):
                chunk = events[i * max_size:(i + 1) * max_size]
                if not chunk or any(e.payload is None for e in chunk):
                    continue
                size = sum([len(e.payload or "") + len(e.metadata or "") for e in chunk])
                if self._events + len(chunk) > self.max_events or self._bytes + size > self.max_bytes:
                    break  # full: these and the later ones are read from the table
                self._batches[batch_id] = (stream_id, chunk, size, now)
                self._streams.setdefault(stream_id, collections.deque()).append(batch_id)
                self._events += len(chunk)
                self._bytes += size
                kept.append(batch_id)
        return kept

    def discard(self, batch_ids: Sequence[int]) -> None:
        """Drop these batches (their recording rolled back)."""
        with self._lock:
            self._drop([b for b in batch_ids if b in self._batches])

    def take(self, batch_id: int, first: int, last: int, event_bytes: int | None = None) -> list[Positioned] | None:
        """Ordinals ``first`` to ``last`` of the batch (then forgotten), or ``None``; too large: :class:`TooLarge`."""
        with self._lock:
            entry = self._batches.get(batch_id)
            if entry is not None:
                self._drop([batch_id])
                self._trim(entry[0])
        if entry is None or not 1 <= first <= last <= len(entry[1]):
            return None
        utc = dt.UTC
        taken: list[Positioned] = []
        for ord_, e in enumerate(entry[1][first - 1:last], start=first):
            payload = e.payload
            assert payload is not None  # (put keeps no batch with an event without its text)
            if event_bytes is not None and len(payload) * 4 > event_bytes \
                    and (size := len(payload.encode())) > event_bytes:
                taken.append((batch_id, ord_, TooLarge(e.id, size, event_bytes)))
                continue
            taken.append((batch_id, ord_, event_from_text(e.id, entry[0], e.created_at.astimezone(utc), payload,
                                                          e.metadata)))
        return taken

    def forget(self, stream_id: int, through_batch_id: int) -> None:
        """Drop the stream's batches up to ``through_batch_id`` (delivered another way: through Spark)."""
        with self._lock:
            ids = self._streams.get(stream_id)
            while ids and ids[0] <= through_batch_id:  # (batch ids grow in the order put)
                batch_id = ids.popleft()
                if batch_id in self._batches:
                    self._drop([batch_id])
            self._trim(stream_id)

    @property
    def events(self) -> int:  # kept now
        return self._events

    def _expire(self, now: float) -> None:  # oldest first: up to the first one young enough
        old = list(itertools.takewhile(lambda b: now - self._batches[b][3] > KEEP_SECS, self._batches))
        streams = {self._batches[b][0] for b in old}
        self._drop(old)
        for stream_id in streams:
            self._trim(stream_id)

    def _trim(self, stream_id: int) -> None:
        """Drop the stream's oldest batch ids that are gone (taken, expired): a forget may not come."""
        ids = self._streams.get(stream_id)
        while ids and ids[0] not in self._batches:
            ids.popleft()
        if ids is not None and not ids:
            del self._streams[stream_id]

    def _drop(self, batch_ids: list[int]) -> None:
        for batch_id in batch_ids:
            _stream, events, size, _at = self._batches.pop(batch_id)
            self._events -= len(events)
            self._bytes -= size
