"""The streaming core against a real slot, real Dagster instance storage and real runs on Spark."""

from __future__ import annotations

import datetime as dt
import json
import random
import struct
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.config import DEFAULT_READER
from pgstream_dagster.defs.names import deliveries_asset_key
from pgstream_dagster.engine import replication
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.ledger import groups
from pgstream_dagster.engine.status import stream_status
from pgstream_dagster.sinks import MemorySink

from .support.harness import Driver, event_ids, insert_events, read_jsonl, slot_of, tick_until, values, write_config

#: the reader group of a stream that names none: its slot and publication are the stream's
PUBLICATION = groups.group_publication(DEFAULT_READER)


#: a stream whose runs are Dagster runs of their own (requested by its group's sensor), reading the ledger's events
#: from the table (not through PySpark: mode per_batch's default)
PER_BATCH = {"mode": "per_batch", "tuning": {"direct_max_events": 1000}}


def _joined(driver: Driver, url: str, stream_id: int) -> None:
    """Tick the stream's group until the group's slot exists and the stream has joined it (what a stream's
    first tick did at once when it read a slot of its own): what commits from then on is read from the slot."""
    def ready() -> bool:
        with psycopg.connect(url) as c:
            state = groups.group_state(c, driver.group_of(stream_id))
            return (state is not None and replication.slot_info(c, state.slot) is not None
                    and any(m.id == stream_id and m.joined for m in state.members))
    tick_until(driver, stream_id, ready, timeout=60)


def test_decoder_returns_transactions_in_commit_order(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1), pgstream.ensure_stream(2)")
        replication.create_slot(c, slot_of(db_url, 1))
    first = psycopg.connect(db_url)
    second = psycopg.connect(db_url)
    (low,) = first.execute("insert into pgstream.events (payload, stream_id) "
                           "values ('{\"who\": \"first\"}', 1) returning id").fetchone()  # type: ignore[misc]
    (high,) = second.execute("insert into pgstream.events (payload, stream_id) "
                             "values ('{\"who\": \"second\"}', 1) returning id").fetchone()  # type: ignore[misc]
    assert low < high
    second.commit()  # the higher id commits first
    first.commit()
    first.close()
    second.close()
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into pgstream.events (payload, stream_id) values ('{}', 2)")  # other stream: filtered
        txns = replication.peek_rows(c, slot_of(db_url, 1), "pgstream_stream_1", 100)[0]
        ids = [e.id for t in txns for e in t.events]
        assert ids == [high, low]
        created: dict[Any, Any] = dict(c.execute("select id, created_at from pgstream.events "
                                                 "where stream_id = 1").fetchall())
        assert [e.created_at for t in txns for e in t.events] == [created[high], created[low]]
        assert txns[0].commit_lsn < txns[1].commit_lsn
        replication.advance(c, slot_of(db_url, 1), txns[-1].end_lsn)
        assert [t for t in replication.peek_rows(c, slot_of(db_url, 1), "pgstream_stream_1", 100)[0] if t.events] == []


def _relation(rel_id: int, columns: list[str]) -> bytes:
    body = b"".join(b"\x00" + name.encode() + b"\x00" + struct.pack("!Ii", 20, -1) for name in columns)
    return b"R" + struct.pack("!I", rel_id) + b"pgstream\x00events\x00d" + struct.pack("!h", len(columns)) + body


def _insert(rel_id: int, values: list[str | bytes | None]) -> bytes:
    raw = [v if v is None or isinstance(v, bytes) else v.encode() for v in values]
    cols = b"".join(b"n" if v is None else b"t" + struct.pack("!i", len(v)) + v for v in raw)
    return b"I" + struct.pack("!I", rel_id) + b"N" + struct.pack("!h", len(values)) + cols


