"""`make dev` for a newcomer: what it prints while it prepares the demo, a second start that reuses
what runs, `.pgstream/env` for the commands of the docs, every command of the docs' `demo` blocks run
as written against that demo, `pgstream-dagster dev --status` and `make clean` (`make stop` with `dg dev`
running: tests/test_demo_green.py).

One demo for the module, prepared as `make dev` prepares it before `dg dev` (its own Postgres under a
throw-away checkout's `.pgstream/`, its Spark Connect server, on a free port: the Spark source's worked
example runs on it); the tests run in file order and the last one stops and deletes it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from pgstream_dagster.devdb import _bin_dir, free_port
from tests.support.dagster_dev import repo_root
from tests.support.harness import insert_events
from tests.support.spark_source import record_batches

ROOT = repo_root()
#: a fenced block right after a `<!-- demo -->` line runs as written on the demo, from the checkout: a bash
#: block in bash, a python block in the checkout's .venv/bin/python with the demo's environment (.pgstream/env)
DEMO_BLOCK = re.compile(r"^[ \t]*<!-- demo -->[ \t]*\n[ \t]*```(bash|python)\n(.*?)^[ \t]*```", re.S | re.M)
#: how each kind of block runs (a python block reads its program on stdin)
RUNNERS = {"bash": ["bash", "-euo", "pipefail", "-c"],
           "python": ["bash", "-euo", "pipefail", "-c", ". .pgstream/env && exec .venv/bin/python -"]}
CHECKOUT_FILES = ("pgstream.yaml", "dagster.yaml", "workspace.yaml", "pyproject.toml")


@dataclass
class Demo:
    root: Path
    env: dict[str, str]  # a user's shell: no DAGSTER_* or PYSPARK_* variable, PGSTREAM_SPARK_PORT the only PGSTREAM_*
    first: str  # what the first `make dev` printed before `dg dev`
    second: str  # and the second


def _user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PGSTREAM_", "DAGSTER_", "VIRTUAL_ENV", "PYSPARK_"))}
    if os.environ.get("PGSTREAM_PG_BIN"):
        env["PGSTREAM_PG_BIN"] = os.environ["PGSTREAM_PG_BIN"]
    # psql: the docs say where it is if the machine has none
    env["PATH"] = f"{env.get('PATH', '')}:{_bin_dir()}"
    env["PYTHONPATH"] = str(ROOT)
    env["PGSTREAM_SPARK_PORT"] = str(free_port())  # not make dev's default port: another test may hold it
    return env


def _prepare(root: Path, env: dict[str, str]) -> str:
    """What `make dev` runs before `dg dev`, in a process of its own (it sets os.environ)."""
    done = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                           "from pgstream_dagster.dev import prepare_dev; prepare_dev(Path(sys.argv[1]))",
                           str(root)], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    root = tmp_path_factory.mktemp("checkout")
    for name in CHECKOUT_FILES:
        (root / name).write_bytes((ROOT / name).read_bytes())
    (root / ".venv").symlink_to(sys.prefix)  # the docs run .venv/bin/...
    for name in ("pgstream_dagster", "sql"):  # dg looks for the project's root module in the project
        (root / name).symlink_to(ROOT / name)
    env = _user_env()
    first = _prepare(root, env)
    second = _prepare(root, env)
    yield Demo(root, env, first, second)
    subprocess.run([sys.executable, "-m", "pgstream_dagster.cli", "dev", "--stop", "--root", str(root)], env=env,
                   capture_output=True, timeout=120)


def _warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r"warn", line, re.I)]


def test_make_dev_prints_each_step_with_its_duration_and_a_second_start_reuses_what_runs(demo: Demo) -> None:
    step = re.compile(r"^\[(\d)/(\d)\] (.+?) \.\.\. (.+) \((\d+\.\d) s\)$", re.M)
    first = {m[3]: m[4] for m in step.finditer(demo.first)}
    second = {m[3]: m[4] for m in step.finditer(demo.second)}
    postgres = f"local Postgres (wal_level=logical) in {demo.root / '.pgstream' / 'data'}"
    port = (demo.root / ".pgstream" / "data.port").read_text()
    spark = (f"Spark Connect server for the runs on port {demo.env['PGSTREAM_SPARK_PORT']} "
             f"(log: {demo.root / '.pgstream' / 'spark-connect.log'})")
    assert first == {postgres: f"initialised and started on port {port}", "roles and databases": "done",
                     "migrations and the demo schema": first["migrations and the demo schema"], spark: "started",
                     "streams and subscriptions of pgstream.yaml": first["streams and subscriptions of pgstream.yaml"],
                     "environment for other shells": f"written to {demo.root / '.pgstream' / 'env'}"}, demo.first
    assert re.fullmatch(r"applied \d+ migrations", first["migrations and the demo schema"])
    assert first["streams and subscriptions of pgstream.yaml"] == "3 changes"  # a slot, two subscriptions
    # stream 1 names no reader: it reads with reader group default, whose slot init created
    assert re.search(r"^      created slot pgstream_g_default_\w+ for reader group default \(streams 1\)$", demo.first,
                     re.M), demo.first
    assert second == {**first, postgres: f"running on port {port}", "migrations and the demo schema": "up to date",
                      spark: "running", "streams and subscriptions of pgstream.yaml": "up to date"}, demo.second
    assert [m.group(1, 2) for m in step.finditer(demo.second)] == [(str(i), "6") for i in range(1, 7)]
    assert _warnings(demo.first + demo.second) == []


def test_the_env_file_holds_what_the_docs_commands_need(demo: Demo) -> None:
    env_file = demo.root / ".pgstream" / "env"
    assert env_file.stat().st_mode & 0o077 == 0  # URLs are credentials elsewhere: the owner's only
    exported = dict(re.findall(r"^export (\w+)=(.*)$", env_file.read_text(), re.M))
    assert set(exported) == {"PGSTREAM_DATABASE_URL", "PGSTREAM_OWNER_DATABASE_URL", "PGSTREAM_EXECUTOR_DATABASE_URL",
                             "PGSTREAM_CONFIG", "PGSTREAM_DEMO_SINK", "PGSTREAM_SPARK_REMOTE", "DAGSTER_POSTGRES_URL",
                             "DAGSTER_HOME"}
    assert exported["PGSTREAM_SPARK_REMOTE"] == f"sc://127.0.0.1:{demo.env['PGSTREAM_SPARK_PORT']}"
    who = "psql -XAtc 'select current_user'"
    shell = subprocess.run(["bash", "-c", f'. .pgstream/env && {who} "$PGSTREAM_DATABASE_URL" && '
                            f'{who} "$PGSTREAM_OWNER_DATABASE_URL"'],
                           cwd=demo.root, env=demo.env, capture_output=True, text=True, timeout=60)
    assert shell.stdout.split() == ["pgstream_demo_runtime", "pgstream_demo_owner"], shell.stderr


def _demo_blocks() -> list[tuple[str, str, str]]:
    """(page#n, language, block) of each demo block, in page order (a page's blocks in order)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*/*.md"))]
    return [(f"{page.relative_to(ROOT)}#{n}", language,
             textwrap.dedent(block) if language == "python" else re.sub(r"^[ \t]+", "", block, flags=re.M))
            for page in pages for n, (language, block) in enumerate(DEMO_BLOCK.findall(page.read_text()), 1)]


def test_every_demo_command_of_the_docs_runs_as_written_without_a_warning(demo: Demo) -> None:
    blocks = _demo_blocks()
    assert {name.split("#")[0] for name, _, _ in blocks} >= {"README.md", "docs/quickstart.md", "docs/spark-source.md"}
    owner = dict(re.findall(r"^export (\w+)=(.*)$", (demo.root / ".pgstream" / "env").read_text(), re.M))
    owner_url = owner["PGSTREAM_OWNER_DATABASE_URL"].strip("'")
    # stream 1's ledger holds 30 events in 3 batches, as after dg dev's deliveries (none run here)
    insert_events(owner_url, 1, 30)
    record_batches(owner_url, 1, 10)
    failures, outputs = [], {}
    for name, language, block in blocks:
        command, stdin = (RUNNERS["bash"] + [block], None) if language == "bash" else (RUNNERS[language], block)
        done = subprocess.run(command, input=stdin, cwd=demo.root, env=demo.env,
                              capture_output=True, text=True, timeout=300)
        output = outputs[name] = done.stdout + done.stderr
        if done.returncode != 0 or _warnings(output):
            failures.append(f"{name} (exit {done.returncode}):\n{block}\n{output}")
    assert failures == [], "\n\n".join(failures)
    # the Spark source's worked example landed the ledger's events (on make dev's Spark Connect server)
    assert outputs["docs/spark-source.md#2"].startswith("30 events landed in "), outputs["docs/spark-source.md#2"]
    # nothing left in the checkout that git would track (a config the docs write goes under .pgstream/)
    left = [p.name + ("/" if p.is_dir() else "") for p in demo.root.iterdir()
            if p.name not in {*CHECKOUT_FILES, ".venv", "pgstream_dagster", "sql"}]
    tracked = [name for name in left if subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index",
                                                        name], capture_output=True).returncode != 0]
    assert tracked == []
    with psycopg.connect(owner_url) as c:  # the inserts went in
        assert c.execute("select count(*) from demo.users").fetchone()[0] >= 2  # type: ignore[index]
        # the pause block ended with resume
        assert c.execute("select paused from pgstream.streams where id = 1").fetchone() == (False,)


