"""`make dev` as a newcomer runs it, left running past a checks tick: it stays green.

A throw-away checkout (the repository's files, this environment's venv), `make dev` in it as the README
says (its own Postgres, roles, migrations, the demo, the Spark Connect server, the exporter, `dg dev`),
one row inserted as the README's tour does, then the demo left alone until the first scheduled
`pgstream_checks` run has ended. What a user must see: no failed run, no failed sensor or schedule
tick, no stack trace in what `make dev` printed, nothing listening off loopback; and `make stop` ends
it all (runs, `dg dev`, Spark Connect, Postgres) in order, within 10 s, the group delivery run of reader group
``default`` (hosting the demo stream's open run) ending as asked (success, not failed), leaving no process or
listening port behind.

The checkout's `pgstream.yaml` is the demo's with two changes: the checks every minute (not every five:
the wait) and free ports for the exporter and Spark Connect (other tests run beside this one).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from pgstream_dagster.devdb import ensure_running, free_port
from tests.support.dagster_dev import descendants, repo_root
from tests.test_dev import CHECKOUT_FILES, _user_env

ROOT = repo_root()
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")

RUNS = """query { runsOrError { ... on Runs { results { runId jobName status tags { key value } } } } }"""
#: what a failed run said: its failure events' messages and errors
FAILURE = """query ($runId: ID!) { logsForRun(runId: $runId) { ... on EventConnection { events {
  __typename ... on MessageEvent { message } ... on ExecutionStepFailureEvent { error { message causes { message } } }
  ... on RunFailureEvent { message } } } } }"""


@dataclass
class RunningDemo:
    root: Path
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    env: dict[str, str]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def runs(self) -> list[dict[str, Any]]:
        answer = httpx.post(f"http://127.0.0.1:{self.port}/graphql", json={"query": RUNS}, timeout=10).json()
        results: list[dict[str, Any]] = answer["data"]["runsOrError"]["results"]
        return results

    def failure(self, run_id: str) -> str:
        answer = httpx.post(f"http://127.0.0.1:{self.port}/graphql", json={"query": FAILURE,
                            "variables": {"runId": run_id}}, timeout=10).json()
        events = answer["data"]["logsForRun"]["events"]
        said = []
        for e in events:
            if "Failure" in e["__typename"]:
                error = e.get("error") or {}
                causes = " / caused by: ".join(c["message"] for c in error.get("causes") or [])
                said.append(f"{e['__typename']}: {error.get('message') or e.get('message')} {causes}")
        return "\n".join(said)

    def exported(self) -> dict[str, str]:
        text = (self.root / ".pgstream" / "env").read_text()
        return {k: v.strip("'") for k, v in re.findall(r"^export (\w+)=(.*)$", text, re.M)}


#: Dagster's daemon (1.13) empties its workspace before its sensor thread pool ends: a sensor tick submitted just
#: before the shutdown whose thread starts after it fails at once with this error, logged by the daemon's loop
#: ("Sensor daemon caught an error for sensor ...") or, once the tick has begun, by the tick itself ("Sensor tick
#: caught an error"). It says nothing of the demo (the tick never reached the code location); any other error, or
#: this one before the daemon's threads ended, does
_SHUTDOWN_RACE = re.compile(
    r"(?ms)^[^\n]*dagster\.daemon\.SensorDaemon - \S*ERROR\S* - "
    r"\S*(?:Sensor daemon caught an error for sensor pgstream_\w+|Sensor tick caught an error)\S*\n"
    r"Traceback \(most recent call last\):\n(?:  [^\n]*\n)+"
    r"dagster\._core\.errors\.DagsterCodeLocationNotFoundError: Location pgstream does not exist in workspace\n")


def _without_dagsters_shutdown_race(output: str) -> str:
    """``output`` without the upstream race above, where it comes after the daemon said its threads ended."""
    ended = output.find("Daemon threads shut down.")
    if ended < 0:
        return output
    return output[:ended] + _SHUTDOWN_RACE.sub("", output[ended:])


def _wait(what: str, done: Callable[[], bool], timeout: float, demo: RunningDemo) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if demo.proc.poll() is not None:
            pytest.fail(f"`make dev` exited ({demo.proc.returncode}) waiting for {what}:\n{demo.output()[-6000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{demo.output()[-6000:]}")
        time.sleep(0.5)


def _listening() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of the machine: socket inode -> (address, port), from /proc/net."""
    found: dict[int, tuple[str, int]] = {}
    for name, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc/net prints each 32-bit word of the address in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
            ip = ipaddress.ip_address(words)
            text = str(ip.ipv4_mapped) if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else str(ip)
            found[int(fields[9])] = (text, int(port, 16))
    return found


