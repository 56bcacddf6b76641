"""Backfill benchmark (run by hand): existing rows -> READ events -> sink, and what a backfill does
to a live stream's latency.

1. Throughput: a table of ``--rows`` rows (written with triggers off, so it starts with no events)
   is backfilled (the engine's ``run`` on a local Spark, ``--parallelism`` tasks, no throttle) while
   the stream is driven in-process (sensor ticks, delivery runs in a background thread, as the
   daemon and a run worker do), once to the file sink and once to Redis. Reported: rows/s written
   as events (backfill start -> backfill done) and rows/s delivered (backfill start -> last event
   confirmed by the sink).
2. Live latency: a writer commits one row every ``--interval`` s for ``--duration`` s into the same
   table (an INSERT subscription, webhook sink in batch mode, receiver in a child process); once
   alone, once while a backfill of ``--latency-rows`` rows runs with the default throttle
   (``max_rows_per_sec`` 5,000), side by side in one run. Reported: p50/p99 commit -> receipt.

Appended to bench/RESULTS.md. Usage: python bench/backfill.py [--rows 1000000] [--parallelism 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Driver, Webhook, delivered_events, machine, write_config
from latency import _pct, _writer

from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.engine import backfill
from pgstream_dagster.engine.migrations import migrate

HERE = Path(__file__).resolve().parent


def _fill(url: str, rows: int, seq_base: int) -> None:
    """``rows`` rows in bench_orders with triggers off: existing data, no events."""
    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("set local session_replication_role = replica")
        conn.execute("insert into public.bench_orders (seq, customer, amount) "
                     "select %s - g, 'customer ' || (g %% 1000), g %% 500 from generate_series(1, %s) g",
                     [seq_base, rows])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("vacuum analyze public.bench_orders")


def _run_backfill(url: str, spark: Any, parallelism: int, rate: float | None, done: dict[str, float]) -> None:
    request = backfill.Request(1, ["bench-orders"], parallelism=parallelism, chunk_size=2000, max_rows_per_sec=rate)
    with psycopg.connect(url, autocommit=True) as conn:
        (target,) = backfill.targets(conn, request)
        backfill_id, _ = backfill.open_backfill(conn, target, request)
    started = time.monotonic()
    for step in backfill.run(url, backfill_id, request, backfill.spark_executor(spark, url), run_id="bench",
                             progress_secs=10):
        if isinstance(step, backfill.Outcome):
            assert step.done, step.progress.line()
            done["rows"] = step.progress.rows_read
    done["secs"] = time.monotonic() - started


def _spark(config: Path) -> Any:
    from pgstream_dagster.config import load_config
    from pgstream_dagster.engine.spark import open_session

    return open_session(load_config(config))


def _throughput(pg: Any, tmpdir: Path, sink: dict[str, Any], name: str, args: argparse.Namespace) -> dict[str, Any]:
    pg.create_database(name)
    url = pg.url_for(name)
    migrate(url)
    config = write_config(tmpdir / f"{name}.yaml", url, {
        "id": 1, "sink": sink, "slot_name": name, "batch": {"max_size": 20_000, "max_fill_secs": 0.5},
        "sensor": {"tick_budget_secs": 2}, "delivery": {"linger_secs": 30, "chunk_size": 5000}})
    _fill(url, args.rows, 0)
    spark = _spark(config)
    with dg.DagsterInstance.ephemeral() as instance:
        driver = Driver(config, instance, background=True)
        driver.step(1)  # the slot, and a first (empty) look
        done: dict[str, float] = {}
        started = time.monotonic()
        worker = threading.Thread(target=_run_backfill, args=(url, spark, args.parallelism, None, done))
        worker.start()
        with psycopg.connect(url, autocommit=True) as conn:
            while delivered_events(conn, 1) < args.rows:
                driver.step(1)
                assert time.monotonic() - started < 3600, "not delivered within an hour"
        delivered_secs = time.monotonic() - started
        worker.join()
        driver.wait()
    return {"rows": args.rows, "backfill_secs": round(done["secs"], 1),
            "written_rows_per_sec": round(args.rows / done["secs"]),
            "delivered_secs": round(delivered_secs, 1), "delivered_rows_per_sec": round(args.rows / delivered_secs),
            "runs": driver.runs, "failed_runs": driver.failed}


def _latency(pg: Any, tmpdir: Path, webhook: Webhook, name: str, args: argparse.Namespace, with_backfill: bool,
             base: int) -> dict[str, Any]:
    pg.create_database(name)
    url = pg.url_for(name)
    migrate(url)
    config = write_config(tmpdir / f"{name}.yaml", url, {
        "id": 1, "sink": {"type": "http", "url": webhook.url, "mode": "batch"}, "slot_name": name,
        "batch": {"max_size": 5000, "max_fill_secs": 0.2}, "sensor": {"tick_budget_secs": 2},
        "delivery": {"linger_secs": 60, "chunk_size": 5000}})
    if with_backfill:
        _fill(url, args.latency_rows, -1)  # negative seqs: not the writer's
    spark = _spark(config)
    before = {seq for seq, _ in webhook.received()}
    with dg.DagsterInstance.ephemeral() as instance:
        driver = Driver(config, instance, background=True)
        with psycopg.connect(url, autocommit=True) as conn:  # warm-up: slot, run, Spark
            conn.execute("insert into public.bench_orders (seq, customer, amount) values (-1, 'warm-up', 0)")
            while delivered_events(conn, 1) < 1:
                driver.step(1)
        out = tmpdir / f"{name}.json"
        start = time.time() + 1
        writer = multiprocessing.Process(target=_writer,
                                         args=(url, start, args.duration, args.interval, str(out), base))
        done: dict[str, float] = {}
        worker = threading.Thread(target=_run_backfill, args=(url, spark, args.parallelism,
                                                              backfill.DEFAULT_MAX_ROWS_PER_SEC, done))
        writer.start()
        if with_backfill:
            worker.start()
        while writer.is_alive() or time.time() < start + args.duration + 1:
            driver.step(1)
        writer.join()
        committed = {int(k): v for k, v in json.loads(out.read_text()).items()}
        deadline, look = time.time() + 600, 0.0
        while time.time() < deadline:
            if time.time() >= look:  # the receiver's whole list: not at every tick
                received = {seq for seq, _ in webhook.received()}
                if all(s in received for s in committed):
                    break
                look = time.time() + 2
            driver.step(1)
        if with_backfill:
            worker.join()
        driver.wait()
    received_at = {seq: t for seq, t in webhook.received() if seq >= base and seq not in before}
    lat = [received_at[s] - committed[s] for s in committed if s in received_at]
    return {"events": len(committed), "missing": len(committed) - len(lat), "p50": round(_pct(lat, 0.5), 3),
            "p99": round(_pct(lat, 0.99), 3), "max": round(max(lat), 3),
            **({"backfill_rows": done.get("rows"), "backfill_secs": round(done.get("secs", 0), 1)}
               if with_backfill else {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--latency-rows", type=int, default=300_000)
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    header = machine()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pgstream-backfill-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off"})
        webhook = Webhook()
        try:
            if not args.skip_throughput:
                out = tmpdir / "backfill.jsonl"
                results["file"] = _throughput(pg, tmpdir, {"type": "file", "path": str(out)}, "bf_file", args)
                print("file:", results["file"], flush=True)
                stream_name = f"pgstream-bench-backfill-{os.getpid()}"
                results["redis"] = _throughput(pg, tmpdir, {"type": "redis", "stream": stream_name}, "bf_redis", args)
                redis.Redis.from_url("redis://127.0.0.1:6379/0").delete(stream_name)
                print("redis:", results["redis"], flush=True)
            results["live alone"] = _latency(pg, tmpdir, webhook, "lat_alone", args, False, 0)
            print("live alone:", results["live alone"], flush=True)
            results["live during backfill"] = _latency(pg, tmpdir, webhook, "lat_backfill", args, True, 10_000_000)
            print("live during backfill:", results["live during backfill"], flush=True)
        finally:
            webhook.stop()
            pg.destroy()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Backfill {stamp}",
             f"Machine: {header}. Method: bench/backfill.py; private Postgres (fsync off), local Spark "
             f"(local[2]), stream driven in-process (sensor ticks; delivery runs in a background thread, open "
             f"runs); backfill = engine run, parallelism {args.parallelism}, chunk 2000."]
    for sink in ("file", "redis"):
        if sink in results:
            r = results[sink]
            lines.append(f"- {r['rows']:,} rows to the {sink} sink, unthrottled: written as events in "
                         f"{r['backfill_secs']}s ({r['written_rows_per_sec']:,} rows/s); all delivered "
                         f"{r['delivered_secs']}s after the start ({r['delivered_rows_per_sec']:,} rows/s end to end; "
                         f"{r['runs']} runs, {r['failed_runs']} failed)")
    alone, during = results["live alone"], results["live during backfill"]
    lines.append(f"- live stream, 1 row every {args.interval}s for {args.duration:.0f}s, webhook: alone p50 "
                 f"{alone['p50']}s, p99 {alone['p99']}s; during a throttled backfill of {args.latency_rows:,} rows "
                 f"(max_rows_per_sec {backfill.DEFAULT_MAX_ROWS_PER_SEC:,.0f}; it took {during.get('backfill_secs')}s) "
                 f"p50 {during['p50']}s, p99 {during['p99']}s ({during['p99'] / max(alone['p99'], 1e-9):.2f}x); "
                 f"missing {alone['missing']} / {during['missing']}")
    with (HERE / "RESULTS.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
