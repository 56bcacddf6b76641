"""End to end, the way a user runs it: ``init`` + ``dagster dev`` on the repo's workspace.yaml and
dagster.yaml; a row inserted in Postgres reaches a real HTTP endpoint through the real sensor daemon
and a real delivery run on Spark."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import psycopg
import pytest
from dagster._core.storage.dagster_run import DagsterRunStatus, RunsFilter
from psycopg import sql

from pgstream_dagster.cli import init
from pgstream_dagster.devdb import LocalPostgres, free_port
from pgstream_dagster.jobs import DELIVERY_JOB, STREAM_TAG
from pgstream_dagster.migrations import migrate

from .conftest import repo_root
from .harness import write_config

EVENTS_TIMEOUT_SECS = 240  # the first run starts Spark
READY_TIMEOUT_SECS = 180

SENSOR_QUERY = """
query ($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    __typename
    ... on Sensor { sensorState { status ticks(limit: 1) { status timestamp } } }
  }
}
"""


# --------------------------------------------------------------------------------------------
# a real HTTP endpoint


@dataclass
class Received:
    event_id: int
    body: dict[str, Any]
    at: float  # time.time() on arrival


@dataclass
class Hook:
    url: str
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[Received]:
        with self.lock:
            return list(self.received)


@pytest.fixture
def hook() -> Iterator[Hook]:
    state: list[Hook] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the sink's httpx client expects

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            event_id = int(self.headers["X-Pgstream-Event-Id"])
            with state[0].lock:
                state[0].received.append(Received(event_id, body, time.time()))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.append(Hook(url=f"http://127.0.0.1:{server.server_address[1]}/hook"))
    thread = threading.Thread(target=server.serve_forever, name="hook-server", daemon=True)
    thread.start()
    try:
        yield state[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


# --------------------------------------------------------------------------------------------
# databases of their own: the app's and Dagster's storage


@dataclass
class Databases:
    app_url: str
    dagster_url: str  # postgresql+psycopg2:// (Dagster's storage breaks on SQLAlchemy's psycopg 3 default)


def _drop(pg: LocalPostgres, name: str) -> None:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        for (slot,) in conn.execute("select slot_name from pg_replication_slots where database = %s",
                                    [name]).fetchall():
            conn.execute("select pg_drop_replication_slot(%s)", [slot])
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


@pytest.fixture
def databases(pg: LocalPostgres) -> Iterator[Databases]:
    suffix = uuid.uuid4().hex[:8]
    app, storage = f"e2e_app_{suffix}", f"e2e_dagster_{suffix}"
    pg.create_database(app)
    pg.create_database(storage)
    try:
        yield Databases(pg.url_for(app), pg.url_for(storage).replace("postgresql://", "postgresql+psycopg2://", 1))
    finally:
        _drop(pg, app)
        _drop(pg, storage)


# --------------------------------------------------------------------------------------------
# `dagster dev`, as a user starts it


@dataclass
class DagsterDev:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def tail(self, lines: int = 150) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def graphql(self, query: str, variables: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"http://127.0.0.1:{self.port}/graphql", timeout=10,
                              json={"query": query, "variables": variables})
        response.raise_for_status()
        return response.json()


def start_dagster_dev(tmp_path: Path, env: dict[str, str]) -> DagsterDev:
    port = free_port()
    log = tmp_path / "dagster-dev.log"
    dagster = Path(sys.executable).with_name("dagster")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(dagster), "dev", "-w", str(repo_root() / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
            cwd=repo_root(), env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    return DagsterDev(proc, port, log)


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process (zombies count as dead), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[19]))


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time (to tell a reused pid apart)."""
    parents: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _proc_stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def stop_process_group(proc: subprocess.Popen[bytes]) -> list[int]:
    """SIGTERM the whole group (webserver, daemon, code servers, run workers, Spark), wait up to
    20 s, then SIGKILL whatever is left of it, and of the descendants that left the group (PySpark's
    worker daemons make sessions of their own). Returns the pids that survived all that."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    tree = descendants(proc.pid)
    outside = [pid for pid in tree if _pgid(pid) not in (None, pgid)]
    print(f"stopping `dagster dev`: {len(tree)} descendants, {len(outside)} outside its process group")
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the children may outlive the leader for a moment
        proc.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.25)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)

    def alive() -> list[int]:
        return [pid for pid, started in tree.items() if (stat := _proc_stat(pid)) and stat[1] == started]

    for pid in alive():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive()


def wait_for(what: str, done: Callable[[], bool], timeout: float, dev: DagsterDev,
             details: Callable[[], str] = lambda: "") -> float:
    """Poll ``done`` until true; returns the seconds waited. On timeout (or when ``dagster dev``
    dies) fail with the tail of its log."""
    started = time.monotonic()
    while True:
        if done():
            return time.monotonic() - started
        if dev.proc.poll() is not None:
            pytest.fail(f"`dagster dev` exited with {dev.proc.returncode} while waiting for {what}\n"
                        f"{details()}\n--- tail of {dev.log} ---\n{dev.tail()}")
        if time.monotonic() - started > timeout:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{details()}\n"
                        f"--- tail of {dev.log} ---\n{dev.tail()}")
        time.sleep(0.5)


# --------------------------------------------------------------------------------------------


def test_dagster_dev_delivers_inserted_rows_to_http(databases: Databases, hook: Hook, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    test_started = time.monotonic()
    app = databases.app_url
    migrate(app)
    with psycopg.connect(app, autocommit=True) as conn:
        conn.execute("create table public.users (id serial primary key, email text, verified bool default false)")

    config_path = write_config(
        tmp_path / "pgstream.yaml", app,
        streams=[{"id": 1, "sink": {"type": "http", "url": hook.url, "mode": "per_event"},
                  "batch": {"max_size": 100, "max_fill_secs": 0.5},
                  "sensor": {"interval_secs": 1, "tick_budget_secs": 3}}],
        subscriptions=[{"key": "user-signup", "stream_id": 1, "operation": "INSERT", "schema_name": "public",
                        "table_name": "users", "when_clause": "new.verified", "column_names": ["id", "email"]}],
    )
    print("\n" + "\n".join(init(config_path)))

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(repo_root() / "dagster.yaml", home / "dagster.yaml")
    env = {"PGSTREAM_CONFIG": str(config_path), "DAGSTER_HOME": str(home),
           "DAGSTER_POSTGRES_URL": databases.dagster_url, "PYTHONUNBUFFERED": "1"}

    dev = start_dagster_dev(tmp_path, env)
    try:
        # 1. the code location is loaded and the daemon ticks the stream's sensor
        selector = {"repositoryLocationName": "pgstream", "repositoryName": "__repository__",
                    "sensorName": "pgstream_stream_1"}
        last_answer: list[object] = [None]

        def sensor_ticked() -> bool:
            try:
                answer = dev.graphql(SENSOR_QUERY, {"selector": selector})
            except httpx.HTTPError as exc:
                last_answer[0] = exc
                return False
            last_answer[0] = answer
            sensor = (answer.get("data") or {}).get("sensorOrError") or {}
            state = sensor.get("sensorState") or {}
            ticks = state.get("ticks") or [{}]
            return state.get("status") == "RUNNING" and ticks[0].get("status") in ("SKIPPED", "SUCCESS")

        ready_secs = wait_for("the sensor's first completed tick", sensor_ticked, READY_TIMEOUT_SECS, dev,
                              lambda: f"last GraphQL answer: {last_answer[0]!r}")
        print(f"dagster dev up and sensor ticking after {time.monotonic() - test_started:.1f}s "
              f"(waited {ready_secs:.1f}s)")

        # 2. 20 verified and 5 unverified users, in 5 transactions
        expected: list[str] = []
        unverified: list[str] = []
        commits: list[float] = []
        with psycopg.connect(app) as conn:
            for txn in range(5):
                with conn.transaction():
                    for i in range(5):
                        n = txn * 5 + i
                        verified = i != 2
                        email = f"user{n:02d}@example.com"
                        (expected if verified else unverified).append(email)
                        conn.execute("insert into public.users (email, verified) values (%s, %s)", [email, verified])
                commits.append(time.time())
        first_commit_at, last_commit_at = commits[0], commits[-1]
        assert len(expected) == 20 and len(unverified) == 5

        # 3. they arrive at the endpoint
        def batches() -> list[tuple[Any, ...]]:
            with psycopg.connect(app, autocommit=True) as c:
                return c.execute("select id, status, event_count, attempts, error from pgstream.batches "
                                 "where stream_id = 1 order by id").fetchall()

        def state() -> str:
            got = hook.snapshot()
            return (f"received {len(got)} bodies: {[r.body.get('new', {}).get('email') for r in got]}\n"
                    f"batches (id, status, events, attempts, error): {batches()}")

        wait_for("20 events at the HTTP endpoint", lambda: len(hook.snapshot()) >= 20, EVENTS_TIMEOUT_SECS,
                 dev, state)
        time.sleep(1)  # anything extra (an unverified user, a duplicate) would arrive now
        got = hook.snapshot()
        assert [r.body["new"]["email"] for r in got] == expected, state()
        assert {r.body["tg_name"] for r in got} == {"user-signup"}
        assert {r.body["tg_op"] for r in got} == {"INSERT"}
        assert all(r.body["new"]["email"] not in unverified for r in got)
        ids = [r.event_id for r in got]
        assert all(a < b for a, b in itertools.pairwise(ids)), ids
        first_latency = got[0].at - first_commit_at
        last_latency = got[-1].at - last_commit_at

        # 4. the ledger and Dagster agree: every batch delivered by a successful run
        wait_for("every batch of stream 1 to be delivered",
                 lambda: bool(batches()) and all(b[1] == "delivered" for b in batches()), 60, dev, state)
        recorded = batches()
        assert sum(b[2] for b in recorded) == 20, recorded

        monkeypatch.setenv("DAGSTER_HOME", str(home))
        monkeypatch.setenv("DAGSTER_POSTGRES_URL", databases.dagster_url)
        with dg.DagsterInstance.get() as instance:
            def succeeded() -> list[dg.DagsterRun]:
                return list(instance.get_runs(RunsFilter(job_name=DELIVERY_JOB,
                                                         statuses=[DagsterRunStatus.SUCCESS])))

            # the batch is marked delivered inside the run, a moment before the run itself succeeds
            wait_for(f"a successful {DELIVERY_JOB} run", lambda: len(succeeded()) >= len(recorded), 60, dev,
                     lambda: f"runs: {[(r.run_id, r.status) for r in instance.get_runs()]}")
            runs = succeeded()
            assert all(r.tags.get(STREAM_TAG) == "1" for r in runs)
            assert not instance.get_runs(RunsFilter(job_name=DELIVERY_JOB, statuses=[DagsterRunStatus.FAILURE]))

        print(f"{len(recorded)} batches {[b[2] for b in recorded]} delivered by {len(runs)} successful runs")
        print(f"latency insert commit -> arrival: first event {first_latency:.2f}s, "
              f"last event {last_latency:.2f}s (last commit -> last arrival)")
    finally:
        survivors = stop_process_group(dev.proc)
    assert not survivors, f"processes of `dagster dev` survived SIGKILL: {survivors}"
    print(f"test took {time.monotonic() - test_started:.1f}s")
