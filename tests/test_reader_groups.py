"""Reader groups (``streams[].reader``): one slot and one publication for several streams, the WAL
decoded once by the group's reader (``engine/ingest/group.py``), each stream's transactions recorded
once in its own ledger, in commit order; a stream that had its own slot joins without losing or
repeating an event; a lost group slot is replaced and every member recovers; nobody but the owner's
functions changes who is in a group."""

# ruff: noqa: S608 -- the attacks are SQL built from the test's own role, type and function names
from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.config import DEFAULT_READER, StreamConfig, load_config, streams_fingerprint
from pgstream_dagster.defs.names import GROUP_DELIVERY_JOB, GROUP_TAG, STREAM_TAG, member_tag, stream_sensor_name
from pgstream_dagster.devdb import LocalPostgres, ensure_running
from pgstream_dagster.engine import ingest, limits, migrations, replication
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.ingest import group as group_reader
from pgstream_dagster.engine.ingest import recorder
from pgstream_dagster.engine.ingest.source import PeekSource
from pgstream_dagster.engine.ledger import groups, locks
from pgstream_dagster.engine.ledger import state as ledger_state
from pgstream_dagster.engine.ledger import streams as ledger_streams
from pgstream_dagster.engine.migrations import migrate
from pgstream_dagster.engine.status import render_status, stream_status

from .conftest import drop_database, fresh_database, migrated_template
from .support.endpoint import Endpoint
from .support.harness import (
    Background,
    Driver,
    group_tag_of,
    insert_events,
    read_jsonl,
    slot_of,
    stream_tag_of,
    write_config,
)
from .support.legacy_streams import SlotInUse, ensure_stream

GROUP = "shared"


@pytest.fixture(scope="module")
def few_slots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A Postgres of its own with room for 4 replication slots only."""
    server = ensure_running(tmp_path_factory.mktemp("pg4") / "data",
                            extra_settings={"fsync": "off", "full_page_writes": "off", "max_replication_slots": "4",
                                            "max_wal_senders": "4"})
    yield server
    server.destroy()


def _configs(tmp_path: Path, url: str, ids: list[int], *, group: Mapping[int, str | None] | None = None,
             batch: dict[str, Any] | None = None) -> list[StreamConfig]:
    """Streams ``ids`` in mode per_batch, each in group :data:`GROUP` unless ``group`` names another (``None``: the
    entry names none, so the stream is in the default group)."""
    group = group or {}
    streams = []
    for i in ids:
        stream: dict[str, Any] = {"id": i, "batch": batch or {"max_size": 100, "max_fill_secs": 0},
                                  "delivery": {"mode": "per_batch"},
                                  "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}}
        reader = group.get(i, GROUP)
        if reader is not None:
            stream["reader"] = reader
        streams.append(stream)
    return list(load_config(write_config(tmp_path / "pgstream.yaml", url, streams)).streams)


def _recorded(url: str, stream_id: int) -> list[int]:
    """The stream's ledger, event by event, in ledger order."""
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select e from pgstream.batches b, unnest(b.event_ids) with ordinality u(e, o) "
                                        "where b.stream_id = %s order by b.id, u.o", [stream_id])]


def _events(url: str, stream_id: int) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id",
                                        [stream_id])]


def _pgstream_slots(url: str) -> list[str]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select slot_name from pg_replication_slots where database = "
                                        "current_database() and slot_name like 'pgstream%' order by 1")]


def _own_slot(conn: psycopg.Connection, stream_id: int) -> str:
    """Stream ``stream_id`` as a version with a slot per stream left it: its row, outside any group, and its own
    slot (created now); the slot's name."""
    slot = ensure_stream(conn, stream_id)
    replication.create_slot(conn, slot)
    return slot


def _read_as_before(conn: psycopg.Connection, stream: StreamConfig) -> int:
    """What such a stream's own sensor did at each tick: what waits in its own slot recorded in its ledger (as
    ``sensor``), then confirmed; the events recorded."""
    source = PeekSource(conn, ledger_streams.stream_slot(conn, stream.id), stream.publication, 100_000)
    txns = source.read(0)
    target = recorder.StreamLedger(stream, ledger_state.SENSOR)
    assert recorder.record_pass(conn, {stream.id: target}, {stream.id: txns}) == set()
    if txns:
        source.confirm(txns[-1].end_lsn)
    return target.events


