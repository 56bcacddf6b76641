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

import dataclasses
import datetime as dt
import json
import os
import pickle
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeAlias

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ..sinks import Event, Sink, SinkConfig, build_sink
from ..sinks.base import parse_event_path
from .publish import Deliveries, Position, Positioned, RejectPolicy, Span, drain, publish

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

Frames: TypeAlias = "DataFrame | list[DataFrame]"
"""What the loaders return: one DataFrame, or (packed) one single-partition DataFrame per partition."""

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

_BATCH_QUERY = """
select b.id, o.ord, e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text,
       (case when %(routing_source)s::text = 'metadata' then e.metadata else e.payload end) #>> %(path)s::text[]
           as routing_key
from pgstream.batches b
cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
join pgstream.events e
  on e.id = o.id and e.stream_id = b.stream_id
 and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at
where b.id = %(batch_id)s and o.ord between %(lo)s and %(hi)s
order by o.ord
"""

#: the replay selection (shared with replay.plan, which counts and splits it)
EVENTS_WHERE = """
    e.stream_id = %(stream_id)s
    and e.id between %(lo)s and %(hi)s
    and (%(from_time)s::timestamptz is null or e.created_at >= %(from_time)s::timestamptz)
    and (%(to_time)s::timestamptz is null or e.created_at < %(to_time)s::timestamptz)
    and (%(keys)s::text[] is null or e.payload ->> 'tg_name' = any (%(keys)s::text[]))"""

