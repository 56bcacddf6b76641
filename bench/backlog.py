"""A backlog handed to an open run at once (run by hand: `make bench-backlog`): how fast the run delivers more than
a round (``tuning.direct_max_events``) of what it was handed, as after a sink outage when a stream's
``delivery.max_events_per_run`` is raised above a round (its default, 100,000, is one round: such a run is handed
the next round once the last is delivered), for the code of this tree and of git ``--baselines``, side by side in
one run.

Without Dagster: the delivery engine (:class:`~pgstream_dagster.engine.delivery.run.DeliveryRun`) hosted as a
group delivery run hosts a member's run (a ``Host.wake`` that waits for a sign, none coming while the backlog is
delivered), the product's defaults otherwise (``tuning.direct_max_events`` 100,000, ``batch.max_size`` 1,000), a
file sink. Per round and version: ``--events`` manual events of the version's own stream inserted and recorded by
the stream's reader group, all handed to one open run (as the sensor does once the sink is back), then timed from
the run's start until its last round is delivered (``deliver`` returns once the host's sign says all is
delivered). Each version runs in a child process of its own (``PYTHONPATH`` = its tree); the order of the
versions rotates per round. Appends medians, ratios and the rounds to bench/RESULTS.md.
Usage: python bench/backlog.py [--events 500000] [--rounds 3] [--baselines 3d4ed26]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

if TYPE_CHECKING:
    from pgstream_dagster.config import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, commit, machine, package_tree, version_worker, versions_lines

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GROUP = "backlog"


def _stream(stream_id: int, out: Path) -> StreamConfig:
    from pgstream_dagster.config import StreamConfig

    return StreamConfig.model_validate({"id": stream_id, "reader": GROUP, "sink": {"type": "file", "path": str(out)},
                                        "batch": {"max_size": 1000, "max_fill_secs": 0},
                                        "delivery": {"max_events_per_run": 1_000_000}})


class _Log:
    def info(self, msg: str) -> None:
        pass

    def warning(self, msg: str) -> None:
        print(f"warning: {msg}", file=sys.stderr, flush=True)

    def error(self, msg: str) -> None:
        print(f"error: {msg}", file=sys.stderr, flush=True)


def _worker(url: str, stream_id: int, out: Path) -> None:
    """Child process: hand the stream's pending batches to one open run and deliver them; prints the seconds."""
    import pgstream_dagster
    from pgstream_dagster.engine.delivery.run import DeliveryRun, Host
    from pgstream_dagster.engine.ledger import state

    stream = _stream(stream_id, out)
    run_key = f"bench-backlog-{stream_id}-{time.time_ns()}"
    with psycopg.connect(url, autocommit=True) as conn:
        batches = [b for b in state.batches_between(conn, stream_id, 0, 2**62) if b.status == "pending"]
        events = sum(b.event_count for b in batches)
        assert state.launch(conn, stream_id, [b.id for b in batches], run_key, keep_open=True) is not False
        batches = state.batches_between(conn, stream_id, batches[0].id, batches[-1].id)
    check = psycopg.connect(url, autocommit=True)
    never = threading.Event()

    def all_delivered() -> bool:
        row = check.execute("select count(*) from pgstream.batches where stream_id = %s and status <> 'delivered'",
                            [stream_id]).fetchone()
        return bool(row and row[0] == 0)

    def wake(timeout: float) -> bool:  # the group run's sign: none while the backlog is delivered
        if all_delivered():
            return True
        never.wait(timeout)
        return False

    host = Host("bench-backlog", _Log(), wake=wake, stop_check=lambda: "delivered" if all_delivered() else None)
    log = _Log()
    started = time.perf_counter()
    rounds = list(DeliveryRun(stream, url, url, "bench-backlog", batches[0].id, batches[-1].id,
                              run_key).start(log).deliver(host))
    secs = time.perf_counter() - started
    check.close()
    print(json.dumps({"secs": secs, "events": events, "rounds": len(rounds),
                      "package": str(Path(pgstream_dagster.__file__).parent)}))


