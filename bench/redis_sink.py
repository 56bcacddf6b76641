"""Redis sink: CPU per event of a chunk sent as one script call (EVALSHA, the default) and as one
pipelined MULTI/EXEC of an XADD per event (``use_script: false``), side by side in one run (run by
hand: `make bench-redis`). Against the Redis on 127.0.0.1:6379: ROUNDS rounds alternating the two,
each publishing N events in chunks of CHUNK through one warm sink into a stream of its own (trimmed
with MAXLEN ~), measuring the client's CPU (thread_time of this thread: building the entries,
encoding, the socket) and the server's (Redis' ``INFO cpu``, user + sys, over the round). Results
are appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, machine

from pgstream_dagster.sinks import Event, build_sink

HERE = Path(__file__).resolve().parent
URL = "redis://127.0.0.1:6379/0"


def _server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _round(client: redis.Redis, events: list[Event], chunk: int, use_script: bool) -> tuple[float, float, float]:
    """(client CPU, server CPU, wall) in microseconds per event."""
    key = f"pgstream-bench-{uuid.uuid4().hex[:8]}"
    sink = build_sink({"type": "redis", "url": URL, "stream": key, "maxlen": 100_000, "use_script": use_script})
    try:
        sink.publish(events[:chunk])  # warm: connection, script loaded
        server, cpu, wall = _server_cpu(client), time.thread_time(), time.perf_counter()
        for start in range(0, len(events), chunk):
            sink.publish(events[start:start + chunk])
        n = len(events)
        return ((time.thread_time() - cpu) / n * 1e6, (_server_cpu(client) - server) / n * 1e6,
                (time.perf_counter() - wall) / n * 1e6)
    finally:
        sink.close()
        client.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--chunk", type=int, default=5000, help="events per publish call (delivery.chunk_size)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    created = dt.datetime.now(dt.UTC)
    payload = ('{"record": {"id": 1, "customer": "c-17", "amount": 42.5, "note": "hello world"}, "changes": null, '
               '"action": "INSERT", "metadata": {"table_schema": "public", "table_name": "orders"}}')
    events = [Event(id=i, stream_id=1, payload=None, payload_json=payload, created_at=created)
              for i in range(1, args.events + 1)]
    client = redis.Redis.from_url(URL)
    results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for use_script in (True, False):
            results[use_script].append(_round(client, events, args.chunk, use_script))
    client.close()

    def median(use_script: bool, i: int) -> float:
        return statistics.median(r[i] for r in results[use_script])

    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Redis sink, script vs pipeline (bench/redis_sink.py) {stamp}",
             f"Machine: {machine()}. Method: {args.rounds} rounds alternating the two, each {args.events:,} events "
             f"(~230-byte payload, no metadata) in publish calls of {args.chunk:,} through one warm sink, MAXLEN ~ "
             "100,000; client CPU = thread_time of the publishing thread, server CPU = Redis INFO cpu (user + sys); "
             "medians of the rounds, microseconds per event."]
    for use_script, name in ((True, "script (EVALSHA, default)"), (False, "pipeline (MULTI/EXEC, use_script false)")):
        lines.append(f"- {name}: client {median(use_script, 0):.2f} us, Redis server {median(use_script, 1):.2f} us, "
                     f"wall {median(use_script, 2):.2f} us an event")
    lines.append(f"- script / pipeline: client {median(True, 0) / median(False, 0):.2f}x, client + server "
                 f"{(median(True, 0) + median(True, 1)) / (median(False, 0) + median(False, 1)):.2f}x, wall "
                 f"{median(True, 2) / median(False, 2):.2f}x")
    print("\n".join(lines))
    append_results("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
