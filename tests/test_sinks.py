"""Sinks against real destinations: files, a real HTTP server, Redis, RabbitMQ and NATS JetStream on loopback.

Every test counts events end to end: what went in equals what came out, in order.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pika
import pytest
import redis
from pydantic import SecretStr, ValidationError

from pgstream_dagster.config import ConfigError, load_config, parse_config
from pgstream_dagster.sinks import (
    Event,
    FileSink,
    FileSinkConfig,
    HttpSink,
    HttpSinkConfig,
    KafkaSink,
    MemorySink,
    MemorySinkConfig,
    NatsSink,
    NatsSinkConfig,
    RabbitMqSink,
    RabbitMqSinkConfig,
    RedisSink,
    RedisSinkConfig,
    Sink,
    SinkError,
    build_sink,
    parse_sink_config,
)
from pgstream_dagster.sinks.base import dumps

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


def free_port() -> int:
    """A loopback port with nothing listening on it (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    root = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, cwd=root, timeout=60, check=False
    )


# -- config union -------------------------------------------------------------------------------------


def test_config_union_parses_every_type_and_rejects_unknown_keys(tmp_path: Path) -> None:
    cases: dict[str, tuple[dict[str, Any], type[Sink]]] = {
        "memory": ({"type": "memory", "name": "x"}, MemorySink),
        "file": ({"type": "file", "path": str(tmp_path / "f.jsonl")}, FileSink),
        "http": ({"type": "http", "url": "http://127.0.0.1:1/", "headers": {"A": "b"}}, HttpSink),
        "redis": ({"type": "redis", "stream": "s"}, RedisSink),
        "rabbitmq": ({"type": "rabbitmq", "routing_key": "q"}, RabbitMqSink),
        "nats": ({"type": "nats", "subject": "s"}, NatsSink),
        "kafka": ({"type": "kafka", "topic": "t"}, KafkaSink),
    }
    for type_name, (data, sink_class) in cases.items():
        config = parse_sink_config(data)
        assert config.type == type_name  # type: ignore[attr-defined]
        assert pickle.loads(pickle.dumps(config)) == config
        with build_sink(data) as sink:
            assert type(sink) is sink_class
            assert sink.type_name == type_name
            assert pickle.loads(pickle.dumps(sink)).config == config
    with pytest.raises(ValidationError):
        parse_sink_config({"type": "file", "path": "x", "unexpected": 1})
    with pytest.raises(ValidationError):
        parse_sink_config({"type": "carrier-pigeon"})
    with pytest.raises(ValidationError):
        parse_sink_config({"type": "http", "url": "http://x", "mode": "sometimes"})


def test_package_imports_without_optional_client_libraries() -> None:
    code = """
import sys
for name in ("redis", "pika", "nats", "confluent_kafka"):
    sys.modules[name] = None  # makes `import name` raise ImportError
from pgstream_dagster.sinks import SinkError, build_sink, parse_sink_config
assert build_sink({"type": "memory"}).type_name == "memory"
for data, extra in [({"type": "redis", "stream": "s"}, "redis"),
                    ({"type": "rabbitmq", "routing_key": "q"}, "rabbitmq"),
                    ({"type": "nats", "subject": "s"}, "nats"),
                    ({"type": "kafka", "topic": "t"}, "kafka")]:
    config = parse_sink_config(data)
    try:
        config.build()
    except ImportError as exc:
        assert isinstance(exc, SinkError), exc
        assert f"pip install pgstream-dagster[{extra}]" in str(exc), exc
    else:
        raise AssertionError(f"{extra}: no ImportError")
print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == "ok"


# -- memory -------------------------------------------------------------------------------------------


def test_memory_sink_delivers_in_order() -> None:
    name = unique("mem")
    events = make_events(25)
    try:
        with MemorySinkConfig(name=name).build() as sink:
            sink.publish(events[:10])
            sink.publish([])
            sink.publish(events[10:])
        assert MemorySink.delivered(name) == events
        assert MemorySink.delivered(unique("other")) == []
    finally:
        MemorySink.reset(name)
    assert MemorySink.delivered(name) == []


def test_memory_sink_fail_times_raises_then_succeeds() -> None:
    name = unique("mem")
    events = make_events(3)
    sink = build_sink({"type": "memory", "name": name, "fail_times": 2})
    try:
        for attempt in (1, 2):
            with pytest.raises(SinkError) as err:
                sink.publish(events)
            assert "memory" in str(err.value) and "101..103" in str(err.value), attempt
            assert err.value.event_ids == (101, 102, 103)
            assert MemorySink.delivered(name) == []
        sink.publish(events)
        assert MemorySink.delivered(name) == events
        # the failure budget is per name, so a rebuilt sink (a retry) does not fail again
        MemorySinkConfig(name=name, fail_times=2).build().publish(events)
        assert MemorySink.delivered(name) == events + events
    finally:
        MemorySink.reset(name)


def test_memory_sink_reject_ids_rejects_permanently_after_delivering_the_events_before() -> None:
    name = unique("mem")
    events = make_events(5)
    config = MemorySinkConfig(name=name, reject_ids=[103])
    try:
        with config.build() as sink:
            for attempt in (1, 2, 3):  # reject_times 0: every time
                with pytest.raises(SinkError) as err:
                    sink.publish(events if attempt == 1 else events[2:])
                assert err.value.permanent and err.value.event_ids == (103,) and err.value.sink == "memory"
                assert str(err.value).startswith(f"memory sink: event 103: injected permanent rejection {attempt} ")
            assert MemorySink.rejections(name) == {103: 3}
            assert MemorySink.delivered(name) == events[:2]  # the events before it, once; nothing after it
            sink.publish(events[3:])  # the caller set 103 aside and goes on
        assert MemorySink.delivered(name) == events[:2] + events[3:]
    finally:
        MemorySink.reset(name)
    assert MemorySink.rejections(name) == {}


def test_memory_sink_reject_times_rejects_only_the_first_n_times_across_instances() -> None:
    name = unique("mem")
    events = make_events(4)
    config = {"type": "memory", "name": name, "reject_ids": [102, 104], "reject_times": 2, "fail_times": 1}
    try:
        with pytest.raises(SinkError) as err:
            build_sink(config).publish(events)
        assert not err.value.permanent and err.value.event_ids == (101, 102, 103, 104)  # fail_times comes first
        rejected = []
        for _ in range(4):  # a fresh sink each time, like a retried delivery
            with build_sink(config) as sink, pytest.raises(SinkError) as err:
                sink.publish(events[1:])
            assert err.value.permanent
            rejected += err.value.event_ids
        assert rejected == [102, 102, 104, 104]  # 102 twice, then accepted; then 104 twice
        assert MemorySink.rejections(name) == {102: 2, 104: 2}
        build_sink(config).publish(events[1:])
        assert [e.id for e in MemorySink.delivered(name)] == [102, 103, 102, 103, 102, 103, 104]
    finally:
        MemorySink.reset(name)


def test_memory_sink_reject_whole_call_names_every_event_until_published_alone() -> None:
    name = unique("mem")
    events = make_events(3)
    try:
        with MemorySinkConfig(name=name, reject_ids=[102], reject_whole_call=True).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(events)
            assert err.value.permanent and err.value.event_ids == (101, 102, 103)
            assert "events 101..103" in str(err.value) and "event 102" in str(err.value)
            assert MemorySink.delivered(name) == []  # a rejected request delivers nothing
            outcomes = []
            for event in events:  # the caller isolates the bad one
                try:
                    sink.publish([event])
                    outcomes.append("ok")
                except SinkError as exc:
                    outcomes.append(exc.event_ids)
                    assert exc.permanent
        assert outcomes == ["ok", (102,), "ok"]
        assert MemorySink.delivered(name) == [events[0], events[2]]
        assert MemorySink.rejections(name) == {102: 2}
    finally:
        MemorySink.reset(name)


def test_sink_error_permanent_defaults_to_false_and_survives_pickling() -> None:
    events = make_events(2)
    plain = SinkError.for_events("x", events, "down")
    assert plain.permanent is False and plain.event_ids == (101, 102)
    rejected = SinkError.for_events("x", events[1:], "too large: tok3n", ["tok3n"], permanent=True)
    assert str(rejected) == "x sink: event 102: too large: ***"
    copy = pickle.loads(pickle.dumps(rejected))  # a Spark task's error reaches the driver pickled
    assert (type(copy), str(copy), copy.sink, copy.event_ids, copy.permanent) == (
        SinkError, "x sink: event 102: too large: ***", "x", (102,), True)
    assert SinkError("m", permanent=True).permanent


# -- file ---------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    return [json.loads(line) for line in lines]


def test_file_sink_appends_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "events.jsonl"
    events = make_events(12)
    with FileSinkConfig(path=str(path)).build() as sink:
        sink.publish(events[:7])
    rows = read_jsonl(path)
    assert len(rows) == 7
    assert rows == [e.as_json_dict() for e in events[:7]]
    assert list(rows[0]) == ["id", "stream_id", "created_at", "payload", "metadata"]
    assert [datetime.fromisoformat(r["created_at"]) for r in rows] == [e.created_at for e in events[:7]]
    assert rows[0]["payload"]["nested"]["ünïcode"] == "✓"

    # a second sink on the same file appends; publishing nothing writes nothing
    with build_sink({"type": "file", "path": str(path)}) as sink:
        sink.publish([])
        sink.publish(events[7:])
    rows = read_jsonl(path)
    assert [r["id"] for r in rows] == [e.id for e in events]
    assert rows == [e.as_json_dict() for e in events]


def test_file_sink_unwritable_path_raises(tmp_path: Path) -> None:
    with FileSinkConfig(path=str(tmp_path)).build() as sink:  # a directory, not a file
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert "file sink" in str(err.value) and "events 101..102" in str(err.value)
    assert not err.value.permanent


def test_file_sink_disk_full_is_not_a_permanent_rejection() -> None:
    with FileSinkConfig(path="/dev/full").build() as sink:  # every write fails with ENOSPC
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
    assert "No space left on device" in str(err.value) and err.value.event_ids == (101, 102, 103)
    assert not err.value.permanent  # the file system's problem: the same events succeed once there is room


def test_configs_and_sinks_work_in_another_process(tmp_path: Path) -> None:
    path = tmp_path / "child.jsonl"
    events = make_events(9)
    config = FileSinkConfig(path=str(path))
    payload = pickle.dumps((config, FileSink(config), events))
    code = """
