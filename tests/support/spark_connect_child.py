"""Child process of tests/test_spark_connect.py: drives a stream and a replay whose runs use a Spark
Connect server. A process of its own because PySpark switches a whole process to Connect mode
(``SPARK_CONNECT_MODE_ENABLED``), which would leak into the classic-Spark tests of the session.

Usage: python -m tests.support.spark_connect_child CONFIG EXPECTED_EVENTS [by_key]

``by_key``: ticks and executes (failed runs included: failover, probe, catch-up) until the ledger
has ``EXPECTED_EVENTS`` events delivered and the stream is out of failover; writes each run's
success and the events of its materializations (no replay).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import dagster as dg
import psycopg

from pgstream_dagster.config import load_config

from .harness import Driver, read_jsonl, replay_through_spark


def delivered_events(config: Path) -> tuple[int, bool]:
    """Events in delivered batches of stream 1, and whether the stream is in failover."""
    url = load_config(config).database_url.get_secret_value()
    with psycopg.connect(url) as c:
        row = c.execute("select (select coalesce(sum(event_count), 0) from pgstream.batches "
                        "where stream_id = 1 and status = 'delivered'), "
                        "(select failover_since is not null from pgstream.streams where id = 1)").fetchone()
    assert row is not None
    return int(row[0]), bool(row[1])


def by_key(config: Path, expected: int, out: Path) -> None:
    with dg.DagsterInstance.ephemeral() as instance:
        driver = Driver(config, instance)
        deadline = time.monotonic() + 300
        while (state := delivered_events(config)) != (expected, False):
            assert time.monotonic() < deadline, f"not delivered in time: {state}"
            for request in driver.tick(1).run_requests or []:
                driver.execute(request)
            time.sleep(0.05)
        rounds = [[e.event_specific_data.materialization.metadata["events"].value  # type: ignore[union-attr]
                   for e in r.all_events if e.event_type_value == "ASSET_MATERIALIZATION"] for r in driver.results]
        out.write_text(json.dumps({"runs": [r.success for r in driver.results], "rounds": rounds}))


def main() -> None:
    config, expected = Path(sys.argv[1]), int(sys.argv[2])
    out = Path(str(config) + ".out")
    if sys.argv[3:] == ["by_key"]:
        by_key(config, expected, out)
        return
    with dg.DagsterInstance.ephemeral() as instance:
        driver = Driver(config, instance)
        sink = Path(json.loads(Path(str(config) + ".sink").read_text()))
        driver.run_until(1, lambda: len(read_jsonl(sink)) >= expected, timeout=300)
        replayed, ids = replay_through_spark(config, 1, instance)
        out.write_text(json.dumps({"runs": [r.success for r in driver.results], "replay": replayed,
                                   "replayed": ids}))


if __name__ == "__main__":
    main()
