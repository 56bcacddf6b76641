"""Backfills: a table's rows become ``READ`` events of a subscription, delivered like every other event. The SQL
(``sql/repeatable/10_backfills.sql``) splits the key range into partitions; a chunk reads rows ``FOR SHARE``,
writes their events through a function of ``pgstream_writer`` existing only in that transaction and moves the
partition's cursor with them: a resumed backfill reads no row twice (row-level security refused). A run (its
partitions in parallel on Spark) holds the backfill's session lock and a fresh owner token: no overlap.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row

from . import dbconn

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

#: key values of ``from`` / ``to``: one per primary key column
KeyValue = str | int | float
#: errors a chunk retries (after rolling back): deadlocks with writers, lock timeouts, lost connections
_TRANSIENT = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure,
              psycopg.errors.LockNotAvailable, psycopg.OperationalError)
#: how long a chunk waits for a row lock held by a writer before it retries
LOCK_TIMEOUT = "10s"
CHUNK_ATTEMPTS = 8
DEFAULT_CHUNK_SIZE = 1000
DEFAULT_PARALLELISM = 4
#: the default throttle: well under what a stream delivers, so live events keep flowing
DEFAULT_MAX_ROWS_PER_SEC = 5000.0
#: a backfill waits while the stream has more undelivered events: a live event never queues behind more READ ones
DEFAULT_MAX_BACKLOG = 20_000
#: how often a backfill waiting for the stream's backlog looks again
BACKLOG_WAIT_SECS = 0.5
#: how long a partition's task works in a round (one Spark job) before it gives its Spark task slot back
ROUND_SECS = 60.0
#: the round of a throttled backfill (its tasks mostly sleep: a shared Spark gets its slots back often)
THROTTLED_ROUND_SECS = 5.0
#: a throttled partition's chunk holds at most this many seconds of its share of the rate
PACED_CHUNK_SECS = 0.25
#: the statuses of an unfinished backfill (as backfills_one_unfinished in sql/017_backfills.sql)
UNFINISHED = ("running", "stopped", "failed")


class BackfillError(ValueError):
    """A backfill that cannot start or go on; the message says what and where, nothing changed."""


class BackfillBusy(BackfillError):
    """The backfill is running in another process."""


@dataclass(frozen=True)
class Target:
    """What one backfill reads: a subscription key's rows of one table."""

    stream_id: int
    key: str
    schema_name: str
    table_name: str
    operation: str  # of the subscription whose definition builds the events (INSERT, else UPDATE)

    def describe(self) -> str:
        return f'subscription "{self.key}" ({self.operation}) on {self.schema_name}.{self.table_name}'


@dataclass(frozen=True)
class Request:
    """A launch: what to backfill and how (the job's config, the CLI's arguments)."""

    stream_id: int
    keys: Sequence[str]
    table: str | None = None  # "schema.table": only that table of the keys
    where: str | None = None
    from_key: Sequence[KeyValue] | None = None
    to_key: Sequence[KeyValue] | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    parallelism: int = DEFAULT_PARALLELISM
    max_rows_per_sec: float | None = None
    max_backlog: int | None = DEFAULT_MAX_BACKLOG
    restart: bool = False

    def __post_init__(self) -> None:
        if not self.keys:
            raise BackfillError("backfill: name at least one subscription key")
        if not 1 <= self.chunk_size <= 100_000:
            raise BackfillError(f"backfill: chunk_size must be between 1 and 100000, got {self.chunk_size}")
        if not 1 <= self.parallelism <= 1024:
            raise BackfillError(f"backfill: parallelism must be between 1 and 1024, got {self.parallelism}")
        if self.max_rows_per_sec is not None and not self.max_rows_per_sec > 0:
            raise BackfillError(f"backfill: max_rows_per_sec must be positive, got {self.max_rows_per_sec}")
        if self.max_backlog is not None and self.max_backlog < 1:
            raise BackfillError(f"backfill: max_backlog must be positive, got {self.max_backlog}")
        if self.table is not None and self.table.count(".") != 1:
            raise BackfillError(f"backfill: table must be schema.table, got {self.table!r}")


