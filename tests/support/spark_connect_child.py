"""Child process of tests/test_spark_connect.py: drives a stream and a replay whose runs use a Spark
Connect server. A process of its own because PySpark switches a whole process to Connect mode
(``SPARK_CONNECT_MODE_ENABLED``), which would leak into the classic-Spark tests of the session.

Usage: python -m tests.support.spark_connect_child CONFIG EXPECTED_EVENTS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dagster as dg

from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import replay_job_name

from .harness import Driver, read_jsonl


def main() -> None:
    config, expected = Path(sys.argv[1]), int(sys.argv[2])
    out = Path(str(config) + ".out")
    with dg.DagsterInstance.ephemeral() as instance:
        driver = Driver(config, instance)
        sink = Path(json.loads(Path(str(config) + ".sink").read_text()))
        driver.run_until(1, lambda: len(read_jsonl(sink)) >= expected, timeout=300)
        replay = build_definitions(config).resolve_job_def(replay_job_name(1)).execute_in_process(
            run_config={"ops": {"replay_stream_1": {"config": {"all_events": True}}}}, instance=instance,
            raise_on_error=False)
        out.write_text(json.dumps({"runs": [r.success for r in driver.results], "replay": replay.success}))


if __name__ == "__main__":
    main()