def test_decoder_reads_id_and_created_at_wherever_the_relation_puts_them() -> None:
    """Column positions come from the Relation message (any order, other columns and NULLs in
    between); a value is parsed once per distinct text; feed() and decode() agree."""
    begin = b"B" + struct.pack("!qqI", 100, 0, 7)
    commit = b"C" + struct.pack("!bqqq", 0, 100, 120, 0)
    messages = [
        begin,
        _relation(16400, ["metadata", "created_at", "stream_id", "id", "payload"]),
        _insert(16400, [None, "2026-11-22 10:00:00.5+00", "3", "41", "{}"]),
        _insert(16400, ['{"a": 1}', "2026-11-22 10:00:00.5+00", None, "42", None]),
        _insert(16400, [None, "2026-11-22 11:00:00+01", "3", "40", None]),
        _relation(16401, ["id", "created_at"]),  # a second relation (e.g. a partition)
        _insert(16401, ["43", "2026-11-22 10:00:01.000123+00"]),
        commit,
        b"B" + struct.pack("!qqI", 130, 0, 8), b"C" + struct.pack("!bqqq", 0, 130, 140, 0),  # empty
    ]
    utc = dt.UTC
    expected = [(41, dt.datetime(2026, 11, 22, 10, 0, 0, 500000, tzinfo=utc)),
                (42, dt.datetime(2026, 11, 22, 10, 0, 0, 500000, tzinfo=utc)),
                (40, dt.datetime(2026, 11, 22, 10, 0, 0, tzinfo=utc)),
                (43, dt.datetime(2026, 11, 22, 10, 0, 1, 123, tzinfo=utc))]
    txns = replication.PgOutputDecoder().decode(messages)
    assert [(t.xid, t.commit_lsn, t.end_lsn) for t in txns] == [(7, 100, 120), (8, 130, 140)]
    assert [(e.id, e.created_at) for e in txns[0].events] == expected and txns[1].events == []
    one_by_one = replication.PgOutputDecoder()
    fed = [t for t in (one_by_one.feed(m) for m in messages) if t is not None]
    assert [(e.id, e.created_at) for t in fed for e in t.events] == expected
    # in parts: the decoder keeps the open transaction and the relations between calls
    split = replication.PgOutputDecoder()
    assert split.decode(messages[:3]) == []
    assert [(e.id, e.created_at) for t in split.decode(messages[3:]) for e in t.events] == expected
    # an id or created_at that is NULL (cannot happen for pgstream.events) is an error, not a guess
    with pytest.raises(ValueError, match="without id or created_at"):
        replication.PgOutputDecoder().decode([begin, _relation(1, ["id", "created_at"]), _insert(1, ["1", None])])


def test_decoder_keeps_payload_and_metadata_text_within_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """With keep_rows, an INSERT's payload and metadata come as the text the WAL carries (a relation without them,
    an earlier version's publication: none); a payload over KEEP_ROW_BYTES, or one decoded once KEEP_BUDGET_BYTES
    were kept since the last recording, comes without (read from the table); recorded() makes room again."""
    monkeypatch.setattr(replication, "KEEP_ROW_BYTES", 20)
    monkeypatch.setattr(replication, "KEEP_BUDGET_BYTES", 25)
    begin = b"B" + struct.pack("!qqI", 100, 0, 7)
    commit = b"C" + struct.pack("!bqqq", 0, 100, 120, 0)
    ts = "2026-11-22 10:00:00+00"
    decoder = replication.PgOutputDecoder(keep_stream=True, keep_rows=True)
    (txn,) = decoder.decode([
        begin, _relation(1, ["id", "payload", "metadata", "stream_id", "created_at"]),
        _insert(1, ["1", '{"a": "\u00e9"}', None, "3", ts]),  # 11 bytes kept
        _insert(1, ["2", '{"big": "' + "x" * 30 + '"}', '{"m": 1}', "3", ts]),  # over KEEP_ROW_BYTES
        _insert(1, ["3", '{"b": 2}', '{"m": 1}', "3", ts]),  # 16 bytes kept: 27 in all
        _insert(1, ["4", '{"c": 3}', None, "3", ts]),  # the budget is spent
        _relation(2, ["id", "stream_id", "created_at"]),  # an earlier version's publication
        _insert(2, ["5", "3", ts]),
        commit])
    assert [(e.id, e.stream_id, e.payload, e.metadata) for e in txn.events] == [
        (1, 3, '{"a": "\u00e9"}', None), (2, 3, None, None), (3, 3, '{"b": 2}', '{"m": 1}'), (4, 3, None, None),
        (5, 3, None, None)]
    decoder.recorded()
    (again,) = decoder.decode([begin, _insert(1, ["6", '{"d": 4}', None, "3", ts]), commit])
    assert [(e.id, e.payload) for e in again.events] == [(6, '{"d": 4}')]
    # without keep_rows (the sensor's peek) nothing is kept
    (peeked,) = replication.PgOutputDecoder(keep_stream=True).decode(
        [begin, _relation(1, ["id", "payload", "metadata", "stream_id", "created_at"]),
         _insert(1, ["1", "{}", None, "3", ts]), commit])
    assert [(e.id, e.payload) for e in peeked.events] == [(1, None)]