def test_the_code_location_loads_without_a_warning(demo: Demo) -> None:
    """`dg check defs` and `dg list defs` as the demo's user runs them (.venv/bin/dg, .venv not activated):
    no preview warning of Dagster's defs-folder loading, no dg warning about the virtual environment."""
    done = subprocess.run(["bash", "-euo", "pipefail", "-c",
                           ". .pgstream/env && .venv/bin/dg check defs && .venv/bin/dg list defs"],
                          cwd=demo.root, env=demo.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pgstream_replay" in done.stdout and "pgstream_backfill" in done.stdout
    assert _warnings(done.stdout + done.stderr) == [], done.stderr


def _running(pid: int) -> bool:
    """The process exists and is no zombie (nothing may have reaped an orphan yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _status(root: Path, env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pgstream_dagster.cli", "dev", "--status", "--root", str(root)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_dev_status_lists_the_exporter_running_beside_dg_dev(demo: Demo, tmp_path: Path) -> None:
    """run_dev starts the exporter, then becomes dg dev (execv): the exporter is a child of dg dev's pid, and exits
    with it. A parent started the same way stands in for dg dev here (dg dev itself is a minute of CPU)."""
    from pgstream_dagster.dev import _exporter

    exported = dict(re.findall(r"^export (\w+)=(.*)$", (demo.root / ".pgstream" / "env").read_text(), re.M))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "pgstream.yaml"
    config.write_text(f"database_url: {exported['PGSTREAM_DATABASE_URL']}\nmetrics: {{port: {port}}}\n")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                               "'-m', 'pgstream_dagster.cli', 'metrics', '--config', sys.argv[1], "
                               "'--exit-with-parent']); time.sleep(300)", str(config)], env=demo.env)
    try:
        deadline = time.monotonic() + 60
        while "running (" not in _exporter(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        line = _exporter(parent.pid)
        assert re.fullmatch(rf"Prometheus exporter:  running \(pid \d+\) on http://127\.0\.0\.1:{port}/metrics",
                            line), line
        exporter = int(line.split("pid ")[1].split(")")[0])
        while time.monotonic() < deadline:  # serving: it knows its parent (what it watches) by now
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).close()
                break
            except OSError:
                time.sleep(0.2)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while _running(exporter) and time.monotonic() < deadline:  # it exits with its parent
        time.sleep(0.2)
    assert not _running(exporter)
    assert _exporter(parent.pid) == "Prometheus exporter:  not running"


def test_make_clean_stops_the_demo_services_before_deleting_them(demo: Demo) -> None:
    datadir = demo.root / ".pgstream" / "data"
    pid = int((datadir / "postmaster.pid").read_text().split()[0])
    port = (demo.root / ".pgstream" / "data.port").read_text()
    spark = int((demo.root / ".pgstream" / "spark-connect.pid").read_text())
    assert _status(demo.root, demo.env) == [
        f"Postgres:             running (pid {pid}) on 127.0.0.1:{port}, data in {datadir}",
        f"Spark Connect server: running (pid {spark}), log {demo.root / '.pgstream' / 'spark-connect.log'}",
        "dg dev:               not running", "Prometheus exporter:  not running"]
    done = subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), "-C", str(demo.root), "clean",
                           f"VENV={sys.prefix}"], env=demo.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"stopped Postgres (pid {pid}, data in {datadir})" in done.stdout
    assert f"stopped the Spark Connect server (pid {spark})" in done.stdout
    assert not _running(spark)
    assert not (demo.root / ".pgstream").exists()
    assert not _running(pid)  # not left running on the deleted directory
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2)
    assert _status(demo.root, demo.env) == ["Postgres:             none", "Spark Connect server: not running",
                                            "dg dev:               not running", "Prometheus exporter:  not running"]


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a user takes root (as another user Postgres runs as it)")
def test_processes_starting_together_on_a_new_machine_all_get_the_local_postgres_user() -> None:
    """On a machine where the user the local Postgres runs as (root: a user of its own) does not exist yet, the
    processes that start one at once (the test workers, ``make dev``) all find it missing: each gets the user,
    none fails on the ``useradd`` another won."""
    import pwd

    name = f"pgs_race_{os.getpid()}"
    script = ("import sys, time; from pgstream_dagster.devdb import _system_user\n"
              "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
              "print(*_system_user(sys.argv[1]))")
    at = time.time() + 1.5  # (every process imported and waiting by then)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", script, name, str(at)], cwd=repo_root(), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(6)]
        answers = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, [err for _, err in answers]
        entry = pwd.getpwnam(name)
        assert {out.strip() for out, _ in answers} == {f"{entry.pw_uid} {entry.pw_gid}"}
    finally:
        subprocess.run(["userdel", name], capture_output=True)
