"""The ``pgstream`` Spark data source (docs/spark-source.md: every option); no Dagster (imported on the executors).
``readStream`` (:class:`StreamReader`): the ledger's events in order, offsets being positions ``{"batch_id": B,
"ord": O}``, ``commit`` recording a registered consumer's position (with its token), which housekeeping keeps events
for. ``read`` (:class:`EventsReader`): events with their delivery state, the options (and with ``pushFilters``
Spark's filters) as the query's conditions. Options ``url`` and ``consumerToken`` are redacted by Spark and repeated
by no message.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

if TYPE_CHECKING:
    import psycopg
    import pyarrow as pa
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.datasource import ReadLimit

NAME = "pgstream"
_log = logging.getLogger(__name__)
URL_OPTION = "url"
NUM_PARTITIONS = 4
ROWS_PER_PARTITION = 50_000
#: a reader yields Arrow record batches of at most this many events, or about this much COPY data (one at least)
ARROW_BATCH_ROWS = 10_000
ARROW_BATCH_BYTES = 8 << 20

SCHEMA = ("id long, stream_id long, created_at timestamp, subscription string, operation string, "
                 "table_schema string, table_name string, payload string, metadata string, batch_id long, "
                 "ord int, batch_status string, delivered_at timestamp, attempts int, dead_letter boolean, "
                 "dead_letter_status string, dead_letter_error string")

#: a stream partition's spans (ordinals ``los[i]..his[i]`` of batch ``batch_ids[i]``), in order: batch id, first
#: ordinal, the span's event ids in commit order (none for a batch that is gone)
_POSITIONS_QUERY = """/* pgstream source: positions */
select b.id, s.lo, b.event_ids[s.lo:s.hi]
from unnest(%(batch_ids)s::bigint[], %(los)s::int[], %(his)s::int[]) with ordinality as s(batch_id, lo, hi, n)
join pgstream.batches b on b.id = s.batch_id and b.stream_id = %(stream_id)s
order by s.n
"""

#: the stream's events in a partition's time span and id range: a range scan as cheap as a plain COPY's,
#: joined to the positions by the reader
_WINDOW_QUERY = """/* pgstream source: stream */
select e.id, e.stream_id, e.created_at, e.payload ->> 'tg_name', e.payload ->> 'tg_op',
       e.payload ->> 'tg_table_schema', e.payload ->> 'tg_table_name', e.payload::text, e.metadata::text
from pgstream.events e
where e.stream_id = %(stream_id)s and e.id between %(min_id)s and %(max_id)s
  and e.created_at >= (select min(w.min_created_at) from pgstream.batches w
                       where w.id = any(%(batch_ids)s::bigint[]) and w.stream_id = %(stream_id)s)
  and e.created_at <= (select max(w.max_created_at) from pgstream.batches w
                       where w.id = any(%(batch_ids)s::bigint[]) and w.stream_id = %(stream_id)s)
"""


class SourceError(ValueError):
    """Bad options of the pgstream source, or a position the ledger does not hold."""


@dataclasses.dataclass(frozen=True, order=True)
class Position:
    """Read through ordinal ``ord`` of ledger batch ``batch_id`` (``Position(0, 0)``: before every batch).
    ``event_id``: the event at that position as the ledger read held it (0: not known, or ordinal 0), in the
    offset so that a checkpoint's position is checked against the ledger it is used with (:func:`holds`)."""

    batch_id: int
    ord: int
    event_id: int = dataclasses.field(default=0, compare=False)

    def as_offset(self) -> dict[str, int]:
        offset = {"batch_id": self.batch_id, "ord": self.ord}
        return {**offset, "event_id": self.event_id} if self.event_id else offset

    @classmethod
    def of(cls, offset: dict[str, Any]) -> Position:
        return cls(int(offset["batch_id"]), int(offset["ord"]), int(offset.get("event_id", 0)))


BEFORE_ALL = Position(0, 0)


@dataclasses.dataclass(frozen=True)
class SpanRead:
    """Ordinals ``lo..hi`` of ledger batch ``batch_id``."""

    batch_id: int
    lo: int
    hi: int

    @property
    def events(self) -> int:
        return self.hi - self.lo + 1


def _raw(options: dict[str, str], name: str) -> str | None:
    """Option ``name`` as given (or lower-cased), None when absent or blank (every option alike)."""
    raw = options.get(name, options.get(name.lower()))
    return None if raw is None or not str(raw).strip() else str(raw)


