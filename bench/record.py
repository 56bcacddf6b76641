"""Recording benchmark (P1's first stage, run by hand: `make bench-record`): how fast the sensor
moves committed events from the slot into the ledger (a peek of ``engine.ingest.consume_group``: peek +
pgoutput decoding + ledger insert + slot advance), for the code of this tree and of git ``--baselines``, side by side
in one run.

Each version is a package tree of its own (``git archive`` of the ref into a temporary directory)
and reads a stream of its own, with its own slot (this tree: a reader group of its own; a version with
``ingest.consume``, the stream's own slot as it read it), in one private Postgres (wal_level=logical,
fsync off). A table with one INSERT subscription per stream (real triggers) gets ``--events`` rows
per round in transactions of ``--rows`` rows, so every stream has the same events waiting in the
same WAL. Then each version, in a child process of its own (``PYTHONPATH`` = its tree), runs
its reader until it recorded all of them; only that is timed. The order of the versions rotates
per round. A baseline without sql/011 gets the publication of every column, as it had.
Appends medians, ratios and the raw rounds to bench/RESULTS.md.
Usage: python bench/record.py [--events 200000] [--rows 100] [--rounds 3] [--max-size 1000]
                              [--baselines 39370c2,033ca0e]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import yaml
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TABLE_SQL, append_results, machine, package_tree, version_worker, versions_lines

import pgstream_dagster
from pgstream_dagster.config import StreamConfig, load_config
from pgstream_dagster.devdb import ensure_running

try:
    from pgstream_dagster.engine import ingest, replication
    from pgstream_dagster.engine.migrations import migrate
    from pgstream_dagster.engine.subscriptions import apply_subscriptions
except ImportError:  # a --ref from before pgstream_dagster/engine/ (the worker runs that tree)
    from pgstream_dagster.migrations import migrate
    from pgstream_dagster.subscriptions import apply_subscriptions

    from pgstream_dagster import replication
    from pgstream_dagster import sensors as ingest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _group(stream_id: int) -> str:
    """The reader group of this tree's stream (a group of one: its own slot)."""
    return f"record{stream_id}"


def _stream(stream_id: int, max_size: int, *, grouped: bool) -> StreamConfig:
    return StreamConfig.model_validate({"id": stream_id, "sink": {"type": "file", "path": "/dev/null"},
                                        "batch": {"max_size": max_size, "max_fill_secs": 0},
                                        **({"reader": _group(stream_id)} if grouped else {})})


def _read(conn: psycopg.Connection, stream: StreamConfig) -> int:
    """One read of the stream's slot by the version's reader; the events it recorded."""
    if hasattr(ingest, "consume"):  # a version whose streams read slots of their own
        return int(ingest.consume(conn, stream, 0).events)
    return sum(ingest.consume_group(conn, _group(stream.id), [stream], 0).events.values())


def _worker(url: str, stream_id: int, events: int, max_size: int) -> None:
    """Child process: record ``events`` events of the stream; prints the time it took (JSON)."""
    stream = _stream(stream_id, max_size, grouped=not hasattr(ingest, "consume"))
    with psycopg.connect(url, autocommit=True) as conn:
        started = time.perf_counter()
        recorded = 0
        while recorded < events:
            recorded += _read(conn, stream)
            if time.perf_counter() - started > 600:
                raise RuntimeError(f"only {recorded} of {events} events recorded in 600s")
        secs = time.perf_counter() - started
    print(json.dumps({"secs": secs, "events": recorded, "package": str(Path(pgstream_dagster.__file__).parent)}))