import pickle, sys
config, sink, events = pickle.loads(sys.stdin.buffer.read())
with config.build() as built:
    built.publish(events[:4])
with sink:
    sink.publish(events[4:])
"""
    result = run_python(code, payload)
    assert result.returncode == 0, result.stderr.decode()
    assert read_jsonl(path) == [e.as_json_dict() for e in events]


# -- http / webhook -----------------------------------------------------------------------------------

WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"pgstream-test-signing-key-0123456789").decode()
FAST_RETRY: dict[str, Any] = {"initial_backoff_secs": 0.01, "max_backoff_secs": 0.05}


def verify_standard_webhook(secret: str, headers: dict[str, str], body: bytes, tolerance_secs: int = 300) -> bool:
    """Standard Webhooks verification, written from the spec independently of the sink's code."""
    key = base64.b64decode(secret[len("whsec_") :] if secret.startswith("whsec_") else secret)
    msg_id, timestamp = headers.get("webhook-id"), headers.get("webhook-timestamp")
    if not msg_id or not timestamp or abs(time.time() - int(timestamp)) > tolerance_secs:
        return False
    signed = msg_id.encode() + b"." + timestamp.encode() + b"." + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest())
    for candidate in headers.get("webhook-signature", "").split(" "):
        version, _, signature = candidate.partition(",")
        if version == "v1" and hmac.compare_digest(signature.encode(), expected):
            return True
    return False


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: Any
    at: float  # time.monotonic() on arrival
    signature_ok: bool | None = None  # None: the server verifies no signatures


Headers = dict[str, str] | Callable[[], dict[str, str]]


@dataclass
class HttpRecorder:
    """State shared by the test server's handler threads."""

    url: str = ""
    mode: str = "ok"  # ok | fail | sleep
    fail_on_event_id: int | None = None  # with mode "ok": answer fail_status to the request carrying this event id
    fail_status: int = 500  # the status of "fail" answers (their body echoes the Authorization header and path)
    sleep_secs: float = 0.0
    signing_secret: str | None = None  # verify Standard Webhooks signatures; a bad one gets 401
    # webhook-id -> answers to its successive attempts: (status, headers or a function making them)
    script: dict[str, list[tuple[int, Headers]]] = field(default_factory=dict)
    key_field: str | None = None  # payload field holding the routing key (per-key in-flight tracking)
    barrier: threading.Barrier | None = None  # the first `barrier.parties` requests wait for each other
    barrier_left: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    max_in_flight: int = 0
    same_key_overlaps: int = 0
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def by_id(self, msg_id: str) -> list[Received]:
        return [r for r in self.received if r.headers.get("webhook-id") == msg_id]


class _Handler(BaseHTTPRequestHandler):
    server: _RecordingServer
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        rec = self.server.recorder
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        headers = {k.lower(): v for k, v in self.headers.items()}
        body = json.loads(raw)
        signature_ok = verify_standard_webhook(rec.signing_secret, headers, raw) if rec.signing_secret else None
        keys = [str(p[rec.key_field]) for p in (body if isinstance(body, list) else [body])] if rec.key_field else []
        with rec.lock:
            rec.received.append(Received(self.path, headers, body, time.monotonic(), signature_ok))
            for key in set(keys):
                rec.same_key_overlaps += rec.in_flight.get(key, 0)
                rec.in_flight[key] = rec.in_flight.get(key, 0) + 1
            rec.max_in_flight = max(rec.max_in_flight, sum(rec.in_flight.values()))
            wait_at_barrier = rec.barrier is not None and rec.barrier_left > 0
            rec.barrier_left -= wait_at_barrier
            scripted = rec.script.get(headers.get("webhook-id", ""), [])
            answer = scripted.pop(0) if scripted else None
        status, extra, text = self._decide(rec, headers, signature_ok, answer, wait_at_barrier)
        with rec.lock:  # leave the in-flight set before answering: the client may send the next one at once
            for key in set(keys):
                rec.in_flight[key] -= 1
        self._answer(status, text, extra)

    def _decide(
        self,
        rec: HttpRecorder,
        headers: dict[str, str],
        signature_ok: bool | None,
        answer: tuple[int, Headers] | None,
        wait_at_barrier: bool,
    ) -> tuple[int, dict[str, str], str]:
        if wait_at_barrier:
            assert rec.barrier is not None
            try:
                rec.barrier.wait()
            except threading.BrokenBarrierError:
                return 400, {}, "barrier broken: requests were not concurrent"
        if rec.mode == "sleep":
            time.sleep(rec.sleep_secs)
        if signature_ok is False:
            return 401, {}, "bad signature"
        if answer is not None:
            status, extra = answer
            return status, extra() if callable(extra) else extra, f"scripted {status}"
        ids = headers.get("x-pgstream-event-ids", headers.get("x-pgstream-event-id", ""))
        marked = rec.fail_on_event_id is not None and str(rec.fail_on_event_id) in ids.split(",")
        failing = rec.mode == "fail" or marked
        if failing:
            # echo the Authorization header and the path back: the sink must keep them out of its error message
            text = f"boom: database on fire (auth was {headers.get('authorization')} at {self.path})\n" * 20
            return rec.fail_status, {}, text
        return (204 if len(rec.received) % 2 else 200), {}, ""

    def _answer(self, status: int, text: str, extra: dict[str, str]) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        if data:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _RecordingServer(ThreadingHTTPServer):
    daemon_threads = True
    recorder: HttpRecorder

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that time out close their socket mid-answer; that is expected here


@pytest.fixture
def http_server() -> Iterator[HttpRecorder]:
    server = _RecordingServer(("127.0.0.1", 0), _Handler)
    server.recorder = HttpRecorder(url=f"http://127.0.0.1:{server.server_address[1]}/hook")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.recorder
    finally:
        if server.recorder.barrier is not None:
            server.recorder.barrier.abort()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_http_per_event_posts_payloads_in_order(http_server: HttpRecorder) -> None:
    events = make_events(15, stream_id=3)
    config = HttpSinkConfig(url=http_server.url, headers={"Authorization": SecretStr("Bearer t0ken-abc")})
    with config.build() as sink:
        sink.publish(events[:6])
        sink.publish(events[6:])
    received = http_server.received
    assert len(received) == len(events)
    assert [r.body for r in received] == [e.payload for e in events]
    for request, event in zip(received, events, strict=True):
        assert request.path == "/hook"
        assert request.headers["webhook-id"] == str(event.id)
        assert request.headers["idempotency-key"] == str(event.id)
        assert request.headers["x-pgstream-event-id"] == str(event.id)
        assert request.headers["x-pgstream-stream-id"] == "3"
        assert abs(int(request.headers["webhook-timestamp"]) - time.time()) < 300
        assert "webhook-signature" not in request.headers  # no signing secret configured
        assert request.headers["authorization"] == "Bearer t0ken-abc"
        assert request.headers["content-type"] == "application/json"


def test_http_batch_mode_chunks_in_order_and_event_bodies(http_server: HttpRecorder) -> None:
    events = make_events(10)
    config = HttpSinkConfig(url=http_server.url, mode="batch", max_batch_size=4)
    with config.build() as sink:
        sink.publish(events)
    received = http_server.received
    assert [len(r.body) for r in received] == [4, 4, 2]
    assert [p for r in received for p in r.body] == [e.payload for e in events]
    assert [r.headers["x-pgstream-event-ids"] for r in received] == [
        "101,102,103,104",
        "105,106,107,108",
        "109,110",
    ]
    assert [r.headers["webhook-id"] for r in received] == ["101-104", "105-108", "109-110"]

    http_server.received.clear()
    with build_sink({"type": "webhook", "url": http_server.url, "body": "event"}) as sink:
        sink.publish(events[:3])
    assert [r.body for r in http_server.received] == [json.loads(dumps(e.as_json_dict())) for e in events[:3]]


