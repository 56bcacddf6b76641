"""Child process of tests/test_spark_cluster.py: ``by_key`` delivery on a standalone cluster whose
executors run a packed environment shipped with ``spark.archives`` (``env.tar.gz#env``,
``spark.pyspark.python: ./env/bin/python``), through the real Dagster job. First from a working
directory without the environment (the run fails, saying why), then with the same environment unpacked
there, as a run image would have it. Writes what it saw as JSON for the test.

Usage: python -m tests.support.spark_archives_child SPEC_JSON   (keys: see ``main``)
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import psycopg

from .dagster_instance import child_instance
from .endpoint import Endpoint
from .harness import Driver, write_config
from .members import MemberRuns, drive, end
from .spark_cluster import executor_origins

STREAM = 1


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    tmp = Path(spec["tmp"])
    db_url: str = spec["db_url"]
    endpoint = Endpoint()
    cfg = write_config(tmp / "pgstream.yaml", db_url, [
        {"id": STREAM, "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         "delivery": {"ordering": "by_key", "routing_key": "group_id", "parallelism": 2, "chunk_size": 20},
         "retry": {"initial_backoff_secs": 0, "max_backoff_secs": 0},
         "sink": endpoint.sink()}],
        spark={"master": spec["master"], "conf": {
            "spark.archives": f"{spec['archive']}#env", "spark.pyspark.python": "./env/bin/python",
            "spark.executor.memory": "512m"}})
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
    result: dict[str, Any] = {}
    with child_instance(spec["dagster_storage_url"], tmp) as instance:
        driver = Driver(cfg, instance)  # its runs: member runs of group default's delivery run
        runs = MemberRuns(driver, STREAM)
        driver.tick(STREAM)
        with psycopg.connect(db_url) as c:
            c.execute("insert into pgstream.events (payload, stream_id) select "
                      "jsonb_build_object('group_id', (g % 3)::text, 'n', g), 1 from generate_series(1, 300) g")
            c.commit()

        # the run's working directory has no ./env: the first run fails, naming the setting and the fix
        drive(driver, runs, lambda: bool(runs.finished()))
        first = runs.finished()[0]
        result["first_run"] = {"success": first["state"] == "ended", "accepted": len(endpoint.accepted),
                               "error": first["error"] or ""}

        # the same environment unpacked there, as a run image has it: every event, each key in order
        with tarfile.open(spec["archive"]) as tar:
            tar.extractall(Path.cwd() / "env", filter="tar")
        drive(driver, runs, lambda: len(endpoint.unique()) >= 300)
        end(driver, runs)
        result["runs"] = runs.outcomes()
        result["accepted"] = list(endpoint.accepted)
        result["executors"] = executor_origins()
    endpoint.down()
    Path(sys.argv[1] + ".out").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
