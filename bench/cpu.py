"""Where the CPU goes (issue 16, run by hand: `make bench-cpu`): a fixed number of events (default
200,000) through the whole path on a private Postgres (wal_level=logical), with CPU-seconds per
100,000 events for each stage, read from the processes' own CPU counters, side by side with what
Postgres spends writing the same events.

Phases, one after the other (so that each process's CPU belongs to one stage):

1. **write, no subscription**: ``--writers`` processes insert the N rows, ``--rows`` per statement,
   into a table without a subscription; CPU of their Postgres backends (``/proc/<pid>/schedstat``,
   read by each writer about its own backend) = the cost of the insert itself.
2. **write, subscribed**: the same inserts into a table with a real INSERT subscription (the trigger
   writes ``pgstream.events``): writer backends = insert + trigger.
3. **deliver**: the stream is driven in-process (bench/common.py ``Driver``, serial: sensor tick, then
   the requested delivery run with ``execute_in_process``, repeat) until the N events are delivered
   to the file sink. Measured:

   - WAL decoding inside Postgres: the sensor backend's CPU inside each
     ``pg_logical_slot_peek_binary_changes`` and ``pg_replication_slot_advance`` (``schedstat`` of
     that backend around each call; ``engine.replication`` functions wrapped by this script);
   - the rest of Postgres during the ticks (ledger writes and reads, status queries): Postgres'
     process tree during the ticks minus the decoding;
   - reading/recording in the sensor (Python): ``time.thread_time`` of the tick (the sensor runs in
     this thread), of which decoding pgoutput messages (``PgOutputDecoder.decode``);
   - loading in Spark: the Spark driver JVM and its Python workers (the JVM's process tree, utime +
     stime + reaped children, ``/proc/<pid>/stat``) during the runs; Postgres serving the runs
     (reads of ``pgstream.events``, ledger marks) = Postgres' process tree during the runs;
   - publishing: the driver's CPU inside ``FileSink.publish`` (``thread_time``); the rest of the
     driver's CPU during the runs (Dagster, unpacking the partitions, the ledger calls) separately.

4. **decode once**: a second pgoutput slot created just before phase 2 is read in one pass
   (``pg_logical_slot_get_binary_changes``, all of it): what decoding the same WAL once costs, so the
   share of the decoding cost that re-decoding (peek + advance, repeated peeks) accounts for.

The machine's other work does not enter the counters (CPU time, not wall time), but it does slow
caches and the scheduler. Prints a table and one JSON line; appends the table to bench/RESULTS.md.
``--overlap`` delivers while the writers write; ``--open`` also runs the delivery in a thread that
stays open (``delivery.mode: open``) while the sensor ticks, as the daemon and a run worker do (the sensor
then peeks and advances far more often); ``--statements N`` loads pg_stat_statements and lists the
statements that took the most time during delivery.
Row and statement mode: by default the bench runs itself twice in child processes, once with the
subscription in each ``trigger_mode`` (``--modes``; ``--trigger-mode`` runs one mode in this
process), prints them side by side and exits non-zero when the pipeline's CPU over the writing CPU
of either mode is over ``--goal`` (default 1.0). It prints the commit and the load average before
and after.
Usage: python bench/cpu.py [--modes row,statement] [--goal 1.0] [--events 200000] [--writers 2] [--rows 100]
                           [--overlap | --open] [--statements N]
                           [--label L] [--json F] [--no-record]
       python bench/cpu.py --compare before.json after.json   (side by side)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    TABLE_SQL,
    Driver,
    Goals,
    append_results,
    delivered_events,
    load_after,
    machine,
    own_secs,
    sched_secs,
    tree_secs,
    write_config,
)

import pgstream_dagster
from pgstream_dagster.config import DeliveryTuning, load_config
from pgstream_dagster.defs.names import DELIVERY_JOB
from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.engine import replication, spark
from pgstream_dagster.engine.migrations import migrate
from pgstream_dagster.sinks.file import FileSink

HERE = Path(__file__).resolve().parent
PER = 100_000  # events per reported unit


def _writer(url: str, table: str, first: int, count: int, rows: int, out: Any) -> None:
    """Insert ``count`` rows, ``rows`` per statement (autocommit: one transaction each); report the
    CPU its own backend spent."""
    with psycopg.connect(url, autocommit=True) as conn:
        backend = conn.info.backend_pid
        before = sched_secs(backend)
        started = time.monotonic()
        seq, end = first, first + count
        insert = sql.SQL("insert into {} (seq, customer, amount) select g, 'c-' || (g %% 1000), g * 1.5 "
                         "from generate_series(%s::bigint, %s::bigint) g").format(sql.Identifier("public", table))
        while seq < end:
            n = min(rows, end - seq)
            conn.execute(insert, [seq, seq + n - 1])
            seq += n
        out.put((sched_secs(backend) - before, time.monotonic() - started))


def write_phase(url: str, table: str, events: int, writers: int, rows: int, postmaster: int,
                during: Callable[[], Any] | None = None) -> tuple[dict[str, float], Any]:
    """The writers' backends' CPU, the rest of Postgres' and the wall time of the writes; with
    ``during``, what it returns, called while the writers write (Postgres' CPU then includes its)."""
    out: Any = multiprocessing.Queue()
    share = -(-events // writers)
    procs = [multiprocessing.Process(target=_writer, args=(url, table, i * share, min(share, events - i * share),
                                                           rows, out)) for i in range(writers)]
    pg0 = tree_secs(postmaster)
    started = time.monotonic()
    for p in procs:
        p.start()
    side = during() if during is not None else None
    results = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    wall = max(r[1] for r in results) if during is not None else time.monotonic() - started
    pg = tree_secs(postmaster) - pg0
    backends = sum(r[0] for r in results)
    return {"backends": backends, "postgres_other": max(0.0, pg - backends), "wall": wall}, side


# --- the delivery path, instrumented ------------------------------------------------------------

@dataclass
class Meter:
    """What the wrappers accumulate (seconds)."""

    peek_pg: float = 0.0
    peek_calls: int = 0
    peek_messages: int = 0
    advance_pg: float = 0.0
    advance_calls: int = 0
    walsender_pg: float = 0.0  # the group delivery run's reader: its WAL sender decodes
    decode_py: float = 0.0
    publish_py: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


METER = Meter()


@contextmanager
def patched(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, wrapper(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _timed_backend(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(conn: psycopg.Connection, *args: Any, **kw: Any) -> Any:
            pid = conn.info.backend_pid
            before = sched_secs(pid)
            result = original(conn, *args, **kw)
            spent = sched_secs(pid) - before
            if kind == "peek":
                METER.peek_pg += spent
                METER.peek_calls += 1
                METER.peek_messages += result[1]
            else:
                METER.advance_pg += spent
                METER.advance_calls += 1
            return result
        return call
    return wrap


def _timed_thread(attr: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            before = time.thread_time()
            try:
                return original(*args, **kw)
            finally:
                setattr(METER, attr, getattr(METER, attr) + time.thread_time() - before)
        return call
    return wrap


def _past_first_round(timeout: float = 30.0) -> None:
    """Wait until a run of this process has gone idle once (``delivery.run._frozen_process``, where
    the package has it: the full collection and ``gc.freeze`` it does once per process)."""
    from pgstream_dagster.engine.delivery import run as delivery_run

    frozen = getattr(delivery_run, "_frozen_process", None)
    if frozen is not None:
        frozen.wait(timeout)


def _spark_jvm_pid() -> int | None:
    """The pid of this process' Spark JVM, if a Spark context was started (by any thread: the active
    session is per thread, and an open run's session is its thread's)."""
    from pyspark import SparkContext

    context: Any = SparkContext._active_spark_context
    if context is None:
        return None
    return int(context._jvm.java.lang.ProcessHandle.current().pid())


@dataclass
class DeliverTotals:
    tick_py: float = 0.0
    tick_pg: float = 0.0
    ticks: int = 0
    run_py: float = 0.0
    run_pg: float = 0.0
    run_spark: float = 0.0
    run_jvm: float = 0.0
    runs: int = 0
    failed: int = 0
    wall: float = 0.0


def deliver_phase(driver: Driver, url: str, target: int, postmaster: int, timeout: float) -> DeliverTotals:
    """Tick and run (serially) until ``target`` events of stream 1 are delivered; CPU per side."""
    totals = DeliverTotals()
    job = driver.defs.resolve_job_def(DELIVERY_JOB)
    sensor = driver.sensor(1)  # stream 1's reader group's
    resources: Any = driver.defs.resources
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        while delivered_events(conn, 1) < target:
            if time.monotonic() - started > timeout:
                raise SystemExit(f"not delivered after {timeout:.0f}s")
            pg0, py0 = tree_secs(postmaster), time.thread_time()
            ctx = dg.build_sensor_context(instance=driver.instance, cursor=driver.cursor, sensor_name=sensor.name,
                                          resources={"pgstream": resources["pgstream"]})
            tick: Any = sensor.evaluate_tick(ctx)
            totals.tick_py += time.thread_time() - py0
            totals.tick_pg += tree_secs(postmaster) - pg0
            totals.ticks += 1
            driver.cursor = tick.cursor
            for request in tick.run_requests or []:
                jvm = _spark_jvm_pid()
                pg0, py0 = tree_secs(postmaster), time.process_time()
                sp0 = tree_secs(jvm) if jvm else 0.0
                jv0 = own_secs(jvm) if jvm else 0.0
                tags = {**request.tags, "dagster/run_key": request.run_key or ""}
                result = job.execute_in_process(run_config=request.run_config, instance=driver.instance, tags=tags,
                                                raise_on_error=False)
                totals.run_py += time.process_time() - py0
                totals.run_pg += tree_secs(postmaster) - pg0
                jvm = jvm or _spark_jvm_pid()  # started by this run (a lazy session): all its CPU is the run's
                totals.run_spark += (tree_secs(jvm) if jvm else 0.0) - sp0
                totals.run_jvm += (own_secs(jvm) if jvm else 0.0) - jv0
                totals.runs += 1
                totals.failed += 0 if result.success else 1
    totals.wall = time.monotonic() - started
    return totals


def open_phase(driver: Driver, url: str, target: int, timeout: float, tick_secs: float) -> DeliverTotals:
    """``--open``: the daemon's way, runs in a thread (``delivery.mode: open``: the sensor hands new
    batches to the open run) while this thread ticks; CPU over the whole phase (this thread = the
    sensor; the rest of this process = the runs)."""
    totals = DeliverTotals()
    # no JVM yet when every round so far was small (no Spark needed): then it starts in the phase
    jvm = _spark_jvm_pid()
    sp0, jv0 = (tree_secs(jvm), own_secs(jvm)) if jvm else (0.0, 0.0)
    py0, proc0 = time.thread_time(), time.process_time()
    started = time.monotonic()
    senders: dict[int, float] = {}  # WAL sender pid -> its CPU when last sampled (it exits with its run)
    sampled = next_tick = 0.0
    with psycopg.connect(url, autocommit=True) as conn:
        while delivered_events(conn, 1) < target:
            if time.monotonic() - started > timeout:
                raise SystemExit(f"not delivered after {timeout:.0f}s")
            if time.monotonic() - sampled >= 0.25:
                sampled = time.monotonic()
                _sample_senders(conn, senders)
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + tick_secs
                totals.ticks += 1
                if driver.step(1):
                    continue
            time.sleep(0.05 if tick_secs < 0.25 else 0.25)  # (this loop's own reads are Postgres' CPU too)
        _sample_senders(conn, senders)
    driver.wait()  # the group delivery run is asked to end: the open run closes
    METER.walsender_pg += sum(senders.values())
    totals.wall = time.monotonic() - started
    totals.tick_py = time.thread_time() - py0
    totals.run_py = time.process_time() - proc0 - totals.tick_py
    jvm = jvm or _spark_jvm_pid()
    totals.run_spark = (tree_secs(jvm) if jvm else 0.0) - sp0
    totals.run_jvm = (own_secs(jvm) if jvm else 0.0) - jv0
    totals.runs, totals.failed = driver.runs, driver.failed
    return totals


def _sample_senders(conn: psycopg.Connection, senders: dict[int, float]) -> None:
    """The CPU of the open runs' WAL senders so far (a sender is new when its run starts reading)."""
    for (pid,) in conn.execute("select pid from pg_stat_activity where backend_type = 'walsender' "
                               "and application_name like 'pgstream reader %'").fetchall():
        try:
            senders[int(pid)] = sched_secs(int(pid))
        except OSError:  # it ended meanwhile: its last sample stands
            pass


def decode_once(url: str, slot: str, publication: str) -> dict[str, float]:
    """Read ``slot`` in one pass (consuming it): Postgres' decoding CPU, and Python's for the messages."""
    with psycopg.connect(url, autocommit=True) as conn:
        pid = conn.info.backend_pid
        before = sched_secs(pid)
        messages = [data for (data,) in conn.execute(
            "select data from pg_logical_slot_get_binary_changes(%s, null, null, "
            "'proto_version', '1', 'publication_names', %s)", [slot, publication], binary=True).fetchall()]
        pg = sched_secs(pid) - before
    py0 = time.thread_time()
    txns = replication.PgOutputDecoder().decode(messages)
    py = time.thread_time() - py0
    return {"pg": pg, "py": py, "messages": len(messages), "events": sum(len(t.events) for t in txns)}


def top_statements(url: str, limit: int) -> list[dict[str, Any]]:
    """The statements that took the most time in Postgres during delivery (pg_stat_statements)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("select total_exec_time / 1000, calls, rows, "
                            "left(regexp_replace(query, '\\s+', ' ', 'g'), 160) "
                            "from pg_stat_statements order by total_exec_time desc limit %s", [limit]).fetchall()
    return [{"secs": float(r[0]), "calls": int(r[1]), "rows": int(r[2]), "query": str(r[3])} for r in rows]


# --- the report ---------------------------------------------------------------------------------

def rows_of(r: dict[str, Any]) -> list[tuple[str, float]]:
    """(stage, CPU-seconds per 100k events) in pipeline order."""
    n = r["events"] / PER
    w0, w1, d, once = r["write_plain"], r["write_subscribed"], r["deliver"], r["decode_once"]
    sensor_pg = ("sensor and runs in Postgres: ledger, status, reads (all but writers and decoding)"
                 if r.get("overlap") else "sensor in Postgres: ledger, status (tick total - decoding)")
    return [
        ("write: insert (writers' backends, no subscription)", w0["backends"] / n),
        ("write: insert + trigger (writers' backends, subscribed)", w1["backends"] / n),
        ("  of which the trigger (difference)", (w1["backends"] - w0["backends"]) / n),
        ("write: other Postgres processes (WAL writer, checkpointer...)", w1["postgres_other"] / n),
        ("decode in Postgres: peeks", d["peek_pg"] / n),
        ("decode in Postgres: slot advances", d["advance_pg"] / n),
        ("decode in Postgres: the group run's WAL sender (replication protocol)", d.get("walsender_pg", 0.0) / n),
        ("  one decoding pass of the same WAL (reference slot)", once["pg"] / n),
        (sensor_pg, d["tick_pg_other"] / n),
        ("sensor in Python: reading/recording (tick thread)", d["tick_py"] / n),
        ("  of which pgoutput parsing (PgOutputDecoder)", d["decode_py"] / n),
        ("load: Spark JVM + Python workers", d["run_spark"] / n),
        ("  of which the JVM itself", d.get("run_jvm", 0.0) / n),
        ("load: Postgres serving the runs (reads, ledger marks)", d["run_pg"] / n),
        ("run driver Python: Dagster, unpacking, ledger (not publish)", d["run_py_other"] / n),
        ("publish: FileSink.publish (driver)", d["publish_py"] / n),
    ]


def summary(r: dict[str, Any]) -> dict[str, float]:
    n = r["events"] / PER
    d = r["deliver"]
    decode = d["peek_pg"] + d["advance_pg"] + d.get("walsender_pg", 0.0)
    pipeline = (decode + d["tick_pg_other"] + d["tick_py"] + d["run_spark"] + d["run_pg"] + d["run_py_other"]
                + d["publish_py"])
    writing = r["write_subscribed"]["backends"]
    return {
        "pipeline_per_100k": pipeline / n,
        "writing_per_100k": writing / n,
        "pipeline_over_writing": pipeline / writing if writing else 0.0,
        "decode_per_100k": decode / n,
        "decode_once_per_100k": r["decode_once"]["pg"] / n,
        "redecode_share": 1 - r["decode_once"]["pg"] / decode if decode else 0.0,
        "postgres_share_of_pipeline": (decode + d["tick_pg_other"] + d["run_pg"]) / pipeline if pipeline else 0.0,
    }


def table(*results: dict[str, Any]) -> list[str]:
    """One column per result (``--compare``: side by side, the last one against the first)."""
    labels = [r.get("label") or f"run {i + 1}" for i, r in enumerate(results)]
    ratio = len(results) > 1
    out = ["| stage | " + " | ".join(f"{label} (CPU-s per 100k events)" for label in labels)
           + (f" | {labels[-1]} / {labels[0]} |" if ratio else " |"),
           "|---|" + "---:|" * (len(results) + ratio)]
    columns = [rows_of(r) for r in results]
    sums = [summary(r) for r in results]
    named = [(name, [c[i][1] for c in columns]) for i, (name, _) in enumerate(columns[0])]
    named.append(("**pipeline total** (decode + sensor + load + run + publish)",
                  [s["pipeline_per_100k"] for s in sums]))
    named.append(("**writing** (insert + trigger, writers' backends)", [s["writing_per_100k"] for s in sums]))
    named.append(("pipeline / writing", [s["pipeline_over_writing"] for s in sums]))
    for name, values in named:
        row = f"| {name} | " + " | ".join(f"{v:.2f}" for v in values)
        if ratio:
            row += f" | {values[-1] / values[0]:.2f}x" if values[0] else " | -"
        out.append(row + " |")
    return out


def _modes(args: argparse.Namespace) -> None:
    """Each trigger mode in a child process (the same arguments, ``--trigger-mode``), side by side."""
    header = machine()
    forwarded: list[str] = []
    skip = False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg in ("--modes", "--goal", "--json", "--label"):
            skip = True
            continue
        if arg.startswith(("--modes=", "--goal=", "--json=", "--label=")) or arg == "--no-record":
            continue
        forwarded.append(arg)
    results = []
    with tempfile.TemporaryDirectory(prefix="pgstream-cpu-modes-") as tmp:
        for mode in args.modes.split(","):
            out = Path(tmp) / f"{mode}.json"
            child = [sys.executable, __file__, *forwarded, "--trigger-mode", mode, "--json", str(out), "--no-record",
                     "--label", f"{mode} mode{', ' + args.label if args.label else ''}"]
            if subprocess.run(child, check=False, cwd=tmp).returncode != 0:
                raise SystemExit(f"bench/cpu.py: the {mode} mode run failed")
            results.append(json.loads(out.read_text()))
    after = load_after()
    goals = Goals()
    for r in results:
        goals.check(f"{r['label']}: pipeline CPU / writing CPU", r["summary"]["pipeline_over_writing"],
                    at_most=args.goal)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## CPU per stage (bench/cpu.py), row and statement mode, {stamp}, {args.events:,} events"
             f"{', ' + args.label if args.label else ''}",
             f"Machine: {header}; {after}. Method: bench/cpu.py --modes {args.modes}: one child process per "
             f"trigger mode, one after the other, each with its own private Postgres ({'--open' if args.open else ''}"
             f"{' --overlap' if args.overlap and not args.open else ''}); the last column is the last mode over the "
             "first.", "", *table(*results), "", *goals.lines()]
    print("\n".join(lines))
    if not args.no_record:
        append_results("\n".join(lines) + "\n")
    goals.finish()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100, help="rows per insert statement (one transaction)")
    parser.add_argument("--batch-size", type=int, default=10_000, help="batch.max_size")
    parser.add_argument("--max-events-per-run", type=int, default=200_000)
    parser.add_argument("--chunk", type=int, default=5000, help="delivery.chunk_size")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed for delivery")
    parser.add_argument("--overlap", action="store_true",
                        help="deliver while the writers write (as in production) instead of after them; Postgres' "
                             "CPU besides the writers' backends and the decoding is then one figure")
    parser.add_argument("--open", action="store_true",
                        help="with --overlap: runs in a thread and stay open while the sensor "
                             "ticks, as the daemon and a run worker overlap (the sensor then peeks far more often)")
    parser.add_argument("--tick-secs", type=float, default=1.0,
                        help="--open: the sensor is evaluated at most this often (the daemon: at most every "
                             "sensor.interval_secs, 1 s by default, and every 5 s at most; before 2026-11-27 the "
                             "bench ticked every 0.05 s)")
    parser.add_argument("--direct-max-events", type=int,
                        default=DeliveryTuning.model_fields["direct_max_events"].default,
                        help="delivery.tuning.direct_max_events (default: the product's; 0: every round is a "
                             "Spark job, as before)")
    parser.add_argument("--label", default="", help="what this run measures (e.g. 'before', 'after')")
    parser.add_argument("--json", type=Path, help="also write the JSON result to this file")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--statements", type=int, default=0, metavar="N",
                        help="load pg_stat_statements and report the N statements that took the most time "
                             "during delivery (to find what a Postgres figure is made of)")
    parser.add_argument("--modes", default="row,statement",
                        help="trigger modes to measure, each in a child process, side by side")
    parser.add_argument("--trigger-mode", choices=("row", "statement"),
                        help="measure this one trigger mode in this process")
    parser.add_argument("--goal", type=float, default=1.0, help="pipeline CPU / writing CPU must be at most this")
    parser.add_argument("--compare", type=Path, nargs="+", metavar="JSON",
                        help="print the results saved with --json side by side (no run)")
    args = parser.parse_args()
    args.overlap = args.overlap or args.open
    if args.compare:
        print("\n".join(table(*(json.loads(path.read_text()) for path in args.compare))))
        return
    if args.trigger_mode is None:
        _modes(args)
        return
    header = machine()
    n = args.events
    with tempfile.TemporaryDirectory(prefix="pgstream-cpu-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        # autovacuum off: a vacuum of pgstream.events would land in whichever phase it happens in
        # (the write phases analyze their table instead)
        settings = {"fsync": "off", "synchronous_commit": "off", "autovacuum": "off"}
        if args.statements:
            settings["shared_preload_libraries"] = "pg_stat_statements"
        pg = ensure_running(tmpdir / "pg", extra_settings=settings)
        try:
            pg.create_database("cpu")
            url = pg.url_for("cpu")
            migrate(url)
            postmaster = int((tmpdir / "pg" / "postmaster.pid").read_text().split()[0])
            sink_path = tmpdir / "out" / "events.jsonl"
            stream = {"id": 1, "sink": {"type": "file", "path": str(sink_path)},
                      "batch": {"max_size": args.batch_size, "max_fill_secs": 1.0},
                      "sensor": {"tick_budget_secs": 2},
                      "delivery": {"chunk_size": args.chunk, "max_events_per_run": args.max_events_per_run,
                                   "mode": "open" if args.open else "per_batch",
                                   "tuning": {"direct_max_events": args.direct_max_events}}}
            config_path = write_config(tmpdir / "cpu.yaml", url, stream, trigger_mode=args.trigger_mode)
            cfg = load_config(config_path).streams[0]
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(TABLE_SQL.replace("bench_orders", "bench_plain"))
                if args.statements:
                    conn.execute("create extension if not exists pg_stat_statements")
            result: dict[str, Any] = {"events": n, "writers": args.writers, "rows": args.rows,
                                      "label": args.label or f"{args.trigger_mode} mode",
                                      "module": pgstream_dagster.__file__}
            # 1. the insert alone, before any slot exists (its WAL is nobody's to decode)
            result["write_plain"] = write_phase(url, "bench_plain", n, args.writers, args.rows, postmaster)[0]
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("analyze public.bench_plain")
                conn.execute("insert into public.bench_orders (seq, customer, amount) values (-1, 'warm-up', 0)")
            with (dg.DagsterInstance.ephemeral() as instance,
                  patched(replication, "peek_rows", _timed_backend("peek")),
                  patched(replication, "advance", _timed_backend("advance")),
                  patched(replication, "advance_at_least", _timed_backend("advance")),
                  patched(replication.PgOutputDecoder, "decode", _timed_thread("decode_py")),
                  patched(FileSink, "publish", _timed_thread("publish_py"))):
                driver = Driver(config_path, instance, background=args.open)
                # warm-up, as a long-running deployment is: slot, Spark session, Python workers
                if args.open:
                    # Spark started now (a one-event round does not need it, a large one will), and the
                    # warm-up's run left open and reading the slot when the writes begin
                    spark.open_session(load_config(config_path))
                    with psycopg.connect(url, autocommit=True) as conn:
                        while delivered_events(conn, 1) < 1:
                            if not driver.step(1):
                                time.sleep(0.05)
                    # and past what a run does once per process after its first round (a full collection,
                    # then gc.freeze: 0.1-0.2 CPU-s, which a long-running run worker has behind it)
                    _past_first_round()
                else:
                    deliver_phase(driver, url, 1, postmaster, args.timeout)
                with psycopg.connect(url, autocommit=True) as conn:
                    replication.create_slot(conn, "cpu_reference")
                global METER
                METER = Meter()
                if args.statements:
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute("select pg_stat_statements_reset()")
                if args.overlap:
                    # 2+3. deliver while the same inserts go through the subscription trigger
                    result["write_subscribed"], totals = write_phase(
                        url, "bench_orders", n, args.writers, args.rows, postmaster,
                        during=lambda: open_phase(driver, url, n + 1, args.timeout, args.tick_secs) if args.open
                        else deliver_phase(driver, url, n + 1, postmaster, args.timeout))
                else:
                    # 2. the same inserts through the subscription trigger
                    result["write_subscribed"] = write_phase(url, "bench_orders", n, args.writers, args.rows,
                                                             postmaster)[0]
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute("analyze public.bench_orders")
                        conn.execute("analyze pgstream.events")
                    METER = Meter()
                    if args.statements:
                        with psycopg.connect(url, autocommit=True) as conn:
                            conn.execute("select pg_stat_statements_reset()")
                    # 3. deliver them
                    totals = deliver_phase(driver, url, n + 1, postmaster, args.timeout)
                m = METER
                if args.statements:
                    result["statements"] = top_statements(url, args.statements)
            decode = m.peek_pg + m.advance_pg + m.walsender_pg
            if args.overlap:
                # Postgres' CPU is not split by window: what is not the writers' or decoding is the pipeline's
                pg_other = result["write_subscribed"].pop("postgres_other") - decode
                result["write_subscribed"]["postgres_other"] = 0.0
                tick_pg_other, run_pg = max(0.0, pg_other), 0.0
            else:
                tick_pg_other, run_pg = max(0.0, totals.tick_pg - decode), totals.run_pg
            result["overlap"] = args.overlap
            result["deliver"] = {
                "peek_pg": m.peek_pg, "peek_calls": m.peek_calls, "peek_messages": m.peek_messages,
                "advance_pg": m.advance_pg, "advance_calls": m.advance_calls, "walsender_pg": m.walsender_pg,
                "tick_pg_other": tick_pg_other, "tick_py": totals.tick_py,
                "decode_py": m.decode_py, "ticks": totals.ticks,
                "run_spark": totals.run_spark, "run_jvm": totals.run_jvm, "run_pg": run_pg,
                "run_py_other": max(0.0, totals.run_py - m.publish_py), "publish_py": m.publish_py,
                "runs": totals.runs, "failed": totals.failed, "wall": totals.wall,
            }
            # 4. the same WAL, decoded once
            result["decode_once"] = decode_once(url, "cpu_reference", cfg.publication)
            with sink_path.open("rb") as f:
                lines = sum(1 for _ in f)
            if lines != n + 1 or result["decode_once"]["events"] != n:
                raise SystemExit(f"counts differ: {n} written, {lines - 1} in the sink (after the warm-up event), "
                                 f"{result['decode_once']['events']} decoded by the reference slot")
            result["sink_lines"] = lines
        finally:
            pg.destroy()
    result["summary"] = summary(result)
    after = load_after()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    d, s = result["deliver"], result["summary"]
    driving = ("open runs in a thread while the sensor ticks" if args.open
               else "serial: sensor tick, then the requested run")
    lines_out = [
        f"\n## CPU per stage (bench/cpu.py) {stamp}, {n:,} events{', ' + args.label if args.label else ''}",
        f"Machine: {header}; {after}. Method: bench/cpu.py; {args.writers} writer processes, {args.rows} rows per "
        f"insert statement, subscription in {args.trigger_mode} mode, fsync off, synchronous_commit off, "
        "autovacuum off; "
        f"{'while they write (--overlap)' if args.overlap else 'then, once they are done,'} the stream driven "
        "in-process "
        f"({driving}, "
        "execute_in_process; Spark local[2], warm; batch.max_size "
        f"{args.batch_size}, chunk {args.chunk}, max_events_per_run {args.max_events_per_run}, "
        f"direct_max_events {args.direct_max_events}) until all "
        f"{n:,} are in the file sink (counted: {result['sink_lines'] - 1:,} lines after the warm-up event); "
        "CPU from /proc (Postgres backends: schedstat; process trees: utime+stime+reaped children) and "
        f"thread_time in the driver. Writes took {result['write_plain']['wall']:.1f}s (plain) and "
        f"{result['write_subscribed']['wall']:.1f}s (subscribed); delivery {d['wall']:.1f}s wall, {d['ticks']} ticks, "
        f"{d['runs']} runs ({d['failed']} failed), {d['peek_calls']} peeks ({d['peek_messages']:,} messages "
        f"returned), {d['advance_calls']} advances.",
        "", *table(result), "",
        f"Pipeline CPU / writing CPU: **{s['pipeline_over_writing']:.2f}x**. Decoding in Postgres "
        f"{s['decode_per_100k']:.2f} CPU-s per 100k vs {s['decode_once_per_100k']:.2f} for one pass over the same WAL: "
        f"re-decoding is {s['redecode_share']:.0%} of the decoding cost. Postgres' share of the pipeline: "
        f"{s['postgres_share_of_pipeline']:.0%}.",
    ]
    for st in result.get("statements", []):
        lines_out.append(f"- {st['secs']:.2f}s in {st['calls']} calls ({st['rows']} rows): `{st['query']}`")
    print("\n".join(lines_out))
    if not args.no_record:
        append_results("\n".join(lines_out) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
