"""Ordered delivery does not keep what it delivered on the Spark driver's heap: an open run or a
large replay delivers many partitions through one long-lived session (toLocalIterator, used
before, kept every served partition on the JVM heap until an OutOfMemoryError)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
from pyspark.sql import SparkSession

from pgstream_dagster.engine import spark
from pgstream_dagster.engine.delivery.sources import SparkSource, publish_in_order
from pgstream_dagster.engine.publish import Span
from pgstream_dagster.sinks.file import FileSinkConfig

from .support.sinks import drain


def _heap_used_mb(session: SparkSession) -> float:
    jvm = session.sparkContext._jvm
    assert jvm is not None
    runtime = jvm.java.lang.Runtime.getRuntime()
    for _ in range(3):
        jvm.java.lang.System.gc()
        time.sleep(0.3)
    return float(runtime.totalMemory() - runtime.freeMemory()) / 1e6


def test_ordered_delivery_keeps_the_driver_heap_flat(db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url) as c:
        c.execute("select pgstream.ensure_stream(1)")
        c.execute("insert into pgstream.events (payload, stream_id) "
                  "select jsonb_build_object('n', g, 'pad', repeat('x', 2000)), 1 from generate_series(1, 2000) g")
        (batch,) = c.execute(
            "insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
            "min_created_at, max_created_at) select 1, array_agg(id order by id), count(*), min(id), max(id), "
            "min(created_at), max(created_at) from pgstream.events returning id").fetchone() or ()
    builder = SparkSession.builder
    for key, value in spark.spark_conf("local[2]", None, {}).items():  # as the runs' resource does
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    sink = FileSinkConfig(path=str(tmp_path / "out.jsonl")).build()  # one sink for every round, as a run's
    frames = spark.load_batches(session, db_url, [Span(batch, 1, 2000)], "group_id", rows_per_partition=500,
                                packed=True)
    assert isinstance(frames, list) and len(frames) == 4  # one single-partition DataFrame per 500 events
    assert drain(publish_in_order(SparkSource(frames), sink, 500)) == 2000  # warm-up
    before = _heap_used_mb(session)
    rounds = 25  # 100 partitions, ~400 MB of payload moved through the driver
    for _ in range(rounds):
        frames = spark.load_batches(session, db_url, [Span(batch, 1, 2000)], "group_id", rows_per_partition=500,
                                    packed=True)
        assert isinstance(frames, list)
        assert drain(publish_in_order(SparkSource(frames), sink, 500)) == 2000
    sink.close()
    grown = _heap_used_mb(session) - before
    lines = (tmp_path / "out.jsonl").read_text().count("\n")
    assert lines == 2000 * (rounds + 1)
    assert grown < 60, f"the driver heap grew {grown:.0f} MB over {rounds} rounds"


def test_spark_partitions_are_bounded_by_bytes(db_url: str, tmp_path: Path) -> None:
    """Events of 3 MiB as text (a few KiB stored): with a read budget of 8 MiB a partition (read whole by
    an executor, collected whole by the driver) holds two of them, not rows_per_partition."""
    with psycopg.connect(db_url) as c:
        c.execute("select pgstream.ensure_stream(1)")
        c.execute("insert into pgstream.events (payload, stream_id) "
                  "select jsonb_build_object('n', g, 'pad', repeat('x', 3145728)), 1 "
                  "from generate_series(1, 7) g")
        (batch,) = c.execute(
            "insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
            "min_created_at, max_created_at) select 1, array_agg(id order by id), count(*), min(id), max(id), "
            "min(created_at), max(created_at) from pgstream.events returning id").fetchone() or ()
        ids = [r[0] for r in c.execute("select id from pgstream.events order by id")]
        builder = SparkSession.builder
        for key, value in spark.spark_conf("local[2]", None, {}).items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        frames = spark.load_batches(session, db_url, [Span(batch, 1, 7)], "group_id", rows_per_partition=500,
                                    packed=True, sizes=c, read_bytes=8 * 2**20)
    assert isinstance(frames, list) and len(frames) == 4  # 2 + 2 + 2 + 1 events
    with FileSinkConfig(path=str(tmp_path / "out.jsonl")).build() as sink:
        assert drain(publish_in_order(SparkSource(frames), sink, 500)) == 7
    with (tmp_path / "out.jsonl").open() as f:
        assert [json.loads(line)["id"] for line in f] == ids
