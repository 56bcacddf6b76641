"""The lake sinks in a real pipeline (real Postgres with logical replication, the real delivery job
and replay job on a real Dagster instance): a delivery run SIGKILLed right after a lake commit, before
the ledger recorded it, then the runs that follow and a replay of every event leave each event in the
table exactly once, read back with the format's own reader. The table's asset and its check of
per-day counts against pgstream.events."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.config import DIRECT_MAX_EVENTS
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import (
    CHECKS_JOB,
    LAKE_COUNTS_CHECK,
    REPLAY_JOB,
    REPLAY_OP,
    deliveries_asset_key,
    lake_table_asset_key,
)
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine.lakecheck import delivered_day_counts
from pgstream_dagster.sinks import Event, build_sink

from .support.faults import STREAM, drive, sent_ids, stream_config
from .support.harness import Driver, backdated, insert_events, write_config
from .support.lake import LAKE_FORMATS, lake_config, lake_ids

#: the delivery run in a process of its own, SIGKILLed by itself right after its ``KILL_AT``-th lake commit
#: returned: the commit is in the table, the ledger never hears of it
_RUN_SCRIPT = """
import json, os, signal, sys
import dagster as dg
from pgstream_dagster.defs.names import DELIVERY_JOB
from pgstream_dagster.config import DIRECT_MAX_EVENTS
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.sinks.lake import LakeSink
config_path, storage_url, home, request, kill_at = sys.argv[1:6]
request = json.loads(request)
commits = []
real_commit = LakeSink._positioned
def commit_then_die(self, events, positions):
    real_commit(self, events, positions)
    commits.append(len(events))
    if len(commits) == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)
LakeSink._positioned = commit_then_die
with dg.instance_for_test(overrides={"storage": {"postgres": {"postgres_url": storage_url}}}, temp_dir=home) as inst:
    job = build_definitions(__import__("pathlib").Path(config_path)).resolve_job_def(DELIVERY_JOB)
    job.execute_in_process(run_config=request["run_config"], instance=inst, tags=request["tags"],
                           raise_on_error=False)
"""

EVENTS = 300
KILL_AT = 4  # chunks of 20: 80 events committed, the 4th chunk's confirmation never recorded


@pytest.mark.parametrize("kind", LAKE_FORMATS)
def test_a_run_killed_after_a_lake_commit_a_replay_and_the_day_counts_check(
        kind: str, db_url: str, tmp_path: Path, instance: dg.DagsterInstance, dagster_storage_url: str,
        pg: LocalPostgres) -> None:
    sink = lake_config(kind, tmp_path, pg)
    # mode per_batch: the stream's runs are Dagster runs of the delivery job of their own (requested by its
    # group's sensor), one of which the test runs in a process of its own and kills (a stream in mode open is
    # hosted by its group's delivery run, in the test's process); read without Spark, as an open run reads
    config_path = write_config(tmp_path / f"pgstream-{kind}.yaml", db_url, [stream_config(
        sink, delivery={"mode": "per_batch", "tuning": {"direct_max_events": DIRECT_MAX_EVENTS}})])
    defs = build_definitions(config_path)
    spec = defs.resolve_assets_def(lake_table_asset_key(STREAM)).specs_by_key[lake_table_asset_key(STREAM)]
    assert deliveries_asset_key(STREAM) in {dep.asset_key for dep in spec.deps}
    driver = Driver(config_path, instance)
    driver.tick(STREAM)
    with psycopg.connect(db_url, autocommit=True) as conn:  # two days ago, then today
        backdated(conn, "insert into pgstream.events (payload, stream_id, created_at) select "
                        "jsonb_build_object('n', g), %s, now() - interval '2 days' from generate_series(1, 30) g",
                  [STREAM])
    insert_events(db_url, STREAM, EVENTS)
    (request,) = driver.tick(STREAM).run_requests
    home = tmp_path / f"home-{kind}"
    home.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_SCRIPT, str(config_path), dagster_storage_url, str(home),
         json.dumps({"run_config": request.run_config,
                     "tags": {**request.tags, "dagster/run_key": request.run_key}}), str(KILL_AT)],
        env={**os.environ}, start_new_session=True)
    try:
        assert proc.wait(timeout=240) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    before = lake_ids(sink, STREAM)
    assert sum(before.values()) == KILL_AT * 20 and set(before.values()) == {1}
    with psycopg.connect(db_url) as conn:  # the ledger recorded less than the table holds
        row = conn.execute("select coalesce(sum(case when status = 'delivered' then event_count "
                           "else confirmed_count end), 0) from pgstream.batches where stream_id = %s",
                           [STREAM]).fetchone()
    assert row is not None
    recorded = int(row[0])
    assert recorded < KILL_AT * 20
    sent = sent_ids(db_url)
    assert len(sent) == EVENTS + 30
    started = time.monotonic()
    drive(driver, lambda: set(lake_ids(sink, STREAM)) >= set(sent))
    assert lake_ids(sink, STREAM) == Counter({i: 1 for i in sent}), kind
    # the delivery runs after the kill materialized the table with what they wrote
    runs = {result.run_id for result in driver.results}
    written = instance.fetch_materializations(lake_table_asset_key(STREAM), limit=1000).records
    assert sum(int(str(r.asset_materialization.metadata["events"].value)) for r in written
               if r.asset_materialization is not None and r.run_id in runs) == len(sent) - recorded
    # a replay of every event of the stream: the table has them all, nothing is written twice
    replay = defs.resolve_job_def(REPLAY_JOB).execute_in_process(
        run_config={"ops": {REPLAY_OP: {"config": {"stream_id": STREAM, "all_events": True}}}}, instance=instance)
    assert replay.success
    assert lake_ids(sink, STREAM) == Counter({i: 1 for i in sent}), kind
    print(f"LAKE-PIPELINE {kind}: {len(sent)} events once after SIGKILL and replay "
          f"({time.monotonic() - started:.1f}s)")

    # the check: per day, what pgstream.events delivered against the table
    with psycopg.connect(db_url, autocommit=True) as conn:  # what the check reads, as the runtime role
        conn.execute("set role pgstream_runtime")
        owed = delivered_day_counts(conn, STREAM)
    assert sorted(owed.counts.values()) == [30, EVENTS]

    def check() -> dg.AssetCheckEvaluation:
        result = defs.resolve_job_def(CHECKS_JOB).execute_in_process(instance=instance, raise_on_error=False)
        (found,) = [e for e in result.get_asset_check_evaluations() if e.check_name == LAKE_COUNTS_CHECK]
        return found

    passed = check()
    assert passed.passed and passed.metadata["days_compared"].value == 2, passed.description
    # a row the ledger never delivered (written behind pgstream's back), two days ago, inside the
    # compared window (which starts at the stream's oldest event: a fixed time of that day may precede it)
    old_day = min(owed.counts)
    assert owed.since is not None and owed.since.astimezone(dt.UTC).date() == old_day
    with build_sink(sink) as writer:
        writer.publish([Event(10**12, STREAM, {"n": -1}, None, owed.since)])
    failed = check()
    assert not failed.passed
    assert failed.description == f"1 day differs: {old_day}: 30 delivered, 31 in the table"
