"""Shared pieces of the streaming benchmarks (bench/sustained.py, bench/latency.py): a private
Postgres, a webhook receiver in a child process that records when each event arrived, and the
in-process driver (the stream's group's sensor tick, then every requested run with ``execute_in_process``,
repeat) that ``tests/support/harness.py`` uses, against a real (ephemeral) Dagster instance. A benchmark
ended by SIGTERM (``timeout``) unwinds as on Ctrl-C: the Postgres and ``dg dev`` it started are stopped."""

from __future__ import annotations

import collections
import io
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import yaml
from psycopg import sql

from pgstream_dagster.config import DIRECT_MAX_EVENTS, load_config

try:
    from pgstream_dagster.defs.location import build_definitions
    from pgstream_dagster.defs.names import DELIVERY_JOB, GROUP_DELIVERY_JOB
    from pgstream_dagster.engine.subscriptions import apply_subscriptions
except ImportError:  # a --baseline tree from before pgstream_dagster/engine and defs/ (ecb0130 and older)
    from pgstream_dagster.jobs import DELIVERY_JOB  # type: ignore[no-redef]
    GROUP_DELIVERY_JOB = "pgstream_group_delivery"
    from pgstream_dagster.location import build_definitions  # type: ignore[no-redef]
    from pgstream_dagster.subscriptions import apply_subscriptions  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent


def _unwind(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _unwind)  # the benchmark's finally blocks stop what it started

TABLE_SQL = """create table if not exists public.bench_orders (
    id bigserial primary key, seq bigint not null, customer text not null, amount numeric not null,
    committed_at double precision)"""


