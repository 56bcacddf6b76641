"""Cold start (issue 32 item 5, run by hand: `make bench-cold-start`): from starting
`pgstream-dagster dev` (what `make dev` runs) to the first event delivered, where the time goes, and
the floor bare Dagster sets on the same machine in the same run.

The demo as `make dev` runs it, in a temporary copy of the checkout's workspace.yaml, dagster.yaml
and pgstream.yaml (its metrics exporter on a free port, the Spark Connect server on a free port):
`pgstream-dagster dev --root <copy>` is started, and once the demo's table exists a writer inserts
one verified user every ``--interval`` s (the events of rows committed before the stream's slot
exists are not the stream's). Phases: *first* (a fresh .pgstream/: initdb, migrations, Spark Connect
server start), then ``--restarts`` times *bare* and *restart*, alternating. *restart*: `dg dev` stopped
and started again (Postgres and the Spark Connect server reused, as a developer's second `make dev`).
*bare*: the same `dg dev` command and dagster.yaml (Postgres storage, QueuedRunCoordinator, sensors in
threads; a database of its own on the demo's Postgres) on a generated code location of one sensor
(interval 1 s, as the demo's stream) that requests one run of a one-op job on its first tick; the op
writes a file. Each phase reports, from the process start: the preparation done ("ready in"; bare: none),
the webserver serving, the code location loaded (the UI's GraphQL), the sensor's first tick (Dagster's
schedule storage), the first run created and started (run storage), and the first event in the demo's
sink (bare: the op's file); then a table of both side by side (median) with ours / bare per step. The
machine's load average before and after. Exits 1 when a restart's first event takes longer than
``--goal`` seconds (default 10).
Usage: python bench/cold_start.py [--restarts 2] [--goal 10] [--interval 0.2] [--logs DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Goals, append_results, load_after, machine, spread

import pgstream_dagster
from pgstream_dagster.defs.names import GROUP_DELIVERY_JOB, group_sensor_name
from pgstream_dagster.devdb import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent


def _env_file(root: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in (root / ".pgstream" / "env").read_text().splitlines():
        if line.startswith("export "):
            key, _, value = shlex.split(line.removeprefix("export "))[0].partition("=")
            values[key] = value
    return values


class _Writer(threading.Thread):
    """One verified user every ``interval`` s once the demo's table exists, until stopped."""

    def __init__(self, root: Path, interval: float) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.stop = threading.Event()
        self.first: float | None = None

    def run(self) -> None:
        conn: psycopg.Connection | None = None
        n = 0
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(_env_file(self.root)["PGSTREAM_OWNER_DATABASE_URL"], autocommit=True,
                                           connect_timeout=2)
                conn.execute("insert into demo.users (email, email_verified) values (%s, true)",
                             [f"cold-{os.getpid()}-{time.time_ns()}-{n}@example.com"])
                n += 1
                self.first = self.first or time.time()
            except (OSError, KeyError, psycopg.Error):
                if conn is not None:
                    conn.close()
                conn = None
            self.stop.wait(self.interval)
        if conn is not None:
            conn.close()


BARE_DEFS = '''"""The bare reference of bench/cold_start.py: one sensor that, on its first tick of a phase
(``COLD_BARE_PHASE``), requests one run of a one-op job; the op writes the time to ``COLD_BARE_OUT``."""

import os
import time

import dagster as dg


@dg.op
def touch() -> None:
    with open(os.environ["COLD_BARE_OUT"], "a") as f:
        f.write(f"{time.time()}\\n")


@dg.job(executor_def=dg.in_process_executor)  # as the delivery job: its op in the run's process
def bare_job() -> None:
    touch()


@dg.sensor(job=bare_job, minimum_interval_seconds=1, default_status=dg.DefaultSensorStatus.RUNNING)
def bare_sensor(context: dg.SensorEvaluationContext):  # noqa: ANN201
    phase = os.environ["COLD_BARE_PHASE"]
    if context.cursor != phase:
        context.update_cursor(phase)
        yield dg.RunRequest(run_key=f"cold-{phase}")


defs = dg.Definitions(jobs=[bare_job], sensors=[bare_sensor])
'''