def _option(options: dict[str, str], name: str, what: str = "") -> str:
    value = _raw(options, name)
    if value is None:
        raise SourceError(f"pgstream source: option {name!r} is required{what}")
    return value.strip()


def _int_option(options: dict[str, str], name: str, default: int | None, minimum: int) -> int:
    raw = _raw(options, name)
    if raw is None:
        if default is None:
            raise SourceError(f"pgstream source: option {name!r} is required")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SourceError(f"pgstream source: option {name!r} must be an integer, got {raw[:40]!r}") from None
    if value < minimum:
        raise SourceError(f"pgstream source: option {name!r} must be >= {minimum}, got {value}")
    return value


def _bool_option(options: dict[str, str], name: str, default: bool) -> bool:
    raw = _raw(options, name)
    if raw is None:
        return default
    if raw.strip().lower() not in ("true", "false"):
        raise SourceError(f"pgstream source: option {name!r} must be true or false, got {raw[:40]!r}")
    return raw.strip().lower() == "true"


def _url(options: dict[str, str]) -> str:
    return _option(options, URL_OPTION, " (the database URL of the executor role, spark.executor_database_url)")


def connect(url: str) -> psycopg.Connection:
    """A connection of the source, in UTC with ISO dates (what :func:`_copy_batches` parses); a failure
    names no part of the URL."""
    import psycopg

    from . import dbconn

    try:
        return dbconn.connect(url, autocommit=True, options="-c TimeZone=UTC -c DateStyle=ISO",
                              application_name="pgstream-source")
    except psycopg.OperationalError as exc:
        raise SourceError(f"pgstream source: cannot connect to the database of option 'url': {exc}") from None
    except psycopg.ProgrammingError:
        raise SourceError("pgstream source: option 'url' is not a valid database URL") from None


_ARROW_TYPES = {"long": "int64", "int": "int32", "string": "string", "boolean": "bool_"}


@functools.cache
def arrow_schema(ddl: str = SCHEMA) -> pa.Schema:
    """A schema of Spark's DDL (:data:`SCHEMA`; a ``long``, ``int``, ``string``, ``boolean`` or ``timestamp`` each)
    as the Arrow schema PySpark takes record batches in (timestamps: microseconds in UTC)."""
    import pyarrow as pa

    fields = [column.split() for column in ddl.split(",")]
    return pa.schema([(name, pa.timestamp("us", tz="UTC") if kind == "timestamp" else getattr(pa, _ARROW_TYPES[kind])())
                      for name, kind in fields])


def _parse_csv(data: bytes, schema: pa.Schema) -> pa.RecordBatch:
    """Rows of ``COPY ... (format csv)`` (``schema``'s columns) as one record batch: an unquoted empty
    field is NULL, a quoted one the empty string; booleans ``t``/``f``; times ISO in UTC."""
    import pyarrow as pa
    from pyarrow import csv

    table = csv.read_csv(
        pa.BufferReader(data),
        read_options=csv.ReadOptions(column_names=schema.names, block_size=len(data) + 1, use_threads=False),
        parse_options=csv.ParseOptions(newlines_in_values=True),
        convert_options=csv.ConvertOptions(column_types=schema, null_values=[""], strings_can_be_null=True,
                                           quoted_strings_can_be_null=False, true_values=["t"],
                                           false_values=["f"]))
    return table.combine_chunks().to_batches()[0]