def test_tick_records_batches_and_rerun_requests_nothing_twice(db_url: str, tmp_path: Path,
                                                               instance: dg.DagsterInstance) -> None:
    """A stream in mode per_batch (a Dagster run of its own per decision, requested by its group's sensor, which
    reads the group's slot while no group run does): the tick records batches and releases the WAL, one run takes
    every pending batch, and a tick evaluated again requests the same run key only."""
    out = tmp_path / "sink.jsonl"
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 10, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 1},
         "delivery": PER_BATCH, "sink": {"type": "file", "path": str(out)}}])
    driver = Driver(cfg, instance)
    _joined(driver, db_url, 1)  # the group's slot, read by its sensor
    assert not driver.group_runs  # (a group of per_batch streams has no group run)
    before = driver.cursors[DEFAULT_READER]
    insert_events(db_url, 1, 25)
    tick = driver.tick(1)
    with psycopg.connect(db_url) as c:
        (inc,) = c.execute("select incarnation from pgstream.streams where id = 1").fetchone() or ()
    # adaptive batching: one run takes every pending batch (up to max_events_per_run)
    assert [r.run_key for r in tick.run_requests] == [f"pgstream-s1-{inc}-b1-3-a1"], tick.skip_message
    with psycopg.connect(db_url) as c:
        rows = c.execute("select id, event_count, status from pgstream.batches order by id").fetchall()
        assert rows == [(1, 10, BatchStatus.LAUNCHED), (2, 10, BatchStatus.LAUNCHED), (3, 5, BatchStatus.LAUNCHED)]
        # WAL released at once: nothing left in the slot
        assert [t for t in replication.peek_rows(c, slot_of(db_url, 1), PUBLICATION, 100)[0] if t.events] == []
    # re-evaluating (the same cursor, as after a crash of the tick) asks for the same run key only
    driver.cursors[DEFAULT_READER] = before
    again = driver.tick(1)
    assert [r.run_key for r in again.run_requests] == [f"pgstream-s1-{inc}-b1-3-a1"]
    assert driver.execute(tick.run_requests[0]).success
    insert_events(db_url, 1, 3)
    again2 = driver.tick(1)
    assert [r.run_key for r in again2.run_requests] == [f"pgstream-s1-{inc}-b4-a1"]
    cursor = json.loads(driver.cursors[DEFAULT_READER] or "{}")
    ids = event_ids(db_url, 1)
    assert cursor["members"]["1"]["last_event_id"] == ids[-1] and len(ids) == 28
    assert [e["id"] for e in read_jsonl(out)] == ids[:25]


def _commit_in_shuffled_order(url: str, rounds: int, conns: int, per_txn: int, seed: int = 7) -> list[int]:
    """Open ``conns`` transactions, insert into each (ids are allocated now, in open order), then
    commit them in a shuffled order. Returns every id in commit order: the order delivery owes."""
    rng = random.Random(seed)
    order: list[int] = []
    pool = [psycopg.connect(url) for _ in range(conns)]
    try:
        for r in range(rounds):
            ids_of: dict[int, list[int]] = {}
            for i, conn in enumerate(pool):
                rows = conn.execute(
                    "insert into pgstream.events (payload, stream_id) "
                    "select jsonb_build_object('round', %s::int, 'txn', %s::int, 'n', g), 1 "
                    "from generate_series(1, %s::int) g returning id", [r, i, per_txn]).fetchall()
                ids_of[i] = [row[0] for row in rows]
            sequence = list(range(conns))
            rng.shuffle(sequence)
            for i in sequence:
                pool[i].commit()
                order.extend(ids_of[i])
    finally:
        for conn in pool:
            conn.close()
    return order


