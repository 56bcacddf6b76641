"""One recording loop for a slot, whoever reads it: read (a :class:`~.source.SlotSource`) -> batch
(:class:`Batching`) -> record (:func:`record_pass`: as ``group:<name>``, each member's batches handed to its open
run in the same transaction; the declared reader checked under the stream row's lock; what the ledger holds
already dropped, :func:`unrecorded`) -> confirm. A joining member's own slot is drained the same way."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from ...config import StreamConfig
from ..handoff import Handoff
from ..ledger import recording, state
from ..replication import Transaction
from .source import SlotSource

#: with the source drained, what waits is recorded at once, but at most this often
RECORD_EVERY_SECS = 0.05
#: how often a replication-protocol reader confirms the server's position when idle (and marks how far it read)
FOLLOW_CHECK_SECS = 1.0


@dataclass(frozen=True)
class Batching:
    """The one batching rule (``batch:``): what waits is recorded once ``max_size`` events wait, the oldest
    committed ``max_fill_secs`` ago, or the source sent all (every :data:`RECORD_EVERY_SECS`); cut at ``max_size``."""

    max_size: int
    max_fill_secs: float
    max_bytes: int

    @classmethod
    def of(cls, streams: list[StreamConfig]) -> Batching:
        """The tightest rule of ``streams`` (a reader group's loop: each member's batches are still cut at its
        own ``batch.max_size``)."""
        return cls(min(s.batch.max_size for s in streams), min(s.batch.max_fill_secs for s in streams),
                   min(s.delivery.tuning.max_read_bytes for s in streams))

    def due(self, pending: Pending, *, drained: bool, now: dt.datetime, since_record: float) -> bool:
        if not pending.txns:
            return False
        if pending.waiting >= self.max_size or pending.waiting == 0:
            return True
        oldest = pending.oldest_commit
        if oldest is not None and (now - oldest).total_seconds() >= self.max_fill_secs:
            return True
        return drained and since_record >= RECORD_EVERY_SECS


@dataclass
class Pending:
    """Transactions read and not recorded yet, in commit order."""

    txns: list[Transaction] = field(default_factory=list)
    waiting: int = 0  # events and unreadable events

    def add(self, txns: list[Transaction]) -> None:
        self.txns += txns
        self.waiting += sum(len(t.events) + len(t.unreadable) for t in txns)

    @property
    def oldest_commit(self) -> dt.datetime | None:
        return next((t.commit_time for t in self.txns if t.events or t.unreadable), None)


@dataclass
class StreamLedger:
    """Where a stream's transactions are recorded, as declared reader ``reader`` (``group:<name>``);
    ``run_key``: the open run to hand them to."""

    stream: StreamConfig
    reader: str
    run_key: str | None = None
    #: where its runs take what is recorded in memory (a group run's members), else None
    handoff: Handoff | None = None
    batches: list[int] = field(default_factory=list)
    events: int = 0
    unreadable: int = 0

    def counted(self, ids: list[int], fresh: list[Transaction]) -> None:
        self.batches += ids
        self.events += sum(len(t.events) for t in fresh)
        self.unreadable += sum(len(t.unreadable) for t in fresh)


def unrecorded(conn: psycopg.Connection, by_stream: dict[int, list[Transaction]]) -> dict[int, list[Transaction]]:
    """Each stream's transactions without what the ledger has: those ending at or before the last one recorded
    from the slot, and events a recovery recorded (by id: it may not have seen a transaction before its position);
    a stream left nothing: not in the result."""
    recorded_to = recording.last_end_lsns(conn, list(by_stream))
    kept = {sid: [t for t in txns if sid not in recorded_to or t.end_lsn > recorded_to[sid]]
            for sid, txns in by_stream.items()}
    kept = {sid: txns for sid, txns in kept.items() if txns}
    if kept:
        for sid, seen in recording.recovered_ids_since(conn, {sid: t[0].commit_lsn for sid, t in kept.items()}).items():
            for t in kept[sid]:
                t.events = [e for e in t.events if e.id not in seen]
    return kept


def record_pass(conn: psycopg.Connection, ledgers: dict[int, StreamLedger], by_stream: dict[int, list[Transaction]],
                *, standby: str | None = None, give_up: Callable[[], bool] | None = None,
                also: Callable[[psycopg.Connection], None] | None = None) -> set[int]:
    """Record each stream's transactions and hand them to its open run, in one transaction (``also`` last, unless a
    stream was lost), in a few statements whatever the number of streams; the streams whose declared reader is no
    longer the loop's (nothing recorded, not confirmed)."""
    done: list[tuple[StreamLedger, list[int], list[Transaction]]] = []
    handed: list[tuple[Handoff, list[int]]] = []  # (dropped again if the transaction does not commit)
    try:
        with conn.transaction():
            # the declared readers, under the stream rows' locks (a joining member may have been handed over)
            locked = state.lock_streams(conn, list(by_stream))
            lost = {sid for sid in by_stream
                    if (locked[sid].slot_reader if sid in locked else state.SENSOR) != ledgers[sid].reader}
            # what the ledger holds already (read again: not confirmed yet) is recorded once
            fresh = {sid: kept for sid, txns in unrecorded(
                        conn, {sid: txns for sid, txns in by_stream.items() if sid not in lost}).items()
                     if (kept := [t for t in txns if t.events or t.unreadable])}
            ids = recording.record_streams(conn, fresh, {sid: ledgers[sid].stream.batch.max_size for sid in fresh},
                                           standby=standby, give_up=give_up)
            for sid, txns in fresh.items():
                target = ledgers[sid]
                done.append((target, ids[sid], txns))
                if target.handoff is not None:  # before the commit that wakes its run
                    handed.append((target.handoff,
                                   target.handoff.put(sid, ids[sid], txns, target.stream.batch.max_size)))
            runs = {sid: (key, ledgers[sid].stream.delivery.max_events_per_run) for sid in by_stream
                    if sid not in lost and (key := ledgers[sid].run_key) is not None}
            if runs:
                state.extend_runs(conn, runs, locked)
            if also is not None and not lost:
                also(conn)
    except BaseException:
        for handoff, batch_ids in handed:
            handoff.discard(batch_ids)
        raise
    for target, batch_ids, txns in done:
        target.counted(batch_ids, txns)
    return lost


