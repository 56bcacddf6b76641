"""``make dev``: a working local demo in one command. Starts (once) a Postgres with ``wal_level=logical`` under
``.pgstream/`` unless ``PGSTREAM_DATABASE_URL`` is set and a Spark Connect server unless ``PGSTREAM_SPARK_REMOTE``
is set (``--no-spark-server``: runs start their own Spark); creates the databases and roles, migrates, creates the
demo schema, applies ``pgstream.yaml``, starts the Prometheus exporter (``metrics.enabled``) and runs ``dg dev``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from .sinks.base import psycopg2_url
from .sparkserver import descendants as _descendants
from .sparkserver import socket_inodes


def _start_exporter(config: Path) -> str | None:
    """Start ``pgstream-dagster metrics`` beside ``dg dev`` (unless ``metrics.enabled`` is false); it ends with ``dg
    dev`` (same process group for Ctrl-C, and it exits when its parent is gone). Returns its URL."""
    from .config import load_metrics_settings
    from .exporter import metrics_url

    metrics = load_metrics_settings(config).metrics
    if not metrics.enabled:
        return None
    subprocess.Popen([sys.executable, "-m", "pgstream_dagster.cli", "metrics", "--config", str(config),
                      "--exit-with-parent"])
    url = metrics_url(metrics.host, metrics.port)
    print(f"Prometheus exporter: {url} (metrics.enabled: false in {config.name} to go without)")
    return url


def _exporter(dg_pid: int | None) -> str:
    """The status line of the Prometheus exporter of ``make dev``: a child of ``dg dev`` (it exits with it)."""
    from .config import ConfigError, load_metrics_settings
    from .exporter import metrics_url

    for pid in _descendants(dg_pid) if dg_pid is not None else []:
        cmdline = _cmdline(pid).split(b"\0")
        if cmdline[1:4] == [b"-m", b"pgstream_dagster.cli", b"metrics"]:
            try:
                config = Path(os.fsdecode(cmdline[cmdline.index(b"--config") + 1]))
                metrics = load_metrics_settings(config, database_url=False).metrics
                where = f" on {metrics_url(metrics.host, metrics.port)}"
            except (ValueError, IndexError, ConfigError):
                where = ""
            return f"Prometheus exporter:  running (pid {pid}){where}"
    return "Prometheus exporter:  not running"


#: the demo's roles (README, "Security"): the owner (migrate, init), the runtime's login role (the code
#: location, sensors, runs) and the Spark executors' login role
DEMO_OWNER = "pgstream_demo_owner"
DEMO_RUNTIME = "pgstream_demo_runtime"
DEMO_EXECUTOR = "pgstream_demo_executor"


def demo_roles(superuser_url: str, database: str) -> dict[str, str]:
    """As a superuser: the demo's three login roles (owner: no attribute, a member of pgstream_writer; runtime:
    REPLICATION, a member of pgstream_runtime; executor: a member of pgstream_executor), the NOLOGIN group roles they
    join, and ``database`` owned by the owner. Idempotent. Returns each role's URL for ``database``."""
    from psycopg import sql

    def role_url(role: str) -> str:
        base = superuser_url.rsplit("/", 1)[0] + "/" + database
        return base.replace("postgres@", f"{role}@", 1)

    with psycopg.connect(superuser_url, autocommit=True) as conn:
        def ensure(role: str, attributes: str, member_of: str | None = None) -> None:
            if not conn.execute("select 1 from pg_roles where rolname = %s", [role]).fetchone():
                conn.execute(sql.SQL("create role {} " + attributes).format(sql.Identifier(role)))  # constants
            if member_of is not None:
                conn.execute(sql.SQL("grant {} to {}").format(sql.Identifier(member_of), sql.Identifier(role)))

        ensure("pgstream_writer", "nologin noinherit")
        ensure("pgstream_runtime", "nologin")
        ensure("pgstream_executor", "nologin")
        ensure(DEMO_OWNER, "login", member_of="pgstream_writer")
        ensure(DEMO_RUNTIME, "login replication", member_of="pgstream_runtime")
        ensure(DEMO_EXECUTOR, "login", member_of="pgstream_executor")
        row = conn.execute("select datdba::regrole::text from pg_database where datname = %s", [database]).fetchone()
        if row is None:
            conn.execute(sql.SQL("create database {} owner {}").format(sql.Identifier(database),
                                                                       sql.Identifier(DEMO_OWNER)))
    with psycopg.connect(role_url("postgres"), autocommit=True) as conn:
        schema_owner = conn.execute("select nspowner::regrole::text from pg_namespace where nspname = 'pgstream'"
                                    ).fetchone()
    if schema_owner is not None and schema_owner[0] != DEMO_OWNER:
        raise SystemExit(f"error: database {database} of .pgstream/ was installed by an earlier `make dev` as "
                         f"{schema_owner[0]}; the demo now installs it as {DEMO_OWNER}: run `make clean` (it deletes "
                         "the demo's data) and `make dev` again")
    if row is not None and row[0] != DEMO_OWNER:
        with psycopg.connect(superuser_url, autocommit=True) as conn:
            conn.execute(sql.SQL("alter database {} owner to {}").format(sql.Identifier(database),
                                                                        sql.Identifier(DEMO_OWNER)))
    return {"owner": role_url(DEMO_OWNER), "runtime": role_url(DEMO_RUNTIME), "executor": role_url(DEMO_EXECUTOR)}


