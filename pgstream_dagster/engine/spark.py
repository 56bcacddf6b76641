"""PySpark side of delivery: Python data sources that read events from ``pgstream.events``
(psycopg on the executors; no JDBC jar, nothing downloaded) and the two delivery strategies:
global order from the driver, or parallel per routing key.

* ``pgstream_batches``: the events of ledger batches, in commit order (``batch_id``, ``ord``);
* ``pgstream_events``: events selected by id range / time range / subscription key, in id order
  (replay).

Both split their input into partitions of at most ``rows_per_partition`` rows, read with a
server-side cursor; the driver pulls one partition at a time (Spark computes at most the next one
meanwhile), so memory stays bounded whatever the size of the backlog.

With ``packed`` (the ordered path), a partition is not a row per event but a row per fetch of
``FETCH_ROWS`` events holding the fetched columns pickled together (:data:`PACKED_SCHEMA`): Spark
then moves a few large binary values instead of converting every event to a Spark row and back
(the driver-side ``Row`` conversion was most of the cost of a replay). Payloads stay JSON text all
the way to the sink (:attr:`Event.payload_json`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import os
import pickle
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ..sinks import Sink, SinkConfig, build_sink
from ..sinks.base import event_from_text, parse_event_path
from .cluster import cluster_conf, driver_python_problem, is_local, package_zip
from .publish import (
    CHUNK_BYTES,
    Confirmed,
    Deliveries,
    Position,
    Positioned,
    RejectPolicy,
    SetAsideTooLarge,
    Span,
    TooLarge,
    publish,
)

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import DataFrame, SparkSession

    from ..config import PgstreamConfig
    from .handoff import Handoff
    from .ledger import KeyProgress

Frames: TypeAlias = "DataFrame | list[DataFrame]"
"""What the loaders return: one DataFrame, or (packed) one single-partition DataFrame per partition."""
_T = TypeVar("_T")

BATCHES_SOURCE = "pgstream_batches"
EVENTS_SOURCE = "pgstream_events"
SCHEMA = ("batch_id long, ord long, id long, stream_id long, created_at timestamp, payload string, "
          "metadata string, routing_key string")
# Spark redacts option values whose key matches spark.redaction.regex ("secret", "password", ...),
# so the database URL never shows in plans or the Spark UI.
URL_OPTION = "secret.database_url"
ROWS_PER_PARTITION = 50_000
#: rows per server-side cursor FETCH, and per packed row
FETCH_ROWS = 5_000
#: one row per fetch: the position of its first event, its event count, and the pickled columns
#: (batch_ids, ords, ids, stream_ids, created_ats, payloads, metadatas) of its events, in order
PACKED_SCHEMA = "batch_id long, ord long, events int, data binary"

# ``e.stream_id + 0``: never a condition the planner may serve with events_stream_created_idx. With
# stale or missing statistics of the day's partition (writers filling it, autovacuum behind) it did,
# scanning the stream's whole day per event of the batch (measured by bench/cpu.py: one 10k batch
# 4.74 s instead of 0.20 s); by the primary key (id, created_at) each event is one index probe.
_BATCH_QUERY = """
select b.id, o.ord, e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text,
       (case when %(routing_source)s::text = 'metadata' then e.metadata else e.payload end) #>> %(path)s::text[]
           as routing_key
from pgstream.batches b
cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
join pgstream.events e
  on e.id = o.id and e.stream_id + 0 = b.stream_id
 and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at
where b.id = %(batch_id)s and o.ord between %(lo)s and %(hi)s
order by o.ord
"""

#: per event of a batch span: its ordinal, id, and the bytes of its payload and of its metadata as JSON text
#: (what reading it costs: each is rendered by the server, nothing is sent). A reader cuts what it reads
#: at a byte budget by these (:func:`cut`), not only at a number of rows: a few thousand events of a few
#: MiB each as text (small stored: compressed) must not be read at once
_BATCH_SIZES = """
select o.ord, e.id, pg_catalog.octet_length(e.payload::pg_catalog.text),
       coalesce(pg_catalog.octet_length(e.metadata::pg_catalog.text), 0)
from pgstream.batches b
cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
join pgstream.events e
  on e.id = o.id and e.stream_id + 0 = b.stream_id
 and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at
