"""The stream's state (:func:`stream_state`, one query for ``batches.decide``), the batch transitions (one UPDATE
each), the run operations made of them, the slot's declared reader, and the two ways in: :func:`apply` (an
:data:`~..batches.Action`) and :func:`apply_run` (a :data:`~..batches.RunAction`): the only writers of
``streams.open_run_key`` and ``streams.slot_reader`` (tests/test_architecture.py)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import assert_never

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from ...config import StreamConfig, stream_object_name
from ..batches import (
    Action,
    BatchStatus,
    CloseRun,
    Extend,
    FailRun,
    Launch,
    LeaveFailover,
    Reissue,
    Requeue,
    RunAction,
    RunOrder,
    StreamState,
    Wait,
    Warm,
)
from ..batches import Batch as Batch  # ledger.state.Batch: the delivery job's name for it
from ..replication import TIMELINE_SQL
from .locks import DELIVERY_LOCK, REPLAY_LOCK
from .recording import atomic

#: the stream's incarnation as run keys carry it: after a promotion, with the server's timeline (``.t2``): a promoted
#: standby that had replayed less hands out again the former primary's batch ids, and Dagster launches a run key
#: once and finds runs by it. On a standby (reading, never launching) the incarnation alone.
_INCARNATION = ("s.incarnation::text operator(pg_catalog.||) case when pg_catalog.pg_is_in_recovery() then '' "
                f"else coalesce(nullif('.t' operator(pg_catalog.||) ({TIMELINE_SQL})::text, '.t1'), '') end")

_BATCH_COLUMNS = ("b.id, b.stream_id, b.kind, b.event_count, b.first_event_id, b.last_event_id, b.status, "
                  "b.attempts, b.run_key, s.incarnation, b.run_id, b.error, b.next_attempt_at, b.first_commit_at, "
                  "b.created_at, b.confirmed_count")
_BATCH_FROM = "from pgstream.batches b join pgstream.streams s on s.id = b.stream_id"


# --- the stream's state: one read per decision (engine/batches.py decides) ------------------------

_STATE = f"""
select p.id as state_of, s.paused, s.failover_since, s.open_run_key,
       {_INCARNATION} as stream_incarnation, h.*,
       case when h.status = %(pending)s and not s.paused then (
           -- what a new run takes: the head, then pending batches while the events fit
           select array_agg(r.id order by r.id) from (
               select o.id, row_number() over w as n, sum(o.event_count) over w as events,
                      bool_and(o.status = %(pending)s) over w as all_pending
               from (select id, event_count, status from pgstream.batches
                     where stream_id = s.id and pgstream.batch_is_open(status) and id >= h.id
                     order by id limit 10000) o
               window w as (order by o.id)) r
           where r.n = 1 or (r.all_pending and r.events <= p.max_events))
       end as next_run,
       case when s.failover_since is not null and h.status = %(pending)s then (
           select max(launched_at) from pgstream.batches where stream_id = s.id and status = %(delivered)s)
       end as last_delivered_launch
from rows from (pg_catalog.unnest(%(ids)s::bigint[]), pg_catalog.unnest(%(max_events)s::bigint[])) as p(id, max_events)
join pgstream.streams s on s.id = p.id
left join lateral (
    select {_BATCH_COLUMNS} from pgstream.batches b
    where b.stream_id = s.id and pgstream.batch_is_open(b.status) order by b.id limit 1) h on true
"""  # noqa: S608  (column lists, no input)

_STREAM_FIELDS = ("paused", "failover_since", "open_run_key", "next_run", "last_delivered_launch",
                  "stream_incarnation")


def stream_state(conn: psycopg.Connection, stream_id: int, max_events: int) -> StreamState:
    """The stream's state for :func:`~.batches.decide`; ``max_events``: ``delivery.max_events_per_run``."""
    return stream_states(conn, {stream_id: max_events})[stream_id]


