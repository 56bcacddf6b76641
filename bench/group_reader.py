"""What a reader group's reader costs by itself (run by hand: `make bench-group-reader`): ten members, one row a
second on each (a writer process), for ``--window`` s, read by ``consume_group`` called again and again (5 s
each, as a group delivery run's reader calls it) in two ways, alternating: the group's slot peeked every 0.1 s
(no ``kept``: how the group's sensor reads) and one replication connection kept across the calls
(``kept=GroupStream``: how a group delivery run's reader reads). Measured: CPU-seconds of this process (the
reader) and of every process of the private Postgres (its backends and the WAL sender) over the window; no
Dagster, no delivery, so the figures are the reader's alone.

Usage: python bench/group_reader.py [--window 30] [--rounds 2] [--streams 10]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import load_after, machine

from pgstream_dagster.config import load_config
from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.engine import ingest
from pgstream_dagster.engine.migrations import migrate
from tests.support.harness import write_config


def _writer(url: str, streams: int, secs: float) -> None:
    """One row a second on every stream, for ``secs``."""
    with psycopg.connect(url, autocommit=True) as conn:
        end = time.monotonic() + secs
        n = 0
        while time.monotonic() < end:
            for i in range(1, streams + 1):
                conn.execute("insert into pgstream.events (payload, stream_id) values "
                             "(jsonb_build_object('n', %s::int), %s)", [n, i])
            n += 1
            time.sleep(max(0.0, 1 - (time.monotonic() % 1)))


def _postgres_cpu(data_dir: Path) -> float:
    """CPU-seconds of the postmaster started on ``data_dir`` and of its children."""
    total = 0.0
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(data_dir) in arg for arg in proc.info["cmdline"] or []):
                for p in [proc, *proc.children(recursive=True)]:
                    t = p.cpu_times()
                    total += t.user + t.system
        except psutil.Error:
            continue
    return total


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=30, help="seconds of one row a second on every stream")
    parser.add_argument("--rounds", type=int, default=2, help="peek then stream, this many times")
    parser.add_argument("--streams", type=int, default=10)
    args = parser.parse_args()
    machine()
    tmp = Path(tempfile.mkdtemp(prefix="pgstream-group-reader-"))
    pg = ensure_running(tmp / "pg", extra_settings={"fsync": "off"})
    try:
        url = pg.url
        migrate(url)
        config = write_config(tmp / "pgstream.yaml", url, [
            {"id": i, "reader": "bench", "batch": {"max_size": 100, "max_fill_secs": 0},
             "delivery": {"mode": "per_batch"}, "sink": {"type": "file", "path": str(tmp / f"out{i}.jsonl")}}
            for i in range(1, args.streams + 1)])
        streams = list(load_config(config).streams)
        with psycopg.connect(url, autocommit=True) as conn:
            for _ in range(5):  # the group's slot, every member joined
                ingest.consume_group(conn, "bench", streams, 1.0)
        for round_ in range(1, args.rounds + 1):
            for way in ("peek", "stream"):
                with psycopg.connect(url, autocommit=True) as conn:
                    kept = ingest.GroupStream(url, "bench group reader") if way == "stream" else None
                    writer = multiprocessing.Process(target=_writer, args=(url, args.streams, args.window))
                    own, server = _own_cpu(), _postgres_cpu(tmp / "pg")
                    writer.start()
                    end = time.monotonic() + args.window
                    events = 0
                    while time.monotonic() < end:
                        result = ingest.consume_group(conn, "bench", streams, min(5.0, end - time.monotonic()),
                                                      kept=kept)
                        events += sum(result.events.values())
                    writer.join()
                    own, server = _own_cpu() - own, _postgres_cpu(tmp / "pg") - server
                    if kept is not None:
                        kept.close()
                per_event = 1000 * (own + server) / max(events, 1)
                print(f"round {round_}, {way}: {events} events in {args.window:.0f} s; reader {own:.2f} CPU-s, "
                      f"Postgres {server:.2f} CPU-s, together {per_event:.1f} ms per event", flush=True)
    finally:
        pg.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
    load_after()


if __name__ == "__main__":
    main()
