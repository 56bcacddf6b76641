"""Cold start (issue 32 item 5, run by hand: `make bench-cold-start`): from starting
`pgstream-dagster dev` (what `make dev` runs) to the first event delivered, and where the time goes.

The demo as `make dev` runs it, in a temporary copy of the checkout's workspace.yaml, dagster.yaml
and pgstream.yaml (its metrics exporter on a free port, the Spark Connect server on a free port):
`pgstream-dagster dev --root <copy>` is started, and once the demo's table exists a writer inserts
one verified user every ``--interval`` s (the events of rows committed before the stream's slot
exists are not the stream's). Phases: *first* (a fresh .pgstream/: initdb, migrations, Spark Connect
server start) and then ``--restarts`` times *restart* (`dg dev` stopped and started again: Postgres
and the Spark Connect server reused, as a developer's second `make dev`). Each phase reports, from
the process start: the preparation done ("ready in"), the stream's slot there (the preparation's
`init` creates it), the first delivery run created and started (Dagster's run storage), and the first event in
the demo's sink file; the machine's load average before and after. Exits 1 when a restart's
first event takes longer than ``--goal`` seconds (default 10).
Usage: python bench/cold_start.py [--restarts 2] [--goal 10] [--interval 0.2]
"""

from __future__ import annotations

import argparse
import datetime as dt
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
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Goals, load_after, machine, spread

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


def _first_run(dagster_url: str, since: float) -> tuple[float | None, float | None]:
    """(create time, start time) of the first delivery run created after ``since``, epoch seconds,
    from Dagster's run storage."""
    try:
        with psycopg.connect(dagster_url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute("select extract(epoch from create_timestamp at time zone 'UTC'), start_time from runs "
                               "where pipeline_name = 'pgstream_delivery' and create_timestamp > "
                               "to_timestamp(%s) at time zone 'UTC' order by create_timestamp limit 1", [since]
                               ).fetchone()
    except psycopg.Error:
        return None, None
    return (float(row[0]), float(row[1]) if row[1] is not None else None) if row else (None, None)


def _phase(root: Path, name: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    log = root / f"dev-{name}.log"
    sink = root / ".pgstream" / "demo-events.jsonl"
    if sink.exists():
        sink.unlink()
    writer = _Writer(root, args.interval)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PGSTREAM_", "DAGSTER_"))}
    env.update(PGSTREAM_SPARK_PORT=str(args.spark_port), PYTHONUNBUFFERED="1")
    marks: dict[str, float] = {}
    started = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen([str(BIN / "pgstream-dagster"), "dev", "--root", str(root), "--port", str(port)],
                                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    writer.start()
    try:
        deadline = started + args.timeout
        while time.time() < deadline:
            now = time.time()
            text = log.read_text(errors="replace")
            if "ready" not in marks and "ready in" in text:
                marks["ready"] = now
            if "ready" in marks:
                values = _env_file(root)
                if "slot" not in marks:
                    try:
                        with psycopg.connect(values["PGSTREAM_OWNER_DATABASE_URL"], autocommit=True,
                                             connect_timeout=2) as conn:
                            if conn.execute("select count(*) from pg_replication_slots where database = "
                                            "current_database()").fetchone() != (0,):
                                marks["slot"] = now
                    except psycopg.Error:
                        pass
                if "run_created" not in marks:
                    created, run_started = _first_run(values["DAGSTER_POSTGRES_URL"].replace("+psycopg2", ""), started)
                    if created is not None:
                        marks["run_created"] = created
                    if run_started is not None:
                        marks["run_started"] = run_started
                elif "run_started" not in marks:
                    _, run_started = _first_run(values["DAGSTER_POSTGRES_URL"].replace("+psycopg2", ""), started)
                    if run_started is not None:
                        marks["run_started"] = run_started
            if sink.exists() and sink.stat().st_size > 0:
                marks["event"] = now
                break
            if proc.poll() is not None:
                raise SystemExit(f"pgstream-dagster dev exited ({proc.returncode}); see {log}:\n{text[-3000:]}")
            time.sleep(0.05)
        else:
            raise SystemExit(f"no event within {args.timeout:.0f}s; see {log}")
    finally:
        writer.stop.set()
        writer.join(10)
        os.killpg(proc.pid, signal.SIGTERM)  # dg dev and its daemon, webserver and code server
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    result = {k: round(v - started, 2) for k, v in marks.items()}
    result["writer_first"] = round((writer.first or started) - started, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--goal", type=float, default=10.0, help="seconds to the first event of a restart, at most")
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
            for i in range(args.restarts + 1):
                name = "first" if i == 0 else f"restart {i}"
                results.append((name, _phase(root, name.replace(" ", "-"), args, free_port())))
                print(f"{name}: {results[-1][1]}", flush=True)
        finally:
            subprocess.run([str(BIN / "pgstream-dagster"), "dev", "--stop", "--root", str(root)], check=False,
                           capture_output=True, env={k: v for k, v in os.environ.items()
                                                     if not k.startswith(("PGSTREAM_", "DAGSTER_"))})
    after = load_after()
    goals = Goals()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Cold start of `make dev` {stamp}",
             f"Machine: {header}; {after}. Method: bench/cold_start.py; `pgstream-dagster dev --root <a copy of the "
             "checkout's yaml files>` started, times from the process start: preparation done (`ready in`), the "
             "stream's slot exists (created by the preparation's init), the first delivery run created and started "
             "(Dagster's run storage), the first event in the demo's sink; a writer inserts a verified user every "
             f"{args.interval}s "
             "from when demo.users exists; *first* = a fresh .pgstream/ (initdb, migrations, Spark Connect server "
             "start), *restart* = `dg dev` stopped and started again (Postgres and Spark Connect server reused)."]
    for name, r in results:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in r.items())
        lines.append(f"- {name}: {parts}")
    restarts = [r["event"] for name, r in results if name != "first"]
    if restarts:
        lines.append(f"- restarts, first event: {spread(restarts, '{:.1f}')} s")
        goals.check("seconds from starting `pgstream-dagster dev` (services running) to the first event",
                    statistics.median(restarts), at_most=args.goal)
    lines += goals.lines()
    with (HERE / "RESULTS.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    goals.finish()


if __name__ == "__main__":
    main()