def stream_states(conn: psycopg.Connection, max_events: dict[int, int]) -> dict[int, StreamState]:
    """:func:`stream_state` of each stream of ``max_events`` (stream id -> its ``max_events_per_run``)."""
    ids = list(max_events)
    states = {sid: StreamState(sid) for sid in ids}  # (a stream without a row yet: nothing to decide)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_STATE, {"ids": ids, "max_events": [max_events[i] for i in ids],
                                    "pending": BatchStatus.PENDING, "delivered": BatchStatus.DELIVERED}).fetchall()
    for row in rows:
        stream_id = int(row.pop("state_of"))
        stream = {k: row.pop(k) for k in _STREAM_FIELDS}
        incarnation = str(stream["stream_incarnation"] or "")
        # the head's run keys (RunOrder) carry the same incarnation as the stream's, the timeline's included
        head = Batch(**{**row, "incarnation": incarnation}) if row["id"] is not None else None
        states[stream_id] = StreamState(
            stream_id, head=head, paused=bool(stream["paused"]),
            failover_since=stream["failover_since"], open_run_key=stream["open_run_key"],
            next_run=tuple(stream["next_run"] or ()), last_delivered_launch=stream["last_delivered_launch"],
            incarnation=incarnation)
    return states


def batches_between(conn: psycopg.Connection, stream_id: int, first: int, last: int) -> list[Batch]:
    with conn.cursor(row_factory=dict_row) as cur:
        return [Batch(**r) for r in cur.execute(
            f"select {_BATCH_COLUMNS} {_BATCH_FROM} where b.stream_id = %s and b.id between %s and %s "
            "order by b.id", [stream_id, first, last]).fetchall()]


def launch_waiting(conn: psycopg.Connection, stream_ids: list[int]) -> bool:
    """Whether a stream of ``stream_ids`` neither paused nor in failover has a batch no run was ever given."""
    row = conn.execute(
        "select exists (select 1 from pgstream.batches b join pgstream.streams s on s.id = b.stream_id "
        "where b.stream_id = any(%s) and b.status = %s and b.attempts = 0 and not s.paused "
        "and s.failover_since is null)", [stream_ids, BatchStatus.PENDING]).fetchone()
    return bool(row and row[0])


def round_outcome(conn: psycopg.Connection, stream_id: int, batch_ids: list[int]) -> tuple[list[int], int]:
    """After a round: the batches of it not delivered (in order), and how many dead letters their events have."""
    row = conn.execute(
        "select array(select id from pgstream.batches where id = any(%(ids)s) and status <> %(delivered)s "
        "order by id), (select count(*) from pgstream.dead_letters "
        "where stream_id = %(stream)s and batch_id = any(%(ids)s))",
        {"ids": batch_ids, "delivered": BatchStatus.DELIVERED, "stream": stream_id},
        prepare=False).fetchone()  # (planned with the ids: see deadletters.dead_letter_positions)
    assert row is not None
    return [int(i) for i in row[0]], int(row[1])


def earlier_open(conn: psycopg.Connection, stream_id: int, batch_id: int) -> int | None:
    row = conn.execute("select min(id) from pgstream.batches where stream_id = %s and id < %s "
                       "and pgstream.batch_is_open(status)", [stream_id, batch_id]).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def _launched_ids(conn: psycopg.Connection, stream_id: int, run_key: str | None) -> list[int]:
    """The batches assigned to run ``run_key`` of the stream and not delivered yet, in order."""
    return [int(r[0]) for r in conn.execute(
        "select id from pgstream.batches where stream_id = %s and pgstream.batch_is_open(status) "
        "and run_key = %s and status = %s order by id", [stream_id, run_key, BatchStatus.LAUNCHED]).fetchall()]


def run_batch_ids(conn: psycopg.Connection, head: Batch) -> list[int]:
    """The batches assigned to the run of ``head`` (a launched batch), in order."""
    return _launched_ids(conn, head.stream_id, head.run_key) or [head.id]


@dataclass(frozen=True)
class Assigned:
    """What an open run sees (:func:`next_assigned`): the batches assigned to it after the one it loaded last, a
    replay waiting for the lease (it takes no more), the oldest open batch before them (it must not overtake it),
    and why the run closes (None: it stays open): the sensor hands it no more batches, the stream is paused, or
    its delivery lease is lost."""

    batches: list[Batch]
    replay_waiting: bool
    earlier_open: int | None
    close: str | None


