"""PySpark side of delivery: Python data sources reading ``pgstream.events`` with psycopg on the executors (no JDBC jar)
and the two strategies, global order from the driver or parallel per routing key. ``pgstream_batches`` reads ledger
batches in commit order (``batch_id``, ``ord``), ``pgstream_events`` a replay's selection in id order; both in
partitions of at most ``rows_per_partition`` rows, the driver pulling one at a time, so memory stays bounded. With
``packed`` (the ordered path) a partition holds a row per fetch of ``FETCH_ROWS`` events pickled together
(:data:`PACKED_SCHEMA`), not a Spark row per event; payloads stay JSON text to the sink (:attr:`Event.payload_json`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import os
import pickle
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ..sinks import SinkConfig, build_sink
from ..sinks.base import event_from_text
from . import dbconn
from .cluster import cluster_conf, driver_python_problem, is_local, package_zip
from .delivery.reads import (
    BATCH_QUERY,
    FETCH_ROWS,
    READ_BYTES,
    ROWS_PER_PARTITION,
    events_query,
    in_turn,
    routing_params,
    sized_spans,
)
from .publish import (
    CHUNK_BYTES,
    BatchDone,
    Confirmed,
    Position,
    Positioned,
    RejectPolicy,
    SetAsideTooLarge,
    Span,
    publish,
)
from .spark_source import arrow_schema, is_classic, register

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import DataFrame, SparkSession

    from ..config import PgstreamConfig
    from .ledger.keyprogress import KeyProgress

Frames: TypeAlias = "DataFrame | list[DataFrame]"
"""What the loaders return: one DataFrame, or (packed) one single-partition DataFrame per partition."""

BATCHES_SOURCE = "pgstream_batches"
EVENTS_SOURCE = "pgstream_events"
SCHEMA = ("batch_id long, ord long, id long, stream_id long, created_at timestamp, payload string, "
          "metadata string, routing_key string")
# Spark redacts option values whose key matches spark.redaction.regex: the URL never shows in plans or the UI
URL_OPTION = "secret.database_url"
#: one row per fetch: the position of its first event, its event count, and the pickled columns
#: (batch_ids, ords, ids, stream_ids, created_ats, payloads, metadatas) of its events, in order
PACKED_SCHEMA = "batch_id long, ord long, events int, data binary"


def group_sized(pieces: Sequence[tuple[Span, int]], rows: int, budget: int) -> list[list[Span]]:
    """Consecutive :func:`sized_spans` pieces in groups of at most ``rows`` ordinals and ``budget`` bytes (one piece
    at least), in order: a packed partition each, a Spark job reading a group, not one per batch (bench/cpu.py)."""
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


def partition_spans(spans: Sequence[Span], size: int) -> list[Span]:
    """The partitions of ``spans``: at most ``size`` ordinals each, in delivery order."""
    return [part for span in spans for part in span.split(size)]


def _read(url: str, query: str, params: Sequence[dict[str, Any]], packed: bool) -> Iterator[tuple[Any, ...]]:
    """The rows of ``query`` for each of ``params`` in turn, on one connection (``packed``: a row per fetch)."""
    # UTC: created_at comes back as an aware UTC datetime, the same on every machine
    with dbconn.connect(url, options="-c TimeZone=UTC") as conn:
        for one in params:
            with conn.cursor(name="pgstream_read") as cur:
                cur.execute(query, one)
                while rows := cur.fetchmany(FETCH_ROWS):
                    if not packed:
                        yield from rows
                        continue
                    columns = tuple(zip(*rows, strict=True))[:7]  # without routing_key
                    yield rows[0][0], rows[0][1], len(rows), pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL)


class BatchesReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options[URL_OPTION]
        # one partition per group of spans, read in order (``partitions``: the JSON of a list of lists of Span fields)
        self.groups = [[Span(**fields) for fields in group] for group in json.loads(options["partitions"])]
        self.routing = routing_params(options.get("routing_key", "group_id"))
        self.packed = options.get("packed") == "true"

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(group) for group in self.groups]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        yield from _read(self.url, BATCH_QUERY, [{**self.routing, "batch_id": span.batch_id, "lo": span.first,
                                                   "hi": span.last} for span in partition.value], self.packed)


class EventsReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options[URL_OPTION]
        self.ranges: list[tuple[int, int]] = [(int(lo), int(hi)) for lo, hi in json.loads(options["ranges"])]
        self.params: dict[str, Any] = {
            "stream_id": int(options["stream_id"]),
            "from_time": options.get("from_time") or None,
            "to_time": options.get("to_time") or None,
            "keys": json.loads(options["keys"]) if options.get("keys") else None,
            **routing_params(options.get("routing_key", "group_id")),
        }
        self.packed = options.get("packed") == "true"

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(r) for r in self.ranges]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        lo, hi = partition.value
        yield from _read(self.url, events_query(self.params), [{**self.params, "lo": lo, "hi": hi}], self.packed)


class _Source(DataSource):
    NAME: str
    READER: type[BatchesReader | EventsReader]

    @classmethod
    def name(cls) -> str:
        return cls.NAME

    def schema(self) -> str:
        return PACKED_SCHEMA if self.options.get("packed") == "true" else SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return self.READER(dict(self.options))


class BatchesDataSource(_Source):
    """``spark.read.format("pgstream_batches")``: the events of ledger batches, in commit order."""

    NAME, READER = BATCHES_SOURCE, BatchesReader


class EventsDataSource(_Source):
    """``spark.read.format("pgstream_events")``: a stream's events by id ranges and filters, in id order."""

    NAME, READER = EVENTS_SOURCE, EventsReader