def _drain(conn: psycopg.Connection, streams: list[StreamConfig], until: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        ingest.consume_group(conn, GROUP, streams, 0.2)


def test_twelve_streams_share_one_slot_and_each_ledger_gets_its_events_once_in_commit_order(
        few_slots: LocalPostgres, tmp_path: Path) -> None:
    few_slots.create_database("twelve")
    url = few_slots.url_for("twelve")
    migrate(url)
    ids = list(range(1, 13))
    with psycopg.connect(url, autocommit=True) as c:
        # the preflight: twelve streams in a group each (a slot each) do not fit in 4, one group does
        alone = {i: f"g{i:02d}" for i in ids}
        (line,) = [p for p in limits.postgres_problems(c, _configs(tmp_path, url, ids, group=alone))
                   if "max_replication_slots" in p]
        assert line == ("max_replication_slots is 4 and 0 are in use; "
                        + " and ".join(f"reader group g{i:02d}" for i in range(5, 13)) + " need 8 more: set "
                        "max_replication_slots = 16 in postgresql.conf and restart Postgres")
        # (twelve streams that name no group share the default group's one slot)
        assert not [p for p in limits.postgres_problems(c, _configs(tmp_path, url, ids, group=dict.fromkeys(ids)))
                    if "max_replication_slots" in p]
        streams = _configs(tmp_path, url, ids)
        assert not [p for p in limits.postgres_problems(c, streams) if "max_replication_slots" in p]
        # half of the rows exist already (a subscription creates its stream's row, with a slot name of its
        # own that nothing creates: there would be room for 4 only)
        for i in ids[:6]:
            ensure_stream(c, i)
        insert_events(url, 2, 3)
        assert _pgstream_slots(url) == []
        first = ingest.consume_group(c, GROUP, streams, 0)
        assert first.slot_created and first.publication == "created"
        assert _pgstream_slots(url) == [first.slot]  # one slot for twelve streams (4 allowed)
        # every member registered: the group reads for it, no slot of its own
        assert {ledger_state.slot_reader(c, i) for i in ids} == {groups.group_reader(GROUP)}
        # writes to all twelve, interleaved, and one transaction touching streams 3 and 7
        for round_ in range(3):
            for i in ids:
                insert_events(url, i, 2 + i % 3, start=round_ * 10)
        with psycopg.connect(url) as w:
            for n in range(4):
                w.execute("insert into pgstream.events (payload, stream_id) values (%s, 3), (%s, 7)",
                          [f'{{"both": {n}}}', f'{{"both": {n}}}'])
        both = [(r[0], r[1]) for r in c.execute("select id, stream_id from pgstream.events where payload ? 'both'")]
        one_pass = ingest.consume_group(c, GROUP, streams, 0)
        assert sum(one_pass.events.values()) == sum(len(_events(url, i)) for i in ids) - 3  # (recovered: below)
        assert {i: len(b) for i, b in first.recovered.items()} == {i: int(i == 2) for i in ids}  # from the table
        for i in ids:
            # each event once, in commit order (ids follow commit order here: one writer at a time)
            assert _recorded(url, i) == _events(url, i), i
        # the shared transaction is recorded in both ledgers, by the same commit
        with psycopg.connect(url) as r:
            ends = {sid: r.execute("select end_lsn from pgstream.batches where stream_id = %s and %s = any(event_ids)",
                                   [sid, eid]).fetchone() for eid, sid in both}
        assert {sid for _e, sid in both} == {3, 7} and ends[3] == ends[7]
        # nothing more, nothing twice
        assert sum(ingest.consume_group(c, GROUP, streams, 0.3).events.values()) == 0
        assert all(_recorded(url, i) == _events(url, i) for i in ids)
        # the group recorded through the end of the last transaction, and the slot moved past it
        (through,) = c.execute("select recorded_through from pgstream.reader_groups where name = %s",
                               [GROUP]).fetchone()  # type: ignore[misc]
        assert through is not None
        status = c.execute("select slot_name, slot_exists from pgstream.stream_status where id = 5").fetchone()
        assert status == (first.slot, True)
        shown = render_status(stream_status(c, 5))
        assert f"slot {first.slot} (reserved" in shown and "read by reader group shared (its sensor " \
            "pgstream_group_shared records the stream's batches)" in shown
        assert _pgstream_slots(url) == [first.slot]


def test_a_stream_with_its_own_slot_joins_without_losing_or_repeating_an_event(db_url: str, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The upgrade path of every existing install: stream 1 read its own slot (the version before: with events
    recorded and events waiting in it) and is now in a reader group (``shared`` here; an entry naming none joins
    group ``default`` the same way); its own slot is drained to the join position, then dropped, and every event
    is recorded once, in commit order."""
    # stream 1 reads its own slot (as a version with a slot per stream left it), with events recorded and events
    # waiting; stream 2 is in the group
    streams = _configs(tmp_path, db_url, [1, 2])
    own, member = streams
    with psycopg.connect(db_url, autocommit=True) as c:
        own_slot = _own_slot(c, 1)
        insert_events(db_url, 1, 30)
        assert _read_as_before(c, own) == 30
        insert_events(db_url, 1, 20, start=100)  # not recorded yet: waiting in its own slot
        ingest.consume_group(c, GROUP, [member], 0)
        # stream 1 is configured in the group (the upgrade): its own slot is drained at the hand-over
        streams = _configs(tmp_path, db_url, [1, 2])
        insert_events(db_url, 1, 5, start=200)
        insert_events(db_url, 1, 7, start=300)  # waiting in its own slot at the join
        # a transaction that began before the join and commits during it
        writer = psycopg.connect(db_url)
        writer.execute("insert into pgstream.events (payload, stream_id) values ('{\"late\": 1}', 1)")

        def commit_later() -> None:
            time.sleep(2.5)
            writer.commit()
            insert_events(db_url, 1, 3, start=400)

        # and, in the tick that hands it over, right after its drain: only in the group's slot, read that tick
        drop = group_reader._drop_own_slot
        written: list[bool] = []

        def drop_then_write(conn: psycopg.Connection, slot: str) -> None:
            drop(conn, slot)
            if slot == own_slot and not written:
                written.append(True)
                insert_events(db_url, 1, 2, start=450)

        monkeypatch.setattr(group_reader, "_drop_own_slot", drop_then_write)
        later = threading.Thread(target=commit_later)
        later.start()
        insert_events(db_url, 2, 3, start=50)
        # the join waits for the transaction that began before the publication included stream 1 (at most
        # a tick's budget); meanwhile the group goes on recording stream 2
        result = ingest.consume_group(c, GROUP, streams, 0.5)
        assert result.publication == "altered" and result.joining == [1] and result.events.get(2) == 3
        # not handed over yet: its own slot is its reader's
        assert ledger_state.slot_reader(c, 1) == ledger_state.SENSOR
        later.join()
        writer.close()
        _drain(c, streams, lambda: len(_recorded(db_url, 1)) == len(_events(db_url, 1)))
        insert_events(db_url, 1, 4, start=500)  # after the join: through the group's slot
        insert_events(db_url, 2, 4)
        _drain(c, streams, lambda: len(_recorded(db_url, 1)) == len(_events(db_url, 1)) and
               len(_recorded(db_url, 2)) == len(_events(db_url, 2)))
        ingest.consume_group(c, GROUP, streams, 0.3)
        assert written
        assert sorted(_recorded(db_url, 1)) == _events(db_url, 1)  # each once
        assert len(_recorded(db_url, 1)) == len(set(_recorded(db_url, 1))) == 30 + 20 + 5 + 7 + 1 + 3 + 2 + 4
        assert _recorded(db_url, 2) == _events(db_url, 2)
        assert ledger_state.slot_reader(c, 1) == groups.group_reader(GROUP)
        # its own slot is gone, the group's is the one slot
        assert own_slot not in _pgstream_slots(db_url) and len(_pgstream_slots(db_url)) == 1
        # a new stream with reader: registered, written to before the group's sensor has put it in the
        # publication: those events are not in the group's slot, and are recorded once
        groups.register_group_member(c, 3, GROUP)
        insert_events(db_url, 3, 6)
        streams = _configs(tmp_path, db_url, [1, 2, 3])
        _drain(c, streams, lambda: len(_recorded(db_url, 3)) == 6)
        insert_events(db_url, 3, 4, start=100)
        _drain(c, streams, lambda: len(_recorded(db_url, 3)) == 10)
        ingest.consume_group(c, GROUP, streams, 0.3)
        assert sorted(_recorded(db_url, 3)) == _events(db_url, 3) and len(_pgstream_slots(db_url)) == 1
        # leaving the group (a slot of its own again, as the version before registered it) is refused, naming the
        # stream, and changes nothing
        with pytest.raises(groups.GroupChange, match="stream 1 reads with reader group shared: leaving a group"):
            ensure_stream(c, 1)
        with pytest.raises(groups.GroupChange, match="stream 1 reads with reader group shared, not other"):
            groups.register_group_member(c, 1, "other")
        assert ledger_state.slot_reader(c, 1) == groups.group_reader(GROUP) and len(_pgstream_slots(db_url)) == 1


def test_an_install_whose_streams_read_their_own_slots_delivers_every_event_once_through_the_default_group(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """Every existing install, end to end: streams 1 and 2 read slots of their own (the version before), with
    events recorded and not delivered yet and events waiting in their slots; the code location of this version
    (their entries name no group) puts them in group ``default``: its sensor and delivery run deliver every
    event once, in commit order, written before, during and after the join; their own slots are dropped."""
    ids = (1, 2)
    config = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": i, "batch": {"max_size": 50, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.2},
         "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in ids])  # mode open (harness)
    before = list(load_config(config).streams)
    with psycopg.connect(db_url, autocommit=True) as c:
        own_slots = [_own_slot(c, i) for i in ids]  # as the version before left them
        for i in ids:
            insert_events(db_url, i, 20)
        for own in before:
            assert _read_as_before(c, own) == 20  # recorded, not delivered
        for i in ids:
            insert_events(db_url, i, 10, start=100)  # waiting in its own slot
    driver = Driver(config, instance)
    assert driver.group_of(1) == driver.group_of(2) == DEFAULT_READER
    deadline = time.monotonic() + 90
    for wave in range(3):  # written while they join, and after
        for i in ids:
            insert_events(db_url, i, 5, start=200 + 10 * wave)
        _tick(driver, DEFAULT_READER)
    while not all(len(_delivered(tmp_path, i)) >= len(_events(db_url, i)) for i in ids):
        assert time.monotonic() < deadline, {i: len(_delivered(tmp_path, i)) for i in ids}
        _tick(driver, DEFAULT_READER)
    for i in ids:
        assert _delivered(tmp_path, i) == _events(db_url, i), i  # every event once, in commit order
        assert len(_events(db_url, i)) == 20 + 10 + 15
    with psycopg.connect(db_url) as c:
        assert c.execute("select id, slot_reader from pgstream.streams order by id").fetchall() == [
            (i, groups.group_reader(DEFAULT_READER)) for i in ids]
    assert _pgstream_slots(db_url) == [_group_slot(db_url)] and not set(own_slots) & set(_pgstream_slots(db_url))
    _end_group_runs(driver)


class _SensorBench:
    """``sensors.group_delivery`` of group ``relay`` on a real instance whose run queue allows ``limit`` runs per
    pgstream/group, its group delivery runs made by hand (as the daemon makes them from the sensor's requests)."""

    def __init__(self, instance: dg.DagsterInstance, conn: psycopg.Connection, streams: list[StreamConfig]) -> None:
        from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin

        from pgstream_dagster.defs.names import CONFIG_TAG, group_tag
        from pgstream_dagster.engine.dbconn import database_key

        self.instance, self.conn, self.streams = instance, conn, streams
        self.tags = {GROUP_TAG: group_tag("relay", database_key(conn)), CONFIG_TAG: streams_fingerprint(streams)}
        # (what the daemon's requests carry: Dagster keeps a queued run only with it)
        self.origin = RemoteJobOrigin(RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("pgstream"),
                                                             "__repository__"), GROUP_DELIVERY_JOB)

    @classmethod
    @contextlib.contextmanager
    def of(cls, db_url: str, dagster_storage_url: str, tmp_path: Path, limit: int,
           members: list[dict[str, Any]]) -> Iterator[_SensorBench]:
        from .conftest import storage_overrides

        streams = list(load_config(write_config(tmp_path / "pgstream.yaml", db_url, members)).streams)
        queue = {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator",
                 "config": {"tag_concurrency_limits": [{"key": GROUP_TAG, "limit": limit,
                                                        "value": {"applyLimitPerUniqueValue": True}}]}}
        (tmp_path / "dagster_home").mkdir()
        with dg.instance_for_test(overrides={**storage_overrides(dagster_storage_url), "run_coordinator": queue},
                                  temp_dir=str(tmp_path / "dagster_home")) as instance, \
                psycopg.connect(db_url, autocommit=True) as c:
            ingest.consume_group(c, "relay", streams, 0)
            yield cls(instance, c, streams)

    def run(self, *moves: Any, tags: Mapping[str, str] | None = None) -> dg.DagsterRun:
        """A group delivery run of the instance (with ``tags``, else the members'), through ``moves`` (Dagster's
        events: its status)."""
        created = self.instance.add_run(dg.DagsterRun(
            job_name=GROUP_DELIVERY_JOB, run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.NOT_STARTED,
            tags=dict(tags or self.tags), remote_job_origin=self.origin))
        for move in moves:
            self.move(created, move)
        return created

    def move(self, run: dg.DagsterRun, event: Any) -> None:
        self.instance.run_storage.handle_run_event(run.run_id, dg.DagsterEvent(event.value,
                                                                              job_name=GROUP_DELIVERY_JOB))

    def decide(self, streams: list[StreamConfig] | None = None) -> tuple[dg.RunRequest | None, str, list[str]]:
        from pgstream_dagster.defs import sensors

        log: list[str] = []
        request, said = sensors.group_delivery(self.conn, self.instance, "relay", streams or self.streams, log, {})
        return request, said, log

    def status(self, run: dg.DagsterRun) -> tuple[dg.DagsterRunStatus, str | None]:
        from pgstream_dagster.defs.names import STOP_TAG

        now = self.instance.get_run_by_id(run.run_id)
        assert now is not None
        return now.status, now.tags.get(STOP_TAG)

    def waiting(self, db_url: str, run: dg.DagsterRun, ended: threading.Event) -> threading.Thread:
        """``run`` waits for the group's lease (until ``ended``, or its session is ended), in a thread."""
        def wait() -> None:
            with contextlib.suppress(psycopg.Error):  # (its session may be ended)
                locks.acquire_group_lease(db_url, "relay", run.run_id, waits=lambda: not ended.is_set())
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while locks.group_lease_state(self.conn, "relay", run.run_id) is not locks.LeaseState.WAITING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return waiter


def test_the_sensor_hands_a_group_run_over_to_its_successor_and_fails_one_that_died_waiting(
        db_url: str, dagster_storage_url: str, tmp_path: Path) -> None:
    """The group's sensor's decisions around a group run's ``max_run_secs`` (``sensors.group_delivery`` on a real
    instance, whose run queue allows 1 run per pgstream/group, and the ledger's locks): the run holding the
    group's lease is left alone until ``max_run_secs`` less the hand-over's lead (``run_grace_secs``, half of
    ``max_run_secs`` at most: 2 s of 4), then its successor is requested; queued, the successor is said to wait
    for the instance's limit, naming the setting; once it waits for the lease, the run is asked to end (tag
    pgstream/stop); killed as it waits (its session ended), it is marked failed at once and the run goes on."""
    from dagster._core.events import DagsterEventType

    member = {"id": 1, "reader": "relay", "delivery": {"mode": "open", "tuning": {"max_run_secs": 4}},
              "sink": {"type": "file", "path": str(tmp_path / "out1.jsonl")}}
    with _SensorBench.of(db_url, dagster_storage_url, tmp_path, 1, [member]) as bench:
        c, tags, run, move_run, decide, status = (bench.conn, bench.tags, bench.run, bench.move, bench.decide,
                                                  bench.status)
        holder = run(DagsterEventType.RUN_START)
        lease = locks.acquire_group_lease(db_url, "relay", holder.run_id)
        taken = time.monotonic()
        request, said, _ = decide()
        assert request is None and said == f"group delivery run {holder.run_id} (it holds the group's delivery lease)"
        time.sleep(max(0.0, taken + 2.2 - time.monotonic()))
        request, said, _ = decide()
        assert request is not None and request.tags == tags, said
        assert said.startswith(f"{holder.run_id}: open 2 s of 4 (delivery.tuning.max_run_secs): its successor "
                               f"requested, it ends once that one waits"), said

        successor = run(DagsterEventType.RUN_ENQUEUED)
        request, said, _ = decide()
        assert request is None and said.startswith(f"group delivery run {successor.run_id} (queued) takes over from "
                                                   f"{holder.run_id}: the run queue allows 1 run at once per reader "
                                                   f"group (run tag {GROUP_TAG}): a group delivery run's successor "
                                                   f"cannot start beside it"), said
        assert said.endswith(f"set limit: 2 for key {GROUP_TAG} under run_coordinator.config.tag_concurrency_limits "
                             f"in dagster.yaml")
        assert status(holder) == (dg.DagsterRunStatus.STARTED, None)  # (queued: the run goes on)

        move_run(successor, DagsterEventType.RUN_START)  # it starts, and waits for the group's lease
        ended = threading.Event()
        waiter = bench.waiting(db_url, successor, ended)
        request, said, _ = decide()
        assert request is None and said == (f"group delivery run {successor.run_id} (it waits for the group's "
                                            f"delivery lease) takes over from {holder.run_id}"), said
        assert status(holder) == (dg.DagsterRunStatus.STARTED, f"its successor {successor.run_id} is up (a fresh "
                                  f"group delivery run every delivery.tuning.max_run_secs)")

        # killed as it waits: its wait's session ended; the holder (asked to end already) is left to end
        c.execute("select pg_terminate_backend(pid) from pgstream.locks where holder = %s", [successor.run_id])
        waiter.join(10)
        request, said, log = decide()
        assert status(successor)[0] == dg.DagsterRunStatus.FAILURE
        assert log == [f"reader group relay: group delivery run {successor.run_id} died (the database session "
                       f"holding the group's delivery lease has ended (its process died)); marked failed"], log
        assert request is None and said == f"group delivery run {holder.run_id} (it holds the group's delivery lease)"
        ended.set()
        locks.give_up_group_lease(lease, "relay")


def test_a_group_run_and_its_successor_requested_within_a_second_get_run_keys_of_their_own(db_url: str) -> None:
    """Dagster skips a run request whose run key it has seen: a group run's successor requested within a second of
    the run (a configuration change right after the location started) must not carry the run's key."""
    from pgstream_dagster.defs import sensors

    with psycopg.connect(db_url) as c:
        first = sensors._requested(c, "relay", "fingerprint")
        time.sleep(0.002)
        second = sensors._requested(c, "relay", "fingerprint")
    assert first.run_key != second.run_key and all(
        str(r.run_key).startswith("pgstream-group-relay-") for r in (first, second)), (first.run_key, second.run_key)


def test_a_group_run_that_gave_its_lease_up_is_alive_while_a_member_run_of_it_closes(
        db_url: str, dagster_storage_url: str, tmp_path: Path) -> None:
    """A group run gives the group's lease to its successor at once, while a member's run of it still closes (a
    sink call under way, its stream's delivery lease held): with that successor gone meanwhile, the group's sensor
    takes the run for ending, not dead, however long after its start; once no member run of it holds a lease, it
    is a started run without a lease past ``run_grace_secs``: marked failed, and a fresh group run requested."""
    from dagster._core.events import DagsterEventType

    from pgstream_dagster.engine.delivery.group import member_run_id

    member = {"id": 1, "reader": "relay", "delivery": {"mode": "open", "run_grace_secs": 1},
              "sink": {"type": "file", "path": str(tmp_path / "out1.jsonl")}}
    with _SensorBench.of(db_url, dagster_storage_url, tmp_path, 2, [member]) as bench:
        ending = bench.run(DagsterEventType.RUN_START)
        closing = locks.acquire_lease(db_url, 1, member_run_id(ending.run_id, 1))
        time.sleep(1.1)
        request, said, log = bench.decide()
        assert request is None and not log and said == (f"group delivery run {ending.run_id} (it gave the group's "
                                                         f"delivery lease up: its members' runs close)"), said
        assert bench.status(ending)[0] == dg.DagsterRunStatus.STARTED
        locks.give_up_lease(closing, 1)
        request, said, log = bench.decide()
        assert bench.status(ending)[0] == dg.DagsterRunStatus.FAILURE
        assert log == [f"reader group relay: group delivery run {ending.run_id} died (no group delivery lease 1 s "
                       f"after it started (delivery.run_grace_secs)); marked failed"], log
        assert request is not None, said


@pytest.mark.parametrize("limit", [2, 1])
def test_a_changed_configuration_hands_the_group_run_over_unless_its_successor_cannot_take_it(
        db_url: str, dagster_storage_url: str, tmp_path: Path, limit: int) -> None:
    """The members' configuration changes (a stream's sink) while a group run holds the lease: its successor, of
    the new configuration, is requested at once and the run delivers on; once the successor waits for the lease,
    the run is asked to end (tag pgstream/stop, saying why). Should the successor not take over, the run is asked
    to end all the same (the next run follows once it has ended, as before hand-overs): the run queue allows one
    group run (``limit`` 1: it is asked at once); a successor of the new configuration failed (one of the old
    configuration that failed before the change does not count); or one not up ``run_grace_secs`` after it was
    requested."""
    from dagster._core.events import DagsterEventType

    from pgstream_dagster.defs.names import CONFIG_TAG

    def member(sink: str) -> dict[str, Any]:
        return {"id": 1, "reader": "relay", "delivery": {"mode": "open", "run_grace_secs": 2},
                "sink": {"type": "file", "path": str(tmp_path / sink)}}

    with _SensorBench.of(db_url, dagster_storage_url, tmp_path, limit, [member("out.jsonl")]) as bench:
        changed = list(load_config(write_config(tmp_path / "changed.yaml", db_url, [member("new.jsonl")])).streams)
        new = {**bench.tags, CONFIG_TAG: streams_fingerprint(changed)}
        for ending in ("waits", "failed", "late"):
            holder = bench.run(DagsterEventType.RUN_START)
            lease = locks.acquire_group_lease(db_url, "relay", holder.run_id)
            if ending == "waits":  # a successor of the old configuration (at max_run_secs) failed before the change
                bench.run(DagsterEventType.RUN_START, DagsterEventType.RUN_FAILURE)
            request, said, log = bench.decide(changed)
            why = (f"the configuration of its streams changed ({CONFIG_TAG} {bench.tags[CONFIG_TAG]}, the code "
                   f"location's {new[CONFIG_TAG]})")
            if limit == 1:  # no successor can start beside it: it is asked to end, the next one follows
                assert request is None and bench.status(holder) == (dg.DagsterRunStatus.STARTED, why), said
                locks.give_up_group_lease(lease, "relay")
                break
            assert request is not None and request.tags == new, said
            assert said == f"{holder.run_id}: {why}: its successor requested, it ends once that one waits", said
            assert log == [f"reader group relay: group delivery run {holder.run_id}: {said.split(': ', 1)[1]}"]
            assert bench.status(holder) == (dg.DagsterRunStatus.STARTED, None)  # it delivers on meanwhile
            # (late: queued, it is not up; a started one that took no lease in run_grace_secs is dead, marked failed)
            successor = bench.run(DagsterEventType.RUN_ENQUEUED if ending == "late" else DagsterEventType.RUN_START,
                                  tags=new)
            ended = threading.Event()
            if ending == "waits":
                bench.waiting(db_url, successor, ended)
                _request, said, _log = bench.decide(changed)
                assert said == (f"group delivery run {successor.run_id} (it waits for the group's delivery lease) "
                                f"takes over from {holder.run_id}"), said
                stop = f"its successor {successor.run_id} is up (the configuration of its streams changed)"
            elif ending == "failed":
                bench.move(successor, DagsterEventType.RUN_FAILURE)
                _request, said, _log = bench.decide(changed)
                stop = why
            else:  # not waiting for the lease run_grace_secs (2 s) after it was requested
                _request, said, _log = bench.decide(changed)
                assert bench.status(holder) == (dg.DagsterRunStatus.STARTED, None), said
                time.sleep(2.1)
                _request, said, log = bench.decide(changed)
                stop = (f"the configuration of its streams changed; its successor {successor.run_id} is not up 2 s "
                        f"after it was requested (delivery.run_grace_secs)")
                assert log == [f"reader group relay: group delivery run {holder.run_id} asked to end: {stop}"], log
            assert bench.status(holder) == (dg.DagsterRunStatus.STARTED, stop), said
            ended.set()
            locks.give_up_group_lease(lease, "relay")
            for run in (holder, successor):  # (ended, before the next case)
                if bench.status(run)[0] == dg.DagsterRunStatus.STARTED:
                    bench.move(run, DagsterEventType.RUN_SUCCESS)


def test_two_databases_served_by_one_dagster_instance_each_run_their_group_default(
        db_url: str, empty_db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """A platform's Dagster instance serves the code locations of two databases, each with a stream 1 in group
    ``default``: each group's sensor requests and sees its own delivery run (tag pgstream/group names the group
    and its database: one live run per group *of a database*), both live at once, and each database's events are
    delivered once, in commit order, to its own sink; neither sensor marks the other database's run failed."""
    migrate(empty_db_url)
    urls = {"a": db_url, "b": empty_db_url}
    configs = {name: write_config(tmp_path / f"{name}.yaml", url, [
        {"id": 1, "batch": {"max_size": 50, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.2},
         "delivery": {"mode": "open", "run_grace_secs": 5, "tuning": {"max_run_secs": 300}},
         "sink": {"type": "file", "path": str(tmp_path / f"{name}.jsonl")}}]) for name, url in urls.items()}
    for config in configs.values():
        init(config)
    drivers = {name: Driver(config, instance) for name, config in configs.items()}

    def delivered(name: str) -> list[int]:
        path = tmp_path / f"{name}.jsonl"
        return [e["id"] for e in read_jsonl(path)] if path.exists() else []

    deadline = time.monotonic() + 120
    for wave in range(3):
        for n, url in enumerate(urls.values()):
            insert_events(url, 1, 10 + n, start=100 * wave)
        for driver in drivers.values():
            _tick(driver, DEFAULT_READER)
    while not all(len(delivered(name)) >= len(_events(url, 1)) for name, url in urls.items()):
        assert time.monotonic() < deadline, {name: len(delivered(name)) for name in urls}
        for driver in drivers.values():
            _tick(driver, DEFAULT_READER)
        time.sleep(0.1)
    time.sleep(6)  # past run_grace_secs: a sensor that took the other database's run for its own would fail it
    for driver in drivers.values():
        _tick(driver, DEFAULT_READER)
    for name, url in urls.items():
        assert delivered(name) == _events(url, 1) and len(delivered(name)) == 3 * (10 + list(urls).index(name))
    live = instance.get_runs(dg.RunsFilter(job_name=GROUP_DELIVERY_JOB, statuses=[dg.DagsterRunStatus.STARTED]))
    tags = sorted(r.tags[GROUP_TAG] for r in live if r.run_id in {b.run_id for d in drivers.values()
                                                                   for b in d.group_runs[DEFAULT_READER]})
    assert tags == sorted(group_tag_of(url, DEFAULT_READER) for url in urls.values()) and tags[0] != tags[1], tags
    assert all(len(d.group_runs[DEFAULT_READER]) == 1 for d in drivers.values())  # no run failed and replaced
    for driver in drivers.values():
        _end_group_runs(driver)


def test_a_dropped_group_slot_is_replaced_and_every_member_recovers(db_url: str, tmp_path: Path) -> None:
    streams = _configs(tmp_path, db_url, [1, 2, 3])
    with psycopg.connect(db_url, autocommit=True) as c:
        slot = ingest.consume_group(c, GROUP, streams, 0).slot
        for i in (1, 2, 3):
            insert_events(db_url, i, 10)
        _drain(c, streams, lambda: all(len(_recorded(db_url, i)) == 10 for i in (1, 2, 3)))
        # events waiting in the slot, then the slot dropped by hand: they are only in the table now
        for i in (1, 2):
            insert_events(db_url, i, 6, start=100)
        c.execute("select pg_drop_replication_slot(%s)", [slot])
        insert_events(db_url, 3, 4, start=100)  # committed while there is no slot
        result = ingest.consume_group(c, GROUP, streams, 0)
        assert result.slot_created and set(result.recovered) == {1, 2, 3}
        assert c.execute("select recovery_pending from pgstream.reader_groups").fetchone() == (False,)
        for i in (1, 2, 3):  # while the next writes go through the new slot
            insert_events(db_url, i, 5, start=200)
        _drain(c, streams, lambda: all(len(set(_recorded(db_url, i))) == len(_events(db_url, i)) for i in (1, 2, 3)))
        ingest.consume_group(c, GROUP, streams, 0.3)
        # ensure_slot's contract for one stream: every event recorded, none twice (recovered ids are
        # dropped from what the new slot decodes: unrecorded)
        for i in (1, 2, 3):
            assert sorted(_recorded(db_url, i)) == _events(db_url, i), i
        assert _pgstream_slots(db_url) == [slot]
        # the group's slot is pgstream's (not an orphan while the group exists), and tear-down removes it
        assert c.execute("select count(*) from pgstream.orphaned_slots").fetchone() == (0,)
    removed = migrations.tear_down(db_url)
    assert f"replication slot {slot}" in removed and f"publication pgstream_group_{GROUP}" in removed
    assert _pgstream_slots(db_url) == []


def test_a_synchronized_slot_is_taken_only_within_what_the_ledger_recorded(db_url: str, tmp_path: Path) -> None:
    """A promoted standby's copy of the group's slot (a failover slot) is taken when the ledger the standby holds
    was recorded through its position, and on the timeline it was taken on it stays taken; a copy past what the
    ledger recorded stays ``lost`` (replaced and recovered). Through a real promotion:
    tests/test_standby_failover.py; here the copy's state is given, against a real group's row."""
    streams = _configs(tmp_path, db_url, [1])
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, GROUP, streams, 0)
        insert_events(db_url, 1, 3)
        _drain(c, streams, lambda: len(_recorded(db_url, 1)) == 3)
        state = groups.group_state(c, GROUP)
        assert state is not None and state.recorded_through is not None
        timeline = replication.current_timeline(c)
        assert state.slot_lsn is not None and state.slot_timeline == timeline  # set when the group made its slot

        def copy(confirmed: int) -> dict[str, object]:
            return {"synced": True, "confirmed_flush_lsn": replication.int_to_lsn(confirmed), "wal_status": "lost",
                    "slot_wal_status": "reserved"}
        c.execute("update pgstream.reader_groups set slot_timeline = %s where name = %s", [timeline - 1, GROUP])
        past = copy(state.recorded_through + 1)
        result = group_reader.GroupResult()
        group_reader._take_synchronized(c, GROUP, groups.group_state(c, GROUP), past, result)  # type: ignore[arg-type]
        assert past["wal_status"] == "lost" and not result.notes
        assert groups.group_state(c, GROUP).slot_timeline == timeline - 1  # type: ignore[union-attr]
        within = copy(state.recorded_through)
        group_reader._take_synchronized(c, GROUP, groups.group_state(c, GROUP), within, result)  # type: ignore[arg-type]
        assert within["wal_status"] == "reserved" and "took the failover slot" in result.notes[0]
        assert groups.group_state(c, GROUP).slot_timeline == timeline  # type: ignore[union-attr]
        later = copy(state.recorded_through + 1_000_000)  # taken on this timeline: the reader's own now
        group_reader._take_synchronized(c, GROUP, groups.group_state(c, GROUP), later, result)  # type: ignore[arg-type]
        assert later["wal_status"] == "reserved" and len(result.notes) == 1


def test_group_functions_belong_to_the_owner_and_membership_cannot_be_written(db_url: str, tmp_path: Path) -> None:
    streams = _configs(tmp_path, db_url, [1])
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, GROUP, streams, 0)
        ensure_stream(c, 2)  # a stream not in a group yet (its row only)
        # the application's role (and so every tenant's) may call none of them; no grant to public either
        for fn in ("register_group_member(bigint, text)", "ensure_group_publication(text)", "begin_join(bigint, text)",
                   "finish_join(bigint, text)", "group_slot_name(text)"):
            for role in ("pgstream_writer", "pgstream_executor"):  # (the executor: every Spark host's credential)
                assert c.execute("select has_function_privilege(%s, %s, 'execute')",
                                 [role, f"pgstream.{fn}"]).fetchone() == (False,), (role, fn)
            assert c.execute("select coalesce(bool_or(a.grantee = 0), false) from pg_proc p, aclexplode(p.proacl) a "
                             "where p.oid = %s::regprocedure", [f"pgstream.{fn}"]).fetchone() == (False,), fn
        c.execute("create role hostile_tenant login")
        c.execute("grant pgstream_runtime to hostile_tenant")
        c.execute("grant pgstream_writer to hostile_tenant")
        try:
            with psycopg.connect(db_url, autocommit=True) as h:
                h.execute("set role hostile_tenant")
                # a tenant's role cannot put its stream into another group by writing tables ...
                for statement in ("update pgstream.streams set reader_group = 'shared' where id = 2",
                                  "update pgstream.reader_groups set members = '{1,2}'",
                                  "insert into pgstream.reader_groups (name, slot) values ('mine', 'x')"):
                    with pytest.raises(psycopg.errors.InsufficientPrivilege):
                        h.execute(statement)
                # ... nor by declaring the group its reader (only begin_join may; the constraint: only a member's)
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match=r"only pgstream\.begin_join hands"):
                    h.execute("update pgstream.streams set slot_reader = 'group:shared' where id = 2")
                # nor by altering the group's publication (its rows, or its columns: the payloads its run hands over)
                for statement in ("alter publication pgstream_group_shared set table pgstream.events where (true)",
                                  "alter publication pgstream_group_shared set table pgstream.events "
                                  "(id, stream_id, created_at) where (true)"):
                    with pytest.raises(psycopg.errors.InsufficientPrivilege):
                        h.execute(statement)
        finally:
            c.execute("drop owned by hostile_tenant")
            c.execute("drop role hostile_tenant")
        assert c.execute("select reader_group from pgstream.streams where id = 2").fetchone() == (None,)
        assert c.execute("select members from pgstream.reader_groups").fetchone() == ([1],)
        assert c.execute("select attnames from pg_publication_tables where pubname = 'pgstream_group_shared'"
                         ).fetchone() == (["id", "payload", "metadata", "stream_id", "created_at"],)


