"""The batch ledger (``pgstream.batches``) and the slot cursor that feeds it.

Invariants:
* a transaction read from the slot is recorded in the ledger *whole*, in one database
  transaction, before the slot is advanced past it; a crash in between re-reads it from the slot
  and the ledger's last ``end_lsn`` makes that harmless;
* a batch's ``event_ids`` are in commit order; batches of a stream are delivered in id order;
* a batch is ``delivered`` only once the sink confirmed every event.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from . import replication
from .replication import DecodedEvent, Transaction


@dataclass(frozen=True)
class Batch:
    id: int
    stream_id: int
    kind: str
    event_count: int
    first_event_id: int
    last_event_id: int
    status: str
    attempts: int
    run_key: str | None
    incarnation: str
    run_id: str | None
    error: str | None
    next_attempt_at: dt.datetime | None
    first_commit_at: dt.datetime | None
    created_at: dt.datetime


_BATCH_COLUMNS = ("b.id, b.stream_id, b.kind, b.event_count, b.first_event_id, b.last_event_id, b.status, "
                  "b.attempts, b.run_key, s.incarnation, b.run_id, b.error, b.next_attempt_at, b.first_commit_at, "
                  "b.created_at")
_BATCH_FROM = "from pgstream.batches b join pgstream.streams s on s.id = b.stream_id"


def _batch(row: dict[str, Any] | None) -> Batch | None:
    return Batch(**row) if row else None


def ensure_stream(conn: psycopg.Connection, stream_id: int) -> None:
    conn.execute("select pgstream.ensure_stream(%s)", [stream_id])


def last_end_lsn(conn: psycopg.Connection, stream_id: int) -> int | None:
    row = conn.execute("select max(end_lsn)::text from pgstream.batches where stream_id = %s", [stream_id]).fetchone()
    return replication.lsn_to_int(row[0]) if row and row[0] else None


def _chunks(events: list[DecodedEvent], size: int) -> list[list[DecodedEvent]]:
    return [events[i:i + size] for i in range(0, len(events), size)]


def record(conn: psycopg.Connection, stream_id: int, txns: list[Transaction], max_size: int,
           kind: str = "stream") -> list[int]:
    """Record the events of ``txns`` (commit order) as batches of at most ``max_size``.

    Runs in its own database transaction. Every batch carries the LSN range and commit times of
    the transactions it covers; the last batch's ``end_lsn`` is the end of the last transaction.
    """
    ids: list[int] = []
    with conn.transaction():
        pending: list[tuple[DecodedEvent, Transaction]] = [(e, t) for t in txns for e in t.events]
        for chunk in [pending[i:i + max_size] for i in range(0, len(pending), max_size)]:
            events = [e for e, _ in chunk]
            first_txn, last_txn = chunk[0][1], chunk[-1][1]
            row = conn.execute(
                """insert into pgstream.batches
                   (stream_id, kind, event_ids, event_count, first_event_id, last_event_id, min_created_at,
                    max_created_at, start_lsn, end_lsn, first_commit_at, last_commit_at)
                   values (%s, %s, %s, %s, %s, %s, %s, %s, %s::pg_lsn, %s::pg_lsn, %s, %s) returning id""",
                [stream_id, kind, [e.id for e in events], len(events), events[0].id, events[-1].id,
                 min(e.created_at for e in events), max(e.created_at for e in events),
                 replication.int_to_lsn(first_txn.commit_lsn), replication.int_to_lsn(last_txn.end_lsn),
                 first_txn.commit_time, last_txn.commit_time],
            ).fetchone()
            assert row is not None
            ids.append(int(row[0]))
    return ids


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
    committed), as ``recovery`` batches whose ``end_lsn`` is the WAL position of the snapshot."""
    with conn.transaction():
        conn.execute("set transaction isolation level repeatable read")
        (lsn,) = conn.execute("select pg_current_wal_lsn()::text").fetchone()  # type: ignore[misc]
        rows = conn.execute(
            """select e.id, e.created_at from pgstream.events e
               where e.stream_id = %s
                 and not exists (select 1 from pgstream.batches b
                                 where b.stream_id = e.stream_id and e.id = any (b.event_ids))
               order by e.id""",
            [stream_id],
        ).fetchall()
        if not rows:
            return []
        txn = Transaction(xid=0, commit_lsn=replication.lsn_to_int(lsn), end_lsn=replication.lsn_to_int(lsn),
                          commit_time=max(r[1] for r in rows),
                          events=[DecodedEvent(int(r[0]), r[1]) for r in rows])
        return record(conn, stream_id, [txn], max_size, kind="recovery")


def head(conn: psycopg.Connection, stream_id: int) -> Batch | None:
    """The oldest batch of the stream that is not delivered: the only one that may run."""
    with conn.cursor(row_factory=dict_row) as cur:
        return _batch(cur.execute(
            f"select {_BATCH_COLUMNS} {_BATCH_FROM} "
            "where b.stream_id = %s and b.status <> 'delivered' order by b.id limit 1",
            [stream_id]).fetchone())


def get(conn: psycopg.Connection, batch_id: int) -> Batch | None:
    with conn.cursor(row_factory=dict_row) as cur:
        return _batch(cur.execute(
            f"select {_BATCH_COLUMNS} {_BATCH_FROM} where b.id = %s",
            [batch_id]).fetchone())


def undelivered_count(conn: psycopg.Connection, stream_id: int) -> tuple[int, int]:
    row = conn.execute("select count(*), coalesce(sum(event_count), 0) from pgstream.batches "
                       "where stream_id = %s and status <> 'delivered'", [stream_id]).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def mark_launched(conn: psycopg.Connection, batch_id: int, run_key: str) -> None:
    conn.execute("update pgstream.batches set status = 'launched', run_key = %s, attempts = attempts + 1, "
                 "launched_at = now(), next_attempt_at = null where id = %s", [run_key, batch_id])


def mark_failed(conn: psycopg.Connection, batch_id: int, error: str, retry_at: dt.datetime) -> None:
    conn.execute("update pgstream.batches set status = 'failed', error = %s, next_attempt_at = %s "
                 "where id = %s and status <> 'delivered'", [error[:2000], retry_at, batch_id])


def mark_delivered(conn: psycopg.Connection, batch_id: int, run_id: str) -> bool:
    row = conn.execute("update pgstream.batches set status = 'delivered', delivered_at = now(), run_id = %s, "
                       "error = null where id = %s and status <> 'delivered' returning id",
                       [run_id, batch_id]).fetchone()
    return row is not None


def earlier_undelivered(conn: psycopg.Connection, batch: Batch) -> int | None:
    row = conn.execute("select min(id) from pgstream.batches where stream_id = %s and id < %s "
                       "and status <> 'delivered'", [batch.stream_id, batch.id]).fetchone()
    return int(row[0]) if row and row[0] is not None else None
