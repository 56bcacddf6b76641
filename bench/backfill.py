"""Backfill benchmark (run by hand): existing rows -> READ events, and what a backfill does to a
live stream's latency. Prints the commit and the load average before and after; exits 1 when a
goal is missed.

1. Throughput, Spark against no Spark: a table of ``--rows`` rows (written with triggers off, so it
   starts with no events) is backfilled by the engine's ``run`` (``--parallelism`` partitions, chunk
   2000, no throttle, no backlog bound, nothing delivering), once through the local Spark
   (``spark_executor``: the product's path) and once with the same partitions in plain threads
   (``run_partition`` in a thread pool), interleaved ``--rounds`` times (S T S T), each in a fresh
   database. Reported: rows/s written as events, median and spread of each, how long after the run's
   start its first chunk began and how long after its last chunk the run ended (Spark's fixed costs),
   and Spark over threads: the median of the pairwise ratios, each Spark phase against the threads
   phase right after it (goal >= ``--spark-goal``, default 0.9).
2. Live latency: a writer commits one row every ``--interval`` s for ``--duration`` s into the same
   table (an INSERT subscription, webhook sink in batch mode, receiver in a child process; the
   stream driven in-process, open runs); once alone, once while a backfill of ``--latency-rows``
   rows runs through Spark with the defaults (``max_rows_per_sec`` 5,000, ``max_backlog`` 20,000),
   side by side in one run. Reported: p50/p99 commit -> receipt; goals: p99 during the backfill at
   most 10x the p99 alone and at most 0.25 s, and the backfill finished.

Each phase runs in a child process on a fresh database; ``--baseline REF`` runs each phase with the
package as of git REF too, interleaved with the current code's.
Appended to bench/RESULTS.md. Usage: python bench/backfill.py [--rows 1000000] [--parallelism 2] [--rounds 2]
       [--baseline REF]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Driver,
    Goals,
    Webhook,
    append_results,
    delivered_events,
    extract_tree,
    load_after,
    machine,
    run_child,
    spread,
    tree_secs,
    write_config,
)
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


def _run_backfill(url: str, execute: backfill.Executor, parallelism: int, rate: float | None, backlog: int | None,
                  done: dict[str, float]) -> None:
    request = backfill.Request(1, ["bench-orders"], parallelism=parallelism, chunk_size=2000, max_rows_per_sec=rate,
                               max_backlog=backlog)
    with psycopg.connect(url, autocommit=True) as conn:
        (target,) = backfill.targets(conn, request)
        backfill_id, _ = backfill.open_backfill(conn, target, request)
    started, done["t0"] = time.monotonic(), time.time()
    for step in backfill.run(url, backfill_id, request, execute, run_id="bench", progress_secs=10):
        if isinstance(step, backfill.Outcome):
            assert step.done, step.progress.line()
            done["rows"] = step.progress.rows_read
    done["secs"], done["t1"] = time.monotonic() - started, time.time()


def _threads(url: str) -> backfill.Executor:
    """The same partitions in plain threads (the engine's run_partition, no Spark)."""
    def execute(backfill_id: int, token: str, parts: Sequence[int], chunk_size: int,
                pace: backfill.Pace) -> list[backfill.PartitionResult]:
        with ThreadPoolExecutor(len(parts)) as pool:
            return list(pool.map(lambda p: backfill.run_partition(url, backfill_id, p, token, chunk_size, pace),
                                 parts))
    return execute


def _spark(config: Path) -> Any:
    from pgstream_dagster.config import load_config
    from pgstream_dagster.engine.spark import open_session

    return open_session(load_config(config))


def _throughput(url: str, tmpdir: Path, name: str, how: str, args: argparse.Namespace) -> dict[str, Any]:
    """One unthrottled backfill of ``--rows`` rows, nothing delivering: rows/s written as events."""
    migrate(url)
    config = write_config(tmpdir / f"{name}.yaml", url, {"id": 1, "sink": {"type": "file",
                                                                          "path": str(tmpdir / f"{name}.jsonl")}})
    _fill(url, args.rows, 0)
    warmup = 0.0
    if how == "spark":
        # the session and its Python workers warm, as a run worker's after its first job (the first
        # job's start-up is paid once per process, not per round: reported apart)
        spark = _spark(config)
        started = time.monotonic()
        spark.range(0, args.parallelism, 1, args.parallelism).mapInArrow(_warm, "x long").collect()
        # an RDD job's Python workers are not a DataFrame job's (classic sessions' backfill jobs are RDD jobs)
        spark.sparkContext.parallelize(range(args.parallelism), args.parallelism).mapPartitions(_warm_rdd).collect()
        warmup = time.monotonic() - started
        execute = backfill.spark_executor(spark, url)
    else:
        execute = _threads(url)
    with psycopg.connect(url, autocommit=True) as conn:
        (datadir,) = conn.execute("show data_directory").fetchone() or ("",)
    postmaster = int((Path(datadir) / "postmaster.pid").read_text().split()[0])
    done: dict[str, float] = {}
    pg_cpu = tree_secs(postmaster)  # Postgres' CPU (backends, also the ended ones): robust to the machine's load
    _run_backfill(url, execute, args.parallelism, None, None, done)
    pg_cpu = tree_secs(postmaster) - pg_cpu
    with psycopg.connect(url, autocommit=True) as conn:
        events, first, last = conn.execute(
            "select count(*), extract(epoch from min(created_at)), extract(epoch from max(created_at)) "
            "from pgstream.events where stream_id = 1").fetchone() or (0, 0, 0)
    assert events == args.rows, (events, args.rows)
    # the fixed ends of the backfill: to its first chunk's transaction, and after its last one's
    return {"how": how, "rows": args.rows, "secs": done["secs"], "rows_per_sec": args.rows / done["secs"],
            "warmup_secs": warmup, "pg_us_per_row": pg_cpu / args.rows * 1e6,
            "start_secs": float(first) - done["t0"], "end_secs": done["t1"] - float(last)}


def _warm(batches: Any) -> Any:
    import pyarrow as pa

    import pgstream_dagster.engine.backfill  # noqa: F401  (what a backfill task imports)

    for _batch in batches:
        yield pa.RecordBatch.from_pylist([{"x": 1}])


def _warm_rdd(indexes: Any) -> Any:
    import pgstream_dagster.engine.backfill  # noqa: F401  (what a backfill task imports)

    yield from indexes


def _latency(url: str, tmpdir: Path, webhook: Webhook, name: str, args: argparse.Namespace, with_backfill: bool,
             base: int) -> dict[str, Any]:
    migrate(url)
    config = write_config(tmpdir / f"{name}.yaml", url, {
        "id": 1, "sink": {"type": "http", "url": webhook.url, "mode": "batch"},
        "batch": {"max_size": 5000, "max_fill_secs": 0.2}, "sensor": {"tick_budget_secs": 2},
        "delivery": {"mode": "open", "chunk_size": 5000}})
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
        worker = threading.Thread(target=_run_backfill, args=(url, backfill.spark_executor(spark, url),
                                                              args.parallelism, backfill.DEFAULT_MAX_ROWS_PER_SEC,
                                                              backfill.DEFAULT_MAX_BACKLOG, done))
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


def _child(spec: dict[str, Any], args: argparse.Namespace) -> None:
    """One phase, in this (child) process: prints its result as JSON."""
    import pgstream_dagster

    tmpdir = Path(spec["tmpdir"])
    if spec["phase"] == "throughput":
        result = _throughput(spec["url"], tmpdir, spec["name"], spec["how"], args)
    else:
        webhook = Webhook()
        try:
            result = _latency(spec["url"], tmpdir, webhook, spec["name"], args, spec["phase"] == "during",
                              spec["base"])
        finally:
            webhook.stop()
    print(json.dumps({**result, "module": pgstream_dagster.__file__}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="Spark / threads pairs, interleaved")
    parser.add_argument("--latency-rows", type=int, default=300_000)
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--spark-goal", type=float, default=0.9, help="Spark rows/s over threads rows/s, at least")
    parser.add_argument("--baseline", help="git ref: each phase also with the package as of REF (interleaved)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(json.loads(args.child), args)
        return
    header = machine()
    runs: list[dict[str, Any]] = []
    latency: dict[str, dict[str, Any]] = {}
    forwarded = [f"--rows={args.rows}", f"--parallelism={args.parallelism}", f"--latency-rows={args.latency_rows}",
                 f"--duration={args.duration}", f"--interval={args.interval}"]
    with tempfile.TemporaryDirectory(prefix="pgstream-backfill-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        trees: list[tuple[str, Path | None]] = [("current", None)]
        if args.baseline:
            trees.insert(0, ("baseline", extract_tree(args.baseline, tmpdir / "baseline")))
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off"})
        count = [0]

        def phase(spec: dict[str, Any], tree: Path | None) -> dict[str, Any]:
            count[0] += 1
            name = f"bf_{count[0]}"
            pg.create_database(name)
            spec = {**spec, "url": pg.url_for(name), "name": name, "tmpdir": str(tmpdir)}
            result = run_child([sys.executable, __file__, *forwarded, "--child", json.dumps(spec)], tmpdir, tree,
                               f"backfill bench phase {spec['phase']}")
            with psycopg.connect(pg.url, autocommit=True) as conn:  # its rows and events: not the next one's
                conn.execute(sql.SQL("drop database {} with (force)").format(sql.Identifier(name)))
            return result

        try:
            if not args.skip_throughput:
                for _ in range(args.rounds):
                    for label, tree in trees:
                        for how in ("spark", "threads"):
                            runs.append({**phase({"phase": "throughput", "how": how}, tree), "code": label})
                            print(f"{label} {how}: {runs[-1]['rows_per_sec']:,.0f} rows/s ({runs[-1]['secs']:.1f}s)",
                                  flush=True)
            if not args.skip_latency:
                latency["alone"] = phase({"phase": "alone", "base": 0}, None)
                print("live alone:", latency["alone"], flush=True)
                for i, (label, tree) in enumerate(trees):
                    latency[label] = phase({"phase": "during", "base": (i + 1) * 10_000_000}, tree)
                    print(f"live during a backfill ({label}):", latency[label], flush=True)
        finally:
            pg.destroy()
    after = load_after()
    goals = Goals()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Backfill {stamp}",
             f"Machine: {header}; {after}. Method: bench/backfill.py; private Postgres (fsync off), local Spark "
             f"(local[2]); backfill = the engine's run, parallelism {args.parallelism}, chunk 2000; each phase in a "
             "child process with a fresh database" + (f"; baseline = the package as of {args.baseline}, its phases "
                                                     "interleaved with the current code's" if args.baseline else "")
             + "."]
    for label, _ in trees:
        mine = [r for r in runs if r["code"] == label]
        if not mine:
            continue
        spark_rates = [r["rows_per_sec"] for r in mine if r["how"] == "spark"]
        thread_rates = [r["rows_per_sec"] for r in mine if r["how"] == "threads"]
        pairs = [s / t for s, t in zip(spark_rates, thread_rates, strict=True)]
        # the goal's figure: the median of the pairwise ratios (a Spark phase and the threads phase right
        # after it share the machine's load; the two medians alone may come from different loads)
        ratio = statistics.median(pairs)
        of_medians = statistics.median(spark_rates) / statistics.median(thread_rates)
        warm = [r["warmup_secs"] for r in mine if r["how"] == "spark"]
        ends = {how: (spread([r["start_secs"] for r in mine if r["how"] == how], "{:.2f}"),
                      spread([r["end_secs"] for r in mine if r["how"] == how], "{:.2f}"))
                for how in ("spark", "threads") if all("start_secs" in r for r in mine)}
        lines.append(f"- {label}: {args.rows:,} rows, unthrottled, nothing delivering, Spark and threads interleaved "
                     f"({args.rounds} each; Spark's Python workers started by a first job before the backfill: "
                     f"{spread(warm, '{:.1f}')} s): through Spark {spread(spark_rates)} rows/s; the same partitions "
                     f"in plain threads {spread(thread_rates)} rows/s; Spark / threads {ratio:.2f}x (median "
                     f"of the pairwise {', '.join(f'{x:.2f}' for x in pairs)}; of the medians {of_medians:.2f}x)")
        for how, (start, end) in ends.items():
            lines.append(f"  - {label} {how}: first chunk's transaction {start} s after the run's start, the run's "
                         f"end {end} s after the last chunk's")
        if label == "current":
            goals.check("backfill through Spark / the same partitions in threads", ratio, at_least=args.spark_goal)
    for label, _ in trees:
        cpu = [r["pg_us_per_row"] for r in runs if r["code"] == label]
        if cpu:
            lines.append(f"- {label}: Postgres CPU per row (all its processes, CPU time, not wall): "
                         f"{spread(cpu, '{:.1f}')} µs")
    if args.baseline and runs:
        for how in ("spark", "threads"):
            cur = statistics.median([r["rows_per_sec"] for r in runs if r["code"] == "current" and r["how"] == how])
            base = statistics.median([r["rows_per_sec"] for r in runs if r["code"] == "baseline" and r["how"] == how])
            lines.append(f"- {how}: current / baseline {cur / base:.2f}x rows/s (medians)")
        cur = statistics.median([r["pg_us_per_row"] for r in runs if r["code"] == "current"])
        base = statistics.median([r["pg_us_per_row"] for r in runs if r["code"] == "baseline"])
        lines.append(f"- Postgres CPU per row: current / baseline {cur / base:.2f}x (medians)")
    if latency:
        alone = latency["alone"]
        lines.append(f"- live stream, 1 row every {args.interval}s for {args.duration:.0f}s, webhook (batch), open "
                     f"runs: alone p50 {alone['p50']}s, p99 {alone['p99']}s (missing {alone['missing']})")
        for label, _ in trees:
            during = latency[label]
            lines.append(f"- {label}: during a backfill of {args.latency_rows:,} rows through Spark (max_rows_per_sec "
                         f"{backfill.DEFAULT_MAX_ROWS_PER_SEC:,.0f}, max_backlog {backfill.DEFAULT_MAX_BACKLOG:,}; "
                         f"{during.get('backfill_rows') or 0:,} rows in {during.get('backfill_secs')}s) p50 "
                         f"{during['p50']}s, p99 {during['p99']}s ({during['p99'] / max(alone['p99'], 1e-9):.2f}x "
                         f"alone); missing {during['missing']}")
        during = latency["current"]
        goals.check("live p99 during a backfill / alone", during["p99"] / max(alone["p99"], 1e-9), at_most=10)
        goals.check("live p99 during a backfill (s)", during["p99"], at_most=0.25)
        goals.check("backfill rows read during the latency phase", float(during.get("backfill_rows") or 0),
                    at_least=args.latency_rows)
    lines += goals.lines()
    append_results("\n".join(lines) + "\n")
    print("\n".join(lines))
    goals.finish()


if __name__ == "__main__":
    main()
