"""The Prometheus exporter's HTTP server (``pgstream-dagster metrics``): ``/metrics`` served by
``prometheus_client`` from a registry holding only :class:`~.engine.metrics.PgstreamCollector`, which
reads the database at every scrape (the metrics and their SQL: ``engine/metrics.py``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import ConfigError


@dataclass
class Exporter:
    """A running exporter: its HTTP server (in a thread) and its collector."""

    server: Any  # wsgiref server
    thread: threading.Thread
    collector: Any  # engine.metrics.PgstreamCollector
    host: str
    port: int

    @property
    def url(self) -> str:
        return metrics_url(self.host, self.port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
        self.collector.close()


def metrics_url(host: str, port: int) -> str:
    """The URL of an exporter listening on ``host:port`` (an IPv6 address bracketed)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def start(database_url: str, host: str, port: int, timeout_secs: float = 5.0) -> Exporter:
    """Serve ``/metrics`` on ``host:port`` in a background thread (``port`` 0: any free port)."""
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("the metrics exporter needs prometheus-client: pip install 'pgstream-dagster[metrics]'"
                          ) from None
    from .engine.dbconn import conninfo_problem
    from .engine.metrics import PgstreamCollector

    if problem := conninfo_problem(database_url):
        raise ConfigError(f"metrics: the database URL is not a connection string libpq can parse: {problem}")

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    collector = PgstreamCollector(database_url, timeout_secs)
    registry.register(collector)
    try:
        server, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"metrics: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return Exporter(server, thread, collector, host, int(server.server_port))


def serve_forever(exporter: Exporter, log: Callable[[str], None] = print, *, exit_with_parent: bool = False) -> None:
    """Block until SIGINT or SIGTERM (``exit_with_parent``: or until the process that started this
    one is gone, as for the exporter ``make dev`` starts beside ``dg dev``), then stop the exporter."""
    stop = threading.Event()
    parent = os.getppid()
    previous = {sig: signal.signal(sig, lambda _sig, _frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    log(f"serving Prometheus metrics on {exporter.url}")
    try:
        while not stop.wait(1.0 if exit_with_parent else 3600):
            if exit_with_parent and os.getppid() != parent:
                break
    finally:
        exporter.stop()
        for sig, old in previous.items():
            signal.signal(sig, old)