def _sockets_of(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening socket the processes hold."""
    listening = _listening()
    held = []
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            if (m := re.fullmatch(r"socket:\[(\d+)\]", link)) and int(m[1]) in listening:
                held.append((pid, *listening[int(m[1])]))
    return held


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDemo]:
    root = tmp_path_factory.mktemp("fresh-clone")
    for name in CHECKOUT_FILES:
        shutil.copy2(ROOT / name, root / name)
    config = (root / "pgstream.yaml").read_text()
    config = config.replace("port: 9187", f"port: {free_port()}")
    (root / "pgstream.yaml").write_text(config + '\nchecks: {cron: "* * * * *"}\n')
    (root / ".venv").symlink_to(sys.prefix)
    for name in ("pgstream_dagster", "sql"):
        (root / name).symlink_to(ROOT / name)
    (root / "Makefile").symlink_to(ROOT / "Makefile")
    port = free_port()
    env = {**_user_env(), "PGSTREAM_SPARK_PORT": str(free_port())}
    log = root / "make-dev.log"
    with log.open("wb") as out:
        # `make dev` with the UI on a free port: what the Makefile runs, `pgstream-dagster dev`, with --port
        # (-o: this environment's venv is installed; make's stamp may be older than a pyproject.toml edited since)
        proc = subprocess.Popen(["make", "-o", f"{sys.prefix}/.installed", "dev", f"VENV={sys.prefix}",
                                 f"DEV_ARGS=--port {port}"], cwd=root, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    running = RunningDemo(root, proc, log, port, env)
    try:
        yield running
    finally:
        if proc.poll() is None:
            subprocess.run(["make", "stop", f"VENV={sys.prefix}"], cwd=root, env=env, capture_output=True,
                           timeout=120)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        subprocess.run([sys.executable, "-m", "pgstream_dagster.cli", "dev", "--stop", "--root", str(root)],
                       env=env, capture_output=True, timeout=120)


def test_a_fresh_make_dev_stays_green_past_a_checks_tick_and_make_stop_ends_it_in_order(demo: RunningDemo) -> None:
    sink = demo.root / ".pgstream" / "demo-events.jsonl"

    def answers() -> bool:
        try:
            return bool(demo.runs()) or True
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return False

    _wait("the UI", answers, 300, demo)
    _wait("the demo's group delivery run (reader group default)",
          lambda: any(r["jobName"] == "pgstream_group_delivery" and r["status"] == "STARTED"
                      and any(t["key"] == "pgstream/group" and t["value"].startswith("default@") for t in r["tags"])
                      for r in demo.runs()), 180, demo)
    with psycopg.connect(demo.exported()["PGSTREAM_OWNER_DATABASE_URL"], autocommit=True) as conn:
        conn.execute("insert into demo.users (email, email_verified) values ('ada@example.com', true)")
    _wait("the tour's event in the sink", lambda: sink.exists() and "ada@example.com" in sink.read_text(), 60, demo)

    def checks_ended() -> bool:
        return any(r["jobName"] == "pgstream_checks" and r["status"] in ("SUCCESS", "FAILURE", "CANCELED")
                   and any(t["key"] == "pgstream/scheduled_checks" for t in r["tags"])
                   for r in demo.runs())

    _wait("the first scheduled pgstream_checks run", checks_ended, 200, demo)
    runs = demo.runs()
    assert {r["jobName"] for r in runs} >= {"pgstream_group_delivery", "pgstream_checks"}
    # (a run still on its way, e.g. the next minute's checks run, launched late on a loaded host, is not a failure;
    # make stop ends it, and every run's last status is checked after the stop below)
    bad = [(r["jobName"], r["status"], r["runId"]) for r in runs
           if r["status"] not in ("SUCCESS", "STARTED", "STARTING", "QUEUED", "NOT_STARTED")]
    assert bad == [], f"runs of a fresh demo that are not green: {bad}\n" + "\n".join(
        demo.failure(run_id) for _job, _status, run_id in bad)

    # what make dev and its processes printed: no stack trace, no error
    output = demo.output()
    assert "Traceback" not in output, output[-6000:]

    # the failed ticks Dagster keeps (sensors and schedules) in its storage
    dagster_url = demo.exported()["DAGSTER_POSTGRES_URL"].replace("postgresql+psycopg2://", "postgresql://", 1)
    with psycopg.connect(dagster_url) as conn:
        failed_ticks = conn.execute("select count(*) from job_ticks where status = 'FAILURE'").fetchone()
    assert failed_ticks == (0,), "failed sensor or schedule ticks"

    # nothing of the demo listens off loopback: dg dev's processes, the exporter, Spark Connect's JVM, Postgres
    spark_pid = int((demo.root / ".pgstream" / "spark-connect.pid").read_text().split()[0])
    pg_pid = int((demo.root / ".pgstream" / "data" / "postmaster.pid").read_text().split()[0])
    processes = {demo.proc.pid, *descendants(demo.proc.pid), spark_pid, *descendants(spark_pid), pg_pid}
    sockets = _sockets_of(processes)
    assert sockets, "found no listening socket of the demo (the /proc walk is broken)"
    assert [s for s in sockets if s[1] not in LOOPBACK] == [], sockets

    # make stop: in order (dg dev as Ctrl-C stops it: its group run interrupted as Dagster interrupts a run, which
    # closes its members' runs, they give their batches back, and ends; then Spark Connect and Postgres), nothing
    # left behind. It takes 6-8 s on a quiet host; dg dev gets 15 s to end by itself (then SIGTERM, which the
    # check of `make dev`'s own end below would catch), as another test process shares the suite's two CPUs
    owner_url = demo.exported()["PGSTREAM_OWNER_DATABASE_URL"]
    # (on a loaded host the queued run coordinator launches a minute's checks run late, beside the next one: a run
    # worker still starting when make stop comes is interrupted in its imports and killed; wait until none is)
    _wait("every launched run to have started or ended", lambda: not [
        r for r in demo.runs() if r["status"] in ("QUEUED", "NOT_STARTED", "STARTING")], 120, demo)
    with psycopg.connect(owner_url) as conn:
        (warm,) = conn.execute("select open_run_key from pgstream.streams where id = 1").fetchone() or (None,)
    assert warm is not None
    started = time.monotonic()
    stop = subprocess.run(["make", "-s", "stop", f"VENV={sys.prefix}"], cwd=demo.root, env=demo.env,
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert stop.returncode == 0, stop.stdout + stop.stderr
    lines = stop.stdout.splitlines()
    assert re.fullmatch(r"stopped dg dev \(pid \d+\) and its processes in \d+\.\d s", lines[0]), lines
    assert lines[1:] == [f"stopped the Spark Connect server (pid {spark_pid})",
                         f"stopped Postgres (pid {pg_pid}, data in {demo.root / '.pgstream' / 'data'})"], lines
    assert demo.proc.wait(timeout=10) == 0, demo.output()[-3000:]  # ended by itself: no `make: ... Killed`
    assert took <= 25, f"make stop took {took:.1f} s: {lines}"  # (dg dev's budget, 15 s, then SIGTERM)
    output = _without_dagsters_shutdown_race(demo.output())
    assert "Killed" not in output and "Traceback" not in output, output[-3000:]
    # what the runs' ops printed is in their compute logs (the run page's stdout and stderr), not dg dev's console
    runs_output = "\n".join(p.read_text(errors="replace") for p in sorted(
        (demo.root / "storage").glob("*/compute_logs/*.[eo][ru][rt]")))
    assert "Traceback" not in runs_output, runs_output[-3000:]
    assert "reader group default: group delivery run ended (interrupted (shutdown)" in runs_output, runs_output[-3000:]
    survivors = [pid for pid in processes if Path(f"/proc/{pid}").exists()
                 and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert survivors == [], f"processes of the demo still running after make stop: {survivors}"
    ports = {port for _, _, port in sockets}
    assert [p for p in _listening().values() if p[1] in ports] == []
    assert not (demo.root / "logs").exists()

    # the group run ended as Dagster expects (success, not failed) and its member gave its stream back: ask
    # Dagster's storage and the ledger (Postgres started again)
    pg = ensure_running(demo.root / ".pgstream" / "data")
    try:
        with psycopg.connect(pg.url_for("dagster")) as conn:
            statuses = conn.execute("select pipeline_name, status from runs").fetchall()
        with psycopg.connect(pg.url_for("pgstream")) as conn:
            launched = conn.execute("select count(*) from pgstream.batches where status = 'launched'").fetchone()
            reader = conn.execute("select open_run_key is distinct from %s, slot_reader from pgstream.streams "
                                  "where id = 1", [warm]).fetchone()
    finally:
        pg.stop("fast")
    assert [s for s in statuses if s[1] not in ("SUCCESS", "CANCELED")] == [], statuses
    assert ("pgstream_group_delivery", "SUCCESS") in statuses, statuses
    assert launched == (0,)
    assert reader == (True, "group:default")  # the group's (its sensor, or its next group run) reads for it