def test_http_500_is_retried_then_names_event_status_and_attempts(http_server: HttpRecorder) -> None:
    events = make_events(6)
    http_server.fail_on_event_id = 103
    with HttpSinkConfig(url=http_server.url, max_attempts=3, **FAST_RETRY).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    message = str(err.value)
    assert "http sink" in message and "event 103" in message
    assert "500" in message and "database on fire" in message and "gave up after 3 attempts" in message
    assert len(message) < 700  # only an excerpt of the body
    assert err.value.event_ids == (103,)
    # events before the failure were delivered in order, 103 was tried 3 times, nothing after it
    assert [r.body["seq"] for r in http_server.received] == [0, 1, 2, 2, 2]


def test_http_batch_500_names_the_id_range(http_server: HttpRecorder) -> None:
    http_server.fail_on_event_id = 106
    config = HttpSinkConfig(url=http_server.url, mode="batch", max_batch_size=4, max_attempts=1)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(10))
    assert "events 105..108" in str(err.value) and "HTTP 500" in str(err.value)
    assert err.value.event_ids == (105, 106, 107, 108)
    assert [len(r.body) for r in http_server.received] == [4, 4]


def test_http_timeout_raises(http_server: HttpRecorder) -> None:
    http_server.mode, http_server.sleep_secs = "sleep", 3
    started = time.monotonic()
    with HttpSinkConfig(url=http_server.url, timeout_secs=0.3, max_attempts=1).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
    assert time.monotonic() - started < 2.9  # the sink gave up before the server answered
    assert "event 101" in str(err.value) and "timed out" in str(err.value)
    assert len(http_server.received) == 1
    assert not err.value.permanent


def test_http_connection_refused_is_retried_then_raises() -> None:
    url = f"http://127.0.0.1:{free_port()}/hook"
    config = HttpSinkConfig(url=url, mode="batch", timeout_secs=2, max_attempts=3, **FAST_RETRY)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(5))
    message = str(err.value)
    assert "events 101..105" in message and "connection failed" in message.lower()
    assert "refused" in message.lower() and "gave up after 3 attempts" in message
    assert not err.value.permanent
    assert f"127.0.0.1:{urlsplit(url).port}/hook" in message  # names the target


def test_http_dead_endpoint_fails_within_the_time_budget() -> None:
    url = f"http://127.0.0.1:{free_port()}/hook"
    config = HttpSinkConfig(url=url, max_attempts=100_000, max_retry_secs=1, **FAST_RETRY)
    started = time.monotonic()
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(50))
    assert time.monotonic() - started < 30  # bounded by max_retry_secs, not by 100k attempts
    attempts = int(re.search(r"gave up after (\d+) attempts", str(err.value)).group(1))  # type: ignore[union-attr]
    assert 1 < attempts < 100_000
    assert err.value.event_ids == (101,) and "50 events not confirmed" in str(err.value)


def test_http_retries_5xx_but_not_other_4xx(http_server: HttpRecorder) -> None:
    events = make_events(4)
    http_server.script["102"] = [(500, {}), (502, {}), (503, {})]  # 503 without Retry-After: plain backoff
    with HttpSinkConfig(url=http_server.url, max_attempts=4, **FAST_RETRY).build() as sink:
        sink.publish(events)
        ids = [r.headers["webhook-id"] for r in http_server.received]
        assert ids == ["101", "102", "102", "102", "102", "103", "104"]
        # every attempt is signed afresh with its own timestamp; the body and id stay the same
        assert len({json.dumps(r.body) for r in http_server.by_id("102")}) == 1

        http_server.received.clear()
        http_server.script["106"] = [(422, {}), (200, {})]
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(4, first_id=105))
    assert [r.headers["webhook-id"] for r in http_server.received] == ["105", "106"]  # 422 once, nothing after
    assert "event 106" in str(err.value) and "HTTP 422" in str(err.value) and "gave up" not in str(err.value)
    assert err.value.event_ids == (106,) and err.value.permanent


def test_http_honours_retry_after_seconds_and_http_date(http_server: HttpRecorder) -> None:
    def in_two_seconds() -> dict[str, str]:  # an HTTP date has whole seconds: at least 1s from now
        return {"Retry-After": format_datetime(datetime.now(UTC) + timedelta(seconds=2), usegmt=True)}

    http_server.script["101"] = [(429, {"Retry-After": "1"})]
    http_server.script["102"] = [(503, in_two_seconds)]
    with HttpSinkConfig(url=http_server.url, **FAST_RETRY).build() as sink:
        sink.publish(make_events(3))
    assert [r.headers["webhook-id"] for r in http_server.received] == ["101", "101", "102", "102", "103"]
    # backoff alone would wait at most 0.05s: the gaps come from Retry-After
    for msg_id in ("101", "102"):
        first, second = http_server.by_id(msg_id)
        assert second.at - first.at >= 0.9, msg_id


def test_http_retry_after_beyond_budget_fails_at_once(http_server: HttpRecorder) -> None:
    http_server.script["101"] = [(503, {"Retry-After": "3600"})]
    started = time.monotonic()
    with HttpSinkConfig(url=http_server.url, max_retry_secs=20, **FAST_RETRY).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert time.monotonic() - started < 15
    assert "HTTP 503" in str(err.value) and "Retry-After 3600s is beyond the 20s budget" in str(err.value)
    assert len(http_server.received) == 1


@pytest.mark.parametrize("mode", ["per_event", "batch"])
def test_http_parallel_keys_keep_per_key_order(http_server: HttpRecorder, mode: str) -> None:
    groups = ["g0", "g1", "g2", "g3"]
    events = [
        Event(id=500 + i, stream_id=1, payload={"seq": i, "g": groups[i % 4], "meta": {"group": groups[i % 4]}},
              metadata=None, created_at=BASE_TIME)
        for i in range(48)
    ]
    http_server.key_field = "g"
    # the first 4 requests only get an answer once 4 are in flight at the same time
    http_server.barrier, http_server.barrier_left = threading.Barrier(4, timeout=60), 4
    config = HttpSinkConfig(url=http_server.url, routing_key="meta.group", max_concurrency=4, mode=mode,
                            max_batch_size=5, max_attempts=1)
    with config.build() as sink:
        sink.publish(events)
    received = [p for r in http_server.received for p in (r.body if mode == "batch" else [r.body])]
    assert sorted(p["seq"] for p in received) == list(range(48))  # each event exactly once
    for group in groups:
        sent = [e.payload["seq"] for e in events if e.payload["g"] == group]
        assert [p["seq"] for p in received if p["g"] == group] == sent
    assert http_server.max_in_flight == 4  # parallel, and never above max_concurrency
    assert http_server.same_key_overlaps == 0  # one key never has two requests in flight
    if mode == "batch":
        assert all(len({p["g"] for p in r.body}) == 1 for r in http_server.received)  # a batch is one key


def test_http_one_failing_key_fails_publish_and_stops_that_key(http_server: HttpRecorder) -> None:
    events = [
        Event(id=700 + i, stream_id=1, payload={"seq": i, "g": "ab"[i % 2]}, metadata=None, created_at=BASE_TIME)
        for i in range(20)
    ]
    http_server.script["705"] = [(400, {})]  # key "b", its third event
    config = HttpSinkConfig(url=http_server.url, routing_key="g", max_concurrency=2, **FAST_RETRY)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert "event 705" in str(err.value) and "HTTP 400" in str(err.value)
    assert 705 in err.value.event_ids
    b_ids = [int(r.headers["webhook-id"]) for r in http_server.received if r.body["g"] == "b"]
    assert b_ids == [701, 703, 705]  # in order, nothing of key b after the failure
    a_ids = [int(r.headers["webhook-id"]) for r in http_server.received if r.body["g"] == "a"]
    assert a_ids == list(range(700, 700 + 2 * len(a_ids), 2))  # key a in order (possibly stopped early)


PERMANENT_STATUSES = [400, 409, 412, 413, 422]
CONFIG_STATUSES = [301, 401, 403, 404, 405, 407, 410, 415, 421, 426, 431]


@pytest.mark.parametrize("status", PERMANENT_STATUSES + CONFIG_STATUSES + [500, 503])
def test_http_rejection_classes(http_server: HttpRecorder, status: int) -> None:
    """A 4xx about the request's content is a permanent rejection of that event, after the events
    before it were confirmed; a 4xx about the configuration (credentials, URL...), a 3xx or a 5xx
    is not. The message stays scrubbed either way."""
    token = "hook-t0ken-" + uuid.uuid4().hex[:8]
    http_server.fail_on_event_id, http_server.fail_status = 103, status
    config = HttpSinkConfig(url=http_server.url, headers={"Authorization": SecretStr(token)}, max_attempts=1)
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(5))
    assert err.value.permanent is (status in PERMANENT_STATUSES)
    assert err.value.event_ids == (103,) and f"HTTP {status}" in str(err.value)
    assert [r.headers["webhook-id"] for r in http_server.received] == ["101", "102", "103"]  # 101, 102 confirmed
    assert http_server.received[-1].headers["authorization"] == token  # echoed by the server...
    assert token not in str(err.value) and "database on fire" in str(err.value)  # ...and masked