# --- end to end through Dagster ---------------------------------------------------------------------

def _tick(driver: Driver, group: str) -> str | None:
    """One tick of the group's sensor (the group delivery run it requests is launched in the background by the
    driver: ``driver.group_runs[group]``); its skip reason. Its members are hosted: no run of their own."""
    tick = driver.tick_group(group)
    assert not tick.run_requests, tick.run_requests
    return tick.skip_message


def _runs(driver: Driver, group: str) -> list[Background]:
    """The group delivery runs the driver launched for ``group``, in launch order."""
    return driver.group_runs.get(group, [])


def _end_group_runs(driver: Driver) -> None:
    """The test's group runs end (the live one asked to, as the sensor asks one of another configuration), each
    having succeeded."""
    driver.stop_group_runs(timeout=30)
    for runs in driver.group_runs.values():
        for run in runs:
            assert run.wait(0).success


def test_twelve_grouped_streams_deliver_every_event_once_through_the_sensors_and_a_group_run(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """Twelve streams (more than Postgres' default 10 slots) in one group: the group's sensor records for all of them
    from one slot and requests the group's delivery run, which hosts each stream's open run (the group run itself ends
    after max_run_secs and the sensor requests the next one); the streams' sensors decide their runs and request no
    Dagster run; every event reaches its stream's sink exactly once, in commit order."""
    ids = list(range(1, 13))
    config = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": i, "reader": "all", "batch": {"max_size": 40, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.05},
         "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}}  # mode open, a short max_run_secs (harness)
        for i in ids])
    driver = Driver(config, instance)
    # one sensor for the twelve: none of a member's own
    assert sorted(str(s.name) for s in driver.defs.sensors or [] if str(s.name).startswith("pgstream_")) == [
        "pgstream_group_all", "pgstream_subscriptions"]

    def delivered(i: int) -> list[int]:
        path = tmp_path / f"out{i}.jsonl"
        return [e["id"] for e in read_jsonl(path)] if path.exists() else []

    started = time.monotonic()
    _tick(driver, "all")
    assert len(_runs(driver, "all")) == 1  # its streams keep runs open (mode open): the group run is up first
    waves, per_wave = 3, 15
    wave = 0
    while True:
        if wave < waves:
            for i in ids:
                insert_events(db_url, i, per_wave, start=wave * 100)
            wave += 1
        _tick(driver, "all")
        if wave == waves and all(len(delivered(i)) >= waves * per_wave for i in ids):
            break
        assert time.monotonic() - started < 80, {i: len(delivered(i)) for i in ids}
    for i in ids:
        assert delivered(i) == _events(db_url, i), i  # every event, once, in commit order
    assert _pgstream_slots(db_url) == [_group_slot(db_url)]  # one slot for twelve streams
    assert _runs(driver, "all")
    assert {r.job_name for r in instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(db_url, "all")}))} == {
        GROUP_DELIVERY_JOB}
    # the group's cursor shows each stream's last recorded event
    shown = json.loads(driver.cursors["all"] or "{}")["members"]
    assert {int(k): v["last_event_id"] for k, v in shown.items()} == {i: _events(db_url, i)[-1] for i in ids}
    _end_group_runs(driver)


def _group_slot(url: str) -> str:
    with psycopg.connect(url) as c:
        (slot,) = c.execute("select slot from pgstream.reader_groups").fetchone()  # type: ignore[misc]
    return str(slot)


