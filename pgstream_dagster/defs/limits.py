"""The Dagster limit a stream can wait on: the instance's ``max_concurrent_runs`` (its run
coordinator's run queue), checked against the streams by :mod:`~..engine.limits`."""

from __future__ import annotations

import dagster as dg


def max_concurrent_runs(instance: dg.DagsterInstance) -> int | None:
    """The instance's ``max_concurrent_runs``; ``None`` when its run coordinator queues nothing
    (runs launch at once) or sets no limit."""
    queue = instance.get_concurrency_config().run_queue_config
    if queue is None or queue.max_concurrent_runs < 0:
        return None
    return int(queue.max_concurrent_runs)