@pytest.mark.parametrize("status", [408, 429])
def test_http_408_and_429_are_retried_not_rejected(http_server: HttpRecorder, status: int) -> None:
    http_server.script["102"] = [(status, {})]
    with HttpSinkConfig(url=http_server.url, **FAST_RETRY).build() as sink:
        sink.publish(make_events(3))
    assert [r.headers["webhook-id"] for r in http_server.received] == ["101", "102", "102", "103"]

    http_server.received.clear()
    http_server.script["104"] = [(status, {}), (status, {})]
    with HttpSinkConfig(url=http_server.url, max_attempts=2, **FAST_RETRY).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2, first_id=104))
    assert not err.value.permanent and "gave up after 2 attempts" in str(err.value)


def test_http_batch_rejected_as_a_whole_names_its_events_then_one_at_a_time_isolates_the_bad_one(
        http_server: HttpRecorder) -> None:
    http_server.fail_on_event_id, http_server.fail_status = 106, 400
    events = make_events(10)
    config = HttpSinkConfig(url=http_server.url, mode="batch", max_batch_size=4, max_attempts=1)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
        assert err.value.permanent and err.value.event_ids == (105, 106, 107, 108)  # the rejected request
        assert "events 105..108" in str(err.value) and "HTTP 400" in str(err.value)
        assert [r.headers["webhook-id"] for r in http_server.received] == ["101-104", "105-108"]
        outcomes: dict[int, tuple[int, ...] | None] = {}
        for event in events[4:8]:  # what the caller does: one at a time
            try:
                sink.publish([event])
                outcomes[event.id] = None
            except SinkError as exc:
                assert exc.permanent
                outcomes[event.id] = exc.event_ids
    assert outcomes == {105: None, 106: (106,), 107: None, 108: None}


def test_http_max_body_bytes_refuses_an_oversized_event_without_sending_it(http_server: HttpRecorder) -> None:
    events = make_events(6)
    big = Event(id=104, stream_id=7, payload={"blob": "x" * 2000}, created_at=BASE_TIME)
    events[3] = big
    with HttpSinkConfig(url=http_server.url, max_body_bytes=1000).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert err.value.permanent and err.value.event_ids == (104,)
    assert f"not sent: the body is {len(big.payload_json)} bytes, more than max_body_bytes (1000)" in str(err.value)
    assert [r.headers["webhook-id"] for r in http_server.received] == ["101", "102", "103"]  # 104 never sent


def test_http_batch_is_cut_to_max_body_bytes_and_only_an_event_too_large_alone_is_refused(
        http_server: HttpRecorder) -> None:
    events = [Event(id=200 + i, stream_id=1, payload={"pad": "y" * 80}, created_at=BASE_TIME) for i in range(10)]
    size = len(events[0].payload_json)  # every payload has this size
    limit = 2 + 3 * size + 2  # three payloads in a JSON array, and no more
    config = HttpSinkConfig(url=http_server.url, mode="batch", max_batch_size=5, max_body_bytes=limit)
    with config.build() as sink:
        sink.publish(events)
        bodies = [r.body for r in http_server.received]
        assert [len(b) for b in bodies] == [3, 3, 3, 1]
        assert [p for b in bodies for p in b] == [e.payload for e in events]

        http_server.received.clear()
        big = Event(id=300, stream_id=1, payload={"pad": "z" * (limit)}, created_at=BASE_TIME)
        with pytest.raises(SinkError) as err:
            sink.publish([*events[:4], big, *events[4:6]])
    assert err.value.permanent and err.value.event_ids == (300,)  # alone in its request: exactly that event
    assert [r.headers["x-pgstream-event-ids"] for r in http_server.received] == ["200,201,202", "203"]


def test_http_permanent_rejection_lets_the_other_keys_send_what_comes_before_it(http_server: HttpRecorder) -> None:
    events = [
        Event(id=700 + i, stream_id=1, payload={"seq": i, "g": "ab"[i % 2]}, metadata=None, created_at=BASE_TIME)
        for i in range(12)
    ]
    http_server.script["703"] = [(422, {})]  # key "b", its second event
    # key "a" waits a second before its first retry: "b" is rejected meanwhile, yet "a" goes on up to 702
    http_server.script["700"] = [(503, {"Retry-After": "1"})]
    config = HttpSinkConfig(url=http_server.url, routing_key="g", max_concurrency=2, **FAST_RETRY)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert err.value.permanent and err.value.event_ids == (703,) and "HTTP 422" in str(err.value)
    sent = [int(r.headers["webhook-id"]) for r in http_server.received]
    assert {700, 701, 702} <= set(sent)  # every event before the rejected one was confirmed
    assert [i for i in sent if i % 2] == [701, 703]  # nothing of key b after it
    assert sent.count(703) == 1  # a permanent rejection is not retried


def test_http_a_failure_before_a_permanent_rejection_makes_the_publish_not_permanent(
        http_server: HttpRecorder) -> None:
    events = [
        Event(id=700 + i, stream_id=1, payload={"seq": i, "g": "ab"[i % 2]}, metadata=None, created_at=BASE_TIME)
        for i in range(6)
    ]
    http_server.script["700"] = [(500, {})]  # key a, the first event: not confirmed
    http_server.script["701"] = [(422, {})]  # key b: rejected
    config = HttpSinkConfig(url=http_server.url, routing_key="g", max_concurrency=2, max_attempts=1)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert not err.value.permanent and 700 in err.value.event_ids


def test_http_standard_webhooks_signatures_verify(http_server: HttpRecorder) -> None:
    http_server.signing_secret = WEBHOOK_SECRET
    events = make_events(6)
    with HttpSinkConfig(url=http_server.url, signing_secret=SecretStr(WEBHOOK_SECRET)).build() as sink:
        sink.publish(events)
    with HttpSinkConfig(url=http_server.url, signing_secret=SecretStr(WEBHOOK_SECRET), mode="batch").build() as sink:
        sink.publish(events)
    assert len(http_server.received) == 7
    assert all(r.signature_ok for r in http_server.received)
    assert all(r.headers["webhook-signature"].startswith("v1,") for r in http_server.received)

    # a sink with another secret is refused (401 is not retried): the verification really checks
    http_server.received.clear()
    other = "whsec_" + base64.b64encode(b"another-signing-key-abcdefghijkl").decode()
    with HttpSinkConfig(url=http_server.url, signing_secret=SecretStr(other), **FAST_RETRY).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert "HTTP 401" in str(err.value) and len(http_server.received) == 1
    assert not err.value.permanent  # a wrong secret would reject every event: not the event's fault
    assert http_server.received[0].signature_ok is False


def test_http_signing_secret_from_environment(
    http_server: HttpRecorder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_WEBHOOK_SECRET", WEBHOOK_SECRET)
    path = tmp_path / "pgstream.yaml"
    path.write_text(
        "database_url: ${TEST_PG_URL}\n"
        "streams:\n"
        f"  - {{id: 1, sink: {{type: webhook, url: '{http_server.url}',\n"
        "                     signing_secret: '${TEST_WEBHOOK_SECRET}'}}\n"
    )
    config = load_config(path)
    sink_config = config.stream(1).sink
    assert WEBHOOK_SECRET not in repr(config) and WEBHOOK_SECRET not in repr(sink_config)
    http_server.signing_secret = WEBHOOK_SECRET
    with sink_config.build() as sink:
        sink.publish(make_events(3))
    assert [r.signature_ok for r in http_server.received] == [True, True, True]


def test_http_signing_secret_is_validated_without_echo() -> None:
    bad = "whsec_this is not base64 at all!"
    with pytest.raises(ValidationError) as err:
        parse_sink_config({"type": "webhook", "url": "http://127.0.0.1:1/", "signing_secret": bad})
    assert "signing_secret" in str(err.value) and bad not in str(err.value)
    with pytest.raises(ValidationError) as err:
        HttpSinkConfig(url="http://127.0.0.1:1/", signing_secret=SecretStr("whsec_c2hvcnQ="))
    assert "too short" in str(err.value)
    with pytest.raises(ValidationError):
        HttpSinkConfig(url="ftp://127.0.0.1/")
    # the prefix is optional, the key is the base64-decoded bytes
    raw = base64.b64encode(b"k" * 32).decode()
    assert HttpSinkConfig(url="http://x/", signing_secret=SecretStr(raw)).signing_secret is not None


def test_http_secrets_never_leak(http_server: HttpRecorder, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "Bearer s3cr3t-" + uuid.uuid4().hex
    query_token = "qt0ken" + uuid.uuid4().hex[:8]
    http_server.mode = "fail"
    config = HttpSinkConfig(
        url=f"{http_server.url}?token={query_token}",
        headers={"Authorization": SecretStr(secret), "X-Api-Key": SecretStr("k3y-42")},
        signing_secret=SecretStr(WEBHOOK_SECRET),
        max_attempts=2,
        **FAST_RETRY,
    )
    raw_key = WEBHOOK_SECRET.removeprefix("whsec_")
    secrets = [secret, "s3cr3t", "k3y-42", query_token, raw_key]
    for text in (repr(config), str(config), config.model_dump_json(), repr(config.build())):
        assert not [s for s in secrets if s in text]
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(1))
    # the server really got (and echoed) the secret; the error message and the logs mask it
    assert http_server.received[0].headers["authorization"] == secret
    assert len(http_server.received) == 2 and "attempt 1 failed" in caplog.text  # the retry was logged
    for text in (str(err.value), repr(err.value), caplog.text):
        assert not [s for s in secrets if s in text], text
    assert "***" in str(err.value) and "event 101" in str(err.value)

    refused_url = f"http://127.0.0.1:{free_port()}/?token={query_token}"
    auth = {"Authorization": SecretStr(secret)}
    refused = HttpSinkConfig(url=refused_url, headers=auth, max_attempts=2, **FAST_RETRY)
    with refused.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(1))
    for text in (str(err.value), caplog.text):
        assert not [s for s in secrets if s in text], text


