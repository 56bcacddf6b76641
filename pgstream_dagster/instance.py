"""Dagster instance plug-ins, configured in ``dagster.yaml`` (docs/operations.md describes both).

:class:`PooledPostgresStorage` is ``dagster_postgres.DagsterPostgresStorage`` whose three storages (runs, event
log, schedules) each keep a small pool of connections in every process: dagster-postgres opens one for every
storage call outside the webserver (SQLAlchemy ``NullPool``), which at 100 streams cost Postgres more CPU than
the events' own statements (``bench/streams.py``). A pooled connection is checked before each use (a restarted
Postgres costs one failed ping, not an error); the webserver keeps its own pool, as with dagster-postgres. The URL
may be ``postgresql://``, ``postgres://`` or ``postgresql+psycopg2://``: all run on psycopg2, which
dagster-postgres' statements need (on psycopg 3, SQLAlchemy 2.1's default for ``postgresql://``, every event write
fails on its ``NOTIFY``); any other driver is refused when the instance loads.

:class:`FileComputeLogManager` keeps each run's stdout and stderr in files for the UI, as Dagster's local compute
log manager does, without also copying them to the run process's own output (Dagster's ``tail -F`` and Python
watcher for each: four processes a run).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import dagster as dg
from dagster._core.execution.compute_logs import redirect_to_file
from dagster._core.instance.ref import compute_logs_directory
from dagster._core.storage.compute_log_manager import CapturedLogContext, ComputeIOType
from dagster._core.storage.local_compute_log_manager import IO_TYPE_EXTENSION, LocalComputeLogManager
from dagster._serdes import ConfigurableClassData
from dagster._utils import ensure_file, touch_file
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.utils import (
    create_pg_engine,
    get_token_provider_from_config,
    pg_config,
    pg_url_from_config,
)

from .sinks.base import psycopg2_url

#: idle connections each storage keeps per process, unless configured
DEFAULT_POOL_SIZE = 1
#: connections opened beyond the pool when threads of one process use a storage at once (closed after use);
#: -1: no bound, as without a pool (a bound would make the daemon's threads wait for each other)
DEFAULT_MAX_OVERFLOW = -1
#: a pooled connection older than this is closed and replaced at its next use
DEFAULT_POOL_RECYCLE_SECS = 3600


class PooledPostgresStorage(DagsterPostgresStorage):
    """``DagsterPostgresStorage`` whose storages keep a small connection pool in each process."""

    def __init__(self, postgres_url: str, should_autocreate_tables: bool = True,
                 inst_data: ConfigurableClassData | None = None, pool_size: int = DEFAULT_POOL_SIZE,
                 max_overflow: int = DEFAULT_MAX_OVERFLOW,
                 pool_recycle_secs: int = DEFAULT_POOL_RECYCLE_SECS, token_provider: Any = None) -> None:
        try:  # on psycopg2; another driver: one line saying what to write (no password)
            postgres_url = psycopg2_url(postgres_url)
        except ValueError as exc:
            raise dg.DagsterInvariantViolationError(
                f"Dagster storage postgres_url (DAGSTER_POSTGRES_URL) {exc}") from None
        super().__init__(postgres_url, should_autocreate_tables, inst_data, token_provider)
        for storage in (self._run_storage, self._event_log_storage, self._schedule_storage):
            storage._engine.dispose()  # (the NullPool engine holds no connection: nothing is closed)
            storage._engine = create_pg_engine(
                postgres_url, token_provider, isolation_level="AUTOCOMMIT", pool_size=pool_size,
                max_overflow=max_overflow, pool_recycle=pool_recycle_secs, pool_pre_ping=True)

    @classmethod
    def config_type(cls) -> dg.Shape:
        return dg.Shape({  # type: ignore[no-untyped-call]
            **cast("dict[str, dg.Field]", pg_config()),
            "pool_size": dg.Field(dg.IntSource, is_required=False, default_value=DEFAULT_POOL_SIZE,
                                  description="idle connections each storage keeps per process"),
            "max_overflow": dg.Field(dg.IntSource, is_required=False, default_value=DEFAULT_MAX_OVERFLOW,
                                     description="connections opened beyond the pool by concurrent threads "
                                                 "(-1: no bound)"),
            "pool_recycle_secs": dg.Field(dg.IntSource, is_required=False, default_value=DEFAULT_POOL_RECYCLE_SECS,
                                          description="a pooled connection older than this is replaced"),
        })

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None,
                          config_value: Mapping[str, Any]) -> PooledPostgresStorage:
        pool = {key: config_value[key] for key in ("pool_size", "max_overflow", "pool_recycle_secs")
                if key in config_value}
        return cls(pg_url_from_config(config_value), config_value.get("should_autocreate_tables", True), inst_data,
                   token_provider=get_token_provider_from_config(config_value), **pool)


class FileComputeLogManager(LocalComputeLogManager):
    """Dagster's ``LocalComputeLogManager`` without the copy to the run's own output. Without ``base_dir``: the
    instance's ``storage`` directory, as Dagster's default (a run launched from another process's instance gets
    that instance's, whatever its own environment)."""

    def __init__(self, base_dir: str | None = None, polling_timeout: float | None = None,
                 inst_data: ConfigurableClassData | None = None) -> None:
        super().__init__(base_dir or "", polling_timeout, inst_data=inst_data)

    def register_instance(self, instance: dg.DagsterInstance) -> None:
        super().register_instance(instance)
        if not self._base_dir:  # (none configured)
            self._base_dir = compute_logs_directory(instance.root_directory)

    @classmethod
    def config_type(cls) -> dict[str, dg.Field]:
        return {"base_dir": dg.Field(dg.StringSource, is_required=False,
                                     description="where the files go (default: the instance's storage directory)"),
                "polling_timeout": dg.Field(dg.Float, is_required=False)}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None,
                          config_value: Mapping[str, Any]) -> FileComputeLogManager:
        return cls(config_value.get("base_dir"), config_value.get("polling_timeout"), inst_data=inst_data)

    @contextmanager
    def capture_logs(self, log_key: Sequence[str]) -> Iterator[CapturedLogContext]:
        out, err = (ensure_file(self.get_captured_local_path(log_key, IO_TYPE_EXTENSION[io]))
                    for io in (ComputeIOType.STDOUT, ComputeIOType.STDERR))
        with redirect_to_file(sys.stdout, out), redirect_to_file(sys.stderr, err):
            yield CapturedLogContext(log_key)
        touch_file(self.complete_artifact_path(log_key))  # type: ignore[no-untyped-call]  # (the capture ended)
