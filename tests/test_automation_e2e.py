"""End to end with the real daemon: on a fresh install (migrated only, no ``init``) the
``pgstream_subscriptions`` sensor applies the YAML subscriptions by itself (runs of the ``pgstream_subscriptions``
job), and after an edit of pgstream.yaml and a reload of the code location (what a deploy does) applies the edit;
nobody materializes anything by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import httpx
import psycopg
import pytest
from dagster import DagsterRunStatus, RunsFilter

from pgstream_dagster.defs.names import SUBSCRIPTIONS_JOB, SUBSCRIPTIONS_SENSOR
from pgstream_dagster.engine.migrations import migrate

from .support.dagster_dev import (
    READY_TIMEOUT_SECS,
    Databases,
    repo_root,
    start_dagster_dev,
    stop_process_group,
    wait_for,
)
from .support.harness import write_config

RELOAD = """
mutation ($name: String!) {
  reloadRepositoryLocation(repositoryLocationName: $name) {
    __typename
    ... on WorkspaceLocationEntry { locationOrLoadError { __typename } }
  }
}
"""

SUB = {"key": "user-signup", "stream_id": 1, "operation": "INSERT", "schema_name": "public", "table_name": "users",
       "when_clause": "new.verified", "column_names": ["id", "email"]}


def _stored_when(url: str) -> str | None:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("select when_clause from pgstream.subscriptions where key = 'user-signup'").fetchone()
    return row[0] if row else None


def _trigger_oid(url: str) -> int | None:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("select oid::bigint from pg_trigger where tgname = 'pgstream_insert' "
                        "and tgrelid = 'public.users'::regclass").fetchone()
    return row[0] if row else None


def test_daemon_applies_new_and_edited_subscriptions(databases: Databases, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    app = databases.app_url
    migrate(app)
    with psycopg.connect(app, autocommit=True) as conn:
        conn.execute("create table public.users (id serial primary key, email text, verified bool default false)")
    streams = [{"id": 1, "sink": {"type": "file", "path": str(tmp_path / "events.jsonl")}}]
    config_path = write_config(tmp_path / "pgstream.yaml", app, streams, [SUB])

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(repo_root() / "dagster.yaml", home / "dagster.yaml")
    env = {"PGSTREAM_CONFIG": str(config_path), "DAGSTER_HOME": str(home),
           "DAGSTER_POSTGRES_URL": databases.dagster_url, "PYTHONUNBUFFERED": "1"}
    dev = start_dagster_dev(tmp_path, env)
    try:
        def state() -> str:
            return f"stored when_clause {_stored_when(app)!r}, trigger oid {_trigger_oid(app)}"

        # 1. the sensor materializes the new subscription: the trigger appears
        wait_for("the subscriptions sensor to apply the subscription", lambda: _trigger_oid(app) is not None,
                 READY_TIMEOUT_SECS + 120, dev, state)
        assert _stored_when(app) == "new.verified"
        first_oid = _trigger_oid(app)

        # 2. edit the YAML, reload the code location: the edit is applied, its trigger recreated
        write_config(config_path, app, streams, [{**SUB, "when_clause": "new.verified and new.email is not null"}])
        answer = httpx.post(f"http://127.0.0.1:{dev.port}/graphql", timeout=60,
                            json={"query": RELOAD, "variables": {"name": "pgstream"}}).json()
        assert answer["data"]["reloadRepositoryLocation"]["__typename"] == "WorkspaceLocationEntry", answer
        wait_for("the subscriptions sensor to apply the edit",
                 lambda: _stored_when(app) == "new.verified and new.email is not null", 240, dev, state)
        wait_for("the new trigger", lambda: _trigger_oid(app) not in (None, first_oid), 30, dev, state)

        monkeypatch.setenv("DAGSTER_HOME", str(home))
        monkeypatch.setenv("DAGSTER_POSTGRES_URL", databases.dagster_url)
        with dg.DagsterInstance.get() as instance:
            key = dg.AssetKey(["pgstream", "stream_1", "subscriptions", "user_signup_insert_public_users"])

            def materialized() -> int:
                return len(instance.fetch_materializations(key, limit=10).records)

            def applied() -> list[dg.DagsterRun]:
                runs = instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.SUCCESS], job_name=SUBSCRIPTIONS_JOB,
                                                    tags={"dagster/sensor_name": SUBSCRIPTIONS_SENSOR}))
                return [r for r in runs if key in (r.asset_selection or set())]

            # the materialization is recorded a moment before its run finishes
            wait_for("two successful pgstream_subscriptions runs of the subscription", lambda: len(applied()) >= 2, 60,
                     dev, lambda: f"{state()}; runs: {[(r.job_name, r.status, r.tags) for r in instance.get_runs()]}")
            assert materialized() == 2
    finally:
        survivors = stop_process_group(dev.proc)
    assert not survivors, f"processes of `dagster dev` survived SIGKILL: {survivors}"
