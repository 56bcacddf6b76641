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
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dagster as dg
import psycopg
import yaml

from pgstream_dagster.config import load_config
from pgstream_dagster.defs.names import member_tag

from .dagster_dev import repo_root
from .harness import Driver, read_jsonl, replay_through_spark


@contextlib.contextmanager
def _instance() -> Iterator[dg.DagsterInstance]:
    """A Dagster instance on the repository's Postgres storage at ``$PGSTREAM_TEST_DAGSTER_STORAGE`` (the group
    delivery runs write to it from threads of their own, which an in-memory instance does not take)."""
    storage = yaml.safe_load((repo_root() / "dagster.yaml").read_text())["storage"]
    for kind in storage.values():
        (kind.get("config", kind))["postgres_url"] = os.environ["PGSTREAM_TEST_DAGSTER_STORAGE"]
    with tempfile.TemporaryDirectory() as home, dg.instance_for_test(overrides={"storage": storage},
                                                                      temp_dir=home) as instance:
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


class Members:
    """Each member run of stream 1 the group delivery runs hosted (its run key) and its last state, in order:
    what the group runs' member tags say (a group run's tag holds its latest one), looked at before each tick,
    the only thing that requests the next."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.states: dict[str, str] = {}

    def look(self) -> None:
        for background in self.driver.group_runs.get(self.driver.group_of(1), []):  # in launch order
            run = self.driver.instance.get_run_by_id(background.run_id or "")
            raw = run.tags.get(member_tag(1)) if run is not None else None
            if raw:
                member = json.loads(raw)
                self.states[member["run_key"]] = member["state"]

    def succeeded(self) -> list[bool]:
        return [state == "ended" for state in self.states.values()]


def drive(driver: Driver, members: Members, done: Callable[[], bool], what: Callable[[], str]) -> None:
    """Tick stream 1's group (executing what it requests of its own) until ``done()``, then end the group runs
    (each member run ends: its state is its last)."""
    deadline = time.monotonic() + 300
    while not done():
        assert time.monotonic() < deadline, f"not done in time: {what()}"
        members.look()
        for request in driver.tick(1).run_requests or []:
            driver.execute(request)
        time.sleep(0.05)
    driver.stop_group_runs("done")
    members.look()


def by_key(config: Path, expected: int, out: Path) -> None:
    with _instance() as instance:
        driver = Driver(config, instance)
        members = Members(driver)
        drive(driver, members, lambda: delivered_events(config) == (expected, False),
              lambda: str(delivered_events(config)))
        rounds = [[e.event_specific_data.materialization.metadata["events"].value  # type: ignore[union-attr]
                   for e in r.all_events if e.event_type_value == "ASSET_MATERIALIZATION"] for r in driver.results]
        out.write_text(json.dumps({"runs": members.succeeded(), "rounds": rounds, "members": members.states}))


def main() -> None:
    config, expected = Path(sys.argv[1]), int(sys.argv[2])
    out = Path(str(config) + ".out")
    if sys.argv[3:] == ["by_key"]:
        by_key(config, expected, out)
        return
    with _instance() as instance:
        driver = Driver(config, instance)
        members = Members(driver)
        sink = Path(json.loads(Path(str(config) + ".sink").read_text()))
        drive(driver, members, lambda: len(read_jsonl(sink)) >= expected,
              lambda: f"{len(read_jsonl(sink))} events in the sink")
        replayed, ids = replay_through_spark(config, 1, instance)
        out.write_text(json.dumps({"runs": members.succeeded() + [r.success for r in driver.results],
                                   "replay": replayed, "replayed": ids}))


if __name__ == "__main__":
    main()