def next_assigned(conn: psycopg.Connection, stream_id: int, run_key: str, after_batch_id: int,
                  run_id: str) -> Assigned:
    """:class:`Assigned` to run ``run_key`` (of Dagster run ``run_id``) since it loaded ``after_batch_id``, in one
    statement."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            f"""with mine as (select {_BATCH_COLUMNS} {_BATCH_FROM}
                              where b.stream_id = %(stream)s and pgstream.batch_is_open(b.status)
                                and b.run_key = %(run)s and b.id > %(after)s and b.status = %(launched)s)
                select m.*, r.replay, r.earlier, r.handed, r.paused_now, r.leased
                from (select pgstream.lock_holder(%(replay)s, %(stream)s) is not null as replay,
                             (select min(e.id) from pgstream.batches e
                              where e.stream_id = %(stream)s and e.id < (select min(f.id) from mine f)
                                and pgstream.batch_is_open(e.status)) as earlier,
                             s.open_run_key is not distinct from %(run)s as handed, s.paused as paused_now,
                             pgstream.lock_holder(%(delivery)s, %(stream)s) is not distinct from %(run_id)s
                               as leased
                      from (select 1) one left join pgstream.streams s on s.id = %(stream)s) r
                left join mine m on true
                order by m.id""",  # noqa: S608  (column lists, no input)
            {"run": run_key, "after": after_batch_id, "launched": BatchStatus.LAUNCHED, "replay": REPLAY_LOCK,
             "stream": stream_id, "delivery": DELIVERY_LOCK, "run_id": run_id}).fetchall()
    outcome = ("replay", "earlier", "handed", "paused_now", "leased")
    batches = [Batch(**{k: v for k, v in r.items() if k not in outcome}) for r in rows if r["id"] is not None]
    first = rows[0]
    close = ("the sensor hands it no more batches (failover or catch-up)" if not first["handed"]
             else "the stream is paused" if first["paused_now"]
             else None if first["leased"] else lease_lost(run_id))
    return Assigned(batches, bool(first["replay"]), first["earlier"], close)  # (earlier: a bigint, or null)


def run_is_open(conn: psycopg.Connection, stream_id: int, run_key: str) -> bool:
    row = conn.execute("select open_run_key = %s from pgstream.streams where id = %s",
                       [run_key, stream_id]).fetchone()
    return bool(row and row[0])


def lease_lost(run_id: str) -> str:
    return (f"run {run_id} no longer holds the stream's delivery lease (the session holding it ended: the server "
            f"restarted or the connection was cut); it publishes nothing more, the next run resumes after the last "
            f"confirmation recorded")


class StreamPaused(RuntimeError):
    """The stream is paused: a run publishes nothing more of it (:func:`publishing`)."""


class LeaseLost(RuntimeError):
    """The run no longer holds the stream's delivery lease: it publishes nothing more (:func:`publishing`)."""


@contextmanager
def publishing(conn: psycopg.Connection, stream_id: int, run_id: str) -> Iterator[None]:
    """A publish call of run ``run_id``, in a transaction holding the stream row ``FOR KEY SHARE`` (a pause waits
    for it): paused, :class:`StreamPaused`; its lease taken by another run, :class:`LeaseLost`."""
    with conn.transaction():
        # (the lease session's life is checked between rounds, :func:`next_assigned`; another run renames the row)
        row = conn.execute("select s.paused, exists (select 1 from pgstream.locks l where l.name = %s "
                           "and l.key = s.id and l.holder = %s and l.pid is not null), "
                           "pg_catalog.set_config('synchronous_commit', 'off', true) "
                           "from pgstream.streams s where s.id = %s for key share of s",
                           [DELIVERY_LOCK, run_id, stream_id]).fetchone()
        if row is None or row[0]:
            raise StreamPaused(f"stream {stream_id} is paused" if row else f"stream {stream_id} does not exist")
        if not row[1]:
            raise LeaseLost(f"stream {stream_id}: {lease_lost(run_id)}")
        yield


def run_channel(stream_id: int) -> str:
    """The NOTIFY channel on which an open run hears that batches were assigned to it."""
    return f"{stream_object_name(stream_id)}_runs"


def listen_runs(conn: psycopg.Connection, stream_id: int) -> None:
    conn.execute(sql.SQL("listen {}").format(sql.Identifier(run_channel(stream_id))))


# --- transitions: one function (one UPDATE) each ----------------------------------------------------

def assign(conn: psycopg.Connection, batch_ids: tuple[int, ...] | list[int], run_key: str) -> None:
    """pending or failed -> launched: the batches are the run ``run_key``'s (one more attempt each)."""
    _assign(conn, {batch_id: run_key for batch_id in batch_ids}, {})


