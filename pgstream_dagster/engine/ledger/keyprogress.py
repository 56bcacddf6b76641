"""Resume points of ``ordering: by_key`` (sql/018_key_progress.sql), written by the Spark tasks."""

from __future__ import annotations

import psycopg

from .. import dbconn

Position = tuple[int, int]


class RunGone(RuntimeError):
    """A ``by_key`` task's run no longer holds the stream's delivery lease: the task stops."""


class KeyProgress:
    """Where each partition of a ``by_key`` round got to: per bucket (``pmod(hash(routing_key), partitions)``) the
    position through which every event is handled, written by the tasks after each confirmed chunk (a failed task's
    result reaches no driver) and read back by a retry: each task's chunk in flight is sent twice at most. Picklable."""

    def __init__(self, database_url: str, stream_id: int, partitions: int, token: str | None = None) -> None:
        self.database_url, self.stream_id, self.partitions = database_url, stream_id, partitions
        self.token = token  # the round's (issue_delivery_token): valid while its run holds the lease

    def connect(self) -> psycopg.Connection:
        return dbconn.connect(self.database_url, autocommit=True, application_name="pgstream by_key task")

    def read(self, conn: psycopg.Connection) -> dict[int, Position]:  # per bucket
        rows = conn.execute("select bucket, batch_id, ord from pgstream.key_progress "
                            "where stream_id = %s and partitions = %s", [self.stream_id, self.partitions]).fetchall()
        return {int(b): (int(batch), int(o)) for b, batch, o in rows}

    def record(self, conn: psycopg.Connection, buckets: list[int], batch_id: int, ord: int) -> None:
        """Every event of ``buckets`` up to ``(batch_id, ord)`` is handled; :class:`RunGone` once the lease is lost."""
        row = conn.execute("select pgstream.record_key_progress(%s, %s, %s, %s, %s)",
                           [self.token, self.partitions, buckets, batch_id, ord]).fetchone()
        if not (row and row[0]):
            raise RunGone(f"stream {self.stream_id}: the run of this by_key round no longer holds the delivery "
                          f"lease; this task stops (batch {batch_id} #{ord} was its last confirmed position)")

    def __repr__(self) -> str:  # never the URL
        return f"KeyProgress(stream {self.stream_id}, {self.partitions} partitions)"


def issue_delivery_token(conn: psycopg.Connection, stream_id: int, run_id: str) -> str:
    """A round's delivery token, on run ``run_id``'s lease connection. Secret: never in a task object's ``repr``."""
    row = conn.execute("select pgstream.issue_delivery_token(%s, %s)", [stream_id, run_id]).fetchone()
    assert row is not None and row[0]
    return str(row[0])


def key_progress_partitions(conn: psycopg.Connection, stream_id: int, first_batch_id: int) -> int | None:
    """The partition count of an interrupted ``by_key`` attempt at the batches from ``first_batch_id`` on."""
    row = conn.execute("select partitions from pgstream.key_progress where stream_id = %s and batch_id >= %s "
                       "order by updated_at desc limit 1", [stream_id, first_batch_id]).fetchone()
    return int(row[0]) if row else None


def clear_key_progress(conn: psycopg.Connection, stream_id: int, *, through_batch_id: int | None = None,
                       keep_partitions: int | None = None) -> None:
    """Forget the stream's resume points in batches up to ``through_batch_id`` or, with ``keep_partitions``,
    of any other partition count. One past the round stays (a failover probe delivers its batch alone)."""
    if through_batch_id is not None:
        conn.execute("delete from pgstream.key_progress where stream_id = %s and batch_id <= %s",
                     [stream_id, through_batch_id])
    if keep_partitions is not None:
        conn.execute("delete from pgstream.key_progress where stream_id = %s and partitions <> %s",
                     [stream_id, keep_partitions])
