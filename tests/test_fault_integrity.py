"""The fault matrix, part 2: bad input and operator slips (issue 12). Each row feeds a real
pipeline (real Postgres with logical replication, real Dagster instance, real runs on Spark, a
real HTTP endpoint) something a hostile or careless user would, and counts events end to end:
every event sent is delivered or, where the policy says so, set aside as a dead letter with the
reason; nothing is lost, order holds, and the stream keeps running.

Rows print ``FAULT-MATRIX {...}`` like tests/test_failover.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from pgstream_dagster.config import HousekeepingConfig
from pgstream_dagster.defs.names import REPLAY_JOB, REPLAY_OP
from pgstream_dagster.engine.housekeeping import run_housekeeping

from .support.endpoint import Endpoint
from .support.faults import (
    STREAM,
    drive,
    drop_slot,
    in_failover,
    ledger_order,
    sent_ids,
    slot_has_events,
    start,
    stream_config,
)
from .support.harness import Driver, backdated, insert_events, write_config

pytestmark = pytest.mark.usefixtures("delivery_mode")  # every row on every delivery mode (faults.MODES)


def as_role(db_url: str, role: str) -> psycopg.Connection:
    """A fresh connection logged in as ``role``."""
    return psycopg.connect(db_url.replace("postgres@", f"{role}@", 1), autocommit=True)


def dead_letters(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url) as c, c.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("select * from pgstream.dead_letters where stream_id = %s order by id", [STREAM]).fetchall()


def open_dead_letters(url: str) -> int:
    with psycopg.connect(url) as c:
        row = c.execute("select open_dead_letters from pgstream.stream_status where id = %s", [STREAM]).fetchone()
    assert row is not None
    return int(row[0])


def report(row: str, endpoint: Endpoint, url: str, **extra: Any) -> None:
    sent = sent_ids(url)
    aside = {d["event_id"] for d in dead_letters(url) if d["status"] == "open"}
    delivered = endpoint.unique()
    assert delivered | aside == set(sent), f"lost: {sorted(set(sent) - delivered - aside)[:20]}"
    assert not delivered & aside
    order = [i for i in ledger_order(url) if i not in aside]
    assert endpoint.first_seen_order() == order  # first deliveries follow commit order
    print("FAULT-MATRIX " + json.dumps({"row": row, "sent": len(sent), "delivered": len(delivered),
                                        "dead_letters": len(aside), "duplicates": endpoint.duplicates(), **extra}))


def caught_up(url: str) -> bool:
    """Every batch of the stream is delivered (its run, hosted by the group run in the background, is done with
    them: their dead letters written)."""
    with psycopg.connect(url) as c:
        row = c.execute("select count(*) from pgstream.batches where stream_id = %s and status <> 'delivered'",
                        [STREAM]).fetchone()
    return row == (0,)


def until(driver: Driver, done: Callable[[], bool]) -> float:
    return drive(driver, done, timeout=240)


# --------------------------------------------------------------------------------------------
# event ids, created_at and stream ids are the database's


def test_manual_events_cannot_choose_id_created_at_or_an_unknown_stream(db_url: str, tmp_path: Path,
                                                                        instance: dg.DagsterInstance,
                                                                        endpoint: Endpoint,
                                                                        manual_role: str) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    start(driver)
    with as_role(db_url, manual_role) as app:
        for column, value in (("id", "5"), ("created_at", "'infinity'"), ("created_at", "'10000-01-01'"),
                              ("created_at", "'0044-03-15 BC'"), ("lsn", "'0/0'")):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
                app.execute(sql.SQL("insert into pgstream.events ({}, payload, stream_id) values ({}, '{{}}', {})")
                            .format(sql.Identifier(column), sql.SQL(value), STREAM))
        with pytest.raises(psycopg.errors.ForeignKeyViolation, match="stream 99 does not exist"):
            app.execute("insert into pgstream.events (payload, stream_id) values ('{}', 99)")
        app.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g), %s "
                    "from generate_series(1, 20) g", [STREAM])
    # the owner slips: explicit duplicate ids and dates are not taken either
    with psycopg.connect(db_url, autocommit=True) as owner:
        with pytest.raises(psycopg.errors.CheckViolation, match="created_at of an event is set by the database"):
            owner.execute("insert into pgstream.events (payload, stream_id, created_at) "
                          "values ('{}', %s, '-infinity')", [STREAM])
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            owner.execute("insert into pgstream.events (payload, stream_id) values ('{}', 99)")
        (top,) = owner.execute("select max(id) from pgstream.events").fetchone()  # type: ignore[misc]
        forged = owner.execute("insert into pgstream.events (id, payload, stream_id) values (%s, '{}', %s), "
                               "(%s, '{}', %s), (1, '{}', %s) returning id",
                               [top + 1000, STREAM, top + 1000, STREAM, STREAM]).fetchall()
    forged_ids = [r[0] for r in forged]
    assert len(set(forged_ids)) == 3 and min(forged_ids) > top and top + 1000 not in forged_ids
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.events where stream_id = 99").fetchone() == (0,)
        ids = [r[0] for r in c.execute("select id from pgstream.events order by created_at, id")]
    assert ids == sorted(ids) and len(ids) == len(set(ids)) == 23
    until(driver, lambda: endpoint.unique() >= set(sent_ids(db_url)))
    report("manual events: forged ids, dates, unknown stream", endpoint, db_url)
    assert dead_letters(db_url) == []


def test_unreadable_created_at_is_set_aside_and_the_stream_moves_on(db_url: str, tmp_path: Path,
                                                                    instance: dg.DagsterInstance,
                                                                    endpoint: Endpoint) -> None:
    """Only a superuser with triggers off can write such a row; the sensor must not stall on it."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    start(driver)
    insert_events(db_url, STREAM, 30)
    with psycopg.connect(db_url, autocommit=True) as c:
        for value in ("infinity", "-infinity", "10000-01-01", "0044-03-15 BC"):
            backdated(c, "insert into pgstream.events (payload, stream_id, created_at) "
                         "values (jsonb_build_object('bad', %s::text), %s, %s::timestamptz)", [value, STREAM, value])
    insert_events(db_url, STREAM, 30, 30)
    until(driver, lambda: len(endpoint.unique()) >= 60 and not slot_has_events(db_url))
    aside = dead_letters(db_url)
    assert [d["stage"] for d in aside] == ["read"] * 4
    assert all("cannot be represented" in d["error"] and d["payload"]["bad"] for d in aside)
    assert all(d["lsn"] is not None and d["batch_id"] is None for d in aside)
    assert open_dead_letters(db_url) == 4
    report("created_at infinity / -infinity / year 10000 / BC", endpoint, db_url)
    # the slot was read past them (nothing retained for them) and a new event still flows
    insert_events(db_url, STREAM, 5, 60)
    until(driver, lambda: len(endpoint.unique()) >= 65)
    # a lost slot recovers from the table without recording them again
    drop_slot(db_url)
    insert_events(db_url, STREAM, 5, 65)
    until(driver, lambda: len(endpoint.unique()) >= 70)
    assert len(dead_letters(db_url)) == 4
    report("created_at unreadable, then slot lost", endpoint, db_url)


