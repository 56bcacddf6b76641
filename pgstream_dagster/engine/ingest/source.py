"""Where a slot's transactions come from (:class:`SlotSource`): :class:`PeekSource`
(``pg_logical_slot_peek_binary_changes``, the WAL decoded again at each read; :meth:`~PeekSource.confirm`
advances the slot) or :class:`StreamSource` (the replication protocol, each transaction decoded once).
Both confirm only what the caller recorded; nothing here knows the ledger.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Iterator
from typing import Protocol

import psycopg

from .. import replication, walstream
from ..replication import Transaction

#: a peek source looks again this often while nothing new has committed
PEEK_POLL_SECS = 0.2


class SlotSource(Protocol):
    """Committed transactions of one slot (one publication), in commit order, each once."""

    def read(self, timeout: float) -> list[Transaction]:
        """The transactions committed since the last read (not confirmed, not returned before),
        waiting up to ``timeout`` seconds for the first."""

    @property
    def drained(self) -> bool:
        """The last :meth:`read` reached the end of what had committed (it was not cut short)."""

    @property
    def in_transaction(self) -> bool:
        """Part of a transaction was received and its commit not yet (the slot must not move)."""

    def confirm(self, lsn: int) -> None:
        """Everything before ``lsn`` is recorded: the slot may release it."""

    def skip_idle(self, conn: psycopg.Connection) -> dt.datetime | None:
        """Nothing received is unrecorded: move the slot past other tables' WAL and return a time before
        which every commit was received (``None``: not known yet). ``conn``: a ledger connection."""

    def close(self) -> None: ...


@contextlib.contextmanager
def _slot_errors(slot: str, *, gone: bool = True) -> Iterator[None]:
    """Postgres' refusals of a slot as :class:`~..walstream.SlotBusy` (and, if ``gone``, ``SlotGone``)."""
    try:
        yield
    except psycopg.errors.ObjectInUse:
        raise walstream.SlotBusy(f"slot {slot} is in use by another connection") from None
    except (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.UndefinedObject) as exc:
        if not gone:
            raise
        raise walstream.SlotGone(f"slot {slot}: {str(exc).strip()[:300]}") from None


class PeekSource:
    """:class:`SlotSource` over ``pg_logical_slot_peek_binary_changes`` on ``conn`` (autocommit); raises
    :class:`~..walstream.SlotBusy` (another connection holds the slot) or :class:`~..walstream.SlotGone`."""

    def __init__(self, conn: psycopg.Connection, slot: str, publication: str, cap: int, *,
                 keep_stream: bool = False) -> None:
        self.conn, self.slot, self.publication, self.cap = conn, slot, publication, cap
        self.keep_stream = keep_stream  # each event's stream id (a reader group's slot)
        self._returned = 0  # end LSN of the last transaction returned
        self._drained = False
        self._flushed = 0  # the WAL flushed before the last peek
        self._peeked_at: dt.datetime | None = None

    @property
    def drained(self) -> bool:
        return self._drained

    @property
    def in_transaction(self) -> bool:
        return False  # a peek returns whole transactions

    def read(self, timeout: float) -> list[Transaction]:
        deadline = time.monotonic() + timeout
        while True:
            peeked_at = dt.datetime.now(dt.UTC)
            flushed = replication.flush_lsn(self.conn)
            with _slot_errors(self.slot):
                txns, rows = replication.peek_rows(self.conn, self.slot, self.publication, self.cap,
                                                   keep_stream=self.keep_stream)
            self._drained = rows < self.cap  # the peek saw everything committed before peeked_at
            if self._drained:
                self._flushed, self._peeked_at = flushed, peeked_at
            fresh = [t for t in txns if t.end_lsn > self._returned]
            if fresh:
                self._returned = fresh[-1].end_lsn
                return fresh
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._drained:
                return []
            time.sleep(min(PEEK_POLL_SECS, remaining))

    @property
    def flushed(self) -> int:
        """The WAL flushed before the last complete peek: every commit before it was returned."""
        return self._flushed if self._drained else 0

    @property
    def seen_through(self) -> dt.datetime | None:
        """When the last complete peek started: every commit before it was returned (``None``: none yet)."""
        return self._peeked_at if self._drained else None

    def confirm(self, lsn: int) -> None:
        with _slot_errors(self.slot):
            replication.advance(self.conn, self.slot, lsn)

    def skip_idle(self, conn: psycopg.Connection) -> dt.datetime | None:
        if not self._drained or self._peeked_at is None:
            return None
        # nothing committed before the last complete peek's flush position is unread: skip other tables' WAL
        with _slot_errors(self.slot, gone=False):
            replication.advance_at_least(self.conn, self.slot, self._flushed)
        return self._peeked_at

    def close(self) -> None:
        pass


class StreamSource:
    """:class:`SlotSource` over :class:`~..walstream.ReplicationStream` (raising what it raises);
    ``keep_stream``: each event's stream id decoded (a reader group's slot); ``keep_rows``: its payload and
    metadata text too (a group run hands them to its members)."""

    def __init__(self, database_url: str, slot: str, publication: str, application_name: str, *,
                 max_bytes: int, keep_stream: bool = False, keep_rows: bool = False) -> None:
        self.publication = publication
        self.stream = walstream.ReplicationStream(database_url, slot, publication, application_name,
                                                  max_bytes=max_bytes)
        self.decoder = replication.PgOutputDecoder(keep_stream=keep_stream, keep_rows=keep_rows)
        self._probe: tuple[dt.datetime, int] | None = None  # (a time, the WAL flushed then)

    @property
    def drained(self) -> bool:
        return not self.stream.full

    @property
    def in_transaction(self) -> bool:
        return self.decoder.in_transaction

    def read(self, timeout: float) -> list[Transaction]:
        return self.decoder.decode(self.stream.read(timeout))

    def confirm(self, lsn: int) -> None:
        self.stream.confirm(lsn)
        self.decoder.recorded()  # (confirmed once recorded)

    def skip_idle(self, conn: psycopg.Connection) -> dt.datetime | None:
        seen: dt.datetime | None = None
        if self._probe is not None and self.stream.wal_end >= self._probe[1]:
            seen, self._probe = self._probe[0], None
        if self._probe is None:
            self._probe = (dt.datetime.now(dt.UTC), replication.flush_lsn(conn))
        if not replication.publication_exists(conn, self.publication):
            # dropped, the server skips the events silently (Postgres 18): the slot must not move past them
            raise walstream.SlotGone(f'publication "{self.publication}" does not exist')
        self.stream.confirm(self.stream.wal_end, reply=True)  # the reply brings a fresh wal_end
        return seen

    def close(self) -> None:
        self.stream.close()
