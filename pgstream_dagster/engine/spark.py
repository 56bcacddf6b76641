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

import datetime as dt
import json
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ..sinks import Event, SinkConfig
from .publish import BatchDone, Confirmed, Owed, Position, Positioned, RejectPolicy, publish

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
       e.payload #>> %(path)s::text[] as routing_key
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
       e.payload #>> %(path)s::text[] as routing_key
from pgstream.events e
where""" + EVENTS_WHERE + """
order by e.id
"""


@dataclass(frozen=True)
class _Slice(InputPartition):
    """Batch ``key``'s ordinals ``lo..hi`` (pgstream_batches) or event ids ``lo..hi`` (pgstream_events)."""
    key: int
    lo: int
    hi: int


def batch_slices(batches: list[tuple[int, int, int]], size: int) -> list[_Slice]:
    """Partitions of ``batches`` ``(batch_id, event_count, confirmed)``: ordinals after the
    confirmed ones, at most ``size`` each, in delivery order."""
    return [_Slice(batch_id, lo, min(lo + size - 1, count))
            for batch_id, count, done in batches for lo in range(done + 1, count + 1, size)]


def _fetch(url: str, query: str, params: dict[str, Any]) -> Iterator[list[tuple[Any, ...]]]:
    import psycopg

    # UTC: created_at comes back as an aware UTC datetime, the same on every machine
    with (psycopg.connect(url, options="-c TimeZone=UTC") as conn,
          conn.cursor(name="pgstream_read") as cur):
        cur.execute(query, params)
        while rows := cur.fetchmany(FETCH_ROWS):
            yield rows


def _read(url: str, query: str, params: dict[str, Any], packed: bool) -> Iterator[tuple[Any, ...]]:
    for rows in _fetch(url, query, params):
        if packed:
            columns = tuple(zip(*rows, strict=True))[:7]  # without routing_key
            yield rows[0][0], rows[0][1], len(rows), pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            yield from rows


class BatchesReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options[URL_OPTION]
        # (batch id, event count, events already confirmed: reading starts after them)
        self.batches: list[tuple[int, int, int]] = [(int(b), int(c), int(d))
                                                    for b, c, d in json.loads(options["batches"])]
        self.size = int(options.get("rows_per_partition", ROWS_PER_PARTITION))
        self.path = options.get("routing_key", "group_id").split(".")
        self.packed = options.get("packed") == "true"
        self.slices = [_Slice(*s) for s in json.loads(options["slices"])] if options.get("slices") else None

    def partitions(self) -> list[_Slice]:
        return list(self.slices) if self.slices is not None else batch_slices(self.batches, self.size)

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _Slice)
        yield from _read(self.url, _BATCH_QUERY, {"path": self.path, "batch_id": partition.key,
                                                  "lo": partition.lo, "hi": partition.hi}, self.packed)


class EventsReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options[URL_OPTION]
        self.ranges: list[tuple[int, int]] = [(int(lo), int(hi)) for lo, hi in json.loads(options["ranges"])]
        self.params: dict[str, Any] = {
            "stream_id": int(options["stream_id"]),
            "from_time": options.get("from_time") or None,
            "to_time": options.get("to_time") or None,
            "keys": json.loads(options["keys"]) if options.get("keys") else None,
            "path": options.get("routing_key", "group_id").split("."),
        }
        self.packed = options.get("packed") == "true"

    def partitions(self) -> list[InputPartition]:
        return [_Slice(0, lo, hi) for lo, hi in self.ranges]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _Slice)
        yield from _read(self.url, _EVENTS_QUERY, {**self.params, "lo": partition.lo, "hi": partition.hi},
                         self.packed)


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


def load_batches(spark: SparkSession, database_url: str, batches: list[tuple[int, int, int]], routing_key: str,
                 rows_per_partition: int = ROWS_PER_PARTITION, packed: bool = False) -> Frames:
    """The events of ``batches`` (``(batch_id, event_count, confirmed_count)`` in delivery order),
    without the first ``confirmed_count`` of each. ``packed``: in :data:`PACKED_SCHEMA` rows, as
    one single-partition DataFrame per partition, in order (see :func:`deliver_in_order`)."""
    spark.dataSource.register(BatchesDataSource)

    def frame(slices: list[_Slice] | None) -> DataFrame:
        reader = (spark.read.format(BATCHES_SOURCE)
                  .option(URL_OPTION, database_url)
                  .option("batches", json.dumps(batches))
                  .option("routing_key", routing_key)
                  .option("rows_per_partition", str(rows_per_partition))
                  .option("packed", "true" if packed else "false"))
        if slices is not None:
            reader = reader.option("slices", json.dumps([[x.key, x.lo, x.hi] for x in slices]))
        return reader.load()

    if not packed:
        return frame(None)
    return [frame([x]) for x in batch_slices(batches, rows_per_partition)]


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


def deliver_in_order(frames: list[DataFrame], sink_config: SinkConfig, chunk_size: int,
                     on_batch_done: BatchDone | None = None,
                     on_progress: Callable[[int], None] | None = None,
                     on_confirmed: Confirmed | None = None, prefetch: bool = True, *,
                     skip: frozenset[Position] = frozenset(), reject: RejectPolicy | None = None,
                     owed: Owed | None = None) -> int:
    """Global order: the partitions come to the driver one at a time, in order (no shuffle), and
    are published chunk by chunk (:func:`pgstream_dagster.engine.publish.publish`: ``skip``, ``reject``
    and ``owed`` are explained there). ``frames``: one single-partition DataFrame per partition, as
    :func:`load_batches` / :func:`load_events` return them packed. ``prefetch``: Spark computes the
    next partition while the driver publishes the current one (memory: two partitions instead of
    one). Returns the events handled (confirmed, set aside or skipped)."""
    rows: Iterator[Any] = _collected(frames, prefetch)
    packed = bool(frames) and is_packed(frames[0])
    events = _packed_events(rows) if packed else _row_events(rows)
    return publish(sink_config, events, chunk_size, on_batch_done=on_batch_done, on_progress=on_progress,
                   on_confirmed=on_confirmed, skip=skip, reject=reject, owed=owed)


def deliver_by_key(df: DataFrame, sink_config: SinkConfig, chunk_size: int, parallelism: int, *,
                   skip: frozenset[Position] = frozenset(), reject: RejectPolicy | None = None) -> int:
    """Per routing key order: partitions by the key, each partition publishes its events in
    commit order on an executor. Events of one key never reorder; keys proceed in parallel.
    ``reject.set_aside`` runs on the executors (it must be picklable). Returns the events handled."""
    counter = df.sparkSession.sparkContext.accumulator(0)

    def publish_partition(rows: Iterator[Any]) -> None:
        counter.add(publish(sink_config, _row_events(rows), chunk_size, skip=skip, reject=reject))

    (df.repartition(parallelism, "routing_key").sortWithinPartitions("batch_id", "ord")
       .foreachPartition(publish_partition))
    return int(counter.value)