# --------------------------------------------------------------------------------------------
# retention


def test_housekeeping_keeps_an_old_event_nobody_delivered(db_url: str, tmp_path: Path,
                                                          instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    start(driver)
    insert_events(db_url, STREAM, 10)
    until(driver, lambda: len(endpoint.unique()) >= 10)
    held = threading.Event()

    def hold(_request: int) -> None:  # (an open run would deliver it within milliseconds)
        held.wait(60)

    endpoint.hook = hold
    with psycopg.connect(db_url, autocommit=True) as c:
        # dated 40 days ago and not delivered yet (not read, or read and its call held): must stay
        backdated(c, "insert into pgstream.events (payload, stream_id, created_at) "
                     "values ('{\"old\": true}', %s, now() - interval '40 days')", [STREAM])
        report_ = run_housekeeping(c, HousekeepingConfig(retention_days=7))
        left = c.execute("select count(*) from pgstream.events_default").fetchone()
    held.set()
    endpoint.hook = None
    assert report_.default_rows_deleted == 0 and left == (1,)
    assert any("1 expired rows of events_default are kept" in w for w in report_.warnings)
    until(driver, lambda: len(endpoint.unique()) >= 11 and caught_up(db_url))
    report("undelivered old event across housekeeping", endpoint, db_url)
    with psycopg.connect(db_url, autocommit=True) as c:
        # once delivered (and its batch closed), it is deleted like any expired row
        final = run_housekeeping(c, HousekeepingConfig(retention_days=7))
    assert final.default_rows_deleted == 1


# --------------------------------------------------------------------------------------------
# a poison event for the sink


def test_poison_event_with_block_waits_until_the_operator_sets_it_aside(db_url: str, tmp_path: Path,
                                                                        instance: dg.DagsterInstance,
                                                                        endpoint: Endpoint) -> None:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    start(driver)
    insert_events(db_url, STREAM, 100)
    poison = sent_ids(db_url)[42]
    endpoint.reject_ids = {poison}
    drive(driver, lambda: in_failover(db_url), timeout=60)  # the events before it are delivered, then it blocks
    assert poison not in endpoint.unique() and max(endpoint.unique()) < poison  # nothing overtook it
    with psycopg.connect(db_url) as c:
        (error,) = c.execute("select failover_error from pgstream.streams where id = %s", [STREAM]).fetchone()  # type: ignore[misc]
    assert "422" in error and f"invalid event {poison}" in error
    # the operator's choice: set the one event aside (not the whole batch) and go on
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select pgstream.set_aside_events(%s, %s, 'the receiver refuses it')",
                         [STREAM, [poison]]).fetchone() == (1,)
        c.execute("select pgstream.retry_now(%s)", [STREAM])
    until(driver, lambda: len(endpoint.unique()) >= 99 and not in_failover(db_url))
    (letter,) = dead_letters(db_url)
    assert letter["event_id"] == poison and letter["stage"] == "deliver"
    assert "the receiver refuses it" in letter["error"]
    report("poison event, on_reject: block, then set aside", endpoint, db_url)