def _copy_batches(conn: psycopg.Connection, query: str, params: Sequence[Any] | dict[str, Any],
                  schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The rows of ``query`` (``schema``'s columns; ``params`` bound on the client: a COPY takes none) as
    Arrow record batches, by one ``COPY (query) TO STDOUT`` in CSV that pyarrow parses."""
    with conn.cursor().copy(f"copy ({query}) to stdout with (format csv, encoding 'UTF8')", params) as copy:
        rows: list[Any] = []  # each CopyData message of a COPY TO is one row
        size = 0
        for row in copy:
            rows.append(row)
            size += len(row)
            if len(rows) >= ARROW_BATCH_ROWS or size >= ARROW_BATCH_BYTES:
                yield _parse_csv(b"".join(rows), schema)
                rows, size = [], 0
        if rows:
            yield _parse_csv(b"".join(rows), schema)


def _positions(conn: psycopg.Connection, params: dict[str, Any]) -> pa.Table:
    """The ledger positions of a stream partition's spans (:data:`_POSITIONS_QUERY`), in order: event id,
    batch id, ordinal, and the row's place in the partition (``position``)."""
    import pyarrow as pa

    rows = conn.execute(_POSITIONS_QUERY, params).fetchall()
    table = pa.table({  # a chunk per span
        "id": pa.chunked_array([pa.array(events, pa.int64()) for _b, _lo, events in rows], pa.int64()),
        "batch_id": pa.chunked_array([pa.nulls(len(events), pa.int64()).fill_null(batch_id)
                                      for batch_id, _lo, events in rows], pa.int64()),
        "ord": pa.chunked_array([pa.array(range(lo, lo + len(events)), pa.int32()) for _b, lo, events in rows],
                                pa.int32())})
    return table.append_column("position", pa.array(range(table.num_rows), pa.int64()))


# --- positions in the ledger -----------------------------------------------------------------------------

def start_position(conn: psycopg.Connection, stream_id: int, starting: str) -> Position:
    """Where a new query starts (``startingPosition``): ``earliest``, ``latest`` (after the last recorded
    batch), an event id (just before it) or an ISO time (before the first batch with an event from then)."""
    text = starting.strip()
    if text.lower() == "earliest":
        return BEFORE_ALL
    if text.lower() == "latest":
        return next_position(conn, stream_id, BEFORE_ALL, None)
    if text.isdigit():
        event_id = int(text)
        row = conn.execute(
            """select b.id, o.ord::int from pgstream.events e
               join pgstream.batches b on b.stream_id = e.stream_id
                and b.min_created_at <= e.created_at and b.max_created_at >= e.created_at
               cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
               where e.id = %s and e.stream_id = %s and o.id = e.id
               order by b.id limit 1""", [event_id, stream_id]).fetchone()
        if row is None:
            raise SourceError(f"pgstream source: startingPosition {event_id}: no recorded batch of stream "
                              f"{stream_id} holds event {event_id}")
        return Position(row[0], row[1] - 1)
    try:
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        raise SourceError(f"pgstream source: startingPosition must be earliest, latest, an event id or an ISO time, "
                          f"got {text[:60]!r}") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=dt.UTC)
    row = conn.execute("select id from pgstream.batches where stream_id = %s and max_created_at >= %s "
                       "order by id limit 1", [stream_id, at]).fetchone()
    if row is None:  # nothing recorded since: start after what is there
        return start_position(conn, stream_id, "latest")
    return Position(row[0], 0)


def next_position(conn: psycopg.Connection, stream_id: int, start: Position, max_events: int | None) -> Position:
    """The end of the next micro-batch from ``start``: the last recorded batch, or the position
    ``max_events`` events on (cutting a batch if it must)."""
    if max_events is None:
        row = conn.execute("select id, event_count from pgstream.batches where stream_id = %s and id >= %s "
                           "order by id desc limit 1", [stream_id, start.batch_id]).fetchone()
        if row is None or (row[0] == start.batch_id and start.ord >= row[1]):
            return start
        return Position(row[0], row[1])
    row = conn.execute(
        """select id, event_count, running from (
               select id, event_count,
                      sum(event_count - case when id = %(b)s then least(%(o)s, event_count) else 0 end)
                          over (order by id) as running
               from pgstream.batches where stream_id = %(s)s and id >= %(b)s) r
           where running >= %(cap)s order by id limit 1""",
        {"s": stream_id, "b": start.batch_id, "o": start.ord, "cap": max_events}).fetchone()
    if row is None:
        return next_position(conn, stream_id, start, None)
    batch_id, count, running = int(row[0]), int(row[1]), int(row[2])
    return Position(batch_id, count - (running - max_events))


def _event_at(conn: psycopg.Connection, stream_id: int, position: Position) -> int | None:
    row = conn.execute("select event_ids[%s] from pgstream.batches where id = %s and stream_id = %s",
                       [position.ord, position.batch_id, stream_id]).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def named(conn: psycopg.Connection, stream_id: int, position: Position) -> Position:
    """``position`` with the event the ledger holds there (for an offset)."""
    if position.ord == 0:
        return position
    return dataclasses.replace(position, event_id=_event_at(conn, stream_id, position) or 0)


def holds(conn: psycopg.Connection, stream_id: int, position: Position) -> bool:
    """Whether the ledger holds ``position``'s event there. Not after a failover of the primary with the standby
    behind: the new primary's ledger lacks the batches the old one recorded last and hands their ids out again."""
    return not position.event_id or _event_at(conn, stream_id, position) == position.event_id


def spans_between(conn: psycopg.Connection, stream_id: int, start: Position, end: Position) -> list[SpanRead]:
    """The events after ``start`` through ``end``, as spans of ledger batches in ledger order."""
    if end <= start:
        return []
    rows = conn.execute("select id, event_count from pgstream.batches where stream_id = %s and id between %s and %s "
                        "order by id", [stream_id, start.batch_id, end.batch_id]).fetchall()
    spans: list[SpanRead] = []
    for batch_id, count in rows:
        lo = start.ord + 1 if batch_id == start.batch_id else 1
        hi = end.ord if batch_id == end.batch_id else count
        if lo <= hi:
            spans.append(SpanRead(batch_id, lo, min(hi, count)))
    return spans


def split_spans(spans: Sequence[SpanRead], parts: int, rows: int) -> list[list[SpanRead]]:
    """``spans`` in at most about ``parts`` consecutive groups of equal size (never more than ``rows``
    events each), cutting a batch where a group ends: each group is one Spark partition."""
    total = sum(s.events for s in spans)
    if total == 0:
        return []
    size = max(1, min(rows, math.ceil(total / parts)))
    groups: list[list[SpanRead]] = [[]]
    room = size
    for span in spans:
        lo = span.lo
        while lo <= span.hi:
            if room == 0:
                groups.append([])
                room = size
            hi = min(span.hi, lo + room - 1)
            groups[-1].append(SpanRead(span.batch_id, lo, hi))
            room -= hi - lo + 1
            lo = hi + 1
    return groups


def commit_consumer(conn: psycopg.Connection, name: str, stream_id: int, position: Position, token: str) -> None:
    """Records the position of registered consumer ``name`` with ``token``; an unknown consumer, another
    token or a position the ledger does not hold is a :class:`SourceError` saying what to do (never the token)."""
    import psycopg

    from .dbconn import error_line

    try:
        conn.execute("select pgstream.consumer_commit(%s, %s, %s, %s, %s)",
                     [name, stream_id, position.batch_id, position.ord, token])
    except (psycopg.errors.InvalidParameterValue, psycopg.errors.InsufficientPrivilege) as exc:
        raise SourceError(f"pgstream source: {error_line(exc)}") from None


class EventsGone(RuntimeError):
    """Events of the ledger the stream reader was to read are no longer in ``pgstream.events``."""


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("pgstream")`` (see the module). With ``Trigger.AvailableNow`` it reads to the
    end of the ledger as of the query's start, in micro-batches of at most ``maxEventsPerTrigger``, then stops."""

    def __init__(self, options: dict[str, str]) -> None:
        self.url = _url(options)
        self.stream_id = _int_option(options, "stream", None, 1)
        self.consumer = _option(options, "consumer")
        self.token = _option(options, "consumerToken", what=(
            f" (consumer {self.consumer}'s token: `pgstream-dagster consumers add` printed it, "
            f"`pgstream-dagster consumers token {self.consumer}` issues a new one)"))
        self.starting = options.get("startingPosition", options.get("startingposition", "earliest"))
        self.max_events = _int_option(options, "maxEventsPerTrigger", 0, 0) or None
        self.parts = _int_option(options, "numPartitions", NUM_PARTITIONS, 1)
        self.rows = _int_option(options, "rowsPerPartition", ROWS_PER_PARTITION, 1)
        self.fail_on_data_loss = _bool_option(options, "failOnDataLoss", True)
        self._conn: psycopg.Connection | None = None
        #: the consumer position last recorded by this reader
        self._recorded: Position | None = None
        #: Trigger.AvailableNow: the end of the ledger when the query started
        self._target: Position | None = None
        #: offsets the ledger no longer holds -> where the query went on (:meth:`_checked`)
        self._resumed: dict[tuple[int, int, int], Position] = {}

    def _db(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.url)
        return self._conn

    def initialOffset(self) -> dict[str, int]:
        conn = self._db()
        position = named(conn, self.stream_id, start_position(conn, self.stream_id, self.starting))
        # registered from the start: housekeeping keeps what it will read before its first commit
        self._record(position)
        return position.as_offset()

    def getDefaultReadLimit(self) -> ReadLimit:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        return ReadMaxRows(self.max_events) if self.max_events else ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        from pyspark.sql.streaming.datasource import ReadMaxRows

        # ``start`` is the end of the last micro-batch, committed by the query's sink; Spark calls :meth:`commit`
        # only once the next one is planned: an idle query's position would stay a micro-batch behind
        position = self._checked(Position.of(start))
        self._record(position)
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = next_position(self._db(), self.stream_id, position, cap)
        if self._target is not None:
            end = max(position, min(end, self._target))
        return named(self._db(), self.stream_id, end).as_offset()

    def _checked(self, position: Position) -> Position:
        """``position``, or where the query goes on when the ledger no longer holds it (:func:`holds`): the
        consumer's position recorded in the database, which the new primary holds with its ledger (replicated
        together). What the query read after it is read again: at least once across such a failover."""
        key = dataclasses.astuple(position)
        if key in self._resumed:
            return self._resumed[key]
        if holds(self._db(), self.stream_id, position):
            return position
        row = self._db().execute("select batch_id, ord from pgstream.consumers where name = %s and stream_id = %s",
                                 [self.consumer, self.stream_id]).fetchone()
        recorded = BEFORE_ALL if row is None else Position(int(row[0]), int(row[1]))
        if recorded == position:
            return position  # (its batch pruned, the query stopped past its consumer's bound: read on from there)
        resumed = named(self._db(), self.stream_id, recorded)
        _log.warning(f"pgstream source: stream {self.stream_id}: the ledger no longer holds event {position.event_id} "
                     f"at batch {position.batch_id} ordinal {position.ord}, where this query read it (a failover of "
                     f"the primary with its standby behind): going on from consumer {self.consumer}'s position "
                     f"recorded in the database, batch {resumed.batch_id} ordinal {resumed.ord}; what the query "
                     "read after it is read again")
        self._resumed[key] = resumed
        return resumed

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = next_position(self._db(), self.stream_id, BEFORE_ALL, None)

    def _record(self, position: Position) -> None:
        if position != self._recorded:
            commit_consumer(self._db(), self.consumer, self.stream_id, position, self.token)
            self._recorded = position

    def reportLatestOffset(self) -> dict[str, int] | None:
        return next_position(self._db(), self.stream_id, BEFORE_ALL, None).as_offset()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        first, last = self._checked(Position.of(start)), Position.of(end)
        if not holds(self._db(), self.stream_id, last):
            last = first  # planned on a lost ledger: nothing (the next micro-batch goes on from the consumer's)
        spans = spans_between(self._db(), self.stream_id, first, last)
        return [InputPartition([dataclasses.astuple(s) for s in group])
                for group in split_spans(spans, self.parts, self.rows)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The partition's events in ledger order as Arrow record batches (positions joined to one COPY's
        events); ``failOnDataLoss``: :class:`EventsGone` names the first span whose events are not all there."""
        import pyarrow as pa
        import pyarrow.compute as pc

        spans = [SpanRead(*fields) for fields in partition.value]
        params: dict[str, Any] = {"batch_ids": [s.batch_id for s in spans], "los": [s.lo for s in spans],
                                  "his": [s.hi for s in spans], "stream_id": self.stream_id}
        schema = arrow_schema()
        events_schema = pa.schema(list(schema)[:9])
        with connect(self.url) as conn:
            positions = _positions(conn, params)
            bounds = pc.min_max(positions.column("id")).as_py()
            window = {**params, "min_id": bounds["min"], "max_id": bounds["max"]}
            events = pa.Table.from_batches(list(_copy_batches(conn, _WINDOW_QUERY, window, events_schema))
                                           if positions.num_rows else [], schema=events_schema)
        joined = positions.join(events, keys="id", join_type="inner").sort_by("position")
        table = pa.Table.from_arrays([joined.column(field.name) if field.name in joined.column_names
                                      else pa.nulls(joined.num_rows, field.type) for field in schema], schema=schema)
        yield from table.to_batches(max_chunksize=ARROW_BATCH_ROWS)
        got = {c["values"]: c["counts"] for c in pc.value_counts(table.column("batch_id")).to_pylist()}
        short = [(s, s.events - got.get(s.batch_id, 0)) for s in spans if got.get(s.batch_id, 0) != s.events]
        if short and self.fail_on_data_loss:
            span, missing = short[0]
            raise EventsGone(
                f"pgstream source: stream {self.stream_id}: {missing} of the events of ledger batch "
                f"{span.batch_id} (ordinals {span.lo}..{span.hi}) are gone from pgstream.events (housekeeping "
                f"dropped them past the consumer's max_retention_days, or the batch was pruned); "
                f"set failOnDataLoss=false to go on without them")

    def commit(self, end: dict[str, Any]) -> None:
        position = Position.of(end)
        if holds(self._db(), self.stream_id, position):
            self._record(position)

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_conn": None}


# --- batch reads: events with their delivery state -------------------------------------------------------

#: columns a filter may be pushed down on, and their SQL
PUSHABLE = {
    "id": "e.id",
    "stream_id": "e.stream_id",
    "created_at": "e.created_at",
    "subscription": "(e.payload ->> 'tg_name')",
    "operation": "(e.payload ->> 'tg_op')",
    "table_schema": "(e.payload ->> 'tg_table_schema')",
    "table_name": "(e.payload ->> 'tg_table_name')",
}
_COMPARISONS: dict[type[Filter], str] = {EqualTo: "=", GreaterThan: ">", GreaterThanOrEqual: ">=",
                                         LessThan: "<", LessThanOrEqual: "<="}


def _sql_value(column: str, value: Any) -> Any:
    """A filter's value as a query parameter of ``column``'s type, or :data:`NotImplemented`."""
    if column in ("id", "stream_id"):
        return value if isinstance(value, int) and not isinstance(value, bool) else NotImplemented
    if column == "created_at":
        if isinstance(value, dt.datetime):
            return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)  # Spark's UTC micros
        return NotImplemented
    return value if isinstance(value, str) else NotImplemented


def pushed_condition(flt: Filter) -> tuple[str, list[Any]] | None:
    """The SQL condition and parameters of a Spark filter this source can evaluate in Postgres."""
    attribute: tuple[str, ...] = getattr(flt, "attribute", ())  # every filter but Not has one
    if len(attribute) != 1 or attribute[0] not in PUSHABLE:
        return None
    column = attribute[0]
    expr = PUSHABLE[column]
    if type(flt) in _COMPARISONS:
        value = _sql_value(column, flt.value)  # type: ignore[attr-defined]
        if value is NotImplemented:
            return None
        return f"{expr} {_COMPARISONS[type(flt)]} %s", [value]
    if isinstance(flt, In):
        values = [_sql_value(column, v) for v in flt.value]
        if not values or any(v is NotImplemented for v in values):
            return None
        return f"{expr} = any(%s)", [values]
    return None


def _csv(options: dict[str, str], name: str) -> list[str] | None:
    raw = _raw(options, name)
    return None if raw is None else [part.strip() for part in raw.split(",") if part.strip()]


def _time_option(options: dict[str, str], name: str) -> dt.datetime | None:
    if (raw := _raw(options, name)) is None:
        return None
    try:
        at = dt.datetime.fromisoformat(raw.strip())
    except ValueError:
        raise SourceError(f"pgstream source: option {name!r} must be an ISO time, got {raw[:60]!r}") from None
    return at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)


class EventsReader(DataSourceReader):
    """``spark.read.format("pgstream")``: see the module's docstring."""

    #: Spark's filters pushed down (:class:`PushdownEventsReader`), each a condition and its parameters
    pushed: list[tuple[str, list[Any]]] = []

    def __init__(self, options: dict[str, str]) -> None:
        self.url = _url(options)
        self.stream_id = _int_option(options, "stream", None, 1)
        self.parts = _int_option(options, "numPartitions", NUM_PARTITIONS, 1)
        #: the options' conditions, as :attr:`pushed`
        self.selected: list[tuple[str, list[Any]]] = [("e.stream_id = %s", [self.stream_id])]
        ops = _csv(options, "operation")
        for condition, value in (("e.created_at >= %s", _time_option(options, "fromTime")),
                                 ("e.created_at < %s", _time_option(options, "toTime")),
                                 (f"{PUSHABLE['subscription']} = any(%s)", _csv(options, "subscription")),
                                 (f"{PUSHABLE['operation']} = any(%s)", ops and [op.upper() for op in ops])):
            if value is not None:
                self.selected.append((condition, [value]))

    def where(self) -> str:
        return " and ".join(condition for condition, _ in self.selected + self.pushed)

    def selection(self) -> list[Any]:
        return [p for _, params in self.selected + self.pushed for p in params]

    def query(self) -> str:
        """The query of one partition (ids ``lo..hi`` after the selection's parameters): the events, the
        ledger batch holding each (one join over the batches overlapping its time span) and its dead letter."""
        # where(): fixed SQL fragments of this module (PUSHABLE, the options'); every value is a parameter (psycopg
        # quotes it into the COPY, which takes no server-side parameters)
        return f"""/* pgstream source: events */
with ev as materialized (
    select e.* from pgstream.events e where {self.where()} and e.id between %s and %s
), span as (
    select min(created_at) as lo, max(created_at) as hi from ev
), held as materialized (
    select distinct on (o.id) o.id as event_id, b.id as batch_id, o.ord::int as ord, b.status, b.delivered_at,
           b.attempts
    from span, pgstream.batches b
    cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
    where b.stream_id = %s and b.max_created_at >= span.lo and b.min_created_at <= span.hi
    order by o.id, b.id
)
select e.id, e.stream_id, e.created_at, e.payload ->> 'tg_name', e.payload ->> 'tg_op',
       e.payload ->> 'tg_table_schema', e.payload ->> 'tg_table_name', e.payload::text, e.metadata::text,
       h.batch_id, h.ord, h.status, h.delivered_at, h.attempts, d.id is not null, d.status, d.error
from ev e
left join held h on h.event_id = e.id
left join pgstream.dead_letters d on d.stream_id = e.stream_id and d.event_id = e.id
order by e.id"""  # noqa: S608

    def partitions(self) -> Sequence[InputPartition]:
        with connect(self.url) as conn:
            row = conn.execute(f"select min(e.id), max(e.id) from pgstream.events e where {self.where()}",  # noqa: S608
                               self.selection()).fetchone()
        if row is None or row[0] is None:
            return []
        lo, hi = int(row[0]), int(row[1])
        size = max(1, math.ceil((hi - lo + 1) / self.parts))
        return [InputPartition((start, min(hi, start + size - 1))) for start in range(lo, hi + 1, size)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        lo, hi = partition.value
        with connect(self.url) as conn:
            yield from _copy_batches(conn, self.query(), [*self.selection(), lo, hi, self.stream_id], arrow_schema())


class PushdownEventsReader(EventsReader):
    """:class:`EventsReader` with Spark's filters pushed down (``pushFilters``; opt-in: Spark 4.3 reuses a
    DataFrame's first filtered reader for its later queries, tests/test_spark_source.py: a DataFrame per query)."""

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        self.pushed = []  # each call replaces the last one's
        for flt in filters:
            pushed = pushed_condition(flt)
            if pushed is None:
                yield flt
            else:
                self.pushed.append(pushed)


class PgstreamDataSource(DataSource):
    """``format("pgstream")``: a stream's events, as a stream (ledger order) or a batch (with delivery state)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        options = dict(self.options)
        return (PushdownEventsReader if _bool_option(options, "pushFilters", False) else EventsReader)(options)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return StreamReader(dict(self.options))


#: the interpreter PySpark gives a classic session's Python workers when ``PYSPARK_PYTHON`` is unset
PYSPARK_DEFAULT_PYTHON = "python3"


def is_classic(spark: SparkSession) -> bool:
    """A classic session (its JVM driver in this process), not a Spark Connect client."""
    return not type(spark).__module__.startswith("pyspark.sql.connect")


def register(spark: SparkSession) -> None:
    """Register ``format("pgstream")`` on ``spark`` (local, a cluster, or Spark Connect). A classic session's Python
    workers run, unless ``PYSPARK_PYTHON`` is set or the master is a cluster, the conf's ``spark.pyspark.python``,
    else this interpreter (``python3`` may lack this package)."""
    from .cluster import is_local

    if is_classic(spark):
        context = spark.sparkContext
        if (context.pythonExec == PYSPARK_DEFAULT_PYTHON and not os.environ.get("PYSPARK_PYTHON")
                and is_local(context.master or "")):
            context.pythonExec = context.getConf().get("spark.pyspark.python") or sys.executable
    spark.dataSource.register(PgstreamDataSource)