def test_a_members_open_run_reads_no_slot_and_a_failing_member_does_not_hold_the_group_back(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """Stream 1 (mode open, a file sink) and stream 2 (a sink that refuses every call) in one group, hosted by
    the group's delivery run (one run throughout, until the shortest max_run_secs of the two): stream 1's open
    run starts no slot reader and takes the batches the group's sensor hands it; stream 2's member run fails in
    its thread (the group run goes on), its sensor puts it in failover, and the group's sensor goes on
    recording both."""
    config = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "reader": "pair", "batch": {"max_size": 50, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.1},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 60}},
         "sink": {"type": "file", "path": str(tmp_path / "out1.jsonl")}},
        {"id": 2, "reader": "pair", "batch": {"max_size": 50, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.1},
         "retry": {"initial_backoff_secs": 60, "max_backoff_secs": 60},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 25}},
         "sink": {"type": "http", "url": "http://127.0.0.1:9/refused", "timeout_secs": 1}}])
    driver = Driver(config, instance)

    def delivered() -> list[int]:
        path = tmp_path / "out1.jsonl"
        return [e["id"] for e in read_jsonl(path)] if path.exists() else []

    def state(i: int) -> str:
        with psycopg.connect(db_url) as c:
            row = c.execute("select state from pgstream.stream_status where id = %s", [i]).fetchone()
        return str(row[0]) if row else ""

    _tick(driver, "pair")
    insert_events(db_url, 1, 10)
    insert_events(db_url, 2, 10)
    deadline = time.monotonic() + 60
    while len(delivered()) < 10 or state(2) != "failover":
        assert time.monotonic() < deadline, (len(delivered()), state(2))
        _tick(driver, "pair")
    (run,) = _runs(driver, "pair")
    (dagster_run,) = instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(db_url, "pair")}))
    member = json.loads(dagster_run.tags["pgstream/member_2"])
    assert member["state"] == "failed" and "127.0.0.1:9" in member["error"], member  # its thread only
    for wave in range(3):  # handed to the open run by the group's sensor: no new run
        insert_events(db_url, 1, 5, start=100 * (wave + 1))
        insert_events(db_url, 2, 5, start=100 * (wave + 1))
        while len(delivered()) < 10 + 5 * (wave + 1):
            assert time.monotonic() < deadline
            _tick(driver, "pair")
        with psycopg.connect(db_url) as c:
            # the open run is not a slot's reader: the group's is, and no WAL sender reads for it (one at most
            # serves the group's slot: the group run's reader)
            assert c.execute("select open_run_key is not null, slot_reader from pgstream.streams where id = 1"
                             ).fetchone() == (True, "group:pair")
            senders, of_group = c.execute(
                "select count(*), count(*) filter (where s.slot_name = (select slot from pgstream.reader_groups)) "
                "from pg_stat_replication r left join pg_replication_slots s on s.active_pid = r.pid").fetchone()  # type: ignore[misc]
            assert senders == of_group <= 1, (senders, of_group)
    assert len(_runs(driver, "pair")) == 1 and run.thread.is_alive()  # one group run hosted both throughout
    # stream 1's status asset shows its open run as the member run the group run hosts, holding the lease
    shown = [str(o.metadata["open_run_state"].value) for o in driver.observations
             if o.asset_key == dg.AssetKey(["pgstream", "stream_1", "status"]) and "open_run_state" in o.metadata]
    assert any(state.startswith(f"live: member run {dagster_run.run_id}/1") for state in shown), shown
    assert sorted(delivered()) == _events(db_url, 1)
    # stream 2 is in failover, and every event of it is recorded all the same
    assert sorted(_recorded(db_url, 2)) == _events(db_url, 2) and len(_events(db_url, 2)) == 25
    assert state(2) == "failover"
    assert _pgstream_slots(db_url) == [_group_slot(db_url)]
    _end_group_runs(driver)


def _member(group: str, i: int, sink: Path) -> dict[str, Any]:
    """A member of ``group`` in mode open whose group run would live 5 minutes."""
    return {"id": i, "reader": group, "batch": {"max_size": 50, "max_fill_secs": 0},
            "sensor": {"tick_budget_secs": 0.1},
            "delivery": {"mode": "open", "tuning": {"max_run_secs": 300}},
            "sink": {"type": "file", "path": str(sink)}}


def _reconfigured_while_a_group_run_lives(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                          before: list[dict[str, Any]], after: list[dict[str, Any]],
                                          sinks: Callable[[int], list[Path]]) -> tuple[Driver, float]:
    """The group run of ``before`` is live and delivering; the code location reloads with ``after``: the group's
    sensor requests a run of ``after`` at once, and asks the old run to end once that one waits for the group's
    lease (a hand-over: the new run was up before the old one ended); every event written before, during and
    after arrives once, in commit order (through ``sinks(i)``, concatenated). The driver, and how long the old
    run took to end after the reload."""
    name = str(before[0]["reader"])  # (the instance is the tests': its runs are told apart by their group)
    old_ids, new_ids = [s["id"] for s in before], [s["id"] for s in after]
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, before), instance)

    def delivered(i: int) -> list[int]:
        return [e["id"] for path in sinks(i) for e in read_jsonl(path)]

    def until(done: Callable[[], bool], ids: list[int], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, {i: len(delivered(i)) for i in ids}
            _tick(driver, name)

    _tick(driver, name)
    (old,) = _runs(driver, name)
    for i in old_ids:
        insert_events(db_url, i, 10)
    until(lambda: all(len(delivered(i)) == 10 for i in old_ids), old_ids)
    for i in old_ids:  # written before the reload, maybe delivered after it
        insert_events(db_url, i, 5, start=100)

    driver.reload(write_config(tmp_path / "pgstream2.yaml", db_url, after))
    reload_at = time.monotonic()
    _tick(driver, name)  # the group's sensor: it registers a new member and requests the old run's successor
    with psycopg.connect(db_url) as c:
        assert [r[0] for r in c.execute("select id from pgstream.streams where reader_group = %s order by id", [name])
                ] == new_ids
    (new, dagster_old) = instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(db_url, name)}))
    assert dagster_old.run_id == old.run_id and "pgstream/stop" not in dagster_old.tags  # (it delivers meanwhile)
    for i in new_ids:  # written while the old run hands over
        insert_events(db_url, i, 5, start=200)
    stop = f"its successor {new.run_id} is up (the configuration of its streams changed)"
    until(lambda: not old.thread.is_alive(), new_ids, timeout=15)
    ended_after = time.monotonic() - reload_at
    assert old.wait(5).success
    ended = instance.get_run_by_id(dagster_old.run_id)
    assert ended is not None and ended.tags["pgstream/stop"] == stop
    assert [r.run_id for r in _runs(driver, name)] == [old.run_id, new.run_id]  # up before the old one ended
    for i in new_ids:  # written to the new run
        insert_events(db_url, i, 5, start=300)
    until(lambda: all(len(delivered(i)) >= len(_events(db_url, i)) for i in new_ids), new_ids)
    for i in new_ids:
        assert delivered(i) == _events(db_url, i), i  # every event, once, in commit order
    assert len(_runs(driver, name)) == 2 and _runs(driver, name)[1].thread.is_alive()
    (dagster_new,) = [r for r in instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(db_url, name)}))
                      if r.run_id != dagster_old.run_id]
    assert dagster_new.tags["pgstream/config"] == streams_fingerprint(load_config(driver.config_path).streams)
    assert "pgstream/stop" not in dagster_new.tags
    return driver, ended_after


def test_a_members_changed_sink_is_picked_up_by_a_fresh_group_run_within_seconds(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """The code location reloads with stream 2's sink writing another file: the live group run is asked to end
    and ends within seconds; what was delivered before went to the old file, every event written after the new
    run started goes to the new one, and none is lost or repeated across the two."""
    before = [_member("resink", i, tmp_path / f"out{i}.jsonl") for i in (1, 2, 3)]
    after = [_member("resink", i, tmp_path / ("out2-new.jsonl" if i == 2 else f"out{i}.jsonl")) for i in (1, 2, 3)]
    driver, ended_after = _reconfigured_while_a_group_run_lives(
        db_url, tmp_path, instance, before, after,
        lambda i: [tmp_path / "out2.jsonl", tmp_path / "out2-new.jsonl"] if i == 2 else [tmp_path / f"out{i}.jsonl"])
    assert ended_after < 10
    old_file = [e["id"] for e in read_jsonl(tmp_path / "out2.jsonl")]
    new_file = [e["id"] for e in read_jsonl(tmp_path / "out2-new.jsonl")]
    assert len(old_file) >= 10 and new_file[-5:] == _events(db_url, 2)[-5:]  # the last wave: the new sink's
    _end_group_runs(driver)


def test_a_member_without_an_entry_is_recorded_and_told_and_the_others_are_delivered(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """While the group run of streams 1 and 2 lives, stream 3 is registered in the group by a newer configuration
    (`pgstream-dagster init`) the code location has not loaded: its events are recorded meanwhile, its line is
    told at every tick of the group's sensor, and streams 1 and 2 go on being delivered, in the same run. Once
    the code location reloads with stream 3, a fresh run delivers each of its events once. Then stream 2's entry
    is removed from pgstream.yaml: streams 1 and 3 go on, stream 2's events are recorded and told; configured
    again, it gets every one of them once, in commit order."""
    members = {i: _member("refused", i, tmp_path / f"out{i}.jsonl") for i in (1, 2, 3)}
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [members[1], members[2]]), instance)

    def delivered(i: int) -> list[int]:
        path = tmp_path / f"out{i}.jsonl"
        return [e["id"] for e in read_jsonl(path)] if path.exists() else []

    def tick_until(done: Callable[[], bool], what: str) -> list[str]:
        """The skip reasons of the sensor's ticks until ``done``: one tick at least (the group run may have done
        it all before the first: the tick's line is still wanted)."""
        skips: list[str] = []
        deadline = time.monotonic() + 60
        while True:
            skips.append(_tick(driver, "refused") or "")
            if done():
                return skips
            assert time.monotonic() < deadline, (what, {i: len(delivered(i)) for i in (1, 2, 3)}, skips[-1:])
            time.sleep(0.05)

    _tick(driver, "refused")  # (registers streams 1 and 2, and requests the group's run)
    for i in (1, 2):
        insert_events(db_url, i, 10)
    tick_until(lambda: all(len(delivered(i)) == 10 for i in (1, 2)), "streams 1 and 2")
    (old,) = _runs(driver, "refused")
    with psycopg.connect(db_url, autocommit=True) as c:
        groups.register_group_member(c, 3, "refused")
    insert_events(db_url, 3, 5)
    for i in (1, 2):
        insert_events(db_url, i, 5, start=100)
    told = ("reader group refused: stream 3 is in the group in the database but has no streams[] entry with "
            "reader: refused in pgstream.yaml: its events are recorded and wait")
    skips = tick_until(lambda: all(len(delivered(i)) == 15 for i in (1, 2)) and len(_recorded(db_url, 3)) == 5,
                       "streams 1 and 2 beside an unconfigured stream 3")
    assert any(told in line for line in skips), skips[-3:]
    assert _runs(driver, "refused") == [old] and old.thread.is_alive()  # the same run: nothing stopped
    assert delivered(3) == []

    driver.reload(write_config(tmp_path / "pgstream2.yaml", db_url, list(members.values())))
    tick_until(lambda: delivered(3) == _events(db_url, 3) and not old.thread.is_alive(),
               "stream 3 once configured, the old run ended")  # (it gives way before its members' runs closed)
    assert len(_runs(driver, "refused")) == 2

    driver.reload(write_config(tmp_path / "pgstream3.yaml", db_url, [members[1], members[3]]))
    # the run of the configuration with stream 2's entry is asked to end (until then it may deliver what commits)
    (_, second) = _runs(driver, "refused")
    tick_until(lambda: not second.thread.is_alive() and len(_runs(driver, "refused")) == 3,
               "the run with stream 2's entry ended, the next one started")
    for i in (1, 2, 3):
        insert_events(db_url, i, 5, start=200)
    removed = ("reader group refused: stream 2 is in the group in the database but has no streams[] entry")
    skips = tick_until(lambda: all(len(delivered(i)) == len(_events(db_url, i)) for i in (1, 3))
                       and len(_recorded(db_url, 2)) == 20, "streams 1 and 3 without stream 2's entry")
    assert any(removed in line for line in skips), skips[-3:]
    assert len(delivered(2)) == 15

    driver.reload(write_config(tmp_path / "pgstream4.yaml", db_url, list(members.values())))
    tick_until(lambda: all(len(delivered(i)) >= len(_events(db_url, i)) for i in (1, 2, 3)), "every stream")
    for i in (1, 2, 3):
        assert delivered(i) == _events(db_url, i), i  # each event once, in commit order
    _end_group_runs(driver)


def test_init_creates_one_slot_for_a_group(db_url: str, tmp_path: Path) -> None:
    """`pgstream-dagster init` registers a group's streams and creates the group's one slot (not one each); a
    stream whose entry names no group is in group ``default``, its slot created as well."""
    _configs(tmp_path, db_url, [1, 2, 3, 4], group={4: None})
    out = init(tmp_path / "pgstream.yaml")
    (default_line, group_line) = sorted(line for line in out if "reader group" in line)  # (default < shared)
    assert group_line.startswith(f"created slot pgstream_g_{GROUP}_d") and group_line.endswith(
        f"for reader group {GROUP} (streams 1, 2, 3)")
    assert default_line.startswith(f"created slot pgstream_g_{DEFAULT_READER}_d") and default_line.endswith(
        f"for reader group {DEFAULT_READER} (streams 4)")
    assert not [line for line in out if "for stream " in line]  # no slot of a stream's own
    with psycopg.connect(db_url) as c:
        assert c.execute("select id, reader_group from pgstream.streams order by id").fetchall() == [
            (1, GROUP), (2, GROUP), (3, GROUP), (4, DEFAULT_READER)]
        slots = [r[0] for r in c.execute("select slot from pgstream.reader_groups order by name")]
    assert slot_of(db_url, 4) == slots[0] and sorted(_pgstream_slots(db_url)) == sorted(slots)


# --- hostile roles ----------------------------------------------------------------------------------


@pytest.fixture
def hostile(db_url: str) -> Iterator[dict[str, str]]:
    """Fresh LOGIN roles of this database (:func:`_hostile_roles`)."""
    with _hostile_roles(db_url) as names:
        yield names


@contextlib.contextmanager
def _hostile_roles(db_url: str) -> Iterator[dict[str, str]]:
    """Fresh LOGIN roles of this database: ``runtime`` (a login member of pgstream_runtime with REPLICATION,
    as the code location connects), ``app`` (writes its own table ``public.orders``), ``owner`` (owns a
    table and may CREATE in the database and in schema public: publications, schemas, functions)."""
    suffix = db_url.rsplit("/", 1)[1]
    names = {kind: f"hostile_{kind}_{suffix}" for kind in ("runtime", "app", "owner")}
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(f"create role {names['runtime']} login replication in role pgstream_runtime")
        c.execute(f"create role {names['app']} login")
        c.execute(f"create role {names['owner']} login")
        c.execute(f"grant create on database {suffix} to {names['owner']}")
        c.execute(f"grant create on schema public to {names['owner']}")
        c.execute(f"create table public.orders (id bigint primary key) ; alter table public.orders owner to "
                  f"{names['owner']}; grant insert on public.orders to {names['app']}")
    yield names
    with psycopg.connect(db_url, autocommit=True) as c:
        for name in names.values():
            c.execute(f"drop owned by {name} cascade")
            c.execute(f"drop role {name}")


def _as(url: str, role: str) -> psycopg.Connection:
    """A fresh connection as ``role`` (PL/pgSQL caches plans per session: each attack in a new one)."""
    return psycopg.connect(url, user=role, autocommit=True)


def _refused(url: str, role: str, statement: str, params: list[Any] | None = None) -> psycopg.Error:
    with _as(url, role) as h, pytest.raises(psycopg.Error) as refused:
        h.execute(statement, params)
    return refused.value