@dataclass
class Progress:
    """A backfill's progress, as ``pgstream.backfill_progress`` has it, plus rates of this run."""

    id: int
    target: Target
    status: str
    rows_total: int
    rows_read: int
    events_written: int
    partitions: int
    partitions_done: int
    error: str | None = None
    rows_per_sec: float = 0.0
    eta_secs: float | None = None

    def line(self) -> str:
        pct = f" ({100 * self.rows_read // self.rows_total}%)" if self.rows_total else ""
        eta = f", ETA {self.eta_secs:.0f}s" if self.eta_secs is not None else ""
        return (f"backfill {self.id} of {self.target.describe()}: {self.status}, "
                f"{self.rows_read}/{self.rows_total} rows{pct}, {self.events_written} events, "
                f"{self.partitions_done}/{self.partitions} partitions done, "
                f"{self.rows_per_sec:.0f} rows/s{eta}" + (f"; {self.error}" if self.error else ""))


@dataclass(frozen=True)
class Pace:
    """One partition task's budget in a round (``max_secs``, then ``more``: its Spark slot given back), within
    which it keeps ``rows_per_sec`` and waits while the stream has ``max_backlog`` waiting."""

    max_secs: float
    rows_per_sec: float | None = None
    max_backlog: int | None = None
    stream_id: int = 0


@dataclass
class PartitionResult:
    """What one partition's task did in this run."""

    part: int
    status: str  # done, stopped, changed, gone, failed
    rows: int = 0
    events: int = 0
    chunks: int = 0
    error: str | None = None


@dataclass
class Outcome:
    """How a run of one backfill ended."""

    progress: Progress
    results: list[PartitionResult] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.progress.status == "done"


# --- choosing and opening --------------------------------------------------------------------

def targets(conn: psycopg.Connection, request: Request) -> list[Target]:
    """The (key, table) pairs the request names, each read through its INSERT subscription, else its
    UPDATE one. Raises naming a key that has none on the stream (or on ``request.table``)."""
    schema, _, table = (request.table or "").partition(".")
    found: list[Target] = []
    for key in request.keys:
        rows = conn.execute(
            "select distinct on (schema_name, table_name) schema_name, table_name, operation::text "
            "from pgstream.subscriptions where stream_id = %s and key = %s and operation <> 'DELETE' "
            "and (%s = '' or (schema_name = %s and table_name = %s)) "
            "order by schema_name, table_name, operation", (request.stream_id, key, schema, schema, table)).fetchall()
        if not rows:
            where = f" on {request.table}" if request.table else ""
            raise BackfillError(f"backfill: stream {request.stream_id} has no INSERT or UPDATE subscription "
                                f'"{key}"{where} (a backfill writes READ events for a subscription that takes '
                                "new rows)")
        found += [Target(request.stream_id, key, s, t, op) for s, t, op in rows]
    return found


def _key_json(values: Sequence[KeyValue] | None) -> str | None:
    return None if values is None else json.dumps(list(values))