class _Progress:
    """One line per step of ``make dev``, with its duration: ``[2/6] migrating ... up to date (0.3 s)``."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    @contextmanager
    def step(self, text: str) -> Iterator[list[str]]:
        """Print ``text`` now, the outcome (what the body appends) and the duration when it ends."""
        self.done += 1
        print(f"[{self.done}/{self.total}] {text} ...", end="", flush=True)
        outcome: list[str] = []
        started = time.monotonic()
        try:
            yield outcome
        except BaseException:
            print(" failed", flush=True)
            raise
        print(f" {', '.join(outcome) or 'done'} ({time.monotonic() - started:.1f} s)", flush=True)


#: the environment of ``make dev``'s demo, in ``.pgstream/env`` for a second shell (``. .pgstream/env``)
ENV_KEYS = ("PGSTREAM_DATABASE_URL", "PGSTREAM_OWNER_DATABASE_URL", "PGSTREAM_EXECUTOR_DATABASE_URL",
            "PGSTREAM_CONFIG", "PGSTREAM_DEMO_SINK", "PGSTREAM_SPARK_REMOTE", "DAGSTER_POSTGRES_URL", "DAGSTER_HOME")


def write_env_file(state: Path) -> Path:
    """Write the demo's environment as ``export`` lines to ``state/env`` (owner-only: the URLs are
    credentials on another install)."""
    path = state / "env"
    lines = ["# the environment of `make dev`'s demo: `. .pgstream/env` in another shell"]
    lines += [f"export {key}={shlex.quote(os.environ[key])}" for key in ENV_KEYS if os.environ.get(key)]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


def prepare_dev(root: Path, spark_server: bool = True) -> bool:
    """Everything ``make dev`` does before ``dg dev``, each step reusing what exists (the running
    Postgres, the migrated database, the Spark Connect server): sets the demo's environment in
    ``os.environ`` and writes it to ``.pgstream/env``. True for the demo (no ``PGSTREAM_CONFIG``)."""
    from .devdb import ensure_running
    from .engine.bootstrap import init
    from .engine.migrations import DRIFT_GUARD_MISSING, drift_guard_installed, install_drift_guard, migrate, sql_dir

    state = root / ".pgstream"
    state.mkdir(exist_ok=True)
    local = not os.environ.get("PGSTREAM_DATABASE_URL")
    demo = not os.environ.get("PGSTREAM_CONFIG")
    spark = spark_server and not os.environ.get("PGSTREAM_SPARK_REMOTE")
    progress = _Progress(2 * local + demo + spark + 2)
    superuser_url: str | None = None
    urls: dict[str, str] = {}
    if local:
        with progress.step(f"local Postgres (wal_level=logical) in {state / 'data'}") as outcome:
            datadir = state / "data"
            fresh = not (datadir / "PG_VERSION").exists()
            was_running = not fresh and _postgres_pid(datadir) is not None
            pg = ensure_running(datadir)
            outcome.append(("initialised and started" if fresh else "running" if was_running else "started")
                           + f" on port {pg.port}")
        with progress.step("roles and databases"):
            pg.create_database("dagster")
            urls = demo_roles(pg.url, "pgstream")
            superuser_url = pg.url_for("pgstream")
        os.environ.update(PGSTREAM_DATABASE_URL=urls["runtime"], PGSTREAM_OWNER_DATABASE_URL=urls["owner"],
                          PGSTREAM_EXECUTOR_DATABASE_URL=urls["executor"])
        os.environ.setdefault("DAGSTER_POSTGRES_URL", psycopg2_url(pg.url_for("dagster")))
    if not os.environ.get("DAGSTER_POSTGRES_URL"):
        raise SystemExit("error: set DAGSTER_POSTGRES_URL (a database for Dagster's own storage)")
    owner_url = os.environ.get("PGSTREAM_OWNER_DATABASE_URL") or os.environ["PGSTREAM_DATABASE_URL"]
    if demo:
        os.environ["PGSTREAM_CONFIG"] = str(root / "pgstream.yaml")
        os.environ.setdefault("PGSTREAM_DEMO_SINK", str(state / "demo-events.jsonl"))
        with progress.step("migrations and the demo schema") as outcome:
            applied = migrate(owner_url)
            outcome.append(f"applied {len(applied)} migrations" if applied else "up to date")
            if superuser_url is not None:
                install_drift_guard(superuser_url)  # the one step that needs a superuser
            with psycopg.connect(owner_url, autocommit=True) as conn:
                conn.execute((sql_dir() / "demo" / "demo_schema.sql").read_text())
                guarded = drift_guard_installed(conn)
        if not guarded:
            print(DRIFT_GUARD_MISSING)
    if spark:
        from . import sparkserver

        port = int(os.environ.get("PGSTREAM_SPARK_PORT", sparkserver.DEFAULT_PORT))
        with progress.step(f"Spark Connect server for the runs on port {port} (log: {state / 'spark-connect.log'})"
                           ) as outcome:
            reused = sparkserver.recorded_pid(state) is not None and sparkserver.listening(port)
            os.environ["PGSTREAM_SPARK_REMOTE"] = sparkserver.ensure_running(state, port=port)
            outcome.append("running" if reused else "started")
    with progress.step(f"streams and subscriptions of {Path(os.environ['PGSTREAM_CONFIG']).name}") as outcome:
        changes = init(Path(os.environ["PGSTREAM_CONFIG"]), owner_url=owner_url)
        outcome.append(f"{len(changes)} changes" if changes else "up to date")
    for line in changes:
        print(f"      {line}")
    # the repository's dagster.yaml in place: DAGSTER_HOME is the directory `dg dev` runs in (with another
    # home, `dg dev` warns that the dagster.yaml of its working directory "will not be used")
    assert (root / "dagster.yaml").is_file(), f"{root / 'dagster.yaml'} is missing"
    os.environ["DAGSTER_HOME"] = str(root)
    with progress.step("environment for other shells") as outcome:
        outcome.append(f"written to {write_env_file(state)}")
    if urls:
        print(f"database pgstream:\n"
              f"  owner    (migrate, init; owns demo.users): {urls['owner']}\n"
              f"  runtime  (code location, sensors, runs):   {urls['runtime']}\n"
              f"  executor (Spark executors):                {urls['executor']}")
    return demo


def _postgres_pid(datadir: Path) -> int | None:
    """The pid of the postmaster running on ``datadir`` (``postmaster.pid``), if it is alive."""
    try:
        pid = int((datadir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except PermissionError:  # alive, as another user (embedded_postgres when make dev runs as root)
        return pid
    except OSError:
        return None
    return pid


def _cmdline(pid: int) -> bytes:
    """The command line of the process ``pid``, its arguments NUL-separated (empty: it ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _dg_dev_pid(state: Path) -> int | None:
    """The pid of the ``dg dev`` that ``make dev`` started (``state/dg-dev.pid``), if it still runs."""
    try:
        pid = int((state / "dg-dev.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    cmdline = _cmdline(pid).split(b"\0")
    return pid if any(part.endswith(b"/dg") for part in cmdline[:2]) and b"dev" in cmdline else None


def dev_services(root: Path) -> list[str]:
    """One line per service of ``make dev`` under ``root``: running (pid, address) or not."""
    from . import sparkserver

    state = root / ".pgstream"
    datadir = state / "data"
    port_file = state / "data.port"
    port = port_file.read_text().strip() if port_file.exists() else "?"
    pg_pid = _postgres_pid(datadir)
    spark_pid = sparkserver.recorded_pid(state)
    dg_pid = _dg_dev_pid(state)
    return [
        f"Postgres:             running (pid {pg_pid}) on 127.0.0.1:{port}, data in {datadir}" if pg_pid
        else f"Postgres:             not running (data in {datadir})" if (datadir / "PG_VERSION").exists()
        else "Postgres:             none",
        f"Spark Connect server: running (pid {spark_pid}), log {state / 'spark-connect.log'}" if spark_pid
        else "Spark Connect server: not running",
        f"dg dev:               running (pid {dg_pid})" if dg_pid else "dg dev:               not running",
        _exporter(dg_pid),
    ]


def _alive(pids: list[int]) -> list[int]:
    """Of ``pids``, those still running (an exited process its parent has not reaped yet, a zombie, is not)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):  # (ended)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
    return alive


def _with_args(pids: list[int], *parts: bytes) -> list[int]:
    return [pid for pid in pids if all(part in _cmdline(pid) for part in parts)]


def _signal_and_wait(pids: list[int], sig: int, until: float) -> None:
    """Send ``sig`` (0: none) to ``pids`` and wait until they ended or ``until`` (monotonic)."""
    for pid in _alive(pids) if sig else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    while _alive(pids) and time.monotonic() < until:
        time.sleep(0.1)


def _name(pid: int) -> str:
    """A process's command, short (for a line saying what had to be killed)."""
    words = [a.decode(errors="replace") for a in _cmdline(pid).split(b"\0") if a and not a.startswith(b"{")][:4]
    if not words:
        return str(pid)
    return f"{pid} ({' '.join(Path(words[0]).name if i == 0 else w for i, w in enumerate(words))[:60]})"


def _stop_tree(pid: int, keep_group: int | None = None, budget: float = 15.0) -> list[str]:
    """Stop ``dg dev`` and its tree within ``budget`` seconds (6-8 s on a quiet host, its Python exiting after
    "Dagster services shut down"; longer on a loaded one, where cutting it short with SIGTERM kills ``make dev``),
    in the order below. The process group ``keep_group`` (the Spark Connect server ``make dev`` started before it
    became ``dg dev``: a child of it, in a session of its own) is left alone. Returns what had to be SIGKILLed."""

    def tree_of(root: int) -> list[int]:
        found = []
        for child in _descendants(root):
            with contextlib.suppress(ProcessLookupError):  # (ended)
                if keep_group is None or os.getpgid(child) != keep_group:
                    found.append(child)
        return found

    tree = [pid, *tree_of(pid)]
    until = time.monotonic() + budget
    # `dg dev` first, as Ctrl-C stops it (SIGINT): its daemon ends the tick under way (a sensor's tick budget) and
    # requests nothing more, its webserver stops; then the runs, which the code server waits for (an open run would
    # wait for its max_run_secs)
    _signal_and_wait([pid], signal.SIGINT, time.monotonic() + 0.2)
    _signal_and_wait(_with_args(tree, b"dagster._daemon", b"run"), 0, time.monotonic() + budget * 0.6)
    # Dagster's run workers (multiprocessing children of `dagster api grpc`), interrupted as Dagster interrupts a
    # run (SIGINT: a delivery run gives its batches back and ends, not fails)
    _signal_and_wait(_with_args(tree + tree_of(pid), b"multiprocessing.spawn", b"--multiprocessing-fork"),
                     signal.SIGINT, until)
    _signal_and_wait([pid], 0, until)  # (a second SIGINT would cut its shutdown short)
    # what `dg dev` leaves to end by itself, its runs over (a code server ends once its heartbeats stop, up to
    # 45 s later): SIGTERM now (a few seconds for a code server on a loaded host), SIGKILL only for what does not
    _signal_and_wait(tree + tree_of(pid), signal.SIGTERM, max(until, time.monotonic() + 3.0))
    left = _alive(tree + tree_of(pid))
    names = [_name(p) for p in left]
    _signal_and_wait(left, signal.SIGKILL, time.monotonic() + 1.0)
    return names


def _unix_sockets(pids: list[int]) -> set[Path]:
    """The paths of the Unix sockets the processes ``pids`` hold (Dagster's code servers listen on some in
    the temporary directory), from /proc."""
    inodes = socket_inodes(pids)
    try:
        table = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {Path(fields[7]) for fields in (line.split() for line in table)
            if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/")}


def _remove_leftovers(root: Path, sockets: set[Path]) -> None:
    """What the stopped ``dg dev`` left: its sockets still on disk, an empty ``logs/`` in ``root``."""
    import stat
    import tempfile

    temp = Path(tempfile.gettempdir()).resolve()
    for path in sockets:
        with contextlib.suppress(OSError):
            if path.resolve().is_relative_to(temp) and stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
    logs = root / "logs"
    if logs.is_dir() and not any(logs.iterdir()):
        logs.rmdir()


def stop_dev(root: Path) -> list[str]:
    """Stop ``make dev``'s services under ``root``, in order: ``dg dev`` as Ctrl-C does (its runs close first, then the
    daemon, webserver and code server; the exporter exits with it), then the Spark Connect server and the local Postgres
    together; then what ``dg dev`` left (sockets, an empty ``logs/``). Returns what was stopped, one line each."""
    from . import sparkserver
    from .devdb import LocalPostgres

    state = root / ".pgstream"
    stopped: list[str] = []
    dg_pid = _dg_dev_pid(state)
    if dg_pid is not None:
        started = time.monotonic()
        sockets = _unix_sockets([dg_pid, *_descendants(dg_pid)])
        left = _stop_tree(dg_pid, keep_group=sparkserver.recorded_pid(state))
        _remove_leftovers(root, sockets)
        stopped.append(f"stopped dg dev (pid {dg_pid}) and its processes in {time.monotonic() - started:.1f} s"
                       + (f" (killed: {', '.join(left)})" if left else ""))
    (state / "dg-dev.pid").unlink(missing_ok=True)
    # the runs over, nothing uses the Spark Connect server or Postgres any more: both stop at once (a JVM takes
    # a second or two to end)
    spark_pid = sparkserver.recorded_pid(state)
    datadir = state / "data"
    pg_pid = _postgres_pid(datadir)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        spark_stopped = pool.submit(sparkserver.stop_recorded, state)
        if pg_pid is not None:
            LocalPostgres(datadir, 0, {}).stop("fast")
    if spark_stopped.result() and spark_pid is not None:
        stopped.append(f"stopped the Spark Connect server (pid {spark_pid})")
    if pg_pid is not None:
        stopped.append(f"stopped Postgres (pid {pg_pid}, data in {datadir})")
    return stopped


def run_dev(port: int = 3000, root: Path | None = None, spark_server: bool = True) -> int:
    root = (root or Path.cwd()).resolve()
    started = time.monotonic()
    demo = prepare_dev(root, spark_server)
    metrics_url = _start_exporter(Path(os.environ["PGSTREAM_CONFIG"]))
    if demo:
        owner_url = os.environ["PGSTREAM_OWNER_DATABASE_URL"]
        demo_insert = "insert into demo.users (email, email_verified) values ('ada@example.com', true)"
        print("\nTry it: insert a row, then watch the event arrive and the run show in the UI:\n"
              f"  psql '{owner_url}' -c \"{demo_insert}\"   # as the application (demo.users' owner)\n"
              f"  tail -f {os.environ['PGSTREAM_DEMO_SINK']}\n"
              f"  open http://127.0.0.1:{port}\n"
              + (f"  curl -s {metrics_url} | grep pgstream_events_delivered   # Prometheus metrics\n"
                 if metrics_url else ""))
    print("In another shell, `. .pgstream/env` sets the demo's environment (the URLs above) for the commands of "
          "the docs.\n`make stop` (pgstream-dagster dev --stop) stops the demo's services, "
          "`pgstream-dagster dev --status` lists them.")
    print(f"ready in {time.monotonic() - started:.1f} s; starting `dg dev` (the UI answers on "
          f"http://127.0.0.1:{port} once the code location is loaded)", flush=True)
    (root / ".pgstream" / "dg-dev.pid").write_text(str(os.getpid()))  # for dev --status/--stop (execv keeps the pid)
    # `dg dev` (dagster-dg-cli): `dagster dev` is superseded by it and says so at every start
    dg = Path(sys.executable).with_name("dg")
    os.execv(str(dg), [str(dg), "dev", "--workspace", str(root / "workspace.yaml"),
                       "--host", "127.0.0.1", "--port", str(port)])
    return 0  # not reached