_EVENTS_QUERY = """
select 0::bigint, e.id, e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text,
       (case when %(routing_source)s::text = 'metadata' then e.metadata else e.payload end) #>> %(path)s::text[]
           as routing_key
from pgstream.events e
where""" + EVENTS_WHERE + """
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
        yield from _read(self.url, _EVENTS_QUERY, [{**self.params, "lo": lo, "hi": hi}], self.packed)


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


def spark_conf(master: str, remote: str | None, extra: dict[str, str]) -> dict[str, str]:
    """Spark settings for the delivery runs: offline, UTC, and the workers use this interpreter."""
    if remote:
        # Spark Connect: the server owns the JVM and its Python workers (pgstream_dagster.sparkserver);
        # a session may only set session settings
        return {"spark.remote": remote, "spark.sql.session.timeZone": "UTC", **extra}
    # Python workers of a local Spark are started from the environment, not only from the conf
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    conf = {
        "spark.app.name": "pgstream-delivery",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.sql.shuffle.partitions": "8",
        "spark.driver.extraJavaOptions": "-Dio.netty.tryReflectionSetAccessible=true",
    }
    conf["spark.master"] = master
    conf.update(extra)
    return conf


def load_batches(spark: SparkSession, database_url: str, spans: Sequence[Span], routing_key: str,
                 rows_per_partition: int = ROWS_PER_PARTITION, packed: bool = False) -> Frames:
    """The events of ``spans`` (what a run owes of each batch, in delivery order: see
    :func:`~pgstream_dagster.engine.publish.owed_spans`), in partitions of at most
    ``rows_per_partition`` events. ``packed``: in :data:`PACKED_SCHEMA` rows, as one
    single-partition DataFrame per partition, in order (see :func:`deliver_in_order`), a partition
    reading consecutive spans up to ``rows_per_partition`` events (:func:`group_spans`); else one
    partition per span (:func:`partition_spans`)."""
    spark.dataSource.register(BatchesDataSource)

    def frame(groups: list[list[Span]]) -> DataFrame:
        return (spark.read.format(BATCHES_SOURCE)
                .option(URL_OPTION, database_url)
                .option("partitions", json.dumps([[dataclasses.asdict(s) for s in group] for group in groups]))
                .option("routing_key", routing_key)
                .option("packed", "true" if packed else "false")
                .load())

    if packed:
        return [frame([group]) for group in group_spans(spans, rows_per_partition)]
    return frame([[part] for part in partition_spans(spans, rows_per_partition)])


def load_events(spark: SparkSession, database_url: str, stream_id: int, ranges: list[tuple[int, int]],
                routing_key: str, from_time: str | None = None, to_time: str | None = None,
                keys: list[str] | None = None, packed: bool = False) -> Frames:
    """A stream's events with ids in ``ranges`` (one partition each, in order) passing the filters;
    ``packed``: in :data:`PACKED_SCHEMA` rows, one single-partition DataFrame per range."""
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
        yield row["batch_id"], row["ord"], Event(row["id"], row["stream_id"], None, None, created,
                                                 payload_json=row["payload"], metadata_json=row["metadata"] or None)


def _packed_events(rows: Iterator[Any]) -> Iterator[Positioned]:
    """Events of rows in :data:`PACKED_SCHEMA`, in order."""
    for row in rows:
        batch_ids, ords, ids, stream_ids, created, payloads, metadatas = pickle.loads(row["data"])
        for i in range(len(ids)):
            yield batch_ids[i], ords[i], Event(ids[i], stream_ids[i], None, None, created[i],
                                               payload_json=payloads[i], metadata_json=metadatas[i])


def is_packed(df: DataFrame) -> bool:
    return "data" in df.columns



def _collected(frames: list[DataFrame], prefetch: bool) -> Iterator[Any]:
    """The rows of single-partition DataFrames, in order, each collected whole; ``prefetch``: the
    next one is collected (by Spark, in a thread) while the caller consumes the current one.

    Not ``toLocalIterator``: in PySpark 4 every partition it serves stays on the driver's JVM heap
    (measured: ~4 MB retained per 4 MB partition, an OutOfMemoryError after ~200 partitions with
    the default 1 GB heap), which a long-lived run or a large replay cannot afford;
    ``collect()`` of one partition at a time keeps the heap flat."""
    if not frames:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgstream-prefetch") as pool:
        ahead = pool.submit(frames[0].collect)
        for i in range(len(frames)):
            rows = ahead.result()
            more = i + 1 < len(frames)
            if more and prefetch:
                ahead = pool.submit(frames[i + 1].collect)
            yield from rows
            if more and not prefetch:
                ahead = pool.submit(frames[i + 1].collect)


def deliver_in_order(frames: list[DataFrame], sink: Sink, chunk_size: int, *, prefetch: bool = True,
                     skip: frozenset[Position] = frozenset(), reject: RejectPolicy | None = None,
                     owed: Sequence[Span] | None = None) -> Deliveries:
    """Global order: the partitions come to the driver one at a time, in order (no shuffle), and
    are published chunk by chunk through ``sink`` (the caller's; a run keeps one for its whole life)
    by :func:`pgstream_dagster.engine.publish.publish`, whose deliveries this yields (``skip``,
    ``reject`` and ``owed`` are explained there). ``frames``: one single-partition DataFrame per
    partition, as :func:`load_batches` / :func:`load_events` return them packed. ``prefetch``: Spark
    computes the next partition while the driver publishes the current one (memory: two partitions
    instead of one)."""
    rows: Iterator[Any] = _collected(frames, prefetch)
    packed = bool(frames) and is_packed(frames[0])
    events = _packed_events(rows) if packed else _row_events(rows)
    yield from publish(sink, events, chunk_size, skip=skip, reject=reject, owed=owed)


def deliver_by_key(df: DataFrame, sink_config: SinkConfig, chunk_size: int, parallelism: int, *,
                   skip: frozenset[Position] = frozenset(), reject: RejectPolicy | None = None) -> int:
    """Per routing key order: partitions by the key, each partition publishes its events in
    commit order on an executor, through a sink of its own (built from ``sink_config`` by
    :func:`~pgstream_dagster.sinks.build_sink`, as the run's, and closed when the partition is
    done). Events of one key never reorder; keys proceed in parallel. ``reject.set_aside`` runs on
    the executors (it must be picklable). Returns the events handled."""
    counter = df.sparkSession.sparkContext.accumulator(0)

    def publish_partition(rows: Iterator[Any]) -> None:
        with build_sink(sink_config) as sink:
            counter.add(drain(publish(sink, _row_events(rows), chunk_size, skip=skip, reject=reject)))

    (df.repartition(parallelism, "routing_key").sortWithinPartitions("batch_id", "ord")
       .foreachPartition(publish_partition))
    return int(counter.value)