def open_backfill(conn: psycopg.Connection, target: Target, request: Request) -> tuple[int, bool]:
    """The backfill of ``target`` to run, ``(id, resumed)``: its unfinished one (same filter and range, unless
    ``restart`` cancels it) or a new one; :class:`BackfillError` (nothing changed) when the database refuses it."""
    where = (request.where or "").strip() or None
    with conn.transaction():
        current = conn.cursor(row_factory=dict_row).execute(
            "select id, status, filter, from_key, to_key, run_id from pgstream.backfills "
            "where stream_id = %s and subscription_key = %s and schema_name = %s and table_name = %s "
            "and status = any(%s)",
            (target.stream_id, target.key, target.schema_name, target.table_name, list(UNFINISHED))).fetchone()
        if current is not None:
            same = (current["filter"] == where and current["from_key"] == _maybe_list(request.from_key)
                    and current["to_key"] == _maybe_list(request.to_key))
            if not request.restart:
                if not same:
                    raise BackfillError(
                        f"backfill {current['id']} of {target.describe()} is unfinished ({current['status']}) with "
                        f"where {current['filter']!r}, from {current['from_key']}, to {current['to_key']}: launch it "
                        "with the same where/from/to to resume it, or with restart to cancel it and start over")
                return int(current["id"]), True
            if not lock(conn, int(current["id"])):
                raise BackfillBusy(f"backfill {current['id']} of {target.describe()} is running (run "
                                   f"{current['run_id']}): stop it before restarting")
            stop(conn, int(current["id"]), cancel=True)
            unlock(conn, int(current["id"]))
        try:
            row = conn.execute("select pgstream.backfill_start(%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s)",
                               (target.stream_id, target.key, target.schema_name, target.table_name, where,
                                _key_json(request.from_key), _key_json(request.to_key),
                                request.parallelism)).fetchone()
        except (psycopg.errors.RaiseException, psycopg.errors.InvalidParameterValue, psycopg.errors.NoDataFound,
                psycopg.errors.FeatureNotSupported, psycopg.errors.UndefinedTable,
                psycopg.errors.UniqueViolation) as exc:
            raise BackfillError(dbconn.first_line(exc)) from None
    assert row is not None
    return int(row[0]), False


def _maybe_list(values: Sequence[KeyValue] | None) -> list[KeyValue] | None:
    return None if values is None else list(values)


def lock(conn: psycopg.Connection, backfill_id: int) -> bool:
    row = conn.execute("select pgstream.backfill_try_lock(%s)", (backfill_id,)).fetchone()
    return bool(row and row[0])


def unlock(conn: psycopg.Connection, backfill_id: int) -> None:
    conn.execute("select pgstream.backfill_unlock(%s)", (backfill_id,))


def stop(conn: psycopg.Connection, backfill_id: int, *, cancel: bool) -> str:
    """Stop (resumable) or cancel (final) a backfill, whoever runs it: its chunks in flight commit,
    the next ones stop. Returns its status before."""
    try:
        row = conn.execute("select pgstream.backfill_stop(%s, %s)", (backfill_id, cancel)).fetchone()
    except psycopg.errors.NoDataFound as exc:
        raise BackfillError(dbconn.first_line(exc)) from None
    assert row is not None
    return str(row[0])


# --- progress --------------------------------------------------------------------------------

def list_backfills(conn: psycopg.Connection, stream_id: int | None = None, *,
                   backfill_id: int | None = None) -> list[Progress]:
    """Backfills (of a stream, or one), newest first."""
    rows = conn.cursor(row_factory=dict_row).execute(
        "select * from pgstream.backfill_progress where (%s::bigint is null or stream_id = %s) "
        "and (%s::bigint is null or id = %s) order by id desc", (stream_id, stream_id, backfill_id, backfill_id))
    return [Progress(int(r["id"]), Target(int(r["stream_id"]), r["subscription_key"], r["schema_name"],
                                          r["table_name"], str(r["operation"])),
                     r["status"], int(r["rows_total"] or 0), int(r["rows_read"]), int(r["events_written"]),
                     int(r["partitions"]), int(r["partitions_done"]), r["error"])
            for r in rows]


def progress(conn: psycopg.Connection, backfill_id: int) -> Progress:
    found = list_backfills(conn, backfill_id=backfill_id)
    if not found:
        raise BackfillError(f"backfill {backfill_id} does not exist")
    return found[0]


# --- one partition (on a Spark executor: psycopg only) ---------------------------------------

def _chunk(conn: psycopg.Connection, backfill_id: int, part: int, token: str, limit: int) -> tuple[str, int, int]:
    with conn.transaction():
        row = conn.execute("select * from pgstream.backfill_chunk(%s, %s, %s::uuid, %s)",
                           (backfill_id, part, token, limit)).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), int(row[2])


def _connect(url: str) -> psycopg.Connection:
    conn = dbconn.connect(url, autocommit=True, application_name="pgstream-dagster backfill")
    conn.execute(f"set lock_timeout = '{LOCK_TIMEOUT}'")
    return conn


