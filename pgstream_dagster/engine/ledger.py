"""The batch ledger (``pgstream.batches``) and the slot cursor that feeds it: recording batches,
reading a stream's state in one query (:func:`stream_state`, for ``batches.decide``), the batch
transitions (one function and one UPDATE each: :func:`assign`, :func:`open_run`,
:func:`clear_open_run`, :func:`release`, :func:`mark_failed`, :func:`mark_confirmed`,
:func:`mark_delivered`, :func:`enter_failover`, :func:`leave_failover`, :func:`retry_now`,
:func:`skip_batch`), the run operations made of them (:func:`launch`, :func:`extend_run`,
:func:`close_run`, :func:`fail_run`), :func:`apply` (a decision's action), and the delivery lease.
Statuses are :class:`~.batches.BatchStatus` members; "open" is ``pgstream.batch_is_open(status)``.

Invariants:
* a transaction read from the slot is recorded in the ledger *whole*, in one database
  transaction, before the slot is advanced past it; a crash in between re-reads it from the slot
  and the ledger's last ``end_lsn`` makes that harmless;
* a batch's ``event_ids`` are in commit order; batches of a stream are delivered in id order;
* a batch is ``delivered`` only once the sink confirmed every event; ``skipped`` only by an
  operator (``pgstream.skip_batch``). Both count as done; everything else is *open*.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Any, assert_never

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from ..config import StreamConfig, stream_object_name
from ..sinks import Event
from ..sinks.base import event_from_text
from . import replication
from .batches import (
    Action,
    BatchStatus,
    Extend,
    FailRun,
    Launch,
    LeaveFailover,
    Reissue,
    RunOrder,
    StreamState,
    Wait,
    Warm,
    WarmRun,
)
from .batches import Batch as Batch  # ledger.Batch: the delivery job's name for it
from .replication import DecodedEvent, Transaction

if TYPE_CHECKING:
    from collections.abc import Callable

    from .publish import TooLarge

_BATCH_COLUMNS = ("b.id, b.stream_id, b.kind, b.event_count, b.first_event_id, b.last_event_id, b.status, "
                  "b.attempts, b.run_key, s.incarnation, b.run_id, b.error, b.next_attempt_at, b.first_commit_at, "
                  "b.created_at, b.confirmed_count")
_BATCH_FROM = "from pgstream.batches b join pgstream.streams s on s.id = b.stream_id"



def _batch(row: dict[str, Any] | None) -> Batch | None:
    return Batch(**row) if row else None


#: The unique index on the slot a stream reads, ``pgstream.streams.slot`` (sql/022_lock_timeouts_and_slot_names.sql).
SLOT_INDEX = "streams_slot_key"


class SlotInUse(RuntimeError):
    """A stream was to read a replication slot that another stream already reads."""

    def __init__(self, stream_id: int, slot: str, holder: int | None) -> None:
        self.stream_id, self.slot, self.holder = stream_id, slot, holder
        other = f"stream {holder}" if holder is not None else "another stream"
        advice = f"give stream {stream_id} another streams[].slot_name in pgstream.yaml"
        if holder is not None:  # advice for the operator, never executed
            advice += (f", or, if stream {holder} is no longer used, delete it (delete from pgstream.streams "  # noqa: S608
                       f"where id = {holder}) and drop its slot (select pg_drop_replication_slot('{slot}'))")
        super().__init__(f"stream {stream_id}: slot {slot} is already used by {other}; a slot belongs to one "
                         f"stream (each would advance it past the other's events): {advice}")


class SlotElsewhere(RuntimeError):
    """The slot a stream reads exists, but in another database of the cluster (slot names are the cluster's)."""

    def __init__(self, stream_id: int, slot: str, database: str) -> None:
        self.stream_id, self.slot, self.database = stream_id, slot, database
        super().__init__(f"stream {stream_id}: replication slot {slot} belongs to database {database}, not to this "
                         f"one (slot names are the cluster's): give stream {stream_id} another streams[].slot_name "
                         f"in pgstream.yaml, or drop that slot in database {database} if nothing there reads it")


def stream_slot(conn: psycopg.Connection, stream_id: int) -> str:
    """The replication slot stream ``stream_id`` reads (``pgstream.streams.slot``: its ``slot_name``, else
    its default, a name the database derives, unique in the cluster: ``pgstream.default_slot_name``), or
    the default a new stream row would get. The one place Python learns a slot's name."""
    row = conn.execute("select pgstream.stream_slot(%s)", [stream_id]).fetchone()
    assert row is not None and row[0] is not None
    return str(row[0])


def slot_holder(conn: psycopg.Connection, slot: str, stream_id: int) -> int | None:
    """The stream other than ``stream_id`` that reads ``slot`` (``pgstream.streams.slot``)."""
    row = conn.execute("select pgstream.slot_holder(%s, %s)", [slot, stream_id]).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def check_slots(conn: psycopg.Connection, streams: list[tuple[int, str | None]]) -> None:
    """Raise :class:`SlotInUse` if a stream (``(id, slot_name)``; ``None``: its default slot) would read a
    slot that another stream row already reads; before anything changes (``pgstream-dagster init``)."""
    for stream_id, slot_name in streams:
        slot = slot_name or stream_slot(conn, stream_id)
        holder = slot_holder(conn, slot, stream_id)
        if holder is not None:
            raise SlotInUse(stream_id, slot, holder)


def ensure_stream(conn: psycopg.Connection, stream_id: int, slot_name: str | None = None) -> str:
    """The stream row (and so its publication) exists and reads ``slot_name`` (``None``: its default
    slot); returns the slot it reads.

    Raises :class:`SlotInUse` (nothing changed) when another stream row already reads that slot.
    """
    try:
        with conn.transaction():
            # the owner's function (the runtime writes no stream row itself): the row exists and reads
            # slot_name, null for its default; it locks the row only when something changes (a run may
            # hold its lock)
            conn.execute("select pgstream.register_stream(%s, %s)", [stream_id, slot_name])
            return stream_slot(conn, stream_id)
    except psycopg.errors.UniqueViolation as exc:
        if exc.diag.constraint_name != SLOT_INDEX:
            raise
        wanted = slot_name or stream_slot(conn, stream_id)
        raise SlotInUse(stream_id, wanted, slot_holder(conn, wanted, stream_id)) from None


def last_end_lsn(conn: psycopg.Connection, stream_id: int) -> int | None:
    row = conn.execute("select max(end_lsn)::text from pgstream.batches where stream_id = %s", [stream_id]).fetchone()
    return replication.lsn_to_int(row[0]) if row and row[0] else None


def record(conn: psycopg.Connection, stream_id: int, txns: list[Transaction], max_size: int,
           kind: str = "stream", standby: str | None = None, give_up: Callable[[], bool] | None = None) -> list[int]:
    """Record the events of ``txns`` (commit order) as batches of at most ``max_size``, and their
    unreadable events as dead letters (stage 'read').

    Runs in its own database transaction. Every batch carries the LSN range and commit times of
    the transactions it covers; the last batch's ``end_lsn`` is the end of the last transaction.
    Waits first until ``txns`` are visible (:func:`wait_until_visible`; ``standby``: the replication
    connection that decoded them, if any; ``give_up``: when to stop waiting and raise).
    """
    ids: list[int] = []
    events = [e for t in txns for e in t.events]
    wait_until_visible(conn, [t.xid for t in txns], standby, give_up)
    # the transaction of each position where a chunk may start or end
    txn_at: list[Transaction] = []
    for t in txns:
        txn_at.extend([t] * len(t.events))
    with conn.transaction():
        for start in range(0, len(events), max_size):
            chunk = events[start:start + max_size]
            first_txn, last_txn = txn_at[start], txn_at[start + len(chunk) - 1]
            created = [e.created_at for e in chunk]
            row = conn.execute(
                """insert into pgstream.batches
                   (stream_id, kind, event_ids, event_count, first_event_id, last_event_id, min_created_at,
                    max_created_at, start_lsn, end_lsn, first_commit_at, last_commit_at)
                   values (%s, %s, %s::bigint[], %s, %s, %s, %s, %s, %s::pg_lsn, %s::pg_lsn, %s, %s) returning id""",
                # the ids as an array literal: psycopg dumps a list element by element in Python (6 ms per
                # 10,000 ids, against 0.8 ms for this)
                [stream_id, kind, "{" + ",".join([str(e.id) for e in chunk]) + "}", len(chunk), chunk[0].id,
                 chunk[-1].id, min(created), max(created),
                 replication.int_to_lsn(first_txn.commit_lsn), replication.int_to_lsn(last_txn.end_lsn),
                 first_txn.commit_time, last_txn.commit_time],
            ).fetchone()
            assert row is not None
            ids.append(int(row[0]))
        record_unreadable(conn, stream_id, txns)
    return ids


#: the transactions of ``xids`` that this statement's snapshot does not see yet (``xids`` are 32-bit, as
#: the WAL carries them: each is widened to the xid8 at most 2^32 before the snapshot's xmax)
_NOT_VISIBLE = """
select count(*) from (select pg_catalog.pg_current_snapshot() as snap) c
cross join lateral (select pg_catalog.pg_snapshot_xmax(c.snap)::text::bigint as xmax) m
cross join pg_catalog.unnest(%s::bigint[]) x(xid)
where not pg_catalog.pg_visible_in_snapshot(
    (m.xmax - ((m.xmax %% 4294967296) - x.xid + 4294967296) %% 4294967296)::text::xid8, c.snap)"""


class ReaderIsSynchronousStandby(RuntimeError):
    """The reader's replication connection is a synchronous standby of the writers it waits for."""


class NotVisibleYet(RuntimeError):
    """Decoded transactions not visible yet when the caller gave up waiting: nothing was recorded."""


def wait_until_visible(conn: psycopg.Connection, xids: list[int], standby: str | None = None,
                       give_up: Callable[[], bool] | None = None) -> None:
    """Return once every transaction of ``xids`` (decoded from the slot, so committed) is visible to
    the snapshots ``conn`` takes from now on (read committed: each statement's).

    Logical decoding hands out a transaction once its commit record is flushed, which is before its
    backend leaves the proc array: for a moment (longer with synchronous replication, which waits for
    the standby in between) its rows are invisible to new snapshots, and ``pg_xact_status`` already
    says committed. A read of its events then (the batch trigger's count by subscription, a dead
    letter's payload, a run reading the batch) would miss rows; after this wait none does. Every
    later read of the batch's events comes after the recording commits, hence after this wait.

    ``standby``: the application name of the replication connection that decoded them (an open
    run's reader). Should ``synchronous_standby_names`` make it a synchronous standby, the writers
    wait for it to confirm what it has not recorded yet while it waits for them: raises
    :class:`ReaderIsSynchronousStandby` (the run reports it; the sensor reads the slot instead).
    ``give_up``: once it returns true (the run stops, the sensor's tick budget is spent) raises
    :class:`NotVisibleYet` instead of waiting on: the caller records them later, never without them."""
    xids = sorted({x for x in xids if x >= 3})  # 0: recovery's own snapshot; 1-2: special xids
    if not xids:
        return
    pause = 0.0005
    while True:
        row = conn.execute(_NOT_VISIBLE, [xids]).fetchone()
        if row is None or row[0] == 0:
            return
        if standby is not None and pause >= 0.05 and conn.execute(
                "select exists (select 1 from pg_catalog.pg_stat_replication "
                "where application_name = %s and sync_state in ('sync', 'quorum'))", [standby]).fetchone() == (True,):
            setting = conn.execute("show synchronous_standby_names").fetchone()
            raise ReaderIsSynchronousStandby(
                f"the slot reader's replication connection ({standby!r}) is a synchronous standby "
                f"(synchronous_standby_names = {setting[0] if setting else ''!r} matches it): writers wait "
                "for it to confirm transactions it can record only once they are visible; list only real "
                "standbys there")
        if give_up is not None and give_up():
            raise NotVisibleYet(f"{row[0]} decoded transactions are not visible yet")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def record_unreadable(conn: psycopg.Connection, stream_id: int, txns: list[Transaction]) -> int:
    """Dead letters (stage 'read') for the events of ``txns`` the sensor could not record, with the
    reason and the commit LSN of their transaction; the payload is copied when the row is still
    there. Idempotent (a transaction read twice sets nothing aside twice). Returns the rows added."""
    added = 0
    for t in txns:
        for bad in t.unreadable:
            cur = conn.execute(
                """insert into pgstream.dead_letters
                          (stream_id, event_id, stage, lsn, payload, metadata, error, attempts)
                   select %(s)s, %(e)s, 'read', %(lsn)s::pg_lsn, e.payload, e.metadata, %(error)s, 0
                   from (select 1) one
                   left join lateral (select payload, metadata from pgstream.events
                                      where id = %(e)s and stream_id = %(s)s limit 1) e on true
                   on conflict (stream_id, event_id) do nothing""",
                {"s": stream_id, "e": bad.id, "lsn": replication.int_to_lsn(t.commit_lsn), "error": bad.reason})
            added += cur.rowcount
    return added


def recovered_ids_since(conn: psycopg.Connection, stream_id: int, lsn: int) -> set[int]:
    """Event ids recorded by recovery batches whose snapshot reaches past ``lsn``: a slot
    transaction committed before that point may already be in them."""
    rows = conn.execute(
        "select unnest(event_ids) from pgstream.batches where stream_id = %s and kind = 'recovery' "
        "and end_lsn >= %s::pg_lsn",
        [stream_id, replication.int_to_lsn(lsn)],
    ).fetchall()
    return {int(r[0]) for r in rows}


def recover_from_table(conn: psycopg.Connection, stream_id: int, max_size: int) -> list[int]:
    """Record every event of the stream that no batch covers yet, in id order (they are all
    committed), as ``recovery`` batches whose ``end_lsn`` is the WAL position of the snapshot.

    Events older than the stream's ``ledger_horizon`` were delivered by batches pruned since and
    are not looked at. The anti-join is a hash join over the ledger's ids: linear, not
    events x batches. Clears ``streams.recovery_pending`` in the same transaction.
    """
    with conn.transaction():
        conn.execute("set transaction isolation level repeatable read")
        # fetchone() is typed optional; a select without from returns one row
        (lsn,) = conn.execute("select pg_current_wal_lsn()::text").fetchone()  # type: ignore[misc]
        rows = conn.execute(
            """with covered as materialized (
                   select distinct unnest(event_ids) as id from pgstream.batches where stream_id = %(s)s)
               select e.id, e.created_at::text from pgstream.events e
               left join covered c on c.id = e.id
               where e.stream_id = %(s)s and c.id is null
                 and e.created_at > coalesce((select ledger_horizon from pgstream.streams where id = %(s)s),
                                             '-infinity')
                 and not exists (select 1 from pgstream.dead_letters d where d.stream_id = %(s)s and d.event_id = e.id)
               order by e.id""",
            {"s": stream_id},
        ).fetchall()
        conn.execute("update pgstream.streams set recovery_pending = false where id = %s", [stream_id])
        if not rows:
            return []
        txn = Transaction(xid=0, commit_lsn=replication.lsn_to_int(lsn), end_lsn=replication.lsn_to_int(lsn))
        for event_id, created in rows:
            parsed = replication.parse_timestamp(created)
            if parsed is None:
                txn.unreadable.append(replication.unreadable_timestamp(int(event_id), created))
            else:
                txn.events.append(DecodedEvent(int(event_id), parsed))
        if txn.events:
            txn.commit_time = max(e.created_at for e in txn.events)
            return record(conn, stream_id, [txn], max_size, kind="recovery")
        record_unreadable(conn, stream_id, [txn])
        return []


def set_recovery_pending(conn: psycopg.Connection, stream_id: int) -> None:
    conn.execute("update pgstream.streams set recovery_pending = true where id = %s", [stream_id])


def recovery_pending(conn: psycopg.Connection, stream_id: int) -> bool:
    row = conn.execute("select recovery_pending from pgstream.streams where id = %s", [stream_id]).fetchone()
    return bool(row and row[0])


def mark_consumed(conn: psycopg.Connection, stream_id: int, through: dt.datetime) -> None:
    """Everything committed before ``through`` has been read from the slot (see retention)."""
    conn.execute("update pgstream.streams set consumed_through = greatest(consumed_through, %s) where id = %s",
                 [through, stream_id])


# --- the stream's state: one read per decision (engine/batches.py decides) ------------------------

_STATE = f"""
select s.paused, s.failover_since, s.open_run_key, s.incarnation::text as stream_incarnation, h.*,
       case when h.status = %(pending)s and not s.paused then (
           -- what a new run takes: the head, then pending batches while the events fit
           select array_agg(r.id order by r.id) from (
               select o.id, row_number() over w as n, sum(o.event_count) over w as events,
                      bool_and(o.status = %(pending)s) over w as all_pending
               from (select id, event_count, status from pgstream.batches
                     where stream_id = s.id and pgstream.batch_is_open(status) and id >= h.id
                     order by id limit 10000) o
               window w as (order by o.id)) r
           where r.n = 1 or (r.all_pending and r.events <= %(max_events)s))
       end as next_run,
       case when s.failover_since is not null and h.status = %(pending)s then (
           select max(launched_at) from pgstream.batches where stream_id = s.id and status = %(delivered)s)
       end as last_delivered_launch
from pgstream.streams s
left join lateral (
    select {_BATCH_COLUMNS} from pgstream.batches b
    where b.stream_id = s.id and pgstream.batch_is_open(b.status) order by b.id limit 1) h on true
where s.id = %(stream_id)s
"""  # noqa: S608  (column lists, no input)

_STREAM_FIELDS = ("paused", "failover_since", "open_run_key", "next_run", "last_delivered_launch", "stream_incarnation")


def stream_state(conn: psycopg.Connection, stream_id: int, max_events: int) -> StreamState:
    """The stream's state for :func:`~.batches.decide`, in one query; ``max_events``:
    ``delivery.max_events_per_run`` (what a new run may take)."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(_STATE, {"stream_id": stream_id, "max_events": max_events, "pending": BatchStatus.PENDING,
                                   "delivered": BatchStatus.DELIVERED}).fetchone()
    if row is None:
        return StreamState(stream_id)
    stream = {k: row.pop(k) for k in _STREAM_FIELDS}
    return StreamState(stream_id, head=_batch(row) if row["id"] is not None else None, paused=bool(stream["paused"]),
                       failover_since=stream["failover_since"], open_run_key=stream["open_run_key"],
                       next_run=tuple(stream["next_run"] or ()),
                       last_delivered_launch=stream["last_delivered_launch"],
                       incarnation=str(stream["stream_incarnation"] or ""))


def batches_between(conn: psycopg.Connection, stream_id: int, first: int, last: int) -> list[Batch]:
    with conn.cursor(row_factory=dict_row) as cur:
        return [Batch(**r) for r in cur.execute(
            f"select {_BATCH_COLUMNS} {_BATCH_FROM} where b.stream_id = %s and b.id between %s and %s "
            "order by b.id", [stream_id, first, last]).fetchall()]


def not_delivered(conn: psycopg.Connection, batch_ids: list[int]) -> list[int]:
    return [int(r[0]) for r in conn.execute(
        "select id from pgstream.batches where id = any(%s) and status <> %s order by id",
        [batch_ids, BatchStatus.DELIVERED]).fetchall()]


def earlier_open(conn: psycopg.Connection, stream_id: int, batch_id: int) -> int | None:
    row = conn.execute("select min(id) from pgstream.batches where stream_id = %s and id < %s "
                       "and pgstream.batch_is_open(status)", [stream_id, batch_id]).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def run_batch_ids(conn: psycopg.Connection, head: Batch) -> list[int]:
    """The batches assigned to the run of ``head`` (a launched batch), in order."""
    return [int(r[0]) for r in conn.execute(
        "select id from pgstream.batches where stream_id = %s and pgstream.batch_is_open(status) "
        "and run_key = %s and status = %s order by id",
        [head.stream_id, head.run_key, BatchStatus.LAUNCHED]).fetchall()] or [head.id]


def assigned_after(conn: psycopg.Connection, run_key: str, after_batch_id: int) -> list[Batch]:
    """Batches assigned to the run ``run_key`` since it loaded ``after_batch_id``, in order."""
    with conn.cursor(row_factory=dict_row) as cur:
        return [Batch(**r) for r in cur.execute(
            f"select {_BATCH_COLUMNS} {_BATCH_FROM} where b.run_key = %s and b.id > %s and b.status = %s "
            "order by b.id", [run_key, after_batch_id, BatchStatus.LAUNCHED]).fetchall()]


def run_is_open(conn: psycopg.Connection, stream_id: int, run_key: str) -> bool:
    row = conn.execute("select open_run_key = %s from pgstream.streams where id = %s",
                       [run_key, stream_id]).fetchone()
    return bool(row and row[0])


def is_paused(conn: psycopg.Connection, stream_id: int) -> bool:
    row = conn.execute("select paused from pgstream.streams where id = %s", [stream_id]).fetchone()
    return bool(row and row[0])


def run_channel(stream_id: int) -> str:
    """The NOTIFY channel on which an open run hears that batches were assigned to it."""
    return f"{stream_object_name(stream_id)}_runs"


def listen_runs(conn: psycopg.Connection, stream_id: int) -> None:
    """LISTEN on the stream's :func:`run_channel` (an open run waits there for batches)."""
    conn.execute(sql.SQL("listen {}").format(sql.Identifier(run_channel(stream_id))))


# --- transitions: one function (one UPDATE) each ----------------------------------------------------

def assign(conn: psycopg.Connection, batch_ids: tuple[int, ...] | list[int], run_key: str) -> None:
    """pending or failed -> launched: the batches are the run ``run_key``'s (one more attempt each)."""
    conn.execute("update pgstream.batches set status = %s, run_key = %s, attempts = attempts + 1, "
                 "launched_at = now(), next_attempt_at = null where id = any(%s)",
                 [BatchStatus.LAUNCHED, run_key, list(batch_ids)])


def open_run(conn: psycopg.Connection, stream_id: int, run_key: str) -> None:
    """The run ``run_key`` becomes the stream's open run: :func:`extend_run` hands it new batches."""
    conn.execute("update pgstream.streams set open_run_key = %s where id = %s", [run_key, stream_id])


def clear_open_run(conn: psycopg.Connection, stream_id: int, run_key: str) -> None:
    """The run ``run_key`` is no longer the stream's open run (closed, failed, or gone without closing)."""
    conn.execute("update pgstream.streams set open_run_key = null where id = %s and open_run_key = %s",
                 [stream_id, run_key])


def release(conn: psycopg.Connection, run_key: str, keep: int) -> None:
    """launched -> pending: the batches of the run ``run_key`` other than ``keep`` wait for another run."""
    conn.execute("update pgstream.batches set status = %s, run_key = null where run_key = %s and status = %s "
                 "and id <> %s", [BatchStatus.PENDING, run_key, BatchStatus.LAUNCHED, keep])


def mark_failed(conn: psycopg.Connection, batch_id: int, error: str, retry_at: dt.datetime) -> None:
    """open -> failed: the batch is retried, alone, at ``retry_at``."""
    conn.execute("update pgstream.batches set status = %s, error = %s, next_attempt_at = %s "
                 "where id = %s and pgstream.batch_is_open(status)", [BatchStatus.FAILED, error[:2000], retry_at,
                                                                      batch_id])


def mark_confirmed(conn: psycopg.Connection, batch_id: int, count: int) -> None:
    """The sink confirmed the first ``count`` events of the batch (a retry resumes after them)."""
    conn.execute("update pgstream.batches set confirmed_count = greatest(confirmed_count, %s) "
                 "where id = %s and status <> %s", [count, batch_id, BatchStatus.DELIVERED])


def mark_delivered(conn: psycopg.Connection, batch_id: int, run_id: str) -> bool:
    """-> delivered: the sink confirmed every event of the batch (false if it already was delivered)."""
    row = conn.execute("update pgstream.batches set status = %s, delivered_at = now(), run_id = %s, "
                       "error = null where id = %s and status <> %s returning id",
                       [BatchStatus.DELIVERED, run_id, batch_id, BatchStatus.DELIVERED]).fetchone()
    return row is not None


def enter_failover(conn: psycopg.Connection, head: Batch, error: str, retry_at: dt.datetime) -> None:
    """The stream is in failover with ``head`` as its checkpoint (or stays in it: one more attempt)."""
    conn.execute("select pgstream.enter_failover(%s, %s, %s, %s)", [head.stream_id, head.id, error, retry_at])


def leave_failover(conn: psycopg.Connection, stream_id: int) -> None:
    """The stream caught up: its failover ends."""
    conn.execute("select pgstream.leave_failover(%s)", [stream_id])


def retry_now(conn: psycopg.Connection, stream_id: int) -> int | None:
    """The stream's failed batch is due now instead of after its backoff; its id (``None``: none).
    Raises ``psycopg.errors.NoDataFound`` for a stream that does not exist."""
    row = conn.execute("select pgstream.retry_now(%s)", [stream_id]).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def skip_batch(conn: psycopg.Connection, stream_id: int, batch_id: int) -> int:
    """open -> skipped (an operator gave up on it); the events it held. Raises
    ``psycopg.errors.NoDataFound`` unless it is an open batch of the stream."""
    row = conn.execute("select pgstream.skip_batch(%s, %s)", [stream_id, batch_id]).fetchone()
    assert row is not None
    return int(row[0])


# --- runs: transitions composed ---------------------------------------------------------------------

def launch(conn: psycopg.Connection, stream_id: int, batch_ids: tuple[int, ...] | list[int], run_key: str, *,
           keep_open: bool, replaces: str | None = None) -> None:
    """Assign ``batch_ids`` to the new run ``run_key``; ``keep_open``: it becomes the stream's open
    run; ``replaces``: an open run that ended without closing, forgotten first."""
    with conn.transaction():
        if replaces is not None:
            clear_open_run(conn, stream_id, replaces)
        assign(conn, batch_ids, run_key)
        if keep_open:
            open_run(conn, stream_id, run_key)


def extend_run(conn: psycopg.Connection, stream_id: int, run_key: str, max_events: int) -> list[int]:
    """Assign the stream's pending batches to the open run ``run_key`` (oldest first, while nothing
    else is in between, up to ``max_events`` undelivered events assigned to it) and wake it up.
    Nothing happens unless ``run_key`` is the stream's open run: the stream row's lock orders this
    against :func:`close_run`, so a run that closed is never handed a batch."""
    with conn.transaction():
        row = conn.execute("select open_run_key from pgstream.streams where id = %s for update",
                           [stream_id]).fetchone()
        if row is None or row[0] is None or row[0] != run_key:
            return []
        rows = conn.execute(
            """select id, event_count, status, run_key from pgstream.batches
               where stream_id = %s and pgstream.batch_is_open(status)
               order by id limit 10000""", [stream_id]).fetchall()
        outstanding = 0
        ids: list[int] = []
        for batch_id, count, status, key in rows:
            if status == BatchStatus.LAUNCHED and key == run_key and not ids:
                outstanding += int(count)
                continue
            if status != BatchStatus.PENDING or (outstanding and outstanding + int(count) > max_events):
                break
            ids.append(int(batch_id))
            outstanding += int(count)
        if ids:
            assign(conn, ids, run_key)
            conn.execute("select pg_notify(%s, %s)", [run_channel(stream_id), run_key])
    return ids


def close_run(conn: psycopg.Connection, stream_id: int, run_key: str) -> bool:
    """The run ``run_key`` stops taking batches: true unless batches were assigned to it and not
    delivered yet (then it must deliver them first and try again)."""
    with conn.transaction():
        conn.execute("select 1 from pgstream.streams where id = %s for update", [stream_id])
        # a statement after the lock: sees every assignment committed before it was granted
        row = conn.execute("select exists (select 1 from pgstream.batches where run_key = %s and status = %s)",
                           [run_key, BatchStatus.LAUNCHED]).fetchone()
        if row and row[0]:
            return False
        clear_open_run(conn, stream_id, run_key)
    return True


def fail_run(conn: psycopg.Connection, head: Batch, run_key: str, error: str, retry_at: dt.datetime) -> None:
    """A delivery run failed: its first undelivered batch waits for ``retry_at`` and the stream
    enters failover; the run's other batches go back to pending (they were not refused)."""
    with conn.transaction():
        clear_open_run(conn, head.stream_id, run_key)
        release(conn, run_key, keep=head.id)
        mark_failed(conn, head.id, error, retry_at)
        enter_failover(conn, head, error, retry_at)


def open_warm_run(conn: psycopg.Connection, stream_id: int, run_key: str) -> bool:
    """The run ``run_key`` (no batch yet) becomes the stream's open run, unless the stream has one."""
    row = conn.execute("update pgstream.streams set open_run_key = %s where id = %s and open_run_key is null "
                       "returning id", [run_key, stream_id]).fetchone()
    return row is not None


def apply(conn: psycopg.Connection, stream: StreamConfig, action: Action) -> RunOrder | WarmRun | None:
    """Carry out ``action`` (from :func:`~.batches.decide`) in the ledger; the run to request, if
    any. Reporting a dead run to Dagster (``FailRun.died``) is the caller's, before this."""
    match action:
        case LeaveFailover(then=then):
            leave_failover(conn, stream.id)
            return apply(conn, stream, then)
        case Wait():
            return None
        case Warm(run=run, again=again):
            return run if again or open_warm_run(conn, stream.id, run.run_key) else None
        case Launch(order=order, keep_open=keep_open, replaces=replaces):
            launch(conn, stream.id, order.batch_ids, order.run_key, keep_open=keep_open, replaces=replaces)
            return order
        case Extend(run_key=key, otherwise=otherwise):
            # empty when the run closed meanwhile: then a new run, if the head needs one
            if extend_run(conn, stream.id, key, stream.delivery.max_events_per_run) or otherwise is None:
                return None
            return apply(conn, stream, otherwise)
        case Reissue(head=head):
            # asking Dagster again with the same run key is harmless: it skips run keys it has seen
            return RunOrder(head, tuple(run_batch_ids(conn, head)), head.attempts)
        case FailRun(head=head, error=error, retry_at=retry_at):
            fail_run(conn, head, head.run_key or "", error, retry_at)
            return None
    assert_never(action)


# --- pgstream's own locks (sql/repeatable/00_locks.sql) ----------------------------------------------
# Rows of pgstream.locks, which only the owner can write: not advisory locks, which any role that can
# connect could take and hold to stall a stream. A lock taken with :func:`try_lock` is held by the
# session (backend) that took it until :func:`unlock` or until that session ends, however it ends.

#: per stream (key: stream id): the open run's delivery lease; its holder is the run id
DELIVERY_LOCK = "delivery"
#: per stream: the slot reader's claim; an open run's reader holds it on its ledger connection while
#: it reads the slot or is about to, and the sensor does not peek meanwhile
READER_LOCK = "reader"
#: per stream: a redelivery of its dead letters
REDELIVERY_LOCK = "redelivery"
#: per stream: a replay, held while it waits for the delivery lease and while it delivers; an open run
#: that sees it closes (it yields the lease to the replay), a delivery run that starts waits for it
REPLAY_LOCK = "replay"
#: per stream: a delivery run waiting for the lease while a replay holds it (its holder is the run id:
#: the run is alive, not dead, although it holds no lease yet)
LEASE_WAIT_LOCK = "delivery_wait"
#: how often a run or a replay waiting for the delivery lease looks again (seconds)
LEASE_POLL_SECS = 0.2


def try_lock(conn: psycopg.Connection, name: str, key: int, holder: str | None = None) -> bool:
    """Take pgstream's lock ``(name, key)`` for ``conn``'s session (false: another live session holds
    it). ``conn`` must be in autocommit mode: the lock is a row that must be committed at once."""
    if not conn.autocommit:
        raise ValueError("try_lock needs a connection in autocommit mode")
    row = conn.execute("select pgstream.try_lock(%s, %s, %s)", [name, key, holder]).fetchone()
    return bool(row and row[0])


def unlock(conn: psycopg.Connection, name: str, key: int) -> None:
    """Give pgstream's lock ``(name, key)`` up if ``conn``'s session holds it."""
    conn.execute("select pgstream.unlock(%s, %s)", [name, key])


def lock_holder(conn: psycopg.Connection, name: str, key: int) -> str | None:
    """Who holds pgstream's lock ``(name, key)`` (``""``: a holder without a name), or None when free."""
    row = conn.execute("select pgstream.lock_holder(%s, %s)", [name, key]).fetchone()
    return None if row is None or row[0] is None else str(row[0])


def lease_name(run_id: str) -> str:
    return f"pgstream run {run_id}"


class LeaseTaken(RuntimeError):
    """Another live run holds the stream's delivery lease."""


def acquire_lease(database_url: str, stream_id: int, run_id: str,
                  waiting: Callable[[str], None] | None = None) -> psycopg.Connection:
    """A connection holding the stream's delivery lease (pgstream's lock ``delivery``, held by the
    run id), named after the run. It lasts as long as the run's process: if the process dies, Postgres
    drops the connection and the lease with it, which is how the sensor tells a dead run from a slow
    one. Two runs of one stream can never deliver at the same time. While a replay of the stream holds
    or waits for the lease (:func:`acquire_replay_lease`) the run waits for it to end (``waiting`` is
    told who, every 10 s), holding the ``delivery_wait`` lock meanwhile (it is alive, not dead); another
    delivery run holding the lease is :class:`LeaseTaken`."""
    conn = psycopg.connect(database_url, autocommit=True, application_name=lease_name(run_id))
    try:
        told = 0.0
        while True:
            replay = lock_holder(conn, REPLAY_LOCK, stream_id)
            if replay is None:
                if not try_lock(conn, DELIVERY_LOCK, stream_id, run_id):
                    raise LeaseTaken(f"another run is delivering stream {stream_id}")
                unlock(conn, LEASE_WAIT_LOCK, stream_id)
                return conn
            try_lock(conn, LEASE_WAIT_LOCK, stream_id, run_id)
            if waiting is not None and time.monotonic() - told >= 10:
                told = time.monotonic()
                waiting(replay)
            time.sleep(LEASE_POLL_SECS)
    except BaseException:
        conn.close()
        raise


def acquire_replay_lease(database_url: str, stream_id: int, holder: str,
                         waiting: Callable[[str], None] | None = None) -> psycopg.Connection:
    """A connection holding the stream's delivery lease for a replay named ``holder`` (its run id),
    and the stream's ``replay`` lock: no delivery run delivers while the connection is open, whatever
    launched the replay (the Launchpad, ``dagster job execute``, a script). It takes the ``replay``
    lock first (after any other replay of the stream), then waits for the lease: the stream's open run
    sees the ``replay`` lock between two rounds, stops taking batches, delivers those it was handed and
    closes, which frees the lease; a run that starts meanwhile waits for the replay
    (:func:`acquire_lease`). Nothing waits on the replay while it waits, so this cannot deadlock.
    ``waiting`` is told who holds what it waits for, every 10 s. Close the connection to release both."""
    conn = psycopg.connect(database_url, autocommit=True, application_name=f"pgstream replay {holder}")
    try:
        told = 0.0
        for name, what in ((REPLAY_LOCK, "another replay"), (DELIVERY_LOCK, "the delivery lease")):
            while not try_lock(conn, name, stream_id, holder):
                if waiting is not None and time.monotonic() - told >= 10:
                    told = time.monotonic()
                    waiting(f"{what} (held by {lock_holder(conn, name, stream_id) or 'a session that is ending'})")
                time.sleep(LEASE_POLL_SECS)
        return conn
    except BaseException:
        conn.close()
        raise


def replay_waiting(conn: psycopg.Connection, stream_id: int) -> bool:
    """Whether a replay of the stream holds or waits for its delivery lease (:func:`acquire_replay_lease`)."""
    return lock_holder(conn, REPLAY_LOCK, stream_id) is not None


def lock_recording(conn: psycopg.Connection, stream_id: int) -> None:
    """Serialise recording what was read from the stream's slot until this transaction ends: the
    sensor and an open run's reader each check what the ledger holds after taking the lock, so a
    transaction both read (the reader connected right after the sensor's peek) is recorded once.
    The stream row's lock, as :func:`extend_run` and :func:`close_run` take it.
    ``no key update``: batches and dead letters referencing the stream are still inserted meanwhile.
    Only inside a transaction."""
    conn.execute("select 1 from pgstream.streams where id = %s for no key update", [stream_id])


def claim_slot(conn: psycopg.Connection, stream_id: int) -> bool:
    """Take the stream's reader claim on ``conn`` (false: another reader has it). It goes with the
    connection: a reader that dies leaves the slot to the sensor."""
    return try_lock(conn, READER_LOCK, stream_id)


def release_slot(conn: psycopg.Connection, stream_id: int) -> None:
    """Give the claim of :func:`claim_slot` up (the sensor peeks again): the reader cannot read for now."""
    unlock(conn, READER_LOCK, stream_id)


def slot_claimed(conn: psycopg.Connection, stream_id: int) -> bool:
    """Whether an open run's reader claims the stream's slot (:func:`claim_slot`): the sensor leaves it alone."""
    return lock_holder(conn, READER_LOCK, stream_id) is not None


def lease_alive(conn: psycopg.Connection, run_id: str) -> bool:
    """Whether run ``run_id``'s process holds a delivery lease (of any stream) and is alive."""
    return lease_state(conn, run_id) is LeaseState.HELD


class LeaseState(StrEnum):
    """What became of a run's delivery lease (:func:`lease_state`)."""

    HELD = "held"  # a live backend of the run holds it
    #: the run took it and the backend that held it has ended without giving it up: the run's process
    #: died (or its connection did, with Postgres restarting): the run delivers nothing more
    LOST = "lost"
    NOT_TAKEN = "not taken"  # no lease names the run: it has not taken one yet (or gave it up, ending)


def lease_state(conn: psycopg.Connection, run_id: str) -> LeaseState:
    """What became of run ``run_id``'s delivery lease (of any stream), or of its wait for it. The
    lock's row keeps naming its holder after the holding backend ended, until another run takes the
    lease or the holder gives it up (:func:`give_up_lease`, when a run ends however it ends, short
    of its process dying)."""
    # the lease, or the wait for it while a replay holds it (LEASE_WAIT_LOCK): a run waiting is alive
    row = conn.execute("select bool_or(pgstream.backend_alive(l.pid, l.backend_start, l.usesysid)), count(*) "
                       "from pgstream.locks l where l.name in (%s, %s) and l.holder = %s and l.pid is not null",
                       [DELIVERY_LOCK, LEASE_WAIT_LOCK, run_id]).fetchone()
    if row is None or not row[1]:
        return LeaseState.NOT_TAKEN
    return LeaseState.HELD if row[0] else LeaseState.LOST


def give_up_lease(conn: psycopg.Connection, stream_id: int) -> None:
    """A run that ends (however it ends, short of its process dying) gives its delivery lease up and
    closes the lease's connection: only a run whose process died leaves a :attr:`LeaseState.LOST`
    lease behind. A connection already broken gives up nothing (its backend has ended)."""
    try:
        if not conn.closed and not conn.broken:
            unlock(conn, DELIVERY_LOCK, stream_id)
    except psycopg.Error:
        pass
    finally:
        conn.close()


class RecordingCheck:
    """Whether the run's ledger connection ``conn`` (the lease's: it records what the sink confirms)
    still answers, asked of Postgres at most every ``every_secs``; once it does not, never again (a
    sink calls it before each request it sends: :attr:`~..sinks.base.Sink.go_on`)."""

    def __init__(self, conn: psycopg.Connection, every_secs: float = 0.2) -> None:
        self.conn, self.every_secs = conn, every_secs
        self.broken: str | None = None  # why it no longer answers
        self._asked = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            if self.broken is None and (self.conn.closed or self.conn.broken):
                self.broken = "the connection is closed"
            if self.broken is not None:
                return False
            if time.monotonic() - self._asked < self.every_secs:
                return True
            try:
                self.conn.execute("select 1")
            except psycopg.Error as exc:
                self.broken = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                return False
            self._asked = time.monotonic()
            return True


@contextmanager
def holding_lease(conn: psycopg.Connection, stream_id: int) -> Iterator[psycopg.Connection]:
    """``conn`` (from :func:`acquire_lease`) until the block ends, then :func:`give_up_lease`."""
    try:
        yield conn
    finally:
        give_up_lease(conn, stream_id)


# --- dead letters (sql/014_event_integrity.sql) ----------------------------------------------------

def dead_letter_positions(conn: psycopg.Connection, stream_id: int, batch_ids: list[int]) -> frozenset[tuple[int, int]]:
    """The ``(batch_id, ord)`` of the events of ``batch_ids`` that have a dead letter: delivery
    skips them."""
    rows = conn.execute("select batch_id, ord from pgstream.dead_letters where stream_id = %s and batch_id = any(%s)",
                        [stream_id, batch_ids]).fetchall()
    return frozenset((int(b), int(o)) for b, o in rows)


def vanished(conn: psycopg.Connection, batch_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(batch_id, ord, event_id)`` of the events of ``batch_ids`` that are no longer in
    ``pgstream.events`` (the join the delivery loader uses), in delivery order."""
    return [(int(b), int(o), int(e)) for b, o, e in conn.execute(
        """select b.id, o.ord, o.id from pgstream.batches b
           cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
           where b.id = any(%s) and not exists (
               select 1 from pgstream.events e
               where e.id = o.id and e.stream_id = b.stream_id
                 and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at)
           order by b.id, o.ord""", [batch_ids]).fetchall()]


class DeadLetterWriter:
    """Records an event the sink rejected for good as a dead letter (``on_reject: dead_letter``),
    durably, before the next event is published; moves the batch's confirmed prefix past it so a
    retry resumes after it. Picklable (``ordering: by_key`` calls it on Spark executors): each call
    uses its own short connection; set-asides are rare."""

    def __init__(self, database_url: str, stream_id: int, sink: str, *, resumes: bool = True) -> None:
        self.database_url, self.stream_id, self.sink = database_url, stream_id, sink
        self.resumes = resumes  # ordered delivery resumes after the confirmed prefix; by_key does not

    def __call__(self, batch_id: int, ord: int, event: Event, error: str, attempts: int) -> None:
        with psycopg.connect(self.database_url, autocommit=True) as conn, conn.transaction():
            conn.execute(
                """insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, event_created_at,
                                                      payload, metadata, sink, error, attempts)
                   values (%s, %s, 'deliver', %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s)
                   on conflict (stream_id, event_id) do nothing""",
                [self.stream_id, event.id, batch_id, ord, event.created_at, event.payload_json,
                 event.metadata_json, self.sink, error[:2000], attempts])
            if self.resumes:
                mark_confirmed(conn, batch_id, ord)

    def known_good(self) -> Event | None:
        """The stream's last event the sink confirmed (of its last delivered batches, not a dead letter,
        still in ``pgstream.events``), or ``None``: what the reject-storm guard sends again to tell a
        sink that refuses everything from events that are refused for what they are."""
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            row = conn.execute(_KNOWN_GOOD, {"stream": self.stream_id, "delivered": BatchStatus.DELIVERED}).fetchone()
        if row is None:
            return None
        event_id, stream_id, created_at, payload, metadata = row
        return event_from_text(event_id, stream_id, created_at.astimezone(dt.UTC), payload, metadata)

    def too_large(self, batch_id: int, ord: int, row: TooLarge) -> None:
        """Record an event too large for the sink (:class:`~.publish.TooLarge`): the database copies its
        payload and metadata from ``pgstream.events`` (the run never reads them); one attempt."""
        with psycopg.connect(self.database_url, autocommit=True) as conn, conn.transaction():
            conn.execute(
                """insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, event_created_at,
                                                      payload, metadata, sink, error, attempts)
                   select e.stream_id, e.id, 'deliver', %s, %s, e.created_at, e.payload, e.metadata, %s, %s, 1
                   from pgstream.events e where e.id = %s and e.stream_id = %s
                   on conflict (stream_id, event_id) do nothing""",
                [batch_id, ord, self.sink, row.reason[:2000], row.id, self.stream_id])
            if self.resumes:
                mark_confirmed(conn, batch_id, ord)

    def __repr__(self) -> str:  # never the URL
        return f"DeadLetterWriter(stream {self.stream_id}, sink {self.sink})"


#: the stream's last confirmed event (:meth:`DeadLetterWriter.known_good`): the last event of its last
#: delivered batches (five at most: a batch may hold nothing but dead letters and vanished events)
#: that has no dead letter and is still in pgstream.events
_KNOWN_GOOD = """
select e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text
from (select b.id, b.stream_id, b.event_ids, b.min_created_at, b.max_created_at from pgstream.batches b
      where b.stream_id = %(stream)s and b.status = %(delivered)s order by b.id desc limit 5) b
cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
join pgstream.events e
  on e.id = o.id and e.stream_id + 0 = b.stream_id
 and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at
where not exists (select 1 from pgstream.dead_letters d where d.stream_id = b.stream_id and d.event_id = o.id)
order by b.id desc, o.ord desc
limit 1
"""


def count_dead_letters(conn: psycopg.Connection, stream_id: int) -> int:
    row = conn.execute("select count(*) from pgstream.dead_letters where stream_id = %s", [stream_id]).fetchone()
    return int(row[0]) if row else 0


# --- resume points of ordering: by_key (sql/018_key_progress.sql) ----------------------------------

Position = tuple[int, int]


class RunGone(RuntimeError):
    """A ``by_key`` task's run no longer holds the stream's delivery lease: the task stops."""


class KeyProgress:
    """Where each Spark partition of a ``by_key`` round got to: for the round's ``partitions``
    (the repartition count) and each bucket (``pmod(hash(routing_key), partitions)``, Spark's hash
    partitioning of the key), the position ``(batch_id, ord)`` up to which every event of the
    bucket is handled.

    The Spark tasks write it themselves, straight to the ledger, after each chunk the sink
    confirmed and before they publish the next one (:meth:`record`), rather than returning it to
    the driver to record: a task's result reaches the driver only when the task ends, and when
    one task fails Spark aborts the job and the driver gets no result of the others at all, nor
    does it when the run process dies. Recorded by the tasks, a confirmation survives a failing
    task, an aborted job and a dead driver; a retry (another run, or Spark retrying the task)
    reads it back (:meth:`read`) and publishes only what comes after, so at most the chunk each
    task had in flight is delivered twice. One small upsert per confirmed chunk, as the ordered
    path writes ``confirmed_count``. Picklable (sent to the executors); the URL is never shown.
    """

    def __init__(self, database_url: str, stream_id: int, partitions: int, run_id: str | None = None) -> None:
        self.database_url, self.stream_id, self.partitions = database_url, stream_id, partitions
        self.run_id = run_id  # the run whose delivery lease must still be held for a task to go on

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.database_url, autocommit=True, application_name="pgstream by_key task")

    def read(self, conn: psycopg.Connection) -> dict[int, Position]:
        """Per bucket: every event of it at a position up to this one is handled."""
        rows = conn.execute("select bucket, batch_id, ord from pgstream.key_progress "
                            "where stream_id = %s and partitions = %s", [self.stream_id, self.partitions]).fetchall()
        return {int(b): (int(batch), int(o)) for b, batch, o in rows}

    def record(self, conn: psycopg.Connection, buckets: list[int], batch_id: int, ord: int) -> None:
        """Every event of ``buckets`` up to ``(batch_id, ord)`` is handled (positions only move forward).
        With ``run_id``, raises :class:`RunGone` instead when the run no longer holds its delivery
        lease (its process died): a Spark Connect server keeps running an abandoned query for
        minutes, and its tasks must not go on publishing beside the run that replaces it."""
        row = conn.execute(
            """with alive as (select %(lease)s::text is null or exists (
                                  select 1 from pg_stat_activity where application_name = %(lease)s) as ok),
                    saved as (
               insert into pgstream.key_progress as p (stream_id, partitions, bucket, batch_id, ord)
               select %(s)s, %(n)s, b, %(batch)s, %(ord)s from unnest(%(buckets)s::int[]) b, alive where alive.ok
               on conflict (stream_id, partitions, bucket) do update
                  set batch_id = excluded.batch_id, ord = excluded.ord, updated_at = now()
                  where (p.batch_id, p.ord) < (excluded.batch_id, excluded.ord)
               returning 1)
               select ok from alive""",
            {"s": self.stream_id, "n": self.partitions, "buckets": buckets, "batch": batch_id, "ord": ord,
             "lease": lease_name(self.run_id) if self.run_id is not None else None}).fetchone()
        if not (row and row[0]):
            raise RunGone(f"stream {self.stream_id}: run {self.run_id} no longer holds the delivery lease; "
                          f"this by_key task stops (batch {batch_id} #{ord} was its last confirmed position)")

    def __repr__(self) -> str:  # never the URL
        return f"KeyProgress(stream {self.stream_id}, {self.partitions} partitions)"


def key_progress_partitions(conn: psycopg.Connection, stream_id: int, first_batch_id: int) -> int | None:
    """The partition count of an interrupted ``by_key`` attempt at the batches from ``first_batch_id``
    on (its resume points hold only for the same partitioning); None when there is none."""
    row = conn.execute("select partitions from pgstream.key_progress where stream_id = %s and batch_id >= %s "
                       "order by updated_at desc limit 1", [stream_id, first_batch_id]).fetchone()
    return int(row[0]) if row else None


def clear_key_progress(conn: psycopg.Connection, stream_id: int, *, through_batch_id: int | None = None,
                       keep_partitions: int | None = None) -> None:
    """Forget the stream's ``by_key`` resume points that lie in batches up to ``through_batch_id``
    (delivered: no later event is at or before them), or, with ``keep_partitions``, those of any
    other partition count (they cannot be resumed from). A resume point past the round stays: a
    failover probe delivers the failed batch alone, and the batches after it resume from it."""
    if through_batch_id is not None:
        conn.execute("delete from pgstream.key_progress where stream_id = %s and batch_id <= %s",
                     [stream_id, through_batch_id])
    if keep_partitions is not None:
        conn.execute("delete from pgstream.key_progress where stream_id = %s and partitions <> %s",
                     [stream_id, keep_partitions])
