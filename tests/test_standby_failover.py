"""Failover of the Postgres primary (issue 46): a real primary and a streaming standby made by
``pg_basebackup`` (tests/support/standby.py), the streams reading through a libpq multi-host URL with
``target_session_attrs=read-write``, a trickle of rows on two streams (one through a subscription's
generated trigger, one of events inserted directly) to an HTTP sink sending one event per request,
kill -9 of the primary mid-trickle, the standby promoted, the application writing on.

Counted end to end against what the new primary holds: none of its events lost, its ledger holds each
once, first deliveries in its commit order, and no event id delivered for two different rows (the
sink's ``webhook-id``, which docs/sinks.md tells consumers to deduplicate by). Events the sink got that
the new primary lacks (phantoms) are inherent to asynchronous replication: counted, and with
synchronous replication there are none. Each test prints an ``HA {...}`` line.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.engine.migrations import migrate

from .support.faults import start, stream_config
from .support.harness import Driver, write_config
from .support.http_recorder import HttpRecorder
from .support.standby import StandbyPair

STREAMS = (1, 2)  # 1: rows of public.items through the generated trigger; 2: events inserted directly
SLOTS = 1  # the two streams' slot: their reader group's (default)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandbyPair]:
    """One primary for the module; each test adds a standby and promotes it (the pair rolls)."""
    servers = StandbyPair(tmp_path_factory.mktemp("ha"))
    yield servers
    servers.destroy()


def _database(pair: StandbyPair, name: str) -> str:
    """A migrated database on the primary with the two streams, replicated; its multi-host URL."""
    pair.primary.create_database(name)
    url = pair.primary.url_for(name)
    migrate(url)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("create table public.items (id bigserial primary key, tag text not null)")
        c.execute("insert into pgstream.streams (id) values (1), (2) on conflict do nothing")
        c.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                  "values ('items', 1, 'INSERT', 'items', '{tag}')")
    pair.catch_up()
    return pair.url_for(name)


class Writer:
    """The application: one row at a time, alternating the streams, each in its own transaction, through
    the multi-host URL; reconnects when the server goes away. ``committed``: the tags whose commit
    the server acknowledged."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.committed: list[str] = []
        self.committed_at: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        conn: psycopg.Connection | None = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.url, autocommit=True)
                tag = f"r{n}"
                if n % 2 == 0:
                    conn.execute("insert into public.items (tag) values (%s)", [tag])
                else:
                    conn.execute("insert into pgstream.events (payload, stream_id) "
                                 "values (jsonb_build_object('tag', %s::text), 2)", [tag])
                self.committed.append(tag)
                self.committed_at[tag] = time.monotonic()
                n += 1
                time.sleep(0.01)
            except psycopg.OperationalError:
                conn = None
                n += 1  # the fate of that row is unknown: its tag is not used again
                time.sleep(0.1)
        if conn is not None:
            conn.close()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def _delivered(recorder: HttpRecorder) -> list[tuple[int, str, float]]:
    """(event id, the row's tag, arrival) of every request the sink got, in arrival order."""
    with recorder.lock:
        received = list(recorder.received)
    return [(int(r.headers["webhook-id"]), _tag(r.body.get("payload", r.body)), r.at) for r in received]


def _tag(payload: dict[str, Any]) -> str:
    """The row's tag: in the row of a subscription's event (``new``), or in an event inserted directly."""
    return str((payload.get("new") or payload)["tag"])


def _held(url: str) -> dict[int, tuple[int, str]]:
    """The new primary's events: id -> (stream, tag)."""
    with psycopg.connect(url) as c:
        return {i: (s, _tag(p)) for i, s, p in c.execute("select id, stream_id, payload from pgstream.events")}


def _ledger(url: str, stream: int) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select unnest(event_ids) from pgstream.batches where stream_id = %s "
                                        "order by id", [stream])]