def test_http_config_secret_survives_pickling_into_another_process(http_server: HttpRecorder) -> None:
    config = HttpSinkConfig(url=http_server.url, headers={"Authorization": SecretStr("Bearer pickled")})
    events = make_events(4)
    code = """
import pickle, sys
config, events = pickle.loads(sys.stdin.buffer.read())
with config.build() as sink:
    sink.publish(events)
"""
    result = run_python(code, pickle.dumps((config, events)))
    assert result.returncode == 0, result.stderr.decode()
    assert [r.body for r in http_server.received] == [e.payload for e in events]
    assert {r.headers["authorization"] for r in http_server.received} == {"Bearer pickled"}


# -- http: secrets in headers and URL paths ---------------------------------------------------------


def escaped(value: str) -> list[str]:
    """``value`` and the escaped forms a library message may show it in (``'tok\\n'``, ``b'tok\\n'``)."""
    return [value, repr(value)[1:-1], repr(value.encode())[2:-1]]


def assert_nowhere(secrets: list[str], *texts: str) -> None:
    for text in texts:
        found = [s for secret in secrets for s in escaped(secret) if s in text]
        assert not found, (found, text)


@pytest.mark.parametrize("ending", ["\n", "\r\n", " \r\n\n"])
def test_http_header_secret_loses_its_trailing_newline_and_never_leaks(
    http_server: HttpRecorder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    ending: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    token = "t0k-" + uuid.uuid4().hex
    raw = f"Bearer {token}{ending}"  # as read from a file-mounted secret
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_HOOK_TOKEN", raw)
    monkeypatch.setenv("TEST_HOOK_URL", http_server.url + ending)  # the URL may come from a file too
    path = tmp_path / "pgstream.yaml"
    path.write_text(
        "database_url: ${TEST_PG_URL}\n"
        "streams:\n"
        "  - {id: 1, sink: {type: http, url: '${TEST_HOOK_URL}', max_attempts: 2, initial_backoff_secs: 0.01,\n"
        "                   headers: {Authorization: '${TEST_HOOK_TOKEN}', X-Plain: '  spaced\tvalue  '}}}\n"
    )
    config = load_config(path)
    sink_config = config.stream(1).sink
    assert isinstance(sink_config, HttpSinkConfig)
    assert sink_config.headers["Authorization"].get_secret_value() == f"Bearer {token}"
    assert sink_config.headers["X-Plain"].get_secret_value() == "spaced\tvalue"  # a tab inside is legal HTTP
    assert sink_config.url.get_secret_value() == http_server.url
    with sink_config.build() as sink:
        sink.publish(make_events(2))
        http_server.mode = "fail"  # the server echoes the Authorization header in its error body
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(1, first_id=200))
        sink_repr = repr(sink)
    assert [r.headers["authorization"] for r in http_server.received] == [f"Bearer {token}"] * 4
    assert "event 200" in str(err.value) and "HTTP 500" in str(err.value) and "***" in str(err.value)
    assert "attempt 1 failed" in caplog.text  # the retry was logged
    assert_nowhere([raw, raw.strip(), token], str(err.value), repr(err.value), repr(config), str(config),
                   repr(sink_config), str(sink_config), sink_config.model_dump_json(), sink_repr, caplog.text)


@pytest.mark.parametrize("value", [
    "Bearer abc\r\nX-Injected: 1", "abc\ndef", "abc\rdef", "abc\x00def", "abc\x7fdef", "\nabc", "abc\x1b[31m",
])
def test_http_header_with_a_control_character_inside_is_refused_naming_the_header(value: str) -> None:
    with pytest.raises(ValidationError) as err:
        HttpSinkConfig(url="http://127.0.0.1:1/", headers={"X-Api-Key": SecretStr(value)})
    message = str(err.value)
    assert "header 'X-Api-Key'" in message and "control character" in message
    assert_nowhere([value, "abc", "def", "X-Injected"], message, repr(err.value))

    data = {"database_url": "postgresql://x",
            "streams": [{"id": 1, "sink": {"type": "http", "url": "http://127.0.0.1:1/",
                                           "headers": {"X-Api-Key": value}}}]}
    with pytest.raises(ConfigError) as config_err:
        parse_config(data, "pgstream.yaml")
    message = str(config_err.value)
    assert "pgstream.yaml: streams[0].sink.headers: " in message and "header 'X-Api-Key'" in message
    assert_nowhere([value, "abc", "def", "X-Injected"], message, repr(config_err.value))