def test_end_to_end_10k_events_in_commit_order(db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    out = tmp_path / "sink.jsonl"
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 2500, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 1},
         "sink": {"type": "file", "path": str(out)}}])
    driver = Driver(cfg, instance)
    _joined(driver, db_url, 1)
    # 10,000 events in 200 transactions, 5 open at a time, committed out of id order; meanwhile a
    # second writer commits concurrently from another thread
    background: list[int] = []
    writer = threading.Thread(target=lambda: background.extend(
        _commit_in_shuffled_order(db_url, rounds=10, conns=2, per_txn=50, seed=3)))
    writer.start()
    expected_main = _commit_in_shuffled_order(db_url, rounds=40, conns=4, per_txn=50)
    writer.join()
    assert len(expected_main) + len(background) == 9000
    _commit_in_shuffled_order(db_url, rounds=5, conns=4, per_txn=50, seed=11)  # 1,000 more

    with psycopg.connect(db_url) as c:
        total = c.execute("select count(*) from pgstream.events where stream_id = 1").fetchall()[0][0]
    assert total == 10_000

    def all_delivered() -> bool:
        return bool(len(read_jsonl(out)) >= total)

    started = time.monotonic()
    driver.run_until(1, all_delivered, timeout=600)
    elapsed = time.monotonic() - started
    delivered = [e["id"] for e in read_jsonl(out)]
    assert len(delivered) == len(set(delivered)) == total  # nothing lost, nothing twice
    # commit order: each writer's own commit sequence is a subsequence of what the sink got
    position = {eid: i for i, eid in enumerate(delivered)}
    for sequence in (expected_main, background):
        assert [position[e] for e in sequence] == sorted(position[e] for e in sequence)
    assert delivered != sorted(delivered)  # the test really committed out of id order
    # and it is exactly the WAL commit order recorded in the ledger
    with psycopg.connect(db_url) as c:
        ledger_order = [r[0] for r in c.execute(
            "select unnest(event_ids) from pgstream.batches where stream_id = 1 order by id")]
        assert c.execute("select count(*) from pgstream.batches where status <> %s",
                         [BatchStatus.DELIVERED]).fetchone() == (0,)
    assert delivered == ledger_order
    runs = {r.run_id for r in driver.results}  # (the group delivery runs: their member runs materialize the stream's)
    driver.stop_group_runs()
    runs |= {r.run_id for r in driver.results}
    materializations = [m for m in instance.fetch_materializations(deliveries_asset_key(1), limit=1000).records
                        if m.run_id in runs]  # the instance storage is shared by the tests
    events = [values(a.metadata)["events"] for m in materializations if (a := m.asset_materialization) is not None]
    assert len(events) == len(materializations) and sum(events) == total
    print(f"\n10k e2e: {total} events in {elapsed:.1f}s = {total / elapsed:.0f} events/s "
          f"({len(driver.results)} runs, in-process)")


