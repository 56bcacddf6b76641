"""One recording loop for a slot, whoever reads it: read (a :class:`~.source.SlotSource`) -> batch
(:class:`Batching`, one rule) -> record (:func:`record_pass`, one ledger transaction) -> confirm.

* The sensor (:func:`consume`, a :class:`~.source.PeekSource`) reads while it is the slot's declared
  reader (``streams.slot_reader = 'sensor'``), within a tick's budget.
* An open run's reader (:func:`follow`, in a thread of the run, a :class:`~.source.StreamSource`)
  reads while its run is (``'run:<run key>'``), hands what it records to the run in the same ledger
  transaction (``ledger.state.extend_run``) and, with a hand-off, the rows themselves.

Both cut batches the same way for the same ``batch:`` settings (:class:`Batching`), and both check,
under the stream row's lock and before recording anything, that they are still the declared reader.

The loop records a map stream id -> :class:`StreamLedger` in one pass, so that one reader can serve
several streams' ledgers (``route`` splits what was read by stream); today each slot serves one
stream. A reader that finds the slot still held by another connection (``SlotBusy``: a reader that has
not seen the declared reader change yet, the sensor's peek begun before a run took the slot) backs off;
what the ledger holds already (read again after a crash between recording and confirming) is dropped
under the stream row's lock (:func:`unrecorded`). Both act (``tests/test_ingest.py``).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from ...config import StreamConfig
from .. import dbconn, replication, walstream
from ..batches import GiveSlotBack, TakeSlot
from ..handoff import Handoff
from ..ledger import groups, recording, state, streams
from ..replication import Transaction
from .results import ConsumeResult, FollowStats
from .slot import SLOT_CREATION_WAIT_SECS, ensure_slot
from .source import PeekSource, SlotSource, StreamSource

#: with the source drained, what is waiting is recorded at once, but at most this often (under
#: continuous traffic batches then hold what arrived in this time, up to max_size)
RECORD_EVERY_SECS = 0.05
#: how often a run's reader checks that it is still the slot's declared reader, confirms the
#: server's position when nothing is pending, and records how far the slot was read
FOLLOW_CHECK_SECS = 1.0
#: the names of before (the reader's cadences)
FOLLOW_RECORD_EVERY_SECS = RECORD_EVERY_SECS


@dataclass(frozen=True)
class Batching:
    """The one batching rule (``batch:`` and ``delivery.tuning.max_read_bytes``): what waits is recorded once
    ``max_size`` events (or unreadable ones) wait, or ``max_bytes`` of kept rows, or the oldest waiting
    transaction committed ``max_fill_secs`` ago, or the source has sent everything committed so far
    (at most every :data:`RECORD_EVERY_SECS`). Recorded, it is cut into batches of ``max_size``."""

    max_size: int
    max_fill_secs: float
    max_bytes: int

    @classmethod
    def of(cls, stream: StreamConfig) -> Batching:
        return cls(stream.batch.max_size, stream.batch.max_fill_secs, stream.delivery.tuning.max_read_bytes)

    def due(self, pending: Pending, *, drained: bool, now: dt.datetime, since_record: float) -> bool:
        if not pending.txns:
            return False
        if pending.waiting >= self.max_size or pending.row_bytes >= self.max_bytes or pending.waiting == 0:
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
    row_bytes: int = 0  # of the rows kept (a hand-off)

    def add(self, txns: list[Transaction]) -> None:
        self.txns += txns
        self.waiting += sum(len(t.events) + len(t.unreadable) for t in txns)
        self.row_bytes += _row_bytes(txns)

    @property
    def oldest_commit(self) -> dt.datetime | None:
        return next((t.commit_time for t in self.txns if t.events or t.unreadable), None)

    def take(self, count: int) -> list[Transaction]:
        taken, rest = self.txns[:count], self.txns[count:]
        self.txns = []
        self.waiting = self.row_bytes = 0
        self.add(rest)
        return taken


@dataclass
class StreamLedger:
    """Where a stream's transactions are recorded, and as whom: ``reader`` is the declared reader the
    recording loop reads as (``ledger.state.SENSOR`` or ``ledger.state.run_reader(run_key)``); ``run_key``: hand
    what is recorded to this open run; ``handoff``: and the rows themselves."""

    stream: StreamConfig
    reader: str
    run_key: str | None = None
    handoff: Handoff | None = None
    batches: list[int] = field(default_factory=list)
    events: int = 0
    unreadable: int = 0
    last_event_id: int | None = None

    def counted(self, ids: list[int], fresh: list[Transaction]) -> None:
        self.batches += ids
        self.events += sum(len(t.events) for t in fresh)
        self.unreadable += sum(len(t.unreadable) for t in fresh)
        last = next((t.events[-1].id for t in reversed(fresh) if t.events), None)
        self.last_event_id = last if last is not None else self.last_event_id


def unrecorded(conn: psycopg.Connection, stream_id: int, txns: list[Transaction]) -> list[Transaction]:
    """``txns`` without what the ledger has already: transactions at or before the end LSN of the last one
    recorded from the slot (read again after a crash between recording and confirming), and events a
    recovery recorded (by id: a transaction before the recovery's position may not have been visible to it)."""
    recorded_to = recording.last_end_lsn(conn, stream_id)
    if recorded_to is not None:
        txns = [t for t in txns if t.end_lsn > recorded_to]
    if txns:
        seen = recording.recovered_ids_since(conn, stream_id, txns[0].commit_lsn)
        if seen:
            for t in txns:
                t.events = [e for e in t.events if e.id not in seen]
    return txns


def record_pass(conn: psycopg.Connection, ledgers: dict[int, StreamLedger], by_stream: dict[int, list[Transaction]],
                *, standby: str | None = None, give_up: Callable[[], bool] | None = None,
                also: Callable[[psycopg.Connection], None] | None = None) -> set[int]:
    """Record each stream's transactions in its ledger, all in one database transaction, and hand them
    to the stream's open run if the reader is the run's; returns the streams whose declared reader is
    no longer the loop's (nothing recorded for those: they must not be confirmed).

    Raises ``ledger.recording.NotVisibleYet`` (nothing recorded) when ``give_up`` says stop waiting for the
    transactions to become visible. ``also``: run in the same transaction once everything is recorded
    (a reader group writes there what it recorded through), unless a stream was lost."""
    lost: set[int] = set()
    done: list[tuple[StreamLedger, list[int], list[Transaction]]] = []
    try:
        with conn.transaction():
            for stream_id, txns in by_stream.items():
                target = ledgers[stream_id]
                # the declared reader, under the stream row's lock: the open run may have been opened or
                # closed since the read (the reader that took over reads these again)
                if state.lock_slot_reader(conn, stream_id) != target.reader:
                    lost.add(stream_id)
                    continue
                # what the ledger holds already (read again: not confirmed yet) is recorded once
                fresh = [t for t in unrecorded(conn, stream_id, txns) if t.events or t.unreadable]
                ids: list[int] = []
                if fresh:
                    max_size = target.stream.batch.max_size
                    ids = recording.record(conn, stream_id, fresh, max_size, standby=standby, give_up=give_up)
                    done.append((target, ids, fresh))
                    if target.handoff is not None:
                        # before the commit that wakes the run: there when it asks; dropped if it fails
                        target.handoff.put(ids, fresh, max_size)
                if target.run_key is not None:
                    state.extend_run(conn, stream_id, target.run_key, target.stream.delivery.max_events_per_run)
            if also is not None and not lost:
                also(conn)
    except BaseException:
        for target, ids, _fresh in done:
            if target.handoff is not None:
                target.handoff.discard(ids)
        raise
    for target, ids, fresh in done:
        target.counted(ids, fresh)
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
        self.last_lsn: int | None = None  # the end of the last transaction confirmed

    def read(self, timeout: float) -> None:
        self.pending.add(self.source.read(timeout))

    def due(self) -> bool:
        return self.rule.due(self.pending, drained=self.source.drained, now=dt.datetime.now(dt.UTC),
                             since_record=time.monotonic() - self.recorded_at)

    def record(self, *, give_up: Callable[[], bool] | None = None, room: int | None = None) -> bool:
        """Record what waits (of it, what holds at most ``room`` events, one transaction at least; the
        rest waits), then confirm it to the source; false, with nothing recorded or confirmed, once the
        loop is no longer the declared reader of a stream."""
        count = len(self.pending.txns) if room is None else _fitting(self.pending.txns, room)
        txns = self.pending.txns[:count]
        through, end = self.recorded_through, txns[-1].end_lsn
        lost = record_pass(self.conn, self.ledgers, self.route(txns), standby=self.standby, give_up=give_up,
                           also=None if through is None else lambda conn: through(conn, end))
        if lost:
            return False
        self.pending.take(count)
        self.source.confirm(txns[-1].end_lsn)
        self.last_lsn = txns[-1].end_lsn
        self.recorded_at = time.monotonic()
        return True


def _row_bytes(txns: list[Transaction]) -> int:
    """Bytes of the WAL messages of the rows kept in ``txns`` (with a hand-off)."""
    return sum([e.row[3] for t in txns for e in t.events if e.row is not None])


def _fitting(txns: list[Transaction], room: int) -> int:
    """How many of ``txns``, from the first, hold at most ``room`` events (one at least)."""
    total = 0
    for i, t in enumerate(txns):
        total += len(t.events)
        if total > room:
            return max(i, 1)
    return len(txns)


def _past(until: float) -> Callable[[], bool]:
    """Whether ``time.monotonic()`` is past ``until``."""
    return lambda: time.monotonic() > until


# --- the sensor: a peek source, within a tick's budget ----------------------------------------------

def consume(conn: psycopg.Connection, stream: StreamConfig, budget_secs: float, *, check_slot: bool = True,
            mark: bool = True) -> ConsumeResult:
    """The sensor's read of the slot: move committed events into the ledger while the sensor is the
    slot's declared reader, until nothing waits or ``budget_secs`` is spent. ``check_slot``: first make
    sure the slot is usable (:func:`~.slot.ensure_slot`, once per tick is enough: a slot lost later
    fails the peek); ``mark``: record how far the slot was read (``streams.consumed_through``).
    Returns after each recording (the sensor decides then)."""
    result = ConsumeResult()
    if stream.reader is not None:
        # a reader group's member: once it has joined, the group's reader reads for it (its own slot,
        # while it joins, is read as before and drained by the group's reader: engine/ingest/group.py)
        result.slot = groups.register_group_member(conn, stream.id, stream.reader)
        if state.slot_reader(conn, stream.id).startswith(groups.GROUP_PREFIX):
            result.slot_busy = True
            return result
        # joining: its own slot is read as it is until the group takes over, never created or replaced (a
        # stream without one joins with nothing to drain: the group records what it has from the table)
        own = result.slot = streams.stream_slot(conn, stream.id)
        info = replication.slot_info(conn, own)
        if info is None or info["wal_status"] == "lost":
            result.slot_busy = True
            return result
        check_slot = False
    if check_slot:
        ensure_slot(conn, stream, result, wait_secs=SLOT_CREATION_WAIT_SECS)
    slot = result.slot = result.slot or streams.stream_slot(conn, stream.id)
    if state.slot_reader(conn, stream.id) != state.SENSOR:
        result.slot_busy = True  # an open run's reader is the declared reader: it records and hands over itself
        return result
    started = time.monotonic()
    deadline = started + budget_secs
    source = PeekSource(conn, slot, stream.publication, max(stream.batch.max_size * 4, 100_000))
    target = StreamLedger(stream, state.SENSOR)
    recorder = Recorder(conn, source, {stream.id: target}, Batching.of(stream))
    try:
        while True:
            recorder.read(0)
            if not recorder.pending.txns:
                seen = source.skip_idle(conn)
                if seen is not None and mark:
                    recording.mark_consumed(conn, stream.id, seen)
                break
            if recorder.due():
                try:
                    # waits until they are visible, up to the tick's budget (one second at least)
                    if not recorder.record(give_up=_past(max(deadline, started + 1.0))):
                        result.slot_busy = True  # a run was opened since the read: its reader reads them
                        break
                except recording.NotVisibleYet:
                    break  # nothing recorded, the slot not advanced: the next tick reads them again
                result.last_lsn = replication.int_to_lsn(recorder.last_lsn or 0)
                if source.drained:
                    # (not skip_idle: advancing past other tables' WAL decodes it again, once per batch)
                    seen = source.seen_through
                    if seen is not None and (mark or target.batches):
                        recording.mark_consumed(conn, stream.id, seen)
                elif time.monotonic() < deadline:
                    continue  # more waits behind the peek's cap
                break
            remaining = deadline - time.monotonic()
            oldest = recorder.pending.oldest_commit
            if remaining <= 0:
                if oldest is not None and mark:
                    recording.mark_consumed(conn, stream.id, oldest)
                break
            wait = 0.2
            if oldest is not None:
                age = (dt.datetime.now(dt.UTC) - oldest).total_seconds()
                wait = max(0.05, min(wait, stream.batch.max_fill_secs - age))
            time.sleep(min(wait, remaining))
    except walstream.SlotBusy:
        # another connection holds the slot although the sensor is the declared reader (an open run's
        # reader that has not seen the change yet): what was recorded is confirmed by whoever reads next,
        # and dropped by them as recorded (unrecorded)
        result.slot_busy = True
    except walstream.SlotGone:
        # invalidated or dropped since the check: the next tick replaces it and recovers
        recording.set_recovery_pending(conn, stream.id)
        result.slot_lost = True
    result.batches += target.batches
    result.events += target.events
    result.unreadable += target.unreadable
    result.last_event_id = target.last_event_id
    return result


# --- an open run's reader: a replication stream, until the run closes -------------------------------

def follow(database_url: str, stream: StreamConfig, run_key: str, stop: threading.Event, stats: FollowStats, *,
           application_name: str, wait: Callable[[float], bool] | None = None,
           handoff: Handoff | None = None) -> None:
    """Read the stream's slot over the replication protocol for the open run ``run_key`` until
    ``stop`` is set or the run is no longer the slot's declared reader: record what commits as
    batches, hand them to the run (``ledger.state.extend_run``: it is woken by NOTIFY) in the same
    transaction, and only then confirm their end position to the server.

    The run becomes the declared reader when this starts (``ledger.state.apply_run(TakeSlot)``: only while it
    is the open run; until then the sensor reads and hands it batches). While it cannot read (no free
    WAL sender, the slot missing or lost, a recovery pending) it gives the slot back to the sensor
    (``GiveSlotBack``), which records and hands batches to the run meanwhile, and takes it again to
    try again. However it ends, short of its process dying, the slot goes back to
    the sensor. A connection that breaks is opened again: the server sends again what was not
    confirmed, and what the ledger already has is dropped (:func:`unrecorded`); so is the ledger
    connection (a database restart).

    ``handoff``: the events it records are put there as they are recorded, for the run to take instead
    of reading them back from the table."""
    pause = wait or stop.wait
    while not stop.is_set():
        try:
            with dbconn.connect(database_url, autocommit=True, application_name=application_name) as conn:
                try:
                    _read_slot(conn, database_url, stream, run_key, stop, stats, application_name, pause, handoff)
                finally:
                    state.apply_run(conn, GiveSlotBack(stream.id, run_key))
                return
        except psycopg.OperationalError as exc:
            stats.notes.append(f"the slot reader lost its database connection ({str(exc).strip()[:300]}); "
                               "trying again")
            pause(FOLLOW_CHECK_SECS)


def _read_slot(conn: psycopg.Connection, database_url: str, stream: StreamConfig, run_key: str,
               stop: threading.Event, stats: FollowStats, application_name: str,
               pause: Callable[[float], bool], handoff: Handoff | None = None) -> None:
    """:func:`follow` on one ledger connection: returns once stopped or the run no longer reads."""
    problem: str | None = None
    if conn.info.parameter_status("server_encoding") != "UTF8":
        handoff = None  # the WAL carries text in the server's encoding: the run reads it from the table

    def wait(secs: float) -> None:
        state.apply_run(conn, GiveSlotBack(stream.id, run_key))  # the sensor reads meanwhile
        pause(secs)

    def without_rows(exc: Exception) -> bool:
        """The whole-event publication is gone (dropped by hand): read with the sensor's from now on,
        and let the run read the events back from the table."""
        nonlocal handoff
        if handoff is None or f'"{stream.rows_publication}"' not in str(exc):
            return False
        handoff = None
        stats.notes.append(f"publication {stream.rows_publication} is missing ({str(exc).strip()[:300]}); "
                           f"reading with {stream.publication} and reading the events back from the table "
                           "(the sensor's next tick creates it again)")
        return True

    while not stop.is_set():
        if not state.run_is_open(conn, stream.id, run_key):
            return
        if recording.recovery_pending(conn, stream.id):
            wait(FOLLOW_CHECK_SECS)
            continue
        if not state.apply_run(conn, TakeSlot(stream.id, run_key)):
            return  # closed meanwhile
        try:
            # with a hand-off, the publication with the whole event: the run delivers what it decodes
            publication = stream.rows_publication if handoff is not None else stream.publication
            slot = stats.slot = streams.stream_slot(conn, stream.id)
            source = StreamSource(database_url, slot, publication, application_name,
                                  max_bytes=stream.delivery.tuning.max_read_bytes, keep_rows=handoff is not None)
        except walstream.SlotBusy:
            pause(0.1)  # the sensor's last peek, from before the run took the slot, under way
            continue
        except (walstream.SlotGone, walstream.StreamBroken, ConnectionError) as exc:
            if without_rows(exc):
                continue
            if str(exc) != problem:
                problem = str(exc)
                stats.notes.append(f"reading slot {stats.slot} failed ({exc}); trying again")
            wait(FOLLOW_CHECK_SECS)
            continue
        problem = None
        try:
            if not _follow(conn, source, stream, run_key, stop, stats, handoff):
                return
        except (walstream.SlotGone, walstream.StreamBroken) as exc:
            if without_rows(exc):
                continue
            stats.notes.append(f"reading slot {stats.slot} stopped ({str(exc).strip()[:300]}); trying again")
            wait(FOLLOW_CHECK_SECS)
        finally:
            source.close()


def _follow(conn: psycopg.Connection, source: StreamSource, stream: StreamConfig, run_key: str,
            stop: threading.Event, stats: FollowStats, handoff: Handoff | None) -> bool:
    """One replication connection's life; false once the run is no longer the slot's declared reader."""
    reader = state.run_reader(run_key)
    target = StreamLedger(stream, reader, run_key=run_key, handoff=handoff)
    recorder = Recorder(conn, source, {stream.id: target}, Batching.of(stream), standby=source.application_name)
    checked_at = 0.0
    while not stop.is_set():
        recorder.read(RECORD_EVERY_SECS if recorder.pending.txns else 0.5)
        if recorder.due():
            before = (len(target.batches), target.events, target.unreadable)
            try:
                # with a hand-off, what it has room for (one transaction at least): the rest waits
                owned = recorder.record(give_up=stop.is_set, room=handoff.room() if handoff is not None else None)
            except recording.NotVisibleYet:
                return True  # stopped while waiting: nothing recorded or confirmed
            finally:
                stats.batches += len(target.batches) - before[0]
                stats.events += target.events - before[1]
                stats.unreadable += target.unreadable - before[2]
            if not owned:
                return False
            if handoff is not None and (recorder.pending.txns or handoff.room() < stream.batch.max_size) and \
                    not _wait_for_room(conn, source, stream, run_key, stop, handoff):
                return False
        now = time.monotonic()
        if recorder.pending.txns or source.in_transaction or now - checked_at < FOLLOW_CHECK_SECS:
            continue
        # nothing received is unrecorded: every transaction that committed before the server's
        # position has been seen, so the slot may move there (past other tables' WAL)
        checked_at = now
        if state.slot_reader(conn, stream.id) != reader:
            return False  # the run closed, or failed
        seen = source.skip_idle(conn)
        if seen is not None:
            recording.mark_consumed(conn, stream.id, seen)
    return True


def _wait_for_room(conn: psycopg.Connection, source: StreamSource, stream: StreamConfig,
                   run_key: str, stop: threading.Event, handoff: Handoff) -> bool:
    """The run has not taken what the reader handed over yet (it publishes slower than the reader
    decodes): read nothing more until it has taken half. What the reader would record meanwhile the
    run would have to read back from the table, which costs more than the wait; the WAL waits in the
    slot. Meanwhile it hands the run what was recorded (in case the sensor has not) and keeps the
    replication connection alive; false once the run is no longer the open run."""
    checked = time.monotonic()
    while not handoff.half_empty() and not stop.is_set():
        stop.wait(0.05)
        if time.monotonic() - checked < FOLLOW_CHECK_SECS:
            continue
        checked = time.monotonic()
        if not state.extend_run(conn, stream.id, run_key, stream.delivery.max_events_per_run) and \
                not state.run_is_open(conn, stream.id, run_key):
            return False
        source.keepalive()
    return True
