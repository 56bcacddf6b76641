"""Child process of tests/test_by_key_resume.py: a ``by_key`` delivery run whose Spark task fails
once mid-partition (the sink answers 500 to one chunk) on ``local[2,3]``, i.e. Spark itself retries
the task within the run. A process of its own: the session's other tests already hold a local Spark
(``getOrCreate`` would hand that one back, with no task retries).

Usage: python -m tests.support.by_key_retry_child SPEC_JSON   (keys: tmp, db_url, dagster_storage_url)
Writes SPEC_JSON.out: the runs' outcomes (the reader group's delivery runs, their member runs, the stream's
failover), what the endpoint accepted, the run log's messages.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import psycopg

from pgstream_dagster.defs.names import member_tag

from .dagster_instance import child_instance
from .endpoint import Endpoint
from .harness import Driver, write_config

STREAM = 1
EVENTS = 400


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    tmp, db_url = Path(spec["tmp"]), spec["db_url"]
    endpoint = Endpoint()
    cfg = write_config(tmp / "pgstream.yaml", db_url, [
        {"id": STREAM, "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         "delivery": {"ordering": "by_key", "routing_key": "group_id", "parallelism": 2, "chunk_size": 10},
         "sink": endpoint.sink()}],
        spark={"master": "local[2,3]"})  # a failed task is tried up to 3 times
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(%s)", [STREAM])
    result: dict[str, Any] = {}
    with child_instance(spec["dagster_storage_url"], tmp) as instance:
        driver = Driver(cfg, instance)
        driver.tick(STREAM)
        with psycopg.connect(db_url) as c:
            ids = [r[0] for r in c.execute(
                "insert into pgstream.events (payload, stream_id) select jsonb_build_object('group_id', "
                "(g %% 4)::text, 'n', g), %s from generate_series(1, %s) g returning id", [STREAM, EVENTS])]
            c.commit()
        endpoint.fail_once_ids = {ids[EVENTS // 2]}  # one chunk in the middle of a partition: refused once
        driver.run_until(STREAM, lambda: len(endpoint.unique()) >= EVENTS, timeout=300)
        driver.close()  # the reader group's delivery runs, which hosted the stream's runs, end
        result["runs"] = [r.success for r in driver.results]
        result["messages"] = [e.message for r in driver.results for e in instance.all_logs(r.run_id) if e.message]
        # what became of the member runs each group run hosted (the last one's: failed, with its error, or ended)
        result["members"] = [json.loads(r.dagster_run.tags[member_tag(STREAM)]) for r in driver.results
                             if member_tag(STREAM) in r.dagster_run.tags]
        with psycopg.connect(db_url) as c:
            row = c.execute("select failover_since is not null, failover_attempts from pgstream.streams where id = %s",
                            [STREAM]).fetchone()
            result["failover"] = list(row) if row else None
            result["sent"] = [r[0] for r in c.execute(
                "select id from pgstream.events where stream_id = %s order by id", [STREAM])]
            result["groups"] = dict(c.execute("select id, payload->>'group_id' from pgstream.events"))
    result["accepted"] = list(endpoint.accepted)
    result["refused_answers"] = endpoint.refused_answers
    endpoint.down()
    Path(sys.argv[1] + ".out").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