def _backlog(conn: psycopg.Connection, stream_id: int) -> int:
    row = conn.execute("select pgstream.backfill_backlog(%s)", (stream_id,)).fetchone()
    return int(row[0]) if row else 0


def _owned(conn: psycopg.Connection, backfill_id: int, token: str) -> bool:
    row = conn.execute("select status = 'running' and owner_token = %s::uuid from pgstream.backfills where id = %s",
                       (token, backfill_id)).fetchone()
    return bool(row and row[0])


def run_partition(url: str, backfill_id: int, part: int, token: str, chunk_size: int, pace: Pace,
                  sleep: Callable[[float], None] = time.sleep) -> PartitionResult:
    """Read partition ``part`` chunk by chunk until done, stopped or out of budget (``more``), retrying transient
    errors; a row that cannot become an event fails the partition, naming its key (the rows before it written)."""
    result = PartitionResult(part, "stopped")
    started = time.monotonic()
    conn = _connect(url)
    try:
        limit = max(1, min(chunk_size, int(pace.rows_per_sec * PACED_CHUNK_SECS))) if pace.rows_per_sec else chunk_size
        while True:
            if pace.max_backlog and not _backlog_below(conn, pace, started, sleep):
                result.status = "more"  # the round's time went by waiting
                return result
            for attempt in range(CHUNK_ATTEMPTS):
                try:
                    if conn.broken:
                        conn = _connect(url)
                    status, rows, events = _chunk(conn, backfill_id, part, token, limit)
                    break
                except _TRANSIENT as exc:
                    if attempt == CHUNK_ATTEMPTS - 1:
                        result.status = "failed"
                        result.error = f"gave up after {CHUNK_ATTEMPTS} attempts: {dbconn.first_line(exc)}"
                        return result
                    sleep(min(0.2 * 2 ** attempt, 5.0))
                except psycopg.Error as exc:
                    if limit == 1:  # this row cannot become an event
                        key = _next_key(conn, backfill_id, part)
                        result.status = "failed"
                        error = dbconn.first_line(exc)
                        result.error = f"row with key {key}: {error}" if key else error
                        return result
                    # find the row: the ones before it are written one at a time (exactly once)
                    limit, status, rows, events = 1, "read", 0, 0
                    break
            result.rows += rows
            result.events += events
            result.chunks += 1 if rows else 0
            if status != "read":
                result.status = status
                return result
            if pace.rows_per_sec:  # keep the rate: the next chunk when this one's share of time is over
                due = min(started + result.rows / pace.rows_per_sec, started + pace.max_secs)
                while (left := due - time.monotonic()) > 0:
                    sleep(min(left, 0.5))
            if time.monotonic() - started >= pace.max_secs:
                result.status = "more"
                return result
    finally:
        conn.close()


def _backlog_below(conn: psycopg.Connection, pace: Pace, started: float, sleep: Callable[[float], None]) -> bool:
    """Until the stream has at most ``pace.max_backlog`` undelivered events; False if the round's
    time is over first. A lost connection ends the wait: the chunk reconnects and retries."""
    with contextlib.suppress(*_TRANSIENT):
        while _backlog(conn, pace.stream_id) > (pace.max_backlog or 0):
            if time.monotonic() - started >= pace.max_secs:
                return False
            sleep(BACKLOG_WAIT_SECS)
    return True


def _next_key(conn: psycopg.Connection, backfill_id: int, part: int) -> str | None:
    try:
        row = conn.execute("select pgstream.backfill_next_key(%s, %s)::text", (backfill_id, part)).fetchone()
    except psycopg.Error:
        return None
    return row[0] if row else None


RESULT_SCHEMA = "part int, status string, rows long, events long, chunks long, error string"


