"""A real Dagster instance with Postgres storage of its own (one database per test), and helpers to
run asset jobs and read what they reported."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
from psycopg import sql

from pgstream_dagster.devdb import LocalPostgres


@contextmanager
def postgres_instance(pg: LocalPostgres, tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    name = f"dagster_{uuid.uuid4().hex[:10]}"
    pg.create_database(name)
    # SQLAlchemy 2.1 defaults to psycopg 3 for postgresql://; Dagster's storage wants psycopg2
    url = pg.url_for(name).replace("postgresql://", "postgresql+psycopg2://", 1)
    home = tmp_path / f"dagster_home_{name}"
    home.mkdir()
    try:
        with dg.instance_for_test(overrides={"storage": {"postgres": {"postgres_url": url}}},
                                  temp_dir=str(home)) as instance:
            yield instance
    finally:
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


@contextmanager
def child_instance(storage_url: str, tmp: Path) -> Iterator[dg.DagsterInstance]:
    """The Dagster instance of a test child process: runs and events in the test's Postgres storage
    (``storage_url``), its home in ``tmp/dagster_home``."""
    home = tmp / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(overrides={"storage": {"postgres": {"postgres_url": storage_url}}},
                              temp_dir=str(home)) as instance:
        yield instance


def materialize(defs: dg.Definitions, instance: dg.DagsterInstance, keys: list[dg.AssetKey],
                run_config: dict[str, Any] | None = None) -> dg.ExecuteInProcessResult:
    """Materialize ``keys`` (and run their checks) the way a run launched from the catalog would: the
    location's implicit asset job, a real instance."""
    job = defs.resolve_implicit_global_asset_job_def()
    return job.execute_in_process(instance=instance, asset_selection=keys, run_config=run_config or {},
                                  raise_on_error=False)


def materializations(result: dg.ExecuteInProcessResult) -> dict[dg.AssetKey, dict[str, Any]]:
    """Metadata values of every materialization in the run, by asset key."""
    out: dict[dg.AssetKey, dict[str, Any]] = {}
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        assert mat is not None
        out[mat.asset_key] = {k: v.value for k, v in mat.metadata.items()}
    return out


def step_failure(result: dg.ExecuteInProcessResult) -> str:
    """The messages of the run's failed steps."""
    return "\n".join(e.step_failure_data.error.message for e in result.all_events
                     if e.is_step_failure and e.step_failure_data.error is not None)


def run_log(instance: dg.DagsterInstance, result: dg.ExecuteInProcessResult) -> str:
    """Everything the run logged, failures' error messages included."""
    lines = []
    for entry in instance.all_logs(result.run_id):
        lines.append(entry.user_message)
        event = entry.dagster_event
        if event is not None and event.is_step_failure and event.step_failure_data.error:
            lines.append(event.step_failure_data.error.to_string())
    return "\n".join(lines)
