"""Ingest: move what commits from a stream's slot into the ledger (the sensor's work, without
Dagster: ``defs/sensors.py`` runs it each tick).

(1) make sure the slot exists and is usable: a missing or invalidated slot is (re)created and
every event the ledger does not cover is recovered from the table; (2) peek committed
transactions, and once ``max_size`` events are waiting or the oldest waited ``max_fill_secs``,
record them in the ledger and advance the slot, so WAL is released whatever the sink does.

While a stream has an open delivery run, the run reads the slot instead (:func:`follow`, in a
thread of the run): over the replication protocol each transaction is decoded once and arrives as
it commits; it is recorded and handed to the run in one ledger transaction, then confirmed. The
sensor finds the slot in use meanwhile and only decides (:class:`ConsumeResult` ``slot_busy``).
"""


import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from ..config import StreamConfig
from . import ledger, limits, replication, walstream
from .handoff import Handoff


@dataclass
class ConsumeResult:
    batches: list[int] = field(default_factory=list)
    events: int = 0
    last_event_id: int | None = None
    last_lsn: str | None = None
    slot_created: bool = False
    slot_lost: bool = False
    recovered: list[int] = field(default_factory=list)
    unreadable: int = 0  # events set aside as dead letters (stage 'read')
    slot_busy: bool = False  # another connection reads the slot (an open run's reader): nothing read
    publications_created: list[str] = field(default_factory=list)  # were missing (dropped by hand)
    slot: str | None = None  # the slot read (pgstream.streams.slot)

    def add(self, other: "ConsumeResult") -> None:
        self.batches += other.batches
        self.events += other.events
        self.last_event_id = other.last_event_id if other.last_event_id is not None else self.last_event_id
        self.last_lsn = other.last_lsn or self.last_lsn
        self.slot_created |= other.slot_created
        self.slot_lost |= other.slot_lost
        self.recovered += other.recovered
        self.unreadable += other.unreadable
        self.slot_busy = other.slot_busy
        self.publications_created += other.publications_created
        self.slot = other.slot or self.slot


def ensure_slot(conn: psycopg.Connection, stream: StreamConfig, result: ConsumeResult) -> None:
    """Create the stream row, publication and slot when missing. A slot that was dropped or
    invalidated (``wal_status = 'lost'``, e.g. ``max_slot_wal_keep_size`` exceeded) is replaced,
    then every event no batch covers is recovered from the table.

    Crash-safe: ``recovery_pending`` is set before the slot is touched and cleared in the
    transaction that records the recovery, so an interruption anywhere makes the next tick
    recover again (duplicates possible, losses not).
    """
    slot = result.slot = ledger.ensure_stream(conn, stream.id, stream.slot_name)
    # a publication dropped by hand: logical decoding skips the stream's events without an error
    # (Postgres 18 only warns), so it is put back, and what committed meanwhile is recovered from the
    # table (decoding looks publications up as of each change: re-created, it does not see those)
    result.publications_created = replication.ensure_publications(conn, stream.id)
    if result.publications_created:
        ledger.set_recovery_pending(conn, stream.id)
    info = replication.slot_info(conn, slot)
    pending = ledger.recovery_pending(conn, stream.id)
    if info is not None and info["wal_status"] != "lost" and not pending:
        return
    if info is None and (elsewhere := replication.slot_database(conn, slot)) is not None:
        raise ledger.SlotElsewhere(stream.id, slot, elsewhere)
    ledger.set_recovery_pending(conn, stream.id)
    if info is not None and info["wal_status"] == "lost":
        replication.drop_slot(conn, slot)
        result.slot_lost = True
        info = None
    if info is None:
        try:
            replication.create_slot(conn, slot)
        except psycopg.errors.ConfigurationLimitExceeded:  # all replication slots are in use
            row = conn.execute("select count(*) from pg_catalog.pg_replication_slots").fetchone()
            line = limits.slot_problem(limits.server_limits(conn), int(row[0]) if row else 0, [stream.id])
            raise limits.LimitsExceeded([line or f"stream {stream.id}: no replication slot is free; raise "
                                                 f"max_replication_slots in postgresql.conf and restart Postgres"]
                                        ) from None
        result.slot_created = True
    result.recovered = ledger.recover_from_table(conn, stream.id, stream.batch.max_size)


def unrecorded(conn: psycopg.Connection, stream_id: int,
               txns: list[replication.Transaction]) -> list[replication.Transaction]:
    """``txns`` without what the ledger has already: transactions at or before the last recorded end
    LSN (read again after a crash between recording and confirming), and events a recovery recorded."""
    recorded_to = ledger.last_end_lsn(conn, stream_id)
    if recorded_to is not None:
        txns = [t for t in txns if t.end_lsn > recorded_to]
    if txns:
        seen = ledger.recovered_ids_since(conn, stream_id, txns[0].commit_lsn)
        if seen:
            for t in txns:
                t.events = [e for e in t.events if e.id not in seen]
    return txns