def test_failed_batch_is_retried_and_never_overtaken(db_url: str, tmp_path: Path,
                                                     instance: dg.DagsterInstance) -> None:
    """A stream in mode per_batch (its runs are Dagster runs of their own, requested by its group's sensor)."""
    MemorySink.reset("retry")
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 5, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         "retry": {"initial_backoff_secs": 0, "max_backoff_secs": 0}, "delivery": PER_BATCH,
         "sink": {"type": "memory", "name": "retry", "fail_times": 2}}])
    driver = Driver(cfg, instance)
    driver.tick(1)
    insert_events(db_url, 1, 15)
    first = driver.tick(1)
    failed = driver.execute(first.run_requests[0])
    assert not failed.success
    # a run for the *next* batch is refused while the first is undelivered
    with psycopg.connect(db_url) as c:
        (inc,) = c.execute("select incarnation from pgstream.streams where id = 1").fetchone() or ()
    sneaky = dg.RunRequest(run_key="sneaky", run_config={"ops": {"load_batches": {"config": {
        "stream_id": 1, "batch_id": 2}}}}, tags={})
    refused = driver.execute(sneaky)
    assert not refused.success
    assert "would overtake open batch 1" in str(refused.all_events)
    # launched by hand without its batches (the Launchpad): refused before it starts, naming the key
    with pytest.raises(dg.DagsterInvalidConfigError, match="batch_id"):
        driver.execute(dg.RunRequest(run_key="by-hand", run_config={"ops": {"load_batches": {"config": {
            "stream_id": 1}}}}, tags={}))
    driver.run_until(1, lambda: len(MemorySink.delivered("retry")) >= 15, timeout=120)
    assert [e.id for e in MemorySink.delivered("retry")] == event_ids(db_url, 1)
    with psycopg.connect(db_url) as c:
        rows = c.execute("select id, status, attempts, run_key from pgstream.batches order by id").fetchall()
    # run 1 took batches 1-3 and failed; batch 1 was probed alone twice (failover) and the
    # backlog 2-3 went in one run
    assert [(r[0], r[1], r[2]) for r in rows] == [(1, BatchStatus.DELIVERED, 3), (2, BatchStatus.DELIVERED, 2),
                                                  (3, BatchStatus.DELIVERED, 2)]
    assert rows[0][3] == f"pgstream-s1-{inc}-b1-a3"
    assert rows[1][3] == rows[2][3] == f"pgstream-s1-{inc}-b2-3-a2"
    driver.tick(1)  # caught up: failover over
    with psycopg.connect(db_url) as c:
        stream = c.execute("select failover_since, failover_attempts from pgstream.streams where id = 1").fetchone()
        history = c.execute("select checkpoint_batch_id, checkpoint_event_id, attempts, ended_at is not null "
                            "from pgstream.failovers").fetchall()
    assert stream == (None, 0)
    assert history == [(1, event_ids(db_url, 1)[0], 2, True)]


def test_events_written_before_the_slot_existed_are_recovered(db_url: str, tmp_path: Path,
                                                              instance: dg.DagsterInstance) -> None:
    """30 events committed before the group's slot exists are recovered from the table; 20 committed as it is
    created (and its members recovered) are delivered too: every one once."""
    MemorySink.reset("recover")
    with psycopg.connect(db_url) as c:
        c.execute("select pgstream.ensure_stream(1)")
    insert_events(db_url, 1, 30)
    before = event_ids(db_url, 1)
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 100, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         "sink": {"type": "memory", "name": "recover"}}])
    driver = Driver(cfg, instance)

    def insert_once_the_slot_exists() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with psycopg.connect(db_url) as c:
                state = groups.group_state(c, DEFAULT_READER)
                if state is not None and replication.slot_info(c, state.slot) is not None:
                    break
            time.sleep(0.01)
        insert_events(db_url, 1, 20, 100)

    insert_after = threading.Thread(target=insert_once_the_slot_exists)
    insert_after.start()
    driver.tick(1)  # the group run's reader creates the slot and recovers the 30 from the table
    driver.run_until(1, lambda: len(MemorySink.delivered("recover")) >= 50, timeout=120)
    insert_after.join()
    ids = [e.id for e in MemorySink.delivered("recover")]
    assert sorted(ids) == event_ids(db_url, 1) and len(ids) == 50
    with psycopg.connect(db_url) as c:
        recovered = {r[0] for r in c.execute("select unnest(event_ids) from pgstream.batches where kind = 'recovery'")}
    assert set(before) <= recovered


