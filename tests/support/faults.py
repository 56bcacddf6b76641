"""The fault matrix's shared pieces: the stream every row drives (stream 1 to an HTTP endpoint, a member of
reader group ``default`` as every stream is), what was sent and in which order the ledger holds it, and
``check_and_report``, which asserts that every event sent was delivered in commit order and prints the row's
``FAULT-MATRIX`` line.

What delivers: in mode open, the member's runs hosted by the group delivery run the driver launched in
the background (``Driver.group_runs``); in mode per_batch, Dagster runs of the stream's own that the rows execute
(``Tick.run_requests``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import dagster as dg
import psycopg

from pgstream_dagster.config import DEFAULT_READER
from pgstream_dagster.defs.names import GROUP_DELIVERY_JOB, member_tag
from pgstream_dagster.engine import replication
from pgstream_dagster.engine.ledger import groups

from .endpoint import Endpoint
from .harness import Driver, slot_of
from .harness import joined as harness_joined

STREAM = 1
#: the reader group of stream 1 (it names none: the default)
GROUP = DEFAULT_READER
#: the publication the group's slot is decoded with (the sensor's and the group delivery run's reader)
PUBLICATION = groups.group_publication(GROUP)

#: the delivery modes the fault matrix runs on (``delivery.mode``; tests/test_failover.py and
#: tests/test_fault_integrity.py run every row on each)
MODES = ("open", "per_batch")
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
    # (run_grace_secs: a run, or group delivery run, that took no lease 10 s after it started is dead; a loaded
    # host took 3 s to start one)
    delivery = {"chunk_size": 20, "run_grace_secs": 10, **over.pop("delivery", {})}
    cfg.update(over)
    cfg["delivery"] = {**mode_delivery(MODE), **delivery}
    return cfg


def mode_delivery(mode: str) -> dict[str, Any]:
    """``delivery`` of a stream in ``mode``: an open member run, always open (closed by a failure, a pause or a
    failover, then opened again), hosted by the group delivery run, which the driver runs in the background for
    as long as the product's ``max_run_secs`` (the test's end asks it to end); per_batch: Dagster runs of the
    stream's own."""
    return {"mode": mode}


def hosted() -> bool:
    """Whether stream 1's runs (mode :data:`MODE`) are hosted by the group delivery run (open), not Dagster
    runs of its own the rows execute (per_batch)."""
    return MODE != "per_batch"


def database_url(driver: Driver) -> str:
    return str((driver.defs.resources or {})["pgstream"].database_url)


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
    """Whether the group's slot holds events of stream 1 not recorded yet: peeked while nothing holds it (the
    group's sensor reads it); while the group delivery run's reader holds it (over the replication protocol: no
    peek), whether an event sent is in no batch (nor set aside as unreadable, a dead letter of stage read), or the
    slot's confirmed position is short of the last one recorded."""
    slot = slot_of(url, STREAM)
    with psycopg.connect(url, autocommit=True) as c:
        try:
            txns, _n = replication.peek_rows(c, slot, PUBLICATION, 100_000, keep_stream=True)
            return any(e.stream_id == STREAM for t in txns for e in t.events)
        except psycopg.errors.ObjectInUse:
            pass
        row = c.execute(
            """with read as (select unnest(event_ids) as id from pgstream.batches where stream_id = %(s)s
                             union select event_id from pgstream.dead_letters where stream_id = %(s)s
                             and stage = 'read')
               select not exists (select 1 from pgstream.events e where e.stream_id = %(s)s
                                  and e.id not in (select id from read))
                      and coalesce(r.confirmed_flush_lsn >= greatest(
                          (select max(end_lsn) from pgstream.batches where stream_id = %(s)s),
                          (select max(lsn) from pgstream.dead_letters where stream_id = %(s)s and stage = 'read')),
                          true)
               from pg_replication_slots r where r.slot_name = %(slot)s""", {"s": STREAM, "slot": slot}).fetchone()
    return not (row is not None and row[0])