@pytest.mark.parametrize("name", ["Bad Name", "X-Colon:", "Ümlaut", "", "X-A\r\nX-B", "(comment)", 'Say"hi"'])
def test_http_header_names_must_be_http_tokens(name: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_sink_config({"type": "http", "url": "http://127.0.0.1:1/", "headers": {name: "v4lue-s3cret"}})
    assert f"header name {name!r} is not a valid HTTP header name" in str(err.value)
    assert "v4lue-s3cret" not in str(err.value)
    token_chars = "!#$%&'*+-.^_`|~09azAZ"
    assert HttpSinkConfig(url="http://x/", headers={token_chars: SecretStr("v")}).headers[token_chars]


def test_http_non_ascii_header_value_is_refused_at_config_time_without_echo() -> None:
    value = "Bearer tök-" + uuid.uuid4().hex
    with pytest.raises(ValidationError) as err:
        HttpSinkConfig(url="http://127.0.0.1:1/", headers={"Authorization": SecretStr(value)})
    assert "header 'Authorization'" in str(err.value) and "non-ASCII" in str(err.value)
    assert_nowhere([value, value[-32:]], str(err.value), repr(err.value))


def test_http_unvalidated_non_ascii_header_gives_a_sink_error_not_a_unicode_error(
    http_server: HttpRecorder, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    value = "Bearer tök-" + uuid.uuid4().hex
    # model_construct skips validation: the send-time guard must still hold
    config = HttpSinkConfig.model_construct(url=SecretStr(http_server.url), headers={"X-Token": SecretStr(value)})
    for concurrency in (1, 4):  # inline, and inside the thread pool of parallel routing keys
        sink = config.model_copy(update={"max_concurrency": concurrency, "routing_key": "name"}).build()
        with sink, pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
        assert type(err.value) is SinkError
        assert "header 'X-Token' has a non-ASCII value" in str(err.value)
        assert re.search(r"http sink: event 10[123]: POST ", str(err.value)), str(err.value)
        assert err.value.__cause__ is None and err.value.__context__ is None
        assert_nowhere([value, value[-32:]], str(err.value), repr(err.value), caplog.text)
    assert http_server.received == []  # nothing was sent


SLACK_PATH = "/services/T0PGSTREAM/B0PGSTREAM/" + "Xk9" * 8
DISCORD_PATH = "/api/webhooks/123456789012345678/" + "aB3-_" * 13


@pytest.mark.parametrize(("path", "shown"), [(SLACK_PATH, "/services/***"), (DISCORD_PATH, "/api/webhooks/***")])
def test_http_url_path_tokens_are_masked_in_messages_reprs_and_logs(
    http_server: HttpRecorder, caplog: pytest.LogCaptureFixture, path: str, shown: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    base = http_server.url.removesuffix("/hook")
    url = base + path
    config = HttpSinkConfig(url=url, max_attempts=2, **FAST_RETRY)
    tokens = [segment for segment in path.split("/") if len(segment) >= 8 and segment not in ("services", "webhooks")]
    secrets = [url, path, *tokens]
    with config.build() as sink:
        sink.publish(make_events(1))
        http_server.mode = "fail"  # the error body echoes the request path
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(1, first_id=300))
        sink_repr = repr(sink)
    assert [r.path for r in http_server.received] == [path] * 3  # the real URL was used
    message = str(err.value)
    assert f"POST {base}{shown} answered HTTP 500" in message and f"at {shown.removesuffix('***')}***)" in message
    assert f"{base}{shown}" in caplog.text  # httpx's request log line, redacted
    assert_nowhere(secrets, message, repr(err.value), repr(config), str(config), config.model_dump_json(),
                   sink_repr, caplog.text)

    refused = base.rsplit(":", 1)[0] + f":{free_port()}" + path  # httpx's own errors
    with HttpSinkConfig(url=refused, max_attempts=1).build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(1))
    assert "connection failed" in str(err.value) and shown in str(err.value)
    assert_nowhere([refused, *tokens], str(err.value), repr(err.value), caplog.text)


@pytest.mark.parametrize(("url", "redacted", "secrets"), [
    ("https://hooks.slack.com/services/T0ABCDEFG/B0ABCDEFG/xoxb1234567890abcdefghij",
     "https://hooks.slack.com/services/***",
     ["T0ABCDEFG/B0ABCDEFG/xoxb1234567890abcdefghij", "T0ABCDEFG", "B0ABCDEFG", "xoxb1234567890abcdefghij"]),
    ("https://discord.com/api/webhooks/123456789012345678/abcDEF-ghi_jkl",
     "https://discord.com/api/webhooks/***", ["123456789012345678/abcDEF-ghi_jkl", "123456789012345678"]),
    ("https://api.telegram.org/bot123456:ABC-DEF1234/sendMessage", "https://api.telegram.org/***",
     ["bot123456:ABC-DEF1234/sendMessage", "bot123456:ABC-DEF1234", "sendMessage"]),
    ("https://u:pw%40x@h.example:8443/v1/events/ingest?key=q%20s#frag", "https://h.example:8443/v1/events/ingest",
     ["pw%40x", "pw@x", "key=q%20s", "key=q s", "frag"]),
    ("https://example.com/hooks/abcdefghijklmnopqrstuvwxyz", "https://example.com/hooks/***",
     ["abcdefghijklmnopqrstuvwxyz"]),  # 16+ characters: masked even when lower case
    ("https://example.com/Hook/x", "https://example.com/***", ["Hook/x"]),
    ("http://[::1]:8080/hook/", "http://[::1]:8080/hook/", []),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080", []),
    ("redis://:pw@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", ["pw"]),  # other schemes keep their path
    ("amqp://guest:guest@127.0.0.1:5672/%2F", "amqp://127.0.0.1:5672/%2F", ["guest"]),
])
def test_redact_url_masks_path_tokens_and_url_secrets_lists_them(url: str, redacted: str, secrets: list[str]) -> None:
    from pgstream_dagster.sinks.base import redact_url, scrub, url_secrets

    assert redact_url(url) == redacted
    listed = url_secrets(url)
    assert [s for s in secrets if s not in listed] == []
    assert (url in listed) == (redacted != url)
    text = f"GET {url} failed; path {urlsplit(url).path}; " + "; ".join(secrets)
    assert_nowhere(secrets, scrub(text, listed))
    if redacted != url:
        assert url not in scrub(text, listed)


def test_scrub_masks_escaped_forms_and_describe_exception_never_cuts_a_secret() -> None:
    from pgstream_dagster.sinks.base import describe_exception, scrub

    secret = "tök\r\nen"
    text = f"Illegal header value {secret.encode()!r}; also {secret!r} and {secret}"
    assert scrub(text, [secret]) == "Illegal header value b'***'; also '***' and ***"
    spaced = "two  spaces  " + uuid.uuid4().hex  # excerpt() collapses whitespace: scrub must come first
    described = describe_exception(RuntimeError("x" * 180 + spaced), [spaced])
    assert described.endswith("***") and "two spaces" not in described and spaced[-8:] not in described


# -- redis --------------------------------------------------------------------------------------------


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


def test_redis_sink_xadds_in_order(redis_client: redis.Redis) -> None:
    key = unique("pgstream-test")
    events = make_events(40)
    try:
        with RedisSinkConfig(stream=key).build() as sink:
            sink.publish(events[:25])
            sink.publish(events[25:])
        entries = redis_client.xrange(key)
        assert len(entries) == len(events)
        assert redis_client.xlen(key) == len(events)
        for (_entry_id, fields), event in zip(entries, events, strict=True):
            assert fields[b"id"] == str(event.id).encode()
            assert fields[b"stream_id"] == b"7"
            assert json.loads(fields[b"payload"]) == event.payload
            assert datetime.fromisoformat(fields[b"created_at"].decode()) == event.created_at
            assert json.loads(fields.get(b"metadata", b"null")) == event.metadata
    finally:
        redis_client.delete(key)


def test_redis_stream_from_payload_path_and_maxlen(redis_client: redis.Redis) -> None:
    prefix = unique("pgstream-test") + ":"
    fallback = prefix + "fallback"
    tenants = ["acme", "globex", None]  # None: no tenant in the payload -> the fallback stream
    events = [
        Event(id=900 + i, stream_id=2, payload={"seq": i, "data": {"tenant": tenants[i % 3]} if tenants[i % 3] else {}},
              metadata=None, created_at=BASE_TIME)
        for i in range(30)
    ]
    config = RedisSinkConfig(stream=fallback, stream_from="data.tenant", stream_prefix=prefix)
    try:
        with config.build() as sink:
            sink.publish(events)
        for tenant, name in (("acme", prefix + "acme"), ("globex", prefix + "globex"), (None, fallback)):
            expected = [str(e.id).encode() for e in events if e.payload["data"].get("tenant") == tenant]
            assert [f[b"id"] for _, f in redis_client.xrange(name)] == expected, name

        capped = prefix + "capped"
        with RedisSinkConfig(stream=capped, maxlen=7, maxlen_approximate=False).build() as sink:
            sink.publish(events)
        assert [f[b"id"] for _, f in redis_client.xrange(capped)] == [str(e.id).encode() for e in events[-7:]]

        # no tenant and no fallback: a permanent rejection of that event, after the events before it
        strict = RedisSinkConfig(stream_from="data.tenant", stream_prefix=prefix + "strict:")
        with strict.build() as sink, pytest.raises(SinkError) as err:
            sink.publish(events[:6])
        assert "event 902" in str(err.value) and "'data.tenant' is missing" in str(err.value)
        assert err.value.permanent and err.value.event_ids == (902,)
        assert sorted(redis_client.keys(prefix + "strict:*")) == [f"{prefix}strict:{t}".encode() for t in tenants[:2]]
        assert [f[b"id"] for _, f in redis_client.xrange(prefix + "strict:acme")] == [b"900"]  # 903: not sent
    finally:
        for name in redis_client.keys(prefix + "*"):
            redis_client.delete(name)
    with pytest.raises(ValidationError):
        RedisSinkConfig()


def test_redis_sink_errors_are_sink_errors(redis_client: redis.Redis) -> None:
    key = unique("pgstream-test")
    redis_client.set(key, "not a stream")
    try:
        with RedisSinkConfig(stream=key).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(make_events(3))
        assert "redis sink" in str(err.value) and "events 101..103" in str(err.value)
        assert "WRONGTYPE" in str(err.value) and not err.value.permanent  # the key's fault, not the events'
    finally:
        redis_client.delete(key)

    port = free_port()
    url = SecretStr(f"redis://:hunter2pw@127.0.0.1:{port}/0")
    config = RedisSinkConfig(url=url, stream=key, timeout_secs=2)
    assert "hunter2pw" not in repr(config)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(1))
    assert "event 101" in str(err.value) and "hunter2pw" not in str(err.value)
    assert f"redis://127.0.0.1:{port}/0" in str(err.value) and "refused" in str(err.value).lower()
    assert not err.value.permanent
    assert redis_client.exists(key) == 0  # nothing was written anywhere


def test_redis_max_message_bytes_rejects_a_large_entry_after_sending_the_ones_before(
        redis_client: redis.Redis) -> None:
    key = unique("pgstream-test")
    events = make_events(5)
    events[2] = Event(id=103, stream_id=7, payload={"blob": "x" * 3000}, created_at=BASE_TIME)
    try:
        with RedisSinkConfig(stream=key, max_message_bytes=1000).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(events)
            assert err.value.permanent and err.value.event_ids == (103,)
            assert f"event 103: not sent to stream {key!r}: the entry is " in str(err.value)
            assert "more than max_message_bytes (1000)" in str(err.value)
            assert [f[b"id"] for _, f in redis_client.xrange(key)] == [b"101", b"102"]  # confirmed; 104: not sent
            sink.publish(events[3:])  # the caller set 103 aside
        assert [f[b"id"] for _, f in redis_client.xrange(key)] == [b"101", b"102", b"104", b"105"]

        redis_client.delete(key)
        chunked = RedisSinkConfig(stream=key, max_message_bytes=1000).build()
        chunked.chunk_size = 3  # type: ignore[misc]  # the 4 events before the rejected one: two transactions
        more = make_events(7, first_id=201)
        more[4] = events[2]
        with chunked, pytest.raises(SinkError) as err:
            chunked.publish(more)
        assert err.value.permanent and err.value.event_ids == (103,)
        assert [f[b"id"] for _, f in redis_client.xrange(key)] == [b"201", b"202", b"203", b"204"]

        # rejected before anything is sent: no connection, and the URL's password stays out of the message
        url = SecretStr("redis://:r3dis-pw-9@127.0.0.1:6379/0")
        with RedisSinkConfig(url=url, stream=key, max_message_bytes=1000).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(events[2:])
        assert err.value.permanent and err.value.event_ids == (103,) and "r3dis-pw-9" not in str(err.value)
    finally:
        redis_client.delete(key)