#: the Arrow record batches a ``by_key`` task gets (after the repartition by key) hold at most this many
#: bytes as well as ``maxRecordsPerBatch`` (10,000) rows: events large as text would fill the executor
_ARROW_BYTES = {"spark.sql.execution.arrow.maxBytesPerBatch": str(READ_BYTES)}


def spark_conf(master: str, remote: str | None, extra: dict[str, str], *, by_key_parallelism: Sequence[int] = (),
               ship_package: bool = True) -> dict[str, str]:
    """Spark settings for the delivery runs: offline, UTC, the user's ``extra`` over pgstream's defaults, and
    :func:`~pgstream_dagster.engine.cluster.cluster_conf`'s on a cluster; the workers' Python
    (``spark.pyspark.python``, ``$PYSPARK_PYTHON`` or this one) set in this process's environment too."""
    if remote:
        # Spark Connect: the server owns the JVM and workers (pgstream_dagster.sparkserver); session settings only
        return {"spark.remote": remote, "spark.sql.session.timeZone": "UTC", **_ARROW_BYTES, **extra}
    python = extra.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON") or sys.executable
    driver_python = extra.get("spark.pyspark.driver.python") or sys.executable
    os.environ["PYSPARK_PYTHON"] = python
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", driver_python)
    return {
        "spark.app.name": "pgstream-delivery",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": python,
        "spark.pyspark.driver.python": driver_python,
        "spark.sql.shuffle.partitions": "8",
        "spark.driver.extraJavaOptions": "-Dio.netty.tryReflectionSetAccessible=true",
        **_ARROW_BYTES,
        "spark.master": master,
        **extra,
        **cluster_conf(master, extra, by_key_parallelism, ship_package=ship_package),
    }


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

    settings: dict[str, Any] = location_conf(config)
    spark = SparkSession.builder.config(map=settings).getOrCreate()
    register(spark)
    return spark


class DriverPythonMissing(RuntimeError):
    """The Python workers' interpreter is a relative path the run's host does not have
    (:func:`~pgstream_dagster.engine.cluster.driver_python_problem`)."""


class ExecutorPythonError(RuntimeError):
    """The executors' Python cannot run the run's tasks (missing, or lacking a module they import): one line
    naming it and where it is set (``PYSPARK_PYTHON`` / ``spark.pyspark.python``)."""


_NO_PROGRAM = re.compile(r'Cannot run program "([^"]+)"')
_NO_MODULE = re.compile(r"No module named '([^']+)'|the '([^']+)' package is not installed")


@contextlib.contextmanager
def executor_python_errors(spark: SparkSession) -> Iterator[None]:
    """Spark actions whose failure for want of the executors' Python (or a module in it) raises
    :class:`ExecutorPythonError` (one line) instead of Spark's error."""
    try:
        yield
    except Exception as exc:
        if not type(exc).__module__.startswith(("pyspark", "py4j")):
            raise  # raised here, not by the executors
        # the Python the session gives the executors (None on Spark Connect)
        python = str(spark.sparkContext.pythonExec) if is_classic(spark) else None
        where = f"PYSPARK_PYTHON / spark.pyspark.python{f': {python}' if python else ''}"
        requirements = "what `pgstream-dagster executor-requirements --config pgstream.yaml` lists"
        if found := _NO_PROGRAM.search(str(exc)):
            raise ExecutorPythonError(
                f"the Spark executors' Python {found.group(1)!r} is not where the executors run ({where}): "
                f"point it at a Python that has {requirements}") from None
        if found := _NO_MODULE.search(str(exc)):
            module = found.group(1) or found.group(2)
            raise ExecutorPythonError(
                f"the Spark executors' Python ({where}) cannot import {module!r}: install {requirements} "
                f"into it, or point PYSPARK_PYTHON at one that has them") from None
        raise


