"""The ingest stage (engine/ingest/): one recording loop and one batching rule for both sources (a peek, the
replication protocol); a reader backs off while another connection still holds its slot; a recording pass
records several streams' ledgers in one transaction, each only while the pass is the stream's declared
reader (``pgstream.streams.slot_reader``)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgstream_dagster.config import StreamConfig, load_config
from pgstream_dagster.engine import handoff, ingest, replication
from pgstream_dagster.engine.delivery.sources import TableSource
from pgstream_dagster.engine.ingest import recorder, source
from pgstream_dagster.engine.ingest.recorder import Batching, Pending
from pgstream_dagster.engine.ledger import deadletters as deadletters_ledger
from pgstream_dagster.engine.ledger import groups, recording, streams
from pgstream_dagster.engine.ledger import state as ledger_state
from pgstream_dagster.engine.publish import Span, TooLarge
from pgstream_dagster.engine.replication import DecodedEvent, Transaction

from .support.harness import insert_events, slot_of, write_config
from .support.legacy_streams import ensure_stream

RUN_KEY = "test-run"
NOW = dt.datetime(2026, 3, 4, 12, 0, 0, tzinfo=dt.UTC)


def _streams(tmp_path: Path, url: str, batch: dict[str, Any], ids: tuple[int, ...] = (1,),
             readers: dict[int, str] | None = None, own_slots: bool = True) -> list[StreamConfig]:
    """The streams (each in reader group ``readers[id]``, default ``default``); ``own_slots``: each with a slot
    of its own, outside any group, as a version with a slot per stream made it."""
    config = load_config(write_config(tmp_path / "pgstream.yaml", url, [
        {"id": i, "batch": batch, "delivery": {"mode": "open"},
         "reader": (readers or {}).get(i, "default"),
         "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in ids]))
    if own_slots:
        with psycopg.connect(url, autocommit=True) as c:
            for stream in config.streams:
                replication.create_slot(c, ensure_stream(c, stream.id))
    return list(config.streams)


def _wait(done: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _batches(url: str, stream_id: int) -> list[list[int]]:
    """The stream's batches, each as its events' ordinals among the stream's events (ids differ by stream)."""
    with psycopg.connect(url) as c:
        ids = [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id",
                                       [stream_id])]
        rank = {e: i for i, e in enumerate(ids)}
        return [[rank[e] for e in r[0]] for r in c.execute(
            "select event_ids from pgstream.batches where stream_id = %s order by id", [stream_id])]


def _recorded(url: str, stream_id: int) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select unnest(event_ids) from pgstream.batches where stream_id = %s "
                                        "order by id", [stream_id])]


# --- one batching rule ------------------------------------------------------------------------------

def _txn(events: int, commit: dt.datetime) -> Transaction:
    return Transaction(xid=5, commit_time=commit, events=[DecodedEvent(i, commit) for i in range(events)])


RULE = Batching(max_size=10, max_fill_secs=2.0, max_bytes=1000)


@pytest.mark.parametrize(("txns", "drained", "since_record", "due"), [
    ([], True, 9.0, False),  # nothing waits
    ([_txn(10, NOW)], False, 0.0, True),  # max_size events wait
    ([_txn(4, NOW), _txn(6, NOW)], False, 0.0, True),
    ([_txn(3, NOW - dt.timedelta(seconds=2))], False, 0.0, True),  # the oldest committed max_fill_secs ago
    ([_txn(3, NOW)], False, 9.0, False),  # more is coming, not full, not old: it waits
    ([_txn(3, NOW)], True, 9.0, True),  # the source sent everything committed: recorded now
    ([_txn(3, NOW)], True, 0.01, False),  # ... but at most every RECORD_EVERY_SECS
    ([_txn(0, NOW)], False, 0.0, True),  # only empty transactions: confirmed at once
])
def test_the_batching_rule(txns: list[Transaction], drained: bool, since_record: float, due: bool) -> None:
    pending = Pending()
    pending.add(txns)
    assert RULE.due(pending, drained=drained, now=NOW, since_record=since_record) is due