def drop_slot(url: str) -> None:
    """Drop the group's slot, as an operator would: its holder (the group delivery run's reader, a sensor's peek)
    is terminated first, as often as it comes back."""
    slot = slot_of(url, STREAM)
    deadline = time.monotonic() + 30
    with psycopg.connect(url, autocommit=True) as c:
        while True:
            c.execute("select pg_terminate_backend(active_pid, 10000) from pg_replication_slots "
                      "where slot_name = %s and active_pid is not null", [slot])
            try:
                c.execute("select pg_drop_replication_slot(%s)", [slot])
                return
            except psycopg.errors.ObjectInUse:
                assert time.monotonic() < deadline, f"slot {slot} is still held"
                time.sleep(0.02)


def in_failover(url: str) -> bool:
    return stream_row(url)["failover_since"] is not None


def joined(url: str, stream_id: int = STREAM) -> bool:
    """Stream 1 (or ``stream_id``) has joined its reader group (:func:`harness.joined`)."""
    return harness_joined(url, stream_id)


def start(driver: Driver, streams: tuple[int, ...] = (STREAM,), timeout: float = 120) -> None:
    """Tick until the streams have joined their group (the group's slot made): what commits from now on is read
    from the slot. (In mode open the first tick requests the group delivery run, whose reader joins
    them.)"""
    url = database_url(driver)
    deadline = time.monotonic() + timeout
    while True:
        for request in driver.tick(streams[0]).run_requests or []:
            driver.execute(request)
        if all(joined(url, s) for s in streams):
            return
        assert time.monotonic() < deadline, f"streams {streams} did not join their reader group"
        time.sleep(0.05)


def drive(driver: Driver, done: Callable[[], bool], timeout: float = 300) -> float:
    """Tick (and execute the runs of mode per_batch; the group delivery run delivers the others) until
    ``done``; returns the seconds it took."""
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < timeout, "the stream did not recover in time"
        for request in driver.tick(STREAM).run_requests or []:
            driver.execute(request)
        time.sleep(0.05)
    return time.monotonic() - started


def group_runs(instance: dg.DagsterInstance, run_ids: list[str]) -> list[dg.DagsterRun]:
    """The group delivery runs ``run_ids``, newest first."""
    runs = instance.get_runs(dg.RunsFilter(job_name=GROUP_DELIVERY_JOB, run_ids=run_ids))
    return list(runs)


def member_runs(driver: Driver) -> dict[str, dict[str, Any]]:
    """What the driver's group delivery runs say of the member runs of stream 1 they hosted (their tag
    ``pgstream/member_1``), by run key: ``state`` (running, ended, failed) and ``error``."""
    ids = [r.run_id for r in driver.group_runs.get(GROUP, []) if r.run_id is not None]
    found: dict[str, dict[str, Any]] = {}
    for run in reversed(group_runs(driver.instance, ids) if ids else []):
        raw = run.tags.get(member_tag(STREAM))
        if raw:
            member = json.loads(raw)
            found[str(member["run_key"])] = member
    return found


def _delivered_batches(url: str) -> dict[int, str]:
    """The stream's delivered batches: id -> the run key that delivered them."""
    with psycopg.connect(url) as c:
        return {r[0]: r[1] for r in c.execute("select id, run_key from pgstream.batches where stream_id = %s "
                                              "and status = 'delivered'", [STREAM])}


def tick_failing_until(driver: Driver, done: Callable[[], bool], what: str, timeout: float = 300) -> None:
    """With the sink down: tick until ``done``; every run fails. A run executed here (mode per_batch) must fail;
    the member runs the group delivery run hosts (open) are seen through what the product shows: each one
    that ended meanwhile is failed (its tag in the group run, with its error), unless it delivered nothing (a
    warm run closing, or any once the group run ends)."""
    url = database_url(driver)
    before = set(member_runs(driver))
    delivered_before = set(_delivered_batches(url))
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for request in driver.tick(STREAM).run_requests or []:
            assert not driver.execute(request).success
        ended = {key: m for key, m in member_runs(driver).items() if key not in before and m["state"] != "running"}
        if ended:
            delivered = {b: key for b, key in _delivered_batches(url).items() if b not in delivered_before}
            for key, member in ended.items():
                if member["state"] == "failed":
                    assert member["error"], (key, member)
                else:
                    mine = sorted(b for b, k in delivered.items() if k == key)
                    assert not mine, f"member run {key} {member['state']} with batches {mine} delivered"
        time.sleep(0.05)


def fail_into_failover(driver: Driver, url: str, timeout: float = 300) -> str:
    """With the sink down: tick (every run must fail) until the stream is in failover; returns the failover's
    error."""
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