#: pending or failed -> launched, batches of several runs (each batch's run key), the hosts of ``woken`` runs woken at
#: commit
_ASSIGN = """
with assigned as (
    update pgstream.batches b set status = %(launched)s, run_key = a.run_key, attempts = b.attempts + 1,
           launched_at = pg_catalog.now(), next_attempt_at = null
    from rows from (pg_catalog.unnest(%(ids)s::bigint[]), pg_catalog.unnest(%(keys)s::text[])) as a(id, run_key)
    where b.id = a.id)
select pg_catalog.pg_notify(w.channel, w.run_key)
from rows from (pg_catalog.unnest(%(channels)s::text[]), pg_catalog.unnest(%(woken)s::text[])) as w(channel, run_key)"""


def _assign(conn: psycopg.Connection, keys: dict[int, str], woken: dict[int, str]) -> None:
    """:func:`assign` of each batch of ``keys`` (batch id -> run key) to its run, and the host of each run of
    ``woken`` (stream id -> run key) woken at commit, in one statement."""
    conn.execute(_ASSIGN, {"launched": BatchStatus.LAUNCHED, "ids": list(keys), "keys": list(keys.values()),
                           "channels": [run_channel(sid) for sid in woken], "woken": list(woken.values())})


def open_run(conn: psycopg.Connection, stream_id: int, run_key: str) -> None:
    """The run ``run_key`` becomes the stream's open run (its host woken at commit)."""
    conn.execute("update pgstream.streams set open_run_key = %s, slot_reader = %s where id = %s",
                 [run_key, SENSOR, stream_id])
    _wake_host(conn, stream_id, run_key)


def clear_open_run(conn: psycopg.Connection, stream_id: int, run_key: str) -> None:
    """The run ``run_key`` is no longer the stream's open run (closed, failed, or gone without closing)."""
    conn.execute("update pgstream.streams set open_run_key = null, slot_reader = %s "
                 "where id = %s and open_run_key = %s", [SENSOR, stream_id, run_key])


# --- the slot's declared reader (sql/025_slot_reader.sql): 'group:<name>' once the stream joined its reader group
# (for good: a trigger turns the writers' 'sensor' into it), :data:`SENSOR` while its own slot is not handed over
SENSOR = "sensor"


def slot_reader(conn: psycopg.Connection, stream_id: int) -> str:
    """Who reads the stream's slot now."""
    row = conn.execute("select slot_reader from pgstream.streams where id = %s", [stream_id]).fetchone()
    return str(row[0]) if row and row[0] is not None else SENSOR


@dataclass(frozen=True)
class Locked:
    """A stream's row as read under its lock (:func:`lock_streams`)."""

    slot_reader: str
    open_run_key: str | None
    paused: bool


def lock_streams(conn: psycopg.Connection, stream_ids: list[int]) -> dict[int, Locked]:
    """The rows of ``stream_ids`` (only inside a transaction), each held under its lock (``no key update``, taken
    in id order) until the transaction ends: a reader records only while it is the stream's slot reader, and hands
    batches only to the open run of a stream not paused. A stream without a row: not in the result."""
    rows = conn.execute("select id, slot_reader, open_run_key, paused from pgstream.streams where id = any(%s) "
                        "order by id for no key update", [sorted(stream_ids)]).fetchall()
    return {int(sid): Locked(str(reader) if reader is not None else SENSOR, key, bool(paused))
            for sid, reader, key, paused in rows}


def release(conn: psycopg.Connection, stream_id: int, run_key: str, keep: int) -> None:
    """launched -> pending: the batches of the run ``run_key`` other than ``keep`` wait for another run."""
    conn.execute("update pgstream.batches set status = %s, run_key = null where stream_id = %s "
                 "and pgstream.batch_is_open(status) and run_key = %s and status = %s and id <> %s",
                 [BatchStatus.PENDING, stream_id, run_key, BatchStatus.LAUNCHED, keep])


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


def retry_now(conn: psycopg.Connection, stream_id: int) -> int | None:
    """The stream's failed batch is due now; its id (``None``: none). ``NoDataFound``: no such stream."""
    row = conn.execute("select pgstream.retry_now(%s)", [stream_id]).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def skip_batch(conn: psycopg.Connection, stream_id: int, batch_id: int) -> int:
    """open -> skipped (an operator gave up on it); the events it held. ``NoDataFound``: no open batch of it."""
    row = conn.execute("select pgstream.skip_batch(%s, %s)", [stream_id, batch_id]).fetchone()
    assert row is not None
    return int(row[0])


# --- runs: transitions composed ---------------------------------------------------------------------