def test_a_read_waits_only_until_what_it_holds_is_due() -> None:
    """The reader's next read waits until what it holds is due (RECORD_EVERY_SECS after the last record), not a
    whole RECORD_EVERY_SECS from now: a commit that arrives 30 ms after a record is recorded 20 ms later. (Waiting
    the whole 50 ms, commits arriving every 83 ms were each recorded 51 ms after their commit, a steady state the
    loop never left: the group run that took over from another delivered at ~55 ms where the first one of the
    location delivered at ~6 ms, bench/RESULTS.md.)"""
    rec = recorder.Recorder(None, object(), {}, RULE, route=lambda txns: {})  # type: ignore[arg-type]
    assert rec.until_due(0.5) == 0.5  # nothing waits: the idle wait
    rec.pending.add([_txn(1, NOW)])
    rec.recorded_at = time.monotonic() - 0.03
    assert 0.0 < rec.until_due(0.5) <= recorder.RECORD_EVERY_SECS - 0.03
    rec.recorded_at = time.monotonic() - 0.06
    assert rec.until_due(0.5) == 0.0  # due once the source is drained: read what is there, then record


@pytest.mark.parametrize("batch", [{"max_size": 7, "max_fill_secs": 3600}, {"max_size": 50, "max_fill_secs": 0},
                                   {"max_size": 1, "max_fill_secs": 0.5}])
def test_the_same_batch_settings_give_the_same_batches_through_both_sources(
        db_url: str, tmp_path: Path, batch: dict[str, Any]) -> None:
    """Stream 1's group is read by its sensor (a peek), stream 2's by a group delivery run's reader (the
    replication protocol, kept open across its calls), the same transactions committed on each, one at a
    time: the same batches, event for event (a peek sees a backlog at once, a stream as it arrives: what one
    recording holds may differ then, but never how it is cut)."""
    peeked, streamed = _streams(tmp_path, db_url, batch, ids=(1, 2), readers={1: "peeked", 2: "streamed"},
                                own_slots=False)
    kept = ingest.GroupStream(db_url, "pgstream group slot reader t")
    total = 0
    try:
        with psycopg.connect(db_url, autocommit=True) as c, psycopg.connect(db_url, autocommit=True) as r:
            ingest.consume_group(c, "peeked", [peeked], 0)  # the groups' slots, the streams joined
            ingest.consume_group(r, "streamed", [streamed], 0, kept=kept)
            for n, size in enumerate([1, 5, 12, 3, 30, 2, 9]):  # one transaction each
                for stream in (peeked, streamed):
                    insert_events(db_url, stream.id, size, 100 * n)
                total += size
                # (short reads, again until recorded: a read spends its whole budget whatever it finds)
                while len(_recorded(db_url, peeked.id)) < total:
                    assert not ingest.consume_group(c, "peeked", [peeked], 0.1).slot_busy
                while len(_recorded(db_url, streamed.id)) < total:
                    assert not ingest.consume_group(r, "streamed", [streamed], 0.1, kept=kept).slot_busy
    finally:
        kept.close()
    assert len(_recorded(db_url, 2)) == total == 62
    assert _batches(db_url, 1) == _batches(db_url, 2)
    size = batch["max_size"]
    assert [len(b) for b in _batches(db_url, 1)] == [len(t[i:i + size]) for t in
                                                     [[0] * n for n in [1, 5, 12, 3, 30, 2, 9]]
                                                     for i in range(0, len(t), size)]


# --- the declared reader ----------------------------------------------------------------------------

