"""Recording benchmark (P1's first stage, run by hand: `make bench-record`): how fast the sensor
moves committed events from the slot into the ledger (peek + pgoutput decoding + ledger insert +
slot advance), with the publication of sql/011 (id, stream_id, created_at) against the earlier
publication of every column and the pgoutput decoder of git ``--baseline`` (before both changes),
side by side in one run.

Two streams in one private Postgres (wal_level=logical), each with its own slot; stream 1's
publication is put back to every column (as before sql/011) and read with the baseline's
``replication`` module, stream 2 keeps the column list and the current decoder. Each
round inserts ``--events`` events of ~250-byte payloads for both streams (interleaved
transactions of ``--per-txn`` rows), then times ``sensors.consume`` for each stream, in alternating
order. Appends medians and the ratio to bench/RESULTS.md.
Usage: python bench/record.py [--events 200000] [--per-txn 100] [--rounds 3] [--baseline 033ca0e]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from pgstream_dagster import ledger, replication, sensors
from pgstream_dagster.config import StreamConfig
from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.migrations import migrate

HERE = Path(__file__).resolve().parent


def _baseline_replication(ref: str, tmp: Path) -> object:
    """``pgstream_dagster/replication.py`` as of git ``ref``, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{ref}:pgstream_dagster/replication.py"], cwd=HERE.parent,
                            check=True, capture_output=True, text=True).stdout
    path = tmp / "baseline_replication.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_replication", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _stream(stream_id: int) -> StreamConfig:
    return StreamConfig.model_validate({
        "id": stream_id, "sink": {"type": "file", "path": "/dev/null"},
        "batch": {"max_size": 10_000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 50}})


def _fill(url: str, events: int, per_txn: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for start in range(0, events, per_txn):
            for stream_id in (1, 2):
                conn.execute(
                    "insert into pgstream.events (payload, stream_id) "
                    "select jsonb_build_object('tg_name', 'orders', 'tg_op', 'INSERT', 'timestamp', 1700000000000 + g, "
                    "'new', jsonb_build_object('id', g, 'customer', 'c-' || (g %% 1000), 'amount', g * 1.5, "
                    "'note', repeat('x', 120)), 'old', null), %s from generate_series(%s::int, %s::int) g",
                    [stream_id, start, start + per_txn - 1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--per-txn", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default="033ca0e", help="git ref whose decoder stream 1 uses")
    args = parser.parse_args()
    header = machine()
    timings: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="pgstream-record-") as tmp:
        current = replication.peek_rows
        decoders = {1: _baseline_replication(args.baseline, Path(tmp)).peek_rows, 2: current}  # type: ignore[attr-defined]
        pg = ensure_running(Path(tmp) / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off"})
        try:
            pg.create_database("record")
            url = pg.url_for("record")
            migrate(url)
            streams = {i: _stream(i) for i in (1, 2)}
            with psycopg.connect(url, autocommit=True) as conn:
                for stream in streams.values():
                    ledger.ensure_stream(conn, stream.id, stream.slot)
                    replication.create_slot(conn, stream.slot)
                # stream 1: the publication as it was before sql/011, every column
                conn.execute("alter publication pgstream_stream_1 set table pgstream.events where (stream_id = 1)")
            for rnd in range(args.rounds):
                _fill(url, args.events, args.per_txn)
                order = (1, 2) if rnd % 2 == 0 else (2, 1)
                with psycopg.connect(url, autocommit=True) as conn:
                    for stream_id in order:
                        replication.peek_rows = decoders[stream_id]  # the decoder consume() uses
                        started = time.perf_counter()
                        recorded = 0
                        while recorded < args.events:
                            recorded += sensors.consume(conn, streams[stream_id], 0).events
                        timings[stream_id].append(time.perf_counter() - started)
                print(f"round {rnd}: before {timings[1][-1]:.2f}s, after {timings[2][-1]:.2f}s",
                      flush=True)
        finally:
            pg.destroy()
    old, new = statistics.median(timings[1]), statistics.median(timings[2])
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Recording (P1) {stamp}, {args.events:,} events per stream per round, {args.rounds} rounds",
             f"Machine: {header}. Method: bench/record.py; two streams with their own slots in one private Postgres "
             f"(fsync off), ~250-byte payloads in transactions of {args.per_txn} rows, interleaved; time for "
             "sensors.consume to peek, decode, record and advance all of a stream's events; order alternated per "
             "round; medians.",
             f"- before (every column published, decoder of {args.baseline}): {old:.2f}s = "
             f"{args.events / old:,.0f} events/s "
             f"(rounds {', '.join(f'{t:.2f}' for t in timings[1])})",
             f"- after (id, stream_id, created_at published by sql/011; decoder reading only id and created_at): "
             f"{new:.2f}s = {args.events / new:,.0f} events/s "
             f"({old / new:.2f}x faster; rounds {', '.join(f'{t:.2f}' for t in timings[2])})"]
    with (HERE / "RESULTS.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
