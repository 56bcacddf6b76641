"""Deployed as Dagster runs in production (the Helm chart, Dagster+ hybrid): the code location as its own
gRPC code server (``dagster api grpc``), ``dagster-daemon run`` and ``dagster-webserver`` as separate
processes, the three on one Postgres instance storage (the repository's dagster.yaml, its
``DAGSTER_POSTGRES_URL`` a plain ``postgresql://`` URL) and a workspace.yaml that points at the code
server's port. Delivery runs are started by the code server (the run launcher asks it), as the
user-code deployment starts them. Through them: a stream delivers to a real HTTP endpoint, a replay
launched through the webserver's GraphQL API redelivers a range, and the endpoint failing puts the
stream in failover, after which everything committed arrives, first deliveries in commit order.

The Dockerfile of the code location's image is checked against pyproject.toml without Docker (none here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import yaml

from pgstream_dagster.defs.names import REPLAY_JOB, REPLAY_OP
from pgstream_dagster.devdb import free_port
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.migrations import migrate

from .support.dagster_dev import READY_TIMEOUT_SECS, Databases, descendants, repo_root, stop_process_group
from .support.endpoint import Endpoint
from .support.harness import write_config

LOCATION = "pgstream"
LAUNCH = """mutation ($params: ExecutionParams!) { launchRun(executionParams: $params) { __typename
  ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } } }"""
RUN = """query ($runId: ID!) { runOrError(runId: $runId) { ... on Run { status } } }"""
LOCATIONS = """query { workspaceOrError { ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- tail of {self.name} ({self.log}) ---\n" + "\n".join(text.splitlines()[-lines:])


@dataclass
class Deployment:
    processes: list[Process]
    webserver_port: int

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        log = cwd / f"{name}.log"
        with log.open("wb") as out:  # a session of its own: stopped with its run workers (stop_process_group)
            inherited = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "PGSTREAM_"))}
            proc = subprocess.Popen(argv, cwd=cwd, env={**inherited, **env}, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(Process(name, proc, log))

    def wait(self, what: str, done: Callable[[], bool], timeout: float, details: Callable[[], str] = str) -> float:
        """Poll ``done`` until true (seconds waited); fail with the processes' logs when one exits or on timeout."""
        started = time.monotonic()
        while not done():
            dead = [p for p in self.processes if p.proc.poll() is not None]
            if dead or time.monotonic() - started > timeout:
                why = (f"{dead[0].name} exited with {dead[0].proc.returncode}" if dead
                       else f"timed out after {timeout:.0f}s")
                pytest.fail(f"{why} waiting for {what}\n{details()}\n" + "\n".join(p.tail() for p in self.processes))
            time.sleep(0.5)
        return time.monotonic() - started

    def graphql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        response = httpx.post(f"http://127.0.0.1:{self.webserver_port}/graphql", timeout=30,
                              json={"query": query, "variables": variables or {}})
        response.raise_for_status()
        data: dict[str, Any] = response.json()["data"]
        return data

    def stop(self) -> list[int]:
        """Each process and what it started (the code server's run workers), all at once; the pids that survived."""
        with ThreadPoolExecutor(len(self.processes) or 1) as pool:
            stopped = pool.map(lambda p: stop_process_group(p.proc, name=p.name), self.processes)
            return [pid for survivors in stopped for pid in survivors]


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


@pytest.fixture
def deployment(databases: Databases, endpoint: Endpoint, tmp_path: Path) -> Iterator[tuple[Deployment, str]]:
    """The three processes on stream 1 (to ``endpoint``, batches, the product's open delivery runs) of a
    migrated, initialised application database; yields them and the application database's URL."""
    app = databases.app_url
    migrate(app)
    with psycopg.connect(app, autocommit=True) as conn:
        conn.execute("create table public.users (id serial primary key, email text)")
    config = write_config(
        tmp_path / "pgstream.yaml", app,
        streams=[{"id": 1, "sink": endpoint.sink(), "batch": {"max_size": 100, "max_fill_secs": 0.2},
                  "sensor": {"interval_secs": 1, "tick_budget_secs": 2},
                  "retry": {"initial_backoff_secs": 0.5, "max_backoff_secs": 2},
                  "delivery": {"mode": "open", "tuning": {"max_run_secs": 600}}}],
        subscriptions=[{"key": "users", "stream_id": 1, "operation": "INSERT", "schema_name": "public",
                        "table_name": "users", "column_names": ["id", "email"]}])
    init(config)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(repo_root() / "dagster.yaml", home / "dagster.yaml")  # the product's instance, copied as deployed
    grpc_port, webserver_port = free_port(), free_port()
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(yaml.safe_dump({"load_from": [{"grpc_server": {
        "host": "127.0.0.1", "port": grpc_port, "location_name": LOCATION}}]}))
    plain_url = databases.dagster_url.replace("postgresql+psycopg2://", "postgresql://", 1)
    storage = {"DAGSTER_POSTGRES_URL": plain_url, "PYTHONUNBUFFERED": "1"}
    env = {**storage, "DAGSTER_HOME": str(home)}
    deployed = Deployment([], webserver_port)
    try:
        # the code server: the only process that imports the code location (and reads pgstream.yaml); no
        # DAGSTER_HOME: the runs it starts load the instance of whoever launched them (the daemon, the
        # webserver), each process reading the storage's URL from its own environment
        deployed.start("code-server", [_bin("dagster"), "api", "grpc", "--module-name", "pgstream_dagster.definitions",
                                       "--host", "127.0.0.1", "--port", str(grpc_port), "--location-name", LOCATION],
                       {**storage, "PGSTREAM_CONFIG": str(config)}, tmp_path)
        deployed.wait("the code server to answer", lambda: subprocess.run(
            [_bin("dagster"), "api", "grpc-health-check", "--host", "127.0.0.1", "--port", str(grpc_port)],
            capture_output=True).returncode == 0, READY_TIMEOUT_SECS)
        deployed.start("daemon", [_bin("dagster-daemon"), "run", "--workspace", str(workspace)], env, tmp_path)
        deployed.start("webserver", [_bin("dagster-webserver"), "--workspace", str(workspace), "--host", "127.0.0.1",
                                     "--port", str(webserver_port)], env, tmp_path)
        yield deployed, app
    finally:
        survivors = deployed.stop()
    assert not survivors, f"processes of the deployment survived SIGKILL: {survivors}"


def _committed(app: str) -> list[int]:
    with psycopg.connect(app, autocommit=True) as c:
        return [r[0] for r in c.execute("select id from pgstream.events where stream_id = 1 order by id")]


def _insert(app: str, n: int, start: int) -> None:
    with psycopg.connect(app, autocommit=True) as conn:
        for i in range(start, start + n):  # a transaction each: n events in commit order
            conn.execute("insert into public.users (email) values (%s)", [f"u{i}@example.com"])


def test_code_server_daemon_and_webserver_deliver_replay_and_fail_over(deployment: tuple[Deployment, str],
                                                                        endpoint: Endpoint, tmp_path: Path) -> None:
    deployed, app = deployment
    started = time.monotonic()

    def state() -> str:
        with psycopg.connect(app, autocommit=True) as c:
            status = c.execute("select state, failover_since from pgstream.stream_status where id = 1").fetchone()
        return f"accepted {endpoint.accepted}, refused {endpoint.refused_answers}, committed {_committed(app)}, " \
               f"stream status {status}"

    def location_loaded() -> bool:
        try:
            entries = deployed.graphql(LOCATIONS)["workspaceOrError"]["locationEntries"]
        except httpx.HTTPError:
            return False
        return [(e["name"], (e["locationOrLoadError"] or {}).get("__typename")) for e in entries] == [
            (LOCATION, "RepositoryLocation")]

    deployed.wait("the webserver to load the code location from the code server", location_loaded,
                  READY_TIMEOUT_SECS)

    # 1. delivery: the daemon's sensor of the stream's reader group (the code server evaluates it) records batches,
    # the group run the code server starts delivers them
    _insert(app, 20, 0)
    deployed.wait("20 events at the endpoint", lambda: len(endpoint.unique()) >= 20, READY_TIMEOUT_SECS, state)
    first = _committed(app)
    assert len(first) == 20 and endpoint.first_seen_order() == first, state()
    delivered_at = time.monotonic()
    code_server, daemon, webserver = deployed.processes
    # the group delivery run (reader group default) hosting the stream's open run stays up, a process of the code
    # server's (the run launcher asked it); the daemon and the webserver, which never load the code location,
    # started none
    assert descendants(code_server.proc.pid), "no run worker under the code server"
    assert not descendants(daemon.proc.pid) and not descendants(webserver.proc.pid)

    # 2. a replay of events 5..14, launched through the webserver's GraphQL API (as the Launchpad does)
    low, high = first[5], first[14]
    launched = deployed.graphql(LAUNCH, {"params": {
        "selector": {"repositoryLocationName": LOCATION, "repositoryName": "__repository__", "jobName": REPLAY_JOB},
        "runConfigData": {"ops": {REPLAY_OP: {"config": {"stream_id": 1, "from_event_id": low,
                                                          "to_event_id": high}}}}}})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]

    def replay_status() -> str:
        return str(deployed.graphql(RUN, {"runId": run_id})["runOrError"].get("status"))

    deployed.wait("the replay run to succeed", lambda: replay_status() in ("SUCCESS", "FAILURE", "CANCELED"), 120,
                  lambda: f"replay {replay_status()}; {state()}")
    assert replay_status() == "SUCCESS", state()
    assert endpoint.accepted[20:] == first[5:15], state()  # the range again, in order, nothing else
    # its output kept where the webserver that launched it reads it (the code server that started its process has
    # no DAGSTER_HOME): the launcher's storage directory, complete
    logs = tmp_path / "dagster_home" / "storage" / run_id / "compute_logs"
    assert list(logs.glob("*.err")) and list(logs.glob("*.complete")), sorted(logs.parent.rglob("*"))
    replayed_at = time.monotonic()

    # 3. the endpoint fails: the stream goes to failover and nothing is lost; it recovers when the endpoint does
    endpoint.mode = "error"
    _insert(app, 10, 20)
    with psycopg.connect(app, autocommit=True) as c:
        deployed.wait("stream 1 in failover", lambda: c.execute(
            "select state from pgstream.stream_status where id = 1").fetchone() == ("failover",), 120, state)
    assert endpoint.refused_answers > 0 and len(endpoint.unique()) == 20, state()
    endpoint.mode = "ok"
    _insert(app, 5, 30)  # committed during the failover
    committed = _committed(app)
    assert len(committed) == 35
    deployed.wait("every event after the endpoint recovered", lambda: endpoint.unique() == set(committed), 120, state)
    with psycopg.connect(app, autocommit=True) as c:
        deployed.wait("the failover to end", lambda: c.execute(
            "select failover_since is null from pgstream.stream_status where id = 1").fetchone() == (True,), 60, state)
    assert endpoint.first_seen_order() == committed, state()  # first deliveries in commit order
    print(f"\ndelivered 20 in {delivered_at - started:.1f}s after the location loaded, replay of 10 in "
          f"{replayed_at - delivered_at:.1f}s, failover and recovery in {time.monotonic() - replayed_at:.1f}s; "
          f"{endpoint.refused_answers} requests refused, {endpoint.duplicates()} events accepted twice")