def test_the_sensor_backs_off_while_another_connection_still_holds_its_slot(db_url: str, tmp_path: Path) -> None:
    """A reader that has not let go yet (a group delivery run's reader, ending) still streams the group's
    slot: the group's sensor backs off (SlotBusy), records nothing and touches nothing, and records every
    event once when the slot is let go."""
    (stream,) = _streams(tmp_path, db_url, {"max_size": 100, "max_fill_secs": 0}, own_slots=False)
    with psycopg.connect(db_url, autocommit=True) as c:
        slot = ingest.consume_group(c, "default", [stream], 0).slot
        assert slot is not None and slot == slot_of(db_url, 1)
        insert_events(db_url, 1, 20)
        stale = source.StreamSource(db_url, slot, groups.group_publication("default"), "stale reader",
                                    max_bytes=stream.delivery.tuning.max_read_bytes, keep_stream=True)
        try:
            result = ingest.consume_group(c, "default", [stream], 0.3)
            assert result.slot_busy and not result.batches and not result.events
            assert _recorded(db_url, 1) == []
        finally:
            stale.close()

        def ticked() -> bool:
            ingest.consume_group(c, "default", [stream], 0.3)
            return len(_recorded(db_url, 1)) >= 20

        _wait(ticked)
    assert sorted(_recorded(db_url, 1)) == _recorded(db_url, 1) and len(set(_recorded(db_url, 1))) == 20


def _event_row(item: Any) -> tuple[Any, ...]:
    batch_id, ord_, event = item
    if isinstance(event, TooLarge):
        return batch_id, ord_, "too large", event.id, event.size
    return batch_id, ord_, event.id, event.stream_id, event.created_at, event.payload_json, event.metadata_json


def test_a_group_runs_reader_hands_what_it_records_to_its_members_in_memory_as_the_table_reads_it(
        db_url: str, tmp_path: Path) -> None:
    """The group run's reader keeps each event's payload and metadata text with the batches it records for a member
    it hosts (engine/handoff.py): taken from there, every event is the one a round reads back from pgstream.events
    (JSON of every shape, unicode and escapes, metadata null or not, a payload over the sink's limit as TooLarge).
    A batch with a payload over KEEP_ROW_BYTES is left to the table, a member in mode per_batch (its runs are
    Dagster runs of their own) gets nothing kept, and a publication of an earlier version (no payload column) is
    given the columns at the reader's next pass."""
    config = load_config(write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 40, "max_fill_secs": 0}, "delivery": {"mode": "open"},
         "sink": {"type": "file", "path": str(tmp_path / "out1.jsonl")}},
        {"id": 2, "batch": {"max_size": 40, "max_fill_secs": 0}, "delivery": {"mode": "per_batch"},
         "sink": {"type": "file", "path": str(tmp_path / "out2.jsonl")}}]))
    streams_ = list(config.streams)
    kept = handoff.Handoff()
    reader = ingest.GroupStream(db_url, "pgstream group slot reader t", handoff=kept)
    publication = groups.group_publication("default")
    try:
        with psycopg.connect(db_url, autocommit=True) as c:
            ingest.consume_group(c, "default", streams_, 0, kept=reader)  # the group's slot, the streams joined
            # as an earlier version made it: no payload, no metadata
            c.execute(f"alter publication {publication} set table pgstream.events (id, stream_id, created_at) "
                      "where (stream_id in (1, 2))")
            ingest.consume_group(c, "default", streams_, 0, kept=reader)
            assert c.execute("select attnames from pg_publication_tables where pubname = %s",
                             [publication]).fetchone() == (["id", "payload", "metadata", "stream_id", "created_at"],)
            c.execute("""insert into pgstream.events (payload, metadata, stream_id) values
                ('{"s": "h\u00e9llo \\"q\\" \\\\ \\n\u2603", "n": null, "a": [1, 2.50, true], "o": {"x": {"y": []}}}',
                 null, 1),
                ('{"big": 12345678901234567890.000, "e": 1e-7}', '{"m": "x", "k": [null]}', 1),
                ('"just a string"', '{}', 1),
                ('[1, 2, 3]', null, 1)""")
            c.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g, 'pad', "
                      "repeat('x', g)), 1 from generate_series(1, 200) g")
            c.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object('n', g), 2 "
                      "from generate_series(1, 30) g")
            c.execute("insert into pgstream.events (payload, stream_id) values "
                      "(jsonb_build_object('huge', repeat('y', %s)), 1)", [replication.KEEP_ROW_BYTES + 10])
            _wait(lambda: ingest.consume_group(c, "default", streams_, 0.3, kept=reader) is not None
                  and len(_recorded(db_url, 1)) == 205 and len(_recorded(db_url, 2)) == 30)
            batches = c.execute("select id, stream_id, event_count, (select max(id) from pgstream.events "
                                "where stream_id = 1) = any(event_ids) from pgstream.batches order by id").fetchall()
        with psycopg.connect(db_url, autocommit=True) as c:
            compared = too_large = 0
            for batch_id, stream_id, count, huge in batches:
                taken = kept.take(batch_id, 1, count, event_bytes=150)
                if stream_id == 2 or huge:
                    assert taken is None, (batch_id, stream_id)
                    continue
                read = list(TableSource(c, [Span(batch_id, 1, count)], "", event_bytes=150).events())
                assert taken is not None and [_event_row(t) for t in taken] == [_event_row(r) for r in read]
                compared += count
                too_large += sum(isinstance(e, TooLarge) for _b, _o, e in taken)
            left = sum(count for _b, stream_id, count, huge in batches if huge)
            assert compared == 205 - left and left >= 1 and too_large >= 50 and kept.events == 0
    finally:
        reader.close()