def _past(until: float) -> Callable[[], bool]:
    """Whether ``time.monotonic()`` is past ``until``."""
    return lambda: time.monotonic() > until


def consume(conn: psycopg.Connection, stream: StreamConfig, budget_secs: float, *, check_slot: bool = True,
            mark: bool = True) -> ConsumeResult:
    """Move committed events from the slot into the ledger (see module docstring). ``check_slot``:
    first make sure the slot is usable (once per tick is enough: a slot lost later fails the peek);
    ``mark``: record how far the slot was read (``streams.consumed_through``)."""
    result = ConsumeResult()
    if check_slot:
        ensure_slot(conn, stream, result)
    slot = result.slot = result.slot or ledger.stream_slot(conn, stream.id)
    deadline = time.monotonic() + budget_secs
    cap = max(stream.batch.max_size * 4, 100_000)
    while True:
        if stream.delivery.read_slot and ledger.slot_claimed(conn, stream.id):
            # an open run's reader reads it, or is about to: peeking now would only keep it out
            result.slot_busy = True
            return result
        peeked_at, peeked = dt.datetime.now(dt.UTC), time.monotonic()
        flushed = replication.flush_lsn(conn)
        try:
            txns, rows = replication.peek_rows(conn, slot, stream.publication, cap)
        except psycopg.errors.ObjectInUse:
            result.slot_busy = True  # an open run reads it (follow): it records and hands over batches itself
            return result
        except (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.UndefinedObject):
            # invalidated or dropped since the check: the next tick replaces it and recovers
            ledger.set_recovery_pending(conn, stream.id)
            result.slot_lost = True
            return result
        complete = rows < cap  # the peek saw everything committed before peeked_at
        txns = unrecorded(conn, stream.id, txns)
        waiting = sum(len(t.events) for t in txns)
        oldest = next((t.commit_time for t in txns if t.events), None)
        now = dt.datetime.now(dt.UTC)
        full = waiting >= stream.batch.max_size
        ripe = oldest is not None and (now - oldest).total_seconds() >= stream.batch.max_fill_secs
        if not txns or full or ripe or waiting == 0:
            with_events = [t for t in txns if t.events or t.unreadable]
            if with_events:
                try:
                    with conn.transaction():
                        # an open run's reader that took the slot right after the peek may have recorded
                        # these meanwhile: checked again under the recording lock, recorded once
                        ledger.lock_recording(conn, stream.id)
                        with_events = [t for t in unrecorded(conn, stream.id, with_events)
                                       if t.events or t.unreadable]
                        if with_events:
                            # waits until they are visible, up to the tick's budget (one second at least)
                            result.batches += ledger.record(conn, stream.id, with_events, stream.batch.max_size,
                                                            give_up=_past(max(deadline, peeked + 1.0)))
                except ledger.NotVisibleYet:
                    break  # nothing recorded, the slot not advanced: the next tick reads them again
                result.events += sum(len(t.events) for t in with_events)
                result.unreadable += sum(len(t.unreadable) for t in with_events)
                last = next((t.events[-1].id for t in reversed(with_events) if t.events), None)
                result.last_event_id = last if last is not None else result.last_event_id
            try:
                if txns:
                    replication.advance(conn, slot, txns[-1].end_lsn)
                    result.last_lsn = replication.int_to_lsn(txns[-1].end_lsn)
                elif complete:
                    # nothing of the stream committed before ``flushed``: skip the other tables' WAL so
                    # the next peek does not decode it again
                    replication.advance_at_least(conn, slot, flushed)
            except psycopg.errors.ObjectInUse:
                # an open run's reader took the slot since the peek: the server sends it what was just
                # recorded again, and it drops that (``unrecorded``)
                result.slot_busy = True
                return result
            if complete and (mark or with_events):
                ledger.mark_consumed(conn, stream.id, peeked_at)
            if full and time.monotonic() < deadline:
                continue  # more may be waiting behind the peek cap
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if oldest is not None and mark:
                ledger.mark_consumed(conn, stream.id, oldest)
            break
        wait = 0.2
        if oldest is not None:
            wait = max(0.05, min(wait, stream.batch.max_fill_secs - (now - oldest).total_seconds()))
        time.sleep(min(wait, remaining))
    return result


#: a reader records what it received once the server has nothing more to send, but at most this
#: often (under continuous traffic batches then hold what arrived in this time, up to max_size)
FOLLOW_RECORD_EVERY_SECS = 0.05
#: how often a reader checks that its run is still the stream's open run, confirms the server's
#: position when nothing is pending, and records how far the slot was read
FOLLOW_CHECK_SECS = 1.0


