"""A failover of the primary under `dg dev` (issue 46, run by hand: `make bench-failover`): the seconds from the
standby accepting writes to the first row written after that reaching the webhook, with the real daemon, run
launcher and Dagster storage.

Per round: a primary with an asynchronous streaming standby (tests/support/standby.py: the embedded server's
binaries, `pg_basebackup`), one stream (events inserted directly, one every 50 ms) to a local webhook, its
`database_url` the pair's multi-host URL (`target_session_attrs=read-write`), Dagster's storage a database of the
local Postgres on 5432; `dg dev` started; once 50 events arrived and 5 s more went by, kill -9 of the primary and
`pg_promote()` of the standby. Reports each round's figure and their median, min and max; appends to
bench/RESULTS.md.
Usage: python bench/failover.py [--rounds 3] [--storage-url postgresql://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import append_results, load_after, machine

from pgstream_dagster.engine.bootstrap import init
from tests.support.dagster_dev import repo_root, start_dagster_dev, stop_process_group
from tests.support.harness import write_config
from tests.support.http_recorder import recording_server
from tests.support.standby import StandbyPair


def _round(root: Path, storage_url: str) -> float:
    pair = StandbyPair(root / "pg")
    storage = f"bench_failover_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(storage_url, autocommit=True) as c:
        c.execute(sql.SQL("create database {}").format(sql.Identifier(storage)))
    try:
        pair.add_standby(synchronous=False)
        pair.create_database("app")
        url = pair.url_for("app")
        with recording_server() as hook:
            cfg = write_config(root / "pgstream.yaml", url, streams=[{
                "id": 1, "sink": {"type": "http", "url": hook.url, "mode": "per_event"},
                "batch": {"max_size": 100, "max_fill_secs": 0.1},
                # the product's delivery settings (the tests' harness shortens max_run_secs unless a mode is said)
                "delivery": {"mode": "open"}}], subscriptions=[])
            init(cfg)
            pair.catch_up()
            home = root / "home"
            home.mkdir()
            shutil.copy(repo_root() / "dagster.yaml", home / "dagster.yaml")
            base = storage_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg2://", 1)
            env = {"PGSTREAM_CONFIG": str(cfg), "DAGSTER_HOME": str(home), "PYTHONUNBUFFERED": "1",
                   "DAGSTER_POSTGRES_URL": f"{base}/{storage}"}
            dev = start_dagster_dev(root, env)
            stop = threading.Event()
            committed: dict[str, float] = {}

            def write() -> None:
                n, conn = 0, None
                while not stop.is_set():
                    try:
                        if conn is None:
                            conn = psycopg.connect(url, autocommit=True)
                        conn.execute("insert into pgstream.events (payload, stream_id) "
                                     "values (jsonb_build_object('tag', %s::text), 1)", [f"r{n}"])
                        committed[f"r{n}"] = time.monotonic()
                    except psycopg.OperationalError:
                        conn = None
                    n += 1
                    time.sleep(0.05)

            def arrived() -> list[tuple[str, float]]:
                with hook.lock:
                    return [(str(r.body.get("payload", r.body).get("tag")), r.at) for r in hook.received]

            writer = threading.Thread(target=write, daemon=True)
            writer.start()
            try:
                deadline = time.monotonic() + 240
                while len(arrived()) < 50:
                    if time.monotonic() > deadline:
                        raise RuntimeError("no events arrived in 240 s:\n" + dev.tail(60))
                    time.sleep(0.2)
                time.sleep(5)
                promoted = pair.fail_over()
                deadline = time.monotonic() + 120
                while not (after := [at for tag, at in arrived() if committed.get(tag, 0) > promoted]):
                    if time.monotonic() > deadline:
                        raise RuntimeError("nothing written after the promotion arrived in 120 s:\n" + dev.tail(80))
                    time.sleep(0.05)
                return min(after) - promoted
            finally:
                stop.set()
                stop_process_group(dev.proc)
    finally:
        pair.destroy()
        with psycopg.connect(storage_url, autocommit=True) as c:
            c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(storage)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--storage-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="a Postgres where each round creates Dagster's storage database")
    args = parser.parse_args()
    header = machine()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    secs: list[float] = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
            secs.append(_round(Path(tmp), args.storage_url))
        print(f"round {i + 1}: first row written after the promotion delivered {secs[-1]:.2f} s after it", flush=True)
    after = load_after()
    append_results(
        f"\n## A failover of the primary under `dg dev` (bench/failover.py) {started}\n\n{header}; {after}.\n\n"
        f"Seconds from the promoted standby accepting writes to the first row written after it reaching the "
        f"webhook, {args.rounds} rounds (asynchronous standby, kill -9 of the primary, one event every 50 ms): "
        f"median {statistics.median(secs):.2f} s, min {min(secs):.2f}, max {max(secs):.2f} "
        f"({', '.join(f'{s:.2f}' for s in secs)}).\n")


if __name__ == "__main__":
    main()
