"""PySpark side of delivery: Python data sources that read events from ``pgstream.events``
(psycopg on the executors; no JDBC jar, nothing downloaded) and the two delivery strategies:
global order from the driver, or parallel per routing key.

* ``pgstream_batches``: the events of ledger batches, in commit order (``batch_id``, ``ord``);
* ``pgstream_events``: events selected by id range / time range / subscription key, in id order
  (replay).

Both split their input into partitions of at most ``rows_per_partition`` rows, read with a
server-side cursor; the driver pulls one partition at a time, so memory stays bounded whatever
the size of the backlog.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from .sinks import Event, SinkConfig

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

BATCHES_SOURCE = "pgstream_batches"
EVENTS_SOURCE = "pgstream_events"
SCHEMA = ("batch_id long, ord long, id long, stream_id long, created_at timestamp, payload string, "
          "metadata string, routing_key string")
# Spark redacts option values whose key matches spark.redaction.regex ("secret", "password", ...),
# so the database URL never shows in plans or the Spark UI.
URL_OPTION = "secret.database_url"
ROWS_PER_PARTITION = 20_000

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


def _read(url: str, query: str, params: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url) as conn, conn.cursor(name="pgstream_read") as cur:
        cur.itersize = 2000
        cur.execute(query, params)
        yield from cur


class BatchesReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options[URL_OPTION]
        # (batch id, event count, events already confirmed: reading starts after them)
        self.batches: list[tuple[int, int, int]] = [(int(b), int(c), int(d))
                                                    for b, c, d in json.loads(options["batches"])]
        self.size = int(options.get("rows_per_partition", ROWS_PER_PARTITION))
        self.path = options.get("routing_key", "group_id").split(".")

    def partitions(self) -> list[InputPartition]:
        return [_Slice(batch_id, lo, min(lo + self.size - 1, count))
                for batch_id, count, done in self.batches for lo in range(done + 1, count + 1, self.size)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _Slice)
        yield from _read(self.url, _BATCH_QUERY, {"path": self.path, "batch_id": partition.key,
                                                  "lo": partition.lo, "hi": partition.hi})


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

    def partitions(self) -> list[InputPartition]:
        return [_Slice(0, lo, hi) for lo, hi in self.ranges]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _Slice)
        yield from _read(self.url, _EVENTS_QUERY, {**self.params, "lo": partition.lo, "hi": partition.hi})


class BatchesDataSource(DataSource):
    """``spark.read.format("pgstream_batches")``: the events of ledger batches, in commit order."""

    @classmethod
    def name(cls) -> str:
        return BATCHES_SOURCE

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return BatchesReader(dict(self.options))


class EventsDataSource(DataSource):
    """``spark.read.format("pgstream_events")``: a stream's events by id ranges and filters, in id order."""

    @classmethod
    def name(cls) -> str:
        return EVENTS_SOURCE

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return EventsReader(dict(self.options))


def spark_conf(master: str, remote: str | None, extra: dict[str, str]) -> dict[str, str]:
    """Spark settings for the delivery runs: offline, UTC, and the workers use this interpreter."""
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
    if remote:
        conf["spark.remote"] = remote
    else:
        conf["spark.master"] = master
    conf.update(extra)
    return conf


def load_batches(spark: SparkSession, database_url: str, batches: list[tuple[int, int, int]], routing_key: str,
                 rows_per_partition: int = ROWS_PER_PARTITION) -> DataFrame:
    """The events of ``batches`` (``(batch_id, event_count, confirmed_count)`` in delivery order),
    without the first ``confirmed_count`` of each."""
    spark.dataSource.register(BatchesDataSource)
    return (spark.read.format(BATCHES_SOURCE)
            .option(URL_OPTION, database_url)
            .option("batches", json.dumps(batches))
            .option("routing_key", routing_key)
            .option("rows_per_partition", str(rows_per_partition))
            .load())