def launch(conn: psycopg.Connection, stream_id: int, batch_ids: tuple[int, ...] | list[int], run_key: str, *,
           keep_open: bool, replaces: str | None = None) -> bool:
    """:class:`~..batches.Launch` ``batch_ids`` as run ``run_key``, under the stream row's lock: nothing is done
    (false) when the ledger moved since the decision (a batch no longer waiting, for a run kept open another open
    run than ``replaces``); the next tick decides again."""
    with conn.transaction():
        row = conn.execute("select open_run_key from pgstream.streams where id = %s for no key update",
                           [stream_id]).fetchone()
        if row is None or (keep_open and row[0] is not None and row[0] != replaces):
            return False
        (waiting,) = conn.execute(  # type: ignore[misc]  # (count(*) returns one row)
            "select count(*) from pgstream.batches where stream_id = %s and id = any(%s) and status in (%s, %s)",
            [stream_id, list(batch_ids), BatchStatus.PENDING, BatchStatus.FAILED]).fetchone()
        if waiting != len(set(batch_ids)):
            return False
        if replaces is not None:
            clear_open_run(conn, stream_id, replaces)
        assign(conn, batch_ids, run_key)
        if keep_open:
            open_run(conn, stream_id, run_key)
    return True


def extend_run(conn: psycopg.Connection, stream_id: int, run_key: str, max_events: int) -> list[int]:
    """Assign the pending batches (up to ``max_events`` undelivered) to the open run ``run_key`` and wake it, under
    the stream row's lock: a run that closed (:func:`_close_run`), or of a paused stream, is handed none."""
    return extend_runs(conn, {stream_id: (run_key, max_events)}).get(stream_id, [])


#: each stream's open batches, in order (as many as a run could be handed)
_OPEN_BATCHES = """
select p.id, o.id, o.event_count, o.status, o.run_key from pg_catalog.unnest(%s::bigint[]) as p(id)
cross join lateral (select id, event_count, status, run_key from pgstream.batches
                    where stream_id = p.id and pgstream.batch_is_open(status) order by id limit 10000) o
order by p.id, o.id"""

def extend_runs(conn: psycopg.Connection, runs: dict[int, tuple[str, int]],
                locked: dict[int, Locked] | None = None) -> dict[int, list[int]]:
    """:func:`extend_run` for each stream of ``runs`` (stream id -> its open run's key and ``max_events``), in three
    statements whatever the number of streams (two when ``locked`` holds the rows :func:`lock_streams` read in this
    transaction); per stream handed any, the batches handed."""
    with atomic(conn):
        if locked is None:
            locked = lock_streams(conn, list(runs))
        open_runs = {sid: run for sid, run in runs.items()
                     if (row := locked.get(sid)) is not None and row.open_run_key == run[0] and not row.paused}
        if not open_runs:
            return {}
        rows: dict[int, list[tuple[int, int, str, str | None]]] = {}
        for sid, batch_id, count, status, key in conn.execute(_OPEN_BATCHES, [list(open_runs)]).fetchall():
            rows.setdefault(int(sid), []).append((int(batch_id), int(count), status, key))
        handed = {sid: ids for sid, batches in rows.items() if (ids := _to_hand(batches, *open_runs[sid]))}
        if handed:
            _assign(conn, {i: open_runs[sid][0] for sid, ids in handed.items() for i in ids},
                    {sid: open_runs[sid][0] for sid in handed})
    return handed


def _to_hand(batches: list[tuple[int, int, str, str | None]], run_key: str, max_events: int) -> list[int]:
    """Of a stream's open batches (id, events, status, run key), the pending ones its open run ``run_key`` is
    handed: after the ones it holds, while its undelivered events stay within ``max_events`` (at least one)."""
    outstanding = 0
    ids: list[int] = []
    for batch_id, count, status, key in batches:
        if status == BatchStatus.LAUNCHED and key == run_key and not ids:
            outstanding += count
            continue
        if status != BatchStatus.PENDING or (outstanding and outstanding + count > max_events):
            break
        ids.append(batch_id)
        outstanding += count
    return ids