@dataclass
class FollowStats:
    """What a run's reader did; ``notes``: what the run log should say (appended by the reader thread)."""

    batches: int = 0
    events: int = 0
    unreadable: int = 0
    notes: list[str] = field(default_factory=list)
    slot: str | None = None  # the slot read, once the reader knows it


def follow(database_url: str, stream: StreamConfig, run_key: str, stop: threading.Event, stats: FollowStats, *,
           application_name: str, wait: Callable[[float], bool] | None = None,
           handoff: Handoff | None = None) -> None:
    """Read the stream's slot over the replication protocol for the open run ``run_key`` until
    ``stop`` is set or the run is no longer the stream's open run: record what commits as batches,
    hand them to the run (``ledger.extend_run``: it is woken by NOTIFY) in the same transaction, and
    only then confirm their end position to the server.

    While the sensor's peek holds the slot, or the slot is missing or lost (the sensor replaces it
    and recovers from the table), or its recovery is pending, it waits and tries again. A connection
    that breaks is opened again: the server sends again what was not confirmed, and what the ledger
    already has is dropped (:func:`unrecorded`); so is the ledger connection (a database restart).

    ``handoff``: the events it records are put there as they are recorded, for the run to take instead
    of reading them back from the table."""
    pause = wait or stop.wait
    while not stop.is_set():
        try:
            with psycopg.connect(database_url, autocommit=True, application_name=application_name) as conn:
                _read_slot(conn, database_url, stream, run_key, stop, stats, application_name, pause, handoff)
                return
        except psycopg.OperationalError as exc:
            stats.notes.append(f"the slot reader lost its database connection ({str(exc).strip()[:300]}); "
                               "trying again")
            pause(FOLLOW_CHECK_SECS)


def _read_slot(conn: psycopg.Connection, database_url: str, stream: StreamConfig, run_key: str,
               stop: threading.Event, stats: FollowStats, application_name: str,
               pause: Callable[[float], bool], handoff: Handoff | None = None) -> None:
    """:func:`follow` on one ledger connection: returns once stopped or the run is no longer open.

    The reader claims the slot (:func:`ledger.claim_slot`) before it connects, so the sensor stops
    peeking (a sensor peeking back to back under load would otherwise keep it out for good), and
    gives the claim up while it cannot read (no free WAL sender, slot gone, recovery pending): then
    the sensor records and hands batches to the run as before."""
    problem: str | None = None
    claimed = False
    if conn.info.parameter_status("server_encoding") != "UTF8":
        handoff = None  # the WAL carries text in the server's encoding: the run reads it from the table

    def wait(secs: float) -> None:
        nonlocal claimed
        if claimed:
            ledger.release_slot(conn, stream.id)
            claimed = False
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
        if not ledger.run_is_open(conn, stream.id, run_key):
            return
        if ledger.recovery_pending(conn, stream.id):
            wait(FOLLOW_CHECK_SECS)
            continue
        if not claimed:
            claimed = ledger.claim_slot(conn, stream.id)
            if not claimed:  # another reader of the stream: a closing run's, about to let go
                pause(FOLLOW_CHECK_SECS)
                continue
        try:
            # with a hand-off, the publication with the whole event: the run delivers what it decodes
            publication = stream.rows_publication if handoff is not None else stream.publication
            slot = stats.slot = ledger.stream_slot(conn, stream.id)
            source = walstream.ReplicationStream(database_url, slot, publication, application_name,
                                                 max_bytes=stream.delivery.max_read_bytes)
        except walstream.SlotBusy:
            pause(0.1)  # the sensor's peek under way: it sees the claim at its next one
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


