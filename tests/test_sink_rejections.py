"""What one event can do to a stream, end to end (issue 28, findings 8-10): real Postgres with
logical replication, a real Dagster instance, real delivery runs, a real HTTP endpoint and the Redis
on 127.0.0.1:6379. Every hostile event is written from a fresh connection as an application role
with the documented manual-event grant; afterwards the stream must still deliver everyone else's
events, in order, with ``on_reject: dead_letter`` setting aside exactly the events at fault.

* A payload Python cannot parse (nesting deeper than its recursion limit) is a per-event rejection
  in every routed sink, on delivery and on redelivery; a number of more digits than Python converts
  to ``int`` is delivered as it is.
* A route taken from the event (a ``path_from`` segment the receiver does not serve, a
  ``headers_from`` value too large to send) is the event's rejection, not a configuration error.
* A reject storm an application writes does not block the stream; a receiver that refuses
  everything, including what it took before, does.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
import redis

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.config import load_config
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine import deadletters

from .support.endpoint import Endpoint
from .support.faults import STREAM, fail_into_failover, in_failover, stream_config
from .support.harness import Driver, write_config
from .support.lake import LAKE_FORMATS, lake_config, lake_ids
from .support.sinks import REDIS_URL, stream_entries, unique
from .test_fault_integrity import as_role
from .test_sink_lake import gauges_table

#: nested deeper than Python's json parser goes (its recursion limit, 1,000), well within Postgres'
DEEP = '{"tenant": "a", "deep": ' + "[" * 3000 + "]" * 3000 + "}"
#: an integer of more digits than Python converts to int (4,300)
HUGE = "9" * 5000


def delivery(**over: Any) -> dict[str, Any]:
    return {"chunk_size": 20, "run_grace_secs": 2, "on_reject": "dead_letter", "max_attempts": 1, **over}


def start(tmp_path: Path, db_url: str, instance: dg.DagsterInstance, cfg: dict[str, Any]) -> Driver:
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [cfg]), instance)
    driver.tick(STREAM)
    return driver


def write(db_url: str, role: str | None, payloads: list[str]) -> list[int]:
    """Insert events with these payloads (JSON text), one transaction each, as ``role`` from a fresh
    connection (``None``: the owner); their ids."""
    with (as_role(db_url, role) if role else psycopg.connect(db_url, autocommit=True)) as conn:
        for payload in payloads:  # the role may insert, not read: the owner reads the ids
            conn.execute("insert into pgstream.events (payload, stream_id) values (%s::jsonb, %s)", [payload, STREAM])
    with psycopg.connect(db_url) as conn:
        ids = [r[0] for r in conn.execute("select id from pgstream.events where stream_id = %s order by id desc "
                                          "limit %s", [STREAM, len(payloads)])]
    return ids[::-1]


def deliver(driver: Driver, done: Callable[[], bool], timeout: float = 60) -> None:
    """Tick and execute until ``done`` (the group delivery run, in the background, delivers meanwhile); every run
    must succeed (nothing stalls the stream)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the stream did not deliver in time"
        for request in driver.tick(STREAM).run_requests or []:
            result = driver.execute(request)
            assert result.success, [e.message for e in result.all_events if e.is_failure]
        time.sleep(0.05)


def letters_by_event(db_url: str) -> dict[int, str]:
    """The stream's open dead letters: event id -> error, in the order they were set aside (their
    payloads stay text: psycopg's own JSON loader would fail on one nested too deep)."""
    with psycopg.connect(db_url) as conn:
        return dict(conn.execute("select event_id, error from pgstream.dead_letters where stream_id = %s "
                                 "and status = 'open' order by id", [STREAM]).fetchall())


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    client.close()


# --------------------------------------------------------------------------------------------
# finding 8: content Python cannot parse


