"""Ingest: move what commits from a stream's slot into the ledger (the sensor's work, without
Dagster: ``defs/sensors.py`` runs it each tick).

(1) make sure the slot exists and is usable: a missing or invalidated slot is (re)created and
every event the ledger does not cover is recovered from the table; (2) peek committed
transactions, and once ``max_size`` events are waiting or the oldest waited ``max_fill_secs``,
record them in the ledger and advance the slot, so WAL is released whatever the sink does.
"""


import datetime as dt
import time
from dataclasses import dataclass, field

import psycopg

from ..config import StreamConfig
from . import ledger, replication


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

    def add(self, other: "ConsumeResult") -> None:
        self.batches += other.batches
        self.events += other.events
        self.last_event_id = other.last_event_id if other.last_event_id is not None else self.last_event_id
        self.last_lsn = other.last_lsn or self.last_lsn
        self.slot_created |= other.slot_created
        self.slot_lost |= other.slot_lost
        self.recovered += other.recovered
        self.unreadable += other.unreadable


def ensure_slot(conn: psycopg.Connection, stream: StreamConfig, result: ConsumeResult) -> None:
    """Create the stream row, publication and slot when missing. A slot that was dropped or
    invalidated (``wal_status = 'lost'``, e.g. ``max_slot_wal_keep_size`` exceeded) is replaced,
    then every event no batch covers is recovered from the table.

    Crash-safe: ``recovery_pending`` is set before the slot is touched and cleared in the
    transaction that records the recovery, so an interruption anywhere makes the next tick
    recover again (duplicates possible, losses not).
    """
    ledger.ensure_stream(conn, stream.id, stream.slot)
    info = replication.slot_info(conn, stream.slot)
    pending = ledger.recovery_pending(conn, stream.id)
    if info is not None and info["wal_status"] != "lost" and not pending:
        return
    ledger.set_recovery_pending(conn, stream.id)
    if info is not None and info["wal_status"] == "lost":
        replication.drop_slot(conn, stream.slot)
        result.slot_lost = True
        info = None
    if info is None:
        replication.create_slot(conn, stream.slot)
        result.slot_created = True
    result.recovered = ledger.recover_from_table(conn, stream.id, stream.batch.max_size)


def consume(conn: psycopg.Connection, stream: StreamConfig, budget_secs: float, *, check_slot: bool = True,
            mark: bool = True) -> ConsumeResult:
    """Move committed events from the slot into the ledger (see module docstring). ``check_slot``:
    first make sure the slot is usable (once per tick is enough: a slot lost later fails the peek);
    ``mark``: record how far the slot was read (``streams.consumed_through``)."""
    result = ConsumeResult()
    if check_slot:
        ensure_slot(conn, stream, result)
    deadline = time.monotonic() + budget_secs
    cap = max(stream.batch.max_size * 4, 100_000)
    while True:
        peeked_at = dt.datetime.now(dt.UTC)
        flushed = replication.flush_lsn(conn)
        try:
            txns, rows = replication.peek_rows(conn, stream.slot, stream.publication, cap)
        except (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.UndefinedObject):
            # invalidated or dropped since the check: the next tick replaces it and recovers
            ledger.set_recovery_pending(conn, stream.id)
            result.slot_lost = True
            return result
        complete = rows < cap  # the peek saw everything committed before peeked_at
        recorded_to = ledger.last_end_lsn(conn, stream.id)
        if recorded_to is not None:
            txns = [t for t in txns if t.end_lsn > recorded_to]
        if txns:
            seen = ledger.recovered_ids_since(conn, stream.id, txns[0].commit_lsn)
            if seen:
                for t in txns:
                    t.events = [e for e in t.events if e.id not in seen]
        waiting = sum(len(t.events) for t in txns)
        oldest = next((t.commit_time for t in txns if t.events), None)
        now = dt.datetime.now(dt.UTC)
        full = waiting >= stream.batch.max_size
        ripe = oldest is not None and (now - oldest).total_seconds() >= stream.batch.max_fill_secs
        if not txns or full or ripe or waiting == 0:
            with_events = [t for t in txns if t.events or t.unreadable]
            if with_events:
                result.batches += ledger.record(conn, stream.id, with_events, stream.batch.max_size)
                result.events += waiting
                result.unreadable += sum(len(t.unreadable) for t in with_events)
                last = next((t.events[-1].id for t in reversed(with_events) if t.events), None)
                result.last_event_id = last if last is not None else result.last_event_id
            if txns:
                replication.advance(conn, stream.slot, txns[-1].end_lsn)
                result.last_lsn = replication.int_to_lsn(txns[-1].end_lsn)
            elif complete:
                # nothing of the stream committed before ``flushed``: skip the other tables' WAL so
                # the next peek does not decode it again
                replication.advance_at_least(conn, stream.slot, flushed)
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