def _follow(conn: psycopg.Connection, source: walstream.ReplicationStream, stream: StreamConfig, run_key: str,
            stop: threading.Event, stats: FollowStats, handoff: Handoff | None) -> bool:
    """One replication connection's life; false once the run is no longer the open run."""
    # an event whose message is larger than a quarter of a read is not kept: the run reads it from the table
    # (it is large enough for that to cost little more than taking it), so the reader holds no second copy
    budget = stream.delivery.max_read_bytes
    decoder = replication.PgOutputDecoder(keep_rows=handoff is not None, max_row_bytes=budget // 4)
    pending: list[replication.Transaction] = []
    pending_bytes = 0  # of the rows kept in ``pending``
    oldest = 0.0  # when the oldest pending transaction arrived (monotonic)
    recorded_at = checked_at = 0.0
    probe: tuple[dt.datetime, int] | None = None  # (a time, the WAL flushed then): for mark_consumed
    while not stop.is_set():
        messages = source.read(FOLLOW_RECORD_EVERY_SECS if pending else 0.5)
        if messages:
            txns = decoder.decode(messages)
            del messages  # (the rows kept are copies: the messages go before more are read)
            if txns and not pending:
                oldest = time.monotonic()
            pending += txns
            pending_bytes += _row_bytes(txns)
        now = time.monotonic()
        if pending:
            waiting = sum(len(t.events) + len(t.unreadable) for t in pending)
            drained = not source.full
            if waiting >= stream.batch.max_size or pending_bytes >= budget or \
                    now - oldest >= stream.batch.max_fill_secs or \
                    (drained and now - recorded_at >= FOLLOW_RECORD_EVERY_SECS):
                # with a hand-off, what it has room for (one transaction at least): the rest waits
                fits = len(pending) if handoff is None else _fitting(pending, handoff.room())
                txns, pending = pending[:fits], pending[fits:]
                pending_bytes = _row_bytes(pending)
                try:
                    recorded_for_run = _record_for_run(conn, stream, run_key, txns, stats, handoff,
                                                       source.application_name, stop.is_set)
                except ledger.NotVisibleYet:
                    return True  # stopped while waiting: nothing recorded or confirmed
                if not recorded_for_run:
                    source.confirm(txns[-1].end_lsn)
                    return False
                source.confirm(txns[-1].end_lsn)
                recorded_at = oldest = now
                if handoff is not None and (pending or handoff.room() < stream.batch.max_size) and \
                        not _wait_for_room(conn, source, stream, run_key, stop, handoff):
                    return False
        if pending or decoder.in_transaction or now - checked_at < FOLLOW_CHECK_SECS:
            continue
        # nothing received is unrecorded: every transaction that committed before the server's
        # position has been seen, so the slot may move there (past other tables' WAL)
        checked_at = now
        if not ledger.run_is_open(conn, stream.id, run_key):
            return False
        if probe is not None and source.wal_end >= probe[1]:
            ledger.mark_consumed(conn, stream.id, probe[0])
            probe = None
        if probe is None:
            probe = (dt.datetime.now(dt.UTC), replication.flush_lsn(conn))
        if not replication.publication_exists(conn, source.publication):
            # dropped: the server skips the stream's events without an error (Postgres 18), so the slot
            # must not move past what was received (the sensor puts it back and recovers)
            raise walstream.SlotGone(f'publication "{source.publication}" does not exist')
        source.confirm(source.wal_end, reply=True)  # the reply brings a fresh wal_end
    return True


def _row_bytes(txns: list[replication.Transaction]) -> int:
    """Bytes of the WAL messages of the rows kept in ``txns`` (with a hand-off)."""
    return sum([e.row[3] for t in txns for e in t.events if e.row is not None])


def _fitting(txns: list[replication.Transaction], room: int) -> int:
    """How many of ``txns``, from the first, hold at most ``room`` events (one at least)."""
    total = 0
    for i, t in enumerate(txns):
        total += len(t.events)
        if total > room:
            return max(i, 1)
    return len(txns)


def _wait_for_room(conn: psycopg.Connection, source: walstream.ReplicationStream, stream: StreamConfig,
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
        if not ledger.extend_run(conn, stream.id, run_key, stream.delivery.max_events_per_run) and \
                not ledger.run_is_open(conn, stream.id, run_key):
            return False
        source.confirm(source.confirmed)  # a status update: the server does not time the connection out
    return True


def _record_for_run(conn: psycopg.Connection, stream: StreamConfig, run_key: str,
                    txns: list[replication.Transaction], stats: FollowStats, handoff: Handoff | None,
                    standby: str | None = None, give_up: Callable[[], bool] | None = None) -> bool:
    """Record ``txns`` and hand the batches to the run, in one transaction; false if the run is no
    longer the stream's open run (the batches stay pending: the sensor launches the next run).

    The batches' rows go to ``handoff`` before the commit, so they are there when the run, woken by
    the commit, asks for them; if the commit fails they are dropped again (their ids are never used)."""
    recorded: list[int] = []
    try:
        with conn.transaction():
            ledger.lock_recording(conn, stream.id)  # the sensor may be recording what it peeked just before
            fresh = [t for t in unrecorded(conn, stream.id, txns) if t.events or t.unreadable]
            if fresh:
                recorded = ledger.record(conn, stream.id, fresh, stream.batch.max_size, standby=standby,
                                         give_up=give_up)
                if handoff is not None:
                    handoff.put(recorded, fresh, stream.batch.max_size)
            handed = ledger.extend_run(conn, stream.id, run_key, stream.delivery.max_events_per_run)
    except BaseException:
        if handoff is not None:
            handoff.discard(recorded)
        raise
    if fresh:
        stats.batches += len(recorded)
        stats.events += sum(len(t.events) for t in fresh)
        stats.unreadable += sum(len(t.unreadable) for t in fresh)
    # nothing handed over: nothing new, the run has max_events_per_run outstanding (the sensor hands
    # the rest later), or it closed
    return bool(handed) or ledger.run_is_open(conn, stream.id, run_key)
