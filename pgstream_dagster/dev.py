"""``make dev``: a working local demo in one command.

Starts (once) a Postgres with ``wal_level=logical`` under ``.pgstream/`` unless
``PGSTREAM_DATABASE_URL`` is set, and a Spark Connect server for the runs unless
``PGSTREAM_SPARK_REMOTE`` is set (``--no-spark-server``: runs start their own Spark); creates the
``pgstream`` and ``dagster`` databases, migrates, creates the demo schema, applies
``pgstream.yaml``, starts the Prometheus exporter (``metrics.enabled``) and runs ``dg dev``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg


def _dagster_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg2://", 1).replace("postgres://", "postgresql+psycopg2://", 1)


def _start_exporter(config: Path) -> str | None:
    """Start ``pgstream-dagster metrics`` beside ``dg dev`` (unless ``metrics.enabled`` is false); it
    ends with ``dg dev`` (same process group for Ctrl-C, and it exits when its parent is gone).
    Returns its URL."""
    from .config import load_metrics_settings

    metrics = load_metrics_settings(config).metrics
    if not metrics.enabled:
        return None
    subprocess.Popen([sys.executable, "-m", "pgstream_dagster.cli", "metrics", "--config", str(config),
                      "--exit-with-parent"])
    host = f"[{metrics.host}]" if ":" in metrics.host else metrics.host
    url = f"http://{host}:{metrics.port}/metrics"
    print(f"Prometheus exporter: {url} (metrics.enabled: false in {config.name} to go without)")
    return url


#: the demo's roles (README, "Security"): the owner (migrate, init), the runtime's login role (the code
#: location, sensors, runs) and the Spark executors' login role
DEMO_OWNER = "pgstream_demo_owner"
DEMO_RUNTIME = "pgstream_demo_runtime"
DEMO_EXECUTOR = "pgstream_demo_executor"


def demo_roles(superuser_url: str, database: str) -> dict[str, str]:
    """As a superuser: the demo's three login roles (owner: no attribute, a member of pgstream_writer;
    runtime: REPLICATION, a member of pgstream_runtime; executor: a member of pgstream_executor), the
    NOLOGIN group roles they join, and ``database`` owned by the owner. Idempotent. Returns each
    role's URL for ``database``."""
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


def run_dev(port: int = 3000, root: Path | None = None, spark_server: bool = True) -> int:
    from .devdb import ensure_running
    from .engine.bootstrap import init
    from .engine.migrations import DRIFT_GUARD_MISSING, drift_guard_installed, install_drift_guard, migrate, sql_dir

    root = (root or Path.cwd()).resolve()
    state = root / ".pgstream"
    state.mkdir(exist_ok=True)
    superuser_url: str | None = None
    if not os.environ.get("PGSTREAM_DATABASE_URL"):
        pg = ensure_running(state / "data")
        pg.create_database("dagster")
        urls = demo_roles(pg.url, "pgstream")
        superuser_url = pg.url_for("pgstream")
        os.environ["PGSTREAM_DATABASE_URL"] = urls["runtime"]
        os.environ["PGSTREAM_OWNER_DATABASE_URL"] = urls["owner"]
        os.environ["PGSTREAM_EXECUTOR_DATABASE_URL"] = urls["executor"]
        os.environ.setdefault("DAGSTER_POSTGRES_URL", _dagster_url(pg.url_for("dagster")))
        print(f"local Postgres (wal_level=logical) in {state / 'data'}; database pgstream:\n"
              f"  owner    (migrate, init; owns demo.users): {urls['owner']}\n"
              f"  runtime  (code location, sensors, runs):   {urls['runtime']}\n"
              f"  executor (Spark executors):                {urls['executor']}")
    if not os.environ.get("DAGSTER_POSTGRES_URL"):
        raise SystemExit("error: set DAGSTER_POSTGRES_URL (a database for Dagster's own storage)")
    url = os.environ["PGSTREAM_DATABASE_URL"]
    owner_url = os.environ.get("PGSTREAM_OWNER_DATABASE_URL") or url
    demo = not os.environ.get("PGSTREAM_CONFIG")
    if demo:
        os.environ["PGSTREAM_CONFIG"] = str(root / "pgstream.yaml")
        os.environ.setdefault("PGSTREAM_DEMO_SINK", str(state / "demo-events.jsonl"))
        migrate(owner_url)
        if superuser_url is not None:
            install_drift_guard(superuser_url)  # the one step that needs a superuser
        with psycopg.connect(owner_url, autocommit=True) as conn:
            conn.execute((sql_dir() / "demo" / "demo_schema.sql").read_text())
            if not drift_guard_installed(conn):
                print(DRIFT_GUARD_MISSING)
    if spark_server and not os.environ.get("PGSTREAM_SPARK_REMOTE"):
        from . import sparkserver

        remote = sparkserver.ensure_running(state, port=int(os.environ.get("PGSTREAM_SPARK_PORT",
                                                                           sparkserver.DEFAULT_PORT)))
        os.environ["PGSTREAM_SPARK_REMOTE"] = remote
        print(f"Spark Connect server for the runs: {remote} (log: {state / 'spark-connect.log'}; "
              "stop it with `pgstream-dagster spark-connect --stop`)")
    for line in init(Path(os.environ["PGSTREAM_CONFIG"]), owner_url=owner_url):
        print(line)
    metrics_url = _start_exporter(Path(os.environ["PGSTREAM_CONFIG"]))

    home = root / ".dagster_home"
    home.mkdir(exist_ok=True)
    shutil.copy(root / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    if demo:
        demo_insert = "insert into demo.users (email, email_verified) values ('ada@example.com', true)"
        print("\nTry it: insert a row, then watch the event arrive and the run show in the UI:\n"
              f"  psql '{owner_url}' -c \"{demo_insert}\"   # as the application (demo.users' owner)\n"
              f"  tail -f {os.environ['PGSTREAM_DEMO_SINK']}\n"
              f"  open http://127.0.0.1:{port}\n"
              + (f"  curl -s {metrics_url} | grep pgstream_events_delivered   # Prometheus metrics\n"
                 if metrics_url else ""))
    # `dg dev` (dagster-dg-cli): `dagster dev` is superseded by it and says so at every start
    dg = Path(sys.executable).with_name("dg")
    os.execv(str(dg), [str(dg), "dev", "--workspace", str(root / "workspace.yaml"),
                       "--host", "127.0.0.1", "--port", str(port)])
    return 0  # not reached