def _fill(url: str, stream_ids: list[int], events: int) -> None:
    """``events`` manual events (~200-byte payloads) of each stream, recorded by the streams' reader group."""
    from pgstream_dagster.engine import ingest

    with psycopg.connect(url, autocommit=True) as conn:
        for sid in stream_ids:
            for start in range(0, events, 50_000):
                conn.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g, "
                             "'note', repeat('x', 150)), %s from generate_series(%s::int, %s::int) g",
                             [sid, start, min(events, start + 50_000) - 1])
        members = [_stream(sid, Path("/dev/null")) for sid in stream_ids]
        want = events * len(stream_ids)
        recorded, deadline = 0, time.monotonic() + 600
        while recorded < want:
            recorded += sum(ingest.consume_group(conn, GROUP, members, 2).events.values())
            assert time.monotonic() < deadline, f"only {recorded} of {want} events recorded"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=500_000, help="backlog of each version per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baselines", default="3d4ed26", help="git refs to compare with, comma-separated")
    parser.add_argument("--worker", nargs=3, metavar=("URL", "STREAM", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], int(args.worker[1]), Path(args.worker[2]))
        return
    from pgstream_dagster.devdb import ensure_running
    from pgstream_dagster.engine import ingest
    from pgstream_dagster.engine.migrations import migrate

    header = machine()
    refs = [r for r in args.baselines.split(",") if r]
    with tempfile.TemporaryDirectory(prefix="pgstream-backlog-") as tmp:
        versions: dict[int, tuple[str, Path]] = {1: (f"current ({commit()})", ROOT)}
        for i, ref in enumerate(refs, start=2):
            versions[i] = (ref, package_tree(ref, Path(tmp) / f"tree-{i}", "pgstream_dagster", "sql"))
        timings: dict[int, list[float]] = {i: [] for i in versions}
        pg = ensure_running(Path(tmp) / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off"})
        try:
            pg.create_database("backlog")
            url = pg.url_for("backlog")
            migrate(url)
            ids = list(versions)
            with psycopg.connect(url, autocommit=True) as conn:  # the group, its slot, its members
                ingest.consume_group(conn, GROUP, [_stream(i, Path("/dev/null")) for i in ids], 0)
            for rnd in range(args.rounds):
                _fill(url, ids, args.events)
                order = ids[rnd % len(ids):] + ids[:rnd % len(ids)]
                for stream_id in order:
                    tree = versions[stream_id][1]
                    out = Path(tmp) / f"out-{stream_id}-{rnd}.jsonl"
                    result = version_worker(__file__, tree, url, str(stream_id), str(out))
                    assert result["events"] == args.events, result
                    lines = sum(1 for _ in out.open("rb"))
                    assert lines == args.events, f"{versions[stream_id][0]}: {lines} of {args.events} delivered"
                    out.unlink()
                    timings[stream_id].append(result["secs"])
                print(f"round {rnd}: " + ", ".join(f"{versions[i][0]} {timings[i][-1]:.2f}s" for i in ids),
                      flush=True)
        finally:
            pg.destroy()
    lines_out = [f"\n## A backlog handed to an open run at once (bench/backlog.py) "
                 f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {args.events:,} events, {args.rounds} rounds",
                 f"Command: `make bench-backlog` (bench/backlog.py --events {args.events} --rounds {args.rounds} "
                 f"--baselines {args.baselines}). Machine: {header}. Method: per round and version, the version's "
                 "stream (delivery.max_events_per_run 1,000,000) gets the backlog (manual events, ~200-byte "
                 "payloads) recorded by its reader group (batches of 1,000), all handed to one open run, "
                 "delivered to a file by the delivery engine in a child process (PYTHONPATH = the version's tree), "
                 "hosted as a group run hosts a member (its wake waits for a sign, none coming until all is "
                 "delivered), the product's direct_max_events (100,000 a round); timed from the run's start to "
                 "its last round; order rotated per round; medians."]
    lines_out += versions_lines(versions, timings, args.events)
    append_results("\n".join(lines_out) + "\n")
    print("\n".join(lines_out))


if __name__ == "__main__":
    main()