where b.id = %(batch_id)s and o.ord between %(lo)s and %(hi)s
order by o.ord
"""

#: :data:`_BATCH_QUERY` cut at a byte budget by the server, in one pass: every event of the span comes with
#: the bytes of its payload and metadata as JSON text, but its payload, metadata and routing key only if it
#: ``fits``: its payload is at most ``limit`` bytes (a null limit: any) and the events that fit before it
#: and it hold at most ``budget`` bytes (the first one that may fits whatever its size). The rest come as
#: sizes only (:class:`DirectRead` reads them next, in pieces it cuts by those sizes). The text of what
#: fits is rendered twice (once to measure it, once to send it): cheap next to the join, which is made once
_BATCH_QUERY_BOUNDED = """
select w.batch_id, w.ord, w.id, w.stream_id, w.created_at,
       case when w.fits then w.payload::pg_catalog.text end,
       case when w.fits then w.metadata::pg_catalog.text end,
       w.payload_bytes, w.metadata_bytes
from (select z.*,
             z.eligible and (z.running <= %(budget)s or z.running = z.payload_bytes + z.metadata_bytes) as fits
      from (select y.*,
                   pg_catalog.sum(case when y.eligible then y.payload_bytes + y.metadata_bytes else 0 end)
                       over (order by y.ord rows unbounded preceding) as running
            from (select b.id as batch_id, o.ord, e.id, e.stream_id, e.created_at, e.payload, e.metadata,
                         x.payload_bytes, x.metadata_bytes,
                         %(limit)s::bigint is null or x.payload_bytes <= %(limit)s::bigint as eligible
                  from pgstream.batches b
                  cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
                  join pgstream.events e
                    on e.id = o.id and e.stream_id + 0 = b.stream_id
                   and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at
                  cross join lateral (
                      select pg_catalog.octet_length(e.payload::pg_catalog.text) as payload_bytes,
                             coalesce(pg_catalog.octet_length(e.metadata::pg_catalog.text), 0) as metadata_bytes
                      offset 0) x
                  where b.id = %(batch_id)s and o.ord between %(lo)s and %(hi)s) y) z) w
order by w.ord
"""

#: bytes of payload and metadata (JSON text) one read holds at most, unless one event is larger
#: (``delivery.max_read_bytes``'s default)
READ_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class Piece:
    """Positions ``lo..hi`` (ordinals of a batch, or event ids) to read at once: within the byte budget."""

    lo: int
    hi: int
    #: bytes of payload and metadata of its events
    size: int = 0


def cut(sizes: Iterable[tuple[int, int, int, int]], lo: int, hi: int, budget: int,
        limit: int | None, rows: int | None = None) -> Iterator[Piece | tuple[int, TooLarge]]:
    """``lo..hi`` in order as :class:`Piece` s of at most ``budget`` bytes of payload and metadata each
    (one event at least) and at most ``rows`` positions, by the ``sizes`` of the events there
    (``(position, id, payload bytes, metadata bytes)`` in order, as :data:`_BATCH_SIZES` returns them;
    a position without a row is in no piece's count). An event whose payload is larger than ``limit``
    is in no piece: it comes as ``(position, TooLarge)`` in its place, never read."""
    start, used = lo, 0
    for position, event_id, payload, metadata in sizes:
        if limit is not None and payload > limit:
            if start < position:
                yield Piece(start, position - 1, used)
            yield position, TooLarge(event_id, payload, limit)
            start, used = position + 1, 0
            continue
        size = payload + metadata
        if (used and used + size > budget) or (rows is not None and position - start >= rows):
            yield Piece(start, position - 1, used)
            start, used = position, 0
        used += size
    if start <= hi:
        yield Piece(start, hi, used)


def sized_spans(conn: psycopg.Connection, spans: Sequence[Span], rows: int, budget: int) -> list[tuple[Span, int]]:
    """``spans`` in pieces of at most ``rows`` ordinals and ``budget`` bytes of payload and metadata
    (one event at least), with their bytes, in order: the sizes of their events come from the server
    (:data:`_BATCH_SIZES`; rendered there, nothing of the events is sent)."""
    pieces: list[tuple[Span, int]] = []
    for whole in spans:
        for span in whole.split(max(rows, 100_000)):  # (a query per 100,000 sizes at most)
            sizes = conn.execute(_BATCH_SIZES, {"batch_id": span.batch_id, "lo": span.first,
                                                "hi": span.last}).fetchall()
            pieces += [(Span(span.batch_id, p.lo, p.hi), p.size)
                       for p in cut(sizes, span.first, span.last, budget, None, rows) if isinstance(p, Piece)]
    return pieces


def group_sized(pieces: Sequence[tuple[Span, int]], rows: int, budget: int) -> list[list[Span]]:
    """Consecutive :func:`sized_spans` pieces in groups of at most ``rows`` ordinals and ``budget``
    bytes in all (one piece at least), in order: one packed partition each (see :func:`group_spans`)."""
    groups: list[list[Span]] = []
    room_rows = room_bytes = 0
    for piece, size in pieces:
        if not groups or piece.events > room_rows or size > room_bytes:
            groups.append([])
            room_rows, room_bytes = rows, budget
        groups[-1].append(piece)
        room_rows -= piece.events
        room_bytes -= size
    return groups


def events_where(params: Mapping[str, Any]) -> str:
    """The filter of a replay's selection (``params``: ``replay.selection``'s; shared with
    ``replay.plan``, which counts and splits it): the stream and the id range, and the time bounds
    and subscription keys only where ``params`` give them, so that no row evaluates a test of a
    parameter that is not there."""
    tests = ["e.stream_id = %(stream_id)s", "e.id between %(lo)s and %(hi)s"]
    if params.get("from_time") is not None:
        tests.append("e.created_at >= %(from_time)s::timestamptz")
    if params.get("to_time") is not None:
        tests.append("e.created_at < %(to_time)s::timestamptz")
    if params.get("keys") is not None:
        tests.append("e.payload ->> 'tg_name' = any (%(keys)s::text[])")
    return " and ".join(tests)


def _events_query(params: Mapping[str, Any]) -> str:
    """The events of a replay's selection (:func:`events_where`), a range of ids at a time."""
    return """
select 0::bigint, e.id, e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text,
       (case when %(routing_source)s::text = 'metadata' then e.metadata else e.payload end) #>> %(path)s::text[]
           as routing_key
from pgstream.events e
where """ + events_where(params) + """
order by e.id
"""


