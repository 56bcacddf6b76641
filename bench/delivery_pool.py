"""Many streams' deliveries: a process per stream or one process hosting them all (issue 30; run by hand:
`make bench-delivery-pool`).

Without Dagster: the delivery engine (:class:`~pgstream_dagster.engine.delivery.run.DeliveryRun`) and the
reader group's recording loop (:func:`~pgstream_dagster.engine.ingest.consume_group`) directly, so the
figures are the engine's own and the hosting shape is the only difference between the modes.

Per phase: a fresh database on a private Postgres (``wal_level=logical``), N tables each with an INSERT
subscription and a stream in one reader group (one slot), each stream delivering to its own path of an
HTTP receiver in a child process (batch mode; ``/fail/<id>`` answers 500). The group's recording loop runs
in a child process of its own (``--role reader``). Each stream's delivery is a warm open run
(``delivery.mode open``: open for what commits; the group's reader hands it its batches), hosted either

- ``process``: N child processes, one DeliveryRun each (today's run per stream, without Dagster's own
  overhead per run), or
- ``thread``: one child process hosting the N DeliveryRuns, a thread each (each with its own sink, lease
  connection and ledger state: the design of a group delivery run).

A host restarts a stream's run after it fails (1 s later, the same open run: what was handed to it is
retried), as the group run would. Measured, with one row a second on every table for ``--window`` s:
processes, total RSS (and PSS) of the delivery processes at the window's end, their CPU and the Postgres
server's over the window per event, commit -> sink p50/p99, events missing at the window's end (read 1 s
after the last commit, and again once drained), Postgres connections the delivery processes hold, and
the time from the runs' start to every stream's first event. The failing phase points stream 1's sink at
``/fail/1`` (HTTP 500) and reports the other streams' figures.

Usage: python bench/delivery_pool.py [--streams 1,10,50,100] [--modes process,thread] [--window 25]
                                     [--fail 50] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pgstream_dagster.config import StreamConfig, load_config
from pgstream_dagster.devdb import LocalPostgres, ensure_running
from pgstream_dagster.engine import ingest
from pgstream_dagster.engine.delivery.run import DeliveryRun, Host
from pgstream_dagster.engine.ledger import state
from pgstream_dagster.engine.migrations import migrate

if TYPE_CHECKING:
    from common import Webhook

HERE = Path(__file__).resolve().parent
GROUP = "pool"
MiB = 2**20


# --- the children: the group's reader, and delivery hosts -----------------------------------------

class _Log:
    """A run's log: warnings and errors to stderr (one line each), the rest dropped."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id

    def info(self, msg: str) -> None:
        pass

    def warning(self, msg: str) -> None:
        print(f"stream {self.stream_id} warning: {msg}", file=sys.stderr, flush=True)

    def error(self, msg: str) -> None:
        print(f"stream {self.stream_id} error: {msg}", file=sys.stderr, flush=True)


def _streams(config: Path) -> tuple[str, list[StreamConfig]]:
    loaded = load_config(config)
    return loaded.database_url.get_secret_value(), list(loaded.streams)


def _read(config: Path, stop: Path) -> None:
    """The group's recording loop until ``stop`` exists (what a group sensor's ticks do, back to back)."""
    url, streams = _streams(config)
    with psycopg.connect(url, autocommit=True, application_name="bench-reader") as conn:
        while not stop.exists():
            ingest.consume_group(conn, GROUP, streams, 1.0)


def _serve_stream(stream: StreamConfig, url: str, stop: Path, ready: threading.Event, failures: list[str]) -> None:
    """One stream's delivery: its warm open run, restarted 1 s after it fails (what was handed to it is retried)."""
    run_key = f"pool-{stream.id}"
    log = _Log(stream.id)
    with psycopg.connect(url, autocommit=True) as conn:
        state.open_warm_run(conn, stream.id, run_key)
    attempt = 0
    while not stop.exists():
        attempt += 1
        run_id = f"pool-{stream.id}-{attempt}"
        try:
            run = DeliveryRun(stream, url, url, run_id, run_key=run_key).start(log)
            ready.set()
            host = Host(run_id, log, stop_check=lambda: "the window ended" if stop.exists() else None)
            for _round in run.deliver(host):
                pass
        except Exception as exc:  # a failing sink: the host retries the run, as a group run would
            failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            ready.set()
            time.sleep(1.0)