def _drive(driver: Driver, done: Any, timeout: float = 240) -> list[str]:
    """Tick both streams and execute what they ask for until ``done()``, as the daemon would through the
    failover; returns the skip reasons of the ticks that waited for the database."""
    deadline = time.monotonic() + timeout
    waited: list[str] = []
    while not done():
        assert time.monotonic() < deadline, "the streams did not catch up in time"
        for stream in STREAMS:
            tick = driver.tick(stream)  # a tick that loses its server says so in one line, raises nothing
            said = tick.skip_message or ""
            if "waiting for" in said or "cannot connect" in said:
                waited.append(said)
                time.sleep(0.2)
            for request in tick.run_requests:
                driver.execute(request)
        time.sleep(0.02)
    return waited


def _failures(driver: Driver) -> list[str]:
    """The failure messages of the runs that failed."""
    return [f"{error.cls_name}: {error.message.strip()}" for result in driver.results if not result.success
            for event in result.all_events if event.event_type_value == "STEP_FAILURE"
            if (error := event.step_failure_data.error) is not None]


def _fail_over_under_trickle(pair: StandbyPair, name: str, tmp_path: Path, instance: dg.DagsterInstance,
                             recorder: HttpRecorder, lagging: bool, held_back: bool = False,
                             before_kill: Any = None) -> dict[str, Any]:
    """The trickle, kill -9 of the primary once 150 events went out (with ``lagging``: the standby cut off
    after 100, and 20 events written after that delivered, which it never gets; with ``held_back`` as well,
    the primary's decoding waits for the standby: 1 s of writes it never gets), promotion, 2 s of writes
    on the new primary; every check that holds in each mode. Returns what was counted."""
    url = _database(pair, name)
    configs = [stream_config({"type": "http", "url": recorder.url, "mode": "per_event", "max_attempts": 1,
                              "timeout_secs": 10}, id=stream) for stream in STREAMS]
    driver = Driver(write_config(tmp_path / "pgstream.yaml", url, configs), instance)
    start(driver, STREAMS)  # the group's slot
    writer = Writer(url)
    promoted: list[float] = []

    def fault() -> None:
        def sent(n: int, since: float = 0) -> bool:
            return sum(writer.committed_at.get(t, 0) > since for _i, t, _a in _delivered(recorder)) >= n
        while not sent(100):
            time.sleep(0.02)
        if before_kill is not None:
            before_kill()  # (the standby has synchronized the slots)
        if lagging:
            pair.cut_off_standby()
            cut_off = time.monotonic()
            while not held_back and not sent(20, since=cut_off):  # rows the standby never got, delivered
                time.sleep(0.02)
        if held_back:
            time.sleep(1)  # rows the standby never gets: held back from the sink
        while not held_back and not sent(150):
            time.sleep(0.02)
        promoted.append(pair.fail_over())
        time.sleep(2)
        writer.finish()

    failed: list[BaseException] = []  # what the fault's thread raised (raised here)

    def faulting_thread() -> None:
        try:
            fault()
        except BaseException as exc:
            failed.append(exc)
    faulting = threading.Thread(target=faulting_thread, daemon=True)
    faulting.start()
    try:
        def caught_up() -> bool:
            if failed:
                raise failed[0]
            if faulting.is_alive():
                return False
            held = _held(pair.url_for(name))
            return set(held) <= {i for i, _t, _a in _delivered(recorder)}
        waited = _drive(driver, caught_up)
    finally:
        writer.stop.set()
    faulting.join(5)
    new = pair.url_for(name)
    held = _held(new)
    delivered = _delivered(recorder)
    rows_of: dict[int, set[str]] = {}
    for event_id, tag, _at in delivered:
        rows_of.setdefault(event_id, set()).add(tag)
    # no id delivered for two different rows: a consumer deduplicating by webhook-id drops nothing
    assert {i: t for i, t in rows_of.items() if len(t) > 1} == {}
    # none of the new primary's events lost, and each delivered as the row it is
    assert set(held) <= set(rows_of), f"lost: {sorted(set(held) - set(rows_of))[:20]}"
    assert all(rows_of[i] == {tag} for i, (_s, tag) in held.items())
    for stream in STREAMS:
        order = _ledger(new, stream)
        assert len(order) == len(set(order)), "an event twice in the ledger"
        assert set(order) == {i for i, (s, _t) in held.items() if s == stream}
        recorded = set(order)
        first = list(dict.fromkeys(i for i, _t, _a in delivered if i in recorded))
        assert first == order, f"stream {stream}: first deliveries out of commit order"
    # the outage in one line: a tick that lost its server said so (it raised nothing: _drive), and so did
    # every run that failed, each with a Failure of one line (not psycopg's error and its traceback)
    failures = _failures(driver)
    assert all(f.startswith("Failure: ") and "\n" not in f for f in failures), failures
    phantoms = sorted(set(rows_of) - set(held))
    new_ids = [i for i, (_s, t) in held.items() if writer.committed_at.get(t, 0) > promoted[0]]
    assert new_ids, "nothing was written on the new primary"
    # the new primary's ids lie above every id delivered before it was promoted
    assert min(new_ids) > max(i for i, _t, at in delivered if at < promoted[0])
    # ...though its sequence resumed from what the standby had replayed: the ids the old primary delivered
    # that the sequence's part of a new id (sql/031_event_ids_per_timeline.sql) would have named again
    sequence_part = (1 << 48) - 1
    reused_without_timeline = [i for i in phantoms if i & sequence_part >= min(new_ids) & sequence_part]
    # the first row written on the new primary, from its promotion to its delivery (reported, not asserted)
    written_after = {t for t, at in writer.committed_at.items() if at >= promoted[0]}
    first_after_promotion = min((at for _i, t, at in delivered if t in written_after), default=None)
    mode = ("async, standby lagging" if lagging else "sync") + (", failover slots" if held_back else "")
    counts = {"mode": mode, "committed": len(writer.committed),
              "held": len(held), "delivered": len(rows_of), "phantoms": len(phantoms),
              "acknowledged_but_lost": len(set(writer.committed) - {t for _s, t in held.values()}),
              "duplicates": len(delivered) - len(rows_of),
              "ids_a_plain_sequence_would_reuse": len(reused_without_timeline),
              "first_new_event_secs": None if first_after_promotion is None
              else round(first_after_promotion - promoted[0], 1), "runs_failed": len(failures),
              "ticks_waiting": len(waited)}
    print("HA " + json.dumps(counts))
    return counts


