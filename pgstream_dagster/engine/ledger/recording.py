"""Recording what was read from a slot: batches, unreadable events as dead letters, recovery from the table."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg

from .. import replication
from ..replication import DecodedEvent, Transaction


@contextmanager
def atomic(conn: psycopg.Connection) -> Iterator[None]:
    """``conn.transaction()``, or nothing in one already (a savepoint would add two round trips a recording)."""
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
        yield
        return
    with conn.transaction():
        yield


#: per stream of ``ids``: the end of its last batch read from the slot (a lookup of one index page each)
_LAST_END = """
select p.id, l.end_lsn::text from pg_catalog.unnest(%s::bigint[]) as p(id)
cross join lateral (select b.end_lsn from pgstream.batches b
                    where b.stream_id = p.id and b.kind = 'stream' and b.end_lsn is not null
                    order by b.end_lsn desc limit 1) l"""


def last_end_lsns(conn: psycopg.Connection, stream_ids: list[int]) -> dict[int, int]:
    """Per stream (none: nothing recorded yet), the end of the last transaction read from the slot and recorded,
    not a recovery's (which may have missed one committed before its snapshot: that one's batch drops by id what
    recovery holds)."""
    rows = conn.execute(_LAST_END, [stream_ids]).fetchall()
    return {int(sid): replication.lsn_to_int(lsn) for sid, lsn in rows if lsn}


#: what :data:`_INSERT` takes of each row of its arrays
_BATCH_ROWS = ("r.stream_id, r.event_ids::bigint[], r.event_count, r.first_id, r.last_id, r.min_created, "
               "r.max_created, r.start_lsn::pg_lsn, r.end_lsn::pg_lsn, r.first_commit, r.last_commit")
_INSERT = f"""
insert into pgstream.batches
    (stream_id, event_ids, event_count, first_event_id, last_event_id, min_created_at, max_created_at,
     start_lsn, end_lsn, first_commit_at, last_commit_at, kind)
select {_BATCH_ROWS}, %s from rows from (
    pg_catalog.unnest(%s::bigint[]), pg_catalog.unnest(%s::text[]), pg_catalog.unnest(%s::int[]),
    pg_catalog.unnest(%s::bigint[]), pg_catalog.unnest(%s::bigint[]), pg_catalog.unnest(%s::timestamptz[]),
    pg_catalog.unnest(%s::timestamptz[]), pg_catalog.unnest(%s::text[]), pg_catalog.unnest(%s::text[]),
    pg_catalog.unnest(%s::timestamptz[]), pg_catalog.unnest(%s::timestamptz[])) with ordinality
  as r(stream_id, event_ids, event_count, first_id, last_id, min_created, max_created, start_lsn, end_lsn,
       first_commit, last_commit, n)
