"""Sink test helpers: the brokers on loopback, events with varied payloads, unique names, and a
fresh Python process for what must survive pickling."""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pgstream_dagster.devdb import free_port
from pgstream_dagster.sinks import (
    Event,
)

__all__ = ["free_port"]


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


