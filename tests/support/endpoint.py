"""A real HTTP endpoint for fault tests: it records the event ids it accepted (and their bodies) and
can answer 500, flap (every other request fails), answer 500 to a random share of requests (seeded),
hang for a while, run a hook, go down (connection refused), refuse content (422) or answer 404 for
paths it does not serve."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from pgstream_dagster.devdb import free_port

Mode = Literal["ok", "error", "flap"]


class Endpoint:
    def __init__(self) -> None:
        self.port = free_port()
        self.mode: Mode = "ok"
        self.fail_rate = 0.0  # this share of requests is answered 500, drawn from ``rng`` (seeded: reproducible)
        self.rng = random.Random(34)
        self.delay = 0.0
        self.accepted: list[int] = []  # event ids, in the order the endpoint confirmed them
        self.requests = 0
        self.refused_answers = 0
        self.hook: Callable[[int], None] | None = None  # called with the request number, before answering
        self.reject_ids: set[int] = set()  # a request carrying one of these is answered 422 (a poison event)
        self.rejected: list[int] = []  # event ids of the requests answered 422
        self.fail_once_ids: set[int] = set()  # the first request carrying one of these is answered 500
        self.reject_marker: bytes | None = None  # a request whose body contains it is answered 422
        self.paths: set[str] | None = None  # the paths it serves (None: every path); others are answered 404
        self.not_found: list[int] = []  # event ids of the requests answered 404
        self.bodies: dict[int, bytes] = {}  # the body of each accepted one-event request, by event id
        self.accepted_at_failure: int | None = None  # len(accepted) when a fail_once_ids request was refused
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events"

    def up(self) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ids = self.headers.get("X-Pgstream-Event-Ids") or self.headers.get("X-Pgstream-Event-Id") or ""
                with endpoint._lock:
                    endpoint.requests += 1
                    n = endpoint.requests
                    fail = endpoint.mode == "error" or (endpoint.mode == "flap" and n % 2 == 1)
                    fail = fail or (endpoint.fail_rate > 0 and endpoint.rng.random() < endpoint.fail_rate)
                if endpoint.hook is not None:
                    endpoint.hook(n)
                if endpoint.delay:
                    time.sleep(endpoint.delay)
                carried = [int(i) for i in ids.split(",") if i]
                with endpoint._lock:
                    once = endpoint.fail_once_ids.intersection(carried)
                    if once:
                        endpoint.fail_once_ids -= once
                        endpoint.accepted_at_failure = len(endpoint.accepted)
                        fail = True
                if endpoint.paths is not None and self.path not in endpoint.paths and not fail:
                    with endpoint._lock:
                        endpoint.not_found.extend(carried)
                    self.send_response(404)
                    self.end_headers()
                    self.wfile.write(b"no such hook")
                    return
                poison = [i for i in carried if i in endpoint.reject_ids]
                if endpoint.reject_marker is not None and endpoint.reject_marker in body and carried:
                    poison = poison or carried
                if poison and not fail:
                    with endpoint._lock:
                        endpoint.rejected.extend(carried)
                    self.send_response(422)
                    self.end_headers()
                    self.wfile.write(f"invalid event {poison[0]}".encode())
                    return
                if fail:
                    with endpoint._lock:
                        endpoint.refused_answers += 1
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"injected failure")
                    return
                with endpoint._lock:
                    endpoint.accepted.extend(int(i) for i in ids.split(",") if i)
                    if len(carried) == 1:
                        endpoint.bodies[carried[0]] = body
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def down(self) -> None:
        """Stop listening: clients get connection refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def sink(self, mode: str = "batch") -> dict[str, Any]:
        # one attempt per publish call: the fault tests exercise the pipeline's failover, not the
        # sink's own retries (tested in test_sinks.py)
        return {"type": "http", "url": self.url, "mode": mode, "timeout_secs": 30, "max_attempts": 1}

    def unique(self) -> set[int]:
        with self._lock:
            return set(self.accepted)

    def duplicates(self) -> int:
        with self._lock:
            return sum(c - 1 for c in Counter(self.accepted).values())

    def first_seen_order(self) -> list[int]:
        seen: set[int] = set()
        order: list[int] = []
        with self._lock:
            for i in self.accepted:
                if i not in seen:
                    seen.add(i)
                    order.append(i)
        return order
