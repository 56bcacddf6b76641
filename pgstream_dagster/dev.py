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


def run_dev(port: int = 3000, root: Path | None = None, spark_server: bool = True) -> int:
    from .devdb import ensure_running
    from .engine.bootstrap import init
    from .engine.migrations import migrate, sql_dir

    root = (root or Path.cwd()).resolve()
    state = root / ".pgstream"
    state.mkdir(exist_ok=True)
    if not os.environ.get("PGSTREAM_DATABASE_URL"):
        pg = ensure_running(state / "data")
        pg.create_database("pgstream")
        pg.create_database("dagster")
        os.environ["PGSTREAM_DATABASE_URL"] = pg.url_for("pgstream")
        os.environ.setdefault("DAGSTER_POSTGRES_URL", _dagster_url(pg.url_for("dagster")))
        print(f"local Postgres (wal_level=logical) in {state / 'data'}: {pg.url_for('pgstream')}")
    if not os.environ.get("DAGSTER_POSTGRES_URL"):
        raise SystemExit("error: set DAGSTER_POSTGRES_URL (a database for Dagster's own storage)")
    url = os.environ["PGSTREAM_DATABASE_URL"]
    demo = not os.environ.get("PGSTREAM_CONFIG")
    if demo:
        os.environ["PGSTREAM_CONFIG"] = str(root / "pgstream.yaml")
        os.environ.setdefault("PGSTREAM_DEMO_SINK", str(state / "demo-events.jsonl"))
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute((sql_dir() / "demo" / "demo_schema.sql").read_text())
    if spark_server and not os.environ.get("PGSTREAM_SPARK_REMOTE"):
        from . import sparkserver

        remote = sparkserver.ensure_running(state, port=int(os.environ.get("PGSTREAM_SPARK_PORT",
                                                                           sparkserver.DEFAULT_PORT)))
        os.environ["PGSTREAM_SPARK_REMOTE"] = remote
        print(f"Spark Connect server for the runs: {remote} (log: {state / 'spark-connect.log'}; "
              "stop it with `pgstream-dagster spark-connect --stop`)")
    for line in init(Path(os.environ["PGSTREAM_CONFIG"])):
        print(line)
    metrics_url = _start_exporter(Path(os.environ["PGSTREAM_CONFIG"]))

    home = root / ".dagster_home"
    home.mkdir(exist_ok=True)
    shutil.copy(root / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    if demo:
        demo_insert = "insert into demo.users (email, email_verified) values ('ada@example.com', true)"
        print("\nTry it: insert a row, then watch the event arrive and the run show in the UI:\n"
              f"  psql '{url}' -c \"{demo_insert}\"\n"
              f"  tail -f {os.environ['PGSTREAM_DEMO_SINK']}\n"
              f"  open http://127.0.0.1:{port}\n"
              + (f"  curl -s {metrics_url} | grep pgstream_events_delivered   # Prometheus metrics\n"
                 if metrics_url else ""))
    # `dg dev` (dagster-dg-cli): `dagster dev` is superseded by it and says so at every start
    dg = Path(sys.executable).with_name("dg")
    os.execv(str(dg), [str(dg), "dev", "--workspace", str(root / "workspace.yaml"),
                       "--host", "127.0.0.1", "--port", str(port)])
    return 0  # not reached