class Recorder:
    """The recording loop's state over one source: what was read and not recorded, when it last
    recorded. ``route`` splits transactions by stream (one stream: all of them are its)."""

    def __init__(self, conn: psycopg.Connection, source: SlotSource, ledgers: dict[int, StreamLedger],
                 rule: Batching, *, standby: str | None = None,
                 route: Callable[[list[Transaction]], dict[int, list[Transaction]]] | None = None,
                 recorded_through: Callable[[psycopg.Connection, int], None] | None = None) -> None:
        self.conn, self.source, self.ledgers, self.rule, self.standby = conn, source, ledgers, rule, standby
        #: called in each recording transaction with the end LSN of its last transaction (a reader group)
        self.recorded_through = recorded_through
        if route is None:
            (only,) = ledgers
            route = lambda txns: {only: txns}  # noqa: E731
        self.route = route
        self.pending = Pending()
        self.recorded_at = 0.0  # monotonic

    def read(self, timeout: float) -> None:
        self.pending.add(self.source.read(timeout))

    def due(self) -> bool:
        return self.rule.due(self.pending, drained=self.source.drained, now=dt.datetime.now(dt.UTC),
                             since_record=time.monotonic() - self.recorded_at)

    def until_due(self, idle: float) -> float:
        """How long the next read may wait: ``idle`` with nothing waiting, else until what waits is due once the
        source is drained (:data:`RECORD_EVERY_SECS` after the last record), not a whole :data:`RECORD_EVERY_SECS`
        from now: commits that arrive at a steady pace are recorded as they arrive, not each one that long later."""
        if not self.pending.txns:
            return idle
        return max(0.0, RECORD_EVERY_SECS - (time.monotonic() - self.recorded_at))

    def record(self, *, give_up: Callable[[], bool] | None = None) -> bool:
        """Record what waits, then confirm it to the source; false, with nothing recorded or confirmed, once
        the loop is no longer the declared reader of a stream."""
        txns = self.pending.txns
        through, end = self.recorded_through, txns[-1].end_lsn
        if record_pass(self.conn, self.ledgers, self.route(txns), standby=self.standby, give_up=give_up,
                       also=None if through is None else lambda conn: through(conn, end)):
            return False  # a stream was lost
        self.pending = Pending()  # (all of it was recorded)
        self.source.confirm(end)
        self.recorded_at = time.monotonic()
        return True