def _events_sizes(params: Mapping[str, Any]) -> str:
    """:data:`_BATCH_SIZES` for a replay's selection: positions are event ids."""
    return """
select e.id, e.id, pg_catalog.octet_length(e.payload::pg_catalog.text),
       coalesce(pg_catalog.octet_length(e.metadata::pg_catalog.text), 0)
from pgstream.events e
where """ + events_where(params) + """
order by e.id
"""


def _routing_params(routing_key: str) -> dict[str, Any]:
    """The query parameters of the routing key (``delivery.routing_key``, an event path): the column it
    reads (payload, or metadata for ``metadata:...``) and its path."""
    source, dotted = parse_event_path(routing_key)
    return {"routing_source": source, "path": dotted.split(".")}


def partition_spans(spans: Sequence[Span], size: int) -> list[Span]:
    """The partitions of ``spans``: at most ``size`` ordinals each, in delivery order."""
    return [part for span in spans for part in span.split(size)]


def group_spans(spans: Sequence[Span], size: int) -> list[list[Span]]:
    """The pieces of :func:`partition_spans` in consecutive groups of at most ``size`` ordinals in
    all, in delivery order: one packed partition (one Spark job) reads a whole group, so a run of
    many small batches does not pay a Spark job per batch (bench/cpu.py: about half a CPU-second of
    the JVM and its Python workers each, whatever the batch's size)."""
    groups: list[list[Span]] = []
    room = 0
    for piece in partition_spans(spans, size):
        if not groups or piece.events > room:
            groups.append([])
            room = size
        groups[-1].append(piece)
        room -= piece.events
    return groups


def _fetch(url: str, query: str, params: Sequence[dict[str, Any]]) -> Iterator[list[tuple[Any, ...]]]:
    """The rows of ``query`` for each of ``params`` in turn, on one connection."""
    import psycopg

    # UTC: created_at comes back as an aware UTC datetime, the same on every machine
    with psycopg.connect(url, options="-c TimeZone=UTC") as conn:
        for one in params:
            with conn.cursor(name="pgstream_read") as cur:
                cur.execute(query, one)
                while rows := cur.fetchmany(FETCH_ROWS):
                    yield rows


def _read(url: str, query: str, params: Sequence[dict[str, Any]], packed: bool) -> Iterator[tuple[Any, ...]]:
    for rows in _fetch(url, query, params):
        if packed:
            columns = tuple(zip(*rows, strict=True))[:7]  # without routing_key
            yield rows[0][0], rows[0][1], len(rows), pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            yield from rows


class BatchesReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options[URL_OPTION]
        # one partition per group of spans, read in order (``partitions``: the JSON of a list of
        # lists of Span fields)
        self.groups = [[Span(**fields) for fields in group] for group in json.loads(options["partitions"])]
        self.routing = _routing_params(options.get("routing_key", "group_id"))
        self.packed = options.get("packed") == "true"

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(group) for group in self.groups]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        group = partition.value
        assert isinstance(group, list) and all(isinstance(span, Span) for span in group)
        yield from _read(self.url, _BATCH_QUERY, [{**self.routing, "batch_id": span.batch_id,
                                                   "lo": span.first, "hi": span.last} for span in group], self.packed)


class EventsReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options[URL_OPTION]
        self.ranges: list[tuple[int, int]] = [(int(lo), int(hi)) for lo, hi in json.loads(options["ranges"])]
        self.params: dict[str, Any] = {
            "stream_id": int(options["stream_id"]),
            "from_time": options.get("from_time") or None,
            "to_time": options.get("to_time") or None,
            "keys": json.loads(options["keys"]) if options.get("keys") else None,
            **_routing_params(options.get("routing_key", "group_id")),
        }
        self.packed = options.get("packed") == "true"

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(r) for r in self.ranges]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        lo, hi = partition.value
        yield from _read(self.url, _events_query(self.params), [{**self.params, "lo": lo, "hi": hi}], self.packed)


class BatchesDataSource(DataSource):
    """``spark.read.format("pgstream_batches")``: the events of ledger batches, in commit order."""

    @classmethod
    def name(cls) -> str:
        return BATCHES_SOURCE

    def schema(self) -> str:
        return PACKED_SCHEMA if self.options.get("packed") == "true" else SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return BatchesReader(dict(self.options))


class EventsDataSource(DataSource):
    """``spark.read.format("pgstream_events")``: a stream's events by id ranges and filters, in id order."""

    @classmethod
    def name(cls) -> str:
        return EVENTS_SOURCE

    def schema(self) -> str:
        return PACKED_SCHEMA if self.options.get("packed") == "true" else SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return EventsReader(dict(self.options))


#: the Arrow record batches a ``by_key`` task gets (after the repartition by key) hold at most this many
#: bytes as well as ``maxRecordsPerBatch`` (10,000) rows: events large as text would fill the executor
_ARROW_BYTES = {"spark.sql.execution.arrow.maxBytesPerBatch": str(READ_BYTES)}


def spark_conf(master: str, remote: str | None, extra: dict[str, str], *, by_key_parallelism: Sequence[int] = (),
               ship_package: bool = True) -> dict[str, str]:
    """Spark settings for the delivery runs: offline, UTC, the user's ``extra`` (``spark.conf``) over
    pgstream's defaults, and on a cluster master what :func:`~pgstream_dagster.engine.cluster.cluster_conf`
    adds (the package for the executors, a bounded share of the cluster, no task retries).

    The Python workers run ``spark.pyspark.python`` if ``extra`` sets it (the executors' Python),
    else ``$PYSPARK_PYTHON``, else this interpreter: PySpark sends the driver's ``PYSPARK_PYTHON``
    with every Python function (data sources included), so it is set in this process's environment
    too."""
    if remote:
        # Spark Connect: the server owns the JVM and its Python workers (pgstream_dagster.sparkserver);
        # a session may only set session settings
        return {"spark.remote": remote, "spark.sql.session.timeZone": "UTC", **_ARROW_BYTES, **extra}
    python = extra.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON") or sys.executable
    driver_python = extra.get("spark.pyspark.driver.python") or sys.executable
    os.environ["PYSPARK_PYTHON"] = python
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", driver_python)
    conf = {
        "spark.app.name": "pgstream-delivery",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": python,
        "spark.pyspark.driver.python": driver_python,
        "spark.sql.shuffle.partitions": "8",
        "spark.driver.extraJavaOptions": "-Dio.netty.tryReflectionSetAccessible=true",
        **_ARROW_BYTES,
    }
    conf["spark.master"] = master
    conf.update(extra)
    conf.update(cluster_conf(master, extra, by_key_parallelism, ship_package=ship_package))
    return conf


_SHIPPED: set[str] = set()
"""Spark Connect sessions that were handed the package (or found they need not be)."""



def location_conf(config: PgstreamConfig) -> dict[str, str]:
    """The Spark settings of every run of a location (``pgstream.yaml``'s ``spark`` block and its
    streams): what the ``pyspark`` resource gets, and what :func:`open_session` uses."""
    return spark_conf(config.spark.master, config.spark.remote, dict(config.spark.conf),
                      by_key_parallelism=[s.delivery.parallelism for s in config.streams
                                          if s.delivery.ordering == "by_key"],
                      ship_package=config.spark.ship_package)


def open_session(config: PgstreamConfig) -> SparkSession:
    """A Spark session with the runs' settings (:func:`location_conf`), outside Dagster (the CLI,
    benches), with ``format("pgstream")`` registered (:mod:`.spark_source`)."""
    from pyspark.sql import SparkSession

    from .spark_source import register

    builder = SparkSession.builder
    for key, value in location_conf(config).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    register(spark)
    return spark


class DriverPythonMissing(RuntimeError):
    """The Python workers' interpreter is a relative path the run's host does not have
    (:func:`~pgstream_dagster.engine.cluster.driver_python_problem`)."""