def test_redis_wrong_password_does_not_leak(redis_client: redis.Redis) -> None:
    key = unique("pgstream-test")
    config = RedisSinkConfig(url=SecretStr("redis://pgstream-no-such-user:wr0ng-redis-pw@127.0.0.1:6379/0"), stream=key)
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(2))
    assert "events 101..102" in str(err.value) and "redis://127.0.0.1:6379/0" in str(err.value)
    assert "wr0ng-redis-pw" not in str(err.value) and "wr0ng-redis-pw" not in repr(err.value)
    assert redis_client.exists(key) == 0


# -- rabbitmq -----------------------------------------------------------------------------------------


@pytest.fixture
def amqp_channel() -> Iterator[Any]:
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    yield connection.channel()
    connection.close()


def drain_queue(channel: Any, queue: str) -> list[tuple[Any, bytes]]:
    messages = []
    while True:
        method, properties, body = channel.basic_get(queue=queue, auto_ack=True)
        if method is None:
            return messages
        messages.append((properties, body))


def test_rabbitmq_sink_publishes_confirmed_persistent_messages(amqp_channel: Any) -> None:
    queue = unique("pgstream-test")
    events = make_events(30)
    try:
        config = RabbitMqSinkConfig(routing_key=queue, declare_queue=queue)
        with config.build() as sink:
            sink.publish(events[:12])
            sink.publish(events[12:])
        assert amqp_channel.queue_declare(queue=queue, passive=True).method.message_count == len(events)
        messages = drain_queue(amqp_channel, queue)
        assert [p.message_id for p, _ in messages] == [str(e.id) for e in events]
        assert [json.loads(body) for _, body in messages] == [e.payload for e in events]
        assert {p.delivery_mode for p, _ in messages} == {2}
        assert {p.content_type for p, _ in messages} == {"application/json"}
        assert {p.headers["x-pgstream-stream-id"] for p, _ in messages} == {7}
    finally:
        amqp_channel.queue_delete(queue=queue)


def test_rabbitmq_exchange_and_routing_key_from_payload(amqp_channel: Any) -> None:
    prefix = unique("pgstream-test") + "."
    exchange = prefix + "exchange"
    queues = {tenant: prefix + tenant for tenant in ("acme", "globex", "fallback")}
    amqp_channel.exchange_declare(exchange=exchange, exchange_type="direct", auto_delete=True)
    for queue in queues.values():
        amqp_channel.queue_declare(queue=queue)
        amqp_channel.queue_bind(queue=queue, exchange=exchange, routing_key=queue)
    tenants = ["acme", "globex", None]
    events = [
        Event(id=300 + i, stream_id=1, payload={"seq": i, "route": {"ex": exchange}, "tenant": tenants[i % 3]},
              metadata={"i": i}, created_at=BASE_TIME)
        for i in range(24)
    ]
    config = RabbitMqSinkConfig(
        exchange_from="route.ex", routing_key_from="tenant", routing_key_prefix=prefix, routing_key=queues["fallback"]
    )
    try:
        with config.build() as sink:
            sink.publish(events)
        for tenant, queue in (("acme", queues["acme"]), ("globex", queues["globex"]), (None, queues["fallback"])):
            messages = drain_queue(amqp_channel, queue)
            expected = [e for e in events if e.payload["tenant"] == tenant]
            assert [p.message_id for p, _ in messages] == [str(e.id) for e in expected], tenant
            assert [json.loads(p.headers["x-pgstream-metadata"]) for p, _ in messages] == [e.metadata for e in expected]
    finally:
        for queue in queues.values():
            amqp_channel.queue_delete(queue=queue)
        amqp_channel.exchange_delete(exchange=exchange)
    with pytest.raises(ValidationError):
        RabbitMqSinkConfig()


def test_rabbitmq_missing_exchange_and_refused_connection_raise(amqp_channel: Any) -> None:
    queue = unique("pgstream-test")
    amqp_channel.queue_declare(queue=queue)
    try:
        missing = unique("no-such-exchange")
        with RabbitMqSinkConfig(exchange=missing, routing_key=queue).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(make_events(3))
        assert "rabbitmq sink" in str(err.value) and "event 101" in str(err.value)
        assert missing in str(err.value) and "NOT_FOUND" in str(err.value)
        assert not err.value.permanent  # a missing exchange is configuration
        assert amqp_channel.queue_declare(queue=queue, passive=True).method.message_count == 0
    finally:
        amqp_channel.queue_delete(queue=queue)

    port = free_port()
    url = SecretStr(f"amqp://guest:refusedpw@127.0.0.1:{port}/%2F")
    with RabbitMqSinkConfig(url=url, routing_key=queue, timeout_secs=3).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert "events 101..102" in str(err.value) and f"amqp://127.0.0.1:{port}/%2F" in str(err.value)
    assert "refusedpw" not in str(err.value) and not err.value.permanent


