"""The repository snapshot at many streams (issue 45; run by hand): what the code server serves and the
daemon fetches at every workspace refresh (60 s), for the code of this tree and of git ``--baselines``.

For each count of ``--streams``, a ``pgstream.yaml`` as bench/streams.py writes it (an http sink and an
INSERT subscription per stream, every stream in one reader group) is loaded by ``build_definitions``
(no database is reached), and Dagster's ``RepositorySnap.from_def`` of it is serialized as the code
server serializes it. Reported: the serialized size, the part of it that is job snapshots, the jobs,
and the seconds to build and serialize it. Each version runs in a child process of its own
(``PYTHONPATH`` = its tree: this checkout, or a ``git archive`` of the baseline).
Appended to bench/RESULTS.md unless ``--no-record``.
Usage: python bench/snapshot.py [--streams 1,10,100] [--baselines 2e7de73] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, package_tree

HERE = Path(__file__).resolve().parent

# in the version's own tree (PYTHONPATH): what the code server builds and serializes
_CHILD = r"""
import json, sys, time
from pathlib import Path
import yaml
from dagster._core.remote_representation.external_data import RepositorySnap
from dagster._serdes import serialize_value
from pgstream_dagster.defs.location import build_definitions

out = []
for count in json.loads(sys.argv[2]):
    path = Path(sys.argv[1]) / f"pgstream-{count}.yaml"
    path.write_text(yaml.safe_dump({
        "database_url": "postgresql://bench@127.0.0.1:1/bench", "spark": {"master": "local[2]"},
        "streams": [{"id": i, "reader": "bench", "sink": {"type": "http", "url": f"http://127.0.0.1:9/hook/{i}",
                                                          "mode": "batch"}} for i in range(1, count + 1)],
        "subscriptions": [{"key": f"bench-s{i}", "stream_id": i, "operation": "INSERT", "table_name": f"bench_s{i}",
                           "column_names": ["id", "seq"]} for i in range(1, count + 1)]}))
    repo = build_definitions(path).get_repository_def()
    started = time.monotonic()
    snap = RepositorySnap.from_def(repo)
    data = serialize_value(snap)
    secs = time.monotonic() - started
    jobs = sum(len(serialize_value(j)) for j in snap.job_datas or [])
    out.append({"streams": count, "bytes": len(data), "job_bytes": jobs, "jobs": len(repo.get_all_jobs()),
                "secs": round(secs, 2)})
print(json.dumps(out))
"""


def _measure(tree: Path, counts: list[int], workdir: Path) -> list[dict[str, float]]:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(workdir), json.dumps(counts)], cwd=workdir,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    result: list[dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,10,100", help="stream counts, comma-separated")
    parser.add_argument("--baselines", default="", help="git refs to measure beside this tree, comma-separated")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    args = parser.parse_args()
    counts = [int(c) for c in args.streams.split(",")]
    header = machine()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        refs = [ref for ref in args.baselines.split(",") if ref]
        versions = [("this tree", ROOT), *((ref, package_tree(ref, Path(tmp) / ref)) for ref in refs)]
        for name, tree in versions:
            work = Path(tmp) / f"work-{len(lines)}"
            work.mkdir()
            for row in _measure(tree, counts, work):
                line = (f"- {name}, {row['streams']} streams: {row['bytes'] / 1e6:.2f} MB ({row['bytes']:,} bytes), "
                        f"job snapshots {row['job_bytes'] / 1e6:.2f} MB of it, {row['jobs']} jobs, "
                        f"built and serialized in {row['secs']:.2f} s")
                print(line, flush=True)
                lines.append(line)
    if not args.no_record:
        with (HERE / "RESULTS.md").open("a") as f:
            f.write(f"\n## Repository snapshot {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC\n"
                    f"Machine: {header}. Method: bench/snapshot.py (RepositorySnap.from_def, serialized as the code "
                    f"server does, of bench/streams.py's configuration).\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