def test_the_hand_off_is_bounded_drops_a_rolled_back_recording_and_what_no_run_took() -> None:
    """The hand-off keeps whole batches within its bounds (a batch that does not fit is left to the table), drops
    batches whose recording rolled back (discard), those of a stream delivered another way (forget: through
    Spark) and those no run took within KEEP_SECS."""
    at = dt.datetime(2026, 3, 4, 12, tzinfo=dt.UTC)

    def txn(ids: range, stream: int = 1) -> Transaction:
        return Transaction(1, events=[DecodedEvent(i, at, stream, f'{{"n": {i}}}', None) for i in ids])

    kept = handoff.Handoff(max_events=25)
    assert kept.put(1, [10, 11], [txn(range(1, 21))], 10) == [10, 11]
    assert kept.put(1, [12], [txn(range(21, 31))], 10) == []  # 30 events > 25: read from the table
    assert kept.put(2, [13], [txn(range(31, 36), 2)], 10) == [13]
    kept.discard([11])
    assert kept.take(11, 1, 10) is None and kept.events == 15
    kept.forget(1, 10)
    assert kept.take(10, 1, 10) is None and kept.take(13, 2, 3) is not None
    assert kept.put(1, [14], [txn(range(36, 37))], 10) == [14]
    original = handoff.KEEP_SECS
    handoff.KEEP_SECS = 0.0
    try:
        time.sleep(0.01)
        assert kept.put(1, [15], [Transaction(1, events=[DecodedEvent(40, at, 1, None, None)])], 10) == []
        assert kept.events == 0 and kept.take(14, 1, 1) is None  # expired meanwhile
        assert kept._streams == {}  # (nothing of them left behind)
    finally:
        handoff.KEEP_SECS = original


def test_one_pass_records_several_streams_ledgers(db_url: str, tmp_path: Path) -> None:
    """The recorder's pass takes a map stream id -> ledger (issue 30: one reader for several streams):
    each stream's transactions go to its own ledger, cut by its own max_size, in one database
    transaction; a stream whose declared reader is no longer the loop's (handed over to its reader group)
    records nothing, and says so."""
    s1, s2 = _streams(tmp_path, db_url, {"max_size": 4, "max_fill_secs": 0}, ids=(1, 2))
    insert_events(db_url, 1, 6)
    insert_events(db_url, 2, 3)
    with psycopg.connect(db_url, autocommit=True) as c:
        def read(stream: StreamConfig) -> list[Transaction]:
            return source.PeekSource(c, streams.stream_slot(c, stream.id), stream.publication, 1000).read(0)

        ledgers = {1: recorder.StreamLedger(s1, ledger_state.SENSOR), 2: recorder.StreamLedger(s2, ledger_state.SENSOR)}
        assert recorder.record_pass(c, ledgers, {1: read(s1), 2: read(s2)}) == set()
        assert _batches(db_url, 1) == [[0, 1, 2, 3], [4, 5]] and _batches(db_url, 2) == [[0, 1, 2]]
        assert (ledgers[1].events, ledgers[2].events) == (6, 3)
        # read again (nothing confirmed): what the ledgers hold is not recorded twice
        assert recorder.record_pass(c, ledgers, {1: read(s1), 2: read(s2)}) == set()
        assert len(_recorded(db_url, 1)) == 6 and len(_recorded(db_url, 2)) == 3
        # stream 2 was handed over to its reader group: stream 2 records nothing in the pass, stream 1 does
        groups.register_group_member(c, 2, "default")
        groups.ensure_group_publication(c, "default")
        groups.begin_join(c, 2, "default")
        assert ledger_state.slot_reader(c, 2) == groups.group_reader("default")
        insert_events(db_url, 1, 2, 100)
        insert_events(db_url, 2, 2, 100)
        assert recorder.record_pass(c, ledgers, {1: read(s1), 2: read(s2)}) == {2}
        assert len(_recorded(db_url, 1)) == 8 and len(_recorded(db_url, 2)) == 3


