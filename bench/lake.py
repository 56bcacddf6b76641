"""Lake sinks: events per second into each lake sink (delta, iceberg, parquet) against writing the
same Arrow data directly with the same library, side by side in one run (run by hand: `make
bench-lake`). Each round publishes N events in publish calls of CHUNK (ledger positions, as a delivery
run does) through a fresh sink into a new table: the sink builds the Arrow table of each call from the
events, reads the stream's token once and commits with it. The direct baseline writes the same Arrow
tables (built before the clock starts) with the library's plain append: ``write_deltalake`` with
``partition_by day``, ``Table.append`` of pyiceberg, ``pyarrow.parquet.write_table`` per day with the file
and its directory fsynced (as the sink's files are). Iceberg's
SQL catalog is a database of the Postgres on 127.0.0.1:5432. Each round also times building the calls' Arrow
tables from fresh events as the sink does, writing nothing, and of it the pass of Arrow's JSON reader that takes the
``tg_*`` columns from the payloads: the direct time over the direct time plus that one is the most a sink given the
events could reach. Results are appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, commit, machine

from pgstream_dagster.sinks import Event, build_sink
from pgstream_dagster.sinks.base import event_columns, event_from_text
from pgstream_dagster.sinks.file import fsync_path
from pgstream_dagster.sinks.lake import events_table, payload_columns

HERE = Path(__file__).resolve().parent
SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
CATALOG_DB = "pgstream_bench_lake"


def make_events(n: int) -> list[Event]:
    """``n`` events of one stream over two UTC days, their payloads as a delivery run reads them
    (``payload::text`` of the jsonb: keys by length, then bytes; ``": "`` and ``", "``)."""
    start = dt.datetime(2026, 11, 26, 12, tzinfo=dt.UTC)
    return [event_from_text(i, 1, start + dt.timedelta(seconds=i * 86400 * 2 // n), (
        f'{{"new": {{"id": {i}, "note": "hello world", "amount": 42.5, "customer": "c-17"}}, "old": null, '
        f'"tg_op": "INSERT", "tg_name": "orders", "timestamp": 1764158400000, "tg_table_name": "orders", '
        f'"tg_table_schema": "public"}}'), None) for i in range(1, n + 1)]


def _catalog_url() -> str:
    with psycopg.connect(SERVER, autocommit=True) as conn:
        if not conn.execute("select 1 from pg_database where datname = %s", [CATALOG_DB]).fetchone():
            conn.execute(f"create database {CATALOG_DB}")
    return SERVER.rsplit("/", 1)[0] + "/" + CATALOG_DB


def sink_config(kind: str, root: Path, catalog_url: str) -> dict[str, Any]:
    name = f"t{uuid.uuid4().hex[:10]}"
    if kind == "iceberg":
        return {"type": "iceberg", "catalog_url": catalog_url, "warehouse": f"file://{root}",
                "table": f"bench.{name}", "catalog_name": "bench"}
    return {"type": kind, "path": str(root / name)}


def through_sink(config: dict[str, Any], events: list[Event], chunk: int) -> tuple[float, float]:
    """Seconds and CPU-seconds of this process to publish ``events`` through a fresh sink (positions:
    batches of ``chunk``)."""
    with build_sink(config) as sink:
        started, cpu = time.perf_counter(), time.process_time()
        for n, start in enumerate(range(0, len(events), chunk), start=1):
            part = events[start:start + chunk]
            sink.publish_at(part, [(n, i) for i in range(1, len(part) + 1)])
        return time.perf_counter() - started, time.process_time() - cpu


def building(events: list[Event], chunk: int, json_only: bool) -> float:
    """Seconds to build the Arrow table of each publish call from ``events``
    as the sink does (``json_only``: only the pass of Arrow's JSON reader over the payloads that gives the
    table's operation, schema, table and subscription columns), writing nothing."""
    started = time.perf_counter()
    for start in range(0, len(events), chunk):
        part = events[start:start + chunk]
        if json_only:
            payload_columns(part, event_columns(part)[3])
        else:
            events_table(part)
    return time.perf_counter() - started


def direct(kind: str, config: dict[str, Any], tables: list[Any]) -> tuple[float, float]:
    """Seconds and CPU-seconds of this process to write the Arrow ``tables`` with the library's plain
    append into a new table."""
    import pyarrow.compute as pc

    write: Callable[[Any], None]
    # iceberg: creating the table is in the time, as it is in the sink's
    started, cpu = time.perf_counter(), time.process_time()
    if kind == "delta":
        from deltalake import write_deltalake

        def write(table: Any) -> None:
            write_deltalake(config["path"], table, mode="append", partition_by=["day"])
    elif kind == "iceberg":
        from pyiceberg.catalog.sql import SqlCatalog

        catalog = SqlCatalog("bench", uri=config["catalog_url"].replace("postgresql://", "postgresql+psycopg2://"),
                             warehouse=config["warehouse"])
        catalog.create_namespace_if_not_exists("bench")
        target = catalog.create_table(config["table"], schema=tables[0].schema)
        with target.update_spec() as spec:
            spec.add_identity("day")

        def write(table: Any) -> None:
            target.append(table)
    else:
        import pyarrow.parquet as pq

        root = Path(config["path"])

        def write(table: Any) -> None:  # durable, as the sink's files: each file and its directory entry fsynced
            days = table.column("day")
            for day in pc.unique(days).to_pylist():
                directory = root / f"day={day.isoformat()}"
                directory.mkdir(parents=True, exist_ok=True)
                file = directory / f"{uuid.uuid4().hex}.parquet"
                pq.write_table(table.filter(pc.equal(days, day)).drop_columns(["day"]), file, compression="zstd")
                fsync_path(file)
                fsync_path(directory)
    for table in tables:
        write(table)
    return time.perf_counter() - started, time.process_time() - cpu


def _spread(values: list[float], digits: str = ",.0f") -> str:
    return f"{statistics.median(values):{digits}} ({min(values):{digits}}-{max(values):{digits}})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--chunk", type=int, default=5000, help="events per publish call (delivery.chunk_size)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--formats", default="delta,iceberg,parquet")
    args = parser.parse_args()
    load = machine()
    events = make_events(args.events)
    tables = [events_table(events[s:s + args.chunk]) for s in range(0, len(events), args.chunk)]  # imports warm
    catalog_url = _catalog_url()
    kinds = args.formats.split(",")
    results: dict[tuple[str, str], list[float]] = {}
    #: per round: seconds to build the calls' Arrow tables from fresh events, and of that the JSON pass alone
    builds: list[float] = []
    passes: list[float] = []
    cpus: dict[tuple[str, str], list[float]] = {}  # CPU-seconds of this process (threads included)
    root = Path(tempfile.mkdtemp(prefix="pgstream-bench-lake-"))
    try:
        for kind in kinds:  # untimed: each way's imports and first table (catalog connection) before the rounds
            through_sink(sink_config(kind, root, catalog_url), make_events(args.chunk), args.chunk)
            direct(kind, sink_config(kind, root, catalog_url), tables[:1])
        for n in range(args.rounds):
            builds.append(building(make_events(args.events), args.chunk, json_only=False))
            passes.append(building(make_events(args.events), args.chunk, json_only=True))
            for kind in kinds:  # per format, every round: the sink and its baseline, the first one alternated
                for way in ("sink", "direct") if n % 2 == 0 else ("direct", "sink"):
                    config = sink_config(kind, root, catalog_url)
                    if way == "sink":
                        fresh = make_events(args.events)  # as a run reads them: payloads not parsed yet
                        seconds, cpu = through_sink(config, fresh, args.chunk)
                    else:
                        seconds, cpu = direct(kind, config, tables)
                    results.setdefault((kind, way), []).append(args.events / seconds)
                    cpus.setdefault((kind, way), []).append(cpu)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Lake sinks against their library's plain append (bench/lake.py) {stamp}, commit {commit()}",
             f"Command: `make bench-lake` (bench/lake.py --events {args.events} --chunk {args.chunk} --rounds "
             f"{args.rounds}). Machine: {load}. Method: one untimed call each way per format first, then "
             f"{args.rounds} rounds; per round and format the sink and its direct baseline back to back (which goes "
             "first alternates by round), "
             f"{args.events:,} events (~215-byte payload as Postgres prints the jsonb, over 2 UTC days) in publish "
             f"calls of {args.chunk:,} (a commit each), a new table per measurement on the local disk (created in "
             "the timed part, both ways); sink = publish_at through a fresh sink of events built before the clock "
             "(payload text, parsed by the sink: Arrow table built from the events, the stream's token read once, "
             "a commit carrying the token; parquet: each file fsynced, renamed, its directory fsynced, then the "
             "commit marker the same way); direct = the same Arrow tables (built before the clock) appended with "
             "the library itself (write_deltalake partition_by day / pyiceberg Table.append to a day-partitioned "
             "table in the same Postgres SQL catalog / pyarrow.parquet.write_table per day, each file and its "
             "directory fsynced); events per second and the ratio sink/direct of each round: median (min-max); CPU: "
             "this process's CPU-seconds (its threads included; not the catalog's Postgres), and their ratio "
             "sink/direct per round, less sensitive to the machine's other load than the rates. Each round also "
             "times building the calls' Arrow tables from fresh events as the sink does, writing nothing, and of it "
             "the pass of Arrow's JSON reader over the payloads alone: direct / (direct + that time) is the most a "
             "sink given the events could reach if it did nothing else beyond the library."]
    for kind in kinds:
        sink, base = results[(kind, "sink")], results[(kind, "direct")]
        ratios = [a / b for a, b in zip(sink, base, strict=True)]
        cpu_ratios = [a / b for a, b in zip(cpus[(kind, "sink")], cpus[(kind, "direct")], strict=True)]
        # the most a sink taking events could reach if all it did beyond the library were the build, or the JSON pass
        base_secs = [args.events / rate for rate in base]
        ceiling = [b / (b + j) for b, j in zip(base_secs, passes, strict=True)]
        built = [b / (b + t) for b, t in zip(base_secs, builds, strict=True)]
        lines.append(f"- {kind}: ratio {_spread(ratios, '.2f')}x; sink {_spread(sink)} events/s, direct "
                     f"{_spread(base)} events/s; CPU sink/direct {_spread(cpu_ratios, '.2f')}x (sink "
                     f"{_spread(cpus[(kind, 'sink')], '.3f')} s, direct {_spread(cpus[(kind, 'direct')], '.3f')} s); "
                     f"direct / (direct + building the tables) {_spread(built, '.2f')}x, direct / (direct + the JSON "
                     f"pass alone) {_spread(ceiling, '.2f')}x")
    lines.append(f"- building the calls' Arrow tables from the events (no write): {_spread(builds, '.3f')} s, of "
                 f"which Arrow's JSON reader over the payloads (the operation, schema, table and subscription columns) "
                 f"{_spread(passes, '.3f')} s")
    print("\n".join(lines))
    append_results("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
