"""Child process of tests/test_spark_cluster.py: drives delivery (global order and ``by_key``, with
an injected sink failure), a replay and a backfill whose runs use a standalone Spark cluster
(``spark.master: spark://...``), against a real Dagster instance, and writes what it saw as JSON
for the test to check. A process of its own: one JVM per process, and the session's other tests
already hold a local Spark (``getOrCreate`` would hand that one back).

Usage: python -m tests.support.spark_cluster_child SPEC_JSON   (keys: see ``main``)
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import BACKFILL_JOB, BACKFILL_OP

from .dagster_instance import child_instance
from .endpoint import Endpoint
from .harness import Driver, insert_events, read_jsonl, replay_through_spark, write_config
from .members import MemberRuns, drive, end
from .spark_cluster import executor_origins

GLOBAL, BY_KEY = 1, 2


def _apps(webui: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{webui}/json/", timeout=5) as resp:
        state = json.loads(resp.read())
    return [{"name": a["name"], "cores": a["cores"]} for a in state.get("activeapps", [])]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    tmp = Path(spec["tmp"])
    db_url: str = spec["db_url"]
    out = tmp / "global.jsonl"
    endpoint = Endpoint()
    cfg = write_config(tmp / "pgstream.yaml", db_url, [
        {"id": GLOBAL, "batch": {"max_size": 400, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         # every round through Spark (by default the run reads rounds of global order itself)
         "delivery": {"chunk_size": 100, "mode": "open",
                      "tuning": {"rows_per_partition": 300, "direct_max_events": 0, "max_run_secs": 600}},
         "sink": {"type": "file", "path": str(out)}},
        {"id": BY_KEY, "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         # (one group run throughout: stream 2's first member run is the open run its batches are handed to)
         "delivery": {"ordering": "by_key", "routing_key": "group_id", "parallelism": 2, "chunk_size": 10,
                      "mode": "open", "tuning": {"max_run_secs": 600}},
         "retry": {"initial_backoff_secs": 0, "max_backoff_secs": 0},
         "sink": endpoint.sink()}],
        spark={"master": spec["master"], "conf": spec["conf"]})
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1), pgstream.ensure_stream(2)")
    result: dict[str, Any] = {}
    with child_instance(spec["dagster_storage_url"], tmp) as instance:
        # both streams name no reader: their runs are member runs of group default's delivery run
        driver = Driver(cfg, instance)
        global_runs, by_key_runs = MemberRuns(driver, GLOBAL), MemberRuns(driver, BY_KEY)
        driver.tick(GLOBAL)

        # global order: 1,500 events in two transactions
        insert_events(db_url, GLOBAL, 1000)
        insert_events(db_url, GLOBAL, 500, 1000)
        drive(driver, global_runs, lambda: len(read_jsonl(out)) >= 1500)
        result["apps"] = _apps(spec["webui"])  # the group run's application is still open
        result["executors"] = executor_origins()

        # by_key, the sink failing from its 5th request on: the run fails once (no task retry)
        with psycopg.connect(db_url) as c:
            c.execute("insert into pgstream.events (payload, stream_id) select "
                      "jsonb_build_object('group_id', (g % 3)::text, 'n', g), 2 from generate_series(1, 300) g")
            c.commit()

        def fail_from_5th(n: int) -> None:
            if n == 4:
                endpoint.mode = "error"

        endpoint.hook = fail_from_5th
        drive(driver, by_key_runs, lambda: bool(by_key_runs.finished()))  # the first member run of stream 2 ends
        result["by_key_failed_run"] = {"success": by_key_runs.finished()[0]["state"] == "ended",
                                       "accepted": len(endpoint.accepted),
                                       "refused_answers": endpoint.refused_answers,
                                       "requests": endpoint.requests}
        endpoint.hook = None
        endpoint.mode = "ok"
        drive(driver, by_key_runs, lambda: len(endpoint.unique()) >= 300)
        end(driver, global_runs, by_key_runs)
        result["global_runs"] = global_runs.outcomes()
        result["by_key_runs"] = by_key_runs.outcomes()
        result["by_key_accepted"] = list(endpoint.accepted)

        # replay of the global stream through the cluster, in id order
        result["replay"], result["replayed"] = replay_through_spark(cfg, GLOBAL, instance)

        # a backfill of 2,000 rows on the cluster's executors (an RDD job's tasks, the package from the zip)
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute("create table public.things (id int primary key, label text)")
            c.execute("insert into public.things select g, 'thing ' || g from generate_series(1, 2000) g")
            c.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                      "values ('things', %s, 'INSERT', 'things', '{id,label}')", [GLOBAL])
        backfilled = build_definitions(cfg).resolve_job_def(BACKFILL_JOB).execute_in_process(
            run_config={"ops": {BACKFILL_OP: {"config": {
                "stream_id": GLOBAL, "subscriptions": ["things"], "parallelism": 3, "chunk_size": 300,
                "max_rows_per_sec": 0}}}},
            instance=instance, raise_on_error=False)
        with psycopg.connect(db_url) as c:
            result["backfill"] = {"success": backfilled.success, "read_ids": [r[0] for r in c.execute(
                "select (payload->'new'->>'id')::int from pgstream.events where payload->>'tg_op' = 'READ' "
                "order by 1")]}
    endpoint.down()
    Path(sys.argv[1] + ".out").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