def test_a_member_without_an_entry_is_recorded_pending_whatever_open_run_key_it_was_left_with(
        db_url: str, tmp_path: Path) -> None:
    """Stream 2 had a run open when its group run was killed (its ``open_run_key`` left set) and its entry was
    then removed from pgstream.yaml: the group's reader records its events for it (a stand-in) and hands them to
    no run (its batches wait, pending, for a run of a configuration that has it); stream 1's go to its open run."""
    s1, _s2 = _streams(tmp_path, db_url, {"max_size": 10, "max_fill_secs": 0}, ids=(1, 2), own_slots=False)
    with psycopg.connect(db_url, autocommit=True) as c:
        ingest.consume_group(c, "default", [s1, _s2], 0)  # both joined the group, its slot made
        for sid in (1, 2):
            assert ledger_state.open_warm_run(c, sid, f"killed-{sid}")
        insert_events(db_url, 1, 5)
        insert_events(db_url, 2, 5)
        while len(_recorded(db_url, 1)) < 5 or len(_recorded(db_url, 2)) < 5:
            ingest.consume_group(c, "default", [s1], 0.2)  # stream 2's entry gone: a stand-in
        statuses: dict[int, list[str]] = dict(c.execute(
            "select stream_id, array_agg(distinct status::text) from pgstream.batches group by stream_id").fetchall())
    assert statuses == {1: ["launched"], 2: ["pending"]}, statuses


def test_a_recording_pass_sends_as_many_statements_for_four_streams_as_for_one(db_url: str, tmp_path: Path) -> None:
    """A group's reader records every member that had a commit since its last pass (at 100 streams, a few each
    pass) and hands the batches to their runs: the pass's statements (the declared readers under the rows' locks,
    what the ledger holds already, the batches, the hand-over and the wake-ups) are one each whatever the number
    of streams in it, not one each per stream. Every event is recorded once, each stream's batches in order and
    handed to its own open run."""
    streams = _streams(tmp_path, db_url, {"max_size": 2, "max_fill_secs": 0}, ids=(1, 2, 3, 4))
    for stream in streams:
        insert_events(db_url, stream.id, 3)
    sent: dict[tuple[int, ...], int] = {}
    with psycopg.connect(db_url, autocommit=True) as c:
        ledgers = {}
        for stream in streams:
            ledger_state.open_run(c, stream.id, f"run-{stream.id}")
            ledgers[stream.id] = recorder.StreamLedger(stream, ledger_state.SENSOR, run_key=f"run-{stream.id}")
        txns = {s.id: source.PeekSource(c, slot_of(db_url, s.id), s.publication, 1000).read(0) for s in streams}
        for ids in [(1,), (2, 3, 4)]:
            trace = tmp_path / f"trace{len(ids)}.txt"
            with trace.open("w") as out:
                c.pgconn.trace(out.fileno())
                assert recorder.record_pass(c, {i: ledgers[i] for i in ids}, {i: txns[i] for i in ids}) == set()
                c.pgconn.untrace()
            lines = trace.read_text().splitlines()
            sent[ids] = sum(1 for line in lines if "\tF\t" in line and ("\tSync" in line or "\tQuery" in line))
        for stream in streams:
            batches = ledger_state.batches_between(c, stream.id, 0, 10**9)
            assert [(b.event_count, b.run_key, b.status) for b in batches] == [
                (2, f"run-{stream.id}", "launched"), (1, f"run-{stream.id}", "launched")], stream.id
            assert _batches(db_url, stream.id) == [[0, 1], [2]]
    assert sent[(1,)] == sent[(2, 3, 4)] and sent[(1,)] <= 10, sent