def _setup(url: str, config: Path, versions: dict[int, tuple[str, Path]]) -> None:
    """One INSERT subscription on ``bench_orders`` per stream, a slot per stream (this tree's: its group's)."""
    sys.path.insert(0, str(ROOT))  # tests.support; only here: a --worker must import its own tree's package
    from tests.support.legacy_streams import ensure_stream

    config.write_text(yaml.safe_dump({
        "database_url": url,
        "streams": [{"id": i, "sink": {"type": "file", "path": "/dev/null"}} for i in versions],
        "subscriptions": [{"key": f"bench-orders-{i}", "stream_id": i, "operation": "INSERT",
                           "table_name": "bench_orders", "column_names": ["id", "seq", "customer", "amount"]}
                          for i in versions]}))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TABLE_SQL)
        apply_subscriptions(conn, load_config(config))
        for stream_id, (_, tree) in versions.items():
            if tree == ROOT:  # its reader group, slot and publication
                ingest.consume_group(conn, _group(stream_id), [_stream(stream_id, 1000, grouped=True)], 0)
                continue
            slot = ensure_stream(conn, stream_id)
            if tree != ROOT and not (tree / "sql" / "022_lock_timeouts_and_slot_names.sql").exists():
                slot = f"pgstream_stream_{stream_id}"  # a baseline before 022 reads the default name of its time
            replication.create_slot(conn, slot)
            if not (tree / "sql" / "011_publication_columns.sql").exists():  # before 011: every column
                conn.execute(sql.SQL("alter publication {} set table pgstream.events where (stream_id = {})").format(
                    sql.Identifier(f"pgstream_stream_{stream_id}"), sql.Literal(stream_id)))


def _fill(url: str, events: int, rows: int, seq: int) -> None:
    """``events`` rows into bench_orders (an event per stream each), ~250-byte payloads."""
    with psycopg.connect(url, autocommit=True) as conn:
        for start in range(seq, seq + events, rows):
            conn.execute("insert into public.bench_orders (seq, customer, amount) "
                         "select g, 'customer-' || (g %% 1000) || '-' || repeat('x', 100), g * 1.5 "
                         "from generate_series(%s::bigint, %s::bigint) g", [start, start + rows - 1])
        with conn.transaction():  # a synchronous commit: the WAL above is flushed, decoding sees it
            conn.execute("set local synchronous_commit = on")
            conn.execute("select pg_current_xact_id()")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rows", type=int, default=100, help="rows per writer transaction")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-size", type=int, default=1000, help="batch.max_size of the streams (default 1000)")
    parser.add_argument("--baselines", default="39370c2,033ca0e", help="git refs to compare with, comma-separated")
    parser.add_argument("--worker", nargs=2, metavar=("URL", "STREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], int(args.worker[1]), args.events, args.max_size)
        return
    header = machine()
    refs = [r for r in args.baselines.split(",") if r]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "pgstream_dagster", "sql"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="pgstream-record-") as tmp:
        # stream 1: this tree; 2, 3...: the baselines
        versions: dict[int, tuple[str, Path]] = {1: (f"current ({commit}{', uncommitted changes' if dirty else ''})",
                                                     ROOT)}
        for i, ref in enumerate(refs, start=2):
            versions[i] = (ref, package_tree(ref, Path(tmp) / f"tree-{i}", "pgstream_dagster", "sql"))
        timings: dict[int, list[float]] = {i: [] for i in versions}
        pg = ensure_running(Path(tmp) / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off"})
        try:
            pg.create_database("record")
            url = pg.url_for("record")
            migrate(url)
            _setup(url, Path(tmp) / "pgstream.yaml", versions)
            ids = list(versions)
            for rnd in range(args.rounds):
                _fill(url, args.events, args.rows, rnd * args.events)
                order = ids[rnd % len(ids):] + ids[:rnd % len(ids)]
                for stream_id in order:
                    tree = versions[stream_id][1]
                    result = version_worker(__file__, tree, url, str(stream_id), "--events", str(args.events),
                                            "--max-size", str(args.max_size))
                    timings[stream_id].append(result["secs"])
                print(f"round {rnd}: " + ", ".join(f"{versions[i][0]} {timings[i][-1]:.2f}s" for i in ids), flush=True)
        finally:
            pg.destroy()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Recording (P1) {stamp}, {args.events:,} events per stream per round, {args.rounds} rounds, "
             f"batch.max_size {args.max_size:,}",
             f"Machine: {header}. Method: bench/record.py; each version a package tree of its own (git archive) "
             f"reading a stream of its own (own slot, own publication: every column for a version before sql/011; "
             "this tree's a reader group of one) "
             f"in one private Postgres (fsync off); a table with one INSERT subscription per stream (real triggers, "
             f"~250-byte payloads), {args.rows} rows per transaction, so every stream has the same events in the "
             "same WAL; time for the version's reader (peeks), in a child process per version, to peek, decode, "
             "record and advance all of them; order rotated per round; medians."]
    lines += versions_lines(versions, timings, args.events)
    append_results("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