def load_events(spark: SparkSession, database_url: str, stream_id: int, ranges: list[tuple[int, int]],
                routing_key: str, from_time: str | None = None, to_time: str | None = None,
                keys: list[str] | None = None) -> DataFrame:
    """A stream's events with ids in ``ranges`` (one partition each, in order) passing the filters."""
    spark.dataSource.register(EventsDataSource)
    return (spark.read.format(EVENTS_SOURCE)
            .option(URL_OPTION, database_url)
            .option("stream_id", str(stream_id))
            .option("ranges", json.dumps(ranges))
            .option("from_time", from_time or "")
            .option("to_time", to_time or "")
            .option("keys", json.dumps(keys) if keys else "")
            .option("routing_key", routing_key)
            .load())


def _event(row: Any) -> Event:
    created = row["created_at"]
    if created.tzinfo is None:
        created = created.replace(tzinfo=dt.UTC)
    return Event(id=row["id"], stream_id=row["stream_id"], payload=json.loads(row["payload"]),
                 metadata=json.loads(row["metadata"]) if row["metadata"] else None, created_at=created)


BatchDone = Callable[[int, int], None]
"""Called with ``(batch_id, events)`` once the sink confirmed every event of a batch."""
Confirmed = Callable[[int, int], None]
"""Called after every confirmed publish with the ``(batch_id, ord)`` of its last event."""


class OrderError(RuntimeError):
    """Rows reached the driver out of order: nothing after them is published."""


def _publish_rows(sink_config: SinkConfig, rows: Iterator[Any], chunk_size: int,
                  on_batch_done: BatchDone | None = None, on_progress: Callable[[int], None] | None = None,
                  on_confirmed: Confirmed | None = None) -> int:
    """Publish rows (already in the order owed) in chunks through a fresh sink; returns the count
    the sink confirmed. Raises on the first chunk the sink rejects. A batch is reported done only
    after the publish call that carried its last event returned."""
    sink = sink_config.build()
    count = 0
    chunk: list[Event] = []
    finished: list[tuple[int, int]] = []  # batches whose last event is in ``chunk``
    current: int | None = None
    in_current = 0
    last: tuple[int, int] | None = None

    def flush() -> None:
        nonlocal count, chunk, finished
        if chunk:
            sink.publish(chunk)
            count += len(chunk)
            chunk = []
            if on_confirmed is not None and last is not None:
                on_confirmed(*last)
            if on_progress is not None:
                on_progress(count)
        for batch_id, n in finished:
            if on_batch_done is not None:
                on_batch_done(batch_id, n)
        finished = []

    try:
        for row in rows:
            position = (row["batch_id"], row["ord"])
            if last is not None and position <= last:
                raise OrderError(f"row {position} arrived after {last}: refusing to publish out of order")
            last = position
            if row["batch_id"] != current:
                if current is not None:
                    finished.append((current, in_current))
                current, in_current = row["batch_id"], 0
            chunk.append(_event(row))
            in_current += 1
            if len(chunk) >= chunk_size:
                flush()
        if current is not None:
            finished.append((current, in_current))
        flush()
    finally:
        sink.close()
    return count


def deliver_in_order(df: DataFrame, sink_config: SinkConfig, chunk_size: int,
                     on_batch_done: BatchDone | None = None,
                     on_progress: Callable[[int], None] | None = None,
                     on_confirmed: Confirmed | None = None) -> int:
    """Global order: the partitions come to the driver one at a time, in order (no shuffle, so
    memory is bounded by one partition), and are published chunk by chunk."""
    return _publish_rows(sink_config, df.toLocalIterator(prefetchPartitions=False), chunk_size,
                         on_batch_done, on_progress, on_confirmed)


def deliver_by_key(df: DataFrame, sink_config: SinkConfig, chunk_size: int, parallelism: int) -> int:
    """Per routing key order: partitions by the key, each partition publishes its events in
    commit order on an executor. Events of one key never reorder; keys proceed in parallel."""
    counter = df.sparkSession.sparkContext.accumulator(0)

    def publish_partition(rows: Iterator[Any]) -> None:
        counter.add(_publish_rows(sink_config, rows, chunk_size))

    (df.repartition(parallelism, "routing_key").sortWithinPartitions("batch_id", "ord")
       .foreachPartition(publish_partition))
    return int(counter.value)
