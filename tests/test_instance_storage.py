"""Dagster's instance storage as the repository's dagster.yaml configures it (pgstream_dagster/instance.py):
dagster-postgres' storage with a connection pool in each process. Without it every event written and
every read opened a Postgres connection of its own (a backend started for one statement)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

import dagster as dg
import psycopg
import pytest
import sqlalchemy
import yaml
from dagster._core.events import DagsterEvent, DagsterEventType, EngineEventData
from dagster._core.events.log import EventLogEntry

from pgstream_dagster.instance import PooledPostgresStorage

from .conftest import storage_overrides
from .support.dagster_dev import repo_root


@pytest.fixture
def pooled(dagster_storage_url: str, tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(overrides=storage_overrides(dagster_storage_url), temp_dir=str(tmp_path / "home")) as i:
        yield i


def _engines(instance: dg.DagsterInstance) -> list[sqlalchemy.engine.Engine]:
    data = instance.get_ref().storage_data  # the composite storage dagster.yaml configures
    assert data is not None and (data.module_name, data.class_name) == (PooledPostgresStorage.__module__,
                                                                       PooledPostgresStorage.__name__)
    return [cast(Any, s)._engine for s in (instance._run_storage, instance._event_storage,
                                           instance._schedule_storage)]


def _count_connects(engines: list[sqlalchemy.engine.Engine]) -> list[int]:
    opened = [0]

    def on_connect(*_: object) -> None:
        opened[0] += 1

    for engine in engines:
        sqlalchemy.event.listen(engine, "connect", on_connect)
    return opened


def _write_events(instance: dg.DagsterInstance, run_id: str, n: int) -> None:
    for i in range(n):
        instance.store_event(EventLogEntry(  # type: ignore[no-untyped-call]
            error_info=None, level="INFO", user_message="", run_id=run_id, timestamp=float(i + 1),
            dagster_event=DagsterEvent(DagsterEventType.ENGINE_EVENT.value, "test_job", message=f"event {i}",
                                       event_specific_data=EngineEventData())))


def test_the_repository_configures_pooled_postgres_storage() -> None:
    config = yaml.safe_load((repo_root() / "dagster.yaml").read_text())["storage"]
    assert config["custom"]["module"] == "pgstream_dagster.instance"
    assert config["custom"]["class"] == "PooledPostgresStorage"
    assert config["custom"]["config"]["postgres_url"] == {"env": "DAGSTER_POSTGRES_URL"}


def test_writes_and_reads_reuse_a_pooled_connection(pooled: dg.DagsterInstance) -> None:
    engines = _engines(pooled)
    assert all(e.pool.size() == 1 for e in engines)  # type: ignore[attr-defined]
    opened = _count_connects(engines)
    run = pooled.create_run_for_job(dg.GraphDefinition("test_job").to_job())
    _write_events(pooled, run.run_id, 100)
    assert len(pooled.all_logs(run.run_id)) >= 100
    assert pooled.get_runs_count(dg.RunsFilter(run_ids=[run.run_id])) == 1
    # a hundred writes and the reads through at most one connection per storage (NullPool: one per call)
    assert opened[0] <= 3, opened[0]


def test_a_pooled_connection_postgres_ended_is_replaced_without_an_error(pooled: dg.DagsterInstance,
                                                                        dagster_storage_url: str) -> None:
    run = pooled.create_run_for_job(dg.GraphDefinition("test_job").to_job())
    _write_events(pooled, run.run_id, 3)
    url = dagster_storage_url.replace("postgresql+psycopg2://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as admin:  # the storage's idle connections end (a restart, a kill)
        ended = admin.execute("select count(pg_catalog.pg_terminate_backend(pid)) from pg_catalog.pg_stat_activity "
                              "where datname = pg_catalog.current_database() and pid <> pg_catalog.pg_backend_pid() "
                              "and state = 'idle'").fetchone()
    assert ended and ended[0] >= 1
    _write_events(pooled, run.run_id, 3)  # checked before use: replaced, nothing raised
    assert len([e for e in pooled.all_logs(run.run_id) if e.dagster_event]) == 6


def test_the_webserver_keeps_its_own_pool(pooled: dg.DagsterInstance) -> None:
    pooled.optimize_for_webserver(statement_timeout=5000, pool_recycle=3600, max_overflow=20)
    for engine in _engines(pooled):
        with engine.connect() as conn:
            assert conn.exec_driver_sql("show statement_timeout").scalar() == "5s"


@dg.op
def _one() -> int:
    return 1


@dg.job
def _one_op_job() -> None:
    _one()


def _env_instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  url: str) -> AbstractContextManager[dg.DagsterInstance]:
    """An instance with the repository's dagster.yaml storage as is: its URL from DAGSTER_POSTGRES_URL."""
    monkeypatch.setenv("DAGSTER_POSTGRES_URL", url)
    storage = yaml.safe_load((repo_root() / "dagster.yaml").read_text())["storage"]
    (tmp_path / "env-home").mkdir()
    return dg.instance_for_test(overrides={"storage": storage}, temp_dir=str(tmp_path / "env-home"))


@pytest.mark.parametrize("scheme", ["postgresql://", "postgres://"])
def test_a_plain_postgres_url_writes_and_reads_a_runs_events(dagster_storage_url: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    plain = dagster_storage_url.replace("postgresql+psycopg2://", scheme)
    assert plain != dagster_storage_url
    with _env_instance(tmp_path, monkeypatch, plain) as instance:
        result = _one_op_job.execute_in_process(instance=instance)  # a run: its events written as it goes
        assert result.success
        _write_events(instance, result.run_id, 2)
        kinds = [e.dagster_event.event_type for e in instance.all_logs(result.run_id) if e.dagster_event]
        assert DagsterEventType.RUN_SUCCESS in kinds and kinds.count(DagsterEventType.ENGINE_EVENT) >= 2
        run = instance.get_run_by_id(result.run_id)
        assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
        assert {e.url.drivername for e in _engines(instance)} == {"postgresql+psycopg2"}


@pytest.mark.parametrize(("url", "named"), [("postgresql+psycopg://app:s3cr%40t@127.0.0.1:9/dagster", "postgresql+psycopg://"),
                                             ("postgresql+asyncpg://app:s3cr%40t@127.0.0.1:9/dagster", "postgresql+asyncpg://"),
                                             ("mysql://app:s3cr%40t@127.0.0.1:9/dagster", "mysql://"),
                                             ("app:s3cr%40t@127.0.0.1:9/dagster", "not a URL")])
def test_another_driver_is_refused_at_load_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       url: str, named: str) -> None:
    with pytest.raises(dg.DagsterInvariantViolationError) as refused, _env_instance(tmp_path, monkeypatch, url):
        pass
    message = str(refused.value)
    assert "\n" not in message and "s3cr" not in message, message
    assert message.startswith("Dagster storage postgres_url (DAGSTER_POSTGRES_URL) must be a "
                              "postgresql+psycopg2:// URL"), message
    assert message.endswith(f"not {named}"), message