def test_paused_stream_keeps_releasing_wal_but_launches_nothing(db_url: str, tmp_path: Path,
                                                                instance: dg.DagsterInstance) -> None:
    from pgstream_dagster.cli import main as cli_main

    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 10, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         "sink": {"type": "memory", "name": "paused"}}])
    MemorySink.reset("paused")
    driver = Driver(cfg, instance)
    _joined(driver, db_url, 1)
    assert cli_main(["pause", "1", "--database-url", db_url]) == 0
    insert_events(db_url, 1, 10)

    def recorded() -> bool:
        with psycopg.connect(db_url) as c:
            (status,) = stream_status(c, 1)
            return (status["undelivered_batches"], status["undelivered_events"]) == (1, 10)

    with psycopg.connect(db_url) as c:
        (written,) = c.execute("select pg_current_wal_lsn()::text").fetchone() or ()

    def released() -> bool:  # the group's slot moved past the events (the group run's reader holds it: no peek)
        with psycopg.connect(db_url) as c:
            (lsn,) = c.execute("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                               [slot_of(db_url, 1)]).fetchone() or ()
        return replication.lsn_to_int(lsn) >= replication.lsn_to_int(written)

    tick_until(driver, 1, lambda: recorded() and released(), timeout=60)  # recorded while paused, WAL released
    for _ in range(3):  # the group's sensor decides for it at each tick: nothing is launched
        assert not driver.tick(1).run_requests
    with psycopg.connect(db_url) as c:
        assert c.execute("select status from pgstream.batches").fetchall() == [(BatchStatus.PENDING,)]
    assert MemorySink.delivered("paused") == []
    assert cli_main(["resume", "1", "--database-url", db_url]) == 0
    tick_until(driver, 1, lambda: len(MemorySink.delivered("paused")) >= 10, timeout=60)
    assert [e.id for e in MemorySink.delivered("paused")] == event_ids(db_url, 1)


def test_by_key_delivery_keeps_order_per_routing_key(db_url: str, tmp_path: Path,
                                                     instance: dg.DagsterInstance) -> None:
    out = tmp_path / "by_key.jsonl"
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         "delivery": {"ordering": "by_key", "routing_key": "group_id", "parallelism": 3, "chunk_size": 7},
         "sink": {"type": "file", "path": str(out)}}])
    driver = Driver(cfg, instance)
    _joined(driver, db_url, 1)
    with psycopg.connect(db_url) as c:
        c.execute("insert into pgstream.events (payload, stream_id) "
                  "select jsonb_build_object('group_id', (g % 5)::text, 'n', g), 1 from generate_series(1, 300) g")
    driver.run_until(1, lambda: len(read_jsonl(out)) >= 300, timeout=180)
    got = read_jsonl(out)
    assert sorted(e["id"] for e in got) == event_ids(db_url, 1) and len(got) == 300
    for key in map(str, range(5)):
        ids = [e["id"] for e in got if e["payload"]["group_id"] == key]
        assert ids == sorted(ids) and len(ids) == 60


def test_tick_skips_other_tables_wal_without_losing_events(db_url: str, tmp_path: Path,
                                                           instance: dg.DagsterInstance) -> None:
    """A read that finds nothing of the group's streams moves the group's slot past the WAL it read (other tables,
    other streams), so the next read does not decode it again; events committed meanwhile stay."""
    out = tmp_path / "sink.jsonl"
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 100, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
         "sink": {"type": "file", "path": str(out)}}])
    driver = Driver(cfg, instance)
    _joined(driver, db_url, 1)

    def confirmed() -> int:
        with psycopg.connect(db_url) as c:
            (lsn,) = c.execute("select confirmed_flush_lsn::text from pg_replication_slots "
                               "where slot_name = %s", [slot_of(db_url, 1)]).fetchone() or ()
        return replication.lsn_to_int(lsn)

    before = confirmed()
    with psycopg.connect(db_url) as c:
        c.execute("create table public.noise (id bigint)")
        c.execute("insert into public.noise select generate_series(1, 20000)")
        c.execute("select pgstream.ensure_stream(2)")
        c.commit()
        insert_events(db_url, 2, 500)  # another stream's events: filtered out by the publication
        (written,) = c.execute("select pg_current_wal_lsn()::text").fetchone() or ()
    tick_until(driver, 1, lambda: confirmed() >= replication.lsn_to_int(written), timeout=60)
    assert confirmed() > before
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.batches").fetchone() == (0,)
    insert_events(db_url, 1, 7)
    driver.run_until(1, lambda: len(read_jsonl(out)) >= 7)
    assert [e["payload"]["n"] for e in read_jsonl(out)] == list(range(7))
