"""The fault matrix's shared pieces: the stream every row drives (stream 1 to an HTTP endpoint),
what was sent and in which order the ledger holds it, and ``check_and_report``, which asserts that
every event sent was delivered in commit order and prints the row's ``FAULT-MATRIX`` line."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import psycopg

from pgstream_dagster.engine import replication

from .endpoint import Endpoint
from .harness import HARNESS_LINGER_SECS, HARNESS_MAX_RUN_SECS, Driver, slot_of

STREAM = 1
PUBLICATION = "pgstream_stream_1"  # the sensor's publication of stream 1

#: the delivery modes the fault matrix runs on (``delivery.mode``; tests/test_failover.py and
#: tests/test_fault_integrity.py run every row on each)
MODES = ("open", "per_batch", "warm")
#: the mode of the rows being run (the fault files' ``delivery_mode`` fixture sets it): the product's default
MODE = "open"


def stream_config(sink: Endpoint | dict[str, Any], **over: Any) -> dict[str, Any]:
    """Stream 1 to ``sink`` (the recording endpoint, or a sink configuration), small batches, short backoff,
    delivery mode :data:`MODE` (a ``delivery`` in ``over`` is merged into it)."""
    cfg: dict[str, Any] = {
        "id": STREAM, "batch": {"max_size": 50, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
        "retry": {"initial_backoff_secs": 0.5, "max_backoff_secs": 2},
        "sink": sink.sink() if isinstance(sink, Endpoint) else sink,
    }
    delivery = {"chunk_size": 20, "run_grace_secs": 2, **over.pop("delivery", {})}
    cfg.update(over)
    cfg["delivery"] = {**mode_delivery(MODE), **delivery}
    return cfg


def mode_delivery(mode: str) -> dict[str, Any]:
    """``delivery`` of a stream in ``mode`` as the in-process driver runs it: it executes a run before it
    ticks again, so an open run's idle linger is short (``tuning.linger_secs``) and it takes new batches
    for ``tuning.max_run_secs`` at most; a warm run, which never closes when idle, is replaced every
    second (the least)."""
    modes: dict[str, dict[str, Any]] = {"open": {"mode": "open", "tuning": {"linger_secs": HARNESS_LINGER_SECS,
                                                                            "max_run_secs": HARNESS_MAX_RUN_SECS}},
                                        "per_batch": {"mode": "per_batch"},
                                        "warm": {"mode": "warm", "tuning": {"max_run_secs": 1}}}
    return modes[mode]


def sent_ids(url: str) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id", [STREAM])]


def ledger_order(url: str) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute(
            "select unnest(event_ids) from pgstream.batches where stream_id = %s order by id", [STREAM])]


def stream_row(url: str) -> dict[str, Any]:
    with psycopg.connect(url) as c, c.cursor(row_factory=psycopg.rows.dict_row) as cur:
        row = cur.execute("select * from pgstream.streams where id = %s", [STREAM]).fetchone()
    assert row is not None
    return row


def slot_has_events(url: str) -> bool:
    with psycopg.connect(url) as c:
        return any(t.events for t in replication.peek(c, slot_of(url, STREAM), PUBLICATION, 100_000))


def in_failover(url: str) -> bool:
    return stream_row(url)["failover_since"] is not None


def drive(driver: Driver, done: Callable[[], bool], timeout: float = 300) -> float:
    """Tick and execute until ``done``; returns the seconds it took."""
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < timeout, "the stream did not recover in time"
        for request in driver.tick(STREAM).run_requests or []:
            driver.execute(request)
        time.sleep(0.05)
    return time.monotonic() - started


def tick_failing_until(driver: Driver, done: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """With the sink down: tick and execute (every run must fail) until ``done``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for request in driver.tick(STREAM).run_requests or []:
            assert not driver.execute(request).success
        time.sleep(0.05)


def fail_into_failover(driver: Driver, url: str, timeout: float = 60) -> str:
    """With the sink down: tick and execute (every run must fail) until the stream is in failover;
    returns the failover's error."""
    tick_failing_until(driver, lambda: in_failover(url), "the stream to enter failover", timeout)
    error = stream_row(url)["failover_error"]
    assert isinstance(error, str)
    return error


def delivered_all(endpoint: Endpoint, url: str) -> Callable[[], bool]:
    return lambda: endpoint.unique() >= set(sent_ids(url)) and not in_failover(url)


def check_and_report(row: str, endpoint: Endpoint, url: str, recover_secs: float, **extra: Any) -> None:
    sent = sent_ids(url)
    assert endpoint.unique() == set(sent), f"lost: {sorted(set(sent) - endpoint.unique())[:20]}"
    order = ledger_order(url)
    assert sorted(order) == sorted(set(order)) and set(order) == set(sent)  # the ledger holds each event once
    assert endpoint.first_seen_order() == order  # first deliveries follow commit order
    assert not in_failover(url)
    print("FAULT-MATRIX " + json.dumps({"row": row, "sent": len(sent), "delivered": len(endpoint.unique()),
                                        "duplicates": endpoint.duplicates(),
                                        "recover_secs": round(recover_secs, 1), **extra}))