def test_poison_event_with_dead_letter_is_set_aside_and_the_rest_delivered(db_url: str, tmp_path: Path,
                                                                          instance: dg.DagsterInstance,
                                                                          endpoint: Endpoint) -> None:
    cfg = stream_config(endpoint, delivery={"chunk_size": 20, "run_grace_secs": 10, "on_reject": "dead_letter",
                                             "max_attempts": 2})
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [cfg]), instance)
    start(driver)
    insert_events(db_url, STREAM, 100)
    ids = sent_ids(db_url)
    poison = {ids[0], ids[42], ids[99]}  # first, middle (mid-chunk) and last
    endpoint.reject_ids = set(poison)
    until(driver, lambda: len(endpoint.unique()) >= 97 and caught_up(db_url))
    assert not in_failover(db_url)
    letters = dead_letters(db_url)
    assert {d["event_id"] for d in letters} == poison
    for d in letters:
        assert d["stage"] == "deliver" and d["status"] == "open" and d["attempts"] == 2
        assert "HTTP 422" in d["error"] and f"invalid event {d['event_id']}" in d["error"]
        assert d["payload"] is not None and d["batch_id"] is not None and d["ord"] >= 1
    assert open_dead_letters(db_url) == 3
    report("poison events, on_reject: dead_letter", endpoint, db_url, ids_in_refused_requests=len(endpoint.rejected))
    # the receiver is fixed: the operator redelivers them from the Launchpad (the replay job), in order
    endpoint.reject_ids = set()
    before = len(endpoint.accepted)
    job = driver.defs.resolve_job_def(REPLAY_JOB)
    result = job.execute_in_process(run_config={"ops": {REPLAY_OP: {"config": {"stream_id": STREAM,
                                                                             "dead_letters": True}}}},
                                    instance=instance, raise_on_error=False)
    assert result.success
    assert endpoint.accepted[before:] == sorted(poison)
    assert {d["status"] for d in dead_letters(db_url)} == {"redelivered"} and open_dead_letters(db_url) == 0
    assert endpoint.unique() == set(sent_ids(db_url))