order by r.n
returning id, stream_id"""  # noqa: S608  (a column list, no input)


def record(conn: psycopg.Connection, stream_id: int, txns: list[Transaction], max_size: int,
           kind: str = "stream", standby: str | None = None, give_up: Callable[[], bool] | None = None) -> list[int]:
    """Record the events of ``txns`` (whole transactions, commit order) as batches of at most ``max_size``,
    unreadable ones as dead letters, in one transaction (before the slot is advanced) once visible."""
    return record_streams(conn, {stream_id: txns}, {stream_id: max_size}, kind, standby, give_up)[stream_id]


def record_streams(conn: psycopg.Connection, txns: dict[int, list[Transaction]], max_size: dict[int, int],
                   kind: str = "stream", standby: str | None = None,
                   give_up: Callable[[], bool] | None = None) -> dict[int, list[int]]:
    """:func:`record` for each stream of ``txns`` (stream id -> its transactions; ``max_size``: its batches'
    size), in one statement whatever the number of streams; per stream, its batches' ids in order."""
    columns: list[list[object]] = [[] for _ in range(11)]
    wait_until_visible(conn, [t.xid for txs in txns.values() for t in txs], standby, give_up)
    for stream_id, txs in txns.items():
        events = [e for t in txs for e in t.events]
        txn_at = [t for t in txs for _e in t.events]  # the transaction of each position
        size = max_size[stream_id]
        for start in range(0, len(events), size):
            chunk = events[start:start + size]
            first_txn, last_txn = txn_at[start], txn_at[start + len(chunk) - 1]
            created = [e.created_at for e in chunk]
            # the event ids as an array literal: psycopg dumps a list element by element (6 ms per 10,000 ids,
            # this 0.8)
            for column, value in zip(columns, [
                    stream_id, "{" + ",".join([str(e.id) for e in chunk]) + "}", len(chunk), chunk[0].id,
                    chunk[-1].id, min(created), max(created), replication.int_to_lsn(first_txn.commit_lsn),
                    replication.int_to_lsn(last_txn.end_lsn), first_txn.commit_time, last_txn.commit_time],
                    strict=True):
                column.append(value)
    ids: dict[int, list[int]] = {stream_id: [] for stream_id in txns}
    with atomic(conn):
        if columns[0]:
            # the ids come in the order of the rows (a stream's batches in order): the identity is taken above
            # the ordered select
            for batch_id, stream_id in sorted(conn.execute(_INSERT, [kind, *columns]).fetchall()):
                ids[int(stream_id)].append(int(batch_id))
        for stream_id, txs in txns.items():
            record_unreadable(conn, stream_id, txs)
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
    """Return once every transaction of ``xids`` (decoded, so committed) is visible to the snapshots ``conn``
    takes from now on: decoding hands a transaction out a moment before its backend leaves the proc array
    (longer with synchronous replication), and a read of its events then would miss rows. ``standby``: the
    replication connection that decoded them (a synchronous standby would wait for the writers while they wait
    for it: :class:`ReaderIsSynchronousStandby`); ``give_up`` true: :class:`NotVisibleYet`."""
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
    """Dead letters (stage 'read') for the unreadable events of ``txns``, idempotent; the rows added."""
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


def recovered_ids_since(conn: psycopg.Connection, since: dict[int, int]) -> dict[int, set[int]]:
    """Per stream of ``since`` (stream id -> a position), the event ids of its recovery batches whose snapshot
    reaches past the position (a slot transaction before it may be in); none: not in the result."""
    rows = conn.execute(
        # (pg_lsn[], not text: a cast in the condition would leave the index's end_lsn out of it)
        "select p.id, r.event_id from rows from (pg_catalog.unnest(%s::bigint[]), pg_catalog.unnest(%s::pg_lsn[])) "
        "as p(id, lsn) cross join lateral (select pg_catalog.unnest(b.event_ids) as event_id from pgstream.batches b "
        "where b.stream_id = p.id and b.kind = 'recovery' and b.end_lsn >= p.lsn) r",
        [list(since), [replication.int_to_lsn(lsn) for lsn in since.values()]]).fetchall()
    seen: dict[int, set[int]] = {}
    for stream_id, event_id in rows:
        seen.setdefault(int(stream_id), set()).add(int(event_id))
    return seen


RECOVERY_ATTEMPTS = 5


def recover_from_table(conn: psycopg.Connection, stream_id: int, max_size: int) -> list[int]:
    """Record every event of the stream no batch covers (after its ``ledger_horizon``) as ``recovery`` batches ending
    at the snapshot's WAL position, clearing ``streams.recovery_pending`` in the same transaction; taken again
    when the stream's row changed under it (a serialization failure), up to :data:`RECOVERY_ATTEMPTS` times."""
    for attempt in range(1, RECOVERY_ATTEMPTS):
        try:
            return _recover_from_table(conn, stream_id, max_size)
        except psycopg.errors.SerializationFailure:
            time.sleep(0.05 * attempt)
    return _recover_from_table(conn, stream_id, max_size)


def _recover_from_table(conn: psycopg.Connection, stream_id: int, max_size: int) -> list[int]:
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
            if (parsed := replication.parse_timestamp(created)) is None:
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
