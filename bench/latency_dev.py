"""Latency through `dagster dev` (P4, run by hand: `make bench-latency-dev`): commit -> webhook
receipt with the real daemon, run launcher (a run is a subprocess), Dagster's Postgres storage and
a Spark session per run, as `make dev` runs it. Side by side in one run: mode open (the default: the
stream's run stays open in its reader group's delivery run, handed each batch as it is recorded; and the
first event after a quiet spell) and mode per_batch (every batch waits for a new run: process start + Spark
start), each with a Spark Connect server (``spark.remote``: a run opens a session on a warm server instead
of starting Spark).

Per phase: fresh databases, `dagster dev` started with the repo's dagster.yaml and workspace.yaml;
once the group's sensor has created the group's slot, one warm-up row (its latency is the cold start: run launch +
Spark start), then a writer commits one row every ``--interval`` s for ``--duration`` s. Reports
p50/p95/p99/max of receipt - commit, the number of delivery runs, and appends to bench/RESULTS.md.
Usage: python bench/latency_dev.py [--duration 60] [--interval 0.2]
       [--phases open+connect+quiet,per_batch+connect] [--quiet-secs 10] [--quiet-rounds 1]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import Webhook, append_results, machine, write_config
from latency import _pct, _writer

from pgstream_dagster import sparkserver
from pgstream_dagster.config import BatchConfig, SensorConfig
from pgstream_dagster.devdb import LocalPostgres, ensure_running, free_port
from pgstream_dagster.engine.migrations import migrate
from tests.support.dagster_dev import start_dagster_dev, stop_process_group

HERE = Path(__file__).resolve().parent


def _wait(what: str, done: Any, timeout: float) -> float:
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - started


def _phase(spec: str, pg: LocalPostgres, tmpdir: Path, webhook: Webhook, args: argparse.Namespace,
           base: int) -> dict[str, Any]:
    mode = spec.split("+")[0]
    flags = set(spec.split("+")[1:])
    connect, quiet_spell = "connect" in flags, "quiet" in flags
    name = f"latency_dev_{mode}" + "".join(f"_{f}" for f in sorted(flags))
    pg.create_database(name)
    pg.create_database(f"{name}_dagster")
    url = pg.url_for(name)
    migrate(url)
    stream = {"id": 1, "sink": {"type": "http", "url": webhook.url, "mode": "batch"},
              "delivery": {"mode": mode}}
    server = None
    spark: dict[str, Any] = {"master": "local[2]"}
    if connect:
        port = free_port()
        server = sparkserver.start(port, "local[2]", log=tmpdir / f"{name}-spark.log")
        spark = {"remote": f"sc://127.0.0.1:{port}"}
    config = write_config(tmpdir / f"{name}.yaml", url, stream, spark)
    home = tmpdir / f"{name}_home"
    home.mkdir()
    shutil.copy(HERE.parent / "dagster.yaml", home / "dagster.yaml")
    dagster_url = pg.url_for(f"{name}_dagster").replace("postgresql://", "postgresql+psycopg2://", 1)
    env = {"PGSTREAM_CONFIG": str(config), "DAGSTER_HOME": str(home), "DAGSTER_POSTGRES_URL": dagster_url,
           "PYTHONUNBUFFERED": "1"}
    before = {seq for seq, _ in webhook.received()}
    (tmpdir / name).mkdir()
    dev = start_dagster_dev(tmpdir / name, env)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            def slot() -> bool:
                return conn.execute("select count(*) from pg_replication_slots where database = current_database()"
                                    ).fetchone() == (1,)  # the stream's reader group's

            ready = _wait("the sensor to create the slot", slot, 300)
            conn.execute("insert into public.bench_orders (seq, customer, amount) values (%s, 'warm-up', 0)",
                         [base - 1])
            committed_at = time.time()
            _wait("the warm-up event", lambda: any(s == base - 1 for s, _ in webhook.received()), 300)
            cold = next(t for s, t in webhook.received() if s == base - 1) - committed_at
        out = tmpdir / f"{name}.json"
        start = time.time() + 1
        writer = multiprocessing.Process(target=_writer,
                                         args=(url, start, args.duration, args.interval, str(out), base))
        writer.start()
        writer.join()
        committed = {int(k): v for k, v in json.loads(out.read_text()).items()}
        _wait("every event at the webhook",
              lambda: set(committed) <= {s for s, _ in webhook.received()}, args.duration + 300)
        quiet: list[float] = []
        for k in range(args.quiet_rounds if quiet_spell else 0):  # the first event after a quiet spell, each round
            seq = base - 2 - k
            time.sleep(args.quiet_secs)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("insert into public.bench_orders (seq, customer, amount) values (%s, 'quiet', 0)",
                             [seq])
                committed_at = time.time()
            _wait("the event after a quiet spell", lambda seq=seq: any(s == seq for s, _ in webhook.received()), 300)
            quiet.append(next(t for s, t in webhook.received() if s == seq) - committed_at)
        with psycopg.connect(dagster_url.replace("+psycopg2", ""), autocommit=True) as conn:
            (runs,) = conn.execute("select count(*) from runs where pipeline_name in ('pgstream_delivery', "
                                   "'pgstream_group_delivery')").fetchone()
    finally:
        stop_process_group(dev.proc)
        if server is not None:
            sparkserver.stop(server)
    received = {seq: t for seq, t in webhook.received() if seq >= base and seq not in before}
    lat = [received[s] - committed[s] for s in committed if s in received]
    return {"events": len(committed), "missing": len(committed) - len(lat), "p50": _pct(lat, 0.5),
            "p95": _pct(lat, 0.95), "p99": _pct(lat, 0.99), "max": max(lat), "runs": runs, "cold": cold,
            "ready": ready, "quiet": quiet}


_FLAG_LABELS = {"connect": ", Spark Connect server", "quiet": ""}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--phases", default="open+connect+quiet,per_batch+connect",
                        help="delivery.mode values to compare (open, per_batch: a run per batch); +connect: runs "
                             "use a Spark Connect server started for the phase (spark.remote); +quiet: then one "
                             "event after a quiet spell of --quiet-secs")
    parser.add_argument("--quiet-secs", type=float, default=10)
    parser.add_argument("--quiet-rounds", type=int, default=1, help="+quiet: quiet spells, one event after each")
    args = parser.parse_args()
    header = machine()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pgstream-latency-dev-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off"})
        webhook = Webhook()
        try:
            for i, spec in enumerate(args.phases.split(",")):
                r = results[spec] = _phase(spec, pg, tmpdir, webhook, args, base=(i + 1) * 10_000_000)
                print(f"{spec}: {r}", flush=True)
        finally:
            webhook.stop()
            pg.destroy()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Latency through `dagster dev` (P4) {stamp}, 1 event every {args.interval}s for "
             f"{args.duration:.0f}s",
             f"Machine: {header}. Method: bench/latency_dev.py; `dagster dev` with the repo's dagster.yaml (daemon, "
             "QueuedRunCoordinator, DefaultRunLauncher: a run is a subprocess with its own Spark session local[2], "
             "Postgres storage); one row per transaction into a table with an INSERT subscription; latency = "
             "webhook receipt (batch mode, receiver in a child process) - commit returned to the writer; cold = "
             "the warm-up event's latency (run launch, plus Spark start if the round needs it); defaults otherwise "
             "(max_fill_secs "
             f"{BatchConfig().max_fill_secs:g}, tick_budget_secs {SensorConfig().tick_budget_secs:g}). "
             "Phases one after the other in one run."]
    first = next(iter(results.values()))
    for spec, r in results.items():
        ratio = "baseline" if r is first else f"{first['p50'] / r['p50']:.1f}x faster than the first"
        flags = spec.split("+")[1:]
        label = f"mode {spec.split('+')[0]}" + "".join(_FLAG_LABELS[f] for f in flags)
        quiet = (f"; first event after {args.quiet_secs:g}s quiet: median {statistics.median(r['quiet']):.3f}s of "
                 f"{len(r['quiet'])} ({', '.join(f'{q:.3f}' for q in r['quiet'])})" if r["quiet"] else "")
        lines.append(f"- {label}: p50 {r['p50'] * 1000:.0f} ms ({ratio}), p95 {r['p95'] * 1000:.0f} ms, "
                     f"p99 {r['p99'] * 1000:.0f} ms, max {r['max'] * 1000:.0f} ms over {r['events']} events "
                     f"({r['missing']} missing); {r['runs']} delivery runs; cold start (first event once the sensor "
                     f"created the slot, {r['ready']:.1f}s after dg dev started) {r['cold']:.1f}s{quiet}")
    append_results("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