#: one registration of a Python data source at a time in the process: a check made while another thread
#: registers the same source finds it taken (DATA_SOURCE_ALREADY_EXISTS); a group run's members share a session
_REGISTERING = threading.Lock()


def register_source(spark: SparkSession, source: type[DataSource]) -> None:
    """Register the Python data source ``source`` on ``spark`` (again: Spark replaces it), one thread at a time."""
    with _REGISTERING:
        spark.dataSource.register(source)


def ship_package(spark: SparkSession) -> None:
    """Before a run's Spark reads: on Spark Connect with a cluster master, the package zip added as an artifact once
    a session; classic, :class:`DriverPythonMissing` when the driver cannot start the workers' interpreter."""
    if is_classic(spark):
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


def _load(spark: SparkSession, source: str, database_url: str, routing_key: str, packed: bool,
          **options: str) -> DataFrame:
    return spark.read.format(source).options(**{URL_OPTION: database_url, "routing_key": routing_key,
                                                "packed": "true" if packed else "false", **options}).load()


def load_batches(spark: SparkSession, database_url: str, spans: Sequence[Span], routing_key: str,
                 rows_per_partition: int = ROWS_PER_PARTITION, packed: bool = False, *,
                 sizes: psycopg.Connection | None = None, read_bytes: int = READ_BYTES) -> Frames:
    """The events of ``spans`` in partitions of at most ``rows_per_partition`` events (``sizes``: and bytes):
    ``packed``, a single-partition DataFrame per group of spans (:func:`group_sized`), else one per span."""
    ship_package(spark)
    register_source(spark, BatchesDataSource)

    def frame(groups: list[list[Span]]) -> DataFrame:
        return _load(spark, BATCHES_SOURCE, database_url, routing_key, packed,
                     partitions=json.dumps([[dataclasses.asdict(s) for s in group] for group in groups]))

    if sizes is not None:
        pieces = sized_spans(sizes, spans, rows_per_partition, read_bytes)
    else:  # (cut by ordinals only)
        pieces = [(part, 0) for part in partition_spans(spans, rows_per_partition)]
    if packed:
        return [frame([group]) for group in group_sized(pieces, rows_per_partition, read_bytes)]
    return frame([[piece] for piece, _size in pieces])


def load_events(spark: SparkSession, database_url: str, stream_id: int, ranges: list[tuple[int, int]],
                routing_key: str, from_time: str | None = None, to_time: str | None = None,
                keys: list[str] | None = None, packed: bool = False) -> Frames:
    """A stream's events with ids in ``ranges`` (one partition each, in order) passing the filters;
    ``packed``: in :data:`PACKED_SCHEMA` rows, one single-partition DataFrame per range."""
    ship_package(spark)
    register_source(spark, EventsDataSource)

    def frame(selected: list[tuple[int, int]]) -> DataFrame:
        return _load(spark, EVENTS_SOURCE, database_url, routing_key, packed, stream_id=str(stream_id),
                     ranges=json.dumps(selected), from_time=from_time or "", to_time=to_time or "",
                     keys=json.dumps(keys) if keys else "")

    return [frame([r]) for r in ranges] if packed else frame(ranges)


def _row_event(row: Any) -> Positioned:
    """The event of a row in :data:`SCHEMA` (payload and metadata stay JSON text until a sink parses them)."""
    created = row["created_at"]
    if created.tzinfo is None:
        created = created.replace(tzinfo=dt.UTC)
    return row["batch_id"], row["ord"], event_from_text(row["id"], row["stream_id"], created, row["payload"],
                                                        row["metadata"] or None)


def _packed_events(rows: Iterator[Any]) -> Iterator[Positioned]:
    """Events of rows in :data:`PACKED_SCHEMA`, in order."""
    for row in rows:
        batch_ids, ords, ids, stream_ids, created, payloads, metadatas = pickle.loads(row["data"])
        for i in range(len(ids)):
            yield batch_ids[i], ords[i], event_from_text(ids[i], stream_ids[i], created[i], payloads[i], metadatas[i])