def run_on_spark(spark: SparkSession, url: str, backfill_id: int, token: str, parts: Sequence[int], chunk_size: int,
                 pace: Pace) -> list[PartitionResult]:
    """Read ``parts`` in parallel, one Spark task each calling ``pgstream.backfill_chunk`` (only its
    :class:`PartitionResult` comes back): an RDD job on a classic session, ``spark.range(n).mapInArrow`` on Connect,
    each task reading the partitions whose indexes in ``parts`` it gets."""
    from .spark import executor_python_errors, ship_package
    from .spark_source import arrow_schema, is_classic

    parts = list(parts)

    def task(indexes: Iterable[int]) -> Iterator[dict[str, Any]]:
        for index in indexes:
            yield asdict(run_partition(url, backfill_id, parts[index], token, chunk_size, pace))

    def arrow_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        for batch in batches:
            for done in task(batch.column("id").to_pylist()):
                yield pa.RecordBatch.from_pylist([done], schema=arrow_schema(RESULT_SCHEMA))

    ship_package(spark)
    with executor_python_errors(spark):
        if is_classic(spark):
            rows: list[dict[str, Any]] = (spark.sparkContext.parallelize(range(len(parts)), len(parts))
                                          .mapPartitions(task).collect())
            return [PartitionResult(**r) for r in rows]
        frame = spark.range(0, len(parts), 1, len(parts)).mapInArrow(arrow_task, RESULT_SCHEMA)
        return [PartitionResult(**r.asDict()) for r in frame.collect()]


def cancel_spark(spark: SparkSession) -> None:
    with contextlib.suppress(Exception):  # best effort: the tasks stop at their next chunk anyway
        if hasattr(spark, "interruptAll") and not hasattr(spark, "sparkContext"):
            spark.interruptAll()
        else:
            spark.sparkContext.cancelAllJobs()


# --- a run -----------------------------------------------------------------------------------

Executor = Callable[[int, str, Sequence[int], int, Pace], list[PartitionResult]]
"""Runs partitions: ``(backfill_id, token, parts, chunk_size, pace of each partition)``."""


def spark_executor(spark: SparkSession, url: str) -> Executor:
    return functools.partial(run_on_spark, spark, url)


def run(url: str, backfill_id: int, request: Request, execute: Executor, *, run_id: str,
        progress_secs: float = 5.0, on_stop: Callable[[], None] | None = None
        ) -> Generator[Progress | Outcome, None, None]:
    """Run backfill ``backfill_id`` to its end here: take its lock (else :class:`BackfillBusy`), claim it and
    read its unfinished partitions in parallel through ``execute``, in rounds of :data:`ROUND_SECS`
    (:data:`THROTTLED_ROUND_SECS`), each task keeping its share of ``max_rows_per_sec`` and the
    ``max_backlog`` bound. Yields :class:`Progress` every ``progress_secs``, then the :class:`Outcome`; a bad
    row fails its partition only. Closed or interrupted, it stops the backfill (resumable) and runs ``on_stop``."""
    token = str(uuid.uuid4())
    session = dbconn.connect(url, autocommit=True, application_name="pgstream-dagster backfill")
    finished = False
    try:
        if not lock(session, backfill_id):
            current = progress(session, backfill_id)
            raise BackfillBusy(f"backfill {backfill_id} of {current.target.describe()} is running in another process "
                               f"({current.status}); stop it first (pgstream-dagster backfill stop {backfill_id})")
        _claim(session, backfill_id, token, run_id)
        reporter = _Reporter(session, backfill_id, progress_secs)
        results: dict[int, PartitionResult] = {}
        while True:
            ended = {p for p, r in results.items() if r.status in ("failed", "gone")}
            parts = [int(r[0]) for r in session.execute(
                "select part from pgstream.backfill_partitions where backfill_id = %s and not done order by part",
                (backfill_id,)).fetchall() if int(r[0]) not in ended]
            if not parts or not _owned(session, backfill_id, token):
                break
            if not (yield from _wait_for_backlog(session, request, backfill_id, token, reporter)):
                break
            # each task keeps its share of the rate and the backlog bound itself, chunk by chunk
            pace = Pace(THROTTLED_ROUND_SECS if request.max_rows_per_sec else ROUND_SECS,
                        rows_per_sec=request.max_rows_per_sec / len(parts) if request.max_rows_per_sec else None,
                        max_backlog=request.max_backlog, stream_id=request.stream_id)
            done = yield from _execute(backfill_id, token, parts, request.chunk_size, pace, execute, reporter)
            for r in done:  # its last status and error, its counts summed over the rounds
                before = results.get(r.part)
                results[r.part] = r if before is None else replace(
                    r, rows=before.rows + r.rows, events=before.events + r.events, chunks=before.chunks + r.chunks)
            statuses = {r.status for r in done}
            if "stopped" in statuses or "gone" in statuses:
                break
            if "changed" in statuses:
                _claim(session, backfill_id, token, run_id)  # the subscription changed: checked again
        outcome = [replace(r, status="stopped") if r.status == "more" else r for r in results.values()]
        failed = [r for r in outcome if r.status in ("failed", "gone")]
        error = "; ".join(f"partition {r.part}: {r.error or 'its subscription was deleted'}" for r in failed) or None
        session.execute("select pgstream.backfill_release(%s, %s::uuid, %s, %s)",
                        (backfill_id, token, "failed" if failed else "stopped", error))
        finished = True
        yield Outcome(reporter.now(), sorted(outcome, key=lambda r: r.part))
    finally:
        if not finished and not session.closed:
            try:
                session.execute("select pgstream.backfill_release(%s, %s::uuid, 'stopped', %s)",
                                (backfill_id, token, "stopped before the end (run cancelled or interrupted)"))
            finally:
                if on_stop is not None:
                    on_stop()
        session.close()