def test_a_recording_pass_is_one_transaction_without_savepoints(db_url: str, tmp_path: Path) -> None:
    """The reader's recording pass (the batches, then the hand-over to the open run) is one database
    transaction: the ledger functions it calls take the caller's transaction, without a SAVEPOINT and
    its RELEASE each (two round trips per function, on the reader's path); called alone, each is still a
    transaction of its own."""
    (stream,) = _streams(tmp_path, db_url, {"max_size": 4, "max_fill_secs": 0})
    insert_events(db_url, 1, 6)
    trace = tmp_path / "trace.txt"
    with psycopg.connect(db_url, autocommit=True) as c, trace.open("w") as out:
        ledger_state.open_run(c, 1, RUN_KEY)
        txns = source.PeekSource(c, slot_of(db_url, 1), stream.publication, 1000).read(0)
        c.pgconn.trace(out.fileno())
        target = recorder.StreamLedger(stream, ledger_state.SENSOR, run_key=RUN_KEY)
        assert recorder.record_pass(c, {1: target}, {1: txns}) == set()
        c.pgconn.untrace()
    sent = trace.read_text()
    assert "pgstream.batches" in sent and "BEGIN" in sent and "COMMIT" in sent
    assert "SAVEPOINT" not in sent.upper(), [line for line in sent.splitlines() if "SAVEPOINT" in line.upper()]
    assert len(_recorded(db_url, 1)) == 6
    with psycopg.connect(db_url, autocommit=True) as c:  # alone: a transaction of its own
        assert [b.run_key for b in ledger_state.batches_between(c, 1, 0, 10**9)] == [RUN_KEY, RUN_KEY]
        insert_events(db_url, 1, 2, 100)
        recording.record(c, 1, source.PeekSource(c, slot_of(db_url, 1), stream.publication, 1000).read(0)[-1:], 4)
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert len(_recorded(db_url, 1)) == 8


def test_recovery_from_the_table_takes_its_snapshot_again_when_the_streams_row_changed_under_it(
        db_url: str, tmp_path: Path) -> None:
    """Another session updates the stream's row while recovery reads the table (as a member's run does when a
    group's reader recovers a new member): the update commits after recovery's snapshot, so recovery's own update
    of the row fails to serialize; recovery reads again in a new snapshot and records every event once, instead of
    stopping the group's reader for its retry interval (a CI failure: the member's first events waited seconds)."""
    _streams(tmp_path, db_url, {"max_size": 4, "max_fill_secs": 0})
    insert_events(db_url, 1, 6)
    result: dict[str, Any] = {}
    with psycopg.connect(db_url, autocommit=True) as other, psycopg.connect(db_url, autocommit=True) as c:
        pid = c.info.backend_pid
        other.execute("begin")
        other.execute("update pgstream.streams set recovery_pending = true where id = 1")

        def recover() -> None:
            try:
                result["batches"] = recording.recover_from_table(c, 1, 4)
            except Exception as exc:  # the assertion below shows it
                result["error"] = exc

        thread = threading.Thread(target=recover)
        thread.start()
        with psycopg.connect(db_url, autocommit=True) as watch:
            _wait(lambda: watch.execute("select wait_event_type from pg_stat_activity where pid = %s",
                                        [pid]).fetchone() == ("Lock",))
        other.execute("commit")  # recovery's snapshot is older than this update: its own update cannot serialize
        thread.join(30)
        assert not thread.is_alive() and "error" not in result, result
        assert len(result["batches"]) == 2
        assert c.execute("select recovery_pending from pgstream.streams where id = 1").fetchone() == (False,)
    assert _batches(db_url, 1) == [[0, 1, 2, 3], [4, 5]]


