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


def last_end_lsn(conn: psycopg.Connection, stream_id: int) -> int | None:
    """The end of the last transaction read from the slot and recorded, not a recovery's (which may have missed
    one committed before its snapshot: that one's batch drops by id what recovery holds)."""
    row = conn.execute("select b.end_lsn::text from pgstream.batches b where b.stream_id = %s and b.kind = 'stream' "
                       "and b.end_lsn is not null order by b.end_lsn desc limit 1", [stream_id]).fetchone()
    return replication.lsn_to_int(row[0]) if row and row[0] else None


def record(conn: psycopg.Connection, stream_id: int, txns: list[Transaction], max_size: int,
           kind: str = "stream", standby: str | None = None, give_up: Callable[[], bool] | None = None) -> list[int]:
    """Record the events of ``txns`` (whole transactions, commit order) as batches of at most ``max_size``,
    unreadable ones as dead letters, in one transaction (before the slot is advanced) once visible."""
    ids: list[int] = []
    events = [e for t in txns for e in t.events]
    wait_until_visible(conn, [t.xid for t in txns], standby, give_up)
    txn_at = [t for t in txns for _e in t.events]  # the transaction of each position
    with atomic(conn):
        for start in range(0, len(events), max_size):
            chunk = events[start:start + max_size]
            first_txn, last_txn = txn_at[start], txn_at[start + len(chunk) - 1]
            created = [e.created_at for e in chunk]
            row = conn.execute(
                """insert into pgstream.batches
                   (stream_id, kind, event_ids, event_count, first_event_id, last_event_id, min_created_at,
                    max_created_at, start_lsn, end_lsn, first_commit_at, last_commit_at)
                   values (%s, %s, %s::bigint[], %s, %s, %s, %s, %s, %s::pg_lsn, %s::pg_lsn, %s, %s) returning id""",
                # an array literal: psycopg dumps a list element by element (6 ms per 10,000 ids, this 0.8)
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


def recovered_ids_since(conn: psycopg.Connection, stream_id: int, lsn: int) -> set[int]:
    """Event ids of recovery batches whose snapshot reaches past ``lsn`` (a slot transaction before it may be in)."""
    rows = conn.execute(
        "select unnest(event_ids) from pgstream.batches where stream_id = %s and kind = 'recovery' "
        "and end_lsn >= %s::pg_lsn",
        [stream_id, replication.int_to_lsn(lsn)],
    ).fetchall()
    return {int(r[0]) for r in rows}


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
