"""Child process of the Spark source tests: a streaming query ``readStream.format("pgstream")`` →
Parquet with a checkpoint, on the Spark of ``conf`` (local, a standalone master, or ``spark.remote``).

Usage: python -m tests.support.spark_source_child SPEC.json

``mode`` ``forever``: runs until killed. ``until_caught_up``: runs until the consumer's position is
the end of the stream's ledger, then stops the query and exits 0. ``available_now``: runs with
``Trigger.AvailableNow`` (up to the ledger's end when it starts) and exits 0 when the query stops.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psycopg

from pgstream_dagster.engine.spark import spark_conf
from pgstream_dagster.engine.spark_source import register


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    conf = dict(spec["conf"])
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    settings = spark_conf(conf.pop("spark.master", "local[2]"), conf.pop("spark.remote", None), conf)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    register(spark)
    reader = (spark.readStream.format("pgstream").option("url", spec["url"]).option("stream", str(spec["stream"]))
              .option("consumer", spec["consumer"]).option("consumerToken", spec["token"])
              .option("startingPosition", "earliest")
              .option("maxEventsPerTrigger", str(spec["max_events"]))
              .option("numPartitions", str(spec["partitions"])))
    writer = (reader.load().writeStream.format("parquet").option("path", spec["out"])
              .option("checkpointLocation", spec["checkpoint"]))
    if spec["mode"] == "available_now":  # up to the ledger's end when it starts, then the query stops by itself
        writer.trigger(availableNow=True).start().awaitTermination()
        spark.stop()
        return
    query = writer.trigger(processingTime="500 milliseconds").start()
    if spec["mode"] == "forever":
        query.awaitTermination()
        return
    owner_url = spec.get("owner_url", spec["url"])
    while True:
        assert query.exception() is None, query.exception()
        with psycopg.connect(owner_url) as c:
            row = c.execute(
                "select (select lag_events from pgstream.consumer_status where name = %s), "
                "(select count(*) from pgstream.batches where stream_id = %s)", [spec["consumer"], spec["stream"]]
            ).fetchone()
        if row is not None and row[0] == 0 and row[1]:
            break
        time.sleep(0.5)
    query.stop()
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1])
