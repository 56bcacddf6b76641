"""The Dagster limits a stream can wait on: the instance's ``max_concurrent_runs`` (its run
coordinator's run queue) and the connections its storage keeps on a Postgres server, checked against
the streams by :mod:`~..engine.limits`."""

from __future__ import annotations

from typing import Any

import dagster as dg

from ..engine.limits import DagsterStorage
from ..instance import PooledPostgresStorage

#: the Dagster processes besides the runs: webserver, daemon, code server
_DAGSTER_PROCESSES = 3


def max_concurrent_runs(instance: dg.DagsterInstance) -> int | None:
    """The instance's ``max_concurrent_runs``; ``None`` when its run coordinator queues nothing
    (runs launch at once) or sets no limit."""
    queue = instance.get_concurrency_config().run_queue_config
    if queue is None or queue.max_concurrent_runs < 0:
        return None
    return int(queue.max_concurrent_runs)


def tag_run_limit(instance: dg.DagsterInstance, key: str) -> int | None:
    """How many runs at once the instance's run queue allows per value of run tag ``key`` (``None``: no limit)."""
    queue = instance.get_concurrency_config().run_queue_config
    limits = [int(entry["limit"]) for entry in (queue.tag_concurrency_limits if queue else None) or []
              if entry.get("key") == key]
    return min(limits) if limits else None


def storage_connections(instance: dg.DagsterInstance, max_runs: int | None) -> DagsterStorage | None:
    """Where the instance's storage keeps connections and how many at most, idle (``None``: it keeps none,
    as dagster-postgres' own storage): its three storages' pools in the webserver, the daemon, the code
    server and each of ``max_runs`` runs."""
    data = instance.get_ref().storage_data
    if data is None or (data.module_name, data.class_name) != (PooledPostgresStorage.__module__,
                                                               PooledPostgresStorage.__name__):
        return None
    engine: Any = getattr(instance.run_storage, "_engine", None)
    if engine is None:
        return None
    per_process = 3 * int(engine.pool.size())
    return DagsterStorage(host=engine.url.host or "", port=int(engine.url.port or 5432),
                          connections=per_process * (_DAGSTER_PROCESSES + (max_runs or 0)))