def test_a_payload_python_cannot_parse_is_one_dead_letter_of_the_webhook(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint, manual_role: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    sink = {**endpoint.sink("per_event"), "path_from": "tenant"}
    driver = start(tmp_path, db_url, instance, stream_config(sink, delivery=delivery()))
    ok1, deep, ok2, huge = write(db_url, manual_role, ['{"tenant": "a", "n": 1}', DEEP, '{"tenant": "a", "n": 2}',
                                                       '{"tenant": "a", "n": ' + HUGE + "}"])
    deliver(driver, lambda: len(endpoint.unique()) >= 3)
    assert endpoint.first_seen_order() == [ok1, ok2, huge]  # in order, around the one set aside
    assert HUGE.encode() in endpoint.bodies[huge]  # the number, as written
    assert list(letters_by_event(db_url)) == [deep]
    assert "nested deeper than Python can parse" in letters_by_event(db_url)[deep]
    assert not in_failover(db_url)
    # redelivered (after the consumer was "fixed"): the sink rejects it again, nothing crashes
    stream = load_config(driver.config_path).streams[0]
    with psycopg.connect(db_url, autocommit=True) as conn:
        report = deadletters.redeliver(conn, stream, None, "test")
    assert report.failed is not None and "nested deeper than Python can parse" in (report.error or "")
    assert endpoint.first_seen_order() == [ok1, ok2, huge]
    # the operator looks at it: shown as stored
    assert cli_main(["dead-letters", "show", str(report.failed), "--database-url", db_url]) == 0
    shown = capsys.readouterr().out
    assert f"event {deep}" in shown and "[" * 3000 in shown


def test_a_payload_python_cannot_parse_is_one_dead_letter_of_a_redis_stream(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, manual_role: str, redis_client: redis.Redis) -> None:
    prefix = unique("poison") + "."
    sink = {"type": "redis", "url": REDIS_URL, "stream": prefix + "unrouted", "stream_from": "tenant",
            "stream_prefix": prefix}
    driver = start(tmp_path, db_url, instance, stream_config(sink, delivery=delivery()))
    try:
        ok1, deep, ok2 = write(db_url, manual_role, ['{"tenant": "a", "n": 1}', DEEP, '{"tenant": "a", "n": 2}'])
        deliver(driver, lambda: redis_client.xlen(prefix + "a") >= 2)
        assert [int(fields["id"]) for _id, fields in stream_entries(redis_client, prefix + "a")] == [ok1, ok2]
        assert list(letters_by_event(db_url)) == [deep]
        assert "nested deeper than Python can parse" in letters_by_event(db_url)[deep]
    finally:
        redis_client.delete(prefix + "a", prefix + "unrouted")


# --------------------------------------------------------------------------------------------
# finding 9: routes taken from the event


def test_a_path_segment_the_receiver_does_not_serve_and_a_huge_header_are_the_events(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint, manual_role: str) -> None:
    endpoint.paths = {"/events/a", "/events/b"}
    sink = {**endpoint.sink("per_event"), "path_from": "tenant", "headers_from": {"X-Note": "note"}}
    driver = start(tmp_path, db_url, instance, stream_config(sink, delivery=delivery()))
    ok1, missing, huge, ok2 = write(db_url, manual_role, [
        '{"tenant": "a", "note": "hi"}', '{"tenant": "nobody"}', '{"tenant": "b", "note": "' + "x" * 20_000 + '"}',
        '{"tenant": "b"}'])
    deliver(driver, lambda: len(endpoint.unique()) >= 2)
    assert endpoint.first_seen_order() == [ok1, ok2]
    letters = letters_by_event(db_url)
    assert list(letters) == [missing, huge]
    assert "HTTP 404" in letters[missing] and "came from the event" in letters[missing]
    assert "max_header_value_bytes" in letters[huge] and "x" * 100 not in letters[huge]  # never the value
    assert set(endpoint.not_found) == {missing}  # the huge header was never sent
    assert not in_failover(db_url)


# --------------------------------------------------------------------------------------------
# finding 10: reject storms


def test_an_application_writing_a_reject_storm_does_not_block_the_stream(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint, manual_role: str) -> None:
    endpoint.reject_marker = b'"refuse"'  # the receiver refuses these events for what they are (422)
    driver = start(tmp_path, db_url, instance, stream_config(endpoint.sink("per_event"), delivery=delivery()))
    before = write(db_url, None, ['{"n": 1}', '{"n": 2}'])
    deliver(driver, lambda: endpoint.unique() == set(before))
    # the attack: 25 refused events in a row (more than max_consecutive_rejects, 20), from a fresh connection
    storm = write(db_url, manual_role, [f'{{"kind": "refuse", "n": {i}}}' for i in range(25)])
    after = write(db_url, None, [f'{{"n": {i}}}' for i in range(3, 8)])
    deliver(driver, lambda: endpoint.unique() == set(before + after))
    assert endpoint.first_seen_order() == before + after
    assert list(letters_by_event(db_url)) == storm
    assert not in_failover(db_url)
    # what checked the receiver: the last delivered event sent again (a duplicate by id), not the storm
    assert endpoint.duplicates() >= 1 and set(endpoint.accepted) == set(before + after)


def test_a_receiver_that_refuses_everything_still_blocks_the_stream(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    endpoint.paths = {"/events/a", "/events/b"}
    sink = {**endpoint.sink("per_event"), "path_from": "tenant"}
    driver = start(tmp_path, db_url, instance,
                   stream_config(sink, delivery=delivery(max_consecutive_rejects=5)))
    good = write(db_url, None, ['{"tenant": "a"}', '{"tenant": "b"}'])
    deliver(driver, lambda: endpoint.unique() == set(good))
    endpoint.paths = set()  # the receiver is misconfigured: every call is answered 404, whatever the event
    write(db_url, None, [f'{{"tenant": "{t}"}}' for t in "ababababab"])
    error = fail_into_failover(driver, db_url)
    assert "HTTP 404" in error and f"now also rejects event {good[-1]}, which it confirmed before" in error
    assert letters_by_event(db_url) == {}  # checked at the first rejection: nothing was set aside
    assert endpoint.unique() == set(good)


# --------------------------------------------------------------------------------------------
# issue 43, finding 5: a value a lake table's typed column cannot hold


@pytest.mark.parametrize("kind", LAKE_FORMATS)
def test_a_manual_event_a_typed_lake_column_cannot_hold_is_one_dead_letter(
        kind: str, db_url: str, pg: LocalPostgres, tmp_path: Path, instance: dg.DagsterInstance,
        manual_role: str) -> None:
    """A manual event ``{"new": {"n": 70000}}`` for a ``smallint`` column (and a date that is none)
    once kept the stream in failover, whatever ``on_reject`` said. Now each is a dead letter; the
    events around it, in the same publish call, land in the table exactly once."""
    gauges_table(db_url, STREAM)
    sink = {**lake_config(kind, tmp_path, pg), "typed_columns": True, "database_url": db_url}
    driver = start(tmp_path, db_url, instance, stream_config(sink, delivery=delivery()))

    def row(values: str) -> str:
        return ('{"tg_op": "INSERT", "tg_name": "gauges", "tg_table_schema": "public", "tg_table_name": "gauges", '
                '"new": {' + values + '}}')
    written = write(db_url, manual_role, [row('"id": 1, "n": 7'), row('"id": 2, "n": 70000'), row('"id": 3, "n": 8'),
                                          row('"id": 4, "on_day": "2026-13-45"'), row('"id": 5, "n": 9')])
    good = [written[0], written[2], written[4]]
    deliver(driver, lambda: set(lake_ids(sink, STREAM)) >= set(good))
    assert lake_ids(sink, STREAM) == Counter({i: 1 for i in good})
    letters = letters_by_event(db_url)
    assert list(letters) == [written[1], written[3]]
    assert "'n' (smallint) cannot hold the row's value: out of range" in letters[written[1]]
    assert "'on_day' (date) cannot hold the row's value: not a date" in letters[written[3]]
    assert not in_failover(db_url)