def test_a_batchs_event_ids_are_stored_uncompressed(db_url: str, tmp_path: Path) -> None:
    """A batch of thousands of events keeps its ids as they are (out of line, not compressed): pglz cost the
    reader's ledger session about 1 us an id on every insert (sql/035)."""
    (stream,) = _streams(tmp_path, db_url, {"max_size": 5000, "max_fill_secs": 0})
    insert_events(db_url, 1, 3000)
    with psycopg.connect(db_url, autocommit=True) as c:
        txns = source.PeekSource(c, slot_of(db_url, 1), stream.publication, 10_000).read(0)
        (batch_id,) = recording.record(c, 1, txns, 5000)
        row = c.execute("select event_count, pg_catalog.pg_column_compression(event_ids), "
                        "pg_catalog.pg_column_size(event_ids) from pgstream.batches where id = %s",
                        [batch_id]).fetchone()
    assert row is not None and row[:2] == (3000, None) and row[2] >= 3000 * 8, row  # (compressed: about 10 kB)


_BATCH_ROWS = """insert into pgstream.batches (stream_id, kind, event_ids, event_count, first_event_id, last_event_id,
                                              min_created_at, max_created_at, end_lsn, status, run_key)
                 select %s::bigint, %s::text, array[g::bigint], 1, g, g, now(), now(),
                        ('0/' || to_hex(g * 64))::pg_lsn, %s::text, %s::text
                 from generate_series(%s::int, %s::int) g"""


def _batches_of(conn: psycopg.Connection, stream_id: int, kind: str, first: int, last: int,
                status: str = "delivered", run_key: str | None = None) -> None:
    conn.execute(_BATCH_ROWS, [stream_id, kind, status, run_key, first, last])


def _blocks_read(conn: psycopg.Connection, call: Callable[[psycopg.Connection], object],
                 table: str = "pgstream.batches") -> int:
    """Blocks of ``table`` and its indexes ``call(conn)`` asked for (this transaction's statistics)."""
    count = ("select sum(pg_catalog.pg_stat_get_xact_blocks_fetched(c.oid))::int from pg_catalog.pg_class c "
             "where c.oid = %(t)s::regclass or c.oid in "
             "(select indexrelid from pg_catalog.pg_index where indrelid = %(t)s::regclass)")
    with conn.transaction():
        (before,) = conn.execute(count, {"t": table}).fetchone() or (0,)
        call(conn)
        (after,) = conn.execute(count, {"t": table}).fetchone() or (0,)
    return int(after) - int(before)