def package_tree(ref: str, into: Path, *paths: str) -> Path:
    """``paths`` of the repository (all of it when none) as of git ``ref``, written under ``into``: another
    version's package for a bench to run side by side with this tree's (``PYTHONPATH`` = ``into``)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, *paths], capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def version_worker(script: str, tree: Path, *argv: str) -> dict[str, Any]:
    """``script --worker ARGV`` run by the version of the package at ``tree`` (``PYTHONPATH``): the JSON its last
    line prints, which names the package it imported (checked to be ``tree``'s)."""
    child = subprocess.run([sys.executable, script, "--worker", *argv], env={**os.environ, "PYTHONPATH": str(tree)},
                           check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    assert Path(result["package"]) == tree / "pgstream_dagster", result
    return result


def versions_lines(versions: dict[int, tuple[str, Path]], timings: dict[int, list[float]], events: int) -> list[str]:
    """A result's lines for this tree's version (key 1) and each baseline: median seconds, events per second, the
    baseline's ratio to this tree's time, every round."""
    now = statistics.median(timings[1])
    lines = [f"- {versions[1][0]}: {now:.2f}s = {events / now:,.0f} events/s "
             f"(rounds {', '.join(f'{t:.2f}' for t in timings[1])})"]
    for i in list(versions)[1:]:
        old = statistics.median(timings[i])
        lines.append(f"- baseline {versions[i][0]}: {old:.2f}s = {events / old:,.0f} events/s; current takes "
                     f"{now / old:.2f}x its time (rounds {', '.join(f'{t:.2f}' for t in timings[i])})")
    return lines


def append_results(text: str) -> None:
    """Append ``text`` to bench/RESULTS.md, as given (the history every bench keeps)."""
    with (Path(__file__).resolve().parent / "RESULTS.md").open("a", encoding="utf-8") as f:
        f.write(text)


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def commit() -> str:
    """The checkout's commit (short hash), ``+dirty`` when its tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "pgstream_dagster", "sql",
                                "bench", ":!bench/RESULTS.md"], check=False).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> str:
    """The header of a result: machine, commit, load average at start (print :func:`load_after` at the end)."""
    text = (f"{platform.platform()}, {os.cpu_count()} CPUs, commit {commit()}, load average {load_average()} at "
            f"start, Python {platform.python_version()}")
    print(f"# {text}", flush=True)
    return text


def load_after() -> str:
    text = f"load average {load_average()} at the end"
    print(f"# {text}", flush=True)
    return text


def spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    """``median (min-max, n values)``."""
    return (f"median {fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))}, "
            f"{len(values)} values)")


class Goals:
    """A benchmark's stated goals: each :meth:`check` is recorded; :meth:`finish` prints them and
    exits non-zero when one was missed (after the results are written)."""

    def __init__(self) -> None:
        self.checks: list[tuple[str, bool]] = []

    def check(self, what: str, value: float, *, at_least: float | None = None, at_most: float | None = None) -> bool:
        ok = (at_least is None or value >= at_least) and (at_most is None or value <= at_most)
        bounds = ([f">= {at_least:g}"] if at_least is not None else []) + ([f"<= {at_most:g}"] if at_most is not None
                                                                          else [])
        bound = " and ".join(bounds)
        self.checks.append((f"{what}: {value:.3g} (goal {bound}): {'met' if ok else 'MISSED'}", ok))
        return ok

    def lines(self) -> list[str]:
        return [f"- goal {text}" for text, _ in self.checks]

    def finish(self) -> None:
        for text, _ in self.checks:
            print(f"goal {text}")
        missed = [text for text, ok in self.checks if not ok]
        if missed:
            print(f"{len(missed)} goal(s) missed", file=sys.stderr)
            raise SystemExit(1)


class _Receiver(BaseHTTPRequestHandler):
    """POST ``/hook`` (one stream) or ``/hook/<stream>``: records ``(stream (0 for /hook), payload new.seq,
    receipt time)`` and answers 204; ``/fail/<stream>``: 500; ``/hang/<stream>``: 500 after two minutes (past any
    sink's timeout: a webhook that hangs). GET ``/received``: what was recorded, GET ``/count``: how many."""

    protocol_version = "HTTP/1.1"
    received: list[tuple[int, int, float]]
    lock: threading.Lock

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path.startswith(("/fail/", "/hang/")):
            if self.path.startswith("/hang/"):
                time.sleep(120)
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        now = time.time()
        payloads = json.loads(body)
        tail = self.path.rstrip("/").rsplit("/", 1)[1]
        stream = int(tail) if tail.isdigit() else 0
        with self.lock:
            self.received.extend((stream, int(p["new"]["seq"]), now)
                                 for p in (payloads if isinstance(payloads, list) else [payloads]))
        self.send_response(204)
        self.end_headers()

    def do_GET(self) -> None:
        with self.lock:
            data = (json.dumps(self.received) if self.path == "/received" else json.dumps(len(self.received))).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512


def _serve(ports: Any) -> None:
    _Receiver.received = []
    _Receiver.lock = threading.Lock()
    server = _Server(("127.0.0.1", 0), _Receiver)
    ports.put(server.server_address[1])
    server.serve_forever()


class Webhook:
    """The benches' webhook receiver (answers 204) in its own process: ``url`` (``/hook``) for one stream,
    ``base`` + ``/hook/<stream>`` (or ``/fail/<stream>``, which answers 500, or ``/hang/<stream>``) for many."""

    def __init__(self) -> None:
        ports: Any = multiprocessing.Queue()
        self.process = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
        self.process.start()
        self.base = f"http://127.0.0.1:{ports.get(timeout=30)}"
        self.url = f"{self.base}/hook"

    def count(self) -> int:
        with urllib.request.urlopen(f"{self.base}/count", timeout=30) as r:
            return int(json.loads(r.read()))

    def received_by_stream(self) -> list[tuple[int, int, float]]:
        """``(stream, seq, receipt time)`` of every payload received."""
        with urllib.request.urlopen(f"{self.base}/received", timeout=60) as r:
            return [(int(s), int(q), float(t)) for s, q, t in json.loads(r.read())]

    def received(self) -> list[tuple[int, float]]:
        """``(seq, receipt time)`` of every payload received (one stream)."""
        return [(q, t) for _s, q, t in self.received_by_stream()]

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(10)


def write_config(path: Path, url: str, stream: dict[str, Any], spark: dict[str, Any] | None = None,
                 trigger_mode: str = "row") -> Path:
    """One stream subscribed to inserts into ``bench_orders`` (``trigger_mode`` row or statement);
    the table and subscription are created.
    Runs are a run per batch unless the stream sets ``delivery.mode`` (the in-process driver runs them
    between ticks); mode per_batch reads its rounds as an open run does unless ``tuning`` says."""
    delivery = {"mode": "per_batch", **stream.get("delivery", {})}
    if delivery["mode"] == "per_batch":
        delivery["tuning"] = {"direct_max_events": DIRECT_MAX_EVENTS, **delivery.get("tuning", {})}
    stream = {**stream, "delivery": delivery}
    path.write_text(yaml.safe_dump({
        "database_url": url, "spark": spark or {"master": "local[2]"}, "streams": [stream],
        "subscriptions": [{"key": "bench-orders", "stream_id": stream["id"], "operation": "INSERT",
                           "table_name": "bench_orders",
                           "column_names": ["id", "seq", "customer", "amount"],
                           **({"trigger_mode": trigger_mode} if trigger_mode != "row" else {})}]}))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TABLE_SQL)
        apply_subscriptions(conn, load_config(path))
    return path


def write_many_streams(path: Path, url: str, streams: list[dict[str, Any]]) -> Path:
    """Streams 1..N (``streams``, in id order), each subscribed to inserts into its own table
    ``bench_s<id>`` (``id``, ``seq``); the tables and subscriptions are created."""
    ids = [int(s["id"]) for s in streams]
    path.write_text(yaml.safe_dump({
        "database_url": url, "spark": {"master": "local[2]"}, "streams": streams,
        "subscriptions": [{"key": f"bench-s{i}", "stream_id": i, "operation": "INSERT", "table_name": f"bench_s{i}",
                           "column_names": ["id", "seq"]} for i in ids]}))
    with psycopg.connect(url, autocommit=True) as conn:
        for i in ids:
            conn.execute(sql.SQL("create table public.{} (id bigserial primary key, seq bigint not null)")
                         .format(sql.Identifier(f"bench_s{i}")))
        apply_subscriptions(conn, load_config(path))
    return path


class Driver:
    """The daemon's loop, in-process: evaluate the stream's sensor tick, execute the run it requests.

    ``background``: runs execute in a thread, one at a time (as the run queue allows one run per
    stream), while the ticks go on: the sensor records and hands batches to the open run
    (``delivery.mode: open``) at the same time, as with the daemon and a run worker. A run requested
    while another is in flight waits in a queue, and the ticks go on meanwhile, as with the daemon's
    run queue. A run key is used once, as the daemon does."""

    def __init__(self, config_path: Path, instance: dg.DagsterInstance, background: bool = False) -> None:
        self.defs = build_definitions(config_path)
        self.config_path = config_path
        self.instance = instance
        self.background = background
        self.cursor: str | None = None
        self.runs = 0
        self.failed = 0
        self._thread: threading.Thread | None = None
        self._queue: collections.deque[dg.RunRequest] = collections.deque()
        self._run_keys: set[str] = set()
        self._group_runs: list[threading.Thread] = []

    def sensor(self, stream_id: int) -> Any:
        """The sensor that decides for the stream: its reader group's (every stream is in one: ``default``
        unless it names another), or in a baseline tree from before that, the stream's own."""
        streams = self.defs.resources["pgstream"].config.streams
        reader = next((getattr(s, "reader", None) for s in streams if s.id == stream_id), None)
        name = f"pgstream_group_{reader}" if reader else f"pgstream_stream_{stream_id}"
        return self.defs.resolve_sensor_def(name)

    def step(self, stream_id: int) -> bool:
        """One tick and its runs; True if a run was started or executed. A group delivery run (it hosts the
        group's streams' runs until asked to end) is always started in a thread of its own."""
        sensor = self.sensor(stream_id)
        ctx = dg.build_sensor_context(instance=self.instance, cursor=self.cursor, sensor_name=sensor.name,
                                      resources={"pgstream": self.defs.resources["pgstream"]})
        tick: Any = sensor.evaluate_tick(ctx)
        self.cursor = tick.cursor
        for request in tick.run_requests or []:
            if request.run_key in self._run_keys:
                continue  # as the daemon does: a sensor's run key is used once (this one may still be starting)
            if request.run_key:
                self._run_keys.add(request.run_key)
            if request.job_name == GROUP_DELIVERY_JOB:
                self._start_group_run(request)
            elif self.background:
                self._queue.append(request)  # the run queue: one run of the stream at a time
            else:
                self._execute(request)
        self._start_next()
        return bool(tick.run_requests)

    def _start_group_run(self, request: dg.RunRequest) -> None:
        for thread in self._group_runs:  # one group run at a time (the tag pgstream/group)
            thread.join()
        thread = threading.Thread(target=self._execute, args=(request,), daemon=True)
        thread.start()
        self._group_runs.append(thread)
        deadline = time.monotonic() + 30  # as the daemon does, the run exists before the next tick looks for one
        while not self.instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": request.run_key or ""})):
            if time.monotonic() > deadline:
                raise TimeoutError("the requested group delivery run was not created")
            time.sleep(0.02)

    def paced_step(self, stream_id: int, every: float, until: float | None = None) -> bool:
        """:meth:`step`, then wait until ``every`` seconds after it began (not past ``until``, a
        ``time.monotonic()``): the daemon evaluates a sensor at most every ``sensor.interval_secs``
        (1 s by default; and starts a tick at most every 5 s), not as often as it can. At least
        0.05 s when nothing was requested."""
        began = time.monotonic()
        ran = self.step(stream_id)
        wait = max(every - (time.monotonic() - began), 0.0 if ran else 0.05)
        if until is not None:
            wait = min(wait, max(0.0, until - time.monotonic()))
        time.sleep(wait)
        return ran

    def _start_next(self) -> None:
        if self._thread is not None:
            if self._thread.is_alive():
                return
            self._thread = None
        if self._queue:
            self._thread = threading.Thread(target=self._execute, args=(self._queue.popleft(),), daemon=True)
            self._thread.start()

    def _execute(self, request: dg.RunRequest) -> None:
        job = self.defs.resolve_job_def(request.job_name or DELIVERY_JOB)
        tags = {**request.tags, "dagster/run_key": request.run_key or ""}
        result = job.execute_in_process(run_config=request.run_config, instance=self.instance, tags=tags,
                                        raise_on_error=False)
        self.runs += 1
        self.failed += 0 if result.success else 1

    def wait(self) -> None:
        """Until the runs in flight and queued (background) have ended; a live group delivery run is asked to
        end (tag pgstream/stop, as its sensor asks it)."""
        while self._thread is not None:
            self._thread.join()
            self._start_next()
        for run in self.instance.get_runs(dg.RunsFilter(job_name=GROUP_DELIVERY_JOB,
                                                        statuses=[dg.DagsterRunStatus.STARTED,
                                                                  dg.DagsterRunStatus.STARTING,
                                                                  dg.DagsterRunStatus.NOT_STARTED])):
            self.instance.add_run_tags(run.run_id, {"pgstream/stop": "the benchmark ends"})
        for thread in self._group_runs:
            thread.join()


def delivered_events(conn: psycopg.Connection, stream_id: int) -> int:
    row = conn.execute("select coalesce(sum(event_count), 0) from pgstream.batches "
                       "where stream_id = %s and status = 'delivered'", [stream_id]).fetchone()
    return int(row[0]) if row else 0


def written_events(conn: psycopg.Connection, stream_id: int) -> int:
    row = conn.execute("select count(*) from pgstream.events where stream_id = %s", [stream_id]).fetchone()
    return int(row[0]) if row else 0


def extract_tree(ref: str, into: Path) -> Path:
    """The package and its SQL as of git ``ref`` (``git archive``), for a ``--baseline`` child
    process (``PYTHONPATH`` = the returned directory)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "pgstream_dagster", "sql"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_child(command: list[str], cwd: Path, tree: Path | None, what: str) -> dict[str, Any]:
    """Run a benchmark child process with the package of ``tree`` (None: this checkout's) and return
    the JSON object it printed last; it must report the ``module`` it imported, which for a
    ``--baseline`` child must be the extracted tree's. ``cwd`` should be outside the repository:
    Spark's Python workers put the cwd first on sys.path."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    out = subprocess.run(command, capture_output=True, text=True, check=False, cwd=cwd, env=env)
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
    if out.returncode != 0 or line is None:
        print(out.stdout[-3000:], out.stderr[-3000:])
        raise SystemExit(f"{what} failed")
    result: dict[str, Any] = json.loads(line)
    if tree is not None and not result["module"].startswith(str(tree)):
        raise SystemExit(f"{what}: the baseline child imported {result['module']}, not the baseline package")
    return result


# --- CPU counters (/proc) -----------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def sched_secs(pid: int) -> float:
    """CPU time of a single-threaded process (a Postgres backend), in ns precision."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _stat(pid: int, children: bool = True) -> tuple[int, float] | None:
    """(parent pid, utime + stime [+ cutime + cstime] in seconds) of ``pid``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    # fields[0] is the state (field 3); utime..cstime are fields 14-17
    return int(fields[1]), sum(int(x) for x in fields[11:15 if children else 13]) / _TICK


def own_secs(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), without its children."""
    st = _stat(pid, children=False)
    return st[1] if st else 0.0


def tree_secs(root: int) -> float:
    """CPU of ``root`` and every live descendant, with what their reaped children spent."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parents[int(entry)], cpu[int(entry)] = st
    total, todo = 0.0, [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


# --- writers ------------------------------------------------------------------------------------