def test_async_standby_lagging_at_the_kill_reuses_no_delivered_id(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder) -> None:
    pair.add_standby(synchronous=False)
    counts = _fail_over_under_trickle(pair, "ha_async", tmp_path, instance, http_server, lagging=True)
    # the standby was cut off before the last deliveries: the sink got events the new primary lacks, and
    # the new primary's sequence resumed below their ids
    assert counts["phantoms"] > 0 and counts["ids_a_plain_sequence_would_reuse"] > 0


def test_async_standby_with_failover_slots_lagging_at_the_kill_delivers_no_phantom(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder) -> None:
    """Failover slots (Postgres 17+): pgstream's slots are created with failover => true, the standby
    synchronizes them, and the primary's decoding of them waits for the standby (synchronized_standby_slots):
    cut off, the standby holds the primary's deliveries back; nothing went out that the new primary lacks.
    After the promotion the synchronized slots are replaced (replication.slot_info) and the gap recovered."""
    standby = pair.add_standby(synchronous=False, failover_slots=True)
    with psycopg.connect(standby.url, autocommit=True) as s:
        counts = _fail_over_under_trickle(pair, "ha_slots", tmp_path, instance, http_server, lagging=True,
                                          held_back=True, before_kill=lambda: _wait_for(lambda: s.execute(
                                              "select count(*) from pg_replication_slots where synced and "
                                              "database = 'ha_slots'").fetchone() == (SLOTS,), timeout=60))
    assert counts["phantoms"] == 0
    with psycopg.connect(pair.url_for("ha_slots")) as c:
        assert c.execute("select count(*) from pg_replication_slots where database = 'ha_slots' and failover "
                         "and not synced").fetchone() == (SLOTS,)  # replaced, failover slots again