def ship_package(spark: SparkSession) -> None:
    """Before a run's Spark reads anything. Spark Connect on a cluster master: add the package zip to
    the session as a Python artifact, once per session, so the server's executors import the data
    sources and sinks from it (a JVM server ignores ``spark.submit.pyFiles``); a local server's workers
    have this environment. A classic session got the zip from ``spark.submit.pyFiles``
    (:func:`spark_conf`); raises :class:`DriverPythonMissing` when its driver could not start the
    workers' interpreter to plan the data sources (a relative ``spark.pyspark.python``)."""
    if not type(spark).__module__.startswith("pyspark.sql.connect"):
        problem = driver_python_problem(str(spark.sparkContext.pythonExec), Path.cwd())
        if problem is not None:
            raise DriverPythonMissing(problem)
        return
    session_id = str(getattr(spark, "session_id", id(spark)))
    if session_id in _SHIPPED:
        return
    if not is_local(spark.conf.get("spark.master") or "local"):
        spark.addArtifacts(str(package_zip()), pyfile=True)
    _SHIPPED.add(session_id)


def load_batches(spark: SparkSession, database_url: str, spans: Sequence[Span], routing_key: str,
                 rows_per_partition: int = ROWS_PER_PARTITION, packed: bool = False, *,
                 sizes: psycopg.Connection | None = None, read_bytes: int = READ_BYTES) -> Frames:
    """The events of ``spans`` (what a run owes of each batch, in delivery order: see
    :func:`~pgstream_dagster.engine.publish.owed_spans`), in partitions of at most
    ``rows_per_partition`` events. ``packed``: in :data:`PACKED_SCHEMA` rows, as one
    single-partition DataFrame per partition, in order (see :func:`deliver_in_order`), a partition
    reading consecutive spans up to ``rows_per_partition`` events (:func:`group_spans`); else one
    partition per span (:func:`partition_spans`). With ``sizes`` (a connection), a partition also
    holds at most ``read_bytes`` bytes of payload and metadata (one event at least), by the sizes of
    the events (:func:`sized_spans`): the driver collects a partition whole, and an executor reads one
    whole."""
    ship_package(spark)
    spark.dataSource.register(BatchesDataSource)

    def frame(groups: list[list[Span]]) -> DataFrame:
        return (spark.read.format(BATCHES_SOURCE)
                .option(URL_OPTION, database_url)
                .option("partitions", json.dumps([[dataclasses.asdict(s) for s in group] for group in groups]))
                .option("routing_key", routing_key)
                .option("packed", "true" if packed else "false")
                .load())

    if sizes is not None:
        pieces = sized_spans(sizes, spans, rows_per_partition, read_bytes)
        if packed:
            return [frame([group]) for group in group_sized(pieces, rows_per_partition, read_bytes)]
        return frame([[piece] for piece, _size in pieces])
    if packed:
        return [frame([group]) for group in group_spans(spans, rows_per_partition)]
    return frame([[part] for part in partition_spans(spans, rows_per_partition)])


def load_events(spark: SparkSession, database_url: str, stream_id: int, ranges: list[tuple[int, int]],
                routing_key: str, from_time: str | None = None, to_time: str | None = None,
                keys: list[str] | None = None, packed: bool = False) -> Frames:
    """A stream's events with ids in ``ranges`` (one partition each, in order) passing the filters;
    ``packed``: in :data:`PACKED_SCHEMA` rows, one single-partition DataFrame per range."""
    ship_package(spark)
    spark.dataSource.register(EventsDataSource)

    def frame(selected: list[tuple[int, int]]) -> DataFrame:
        return (spark.read.format(EVENTS_SOURCE)
                .option(URL_OPTION, database_url)
                .option("stream_id", str(stream_id))
                .option("ranges", json.dumps(selected))
                .option("from_time", from_time or "")
                .option("to_time", to_time or "")
                .option("keys", json.dumps(keys) if keys else "")
                .option("routing_key", routing_key)
                .option("packed", "true" if packed else "false")
                .load())

    return [frame([r]) for r in ranges] if packed else frame(ranges)


def _row_events(rows: Iterator[Any]) -> Iterator[Positioned]:
    """Events of rows in :data:`SCHEMA` (payload and metadata stay JSON text until a sink parses them)."""
    for row in rows:
        created = row["created_at"]
        if created.tzinfo is None:
            created = created.replace(tzinfo=dt.UTC)
        yield row["batch_id"], row["ord"], event_from_text(row["id"], row["stream_id"], created, row["payload"],
                                                           row["metadata"] or None)


def _packed_events(rows: Iterator[Any]) -> Iterator[Positioned]:
    """Events of rows in :data:`PACKED_SCHEMA`, in order."""
    for row in rows:
        batch_ids, ords, ids, stream_ids, created, payloads, metadatas = pickle.loads(row["data"])
        for i in range(len(ids)):
            yield batch_ids[i], ords[i], event_from_text(ids[i], stream_ids[i], created[i], payloads[i], metadatas[i])


