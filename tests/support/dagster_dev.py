"""Running `dg dev` (`make dev`) the way a user does, for end-to-end tests: databases of its own, the
process group, GraphQL, and a clean stop (no process of it may survive)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from pgstream_dagster.devdb import LocalPostgres, free_port

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


def make_databases(pg: LocalPostgres) -> Databases:
    suffix = uuid.uuid4().hex[:8]
    app, storage = f"e2e_app_{suffix}", f"e2e_dagster_{suffix}"
    pg.create_database(app)
    pg.create_database(storage)
    return Databases(pg.url_for(app), pg.url_for(storage).replace("postgresql://", "postgresql+psycopg2://", 1))


def drop_databases(pg: LocalPostgres, dbs: Databases) -> None:
    for url in (dbs.app_url, dbs.dagster_url):
        _drop(pg, url.rsplit("/", 1)[1])


# --------------------------------------------------------------------------------------------
# `dg dev`, as a user starts it


@dataclass
class DagsterDev:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def tail(self, lines: int = 150) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def graphql(self, query: str, variables: dict[str, Any]) -> dict[str, Any]:
        # (a reload starts a code server: slow on a loaded host)
        response = httpx.post(f"http://127.0.0.1:{self.port}/graphql", timeout=60,
                              json={"query": query, "variables": variables})
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data


#: how long `dagster dev` may take until the first sensor tick completed (the first run starts Spark)
READY_TIMEOUT_SECS = 180


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def start_dagster_dev(tmp_path: Path, env: dict[str, str]) -> DagsterDev:
    port = free_port()
    log = tmp_path / "dagster-dev.log"
    dg = Path(sys.executable).with_name("dg")  # what `make dev` runs (`dagster dev` is superseded by it)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(dg), "dev", "--workspace", str(repo_root() / "workspace.yaml"), "--host", "127.0.0.1",
             "--port", str(port)],
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


def stop_process_group(proc: subprocess.Popen[bytes], *, crash: bool = False, name: str = "`dg dev`") -> list[int]:
    """SIGTERM the whole group (webserver, daemon, code servers, run workers, Spark), wait up to
    20 s, then SIGKILL whatever is left of it, and of the descendants that left the group (PySpark's
    worker daemons make sessions of their own). ``crash``: SIGKILL at once (kill -9 of the group, as
    a machine or container dies). Returns the pids that survived all that."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    tree = descendants(proc.pid)
    outside = [pid for pid in tree if _pgid(pid) not in (None, pgid)]
    print(f"{'killing' if crash else 'stopping'} {name}: {len(tree)} descendants, {len(outside)} outside its "
          "process group")
    try:
        os.killpg(pgid, signal.SIGKILL if crash else signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + (0 if crash else 20)
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
    """Poll ``done`` until true; returns the seconds waited. On timeout (or when ``dg dev``
    dies) fail with the tail of its log."""
    started = time.monotonic()
    while True:
        if done():
            return time.monotonic() - started
        if dev.proc.poll() is not None:
            pytest.fail(f"`dg dev` exited with {dev.proc.returncode} while waiting for {what}\n"
                        f"{details()}\n--- tail of {dev.log} ---\n{dev.tail()}")
        if time.monotonic() - started > timeout:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{details()}\n"
                        f"--- tail of {dev.log} ---\n{dev.tail()}")
        time.sleep(0.5)