def frame_events(frames: list[DataFrame], prefetch: bool = True) -> Iterator[Positioned]:
    """The events of single-partition DataFrames (packed), in order, each collected whole (``prefetch``: the next
    meanwhile), not ``toLocalIterator``, whose partitions stay on the driver's JVM heap in PySpark 4 (OOM).
    Closed, it waits for the partition collected ahead (left to the collector, it could deadlock on py4j)."""
    if not frames:
        return
    with executor_python_errors(frames[0].sparkSession), \
            contextlib.closing(in_turn([frame.collect for frame in frames], prefetch)) as collected:
        rows = itertools.chain.from_iterable(collected)
        yield from _packed_events(rows) if "data" in frames[0].columns else map(_row_event, rows)


#: what each by_key partition returns: per batch, the events it handled and those an earlier attempt confirmed
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
    """One ``by_key`` partition on an executor: its events published through a sink of its own, each confirmed
    chunk recorded in ``progress`` first (not published again); yields one :data:`BY_KEY_RESULT_SCHEMA` batch."""
    import pyarrow as pa

    first = next((batch for batch in batches if batch.num_rows), None)
    if first is None:
        return
    handled: dict[int, int] = {}
    resumed: dict[int, int] = {}
    buckets: set[int] = set()
    with contextlib.ExitStack() as stack:
        conn = stack.enter_context(progress.connect()) if progress is not None else None
        done = progress.read(conn) if progress is not None and conn is not None else {}

        last: dict[int, int] = {}  # per batch: the ordinal of the last of its rows given to the publisher

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
                    last[batch_id] = row["ord"]
                    yield _row_event(row)

        sink = stack.enter_context(build_sink(sink_config))
        deliveries = stack.enter_context(contextlib.closing(
            publish(sink, rows(), chunk_size, skip=skip, reject=reject, too_large=too_large,
                    chunk_bytes=chunk_bytes)))
        recorded: Position = (0, 0)
        for delivery in deliveries:
            # every event of these buckets up to here is handled (a batch's end is said by its BatchDone)
            if isinstance(delivery, Confirmed):
                position = (delivery.batch_id, delivery.ord)
            elif isinstance(delivery, BatchDone) and delivery.batch_id in last:
                position = (delivery.batch_id, last[delivery.batch_id])
            else:
                continue
            if progress is not None and conn is not None and position > recorded:
                progress.record(conn, sorted(buckets), *position)
                recorded = position
    yield pa.RecordBatch.from_pylist(
        [{"batch_id": b, "handled": n, "resumed": resumed.get(b, 0)} for b, n in handled.items()],
        schema=arrow_schema(BY_KEY_RESULT_SCHEMA))


def deliver_by_key(df: DataFrame, sink_config: SinkConfig, chunk_size: int, parallelism: int, *,
                   skip: frozenset[Position] = frozenset(), reject: RejectPolicy | None = None,
                   progress: KeyProgress | None = None, too_large: SetAsideTooLarge | None = None,
                   chunk_bytes: int = CHUNK_BYTES) -> KeyDeliveries:
    """Per routing key order: repartition by the key into ``parallelism`` partitions (resumed:
    ``progress.partitions``), each published in commit order on an executor through a sink built from
    ``sink_config`` (``reject.set_aside`` and ``too_large`` picklable), counts returned as rows of
    ``mapInArrow`` (classic and Connect); ``progress``: what the sink confirmed, per chunk (:class:`KeyProgress`)."""
    from pyspark.sql import functions as F

    partitions = progress.partitions if progress is not None else parallelism

    def publish_partition(batches: Iterator[Any]) -> Iterator[Any]:
        return _publish_partition(batches, sink_config, chunk_size, skip, reject, progress, too_large, chunk_bytes)

    # bucket: the partition Spark's hash partitioning sends the key to, and what resume points are kept by
    with executor_python_errors(df.sparkSession):
        rows = (df.withColumn("bucket", F.pmod(F.hash("routing_key"), F.lit(partitions)))
                  .repartition(partitions, "routing_key").sortWithinPartitions("batch_id", "ord")
                  .mapInArrow(publish_partition, BY_KEY_RESULT_SCHEMA).collect())
    handled: dict[int, int] = {}
    for row in rows:
        handled[row["batch_id"]] = handled.get(row["batch_id"], 0) + int(row["handled"])
    return KeyDeliveries(handled, sum(int(row["resumed"]) for row in rows))