def is_packed(df: DataFrame) -> bool:
    return "data" in df.columns



def _collected(frames: list[DataFrame], prefetch: bool) -> Iterator[Any]:
    """The rows of single-partition DataFrames, in order, each collected whole; ``prefetch``: the
    next one is collected (by Spark, in a thread) while the caller consumes the current one.

    Not ``toLocalIterator``: in PySpark 4 every partition it serves stays on the driver's JVM heap
    (measured: ~4 MB retained per 4 MB partition, an OutOfMemoryError after ~200 partitions with
    the default 1 GB heap), which a long-lived run or a large replay cannot afford;
    ``collect()`` of one partition at a time keeps the heap flat."""
    for rows in _in_turn([frame.collect for frame in frames], prefetch):
        yield from rows


def _in_turn(calls: Sequence[Callable[[], _T]], prefetch: bool = True) -> Iterator[_T]:
    """The results of ``calls``, in order, each made in a thread; ``prefetch``: the next call is
    made while the caller consumes the current result, else once it asks for the next."""
    if not calls:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgstream-prefetch") as pool:
        ahead = pool.submit(calls[0])
        for i in range(len(calls)):
            result = ahead.result()
            more = i + 1 < len(calls)
            if more and prefetch:
                ahead = pool.submit(calls[i + 1])
            yield result
            if more and not prefetch:
                ahead = pool.submit(calls[i + 1])


def _positioned(rows: list[tuple[Any, ...]]) -> Iterator[Positioned]:
    """Events of rows of :data:`_BATCH_QUERY` or :func:`_events_query` read by psycopg, in order."""
    for batch_id, ord_, event_id, stream_id, created, payload, metadata, _key in rows:
        yield batch_id, ord_, event_from_text(event_id, stream_id, created.astimezone(dt.UTC), payload, metadata)


@dataclasses.dataclass(frozen=True)
class DirectRead:
    """A round small enough to read without Spark: ``spans`` read by ``conn`` (the run's own
    connection) with the query the Spark source runs, as :func:`deliver_in_order` publishes them. A
    Spark job costs 0.1-0.3 s and about half a CPU-second whatever its size (bench/cpu.py): for the
    few events an open run gets at a time that is most of the latency and of the CPU."""

    conn: psycopg.Connection
    spans: Sequence[Span]
    routing_key: str
    #: the rows the run's slot reader recorded (:mod:`.handoff`): a span found there is not read
    handoff: Handoff | None = None
    #: bytes of payload and metadata one read holds at most (one event at least): ``delivery.max_read_bytes``
    read_bytes: int = READ_BYTES
    #: an event whose payload is larger is not read (:class:`~.publish.TooLarge`): the sink's ``max_event_bytes()``
    event_bytes: int | None = None

    def events(self) -> Iterator[Positioned]:
        for whole in self.spans:
            kept = (self.handoff.take(whole.batch_id, whole.first, whole.last, self.event_bytes)
                    if self.handoff is not None else None)
            if kept is not None:
                yield from kept
                continue
            for span in whole.split(FETCH_ROWS):
                # FETCH_ROWS at a time and at most read_bytes (the server cuts), each fetched whole before
                # anything is yielded: the caller writes the ledger on the same connection
                yield from self._read(span.batch_id, span.first, span.last)

    def _read(self, batch_id: int, lo: int, hi: int) -> Iterator[Positioned]:
        where = {"batch_id": batch_id, "budget": self.read_bytes, "limit": self.event_bytes}
        rows = self.conn.execute(_BATCH_QUERY_BOUNDED, {**where, "lo": lo, "hi": hi}).fetchall()
        utc = dt.UTC
        rest: list[tuple[int, int, int, int]] = []  # (ord, id, payload bytes, metadata bytes) after the cut
        for batch, ord_, event_id, stream_id, created, payload, metadata, payload_bytes, metadata_bytes in rows:
            if rest or (payload is None and (self.event_bytes is None or payload_bytes <= self.event_bytes)):
                rest.append((ord_, event_id, payload_bytes, metadata_bytes))
            elif payload is None:
                assert self.event_bytes is not None
                yield batch, ord_, TooLarge(event_id, payload_bytes, self.event_bytes)
            else:
                yield batch, ord_, event_from_text(event_id, stream_id, created.astimezone(utc), payload, metadata)
        del rows
        if not rest:
            return
        for piece in cut(rest, rest[0][0], hi, self.read_bytes, self.event_bytes):
            if isinstance(piece, Piece):  # fits whole (its events' sizes are known)
                yield from self._read(batch_id, piece.lo, piece.hi)
            else:
                yield batch_id, piece[0], piece[1]


