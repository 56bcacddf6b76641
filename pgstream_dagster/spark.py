"""PySpark side of delivery: a Python data source that reads a ledger batch from
``pgstream.events`` (psycopg on the executors; no JDBC jar, nothing downloaded), and the two
delivery strategies: global commit order from the driver, or parallel per routing key.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from .sinks import Event, SinkConfig

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SOURCE_NAME = "pgstream_batch"
SCHEMA = ("ord long, id long, stream_id long, created_at timestamp, payload string, metadata string, "
          "routing_key string")
# Spark redacts option values whose key matches spark.redaction.regex ("secret", "password", ...),
# so the database URL never shows in plans or the Spark UI.
URL_OPTION = "secret.database_url"

_QUERY = """
select o.ord, e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text,
       e.payload #>> %(path)s::text[] as routing_key
from pgstream.batches b
cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
join pgstream.events e
  on e.id = o.id and e.stream_id = b.stream_id
 and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at
where b.id = %(batch_id)s and o.ord between %(lo)s and %(hi)s
order by o.ord
"""


@dataclass(frozen=True)
class _Range(InputPartition):
    lo: int
    hi: int


class BatchEventsReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options[URL_OPTION]
        self.batch_id = int(options["batch_id"])
        self.count = int(options["event_count"])
        self.parts = max(1, min(int(options.get("num_partitions", "1")), self.count))
        self.path = options.get("routing_key", "group_id").split(".")

    def partitions(self) -> list[InputPartition]:
        step = -(-self.count // self.parts)
        return [_Range(lo, min(lo + step - 1, self.count)) for lo in range(1, self.count + 1, step)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        import psycopg

        assert isinstance(partition, _Range)
        with psycopg.connect(self.url) as conn, conn.cursor(name="pgstream_batch_read") as cur:
            cur.itersize = 2000
            cur.execute(_QUERY, {"path": self.path, "batch_id": self.batch_id,
                                 "lo": partition.lo, "hi": partition.hi})
            yield from cur


class BatchEventsDataSource(DataSource):
    """``spark.read.format("pgstream_batch")``: the events of one ledger batch, with their
    commit-order ordinal ``ord``."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return BatchEventsReader(dict(self.options))


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


def load_batch(spark: SparkSession, database_url: str, batch_id: int, event_count: int,
               routing_key: str, num_partitions: int) -> DataFrame:
    spark.dataSource.register(BatchEventsDataSource)
    return (spark.read.format(SOURCE_NAME)
            .option(URL_OPTION, database_url)
            .option("batch_id", str(batch_id))
            .option("event_count", str(event_count))
            .option("routing_key", routing_key)
            .option("num_partitions", str(num_partitions))
            .load())


def _event(row: Any) -> Event:
    created = row["created_at"]
    if created.tzinfo is None:
        created = created.replace(tzinfo=dt.UTC)
    return Event(id=row["id"], stream_id=row["stream_id"], payload=json.loads(row["payload"]),
                 metadata=json.loads(row["metadata"]) if row["metadata"] else None, created_at=created)


def _publish_rows(sink_config: SinkConfig, rows: Iterator[Any], chunk_size: int) -> int:
    """Publish rows (already in the order owed) in chunks through a fresh sink; returns the count
    the sink confirmed. Raises on the first chunk the sink rejects."""
    sink = sink_config.build()
    count = 0
    try:
        chunk: list[Event] = []
        for row in rows:
            chunk.append(_event(row))
            if len(chunk) >= chunk_size:
                sink.publish(chunk)
                count += len(chunk)
                chunk = []
        if chunk:
            sink.publish(chunk)
            count += len(chunk)
    finally:
        sink.close()
    return count


def deliver_in_order(df: DataFrame, sink_config: SinkConfig, chunk_size: int) -> int:
    """Global commit order: stream the ordered rows to the driver and publish chunk by chunk."""
    return _publish_rows(sink_config, df.orderBy("ord").toLocalIterator(), chunk_size)


def deliver_by_key(df: DataFrame, sink_config: SinkConfig, chunk_size: int, parallelism: int) -> int:
    """Per routing key order: partitions by the key, each partition publishes its events in
    commit order on an executor. Events of one key never reorder; keys proceed in parallel."""
    counter = df.sparkSession.sparkContext.accumulator(0)

    def publish_partition(rows: Iterator[Any]) -> None:
        counter.add(_publish_rows(sink_config, rows, chunk_size))

    (df.repartition(parallelism, "routing_key").sortWithinPartitions("ord")
       .foreachPartition(publish_partition))
    return int(counter.value)