def _first_run(dagster_url: str, job: str, since: float) -> tuple[float | None, float | None]:
    """(create time, start time) of the first run of ``job`` created after ``since``, epoch seconds,
    from Dagster's run storage."""
    try:
        with psycopg.connect(dagster_url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute("select extract(epoch from create_timestamp at time zone 'UTC'), start_time from runs "
                               "where pipeline_name = %s and create_timestamp > "
                               "to_timestamp(%s) at time zone 'UTC' order by create_timestamp limit 1", [job, since]
                               ).fetchone()
    except psycopg.Error:
        return None, None
    return (float(row[0]), float(row[1]) if row[1] is not None else None) if row else (None, None)


def _first_tick(dagster_url: str, sensor: str, since: float) -> float | None:
    """The start of ``sensor``'s first tick after ``since``, epoch seconds, from Dagster's schedule storage."""
    try:
        with psycopg.connect(dagster_url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute("select extract(epoch from min(timestamp) at time zone 'UTC') from job_ticks "
                               "where timestamp > to_timestamp(%s) at time zone 'UTC' and tick_body like %s",
                               [since, f'%"job_name": "{sensor}"%']).fetchone()
    except psycopg.Error:
        return None
    return float(row[0]) if row and row[0] is not None else None


_LOCATIONS = json.dumps({"query": "{ workspaceOrError { ... on Workspace { locationEntries { loadStatus "
                                  "locationOrLoadError { __typename } } } } }"}).encode()


def _location_loaded(port: int) -> bool:
    """The UI (`dg dev`'s webserver) shows the code location loaded (not a load error)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=_LOCATIONS,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            entries = json.load(response)["data"]["workspaceOrError"]["locationEntries"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(entries) and all(e["loadStatus"] == "LOADED" and e["locationOrLoadError"]["__typename"] != "PythonError"
                                 for e in entries)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # dg dev and its daemon, webserver and code server
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _watch(proc: subprocess.Popen[bytes], log: Path, started: float, timeout: float, done: Path, job: str,
           sensor: str, port: int, dagster_url: Any) -> dict[str, float]:
    """Poll until ``done`` has content: the marks (epoch seconds) of the webserver serving (its log
    line), the code location loaded (the UI's GraphQL says so), ``sensor``'s first tick, ``job``'s first
    run created and started. ``dagster_url()`` is the storage's URL once known (None before)."""
    marks: dict[str, float] = {}
    deadline = started + timeout
    polled = 0.0
    while time.time() < deadline:
        now = time.time()
        text = log.read_text(errors="replace")
        if "ready" not in marks and "ready in" in text:
            marks["ready"] = now
        if "webserver" not in marks and "Serving dagster-webserver" in text:
            marks["webserver"] = now
        if "webserver" in marks and "loaded" not in marks and now - polled >= 0.2:
            polled = now
            if _location_loaded(port):
                marks["loaded"] = now
        url = dagster_url()
        if url is not None:
            if "tick" not in marks:
                tick = _first_tick(url, sensor, started)
                if tick is not None:
                    marks["tick"] = tick
            if "run_started" not in marks:
                created, run_started = _first_run(url, job, started)
                if created is not None:
                    marks["run_created"] = created
                if run_started is not None:
                    marks["run_started"] = run_started
        if done.exists() and done.stat().st_size > 0:
            marks["event"] = now
            return marks
        if proc.poll() is not None:
            raise SystemExit(f"dev exited ({proc.returncode}); see {log}:\n{text[-3000:]}")
        time.sleep(0.05)
    raise SystemExit(f"nothing delivered within {timeout:.0f}s; see {log}")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PGSTREAM_", "DAGSTER_", "COLD_BARE_"))}


def _bare_phase(bare: Path, name: str, args: argparse.Namespace, port: int, dagster_url: str) -> dict[str, Any]:
    """The bare reference: the same `dg dev` command on a one-sensor, one-op code location, the same
    dagster.yaml (its storage in a database of its own on the demo's Postgres)."""
    log = bare / f"dev-{name}.log"
    out = bare / "op-out"
    out.unlink(missing_ok=True)
    env = _clean_env()
    env.update(DAGSTER_HOME=str(bare), DAGSTER_POSTGRES_URL=dagster_url, COLD_BARE_OUT=str(out),
               COLD_BARE_PHASE=f"{name}-{time.time_ns()}", PYTHONUNBUFFERED="1")
    started = time.time()
    with log.open("wb") as f:
        proc = subprocess.Popen([str(BIN / "dg"), "dev", "--workspace", str(bare / "workspace.yaml"), "--host",
                                 "127.0.0.1", "--port", str(port)], cwd=bare, env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    plain = dagster_url.replace("+psycopg2", "")
    try:
        marks = _watch(proc, log, started, args.timeout, out, "bare_job", "bare_sensor", port, lambda: plain)
        marks["op"] = float(out.read_text().split()[0])
    finally:
        _stop(proc)
    return {k: round(v - started, 2) for k, v in marks.items()}


def _phase(root: Path, name: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    log = root / f"dev-{name}.log"
    sink = root / ".pgstream" / "demo-events.jsonl"
    if sink.exists():
        sink.unlink()
    writer = _Writer(root, args.interval)
    env = _clean_env()
    env.update(PGSTREAM_SPARK_PORT=str(args.spark_port), PYTHONUNBUFFERED="1")
    started = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen([str(BIN / "pgstream-dagster"), "dev", "--root", str(root), "--port", str(port)],
                                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    writer.start()

    def dagster_url() -> str | None:
        if "ready in" not in log.read_text(errors="replace"):
            return None
        return _env_file(root)["DAGSTER_POSTGRES_URL"].replace("+psycopg2", "")

    try:
        marks = _watch(proc, log, started, args.timeout, sink, GROUP_DELIVERY_JOB, group_sensor_name("default"), port,
                       dagster_url)
    finally:
        writer.stop.set()
        writer.join(10)
        _stop(proc)
    result = {k: round(v - started, 2) for k, v in marks.items()}
    result["writer_first"] = round((writer.first or started) - started, 2)
    return result


def _bare_setup(root: Path) -> tuple[Path, str]:
    """The bare reference's directory (its defs module, workspace.yaml, the repository's dagster.yaml)
    and its storage: a database ``dagster_bare`` on the demo's Postgres, its schema created before timing
    (as the demo's storage has its schema at a restart)."""
    bare = root / "bare"
    bare.mkdir(exist_ok=True)
    (bare / "bare_defs.py").write_text(BARE_DEFS)
    (bare / "workspace.yaml").write_text("load_from:\n  - python_file:\n      relative_path: bare_defs.py\n"
                                         "      location_name: bare\n")
    shutil.copy(ROOT / "dagster.yaml", bare / "dagster.yaml")
    demo = _env_file(root)["DAGSTER_POSTGRES_URL"]  # the demo's Dagster storage, as Postgres' superuser
    with psycopg.connect(demo.replace("+psycopg2", ""), autocommit=True) as conn:
        if not conn.execute("select 1 from pg_database where datname = 'dagster_bare'").fetchone():
            conn.execute("create database dagster_bare")
    url = demo.rsplit("/", 1)[0] + "/dagster_bare"
    env = _clean_env()
    env.update(DAGSTER_HOME=str(bare), DAGSTER_POSTGRES_URL=url)
    subprocess.run([str(BIN / "dagster"), "instance", "migrate"], cwd=bare, env=env, check=True, capture_output=True)
    return bare, url


#: (key, label, in the chain): a step in the chain is timed from the previous one in the chain; the
#: webserver and the UI's "loaded" are not (the daemon may tick before the UI shows the location loaded)
STEPS = (("ready", "preparation done (ours: `ready in`)", True), ("webserver", "webserver serving", False),
         ("loaded", "code location loaded (UI)", False), ("tick", "sensor's first tick", True),
         ("run_created", "run created", True), ("run_started", "run started (RUN_START)", True),
         ("event", "op ran (bare) / first event delivered (ours)", True))


def _step_of(r: dict[str, Any], key: str) -> float | None:
    return 0.0 if key == "ready" and "ready" not in r else r.get(key)


def _deltas(rs: list[dict[str, Any]], key: str, previous: str) -> list[float]:
    return [v - p for r in rs if (v := _step_of(r, key)) is not None and (p := _step_of(r, previous)) is not None]


def _table(bare: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[str]:
    """Each step from the process start and the step's own time (since the previous one), bare and ours
    side by side (median of the phases) and ours / bare."""
    lines = ["", "| step | bare: from start | ours: from start | ours / bare | bare: the step | ours: the step | "
             "ours / bare |", "|---|---|---|---|---|---|---|"]
    previous: str | None = None
    for key, label, chained in STEPS:
        def of(rs: list[dict[str, Any]], k: str | None) -> list[float]:
            return [v for r in rs if k is not None and (v := _step_of(r, k)) is not None]

        b, o = of(bare, key), of(ours, key)
        if not chained:
            db, do = [], []
        elif previous is None:
            db, do = b, o
        else:
            db, do = _deltas(bare, key, previous), _deltas(ours, key, previous)

        def cell(values: list[float]) -> str:
            if not values:
                return "-"
            return f"{statistics.median(values):.1f} ({', '.join(f'{v:.1f}' for v in values)})"

        def ratio(x: list[float], y: list[float]) -> str:
            if not x or not y or statistics.median(x) <= 0:
                return "-"
            return f"{statistics.median(y) / statistics.median(x):.2f}x"

        lines.append(f"| {label} | {cell(b)} | {cell(o)} | {ratio(b, o)} | {cell(db)} | {cell(do)} | {ratio(db, do)} |")
        if chained:
            previous = key
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--restarts", type=int, default=2, help="bare / ours phases after the first (alternating)")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--goal", type=float, default=10.0, help="seconds to the first event of a restart, at most")
    parser.add_argument("--logs", type=Path, help="copy each phase's `dg dev` log into this directory")
    parser.add_argument("--label", default="", help="what the heading says of this run (e.g. the package measured)")
    args = parser.parse_args()
    header = machine()
    results: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="pgstream-cold-start-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)
        for file in ("workspace.yaml", "dagster.yaml"):
            shutil.copy(ROOT / file, root / file)
        metrics = free_port()
        (root / "pgstream.yaml").write_text((ROOT / "pgstream.yaml").read_text().replace("port: 9187",
                                                                                          f"port: {metrics}"))
        args.spark_port = free_port()
        try:
            results.append(("first", _phase(root, "first", args, free_port())))
            print(f"first: {results[-1][1]}", flush=True)
            bare, bare_url = _bare_setup(root)
            for i in range(1, args.restarts + 1):
                results.append((f"bare {i}", _bare_phase(bare, f"bare-{i}", args, free_port(), bare_url)))
                print(f"bare {i}: {results[-1][1]}", flush=True)
                results.append((f"restart {i}", _phase(root, f"restart-{i}", args, free_port())))
                print(f"restart {i}: {results[-1][1]}", flush=True)
        finally:
            subprocess.run([str(BIN / "pgstream-dagster"), "dev", "--stop", "--root", str(root)], check=False,
                           capture_output=True, env=_clean_env())
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                for log in [*root.glob("dev-*.log"), *root.glob("bare/dev-*.log")]:
                    shutil.copy(log, args.logs / log.name)
    after = load_after()
    goals = Goals()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    label = f", {args.label}" if args.label else ""
    package = Path(pgstream_dagster.__file__).resolve().parent
    lines = [f"\n## Cold start of `make dev` against bare Dagster {stamp}{label}, package {package}",
             f"Machine: {header}; {after}. Method: bench/cold_start.py; `pgstream-dagster dev --root <a copy of the "
             "checkout's yaml files>` started, times from the process start: preparation done (`ready in`), the "
             "webserver serving (its log line), the code location loaded (the UI's GraphQL: loadStatus LOADED), the "
             "sensor's "
             "first tick (Dagster's schedule storage), the first delivery run created and started (run storage), the "
             "first event in the demo's sink; a writer inserts a verified user every "
             f"{args.interval}s from when demo.users exists; *first* = a fresh .pgstream/ (initdb, migrations, Spark "
             "Connect server start), *restart* = `dg dev` stopped and started again (Postgres and Spark Connect "
             "server reused). *bare* = the same `dg dev` command and dagster.yaml (storage: a database of its own on "
             "the same Postgres, schema created before) on a code location of one sensor (interval 1 s, as the "
             "demo's) that requests one run of a one-op job (in-process executor, as the delivery job) on its first "
             "tick; the op writes a file. Phases alternate bare, restart, bare, restart."]
    for name, r in results:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in r.items())
        lines.append(f"- {name}: {parts}")
    bares = [r for name, r in results if name.startswith("bare")]
    restarts = [r for name, r in results if name.startswith("restart")]
    if restarts:
        lines += _table(bares, restarts)
        lines.append("")
        events = [r["event"] for r in restarts]
        lines.append(f"- restarts, first event: {spread(events, '{:.1f}')} s; bare, op ran: "
                     f"{spread([r['event'] for r in bares], '{:.1f}')} s")
        goals.check("seconds from starting `pgstream-dagster dev` (services running) to the first event",
                    statistics.median(events), at_most=args.goal)
    lines += goals.lines()
    append_results("\n".join(lines) + "\n")
    print("\n".join(lines))
    goals.finish()


if __name__ == "__main__":
    main()
