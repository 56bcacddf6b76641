"""Resume points of ``ordering: by_key`` (sql/018_key_progress.sql), written by the Spark tasks."""

from __future__ import annotations

import psycopg

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

    def __init__(self, database_url: str, stream_id: int, partitions: int, token: str | None = None) -> None:
        self.database_url, self.stream_id, self.partitions = database_url, stream_id, partitions
        #: the round's delivery token (:func:`issue_delivery_token`): what the tasks write with, while
        #: the run it was issued to holds the stream's delivery lease
        self.token = token

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.database_url, autocommit=True, application_name="pgstream by_key task")

    def read(self, conn: psycopg.Connection) -> dict[int, Position]:
        """Per bucket: every event of it at a position up to this one is handled."""
        rows = conn.execute("select bucket, batch_id, ord from pgstream.key_progress "
                            "where stream_id = %s and partitions = %s", [self.stream_id, self.partitions]).fetchall()
        return {int(b): (int(batch), int(o)) for b, batch, o in rows}

    def record(self, conn: psycopg.Connection, buckets: list[int], batch_id: int, ord: int) -> None:
        """Every event of ``buckets`` up to ``(batch_id, ord)`` is handled (positions only move forward),
        written by the owner's ``pgstream.record_key_progress`` with the round's token: the executors
        hold no write privilege on the table (one would let them LOCK it and stall every by_key run),
        and the token names the one stream they may write for. Raises :class:`RunGone` instead when the
        run no longer holds its delivery lease (its process died): a Spark Connect server keeps running
        an abandoned query for minutes, and its tasks must not go on publishing beside the run that
        replaces it. The lease is pgstream's lock row (only pgstream's roles write it), not a
        connection's ``application_name``, which any role can give itself."""
        row = conn.execute("select pgstream.record_key_progress(%s, %s, %s, %s, %s)",
                           [self.token, self.partitions, buckets, batch_id, ord]).fetchone()
        if not (row and row[0]):
            raise RunGone(f"stream {self.stream_id}: the run of this by_key round no longer holds the delivery "
                          f"lease; this task stops (batch {batch_id} #{ord} was its last confirmed position)")

    def __repr__(self) -> str:  # never the URL
        return f"KeyProgress(stream {self.stream_id}, {self.partitions} partitions)"


def issue_delivery_token(conn: psycopg.Connection, stream_id: int, run_id: str) -> str:
    """A new delivery token of the stream for its round's Spark tasks (:class:`KeyProgress`,
    :class:`~.deadletters.DeadLetterWriter`): ``conn`` is the lease connection of run ``run_id``.
    Secret: the tasks' objects carry it, their ``repr`` never shows it."""
    row = conn.execute("select pgstream.issue_delivery_token(%s, %s)", [stream_id, run_id]).fetchone()
    assert row is not None and row[0]
    return str(row[0])


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