def test_a_function_planted_in_public_redirects_none_of_the_group_readers_calls(
        db_url: str, tmp_path: Path, hostile: dict[str, str]) -> None:
    """A role that may create functions in ``public`` (on the default search path of every role) plants
    look-alikes of the built-ins the group's reader calls with untyped arguments (a ``text`` parameter
    is a better match for a string than the built-in's ``name``): each would record who ran it and
    return no change. The group's reader, on a connection with the default search path, runs none of
    them and records every event; the runtime's own connections pin the search path."""
    owner = hostile["owner"]
    with _as(db_url, owner) as h:
        h.execute("create table public.ran (who text, what text)")
        h.execute("grant insert on public.ran to public")
        for name, args, returns, row in [
                ("pg_logical_slot_peek_binary_changes", "text, text, integer, text, text, text, text",
                 "table (data bytea)", "select null::bytea where false"),
                ("pg_logical_slot_peek_binary_changes", "text, text, bigint, text, text, text, text",
                 "table (data bytea)", "select null::bytea where false"),
                ("pg_create_logical_replication_slot", "text, text", "table (slot_name text, lsn text)",
                 "select 'x', '0/0' where false"),
                ("pg_replication_slot_advance", "text, text", "void", "select"),
                ("pg_drop_replication_slot", "text", "void", "select"),
                ("pg_xact_status", "text", "text", "select 'committed'"),
                ("unnest", "text", "setof bigint", "select 1::bigint where false")]:
            h.execute(f"create function public.{name}({args}) returns {returns} language sql as $$ "
                      f"insert into public.ran values (current_user, '{name}'); {row} $$")
            h.execute(f"grant execute on function public.{name}({args}) to public")
    streams = _configs(tmp_path, db_url, [1, 2])
    with psycopg.connect(db_url, autocommit=True) as c:
        assert "public" in str(c.execute("show search_path").fetchone())
        first = ingest.consume_group(c, GROUP, streams, 0)
        assert first.slot_created
        insert_events(db_url, 1, 5)
        insert_events(db_url, 2, 3)
        _drain(c, streams, lambda: len(_recorded(db_url, 1)) == 5 and len(_recorded(db_url, 2)) == 3, timeout=20)
        assert c.execute("select count(*) from public.ran").fetchone() == (0,)
        assert _recorded(db_url, 1) == _events(db_url, 1) and _recorded(db_url, 2) == _events(db_url, 2)
    # the runtime's connections (the sensors' resource, an open run's reader) see pg_catalog, pg_temp only,
    # and keep what the URL's options say
    from pgstream_dagster.engine import dbconn
    with dbconn.connect(db_url + "?options=-c%20statement_timeout%3D12345") as r:
        assert r.execute("show search_path").fetchone() == ("pg_catalog,pg_temp",)
        assert r.execute("show statement_timeout").fetchone() == ("12345ms",)


@pytest.fixture(scope="module")
def two_groups(pg: LocalPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """A database of its own for the crafted-argument rows (each refused and changing nothing: they share it)
    with the hostile roles, group ``shared`` of streams 1 and 2 and group ``other`` of stream 3."""
    name = fresh_database(pg, migrated_template(pg))
    url = pg.url_for(name)
    streams = _configs(tmp_path_factory.mktemp("two-groups"), url, [1, 2, 3], group={3: "other"})
    with _hostile_roles(url) as roles:
        with psycopg.connect(url, autocommit=True) as c:
            ingest.consume_group(c, GROUP, streams[:2], 0)
            ingest.consume_group(c, "other", streams[2:], 0)
        yield url, roles
    drop_database(pg, name)


@pytest.mark.parametrize(("statement", "params", "message"), [
    ("select pgstream.register_group_member(%s, %s)", [1, "x') ; drop table pgstream.streams; --"],
     "register_group_member: reader group name 'x'') ; drop table pgstream.streams; --' is not [a-z][a-z0-9_]{0,30}"),
    ("select pgstream.register_group_member(%s, %s)", [1, "a,pgstream_stream_1_rows"],
     "register_group_member: reader group name 'a,pgstream_stream_1_rows' is not"),
    ("select pgstream.register_group_member(%s, %s)", [1, "Shared"], "reader group name 'Shared' is not"),
    ("select pgstream.register_group_member(%s, %s)", [1, "a" * 32], "is not [a-z][a-z0-9_]{0,30}"),
    ("select pgstream.register_group_member(%s, %s)", [1, None], "reader group name NULL is not"),
    ("select pgstream.register_group_member(%s, %s)", [0, GROUP],
     "register_group_member: stream id must be positive, got '0'"),
    ("select pgstream.register_group_member(%s, %s)", [None, GROUP], "stream id must be positive, got NULL"),
    ("select pgstream.ensure_group_publication(%s)", ["nosuch"],
     "ensure_group_publication: reader group nosuch does not exist"),
    ("select pgstream.ensure_group_publication(%s)", ["a\"; drop publication x; --"], "is not [a-z]"),
    ("select pgstream.begin_join(%s, %s)", [-5, GROUP], "begin_join: stream id must be positive, got '-5'"),
    ("select pgstream.begin_join(%s, %s)", [1, "other"], "begin_join: stream 1 is not a member of reader group other"),
    ("select pgstream.finish_join(%s, %s)", [3, GROUP], "finish_join: stream 3 is not a member of reader group shared"),
    ("select pgstream.register_group_member(%s, %s)", [3, GROUP],
     "stream 3 reads with reader group other, not shared: moving a stream to another group is not supported"),
    ("select pgstream.begin_join(%s, %s)", [1, GROUP], "begin_join: stream 1 has joined reader group shared already"),
    ("select pgstream.begin_join(%s, %s)", [1, "nosuch"], "begin_join: reader group nosuch does not exist"),
    ("select pgstream.finish_join(%s, %s)", [9, GROUP], "finish_join: stream 9 is not a member of reader group shared"),
    ("select pgstream.begin_join(%s::text::bigint, %s)", ["1; select 1", GROUP],
     "invalid input syntax for type bigint"),
])
def test_the_group_functions_refuse_crafted_arguments_in_one_line_and_change_nothing(
        two_groups: tuple[str, dict[str, str]], statement: str, params: list[Any], message: str) -> None:
    """As the runtime, from a fresh connection: names that would inject into the publication's DDL or a
    slot's publication_names, ids out of range, another group's or no group, a joined member's join
    again, a group's slot for a stream: each refused with one line naming the function and the
    argument; the group, its members and its publication are as before."""
    db_url, hostile = two_groups
    with psycopg.connect(db_url, autocommit=True) as c:
        before = c.execute("select name, slot, members from pgstream.reader_groups order by 1").fetchall()
        rows = c.execute("select id, reader_group, slot_reader, join_lsn from pgstream.streams order by id").fetchall()
        pubs = c.execute("select pubname, rowfilter from pg_publication_tables order by 1").fetchall()
    error = _refused(db_url, hostile["runtime"], statement, params)
    assert isinstance(error, psycopg.errors.InvalidParameterValue | psycopg.errors.NoDataFound |
                      psycopg.errors.ObjectNotInPrerequisiteState | psycopg.errors.FeatureNotSupported |
                      psycopg.errors.UniqueViolation | psycopg.errors.InvalidTextRepresentation), error
    assert message in str(error).splitlines()[0] and "\n" not in (error.diag.message_primary or "")
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select name, slot, members from pgstream.reader_groups order by 1").fetchall() == before
        assert c.execute("select id, reader_group, slot_reader, join_lsn from pgstream.streams "
                         "order by id").fetchall() == rows
        assert c.execute("select pubname, rowfilter from pg_publication_tables order by 1").fetchall() == pubs
        assert c.execute("select count(*) from pg_roles where rolsuper and rolname like 'hostile%'").fetchone() == (0,)


def test_a_runtime_calling_the_hand_over_out_of_order_is_refused_and_the_join_loses_nothing(
        db_url: str, tmp_path: Path, hostile: dict[str, str]) -> None:
    """As the runtime, from fresh connections: finish_join before begin_join; begin_join while a
    transaction older than the publication's change still runs (its events would be in neither slot);
    finish_join while the member's own slot is behind its join position; a joined member's declared
    reader set back to the sensor or to a run (the trigger keeps the group's). Each is refused or kept,
    and the group's reader then hands the stream over with every event recorded once."""
    runtime = hostile["runtime"]
    streams = _configs(tmp_path, db_url, [1, 2])
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, GROUP, streams[:1], 0)
        _own_slot(c, 2)  # stream 2 reads its own slot (a version with a slot per stream)
        insert_events(db_url, 2, 10)
        assert _read_as_before(c, streams[1]) == 10
        insert_events(db_url, 2, 4, start=100)  # waiting in its own slot
        writer = psycopg.connect(db_url)  # began before the publication includes stream 2
        writer.execute("insert into pgstream.events (payload, stream_id) values ('{\"late\": 1}', 2)")
        try:
            with _as(db_url, runtime) as h:
                h.execute("select pgstream.register_group_member(2, 'shared')")
                assert h.execute("select pgstream.ensure_group_publication('shared')").fetchone() == ("altered",)
            early = _refused(db_url, runtime, "select pgstream.finish_join(2, 'shared')")
            assert "finish_join: stream 2 has not begun joining reader group shared (begin_join)" in str(early)
            racing = _refused(db_url, runtime, "select pgstream.begin_join(2, 'shared')")
            assert isinstance(racing, psycopg.errors.ObjectNotInPrerequisiteState)
            assert "begin_join: stream 2: transactions older than the last change of reader group shared's " \
                   "publication are still running" in str(racing)
            # a repeatable-read snapshot taken before the change does not pass for a newer one
            with _as(db_url, runtime) as h:
                h.execute("begin isolation level repeatable read")
                h.execute("select 1")
                writer.commit()
                with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
                    h.execute("select pgstream.begin_join(2, 'shared')")
                h.execute("rollback")
        finally:
            writer.close()
        assert ledger_state.slot_reader(c, 2) == ledger_state.SENSOR  # nothing changed so far
        with _as(db_url, runtime) as h:
            (join_lsn,) = h.execute("select pgstream.begin_join(2, 'shared')").fetchone()  # type: ignore[misc]
        behind = _refused(db_url, runtime, "select pgstream.finish_join(2, 'shared')")
        assert f"not drained to its join position {join_lsn} yet" in str(behind)
        # the trigger keeps a joined member's reader, whatever the runtime sets, and lets only begin_join hand
        # a joining member over (stream 3 joins: its reader set by hand would skip draining its own slot)
        ensure_stream(c, 3)  # a stream's row, before it gets reader:
        with _as(db_url, runtime) as h:
            h.execute("select pgstream.register_group_member(3, 'shared')")
        skipped = _refused(db_url, runtime, "update pgstream.streams set slot_reader = 'group:shared' where id = 3")
        assert isinstance(skipped, psycopg.errors.InsufficientPrivilege)
        assert "stream 3: only pgstream.begin_join hands a stream over to its reader group" in str(skipped)
        with _as(db_url, runtime) as h:
            h.execute("update pgstream.streams set slot_reader = 'sensor' where id = 1")
            h.execute("update pgstream.streams set open_run_key = 'k', slot_reader = 'run:k' where id = 1")
            assert h.execute("select slot_reader from pgstream.streams where id = 1").fetchone() == ("group:shared",)
            h.execute("update pgstream.streams set open_run_key = null where id = 1")
        # the group's reader goes on: drains stream 2's own slot to L, which finish_join then accepts
        insert_events(db_url, 2, 3, start=200)
        grouped = _configs(tmp_path, db_url, [1, 2, 3])
        _drain(c, grouped, lambda: ledger_state.slot_reader(c, 2) == groups.group_reader(GROUP) and
               len(_recorded(db_url, 2)) == len(_events(db_url, 2)))
        assert sorted(_recorded(db_url, 2)) == _events(db_url, 2) and len(_events(db_url, 2)) == 10 + 4 + 1 + 3
        assert c.execute("select join_lsn from pgstream.streams where id = 2").fetchone() == (None,)
        assert len(_pgstream_slots(db_url)) == 1  # its own slot dropped


def test_a_publication_by_the_groups_name_or_another_roles_locks_do_not_take_the_group_over(
        db_url: str, tmp_path: Path, hostile: dict[str, str]) -> None:
    """A role with CREATE on the database creates ``pgstream_group_<name>`` for its own table before the
    group exists: the group's reader refuses it, naming it and its owner, and reads nothing through it.
    The application and table-owning roles can neither lock the group's row or the streams (the runtime
    can: it is the group's reader) and their open transactions and table locks do not keep the group
    from recording."""
    owner, app = hostile["owner"], hostile["app"]
    with _as(db_url, owner) as h:
        h.execute("create publication pgstream_group_squat for table public.orders")
    # a stream configured with the slot of a group (slot_name) is refused, naming the group
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, "other", _configs(tmp_path, db_url, [8], group={8: "other"}), 0)
        taken = _group_slot(db_url)
        with pytest.raises(SlotInUse,
                           match=f"stream 9: slot {taken} is already used by reader group other " r"\(its slot\)"):
            ensure_stream(c, 9, taken)
        assert c.execute("select count(*) from pgstream.streams where id = 9").fetchone() == (0,)
    squat = _configs(tmp_path, db_url, [7], group={7: "squat"})
    with psycopg.connect(db_url, autocommit=True) as c:
        with pytest.raises(groups.GroupChange) as refused:
            ingest.consume_group(c, "squat", squat, 0)
        assert str(refused.value) == (
            f"reader group squat: publication pgstream_group_squat is not the group's (owner {owner}, or "
            "it publishes more than pgstream.events): drop it")
        assert _pgstream_slots(db_url) == [taken]  # (group other's): none for the squatted group
    for role, statement in itertools.product((app, owner), [
            "begin; lock table pgstream.reader_groups in access share mode",
            "select 1 from pgstream.reader_groups for update",
            "begin; lock table pgstream.streams in access share mode",
            "select 1 from pgstream.streams for key share",
            "select pgstream.register_group_member(1, 'shared')"]):
        assert isinstance(_refused(db_url, role, statement), psycopg.errors.InsufficientPrivilege), (role, statement)
    streams = _configs(tmp_path, db_url, [1, 2])
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, GROUP, streams, 0)
        # the table's owner holds its table locked, the application an open transaction that wrote
        locker, idle = _as(db_url, owner), _as(db_url, app)
        try:
            locker.execute("begin")
            locker.execute("lock table public.orders in access exclusive mode")
            idle.execute("begin")
            idle.execute("select txid_current()")
            insert_events(db_url, 1, 5)
            insert_events(db_url, 2, 5)
            started = time.monotonic()
            _drain(c, streams, lambda: len(_recorded(db_url, 1)) == 5 and len(_recorded(db_url, 2)) == 5, timeout=15)
            assert time.monotonic() - started < 10
        finally:
            locker.close()
            idle.close()


