"""Child process of tests/test_spark_connect.py: drives a stream and a replay whose runs use a Spark
Connect server. A process of its own because PySpark switches a whole process to Connect mode
(``SPARK_CONNECT_MODE_ENABLED``), which would leak into the classic-Spark tests of the session.

Usage: python -m tests.support.spark_connect_child CONFIG EXPECTED_EVENTS [by_key]

``by_key``: ticks (the group delivery run hosting the stream's runs in the background: failed member runs
included, failover, probe, catch-up) until the ledger has ``EXPECTED_EVENTS`` events delivered and the stream
is out of failover, then ends the group runs; writes whether each member run of the stream succeeded, in order
(from the group runs' member tags), and the events of each group run's materializations (no replay).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psycopg

from pgstream_dagster.config import load_config

from .dagster_instance import child_instance
from .harness import Driver, read_jsonl, replay_through_spark
from .members import MemberRuns, drive, end


@contextlib.contextmanager
def _instance() -> Iterator[dg.DagsterInstance]:
    """The Dagster storage at ``$PGSTREAM_TEST_DAGSTER_STORAGE`` (the group delivery runs write to it from
    threads of their own, which an in-memory instance does not take)."""
    with tempfile.TemporaryDirectory() as tmp, child_instance(os.environ["PGSTREAM_TEST_DAGSTER_STORAGE"],
                                                              Path(tmp)) as instance:
        yield instance


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
    with _instance() as instance:
        driver = Driver(config, instance)
        members = MemberRuns(driver, 1)
        drive(driver, members, lambda: delivered_events(config) == (expected, False))
        end(driver, members)
        rounds = [[e.event_specific_data.materialization.metadata["events"].value  # type: ignore[union-attr]
                   for e in r.all_events if e.event_type_value == "ASSET_MATERIALIZATION"] for r in driver.results]
        out.write_text(json.dumps({"runs": members.outcomes(), "rounds": rounds,
                                   "members": list(members.seen.values())}))


def main() -> None:
    # PySpark's Spark Connect logging, imported here first: its import swaps logging's logger class for a moment
    # (PySparkLogger.getLogger), and imported by a group run's member thread it raced with the tick's Dagster
    # logger in this thread (TypeError: PySparkLogger.__init__() got an unexpected keyword argument 'level')
    import pyspark.sql.connect.logging  # noqa: F401

    config, expected = Path(sys.argv[1]), int(sys.argv[2])
    out = Path(str(config) + ".out")
    if sys.argv[3:] == ["by_key"]:
        by_key(config, expected, out)
        return
    with _instance() as instance:
        driver = Driver(config, instance)
        members = MemberRuns(driver, 1)
        sink = Path(json.loads(Path(str(config) + ".sink").read_text()))
        drive(driver, members, lambda: len(read_jsonl(sink)) >= expected)
        end(driver, members)
        replayed, ids = replay_through_spark(config, 1, instance)
        # (each member run's state and error: what a failed assertion on "runs" prints first)
        out.write_text(json.dumps({"runs": members.outcomes() + [r.success for r in driver.results],
                                   "members": list(members.seen.values()), "replay": replayed, "replayed": ids}))


if __name__ == "__main__":
    main()
