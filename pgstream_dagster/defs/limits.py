"""The Dagster limits a stream can wait on: the instance's ``max_concurrent_runs`` (its run
coordinator's run queue), the queue's limit on the group delivery runs and the connections its storage keeps on
a Postgres server, checked against the streams by :mod:`~..engine.limits`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg

from ..config import StreamConfig
from ..engine.limits import DagsterStorage, TagRunLimit, group_run_problem
from ..instance import PooledPostgresStorage
from .names import GROUP_TAG

#: the Dagster processes besides the runs: webserver, daemon, code server
_DAGSTER_PROCESSES = 3


def max_concurrent_runs(instance: dg.DagsterInstance) -> int | None:
    """The instance's ``max_concurrent_runs``; ``None`` when its run coordinator queues nothing
    (runs launch at once) or sets no limit."""
    queue = instance.get_concurrency_config().run_queue_config
    if queue is None or queue.max_concurrent_runs < 0:
        return None
    return int(queue.max_concurrent_runs)


def group_run_limit(instance: dg.DagsterInstance) -> TagRunLimit | None:
    """The instance's run queue's strictest limit on the group delivery runs (run tag :data:`~.names.GROUP_TAG`:
    per group, or for every group together; a limit on one value of it, one group's, is left out). ``None``: none."""
    queue = instance.get_concurrency_config().run_queue_config
    limits = []
    for entry in (queue.tag_concurrency_limits if queue else None) or []:
        value = entry.get("value")
        if entry.get("key") != GROUP_TAG or isinstance(value, str):
            continue
        per_value = isinstance(value, dict) and bool(value.get("applyLimitPerUniqueValue"))
        limits.append(TagRunLimit(GROUP_TAG, int(entry["limit"]), per_value))
    return min(limits, key=lambda limit: (limit.per_value, limit.limit), default=None)


def hand_over_blocked(instance: dg.DagsterInstance, streams: Sequence[StreamConfig]) -> str | None:
    """The line saying that the run queue lets no successor of the group delivery run of ``streams`` (one reader
    group) start beside it, as preflight says it (:func:`~..engine.limits.group_run_problem`); ``None``: it lets one."""
    return group_run_problem(group_run_limit(instance), streams, "dagster.yaml")


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