def test_rabbitmq_unroutable_and_nacked_raise(amqp_channel: Any) -> None:
    with RabbitMqSinkConfig(routing_key=unique("no-such-queue")).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert "event 101" in str(err.value) and "unroutable" in str(err.value)
    assert not err.value.permanent  # binding a queue makes it routable: configuration

    # a full queue with overflow=reject-publish makes the broker nack the third message
    queue = unique("pgstream-test")
    amqp_channel.queue_declare(queue=queue, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    try:
        with RabbitMqSinkConfig(routing_key=queue).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(make_events(4))
        assert "event 103" in str(err.value) and "nack" in str(err.value)
        assert err.value.event_ids == (103,) and not err.value.permanent  # a full queue: capacity
        assert [p.message_id for p, _ in drain_queue(amqp_channel, queue)] == ["101", "102"]
    finally:
        amqp_channel.queue_delete(queue=queue)


#: RabbitMQ's default max_message_size since 3.8 (4.x: 16 MiB); a message one byte larger is refused by any default
RABBITMQ_MAX_MESSAGE_SIZE = 128 * 1024 * 1024


def test_rabbitmq_message_over_the_brokers_max_size_is_a_permanent_rejection(amqp_channel: Any) -> None:
    queue = unique("pgstream-test")
    amqp_channel.queue_declare(queue=queue)
    events = make_events(3)
    filler = RABBITMQ_MAX_MESSAGE_SIZE + 1 - len('{"blob":""}')
    huge = Event(id=102, stream_id=7, payload_json='{"blob":"' + "x" * filler + '"}', created_at=BASE_TIME)
    assert len(huge.payload_json) == RABBITMQ_MAX_MESSAGE_SIZE + 1
    try:
        with RabbitMqSinkConfig(routing_key=queue).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish([events[0], huge, events[2]])
            message = str(err.value)
            assert err.value.permanent and err.value.event_ids == (102,)
            assert "PRECONDITION_FAILED" in message and "is larger than configured max size" in message
            assert message.startswith("rabbitmq sink: event 102: amqp://127.0.0.1:5672/%2F ") and "guest" not in message
            assert len(message) < 700
            assert [p.message_id for p, _ in drain_queue(amqp_channel, queue)] == ["101"]  # confirmed; 103: not sent
            sink.publish(events[2:])  # the caller set 102 aside; the sink reconnects (the broker closed the channel)
        assert [p.message_id for p, _ in drain_queue(amqp_channel, queue)] == ["103"]
    finally:
        amqp_channel.queue_delete(queue=queue)


def test_rabbitmq_max_message_bytes_and_payload_routes_are_permanent_rejections(amqp_channel: Any) -> None:
    prefix = unique("pgstream-test") + "."
    queue = prefix + "acme"
    amqp_channel.queue_declare(queue=queue)
    events = [Event(id=600 + i, stream_id=1, payload={"tenant": "acme", "i": i}, created_at=BASE_TIME)
              for i in range(2)]
    big = Event(id=650, stream_id=1, payload={"tenant": "acme", "blob": "x" * 2000}, created_at=BASE_TIME)
    long_key = Event(id=651, stream_id=1, payload={"tenant": "t" * 300}, created_at=BASE_TIME)
    no_key = Event(id=652, stream_id=1, payload={"other": 1}, created_at=BASE_TIME)
    unbound = Event(id=653, stream_id=1, payload={"tenant": "nobody"}, created_at=BASE_TIME)
    config = RabbitMqSinkConfig(routing_key_from="tenant", routing_key_prefix=prefix, max_message_bytes=1000)
    try:
        with config.build() as sink:
            outcomes = []
            for bad in (big, long_key, no_key, unbound):
                with pytest.raises(SinkError) as err:
                    sink.publish([events[0], bad, events[1]])
                assert err.value.event_ids == (bad.id,)
                outcomes.append((err.value.permanent, str(err.value)))
            assert [m.message_id for m, _ in drain_queue(amqp_channel, queue)] == ["600"] * 4  # each time: 600 first
        expected = [
            (True, f"event 650: not sent (exchange '' routing key '{prefix}acme'): the body is "),
            (True, f"event 651: routing key '{prefix}ttt"),
            (True, "event 652: no destination: payload path 'tenant' is missing and no fixed name"),
            (False, f"event 653: unroutable: no queue bound for exchange '' routing key '{prefix}nobody'"),
        ]  # 653: not permanent, binding a queue makes it routable
        for (permanent, message), (expected_permanent, text) in zip(outcomes, expected, strict=True):
            assert permanent is expected_permanent and text in message, message
        assert "more than max_message_bytes (1000)" in outcomes[0][1]
        assert "from the payload is longer than 255 bytes" in outcomes[1][1]
    finally:
        amqp_channel.queue_delete(queue=queue)


def test_rabbitmq_bad_credentials_do_not_leak(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = RabbitMqSinkConfig(url=SecretStr("amqp://guest:wr0ngpass@127.0.0.1:5672/%2F"), routing_key="q")
    assert "wr0ngpass" not in repr(config)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert "events 101..102" in str(err.value) and "wr0ngpass" not in str(err.value)
    assert "ACCESS_REFUSED" in str(err.value) and "amqp://127.0.0.1:5672/%2F" in str(err.value)
    assert caplog.records and "wr0ngpass" not in caplog.text  # pika logs a lot; never the password


# -- nats ---------------------------------------------------------------------------------------------


async def _nats_admin(action: str, stream: str, subject: str = "", expected: int = 0,
                      max_msg_size: int | None = None) -> list[Any]:
    nc = await nats.connect(NATS_URL)
    try:
        js = nc.jetstream()
        if action == "create":
            limits = {} if max_msg_size is None else {"max_msg_size": max_msg_size}
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


@pytest.fixture
def nats_stream() -> Iterator[tuple[str, str]]:
    name = unique("PGSTREAM_TEST").replace("-", "_")
    subject = f"pgstream.test.{name}"
    asyncio.run(_nats_admin("create", name, subject))
    yield name, subject
    asyncio.run(_nats_admin("delete", name))


def test_nats_jetstream_publish_acked_in_order_and_deduplicated(nats_stream: tuple[str, str]) -> None:
    stream, subject = nats_stream
    events = make_events(30)
    with NatsSinkConfig(servers=[NATS_URL], subject=subject).build() as sink:
        sink.publish(events[:10])
        sink.publish(events)  # a retry of a batch partly delivered: Nats-Msg-Id drops the duplicates
    count, messages = asyncio.run(_nats_admin("read", stream, subject, expected=len(events)))
    assert count == len(events)
    assert [json.loads(m.data) for m in messages] == [e.payload for e in events]
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [str(e.id) for e in events]
    assert [json.loads(m.headers.get("Pgstream-Metadata", "null")) for m in messages] == [e.metadata for e in events]
    assert [m.metadata.sequence.stream for m in messages] == list(range(1, len(events) + 1))


def test_nats_core_publish_with_flush(nats_stream: tuple[str, str]) -> None:
    stream, subject = nats_stream
    events = make_events(8)
    with build_sink({"type": "nats", "subject": subject, "jetstream": False}) as sink:
        sink.publish(events)
    count, messages = asyncio.run(_nats_admin("read", stream, subject, expected=len(events)))
    assert count == len(events)
    assert [json.loads(m.data) for m in messages] == [e.payload for e in events]


def test_nats_subject_from_payload_path(nats_stream: tuple[str, str]) -> None:
    stream, subject = nats_stream
    tables = ["orders", "users", None]  # None: no table in the payload -> the fallback subject
    events = [
        Event(id=400 + i, stream_id=1, payload={"seq": i, "table": tables[i % 3]} if tables[i % 3] else {"seq": i},
              metadata=None, created_at=BASE_TIME)
        for i in range(21)
    ]
    config = NatsSinkConfig(subject=subject, subject_from="table", subject_prefix=subject + ".")
    with config.build() as sink:
        sink.publish(events)
    count, messages = asyncio.run(_nats_admin("read", stream, ">", expected=len(events)))
    assert count == len(events)
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [str(e.id) for e in events]
    expected = [f"{subject}.{e.payload['table']}" if "table" in e.payload else subject for e in events]
    assert [m.subject for m in messages] == expected

    bad = [Event(id=1, stream_id=1, payload={"table": "has space"}, metadata=None, created_at=BASE_TIME)]
    fresh = make_events(3, first_id=450)
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(fresh[:2] + bad + fresh[2:])
    assert "event 1:" in str(err.value) and "invalid subject" in str(err.value)
    assert err.value.permanent and err.value.event_ids == (1,)  # a subject from the payload: the event's fault
    # the events before it were acknowledged, nothing after it was sent
    assert asyncio.run(_nats_admin("read", stream, ">", expected=0))[0] == len(events) + 2
    with pytest.raises(ValidationError):
        NatsSinkConfig()


def test_nats_subject_without_stream_raises() -> None:
    subject = f"pgstream.nostream.{uuid.uuid4().hex}"
    with NatsSinkConfig(subject=subject, timeout_secs=3).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
    assert "nats sink" in str(err.value) and "event 101" in str(err.value)
    assert "no JetStream stream" in str(err.value)
    assert not err.value.permanent  # creating or extending a stream makes it deliverable: configuration


def test_nats_connection_refused_raises(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = NatsSinkConfig(
        servers=[f"nats://127.0.0.1:{free_port()}"],
        subject="x",
        timeout_secs=1,
        password=SecretStr("natspw-9"),
        user="u",
    )
    assert "natspw-9" not in repr(config)
    started = time.monotonic()
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert time.monotonic() - started < 30
    assert "events 101..102" in str(err.value) and "natspw-9" not in str(err.value)
    assert "nats://127.0.0.1:" in str(err.value)
    assert "natspw-9" not in caplog.text
    assert not err.value.permanent


@pytest.fixture
def small_nats_stream() -> Iterator[tuple[str, str]]:
    """A JetStream stream whose max_msg_size is 400 bytes (payload and headers)."""
    name = unique("PGSTREAM_TEST").replace("-", "_")
    subject = f"pgstream.test.{name}"
    asyncio.run(_nats_admin("create", name, subject, max_msg_size=400))
    yield name, subject
    asyncio.run(_nats_admin("delete", name))


def test_nats_jetstream_max_msg_size_is_a_permanent_rejection(small_nats_stream: tuple[str, str]) -> None:
    stream, subject = small_nats_stream
    events = make_events(4)
    events[1] = Event(id=102, stream_id=7, payload={"blob": "x" * 500}, created_at=BASE_TIME)
    config = NatsSinkConfig(subject=subject, user="u", password=SecretStr("natspw-rej"))
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
        message = str(err.value)
        assert err.value.permanent and err.value.event_ids == (102,)
        assert message.startswith(f"nats sink: event 102: publish to {subject!r} at nats://127.0.0.1:4222 failed: ")
        assert "message size exceeds maximum allowed" in message and "natspw-rej" not in message
        sink.publish(events[2:])  # the caller set 102 aside
    count, messages = asyncio.run(_nats_admin("read", stream, subject, expected=3))
    assert count == 3 and [m.headers["Nats-Msg-Id"] for m in messages] == ["101", "103", "104"]


@pytest.mark.parametrize("jetstream", [True, False])
def test_nats_message_over_the_servers_max_payload_is_refused_before_sending(
        nats_stream: tuple[str, str], jetstream: bool) -> None:
    stream, subject = nats_stream
    events = make_events(5)
    with NatsSinkConfig(subject=subject, jetstream=jetstream).build() as sink:
        sink.publish(events[:1])
        max_payload = sink._nc.max_payload  # type: ignore[attr-defined,union-attr]  # the server's (1 MiB default)
        # too large on its own, and too large only with its headers (nats-py checks the payload alone: the server
        # would close the connection, losing what was not flushed yet)
        blob = Event(id=102, stream_id=7, payload_json=f'"{"x" * max_payload}"', created_at=BASE_TIME)
        padded = Event(id=104, stream_id=7, payload_json=f'"{"y" * (max_payload - 20)}"', metadata={"op": "insert"},
                       created_at=BASE_TIME)
        rejected = []
        for bad, before in ((blob, events[1:1]), (padded, events[1:3])):
            with pytest.raises(SinkError) as err:
                sink.publish([*before, bad, events[4]])
            assert err.value.permanent and err.value.event_ids == (bad.id,)
            assert f"the server's max_payload ({max_payload})" in str(err.value)
            rejected.append(bad.id)
        sink.publish(events[4:])  # the connection survived
    assert rejected == [102, 104]
    count, messages = asyncio.run(_nats_admin("read", stream, subject, expected=4))
    assert count == 4 and [m.headers["Nats-Msg-Id"] for m in messages] == ["101", "102", "103", "105"]



def test_nats_subject_problems_are_permanent_only_when_the_subject_comes_from_the_payload() -> None:
    event = make_events(1)
    with NatsSinkConfig(subject="has space").build() as sink, pytest.raises(SinkError) as err:
        sink.publish(event)
    assert "invalid subject 'has space'" in str(err.value) and not err.value.permanent  # the configuration's
    with NatsSinkConfig(subject_from="table").build() as sink, pytest.raises(SinkError) as err:
        sink.publish(event)
    assert "'table' is missing" in str(err.value) and err.value.permanent and err.value.event_ids == (101,)
    empty_token = Event(id=5, stream_id=1, payload={"table": "a..b"}, created_at=BASE_TIME)
    with NatsSinkConfig(subject_from="table").build() as sink, pytest.raises(SinkError) as err:
        sink.publish([empty_token])
    assert "invalid subject 'a..b'" in str(err.value) and err.value.permanent
