"""Prometheus metrics, read from the database at every scrape (``pgstream-dagster metrics``): every value comes from
``pgstream.metrics`` (sql/repeatable/09_metrics.sql) in one read-only statement with ``statement_timeout`` and
``lock_timeout`` set, so exporters agree and keep no count of their own (counters and histogram buckets are rows the
ledger's triggers increment). When the database cannot be read the scrape still answers, with ``pgstream_up 0``.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psycopg
import yaml
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .dbconn import connect, first_line, scrubbed_error

Kind = Literal["counter", "gauge"]

#: the read of one scrape (the view is the one place that knows where each value comes from)
_QUERY = "select metric, stream_id, label, value from pgstream.metrics"


@dataclass(frozen=True)
class MetricSpec:
    """An exported metric: ``name`` (without ``_total`` for a counter), its type, help text, and the
    name of the label that the view's ``label`` column fills (``None``: it has none)."""

    name: str
    kind: Kind
    help: str
    label: str | None = None
    per_stream: bool = True


def _definitions() -> tuple[dict[str, MetricSpec], dict[str, tuple[str, str]]]:
    data = yaml.safe_load((Path(__file__).with_name("metrics.yaml")).read_text(encoding="utf-8"))
    metrics = {key: MetricSpec(d["name"], d["type"], d["help"], d.get("label"), d.get("per_stream", True))
               for key, d in data["metrics"].items()}
    histograms = {key: (d["name"], d["help"]) for key, d in data["histograms"].items()}
    return metrics, histograms


#: the view's ``metric`` -> what is exported (``metrics.yaml``); histograms: ``<key>_bucket`` (label: upper
#: bound) and ``<key>_sum`` rows, bounds from ``bucket_bound`` rows (pgstream.metric_buckets)
METRICS, HISTOGRAMS = _definitions()

UP = "pgstream_up"
SCRAPE_DURATION = "pgstream_scrape_duration_seconds"


@dataclass(frozen=True)
class Row:
    metric: str
    stream_id: int | None
    label: str
    value: float


def read(conn: psycopg.Connection, timeout_secs: float) -> list[Row]:
    """One scrape's rows, read in a read-only transaction that gives up after ``timeout_secs`` and
    never waits for a lock more than a second."""
    with conn.transaction():
        conn.execute("set transaction read only")
        conn.execute("select set_config('statement_timeout', %s, true), set_config('lock_timeout', %s, true)",
                     [f"{max(1, int(timeout_secs * 1000))}ms", f"{min(1000, max(1, int(timeout_secs * 1000)))}ms"])
        rows = conn.execute(_QUERY).fetchall()
    return [Row(str(m), int(s) if s is not None else None, str(label), float(v)) for m, s, label, v in rows]


def families(rows: list[Row]) -> list[Metric]:
    """The metric families of one scrape's rows (unknown rows are left out: a newer database)."""
    streams = sorted({r.stream_id for r in rows if r.stream_id is not None and r.metric == "paused"})
    bounds: dict[str, list[float]] = defaultdict(list)
    values: dict[str, dict[tuple[int | None, str], float]] = defaultdict(dict)
    for r in rows:
        if r.metric == "bucket_bound":
            bounds[r.label].append(r.value)
        else:
            values[r.metric][(r.stream_id, r.label)] = r.value
    out: list[Metric] = []
    for key, spec in METRICS.items():
        got = values.get(key, {})
        if spec.kind == "counter" and spec.label is None and spec.per_stream:
            got = {(s, ""): got.get((s, ""), 0.0) for s in streams}
        labels = (["stream"] if spec.per_stream else []) + ([spec.label] if spec.label else [])
        family = (CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily)(spec.name, spec.help,
                                                                                        labels=labels)
        for (stream_id, label), value in sorted(got.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
            family.add_metric(([str(stream_id)] if spec.per_stream else []) + ([label] if spec.label else []), value)
        out.append(family)
    for key, (name, text) in HISTOGRAMS.items():
        le = sorted(bounds.get(key, [])) or [math.inf]
        family_h = HistogramMetricFamily(name, text, labels=["stream"])
        counts = values.get(f"{key}_bucket", {})
        sums = values.get(f"{key}_sum", {})
        for stream_id in streams:
            per_bound = {float(label): v for (s, label), v in counts.items() if s == stream_id}
            cumulative, buckets = 0.0, []
            for bound in le:
                cumulative += per_bound.get(bound, 0.0)
                buckets.append(("+Inf" if math.isinf(bound) else f"{bound:g}", cumulative))
            family_h.add_metric([str(stream_id)], buckets, sums.get((stream_id, ""), 0.0))
        out.append(family_h)
    return out


class PgstreamCollector(Collector):
    """Every ``collect()`` reads the database (see the module), on one connection kept between scrapes
    (opened again after an error), scrapes of one exporter serialised on it."""

    def __init__(self, database_url: str, timeout_secs: float = 5.0,
                 log: Callable[[str], None] | None = None) -> None:
        self._url = database_url
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._timeout = timeout_secs
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._url, autocommit=True, application_name="pgstream metrics",
                                 connect_timeout=max(1, int(self._timeout)))
        return self._conn

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        with self._lock:
            try:
                rows = read(self._connection(), self._timeout)
                if self.last_error is not None:
                    self._log("pgstream metrics: reading the database again")
                self.last_error = None
            except psycopg.Error as exc:
                # libpq echoes a connection string it cannot parse, the password included
                error = f"{type(exc).__name__}: {scrubbed_error(first_line(exc), self._url)}"
                if error != self.last_error:  # once per kind of failure, not at every scrape
                    self._log(f"pgstream metrics: cannot read the database ({error}); reporting {UP} 0")
                self.last_error = error
                self.close()
                rows = None
        up = GaugeMetricFamily(UP, "1 if the last scrape read the database, 0 if it could not",
                               value=1.0 if rows is not None else 0.0)
        duration = GaugeMetricFamily(SCRAPE_DURATION, "How long the scrape's read of the database took",
                                     value=time.monotonic() - started)
        if rows is not None:
            yield from families(rows)
        yield up
        yield duration

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __repr__(self) -> str:  # never the URL
        return "PgstreamCollector()"