def test_an_open_transaction_of_another_role_bounds_the_group_slots_creation_and_is_named(
        db_url: str, tmp_path: Path, hostile: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Creating a slot waits for every transaction running (Postgres needs a point where none is): an
    application role that keeps one open (it wrote, or locked its table) would hold the group's sensor in
    its first tick for as long as it likes. The wait is bounded; the tick ends with one line naming the
    backend, nothing is created, and the next tick after the transaction ends creates the slot."""
    monkeypatch.setattr(group_reader, "SLOT_CREATION_WAIT_SECS", 1.0)
    streams = _configs(tmp_path, db_url, [1])
    idle = _as(db_url, hostile["owner"])
    try:
        idle.execute("begin")
        idle.execute("lock table public.orders in access exclusive mode")  # (takes a transaction id)
        pid = idle.info.backend_pid
        with psycopg.connect(db_url, autocommit=True) as c:
            started = time.monotonic()
            with pytest.raises(replication.SlotCreationWaits) as waits:
                ingest.consume_group(c, GROUP, streams, 0)
            assert time.monotonic() - started < 5
            assert f"backends {pid} (role {hostile['owner']})" in str(waits.value)
            assert str(waits.value).startswith(f"creating replication slot {_group_slot(db_url)} waited 1 s ")
            assert _pgstream_slots(db_url) == []
            # another group's as well (stream 5 names none: group default)
            other = _configs(tmp_path, db_url, [5], group={5: None})
            with pytest.raises(replication.SlotCreationWaits, match=f"backends {pid} "):
                ingest.consume_group(c, DEFAULT_READER, other, 0)
            idle.execute("rollback")
            assert ingest.consume_group(c, DEFAULT_READER, other, 0).slot_created
            assert ingest.consume_group(c, GROUP, streams, 0).slot_created
            assert sorted(_pgstream_slots(db_url)) == sorted([slot_of(db_url, 1), slot_of(db_url, 5)])
    finally:
        idle.close()


def test_shadows_in_pg_temp_and_the_search_path_change_nothing_the_group_functions_do(
        db_url: str, tmp_path: Path, hostile: dict[str, str]) -> None:
    """The runtime (the one role that may call them) plants, in its session's pg_temp and in public (first
    on its search path), types named like the ones the group functions use with implicit casts that try to
    make it superuser, and functions and an operator named like theirs; the functions run as the owner (a
    superuser here) and use none of them: the group and the hand-over come out right, no role gained
    anything, nothing planted ran."""
    runtime = hostile["runtime"]
    escalate = f"begin execute 'alter role {runtime} superuser'; exception when others then null; end;"
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(f"grant create on schema public to {runtime}")
        c.execute("create table public.ran (what text)")
        c.execute("grant insert on public.ran to public")
        ensure_stream(c, 2)
    with _as(db_url, runtime) as h:
        h.execute("set search_path = pg_temp, public, pg_catalog")
        for name in ("text", "pg_lsn", "int8"):
            h.execute(f"create type pg_temp.{name} as enum ('x')")
            h.execute(f"create function pg_temp.to_{name}(pg_catalog.{name}) returns pg_temp.{name} language plpgsql "
                      f"as $$ begin insert into public.ran values ('cast {name}'); {escalate} return 'x'; end $$")
            h.execute(f"create cast (pg_catalog.{name} as pg_temp.{name}) with function "
                      f"pg_temp.to_{name}(pg_catalog.{name}) as implicit")
        for fn, args in [("array_to_string", "bigint[], text"), ("format", "text, variadic text[]"),
                         ("pg_current_wal_insert_lsn", ""), ("quote_nullable", "anyelement"),
                         ("pg_get_userbyid", "oid"), ("left", "text, integer")]:
            h.execute(f"create function public.{fn}({args}) returns text language plpgsql as "
                      f"$$ begin insert into public.ran values ('{fn}'); {escalate} return 'x'; end $$")
        h.execute("create function public.eq(text, text) returns boolean language plpgsql as "
                  f"$$ begin insert into public.ran values ('='); {escalate} return true; end $$")
        h.execute("create operator public.= (leftarg = text, rightarg = text, function = public.eq)")
        assert h.execute("select pgstream.register_group_member(1, 'shared')").fetchone() is not None
        assert h.execute("select pgstream.register_group_member(2, 'shared')").fetchone() is not None
        assert h.execute("select pgstream.ensure_group_publication('shared')").fetchone() == ("created",)
        h.execute("select pgstream.begin_join(1, 'shared')")
        h.execute("select pgstream.finish_join(1, 'shared')")
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            h.execute("select pgstream.begin_join(2, 'Shared''')")
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select count(*) from public.ran").fetchone() == (0,)
        assert c.execute("select rolsuper from pg_roles where rolname = %s", [runtime]).fetchone() == (False,)
        assert c.execute("select members from pgstream.reader_groups where name = 'shared'").fetchone() == ([1, 2],)
        assert c.execute("select id, slot_reader, join_lsn is null from pgstream.streams order by id").fetchall() == [
            (1, "group:shared", True), (2, "sensor", True)]
        assert c.execute("select rowfilter from pg_publication_tables where pubname = 'pgstream_group_shared'"
                         ).fetchone() == ("(stream_id = ANY (ARRAY[(1)::bigint, (2)::bigint]))",)


def test_a_publication_by_a_streams_name_made_by_another_role_is_refused_and_reads_nothing(
        db_url: str, tmp_path: Path, hostile: dict[str, str]) -> None:
    """A role with CREATE on the database creates the publications a stream will have by their names
    (``pgstream_stream_<id>``, ``_rows``) for its own table, before the stream exists: registering the stream
    (alone, or as a group's member) refuses it in one line naming the publication and its owner, and changes
    nothing; once the operator drops it, the stream gets its own."""
    owner = hostile["owner"]
    with _as(db_url, owner) as h:
        h.execute("create publication pgstream_stream_7 for table public.orders")
        h.execute("create publication pgstream_stream_8_rows for table public.orders")
    with psycopg.connect(db_url, autocommit=True) as c:
        with pytest.raises(replication.PublicationTaken) as refused:
            ensure_stream(c, 7)
        assert str(refused.value) == (f"stream 7: publication pgstream_stream_7 is not the stream's (owner {owner}, "
                                      "or it publishes more than pgstream.events): drop it")
        with pytest.raises(replication.PublicationTaken, match="publication pgstream_stream_8_rows is not the stream"):
            groups.register_group_member(c, 8, "squat")
        # a group's only member refused: left out, in one line; no group, publication or slot for nothing
        alone = ingest.consume_group(c, "squat", _configs(tmp_path, db_url, [7], group={7: "squat"}), 0)
        assert alone.left_out == {7: f"reader group squat: stream 7 is left out: publication pgstream_stream_7 is "
                                     f"not the stream's (owner {owner}, or it publishes more than pgstream.events): "
                                     "drop it"}
        assert alone.notes == list(alone.left_out.values()) and alone.slot is None
        assert c.execute("select count(*) from pgstream.streams where id in (7, 8)").fetchone() == (0,)
        assert c.execute("select count(*) from pgstream.reader_groups").fetchone() == (0,)
        # the operator drops the other role's publications: the streams get their own
        for name in ("pgstream_stream_7", "pgstream_stream_8_rows"):
            c.execute(f"drop publication {name}")
        ensure_stream(c, 7)
        groups.register_group_member(c, 8, "squat")
        rows = c.execute("select p.pubname, r.prrelid::regclass::text from pg_publication p join pg_publication_rel r "
                         "on r.prpubid = p.oid where p.pubname in ('pgstream_stream_7', 'pgstream_stream_8_rows') "
                         "order by 1").fetchall()
        assert rows == [("pgstream_stream_7", "pgstream.events"), ("pgstream_stream_8_rows", "pgstream.events")]


def test_a_publication_squatted_by_a_members_name_leaves_that_member_out_and_the_group_goes_on(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, hostile: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams 1 and 2 deliver through their group's sensor and delivery run when a role with CREATE on the
    database, from a fresh connection, creates ``pgstream_stream_3`` (ids are small and sequential) for its own
    table before stream 3 exists; then stream 3 is added to the group. Stream 3 cannot join: it is left out,
    told in one line by the group's sensor (each tick's status) and once by the group delivery run, and nothing
    is read through the squatted publication; every event of streams 1 and 2 keeps being recorded and delivered,
    once, in commit order. Once the operator drops the publication, stream 3 joins and delivers."""
    from pgstream_dagster.engine.delivery import group as group_delivery

    monkeypatch.setattr(group_delivery, "READ_SECS", 1.0)  # the run's reader tells what a read did when it ends
    owner = hostile["owner"]
    before = [_member("held", i, tmp_path / f"out{i}.jsonl") for i in (1, 2)]
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, before), instance)
    _tick(driver, "held")

    def deliver(ids: tuple[int, ...], each: int, skips: list[str | None]) -> None:
        deadline = time.monotonic() + 60
        while not all(len(_delivered(tmp_path, i)) >= each for i in ids):
            assert time.monotonic() < deadline, {i: len(_delivered(tmp_path, i)) for i in ids}
            skips.append(_tick(driver, "held"))
            time.sleep(0.1)

    for i in (1, 2):
        insert_events(db_url, i, 10)
    deliver((1, 2), 10, [])
    with _as(db_url, owner) as h:
        h.execute("create publication pgstream_stream_3 for table public.orders")
        h.execute("insert into public.orders values (1)")
    after = [*before, _member("held", 3, tmp_path / "out3.jsonl")]
    driver.reload(write_config(tmp_path / "pgstream2.yaml", db_url, after))
    line = (f"reader group held: stream 3 is left out: publication pgstream_stream_3 is not the stream's (owner "
            f"{owner}, or it publishes more than pgstream.events): drop it")
    skips: list[str | None] = []
    deadline = time.monotonic() + 60
    # the run of before is handed over (configuration changed) to a fresh one, and ends
    while len(_runs(driver, "held")) < 2 or _runs(driver, "held")[0].thread.is_alive():
        assert time.monotonic() < deadline, skips
        skips.append(_tick(driver, "held"))
        time.sleep(0.1)
    (fresh, _before) = instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(db_url, "held")}))
    assert _run_reads(db_url, group="held") == f"group delivery run {fresh.run_id}"  # its reader reads
    for wave in range(1, 4):
        for i in (1, 2):
            insert_events(db_url, i, 10, start=100 * wave)
        deliver((1, 2), 10 * (wave + 1), skips)
    for i in (1, 2):
        assert _delivered(tmp_path, i) == _events(db_url, i), i  # every event once, in commit order
        assert _recorded(db_url, i) == _events(db_url, i), i
    told = [s for s in skips if s is not None and line in s]
    assert told and all(s.count("is left out") == 1 for s in told), skips
    deadline = time.monotonic() + 30  # (the run's reader tells what a read did when it ends)
    while line not in (said := [e.user_message for e in instance.all_logs(fresh.run_id)]):
        assert time.monotonic() < deadline, said
        time.sleep(0.2)
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select id from pgstream.streams order by id").fetchall() == [(1,), (2,)]
        assert c.execute("select members from pgstream.reader_groups").fetchone() == ([1, 2],)
        assert c.execute("select pg_get_userbyid(pubowner) from pg_publication where pubname = 'pgstream_stream_3'"
                         ).fetchone() == (owner,)
        # the operator drops it: stream 3 is registered at the next pass and joins; its events are delivered
        c.execute("drop publication pgstream_stream_3")
        deadline = time.monotonic() + 30
        while c.execute("select count(*) from pgstream.streams where id = 3 and slot_reader = 'group:held' "
                        "and join_lsn is null").fetchone() != (1,):
            assert time.monotonic() < deadline
            _tick(driver, "held")
            time.sleep(0.1)
    insert_events(db_url, 3, 5)
    deliver((3,), 5, skips)
    assert _delivered(tmp_path, 3) == _events(db_url, 3)
    assert [e.user_message for e in instance.all_logs(fresh.run_id)].count(line) == 1  # told once while it stood
    _end_group_runs(driver)


def test_a_member_in_mode_per_batch_gets_a_dagster_run_per_batch_through_pyspark_beside_hosted_members(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """The design card's route for a reader group's member: stream 2 (mode per_batch) gets a run of the delivery
    job of its own per batch (read through PySpark), requested by the group's sensor; stream 1 (mode open) is
    hosted by the group delivery run, which never takes stream 2's runs. Every event of both arrives once, in
    commit order."""
    from pgstream_dagster.engine.delivery.run import DeliveryRun

    routes: dict[int, list[str]] = {}  # the source of each round delivered, by stream
    deliver = DeliveryRun.deliver

    def seen(run: DeliveryRun, host: Any) -> Any:
        for delivered in deliver(run, host):
            routes.setdefault(run.stream.id, []).append(delivered.route)
            yield delivered

    monkeypatch.setattr(DeliveryRun, "deliver", seen)
    members = [_member("card", 1, tmp_path / "out1.jsonl"),
               {**_member("card", 2, tmp_path / "out2.jsonl"), "delivery": {"mode": "per_batch"}}]
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, members), instance)
    own: list[dg.ExecuteInProcessResult] = []  # stream 2's runs, executed here (as the run launcher would)

    def tick() -> None:
        own.extend(driver.execute(request) for request in driver.tick_group("card").run_requests)

    tick()
    assert len(_runs(driver, "card")) == 1  # stream 1 keeps its run open: the group run is up first
    deadline = time.monotonic() + 120
    for wave in range(2):
        for i in (1, 2):
            insert_events(db_url, i, 15, start=100 * wave)
        while not all(len(_delivered(tmp_path, i)) >= 15 * (wave + 1) for i in (1, 2)):
            assert time.monotonic() < deadline, {i: len(_delivered(tmp_path, i)) for i in (1, 2)}
            tick()
            time.sleep(0.1)
    for i in (1, 2):
        assert _delivered(tmp_path, i) == _events(db_url, i), i
    assert len(own) >= 2 and all(r.success for r in own)  # a run per batch (or run of batches)
    assert all(r.dagster_run.tags[STREAM_TAG] == stream_tag_of(db_url, 2) for r in own)
    assert set(routes[2]) == {"SparkSource"} and "SparkSource" not in routes[1], routes  # stream 2's: PySpark
    (hosting,) = instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(db_url, "card")}))
    assert "pgstream/member_1" in hosting.tags and "pgstream/member_2" not in hosting.tags
    _end_group_runs(driver)