# --------------------------------------------------------------------------------------------
# the code location's image (Docker does not run here: its file is checked against the package)


def test_the_dockerfile_installs_the_package_and_serves_the_code_location() -> None:
    """The image's command serves workspace.yaml's module as its location on every interface, on the port it
    exposes; it installs this package with every extra but dev (a sink added to pyproject.toml fails this
    until the image has it), on a Python pyproject.toml accepts, with Java 17 for Spark."""
    instructions = re.sub(r"\\\n", " ", (repo_root() / "Dockerfile").read_text())  # continuation lines joined
    project = tomllib.loads((repo_root() / "pyproject.toml").read_text())["project"]
    workspace = yaml.safe_load((repo_root() / "workspace.yaml").read_text())["load_from"][0]["python_module"]
    (cmd,) = re.findall(r"^CMD (\[.*\])$", instructions, re.M)
    argv = yaml.safe_load(cmd)
    assert argv[:3] == ["dagster", "api", "grpc"], argv
    assert argv[argv.index("--module-name") + 1] == workspace["module_name"]
    assert argv[argv.index("--location-name") + 1] == workspace["location_name"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert re.search(rf"^EXPOSE {argv[argv.index('--port') + 1]}$", instructions, re.M)
    (install,) = re.findall(r"pip install [^&\n]*", instructions)
    assert '".[${PGSTREAM_EXTRAS}]"' in install, install
    (extras,) = re.findall(r"^ARG PGSTREAM_EXTRAS=([a-z0-9,]+)$", instructions, re.M)
    assert sorted(extras.split(",")) == sorted(set(project["optional-dependencies"]) - {"dev"}), extras
    (python,) = re.findall(r"^FROM python:(3\.\d+)-slim", instructions, re.M)
    (oldest,) = re.findall(r"^>=(3\.\d+)$", project["requires-python"])
    assert tuple(map(int, python.split("."))) >= tuple(map(int, oldest.split("."))), (python, oldest)
    assert "openjdk-17-jre-headless" in instructions, "no Java 17 for Spark"
    for source in ("pyproject.toml", "README.md", "pgstream_dagster", "sql"):  # what the wheel is built from
        assert re.search(rf"^COPY [^\n]*\b{re.escape(source)}\b", instructions, re.M), source