def _claim(session: psycopg.Connection, backfill_id: int, token: str, run_id: str) -> None:
    try:
        session.execute("select pgstream.backfill_claim(%s, %s::uuid, %s)", (backfill_id, token, run_id))
    except (psycopg.errors.NoDataFound, psycopg.errors.ObjectNotInPrerequisiteState,
            psycopg.errors.RaiseException, psycopg.errors.InvalidParameterValue) as exc:
        raise BackfillError(dbconn.first_line(exc)) from None


class _Reporter:
    """A run's progress: rows/s since the run started, ETA; :meth:`due` every ``every`` seconds."""

    def __init__(self, session: psycopg.Connection, backfill_id: int, every: float) -> None:
        self.session, self.backfill_id, self.every = session, backfill_id, every
        self.started = time.monotonic()
        self.first = progress(session, backfill_id)
        self.next = self.started + every

    def now(self) -> Progress:
        now = progress(self.session, self.backfill_id)
        now.rows_per_sec = (now.rows_read - self.first.rows_read) / max(time.monotonic() - self.started, 1e-6)
        if now.rows_per_sec > 0 and now.rows_total > now.rows_read:
            now.eta_secs = (now.rows_total - now.rows_read) / now.rows_per_sec
        return now

    def due(self) -> Iterator[Progress]:
        if time.monotonic() >= self.next:
            self.next = time.monotonic() + self.every
            yield self.now()


def _wait_for_backlog(session: psycopg.Connection, request: Request, backfill_id: int, token: str,
                      reporter: _Reporter) -> Generator[Progress, None, bool]:
    """Until the stream has at most ``max_backlog`` undelivered events; False if the backfill was stopped meanwhile."""
    while request.max_backlog and _backlog(session, request.stream_id) > request.max_backlog:
        if not _owned(session, backfill_id, token):
            return False
        time.sleep(BACKLOG_WAIT_SECS)
        yield from reporter.due()
    return True


def _execute(backfill_id: int, token: str, parts: Sequence[int], chunk_size: int, pace: Pace, execute: Executor,
             reporter: _Reporter) -> Generator[Progress, None, list[PartitionResult]]:
    """One round of ``parts`` in a thread (a Spark job), yielding progress meanwhile."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["results"] = execute(backfill_id, token, parts, chunk_size, pace)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=work, name=f"pgstream-backfill-{backfill_id}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        yield from reporter.due()
    if "error" in box:
        raise box["error"]
    results: list[PartitionResult] = box["results"]
    return results