def _host(config: Path, ids: list[int], stop: Path, ready: Path) -> None:
    """A delivery process: a DeliveryRun per stream of ``ids``, a thread each; ``ready`` written once every
    run holds its lease; exits once ``stop`` exists and the runs closed (or 15 s after)."""
    url, streams = _streams(config)
    by_id = {s.id: s for s in streams}
    threads: list[threading.Thread] = []
    events: list[threading.Event] = []
    failures: list[str] = []
    for i in ids:
        event = threading.Event()
        thread = threading.Thread(target=_serve_stream, args=(by_id[i], url, stop, event, failures),
                                  name=f"stream-{i}", daemon=True)
        thread.start()
        threads.append(thread)
        events.append(event)
    for event in events:
        event.wait(120)
    ready.write_text("ok")
    while not stop.exists():
        time.sleep(0.2)
    deadline = time.monotonic() + 15
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if failures:
        print(json.dumps({"failures": len(failures), "first": failures[0]}), flush=True)


# --- the parent -----------------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _insert(table: int) -> sql.Composed:
    return sql.SQL("insert into public.{} (seq) values (%s)").format(sql.Identifier(f"bench_s{table}"))


def _setup(pg: LocalPostgres, name: str, count: int, receiver: Webhook, tmp: Path, failing: set[int]) -> Path:
    pg.create_database(name)
    url = pg.url_for(name)
    migrate(url)
    streams = [{"id": i, "reader": GROUP, "batch": {"max_size": 100, "max_fill_secs": 0},
                "delivery": {"mode": "open", "tuning": {"max_run_secs": 3600, "report_every_secs": 60}},
                "retry": {"initial_backoff_secs": 1, "max_backoff_secs": 1},
                "sink": {"type": "http", "mode": "batch", "max_retry_secs": 3,
                         "url": f"{receiver.base}/{'fail' if i in failing else 'hook'}/{i}"}}
               for i in range(1, count + 1)]
    from common import write_many_streams  # (here: the children this bench starts stay free of Dagster)

    config = write_many_streams(tmp / f"{name}.yaml", url, streams)
    with psycopg.connect(url, autocommit=True) as conn:
        ingest.consume_group(conn, GROUP, list(load_config(config).streams), 0)  # the group's slot, every member joined
    return config