@pytest.mark.parametrize("plans", ["force_generic_plan", "force_custom_plan"])
def test_the_ledger_lookups_of_every_event_read_a_few_pages_however_many_batches_the_table_keeps(
        db_url: str, plans: str) -> None:
    """The reader asks, on every pass, where a stream's slot batches end and which recovery batches reach past a
    position; a member's run asks, on every batch, what was handed to it. Whatever the plan (a prepared
    statement's generic plan made while the table was nearly empty, as on a new install, or a plan made without
    statistics as the table grew), each reads a few index pages, not every batch the stream (or the table) keeps:
    in a 100-stream bench they were the ledger's costliest statements (sql/036)."""
    with psycopg.connect(db_url, autocommit=True, prepare_threshold=0) as c:
        ensure_stream(c, 1)
        ensure_stream(c, 2)
        c.execute("set plan_cache_mode = " + plans)
        _batches_of(c, 1, "stream", 1, 1, "launched", "run-1")
        (head,) = ledger_state.batches_between(c, 1, 0, 10**9)
        lookups: dict[str, Callable[[psycopg.Connection], object]] = {
            "last_end_lsns": lambda conn: recording.last_end_lsns(conn, [1]),
            "recovered_ids_since": lambda conn: recording.recovered_ids_since(conn, {1: 20_001 * 64}),
            "next_assigned": lambda conn: ledger_state.next_assigned(conn, 1, "run-1", 0, ""),
            "run_batch_ids": lambda conn: ledger_state.run_batch_ids(conn, head),
        }
        for call in lookups.values():  # (the generic plans are made here, on one batch)
            call(c)
        _batches_of(c, 1, "stream", 2, 10_000)
        _batches_of(c, 2, "stream", 10_001, 20_000)
        _batches_of(c, 1, "recovery", 20_001, 20_001)
        assert recording.last_end_lsns(c, [1, 2, 3]) == {1: 10_000 * 64, 2: 20_000 * 64}
        assert recording.recovered_ids_since(c, {1: 20_001 * 64, 2: 0}) == {1: {20_001}}
        assert [b.id for b in ledger_state.next_assigned(c, 1, "run-1", 0, "").batches] == [head.id]
        assert ledger_state.run_batch_ids(c, head) == [head.id]
        read = {name: _blocks_read(c, call) for name, call in lookups.items()}
        # the status view's last recorded position is the later of either kind's
        assert c.execute("select last_recorded_lsn from pgstream.stream_status where id = 1").fetchone() == (
            replication.int_to_lsn(20_001 * 64),)
        whole = c.execute("select pg_catalog.pg_relation_size('pgstream.batches') / 8192").fetchone()
    assert whole is not None and whole[0] > 200  # what reading every batch would cost
    assert all(blocks <= 8 for blocks in read.values()), (read, whole)


def test_a_runs_look_at_its_batches_dead_letters_reads_a_few_pages_however_many_the_stream_has(
        db_url: str) -> None:
    """A member run asks, for every batch, which of its events have a dead letter (skipped) and, after each round,
    how many (as the ledger's trigger does when a batch is delivered, to count what was delivered): with the
    plan Postgres settles on after a few calls while the stream had none (psycopg prepares a statement from its
    fifth call), a stream whose sink rejected 20,000 events read all of its dead letters on every batch. Planned
    with the batch ids on a (stream_id, batch_id) index, each reads a few pages (sql/036)."""
    with psycopg.connect(db_url, autocommit=True, prepare_threshold=0) as c:
        ensure_stream(c, 1)
        _batches_of(c, 1, "stream", 1, 2, "launched", "run-1")
        ids = [b.id for b in ledger_state.batches_between(c, 1, 0, 10**9)]
        _batches_of(c, 1, "stream", 3, 12, "launched", "run-1")  # delivered one by one: the trigger counts
        delivering = iter([b.id for b in ledger_state.batches_between(c, 1, 0, 10**9)][2:])
        lookups: dict[str, Callable[[psycopg.Connection], object]] = {
            "dead_letter_positions": lambda conn: deadletters_ledger.dead_letter_positions(conn, 1, ids),
            "round_outcome": lambda conn: ledger_state.round_outcome(conn, 1, ids),
            "mark_delivered": lambda conn: ledger_state.mark_delivered(conn, next(delivering), "run-1"),
        }
        for _ in range(8):  # (the plan settles here, on no dead letter)
            for call in lookups.values():
                call(c)
        c.execute("insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, error) "
                  "select 1, g, 'deliver', g + 1000, 0, 'rejected' from generate_series(1, 20000) g")
        c.execute("insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, error) "
                  "values (1, 0, 'deliver', %s, 0, 'rejected')", [ids[1]])
        assert deadletters_ledger.dead_letter_positions(c, 1, ids) == frozenset({(ids[1], 0)})
        assert ledger_state.round_outcome(c, 1, ids) == (ids, 1)
        read = {name: _blocks_read(c, call, "pgstream.dead_letters") for name, call in lookups.items()}
        whole = c.execute("select pg_catalog.pg_relation_size('pgstream.dead_letters') / 8192").fetchone()
    assert whole is not None and whole[0] > 100  # what reading every dead letter would cost
    assert all(blocks <= 8 for blocks in read.values()), (read, whole)