@dataclasses.dataclass(frozen=True)
class DirectEvents:
    """A replay's selection read without Spark (``delivery.direct_max_events`` above 0): the id
    ``ranges`` of :func:`~pgstream_dagster.engine.replay.plan`, each read whole with the query the
    Spark source runs (``params``: its filters), by a connection of its own while the caller publishes
    the range before. The run's process publishes every event of a replay anyway (id order): Spark
    would only add its start-up, its JVM and a copy of every row (bench/replay.py)."""

    database_url: str
    ranges: Sequence[tuple[int, int]]
    params: dict[str, Any]
    routing_key: str
    #: as :class:`DirectRead`'s: a range is read in pieces of at most this many bytes (one event at least)
    read_bytes: int = READ_BYTES
    event_bytes: int | None = None

    def events(self) -> Iterator[Positioned]:
        if not self.ranges:
            return
        import psycopg

        params = {**self.params, **_routing_params(self.routing_key)}
        query, sizes = _events_query(params), _events_sizes(params)
        with psycopg.connect(self.database_url, autocommit=True, options="-c TimeZone=UTC",
                             application_name="pgstream replay") as conn:

            def read(lo: int, hi: int) -> Callable[[], list[Positioned]]:
                return lambda: list(_positioned(conn.execute(query, {**params, "lo": lo, "hi": hi}).fetchall()))

            def reads() -> Iterator[Callable[[], list[Positioned]]]:
                """A read per range, or per piece of it within the byte budget (psycopg serialises the
                sizes query with the read of the piece before, made meanwhile)."""
                for lo, hi in self.ranges:
                    pieces = list(cut(conn.execute(sizes, {**params, "lo": lo, "hi": hi}).fetchall(), lo, hi,
                                      self.read_bytes, self.event_bytes))
                    for piece in pieces:
                        if isinstance(piece, Piece):
                            yield read(piece.lo, piece.hi)
                        else:
                            yield lambda piece=piece: [(0, piece[0], piece[1])]  # type: ignore[misc]

            # the piece after the one being published is read meanwhile: two pieces in memory at most
            for rows in _in_turn_lazily(reads()):
                yield from rows


