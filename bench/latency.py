"""Latency benchmark (P4, run by hand): commit -> sink receipt under light load. A writer process
inserts one row into a subscribed table every ``--interval`` seconds (one transaction each) and
notes when each commit returned; a webhook receiver (batch mode, child process) notes when each
event arrived. The stream is driven in-process (bench/common.py ``Driver``: sensor tick, requested
run via ``execute_in_process``, ephemeral Dagster instance, warm Spark session), once per
``--fill`` value of ``batch.max_fill_secs``, side by side.

Reports p50/p95/p99/max of receipt - commit, and a breakdown from the ledger (per batch: commit ->
recorded (the batch's oldest event), recorded -> run launched,
launched -> delivered). Appended to bench/RESULTS.md.
``--baseline REF`` measures the package as of git ``REF`` too, side by side: each (fill, tree) phase
runs in a child process of its own (own Postgres, webhook and Spark), alternating baseline and
current for each fill value, and the results give the current/baseline ratios.
Usage: python bench/latency.py [--duration 60] [--interval 0.2] [--fill 5,0.5] [--baseline REF]
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
import time
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Driver, Webhook, append_results, delivered_events, extract_tree, machine, run_child, write_config

from pgstream_dagster.devdb import ensure_running

try:
    from pgstream_dagster.engine.migrations import migrate
except ImportError:  # a --baseline tree from before pgstream_dagster/engine (ecb0130 and older)
    from pgstream_dagster.migrations import migrate  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent


def _writer(url: str, start: float, duration: float, interval: float, out: str, base: int) -> None:
    committed: dict[int, float] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        seq = 0
        while True:
            due = start + seq * interval
            if due > start + duration:
                break
            time.sleep(max(0.0, due - time.time()))
            conn.execute("insert into public.bench_orders (seq, customer, amount) values (%s, 'c', 1)", [base + seq])
            committed[base + seq] = time.time()
            seq += 1
    Path(out).write_text(json.dumps(committed))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _phase(fill: float, pg: Any, tmpdir: Path, webhook: Webhook, args: argparse.Namespace,
           base: int) -> dict[str, Any]:
    name = f"latency_{str(fill).replace('.', '_')}"
    pg.create_database(name)
    url = pg.url_for(name)
    migrate(url)
    stream = {"id": 1, "sink": {"type": "http", "url": webhook.url, "mode": "batch"},
              "batch": {"max_size": 1000, "max_fill_secs": fill}, "sensor": {"tick_budget_secs": 10}}
    config = write_config(tmpdir / f"{name}.yaml", url, stream)
    before = {seq for seq, _ in webhook.received()}
    with dg.DagsterInstance.ephemeral() as instance:
        driver = Driver(config, instance)
        # warm-up: slot, Spark session and Python workers, as a long-running deployment has them
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("insert into public.bench_orders (seq, customer, amount) values (-1, 'warm-up', 0)")
            while delivered_events(conn, 1) < 1:
                driver.step(1)
        out = tmpdir / f"{name}.json"
        start = time.time() + 1
        writer = multiprocessing.Process(target=_writer,
                                         args=(url, start, args.duration, args.interval, str(out), base))
        writer.start()
        while writer.is_alive() or time.time() < start + args.duration + 1:
            driver.step(1)
        writer.join()
        committed = {int(k): v for k, v in json.loads(out.read_text()).items()}
        deadline = time.time() + 120
        with psycopg.connect(url, autocommit=True) as conn:
            while delivered_events(conn, 1) < len(committed) + 1 and time.time() < deadline:
                driver.step(1)
            rows = conn.execute(
                """select extract(epoch from created_at - first_commit_at),
                          extract(epoch from launched_at - created_at), extract(epoch from delivered_at - launched_at)
                   from pgstream.batches where stream_id = 1 and first_commit_at >= to_timestamp(%s)""",
                [start - 0.5]).fetchall()
    received = {seq: t for seq, t in webhook.received() if seq >= 0 and seq not in before}
    lat = [received[s] - committed[s] for s in committed if s in received]
    missing = len(committed) - len(lat)
    breakdown = [statistics.median(float(r[i]) for r in rows if r[i] is not None) for i in range(3)] if rows else []
    return {"events": len(committed), "missing": missing, "p50": _pct(lat, 0.5), "p95": _pct(lat, 0.95),
            "p99": _pct(lat, 0.99), "max": max(lat), "batches": len(rows), "runs": driver.runs,
            "breakdown": breakdown}


def _measure(fill: float, args: argparse.Namespace, base: int) -> dict[str, Any]:
    """One phase in this process: its own Postgres and webhook receiver."""
    with tempfile.TemporaryDirectory(prefix="pgstream-latency-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off"})
        webhook = Webhook()
        try:
            return _phase(fill, pg, tmpdir, webhook, args, base=base)
        finally:
            webhook.stop()
            pg.destroy()


def _child(fill: float, args: argparse.Namespace, base: int, tree: Path | None) -> dict[str, Any]:
    """One phase in a child process, with the package of ``tree`` (None: this checkout's)."""
    command = [sys.executable, str(HERE / "latency.py"), "--phase", str(fill), "--base", str(base),
               "--duration", str(args.duration), "--interval", str(args.interval)]
    return run_child(command, Path(tempfile.gettempdir()), tree, f"latency phase {fill} ({tree or 'current'})")


def _line(label: str, r: dict[str, Any], base: dict[str, Any] | None) -> str:
    b = r["breakdown"]
    parts = (f"; breakdown {b[0]:.2f}s + {b[1]:.2f}s + {b[2]:.2f}s" if b else "")
    ratio = (f" (p50 {r['p50'] / base['p50']:.2f}x, p99 {r['p99'] / base['p99']:.2f}x baseline)"
             if base and base["p50"] > 0 and base["p99"] > 0 else "")
    return (f"- {label}: p50 {r['p50']:.2f}s, p95 {r['p95']:.2f}s, p99 {r['p99']:.2f}s, "
            f"max {r['max']:.2f}s over {r['events']} events ({r['missing']} missing), {r['batches']} "
            f"batches, {r['runs']} runs{parts}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--fill", default="5,0.5", help="batch.max_fill_secs values to compare")
    parser.add_argument("--baseline", help="git ref to compare with, side by side (e.g. the commit before a change)")
    parser.add_argument("--phase", type=float, help=argparse.SUPPRESS)  # a child: one phase, JSON on stdout
    parser.add_argument("--base", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        import pgstream_dagster

        print(json.dumps({**_measure(args.phase, args, args.base), "module": pgstream_dagster.__file__}))
        return
    header = machine()
    fills = [float(x) for x in args.fill.split(",")]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pgstream-latency-trees-") as tmp:
        tree = extract_tree(args.baseline, Path(tmp) / "baseline") if args.baseline else None
        for i, fill in enumerate(fills):
            if tree is not None:
                results[f"max_fill_secs {fill}, baseline"] = r = _child(fill, args, i * 10_000_000, tree)
                print(f"max_fill_secs {fill} baseline: {r}")
            results[f"max_fill_secs {fill}"] = r = (_child(fill, args, i * 10_000_000, None) if tree is not None
                                                    else _measure(fill, args, i * 10_000_000))
            print(f"max_fill_secs {fill}: {r}")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Latency (P4) {stamp}, 1 event every {args.interval}s for {args.duration:.0f}s",
             f"Machine: {header}. Method: bench/latency.py; one row per transaction into a table with an INSERT "
             "subscription; latency = webhook receipt (batch mode, receiver in a child process) - commit returned "
             "to the writer; stream driven in-process (sensor tick then execute_in_process of the requested run, "
             "back to back; ephemeral Dagster instance; Spark session warm after one warm-up event). Breakdown = "
             "medians over batches from the ledger: first commit -> batch recorded, recorded -> run launched, "
             "launched -> marked delivered."
             + (f" Baseline = the package at {args.baseline}; each phase in a child process of its own, baseline "
                f"and current alternating per fill value, in one run." if args.baseline else "")]
    for label, r in results.items():
        if not label.endswith(", baseline"):
            base = results.get(f"{label}, baseline")
            if base is not None:
                lines.append(_line(f"{label}, baseline {args.baseline}", base, None))
            lines.append(_line(label + (" (current)" if base is not None else ""), r, base))
    append_results("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
