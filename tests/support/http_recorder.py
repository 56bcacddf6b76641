"""A real HTTP server that records what a sink sends and answers as told (status codes, delays,
Retry-After), and a Standard Webhooks signature check."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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


@contextmanager
def recording_server() -> Iterator[HttpRecorder]:
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