def _close_run(conn: psycopg.Connection, stream_id: int, run_key: str) -> bool:
    """The run ``run_key`` stops taking batches: true unless batches assigned to it are not delivered yet."""
    with conn.transaction():
        conn.execute("select 1 from pgstream.streams where id = %s for no key update", [stream_id])
        # a statement after the lock: sees every assignment committed before it was granted
        row = conn.execute("select exists (select 1 from pgstream.batches where stream_id = %s "
                           "and pgstream.batch_is_open(status) and run_key = %s and status = %s)",
                           [stream_id, run_key, BatchStatus.LAUNCHED]).fetchone()
        if row and row[0]:
            return False
        clear_open_run(conn, stream_id, run_key)
    return True


def give_back(conn: psycopg.Connection, stream_id: int, run_key: str) -> list[int]:
    """The run ``run_key`` ends without delivering what it holds (paused, a shutdown): its batches back to pending."""
    with conn.transaction():
        conn.execute("select 1 from pgstream.streams where id = %s for no key update", [stream_id])
        ids = _launched_ids(conn, stream_id, run_key)
        clear_open_run(conn, stream_id, run_key)
        release(conn, stream_id, run_key, keep=0)
    return ids


def fail_run(conn: psycopg.Connection, head: Batch, run_key: str, error: str, retry_at: dt.datetime) -> None:
    """:class:`~..batches.FailRun`: ``head`` (open -> failed) is retried alone at ``retry_at``, the stream enters
    failover with it as its checkpoint (or stays in it: one more attempt)."""
    with conn.transaction():
        clear_open_run(conn, head.stream_id, run_key)
        release(conn, head.stream_id, run_key, keep=head.id)
        conn.execute("update pgstream.batches set status = %s, error = %s, next_attempt_at = %s "
                     "where id = %s and pgstream.batch_is_open(status)", [BatchStatus.FAILED, error[:2000], retry_at,
                                                                          head.id])
        conn.execute("select pgstream.enter_failover(%s, %s, %s, %s)", [head.stream_id, head.id, error, retry_at])


def requeue_run(conn: psycopg.Connection, head: Batch, run_key: str, *, checkpoint: bool) -> None:
    """:class:`~..batches.Requeue` the run ``run_key`` (interrupted by a shutdown)."""
    with conn.transaction():
        clear_open_run(conn, head.stream_id, run_key)
        release(conn, head.stream_id, run_key, keep=head.id if checkpoint else 0)
        if checkpoint:
            conn.execute("update pgstream.batches set status = %s, next_attempt_at = now() "
                         "where id = %s and pgstream.batch_is_open(status)", [BatchStatus.FAILED, head.id])


def open_warm_run(conn: psycopg.Connection, stream_id: int, run_key: str) -> bool:
    """The run ``run_key`` (no batch yet) becomes the stream's open run, unless the stream has one."""
    with conn.transaction():
        row = conn.execute("update pgstream.streams set open_run_key = %s, slot_reader = %s where id = %s and "
                           "open_run_key is null returning id", [run_key, SENSOR, stream_id]).fetchone()
        if row is not None:
            _wake_host(conn, stream_id, run_key)
    return row is not None


def _wake_host(conn: psycopg.Connection, stream_id: int, run_key: str) -> None:
    """Wake what hosts the stream's open run ``run_key`` (at commit, on its run channel): batches were handed to
    it, or it was opened (the group delivery run hosts it at once, not at its next look)."""
    conn.execute("select pg_notify(%s, %s)", [run_channel(stream_id), run_key])


def apply(conn: psycopg.Connection, stream: StreamConfig, action: Action) -> RunOrder | None:
    """Carry out ``action``; the run to request, if any (reporting a dead run to Dagster is the caller's, first)."""
    match action:
        case LeaveFailover(then=then):  # the stream caught up
            conn.execute("select pgstream.leave_failover(%s)", [stream.id])
            return apply(conn, stream, then)
        case Wait():
            return None
        case Warm(run_key=key):
            open_warm_run(conn, stream.id, key)
            return None
        case Launch(order=order, keep_open=keep_open, replaces=replaces):
            launched = launch(conn, stream.id, order.batch_ids, order.run_key, keep_open=keep_open, replaces=replaces)
            return order if launched else None
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
        case Requeue(head=head, checkpoint=checkpoint):
            requeue_run(conn, head, head.run_key or "", checkpoint=checkpoint)
            return None
    assert_never(action)


def apply_run(conn: psycopg.Connection, action: RunAction) -> bool:
    """Carry out the open run's own transition ``action`` in the ledger; false when it is refused."""
    match action:
        case CloseRun(stream_id=stream_id, run_key=key):
            return _close_run(conn, stream_id, key)
    assert_never(action)