def test_sync_standby_loses_no_acknowledged_row_and_delivers_no_phantom(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder) -> None:
    pair.add_standby(synchronous=True)
    counts = _fail_over_under_trickle(pair, "ha_sync", tmp_path, instance, http_server, lagging=False)
    assert counts["phantoms"] == 0
    assert counts["acknowledged_but_lost"] == 0



def test_an_event_committed_but_not_yet_visible_during_a_recovery_is_recorded_from_the_slot(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder) -> None:
    """A recovery from the table (after a promotion, a slot lost or created) reads the events no batch covers
    with a snapshot, while the slot decodes what commits. A transaction whose commit is in the WAL before that
    snapshot but not yet visible to it (its backend has not left the proc array; with synchronous replication
    it waits for the standby in between) is not in the recovery: the slot's batch must keep it. Held there by
    a synchronous standby that never answers (for that session only: the others commit locally)."""
    pair.primary.create_database("ha_visible")
    url = pair.primary.url_for("ha_visible")
    migrate(url)
    driver = Driver(write_config(tmp_path / "pgstream.yaml", url, [stream_config(
        {"type": "http", "url": http_server.url, "mode": "per_event", "max_attempts": 1}, id=2)]), instance)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id) values (2) on conflict do nothing")
        c.execute("alter database ha_visible set synchronous_commit = local")
    start(driver, (2,))  # the group's slot
    _synchronous_standby(pair, "nobody")
    held = psycopg.connect(url, autocommit=True)
    try:
        held.execute("set synchronous_commit = on")
        pid = held.info.backend_pid
        writing = threading.Thread(target=lambda: held.execute(
            "insert into pgstream.events (payload, stream_id) values ('{\"tag\": \"held\"}', 2)"), daemon=True)
        writing.start()
        with psycopg.connect(url, autocommit=True) as c:
            _wait_for(lambda: c.execute("select wait_event from pg_stat_activity where pid = %s", [pid]).fetchone()
                      == ("SyncRep",))
            # an event committed after it, visible: the recovery records it, at a WAL position past the held one
            c.execute("insert into pgstream.events (payload, stream_id) values ('{\"tag\": \"visible\"}', 2)")
            # as after a promotion (the group's slot replaced): the group's members recover from the table
            c.execute("update pgstream.reader_groups set recovery_pending = true where name = 'default'")

            def recovered() -> bool:  # the recovery (the held event not visible to it), then the slot (both decoded)
                driver.tick(2)  # (the group delivery run's reader recovers, at its next read, or this tick)
                return c.execute("select count(*) from pgstream.batches where kind = 'recovery'").fetchone() == (1,)
            _wait_for(recovered, timeout=30)
            c.execute("select pg_cancel_backend(%s)", [pid])  # the wait ends: committed locally, visible now
            writing.join(10)

            def recorded() -> bool:
                driver.tick(2)
                return c.execute("select count(*) from pgstream.batches b join pgstream.events e "
                                 "on e.id = any(b.event_ids) where b.stream_id = 2").fetchone() == (2,)
            _wait_for(recorded, timeout=20)  # each event once in the ledger
    finally:
        held.close()
        _synchronous_standby(pair, "")


def _synchronous_standby(pair: StandbyPair, names: str) -> None:
    with psycopg.connect(pair.primary.url, autocommit=True) as admin:
        admin.execute(f"alter system set synchronous_standby_names = '{names}'")
        admin.execute("select pg_reload_conf()")


def _wait_for(done: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