def test_a_members_dropped_or_altered_table_holds_no_other_member_back(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """Three streams with no ``reader:`` key (the database's default group), each subscribed to INSERTs on a table
    of its own. While the group's delivery run delivers, the application writes to stream 2's table and drops it
    at once (its subscription deleted first: pgstream's guard refuses the drop in one line), and alters stream 3's
    (a column added, one it does not publish retyped: the table rewritten; a rename and retyping a column it
    publishes are refused in one line each). Every event stream 2 had is delivered; streams 1 and 3 go on: every
    event once, in commit order, each wave within seconds, by the same group delivery run, while the group's
    sensor ticks on."""
    ids = [1, 2, 3]
    with psycopg.connect(db_url, autocommit=True) as c:
        for i in ids:
            c.execute(f"create table public.t{i} (id int primary key, v text, w int)")
    config = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": i, "batch": {"max_size": 50, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.1},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 300}},
         "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in ids],
        subscriptions=[{"key": f"s{i}", "stream_id": i, "operation": "INSERT", "schema_name": "public",
                        "table_name": f"t{i}", "column_names": ["id", "v"]} for i in ids])
    init(config)
    driver = Driver(config, instance)

    def write(table: str, start: int, n: int) -> None:
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute(f"insert into public.{table} select g, 'v' || g, g from generate_series(%s::int, %s::int) g",
                      [start, start + n - 1])

    def deliver(want: dict[int, int]) -> None:
        deadline = time.monotonic() + 30
        while not all(len(_delivered(tmp_path, i)) >= n for i, n in want.items()):
            assert time.monotonic() < deadline, {i: len(_delivered(tmp_path, i)) for i in want}
            _tick(driver, DEFAULT_READER)
            time.sleep(0.1)

    for i in ids:
        write(f"t{i}", 1, 20)
    deliver({1: 20, 2: 20, 3: 20})
    (run,) = _runs(driver, DEFAULT_READER)
    write("t2", 21, 5)  # (dropped before they are delivered)
    with psycopg.connect(db_url, autocommit=True) as c:
        with pytest.raises(psycopg.errors.DependentObjectsStillExist, match=re.escape(
                'subscriptions "s2" (stream 2, INSERT) depend on it')):
            c.execute("drop table public.t2")  # (pgstream's guard: in one line, with the statement to run first)
        c.execute("delete from pgstream.subscriptions where schema_name = 'public' and table_name = 't2'")
        c.execute("drop table public.t2")
        c.execute("alter table public.t3 add column extra int")
        refused = psycopg.errors.DependentObjectsStillExist
        with pytest.raises(refused, match=re.escape("column v of public.t3 is published")):
            c.execute("alter table public.t3 alter column v type varchar(10)")  # (the guard, in one line)
        c.execute("alter table public.t3 alter column w type bigint")  # (not published; the table rewritten)
        with pytest.raises(psycopg.errors.DependentObjectsStillExist, match='subscribed by "s3"'):
            c.execute("alter table public.t3 rename to t3_renamed")
    for wave in range(1, 4):
        write("t1", 100 * wave, 10)
        write("t3", 100 * wave, 10)
        deliver({1: 20 + 10 * wave, 2: 25, 3: 20 + 10 * wave})
    assert _runs(driver, DEFAULT_READER) == [run] and run.thread.is_alive()  # the same run throughout
    for i in ids:
        assert _delivered(tmp_path, i) == _events(db_url, i), i  # every event once, in commit order
    assert len(_delivered(tmp_path, 2)) == 25
    _end_group_runs(driver)