def _in_turn_lazily(calls: Iterator[Callable[[], _T]]) -> Iterator[_T]:
    """:func:`_in_turn` (prefetching) of calls made as they are needed."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgstream-prefetch") as pool:
        call = next(calls, None)
        if call is None:
            return
        ahead = pool.submit(call)
        while True:
            result = ahead.result()
            call = next(calls, None)
            if call is not None:
                ahead = pool.submit(call)
            yield result
            if call is None:
                return


def deliver_in_order(frames: list[DataFrame] | DirectRead | DirectEvents, sink: Sink, chunk_size: int, *,
                     prefetch: bool = True,
                     skip: frozenset[Position] = frozenset(), reject: RejectPolicy | None = None,
                     owed: Sequence[Span] | None = None, too_large: SetAsideTooLarge | None = None,
                     chunk_bytes: int = CHUNK_BYTES) -> Deliveries:
    """Global order: the partitions come to the driver one at a time, in order (no shuffle), and
    are published chunk by chunk through ``sink`` (the caller's; a run keeps one for its whole life)
    by :func:`pgstream_dagster.engine.publish.publish`, whose deliveries this yields (``skip``,
    ``reject``, ``owed``, ``too_large`` and ``chunk_bytes`` are explained there). ``frames``: one
    single-partition DataFrame per partition, as :func:`load_batches` / :func:`load_events` return them packed, or a
    :class:`DirectRead` or :class:`DirectEvents`. ``prefetch``: Spark computes the next partition while
    the driver publishes the current one (memory: two partitions instead of one)."""
    events: Iterator[Positioned]
    if isinstance(frames, DirectRead | DirectEvents):
        events = frames.events()
    else:
        rows: Iterator[Any] = _collected(frames, prefetch)
        events = _packed_events(rows) if frames and is_packed(frames[0]) else _row_events(rows)
    yield from publish(sink, events, chunk_size, skip=skip, reject=reject, owed=owed, too_large=too_large,
                       chunk_bytes=chunk_bytes)


#: what each by_key partition returns to the driver: per batch, the events it handled and, of them,
#: those an earlier attempt had confirmed (skipped, not published again)
BY_KEY_RESULT_SCHEMA = "batch_id long, handled long, resumed long"




@dataclasses.dataclass(frozen=True)
class KeyDeliveries:
    """What a ``by_key`` delivery handled: per batch, the events confirmed by the sink, set aside or
    skipped, including ``resumed`` ones an earlier attempt had confirmed."""

    handled: dict[int, int]
    resumed: int

    @property
    def total(self) -> int:
        return sum(self.handled.values())


def _publish_partition(batches: Iterator[Any], sink_config: SinkConfig, chunk_size: int,
                       skip: frozenset[Position], reject: RejectPolicy | None,
                       progress: KeyProgress | None, too_large: SetAsideTooLarge | None = None,
                       chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """One ``by_key`` partition, on an executor: its events (Arrow record batches in :data:`SCHEMA`
    plus ``bucket``, in commit order) published through a sink of its own; each confirmed chunk is
    recorded in ``progress`` before the next is published, and events at or before their bucket's
    recorded position are not published again. Yields one :data:`BY_KEY_RESULT_SCHEMA` record batch."""
    import pyarrow as pa

    first = next(batches, None)
    while first is not None and first.num_rows == 0:
        first = next(batches, None)
    if first is None:
        return
    handled: dict[int, int] = {}
    resumed: dict[int, int] = {}
    buckets: set[int] = set()
    with contextlib.ExitStack() as stack:
        conn = stack.enter_context(progress.connect()) if progress is not None else None
        done = progress.read(conn) if progress is not None and conn is not None else {}

        def rows() -> Iterator[Positioned]:
            for record_batch in itertools.chain([first], batches):
                for row in record_batch.to_pylist():
                    batch_id, bucket = row["batch_id"], row["bucket"]
                    handled[batch_id] = handled.get(batch_id, 0) + 1
                    buckets.add(bucket)
                    reached = done.get(bucket)
                    if reached is not None and (batch_id, row["ord"]) <= reached:
                        resumed[batch_id] = resumed.get(batch_id, 0) + 1
                        continue
                    yield from _row_events(iter([row]))

        sink = stack.enter_context(build_sink(sink_config))
        deliveries = stack.enter_context(contextlib.closing(
            publish(sink, rows(), chunk_size, skip=skip, reject=reject, too_large=too_large,
                    chunk_bytes=chunk_bytes)))
        for delivery in deliveries:
            if isinstance(delivery, Confirmed) and progress is not None and conn is not None:
                # every event of these buckets up to here is handled: a retry resumes after it
                progress.record(conn, sorted(buckets), delivery.batch_id, delivery.ord)
    yield pa.RecordBatch.from_pylist(
        [{"batch_id": b, "handled": n, "resumed": resumed.get(b, 0)} for b, n in handled.items()],
        schema=pa.schema([("batch_id", pa.int64()), ("handled", pa.int64()), ("resumed", pa.int64())]))


def deliver_by_key(df: DataFrame, sink_config: SinkConfig, chunk_size: int, parallelism: int, *,
                   skip: frozenset[Position] = frozenset(), reject: RejectPolicy | None = None,
                   progress: KeyProgress | None = None, too_large: SetAsideTooLarge | None = None,
                   chunk_bytes: int = CHUNK_BYTES) -> KeyDeliveries:
    """Per routing key order: repartitions by the key into ``parallelism`` partitions (for a
    resumed round, ``progress.partitions``: the resume points hold for that partitioning), each
    publishing its events in commit order on an executor through a sink of its own (built from
    ``sink_config`` by :func:`~pgstream_dagster.sinks.build_sink`, as the run's, and closed when
    the partition is done). Events of one key never reorder; keys proceed in parallel.
    ``reject.set_aside`` and ``too_large`` run on the executors (they must be picklable).

    No accumulator and no ``sparkContext``: the partitions run in ``mapInArrow`` and return their
    counts as rows, which the driver collects, so this works on classic Spark and Spark Connect
    alike. With ``progress`` each partition records what the sink confirmed, chunk by chunk,
    durably, and skips what an earlier attempt recorded (see
    :class:`~pgstream_dagster.engine.ledger.KeyProgress` for why the tasks write it, not the driver)."""
    from pyspark.sql import functions as F

    partitions = progress.partitions if progress is not None else parallelism

    def publish_partition(batches: Iterator[Any]) -> Iterator[Any]:
        return _publish_partition(batches, sink_config, chunk_size, skip, reject, progress, too_large, chunk_bytes)

    # bucket: the partition Spark's hash partitioning sends the key to, and what resume points are kept by
    rows = (df.withColumn("bucket", F.pmod(F.hash("routing_key"), F.lit(partitions)))
              .repartition(partitions, "routing_key").sortWithinPartitions("batch_id", "ord")
              .mapInArrow(publish_partition, BY_KEY_RESULT_SCHEMA).collect())
    handled: dict[int, int] = {}
    resumed = 0
    for row in rows:
        handled[row["batch_id"]] = handled.get(row["batch_id"], 0) + int(row["handled"])
        resumed += int(row["resumed"])
    return KeyDeliveries(handled, resumed)
