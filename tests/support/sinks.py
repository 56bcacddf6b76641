"""Sink test helpers: the brokers on loopback, events with varied payloads, unique names, and a
fresh Python process for what must survive pickling."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pgstream_dagster.devdb import free_port
from pgstream_dagster.engine.publish import Deliveries, Finished
from pgstream_dagster.sinks import (
    Event,
)

__all__ = ["free_port", "stop_process", "wait_listening"]


REDIS_URL = "redis://127.0.0.1:6379/0"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
NATS_URL = "nats://127.0.0.1:4222"
BASE_TIME = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def drain(deliveries: Deliveries) -> int:
    """Run a publish loop to the end; the events handled."""
    handled = 0
    for delivery in deliveries:
        if isinstance(delivery, Finished):
            handled = delivery.handled
    return handled


def make_events(n: int, *, first_id: int = 101, stream_id: int = 7) -> list[Event]:
    """``n`` events with increasing, non-trivial ids and varied payloads."""
    return [
        Event(
            id=first_id + i,
            stream_id=stream_id,
            payload={"seq": i, "name": f"row-{i}", "tags": ["a", i], "nested": {"ünïcode": "✓", "n": None}},
            metadata={"op": "insert", "txid": 1000 + i} if i % 2 == 0 else None,
            created_at=BASE_TIME + timedelta(seconds=i),
        )
        for i in range(n)
    ]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """Terminate a server process the test started (kill it if it takes longer than 10 s)."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def run_python(code: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, cwd=root, timeout=60, check=False
    )




def wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float = 30) -> None:
    """Wait until the server process ``proc`` accepts connections on 127.0.0.1:``port``; its log's tail if
    it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


async def nats_admin(action: str, stream: str, subject: str = "", expected: int = 0,
                     max_msg_size: int | None = None) -> list[Any]:
    """JetStream administration on the NATS server on loopback: ``create`` the stream ``stream`` over
    ``subject`` and ``subject.>``, ``delete`` it, or ``read`` (and ack) up to ``expected`` messages of
    the subjects matching ``subject`` (``>``: all), returning ``[messages in the stream, messages read]``."""
    import nats  # the sink's optional extra: imported by the tests that use it only

    nc = await nats.connect(NATS_URL)
    try:
        js = nc.jetstream()
        if action == "create":
            limits: dict[str, Any] = {} if max_msg_size is None else {"max_msg_size": max_msg_size}
            await js.add_stream(name=stream, subjects=[subject, subject + ".>"], **limits)
            return []
        if action == "delete":
            await js.delete_stream(stream)
            return []
        info = await js.stream_info(stream)
        sub = await js.pull_subscribe(subject, stream=stream)
        messages: list[Any] = []
        deadline = time.monotonic() + 10
        while len(messages) < expected and time.monotonic() < deadline:
            batch = await sub.fetch(expected - len(messages), timeout=2)
            for msg in batch:
                await msg.ack()
            messages += batch
        await sub.unsubscribe()
        return [info.state.messages, messages]
    finally:
        await nc.close()


def stream_entries(client: Any, key: str) -> list[tuple[Any, dict[Any, Any]]]:
    """``XRANGE key`` of a Redis stream: (entry id, fields) in order (bytes, or str for a client with
    ``decode_responses``)."""
    return list(client.xrange(key))

