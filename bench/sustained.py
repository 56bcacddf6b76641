"""Sustained throughput benchmark (P1, run by hand): a load generator inserts into a subscribed
table (real subscription trigger) as fast as Postgres accepts, for a fixed duration; the stream is
driven in-process (bench/common.py ``Driver``: sensor tick, then the requested delivery run with
``execute_in_process`` against an ephemeral Dagster instance, repeat) and delivers to Redis Streams,
then (a fresh database) to a webhook (batch mode, receiver in a child process).

Reports events/s written vs events/s delivered (ledger ``delivered``) during the write window, both
read at the window's end (a timer, not after the last sensor step returns: the drain is not counted
as in-window), the drain time after it, and the backlog (written - delivered) sampled every
``--sample-secs``. Before each phase and after the last one the same writers insert into a table
without a subscription for the same duration (*writers alone*, the baseline on the same machine in
the same run, interleaved A B A B A). The ratio at the window's end cannot reach 1 while events are
written (what is in flight counts as not delivered): the steady state is delivered / written over the
window's second half (above 1 when the backlog shrank). Where the CPU went during the window (the
writers' processes and backends, the sensor's and runs' Python, the Spark JVM, the rest of Postgres,
Redis), per 100,000 events written, says up to which rate the machine's CPUs can carry writing and
delivering together. Exits non-zero when a phase's delivered / written at the window's end, or in
its second half, is under ``--goal``. Results are appended to bench/RESULTS.md.
Usage: python bench/sustained.py [--duration 300] [--sinks redis,webhook] [--writers 2] [--rows 100] [--goal 1.0]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import itertools
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Driver,
    Goals,
    Webhook,
    append_results,
    delivered_events,
    load_after,
    machine,
    own_secs,
    sched_secs,
    spread,
    tree_secs,
    write_config,
    written_events,
)

from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.engine.migrations import migrate

HERE = Path(__file__).resolve().parent


def _writer(url: str, until: float, rows: int, counter: Any, cpus: set[int] | None = None,
            out: Any = None, rate: float = 0.0) -> None:
    """Insert ``rows`` rows per transaction until ``until`` (wall clock), at ``rate`` rows a second (0: as
    fast as Postgres accepts; a writer behind its pace catches up without sleeping); ``cpus``: only on these;
    ``out``: gets (this process' CPU, its backend's CPU) in seconds, once done."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    seq = 0
    with psycopg.connect(url, autocommit=True) as conn:
        backend = conn.info.backend_pid
        backend0, own0 = sched_secs(backend), time.process_time()
        began = time.time()
        while time.time() < until:
            if rate and (ahead := began + seq / rate - time.time()) > 0:
                time.sleep(min(ahead, max(0.0, until - time.time())))
                continue
            conn.execute("insert into public.bench_orders (seq, customer, amount) "
                         "select g, 'c-' || (g %% 1000), g * 1.5 from generate_series(%s::bigint, %s::bigint) g",
                         [seq, seq + rows - 1])
            seq += rows
            with counter.get_lock():
                counter.value += rows
        if out is not None:
            out.put((time.process_time() - own0, sched_secs(backend) - backend0))


def _redis_pid() -> int | None:
    """The local Redis server's pid (its CPU is the sink's), if it answers."""
    try:
        import redis

        return int(redis.Redis.from_url("redis://127.0.0.1:6379/0").info("server")["process_id"])
    except Exception:
        return None


def _cpu_now(postmaster: int, redis_pid: int | None) -> dict[str, float]:
    """CPU seconds so far: this process (sensor, runs, their threads), its Spark JVM (if started), Postgres'
    whole tree, the Redis server."""
    jvm = _spark_jvm_pid()
    return {"driver": own_secs(os.getpid()), "jvm": tree_secs(jvm) if jvm else 0.0,
            "postgres": tree_secs(postmaster), "redis": own_secs(redis_pid) if redis_pid else 0.0}


def _spark_jvm_pid() -> int | None:
    from pyspark import SparkContext

    context: Any = SparkContext._active_spark_context
    return None if context is None else int(context._jvm.java.lang.ProcessHandle.current().pid())