def _child(role: str, config: Path, stop: Path, *, ids: list[int] | None = None,
           ready: Path | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--config", str(config),
               "--stop", str(stop)]
    if ids is not None and ready is not None:
        command += ["--ids", ",".join(map(str, ids)), "--ready", str(ready)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _memory(procs: list[psutil.Process]) -> tuple[int, int]:
    rss = pss = 0
    for p in procs:
        try:
            info = p.memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        except psutil.Error:
            pass
    return rss, pss


def _connections(procs: list[psutil.Process], port: int) -> int:
    held = 0
    for p in procs:
        try:
            held += sum(1 for c in p.net_connections(kind="tcp") if c.raddr and c.raddr.port == port)
        except psutil.Error:
            pass
    return held


def _postgres(pg: LocalPostgres) -> list[psutil.Process]:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        (pid,) = conn.execute("select pg_backend_pid()").fetchone()  # type: ignore[misc]
        parent = psutil.Process(psutil.Process(pid).ppid())  # (while the backend lives)
    return [parent, *parent.children()]


def _writer(url: str, count: int, start: float, window: float, committed: dict[tuple[int, int], float]) -> None:
    """One row a second on every table, spread over the second; ``committed``: (table, seq) -> commit time."""
    with psycopg.connect(url, autocommit=True) as conn:
        tick = 0
        while tick < window:
            for i in range(1, count + 1):
                time.sleep(max(0.0, start + tick + (i - 1) / count - time.time()))
                conn.execute(_insert(i), [tick + 1])
                committed[(i, tick + 1)] = time.time()
            tick += 1


def phase(pg: LocalPostgres, tmp: Path, count: int, mode: str, window: float, failing: set[int]) -> dict[str, Any]:
    name = f"pool_{mode}_{count}" + ("_fail" if failing else "")
    from common import Webhook  # (here: the children this bench starts stay free of Dagster)

    receiver = Webhook()
    config = _setup(pg, name, count, receiver, tmp, failing)
    url = pg.url_for(name)
    stop = tmp / f"{name}.stop"
    reader = _child("reader", config, stop)
    ids = list(range(1, count + 1))
    groups = [[i] for i in ids] if mode == "process" else [ids]
    started = time.monotonic()
    readies = [tmp / f"{name}.ready{n}" for n in range(len(groups))]
    hosts = [_child("host", config, stop, ids=g, ready=r) for g, r in zip(groups, readies, strict=True)]
    result: dict[str, Any] = {"mode": mode, "streams": count, "failing": sorted(failing)}
    try:
        while not all(r.exists() for r in readies):
            if any(h.poll() is not None for h in hosts) or time.monotonic() - started > 300:
                raise RuntimeError(f"{name}: a delivery process ended or did not start")
            time.sleep(0.1)
        result["start_secs"] = time.monotonic() - started
        healthy = [i for i in ids if i not in failing]
        with psycopg.connect(url, autocommit=True) as conn:
            first_at = time.time()
            for i in ids:
                conn.execute(_insert(i), [0])
        firsts: dict[int, float] = {}
        deadline = time.monotonic() + 60
        while len(firsts) < len(healthy) and time.monotonic() < deadline:
            for s, q, t in receiver.received_by_stream():
                if q == 0 and s not in firsts:
                    firsts[s] = t - first_at
            time.sleep(0.2)
        result["first_event_max_secs"] = max(firsts.values()) if firsts else None
        procs = [psutil.Process(h.pid) for h in hosts]
        pg_procs = _postgres(pg)
        reader_proc = [psutil.Process(reader.pid)]
        before = (_cpu(procs), _cpu(pg_procs), _cpu(reader_proc))
        committed: dict[tuple[int, int], float] = {}
        _writer(url, count, time.time() + 0.5, window, committed)
        time.sleep(1.0)  # the window's end: 1 s after the last commit
        at_end = {(s, q) for s, q, _t in receiver.received_by_stream()}
        after = (_cpu(procs), _cpu(pg_procs + [p for p in _postgres(pg) if p not in pg_procs]), _cpu(reader_proc))
        result["processes"] = len(hosts)
        result["rss_bytes"], result["pss_bytes"] = _memory(procs)
        result["connections"] = _connections(procs, pg.port)
        with psycopg.connect(url, autocommit=True) as conn:
            result["slots"] = conn.execute("select count(*) from pg_replication_slots where database = %s",
                                           [name]).fetchone()[0]  # type: ignore[index]
            result["db_connections"] = conn.execute(
                "select count(*) from pg_stat_activity where datname = %s and backend_type = 'client backend'",
                [name]).fetchone()[0]  # type: ignore[index]
        drain = time.monotonic() + 15
        while time.monotonic() < drain:
            got = {(s, q): t for s, q, t in receiver.received_by_stream() if q > 0}
            if all(k in got for k in committed if k[0] not in failing):
                break
            time.sleep(0.5)
        ok = {k: v for k, v in committed.items() if k[0] not in failing}
        lat = [got[k] - v for k, v in ok.items() if k in got]
        result.update(events=len(ok), delivered=len(lat), missing_at_end=sum(1 for k in ok if k not in at_end),
                      missing_drained=len(ok) - len(lat), p50_ms=1000 * _pct(lat, 0.5), p99_ms=1000 * _pct(lat, 0.99),
                      max_ms=1000 * max(lat, default=float("nan")),
                      failing_delivered=sum(1 for k in committed if k[0] in failing and k in got))
        result["cpu_ms_per_event"] = 1000 * (after[0] - before[0]) / max(1, len(lat))
        result["pg_cpu_ms_per_event"] = 1000 * (after[1] - before[1]) / max(1, len(lat))
        result["reader_cpu_ms_per_event"] = 1000 * (after[2] - before[2]) / max(1, len(lat))
    finally:
        stop.write_text("stop")
        for h in [*hosts, reader]:
            try:
                out, _ = h.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                h.kill()
                out, _ = h.communicate()
            for line in (out or "").splitlines():
                if line.startswith("{") and "failures" in line:
                    result["run_failures"] = result.get("run_failures", 0) + json.loads(line)["failures"]
        receiver.stop()
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("select pg_drop_replication_slot(slot_name) from pg_replication_slots where database = %s",
                         [name])
    return result


def _line(r: dict[str, Any]) -> str:
    fail = f", stream {r['failing'][0]}'s sink answering 500 ({r['failing_delivered']} of it delivered, " \
           f"{r.get('run_failures', 0)} run failures retried)" if r["failing"] else ""
    first = f"{r['first_event_max_secs']:.2f}s" if r["first_event_max_secs"] is not None else "none"
    return (f"- {r['mode']}, {r['streams']} streams{fail}: {r['processes']} delivery processes "
            f"(started in {r['start_secs']:.1f}s), RSS {r['rss_bytes'] / MiB:,.0f} MiB (PSS {r['pss_bytes'] / MiB:,.0f}"
            f" MiB); CPU {r['cpu_ms_per_event']:.2f} ms per event in delivery, {r['pg_cpu_ms_per_event']:.2f} in "
            f"Postgres, {r['reader_cpu_ms_per_event']:.2f} in the group's reader; p50 {r['p50_ms']:.0f} ms, "
            f"p99 {r['p99_ms']:.0f} ms, max {r['max_ms']:.0f} ms over {r['events']} events; missing at the window's "
            f"end {r['missing_at_end']}, once drained {r['missing_drained']}; first event of every stream within "
            f"{first}; {r['connections']} Postgres connections held by the delivery processes "
            f"({r['db_connections']} on the database), {r['slots']} slot")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["bench", "reader", "host"], default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stop", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--streams", default="1,10,50,100", help="phases: streams per phase")
    parser.add_argument("--modes", default="process,thread", help="process (one per stream), thread (one process)")
    parser.add_argument("--window", type=float, default=25, help="seconds of one row a second on every table")
    parser.add_argument("--fail", type=int, default=50,
                        help="streams of the phase where stream 1's sink answers 500 (both modes); 0: none")
    parser.add_argument("--record", action=argparse.BooleanOptionalAction, default=True,
                        help="append the figures to bench/RESULTS.md")
    args = parser.parse_args()
    if args.role == "reader":
        _read(args.config, args.stop)
        return
    if args.role == "host":
        logging.disable(logging.WARNING)  # a failing sink's retries: counted (run failures), not printed
        _host(args.config, [int(i) for i in args.ids.split(",")], args.stop, args.ready)
        return
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE.parent).stdout.strip()
    print(f"# commit {commit}, load average {load} at start", flush=True)
    results: list[dict[str, Any]] = []
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="pgstream-pool-") as tmpdir:
        tmp = Path(tmpdir)
        pg = ensure_running(tmp / "pg", extra_settings={"fsync": "off", "max_connections": "500",
                                                        "max_replication_slots": "10", "max_wal_senders": "10"})
        try:
            for count in (int(c) for c in args.streams.split(",")):
                for mode in modes:
                    results.append(phase(pg, tmp, count, mode, args.window, set()))
                    print(_line(results[-1]), flush=True)
            if args.fail:
                for mode in modes:
                    results.append(phase(pg, tmp, args.fail, mode, args.window, {1}))
                    print(_line(results[-1]), flush=True)
        finally:
            pg.destroy()
    end_load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpu = {(r["mode"], r["streams"]): r["cpu_ms_per_event"] for r in results if not r["failing"]}
    lines = [f"\n## Delivery of many streams: a process per stream vs one process hosting them {stamp}, "
             f"commit {commit}",
             f"Machine: {os.cpu_count()} CPUs, load average {load} at start, {end_load} at the end. Method: "
             f"bench/delivery_pool.py (no Dagster: DeliveryRun and the group's recording loop directly); every "
             f"stream in one reader group, a warm open run each, HTTP batch sink to a receiver in a child process; "
             f"one row a second on every table for {args.window:g}s; missing 'at the end' read 1 s after the last "
             f"commit.",
             *[_line(r) for r in results]]
    if ("thread", 1) in cpu:
        lines.append("- CPU per event in delivery against one stream in one process: " + ", ".join(
            f"{m} {n}: {v / cpu[('thread', 1)]:.2f}x" for (m, n), v in cpu.items()))
    text = "\n".join(lines)
    print(text)
    if args.record:
        from common import append_results  # (here: the children this bench starts stay free of Dagster)

        append_results(text + "\n")


if __name__ == "__main__":
    main()
