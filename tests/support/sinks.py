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

from pgstream_dagster.devdb import free_port
from pgstream_dagster.sinks import (
    Event,
)

__all__ = ["free_port", "stop_process", "wait_listening"]


REDIS_URL = "redis://127.0.0.1:6379/0"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
NATS_URL = "nats://127.0.0.1:4222"
BASE_TIME = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


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


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Terminate a server process (killed if it does not end within 10 s)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