def test_members_whose_publish_calls_hang_hold_no_other_member_back(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """The webhook of streams 1-9 hangs in its first call of each (the run waits up to its 30 s timeout, the
    stream row held against a pause meanwhile): more members hang than the members' pool has connections working
    at once (``POOL_SIZE``). Streams 10 and 11, in the same default group, go on: each wave committed while the
    calls hang is delivered within seconds, every event once, in commit order. The group's reader, which moves
    every member's read position once a second, does not wait for the calls (an update of a stream row is no
    key update: it does not conflict with the publish's lock), nor do the other members' publishes, nor their
    turn for a pooled connection (one held a second no longer counts)."""
    from pgstream_dagster.engine.ledger.locks import POOL_SIZE

    hanging, release = Endpoint(), threading.Event()
    hung, going = list(range(1, POOL_SIZE + 2)), [POOL_SIZE + 2, POOL_SIZE + 3]

    def hang(_request: int) -> None:  # every call waits until the test lets it through
        release.wait(120)

    hanging.hook = hang
    try:
        config = write_config(tmp_path / "pgstream.yaml", db_url, [
            {"id": i, "batch": {"max_size": 50, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.1},
             "delivery": {"mode": "open", "tuning": {"max_run_secs": 300}},
             "sink": hanging.sink() if i in hung else {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}}
            for i in hung + going])
        init(config)
        driver = Driver(config, instance)

        def deliver(want: int, secs: float) -> None:
            deadline = time.monotonic() + secs
            while not all(len(_delivered(tmp_path, i)) >= want for i in going):
                assert time.monotonic() < deadline, {i: len(_delivered(tmp_path, i)) for i in going}
                _tick(driver, DEFAULT_READER)
                time.sleep(0.1)

        for i in hung + going:
            insert_events(db_url, i, 5)
        # (the calls time out after 30 s: the members that go on deliver, and every hung member's call hangs at once,
        # well before)
        deliver(5, 20)
        deadline = time.monotonic() + 10
        while hanging.requests < len(hung):
            assert time.monotonic() < deadline, hanging.requests
            _tick(driver, DEFAULT_READER)
            time.sleep(0.1)
        for wave in range(1, 4):
            time.sleep(1.5)  # (the reader has moved the members' read positions since)
            for i in going:
                insert_events(db_url, i, 10, start=100 * wave)
            deliver(5 + 10 * wave, 10)
        assert hanging.requests == len(hung) and not hanging.accepted  # each hung member's call hung throughout
        for i in going:
            assert _delivered(tmp_path, i) == _events(db_url, i), i  # every event once, in commit order
        release.set()
        deadline = time.monotonic() + 60
        everything = {e for i in hung for e in _events(db_url, i)}
        while hanging.unique() != everything:
            assert time.monotonic() < deadline, (len(hanging.unique()), len(everything))
            _tick(driver, DEFAULT_READER)
            time.sleep(0.1)
        _end_group_runs(driver)
    finally:
        release.set()
        hanging.down()


def test_a_members_hanging_publish_call_holds_no_other_member_back_across_a_hand_over(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """Stream 1's webhook hangs in a call (up to its 30 s timeout) when the code location reloads with another
    configuration (stream 3's batch size): the group run's successor is requested and the old run is asked to end
    once it waits. The old run gives the group's lease and its reading up at once and its other members close: the
    successor hosts streams 2 and 3 while stream 1's call still hangs in the old run (which holds stream 1's
    delivery lease until the call returns), so what they commit meanwhile is delivered within seconds, not after
    the call. Released, the old run delivers what it holds of stream 1, closes and ends; the successor takes
    stream 1 over. Every event once, in commit order; both runs succeed."""
    hanging, release, armed = Endpoint(), threading.Event(), threading.Event()

    def hang(_request: int) -> None:  # once armed, every call waits until the test lets it through
        if armed.is_set():
            release.wait(120)

    hanging.hook = hang

    def member(i: int, size: int = 50) -> dict[str, Any]:
        return {**_member("handing", i, tmp_path / f"out{i}.jsonl"), "batch": {"max_size": size, "max_fill_secs": 0},
                **({"sink": hanging.sink()} if i == 1 else {})}

    def delivered(i: int) -> list[int]:
        return sorted(hanging.unique()) if i == 1 else _delivered(tmp_path, i)

    try:
        config = write_config(tmp_path / "pgstream.yaml", db_url, [member(i) for i in (1, 2, 3)])
        init(config)
        driver = Driver(config, instance)

        def until(what: str, done: Callable[[], bool], timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not done():
                assert time.monotonic() < deadline, f"{what}: {({i: len(delivered(i)) for i in (1, 2, 3)})}"
                _tick(driver, "handing")
                time.sleep(0.1)

        for i in (1, 2, 3):
            insert_events(db_url, i, 5)
        until("the first events", lambda: all(len(delivered(i)) == 5 for i in (1, 2, 3)), 60)
        (old,) = _runs(driver, "handing")
        armed.set()
        calls = hanging.requests
        insert_events(db_url, 1, 5, start=100)
        until("stream 1's call", lambda: hanging.requests > calls, 20)

        driver.reload(write_config(tmp_path / "pgstream2.yaml", db_url, [member(1), member(2), member(3, 60)]))
        _tick(driver, "handing")  # the successor requested: it waits for the group's lease

        def closed() -> bool:
            """The old run was asked to end, and its members' runs of streams 2 and 3 have closed."""
            run = instance.get_run_by_id(old.run_id or "")
            return run is not None and "pgstream/stop" in run.tags and all(
                json.loads(run.tags.get(member_tag(i), "{}")).get("state") == "ended" for i in (2, 3))
        until("the old run's members closed", closed, 15)
        for i in (2, 3):
            insert_events(db_url, i, 5, start=200)
        until("streams 2 and 3 after the old run's members closed",
              lambda: all(len(delivered(i)) == 10 for i in (2, 3)), 10)
        runs = _runs(driver, "handing")
        assert len(runs) == 2 and old.thread.is_alive(), [r.described() for r in runs]  # (stream 1's call hangs)
        assert hanging.unique() == set(_events(db_url, 1)[:5])
        with psycopg.connect(db_url, autocommit=True) as c:
            assert locks.group_lease_state(c, "handing", runs[1].run_id or "") is locks.LeaseState.HELD
        for i in (2, 3):
            insert_events(db_url, i, 5, start=300)
        until("streams 2 and 3 by the successor", lambda: all(len(delivered(i)) == 15 for i in (2, 3)), 15)

        release.set()
        insert_events(db_url, 1, 5, start=400)
        until("stream 1", lambda: hanging.unique() == set(_events(db_url, 1)), 60)
        until("the old run's end", lambda: not old.thread.is_alive(), 30)
        assert hanging.first_seen_order() == _events(db_url, 1)  # every event, in commit order
        for i in (2, 3):
            assert delivered(i) == _events(db_url, i), i  # every event once, in commit order
        _end_group_runs(driver)
    finally:
        release.set()
        hanging.down()


def test_a_members_invalid_entry_leaves_it_out_and_the_group_goes_on_recording_it(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """Streams 1-3 deliver through their group; the code location reloads with stream 2's entry invalid (a
    misspelled sink key). Stream 2 is left out, told in one line by a sensor of its own and at every tick of the
    group's sensor; streams 1 and 3 go on delivering every event once, in commit order; stream 2's events are
    recorded meanwhile (the group's slot never moves past them). Once its entry is fixed, stream 2 delivers what
    it missed, once, in commit order."""
    members = [_member("mixed", i, tmp_path / f"out{i}.jsonl") for i in (1, 2, 3)]
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, members), instance)
    _tick(driver, "mixed")
    skips: list[str | None] = []

    def deliver(ids: tuple[int, ...], each: int) -> None:
        deadline = time.monotonic() + 60
        while not all(len(_delivered(tmp_path, i)) >= each for i in ids):
            assert time.monotonic() < deadline, ({i: len(_delivered(tmp_path, i)) for i in ids}, skips[-3:])
            skips.append(_tick(driver, "mixed"))
            time.sleep(0.1)

    for i in (1, 2, 3):
        insert_events(db_url, i, 10)
    deliver((1, 2, 3), 10)
    broken = [members[0], {**members[1], "sink": {**members[1]["sink"], "colour": "red"}}, members[2]]
    driver.reload(write_config(tmp_path / "pgstream2.yaml", db_url, broken))
    problem = f"{tmp_path / 'pgstream2.yaml'}: streams[1].sink.colour: unknown key (allowed: "
    left_out = driver.defs.resolve_sensor_def(stream_sensor_name(2))  # the left-out stream's own sensor
    told = left_out.evaluate_tick(dg.build_sensor_context(instance=instance, sensor_name=left_out.name)).skip_message
    assert (told or "").startswith(f"stream 2 is left out: its streams[] entry is invalid: {problem}")
    assert "\n" not in (told or "")
    assert not any(str(s.name) == stream_sensor_name(1) for s in driver.defs.sensors or [])  # (members have none)
    deadline = time.monotonic() + 60
    # the run of before is handed over (configuration changed) to a fresh one, and ends
    while len(_runs(driver, "mixed")) < 2 or _runs(driver, "mixed")[0].thread.is_alive():
        assert time.monotonic() < deadline, skips[-3:]
        skips.append(_tick(driver, "mixed"))
        time.sleep(0.1)
    assert _runs(driver, "mixed")[0].wait(10).success
    for wave in range(1, 4):
        for i in (1, 2, 3):
            insert_events(db_url, i, 10, start=100 * wave)
        deliver((1, 3), 10 * (wave + 1))
    deadline = time.monotonic() + 30
    while _recorded(db_url, 2) != _events(db_url, 2):  # recorded meanwhile, in commit order
        assert time.monotonic() < deadline, (_recorded(db_url, 2), _events(db_url, 2))
        skips.append(_tick(driver, "mixed"))
    assert len(_delivered(tmp_path, 2)) == 10  # and not delivered
    line = f"reader group mixed: stream 2 is left out of delivery, its streams[] entry is invalid ({problem}"
    assert any(line in (s or "") for s in skips[-3:]), skips[-3:]
    for i in (1, 3):
        assert _delivered(tmp_path, i) == _events(db_url, i), i
    # fixed: stream 2 delivers what it missed, once, in commit order
    driver.reload(write_config(tmp_path / "pgstream3.yaml", db_url, members))
    deliver((2,), 40)
    for i in (1, 2, 3):
        assert _delivered(tmp_path, i) == _events(db_url, i) == _recorded(db_url, i), i
    _end_group_runs(driver)


class Readers:
    """Every ``consume_group`` call of the group's sensor and of the group delivery run's reader (both wrapped):
    who called it, whether the calling session held the group's reading (``pgstream.locks``) while it read,
    and how many read at once at most."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from pgstream_dagster.defs import jobs, sensors

        self.calls: list[tuple[str, bool]] = []  # (who, the session held the group's reading)
        self.reading = 0
        self.most = 0
        self._guard = threading.Lock()
        monkeypatch.setattr(sensors, "consume_group", self._wrap("sensor", ingest.consume_group))
        monkeypatch.setattr(jobs, "consume_group", self._wrap("run", ingest.consume_group))

    def _wrap(self, who: str, real: Any) -> Any:
        def consume_group(conn: psycopg.Connection, group: str, *args: Any, **kwargs: Any) -> Any:
            row = conn.execute("select pid = pg_backend_pid() from pgstream.locks where name = %s and key = 0",
                               [f"group_reader:{group}"]).fetchone()
            with self._guard:
                self.calls.append((who, bool(row and row[0])))
                self.reading += 1
                self.most = max(self.most, self.reading)
            try:
                return real(conn, group, *args, **kwargs)
            finally:
                with self._guard:
                    self.reading -= 1

        return consume_group

    def by(self, who: str) -> int:
        return sum(1 for w, _ in self.calls if w == who)


def _readers_with_the_run_after_a_tick(monkeypatch: pytest.MonkeyPatch) -> Readers:
    """:class:`Readers`, the group run's reader calling ``consume_group`` for a second at a time (not 5) and
    starting only once a tick of the sensor has begun to read (a run's process starts within a second in the
    daemon's absence: no tick would find the reading free otherwise)."""
    from pgstream_dagster.engine.delivery import group as group_delivery

    monkeypatch.setattr(group_delivery, "READ_SECS", 1.0)
    readers = Readers(monkeypatch)
    reader = group_delivery.GroupDelivery._read

    def after_a_tick_read(self: group_delivery.GroupDelivery) -> None:
        deadline = time.monotonic() + 60
        while readers.by("sensor") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        reader(self)

    monkeypatch.setattr(group_delivery.GroupDelivery, "_read", after_a_tick_read)
    return readers


def _live_group(db_url: str, tmp_path: Path, instance: dg.DagsterInstance, ids: list[int], *,
                tick_budget_secs: float = 0.1) -> Driver:
    """A group ``live`` of streams in mode open (file sinks), its sensor ticked once: its delivery run starts
    (one run throughout the test: max_run_secs 300; the test ends it, :func:`_end_group_runs`)."""
    config = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": i, "reader": "live", "batch": {"max_size": 50, "max_fill_secs": 0},
         "sensor": {"tick_budget_secs": tick_budget_secs},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 300}},
         "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in ids])
    driver = Driver(config, instance)
    _tick(driver, "live")
    assert len(_runs(driver, "live")) == 1
    return driver


def _run_reads(db_url: str, timeout: float = 60, group: str = "live") -> str:
    """Wait until the group delivery run's reader holds the group's reading; its holder."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(db_url, autocommit=True) as c:
        while not (holder := locks.group_reading_holder(c, group) or "").startswith("group delivery run "):
            assert time.monotonic() < deadline, holder
            time.sleep(0.1)
    return holder


def _group_senders(url: str) -> list[tuple[int, str]]:
    """The WAL senders (pg_stat_replication) serving the group's slot: (pid, application_name)."""
    with psycopg.connect(url) as c:
        return [(int(p), str(a)) for p, a in c.execute(
            "select r.pid, r.application_name from pg_stat_replication r join pg_replication_slots s "
            "on s.active_pid = r.pid where s.slot_name = (select slot from pgstream.reader_groups) order by 1")]


def _delivered(tmp_path: Path, i: int) -> list[int]:
    path = tmp_path / f"out{i}.jsonl"
    return [e["id"] for e in read_jsonl(path)] if path.exists() else []


def test_a_live_group_runs_reader_records_continuously_and_the_sensor_reads_nothing(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the group delivery run lives, its reader reads the group's slot itself: events committed now reach
    the members' sinks (each once, in commit order); the group's sensor keeps deciding for the members, and its
    ticks read nothing and say who reads."""
    readers = Readers(monkeypatch)
    ids = [1, 2, 3]
    driver = _live_group(db_url, tmp_path, instance, ids)
    holder = _run_reads(db_url)
    (run,) = instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(db_url, "live")}))
    assert holder == f"group delivery run {run.run_id}"  # named after the run holding it
    ticks = readers.by("sensor")
    for wave in range(3):
        for i in ids:
            insert_events(db_url, i, 10, start=100 * wave)
    deadline = time.monotonic() + 30
    while not all(len(_delivered(tmp_path, i)) >= 30 for i in ids):
        assert time.monotonic() < deadline, {i: len(_delivered(tmp_path, i)) for i in ids}
        skipped = _tick(driver, "live")  # the group's sensor decides for the members: the run reads, the tick does not
        assert skipped is not None and skipped.startswith(f"read nothing: {holder} reads the group's slot"), skipped
        time.sleep(0.1)
    # one WAL sender serves the group's slot: the run's reader, over the replication protocol
    assert [a for _, a in _group_senders(db_url)] == [f"pgstream group slot reader {run.run_id}"]
    assert readers.by("sensor") == ticks
    for i in ids:
        assert _delivered(tmp_path, i) == _events(db_url, i), i  # every event once, in commit order
        assert _recorded(db_url, i) == _events(db_url, i), i
    assert readers.by("run") > 0 and all(held for _, held in readers.calls) and readers.most == 1
    _end_group_runs(driver)


def test_a_batch_the_group_runs_reader_records_for_a_member_without_a_run_gets_its_run_within_the_tick(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """The group run's reader records the first batch of a member that has no run yet while the group's tick is
    under way: the tick sees the batch waiting and decides its run within a second, not at the group's next tick
    (an interval later); the events reach the sink once, in order."""
    driver = _live_group(db_url, tmp_path, instance, [1, 2], tick_budget_secs=4.0)
    _run_reads(db_url)
    ticked: dict[str, Any] = {}

    def tick() -> None:
        started = time.monotonic()
        ticked["skip"] = _tick(driver, "live")
        ticked["secs"] = time.monotonic() - started

    during = threading.Thread(target=tick)
    during.start()
    time.sleep(1.0)  # the tick has decided once: nothing was waiting then
    insert_events(db_url, 2, 3)
    during.join(30)
    assert not during.is_alive() and ticked["secs"] < 6, ticked
    with psycopg.connect(db_url) as c:
        waited = c.execute("select extract(epoch from launched_at - created_at) from pgstream.batches "
                           "where stream_id = 2 order by id").fetchall()
    assert waited and all(w is not None and float(w) < 1.5 for (w,) in waited), waited
    deadline = time.monotonic() + 30
    while _delivered(tmp_path, 2) != _events(db_url, 2):
        assert time.monotonic() < deadline, _delivered(tmp_path, 2)
        time.sleep(0.1)
    assert _delivered(tmp_path, 1) == []
    _end_group_runs(driver)


def test_the_sensor_reads_again_once_the_group_runs_reader_connection_dies_and_nothing_is_lost(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group run's reader connection terminated (as when its process is killed -9): the group's reading is
    freed with its session, the sensor's next tick reads what committed meanwhile; the run's reader takes the
    reading back later; every event arrives, in commit order."""
    from pgstream_dagster.engine.delivery import group as group_delivery

    monkeypatch.setattr(group_delivery, "READ_ERROR_SECS", 3.0)
    readers = Readers(monkeypatch)
    ids = [1, 2]
    driver = _live_group(db_url, tmp_path, instance, ids)
    holder = _run_reads(db_url)
    for i in ids:
        insert_events(db_url, i, 10)
    with psycopg.connect(db_url, autocommit=True) as c:
        wait = time.monotonic() + 30
        while not all(len(_recorded(db_url, i)) == 10 for i in ids):
            assert time.monotonic() < wait
            time.sleep(0.05)
        terminated = c.execute("select pg_terminate_backend(pid) from pg_stat_activity where application_name = %s",
                               ["pgstream group reader " + holder.removeprefix("group delivery run ")]).fetchall()
        assert terminated == [(True,)]
        wait = time.monotonic() + 10
        # freed with the reader's session (and the run's reader has seen its connection end)
        while locks.group_reading_holder(c, "live") is not None or readers.reading:
            assert time.monotonic() < wait
            time.sleep(0.05)
    for i in ids:
        insert_events(db_url, i, 10, start=100)
    ticks = readers.by("sensor")
    skipped = _tick(driver, "live")  # the run's reader waits before it connects again: the sensor reads
    assert skipped is not None and skipped.startswith("recorded 20 events for 2 of 2 streams"), skipped
    assert readers.by("sensor") == ticks + 1
    assert _run_reads(db_url) == holder  # the run's reader reads again
    for i in ids:
        insert_events(db_url, i, 10, start=200)
    deadline = time.monotonic() + 30
    while not all(len(_delivered(tmp_path, i)) >= 30 for i in ids):
        assert time.monotonic() < deadline, {i: len(_delivered(tmp_path, i)) for i in ids}
        time.sleep(0.1)
    for i in ids:
        assert _delivered(tmp_path, i) == _events(db_url, i), i
        assert _recorded(db_url, i) == _events(db_url, i), i
    assert all(held for _, held in readers.calls) and readers.most == 1
    _end_group_runs(driver)


def test_the_group_runs_reader_keeps_one_wal_sender_across_its_reads_and_one_killed_loses_nothing(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group run's reader reads the group's slot over one replication connection, kept across its calls
    (many here, a second each): exactly one WAL sender serves the group's slot, the same one, while events are
    recorded. Its WAL sender terminated while events commit: the reader opens a new one, from the slot's
    confirmed position; every event reaches the members' ledgers and sinks once, in commit order."""
    from pgstream_dagster.engine.delivery import group as group_delivery

    monkeypatch.setattr(group_delivery, "READ_SECS", 1.0)
    monkeypatch.setattr(group_delivery, "READ_ERROR_SECS", 2.0)
    readers = Readers(monkeypatch)
    ids = [1, 2]
    driver = _live_group(db_url, tmp_path, instance, ids)
    holder = _run_reads(db_url)
    name = "pgstream group slot reader " + holder.removeprefix("group delivery run ")
    deadline = time.monotonic() + 30
    while not (senders := _group_senders(db_url)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    calls = readers.by("run")
    for wave in range(4):
        for i in ids:
            insert_events(db_url, i, 5, start=10 * wave)
        _tick(driver, "live")  # (it decides for the members; it reads only while the run's reader does not)
        time.sleep(0.8)
    deadline = time.monotonic() + 30
    while not all(len(_recorded(db_url, i)) == 20 for i in ids):
        assert time.monotonic() < deadline, {i: len(_recorded(db_url, i)) for i in ids}
        time.sleep(0.1)
    assert readers.by("run") >= calls + 2  # several calls of the reader ...
    assert _group_senders(db_url) == senders and [a for _, a in senders] == [name]  # ... one WAL sender all along

    (pid, _name), = senders
    for i in ids:
        insert_events(db_url, i, 10, start=100)
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
    for i in ids:
        insert_events(db_url, i, 10, start=200)
    deadline = time.monotonic() + 30
    while not ((now := _group_senders(db_url)) and now[0][0] != pid):  # it comes back
        assert time.monotonic() < deadline, now
        _tick(driver, "live")  # (it decides for the members; it reads only while the run's reader does not)
        time.sleep(0.2)
    assert [a for _, a in now] == [name]
    for i in ids:
        insert_events(db_url, i, 10, start=300)
    deadline = time.monotonic() + 60
    while not all(len(_delivered(tmp_path, i)) >= 50 for i in ids):
        assert time.monotonic() < deadline, {i: len(_delivered(tmp_path, i)) for i in ids}
        _tick(driver, "live")  # (it decides for the members; it reads only while the run's reader does not)
        time.sleep(0.1)
    for i in ids:
        assert len(_events(db_url, i)) == 50
        assert _delivered(tmp_path, i) == _events(db_url, i), i  # every event once, in commit order
        assert _recorded(db_url, i) == _events(db_url, i), i
    assert all(held for _, held in readers.calls) and readers.most == 1
    _end_group_runs(driver)


def test_the_sensors_tick_and_the_group_runs_reader_never_read_at_once(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly one reader of the group's slot: the group's sensor ticking without pause while its delivery run
    starts and reads (each taking the group's reading for what it reads), events committing all along: never
    two ``consume_group`` at once, each by the session holding the group's reading."""
    readers = _readers_with_the_run_after_a_tick(monkeypatch)
    ids = [1, 2]
    driver = _live_group(db_url, tmp_path, instance, ids)
    deadline = time.monotonic() + 60
    wave = 0
    while readers.by("run") < 5 or wave < 10:
        assert time.monotonic() < deadline, readers.calls[-5:]
        for i in ids:
            insert_events(db_url, i, 3, start=10 * wave)
        wave += 1
        _tick(driver, "live")
    assert readers.by("sensor") >= 1 and readers.by("run") >= 5
    assert all(held for _, held in readers.calls) and readers.most == 1, readers.calls
    deadline = time.monotonic() + 30
    while not all(len(_delivered(tmp_path, i)) >= 3 * wave for i in ids):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for i in ids:
        assert _delivered(tmp_path, i) == _events(db_url, i), i
    _end_group_runs(driver)


def test_a_tick_leaves_the_slot_to_a_group_run_whose_reader_starts_during_it(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group run that starts (one taking over from another, or back from an error) reads the group's slot at the
    first slice boundary of a tick that found the reading free, not once the tick (``tick_budget_secs``, 8 s here)
    has ended: with a group run started, the tick leaves the reading free between its slices long enough for the
    run's reader, which tries every READ_RETRY_SECS; a run still starting when the tick began (its Dagster status
    shows it started only once the tick reads, here) is looked at again after each slice. The sensor read once;
    every event arrives once, in order."""
    readers = _readers_with_the_run_after_a_tick(monkeypatch)
    handle_new_event = instance.handle_new_event

    def started_once_the_tick_reads(event: Any, **kwargs: Any) -> None:
        if event.is_dagster_event and event.get_dagster_event().event_type == dg.DagsterEventType.RUN_START:
            deadline = time.monotonic() + 60
            while readers.by("sensor") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        handle_new_event(event, **kwargs)

    monkeypatch.setattr(instance, "handle_new_event", started_once_the_tick_reads)
    ids = [1, 2]
    driver = _live_group(db_url, tmp_path, instance, ids, tick_budget_secs=8)
    for i in ids:
        insert_events(db_url, i, 5)
    _tick(driver, "live")  # 8 s: it reads a slice, then the run's reader takes over
    assert readers.by("sensor") == 1 and readers.by("run") >= 1, readers.calls
    assert readers.most == 1 and all(held for _, held in readers.calls), readers.calls
    for i in ids:
        insert_events(db_url, i, 5, start=100)
    deadline = time.monotonic() + 30
    while not all(len(_delivered(tmp_path, i)) >= 10 for i in ids):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for i in ids:
        assert _delivered(tmp_path, i) == _events(db_url, i), i
    _end_group_runs(driver)


def test_a_group_run_whose_server_goes_away_fails_in_one_line(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group delivery run's server going away mid-run (a crash, a failover) fails the run with one line
    saying so, not a traceback; the group's sensor requests a fresh one as for any dead group run."""
    from pgstream_dagster.engine.delivery.group import GroupDelivery

    def gone(self: GroupDelivery) -> str:
        raise psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly")

    monkeypatch.setattr(GroupDelivery, "run", gone)
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [_member("lost", 1, tmp_path / "o.jsonl")]),
                    instance)
    result = driver.execute(dg.RunRequest(run_key="lost-1", job_name=GROUP_DELIVERY_JOB,
                                          run_config={"ops": {"deliver_group": {"config": {"group": "lost"}}}},
                                          tags={GROUP_TAG: group_tag_of(db_url, "lost")}))
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.step_failure_data.error.message if failure.step_failure_data.error else ""
    (line,) = message.strip().splitlines()  # one line, Dagster's Failure: no traceback of ours
    assert line.endswith(
        ": reader group lost: the primary is gone (a crash, a restart or a failover), waiting for it: consuming input "
        "failed: server closed the connection unexpectedly; the group's sensor requests a fresh group run"), message