#: garbage collections of this process (the sensor's and the runs' Python) that took over 0.1 s:
#: (generation, seconds), for the results line
GC_PAUSES: list[tuple[int, float]] = []
_gc_started = [0.0]


def _gc_timer(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    elif (took := time.perf_counter() - _gc_started[0]) > 0.1:
        GC_PAUSES.append((info["generation"], took))


gc.callbacks.append(_gc_timer)


def _phase(name: str, mode: str, url: str, tmpdir: Path, args: argparse.Namespace,
           webhook: Webhook | None, rate: float = 0.0) -> dict[str, Any]:
    """One sink and mode: the writers (at ``rate`` events a second together, 0: flat out) for the window, the
    stream delivering meanwhile, then the drain."""
    sink: dict[str, Any]
    if name == "redis":
        sink = {"type": "redis", "url": "redis://127.0.0.1:6379/0",
                "stream": f"pgstream-sustained-{uuid.uuid4().hex[:8]}", "maxlen": 100_000}
    else:
        assert webhook is not None
        sink = {"type": "http", "url": webhook.url, "mode": "batch", "max_batch_size": 1000}
    open_runs = mode == "open"
    stream = {"id": 1, "sink": sink,
              "batch": {"max_size": args.batch_size, "max_fill_secs": args.max_fill_secs},
              "sensor": {"tick_budget_secs": 2},
              "delivery": {"chunk_size": 5000, "max_events_per_run": args.max_events_per_run,
                           "mode": "open" if open_runs else "per_batch"}}
    config = write_config(tmpdir / f"{name}_{mode}.yaml", url, stream, trigger_mode=args.trigger_mode)
    counter: Any = multiprocessing.Value("q", 0)
    samples: list[tuple[float, int, int]] = []
    with dg.DagsterInstance.ephemeral() as instance:
        driver = Driver(config, instance, background=open_runs)
        # warm-up, as a long-running deployment is: slot, Spark session, Python workers
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("insert into public.bench_orders (seq, customer, amount) values (-1, 'warm-up', 0)")
            while delivered_events(conn, 1) < 1:
                driver.step(1)
        redis_pid = _redis_pid() if name == "redis" else None
        cpu_out: Any = multiprocessing.Queue()
        cpu0 = _cpu_now(args.postmaster, redis_pid)
        started = time.time()
        until = started + args.duration
        writers = [multiprocessing.Process(target=_writer, args=(url, until, args.rows, counter, args.database_cpus,
                                                                 cpu_out, rate / args.writers))
                   for _ in range(args.writers)]
        for w in writers:
            w.start()
        stop = threading.Event()

        def sample() -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                while not stop.is_set():
                    samples.append((time.time() - started, counter.value + 1, delivered_events(conn, 1)))
                    stop.wait(args.sample_secs)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        # the counts at the window's end, read by a timer on its own connection (a sensor step may
        # return a second or more after it: what is delivered then is the drain, not the window)
        at_end: dict[str, int] = {}
        end_conn = psycopg.connect(url, autocommit=True)

        cpu_end: dict[str, float] = {}

        def snapshot() -> None:
            at_end["delivered"] = delivered_events(end_conn, 1)
            at_end["written"] = written_events(end_conn, 1)
            cpu_end.update(_cpu_now(args.postmaster, redis_pid))

        timer = threading.Timer(until - time.time(), snapshot)
        timer.start()
        while time.time() < until:
            driver.paced_step(1, args.tick_secs, time.monotonic() + (until - time.time()))
        writer_cpu = [cpu_out.get(timeout=60) for _ in writers]
        for w in writers:
            w.join()
        timer.join()
        end_conn.close()
        with psycopg.connect(url, autocommit=True) as conn:
            written = written_events(conn, 1)  # the writers' last transactions may commit just after the end
        delivered_in_window, written_in_window = at_end["delivered"], at_end["written"]
        drain_deadline = time.time() + args.drain_secs
        while time.time() < drain_deadline:
            with psycopg.connect(url, autocommit=True) as conn:
                if delivered_events(conn, 1) >= written:
                    break
            driver.paced_step(1, args.tick_secs)
        drained_at = time.time()
        driver.wait()  # the group delivery run is asked to end: the open run closes
        stop.set()
        sampler.join()
        with psycopg.connect(url, autocommit=True) as conn:
            delivered = delivered_events(conn, 1)
        if webhook is not None:
            assert webhook.count() >= delivered, (webhook.count(), delivered)
    pauses = [(g, t) for g, t in GC_PAUSES]
    GC_PAUSES.clear()
    cpu = {k: cpu_end[k] - cpu0[k] for k in cpu0}
    cpu["writers_client"] = sum(c for c, _b in writer_cpu)
    cpu["writers_backend"] = sum(b for _c, b in writer_cpu)
    cpu["postgres_else"] = max(0.0, cpu.pop("postgres") - cpu["writers_backend"])
    return {"written": written, "written_in_window": written_in_window, "window": args.duration, "cpu": cpu,
            "delivered_in_window": delivered_in_window,
            "delivered": delivered, "drain_secs": drained_at - until, "runs": driver.runs, "failed": driver.failed,
            "samples": samples, "gc_pauses": pauses}


def _alone(pg: Any, index: int, tmpdir: Path, args: argparse.Namespace) -> float:
    """The writers alone: the same inserts into the same subscribed table (the trigger writes the
    events) in a fresh database with no stream running (no slot, no sensor, no run), for the same
    duration: events/s."""
    name = f"sustained_alone_{index}"
    pg.create_database(name)
    url = pg.url_for(name)
    migrate(url)
    write_config(tmpdir / f"{name}.yaml", url, {"id": 1, "sink": {"type": "file", "path": str(tmpdir / "x.jsonl")}},
                 trigger_mode=args.trigger_mode)
    counter: Any = multiprocessing.Value("q", 0)
    until = time.time() + args.duration
    writers = [multiprocessing.Process(target=_writer, args=(url, until, args.rows, counter, args.database_cpus))
               for _ in range(args.writers)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    return float(counter.value) / args.duration


def _gc_note(pauses: list[tuple[int, float]]) -> str:
    if not pauses:
        return "; no garbage collection over 0.1 s"
    return (f"; {len(pauses)} garbage collections over 0.1 s (longest {max(t for _, t in pauses):.2f} s, "
            f"{sum(t for _, t in pauses):.1f} s in all)")


def _pin_tree(pid: int, cpus: set[int]) -> None:
    """Postgres' postmaster and its processes on ``cpus`` (backends forked later inherit it)."""
    os.sched_setaffinity(pid, cpus)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    os.sched_setaffinity(int(entry.name), cpus)
            except (OSError, IndexError, ValueError):
                continue


def _curve(samples: list[tuple[float, int, int]], points: int = 16) -> str:
    step = max(1, -(-len(samples) // points))  # at most ~points values
    picked = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    return ", ".join(f"{t:.0f}s {w - d:,}" for t, w, d in picked)


def _steady(samples: list[tuple[float, int, int]], window: float) -> float | None:
    """Delivered / written over the window's second half (from the first sample at half the window to the
    last one in it): above 1 when the backlog shrank. The ratio at the window's end cannot reach 1 while
    events are written: what is in flight (read, recorded, being published) counts as not delivered."""
    inside = [s for s in samples if window / 2 <= s[0] <= window]
    if len(inside) < 2:
        return None
    (_t0, w0, d0), (_t1, w1, d1) = inside[0], inside[-1]
    return (d1 - d0) / (w1 - w0) if w1 > w0 else None


def _cpu_note(r: dict[str, Any], cpus: int) -> str:
    """Where the CPU went during the window, per 100,000 events written, and the rate at which the writers and
    the pipeline together fit the machine's CPUs."""
    cpu, per = r["cpu"], r["written_in_window"] / 100_000
    if not per:
        return "no events written"
    writers = cpu["writers_client"] + cpu["writers_backend"]
    pipeline = cpu["driver"] + cpu["jvm"] + cpu["postgres_else"] + cpu["redis"]
    total = writers + pipeline
    fits = cpus / (total / r["written_in_window"])
    return (f"CPU-s per 100k events written: writers {writers / per:.2f} (their backends "
            f"{cpu['writers_backend'] / per:.2f}, their Python {cpu['writers_client'] / per:.2f}), "
            f"pipeline {pipeline / per:.2f} (sensor and run Python {cpu['driver'] / per:.2f}, "
            f"Spark JVM {cpu['jvm'] / per:.2f}, the rest of Postgres: WAL sender, ledger, WAL writer "
            f"{cpu['postgres_else'] / per:.2f}, Redis {cpu['redis'] / per:.2f}); pipeline / writers "
            f"{pipeline / writers if writers else 0:.2f}; {total / r['window']:.2f} of {cpus} CPUs busy with both; "
            f"at these costs {cpus} CPUs carry writing and delivering together up to {fits:,.0f} events/s "
            f"(written: {r['written_in_window'] / r['window']:,.0f}/s)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=300, help="seconds of writing per sink")
    parser.add_argument("--sinks", default="redis,webhook")
    parser.add_argument("--modes", default="serial,open",
                        help="serial: runs between ticks, mode per_batch (the first method); open: the stream's run "
                             "open in its reader group's delivery run, in a thread while the group's sensor ticks")
    parser.add_argument("--writers", type=int, default=2, help="writer processes")
    parser.add_argument("--rows", type=int, default=100, help="rows per writer transaction")
    parser.add_argument("--batch-size", type=int, default=10_000, help="batch.max_size")
    parser.add_argument("--max-fill-secs", type=float, default=1.0, help="batch.max_fill_secs")
    parser.add_argument("--max-events-per-run", type=int, default=200_000)
    parser.add_argument("--sample-secs", type=float, default=5)
    parser.add_argument("--drain-secs", type=float, default=600)
    parser.add_argument("--label", default="", help="what this run measures (e.g. the code: 'before', 'after')")
    parser.add_argument("--trigger-mode", choices=("row", "statement"), default="row",
                        help="the subscription's trigger_mode")
    parser.add_argument("--goal", type=float, default=1.0,
                        help="delivered / written at the window's end each phase must reach (exit 1 if not)")
    parser.add_argument("--tick-secs", type=float, default=1.0,
                        help="the sensor is evaluated at most this often (the daemon: at most every "
                             "sensor.interval_secs, 1 s by default, and every 5 s at most; before 2026-11-27 the "
                             "bench ticked every 0.05 s)")
    parser.add_argument("--pace", type=float, default=0.0,
                        help="the writers insert at this fraction of the rate they reached alone just before (0: as "
                             "fast as Postgres accepts): e.g. 0.5, half their solo rate")
    parser.add_argument("--split", action="store_true",
                        help="the pipeline's Python (sensor, runs, Spark) on the last CPU, Postgres (the WAL sender "
                             "and ledger included) and the writers on the others: its own core")
    args = parser.parse_args()
    header = machine()
    results: dict[str, dict[str, Any]] = {}
    alone: list[float] = []
    with tempfile.TemporaryDirectory(prefix="pgstream-sustained-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off"})
        args.database_cpus = None
        args.postmaster = int((tmpdir / "pg" / "postmaster.pid").read_text().split()[0])
        if args.split:
            cpus = sorted(os.sched_getaffinity(0))
            args.database_cpus = set(cpus[:-1])
            _pin_tree(int((tmpdir / "pg" / "postmaster.pid").read_text().split()[0]), args.database_cpus)
            os.sched_setaffinity(0, {cpus[-1]})  # this process: the sensor and the runs (and Spark, started later)
        webhook = Webhook()
        try:
            for name, mode in itertools.product(args.sinks.split(","), args.modes.split(",")):
                alone.append(_alone(pg, len(alone), tmpdir, args))
                print(f"writers alone: {alone[-1]:,.0f} events/s", flush=True)
                pg.create_database(f"sustained_{name}_{mode}")
                url = pg.url_for(f"sustained_{name}_{mode}")
                migrate(url)
                r = results[f"{name} ({mode})"] = _phase(name, mode, url, tmpdir, args,
                                                         webhook if name == "webhook" else None,
                                                         args.pace * alone[-1])
                print(f"{name} ({mode}): written {r['written'] / r['window']:,.0f} events/s, delivered "
                      f"{r['delivered_in_window'] / r['window']:,.0f} events/s in the window; drained in "
                      f"{r['drain_secs']:.1f}s; {r['runs']} runs ({r['failed']} failed){_gc_note(r['gc_pauses'])}; "
                      f"backlog {_curve(r['samples'])}", flush=True)
            alone.append(_alone(pg, len(alone), tmpdir, args))
            print(f"writers alone: {alone[-1]:,.0f} events/s", flush=True)
        finally:
            webhook.stop()
            pg.destroy()
    after = load_after()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    import pgstream_dagster
    label = f", {args.label}" if args.label else ""
    pace = f", writers at {args.pace:g}x their solo rate" if args.pace else ""
    lines = [f"\n## Sustained (P1) {stamp}, {args.duration:.0f}s of writing per sink{pace}{label}"
             f"{' (split CPUs)' if args.split else ''}, package {Path(pgstream_dagster.__file__).parent}",
             f"Machine: {header}. Method: bench/sustained.py; {args.writers} writer processes inserting "
             f"{args.rows} rows per transaction into a table with a real INSERT subscription "
             f"({args.trigger_mode} mode; Postgres fsync off, "
             "synchronous_commit off), "
             + (f"paced to {args.pace:g}x the rate the writers alone reached just before each phase (a writer behind "
                "its pace catches up)" if args.pace else "as fast as Postgres accepts") +
             "; the stream is driven in-process (ephemeral "
             "Dagster instance, one warm Spark session local[2]): *serial* = sensor tick, then the requested run "
             "via execute_in_process, one after the other, mode per_batch; "
             "*open* = the group delivery run in a thread while the group's sensor keeps ticking, "
             "as the daemon and a run worker overlap; the group run reads the group's slot (replication protocol), "
             "the stream's open run reads small rounds "
             f"without Spark; batch.max_size {args.batch_size}, max_fill_secs {args.max_fill_secs}, "
             f"max_events_per_run {args.max_events_per_run}, chunk 5000; delivered = ledger batches marked "
             "delivered (sink-confirmed); "
             + ("**split**: the pipeline's Python (sensor, runs, Spark driver) pinned to the last CPU, Postgres "
                "(WAL sender and ledger backends included) and the writers to the others, Redis unpinned; "
                if args.split else "writers, driver, Spark, Postgres and the sink share the 2 CPUs; ") +
             f"backlog = written - delivered, sampled every {args.sample_secs:.0f}s; written and delivered read "
             "by a timer at the window's end; *writers alone* = the same writers into the same subscribed "
             "table in a fresh database with no stream running (no slot, sensor or run), for the same duration, "
             f"before each phase and after the last; {after}.",
             f"- writers alone: {spread(alone)} events/s"]
    goals = Goals()
    base = statistics.median(alone) if alone else 0.0
    for name, r in results.items():
        w, d = r["written_in_window"] / r["window"], r["delivered_in_window"] / r["window"]
        goals.check(f"{name} delivered / written at the window's end", d / w if w else 0.0, at_least=args.goal)
        steady = _steady(r["samples"], r["window"])
        if steady is not None:
            goals.check(f"{name} delivered / written in the window's second half (steady state)", steady,
                         at_least=args.goal)
        lines.append(f"- {name}: written {w:,.0f} events/s ({w / base if base else 0:.2f}x the writers alone), "
                     f"delivered {d:,.0f} events/s in the window "
                     f"(ratio {d / w if w else 0:.2f}), all {r['delivered']:,} delivered {r['drain_secs']:.0f}s after "
                     f"writing stopped, {r['runs']} runs ({r['failed']} failed); backlog: {_curve(r['samples'])}"
                     f"{_gc_note(r['gc_pauses'])}")
        lines.append(f"  - {name}: {_cpu_note(r, os.cpu_count() or 1)}")
    lines += goals.lines()
    append_results("\n".join(lines) + "\n")
    print("\n".join(lines))
    goals.finish()


if __name__ == "__main__":
    main()
