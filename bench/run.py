"""Sink publish throughput, side by side in one run (run by hand: `make bench`).

Publishes the same N events through the file sink, the HTTP sink in per_event mode and the HTTP
sink in batch mode (to a local stdlib HTTP server), and prints events/s and ratios. Results are
appended to bench/RESULTS.md.
"""

from __future__ import annotations

import datetime as dt
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pgstream_dagster.sinks import Event, build_sink

N = 5000
CHUNK = 500


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _events() -> list[Event]:
    now = dt.datetime.now(dt.UTC)
    return [Event(id=i, stream_id=1, payload={"tg_name": "bench", "new": {"id": i, "email": f"u{i}@x"}},
                  metadata=None, created_at=now) for i in range(1, N + 1)]


def _measure(config: dict[str, object], events: list[Event]) -> float:
    sink = build_sink(config)
    started = time.perf_counter()
    for i in range(0, len(events), CHUNK):
        sink.publish(events[i:i + CHUNK])
    sink.close()
    return len(events) / (time.perf_counter() - started)


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    events = _events()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "file": _measure({"type": "file", "path": str(Path(tmp) / "out.jsonl")}, events),
            "http per_event": _measure({"type": "http", "url": url, "mode": "per_event"}, events),
            "http batch": _measure({"type": "http", "url": url, "mode": "batch", "max_batch_size": CHUNK}, events),
        }
    server.shutdown()
    base = results["http per_event"]
    lines = [f"## {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {N} events, chunks of {CHUNK}"]
    lines += [f"- {name}: {rate:,.0f} events/s ({rate / base:.1f}x http per_event)" for name, rate in results.items()]
    text = "\n".join(lines)
    print(text)
    with (Path(__file__).parent / "RESULTS.md").open("a") as f:
        f.write(text + "\n\n")


if __name__ == "__main__":
    main()
