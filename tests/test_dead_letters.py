"""Dead letters, the operator surface: set aside, list, show (overtaken), discard, redeliver (to a
real file sink and a real HTTP endpoint that fails), through the engine, the replay and control jobs
executed against a real Dagster instance, and the CLI. Real Postgres; the ledger's batches are
written as the sensor writes them and marked delivered as a delivery run marks them."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.config import load_config
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import CONTROL_JOB, REPLAY_JOB, REPLAY_OP
from pgstream_dagster.defs.status import status_observation
from pgstream_dagster.engine import deadletters
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.deadletters import DeadLetterError
from pgstream_dagster.engine.ledger import locks
from pgstream_dagster.engine.status import render_status, stream_status
from pgstream_dagster.sinks import MemorySink

from .support.dagster_instance import run_log
from .support.endpoint import Endpoint
from .support.harness import read_jsonl, write_config


def events(conn: psycopg.Connection, stream_id: int, n: int, tag: str = "e") -> list[int]:
    """``n`` events of the stream (ids chosen by the database), in one transaction."""
    rows = conn.execute("insert into pgstream.events (payload, metadata, stream_id) "
                        "select jsonb_build_object('tag', %s::text, 'n', g), jsonb_build_object('m', g), %s "
                        "from generate_series(1, %s) g returning id", [tag, stream_id, n]).fetchall()
    return sorted(r[0] for r in rows)


def batch(conn: psycopg.Connection, stream_id: int, ids: Sequence[int], start_lsn: str, end_lsn: str) -> int:
    """A pending batch, as the sensor records one (event ids in commit order, LSN range)."""
    row = conn.execute(
        "insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
        "min_created_at, max_created_at, start_lsn, end_lsn, first_commit_at, last_commit_at) "
        "values (%s, %s, %s, %s, %s, now(), now(), %s::pg_lsn, %s::pg_lsn, now(), now()) returning id",
        [stream_id, list(ids), len(ids), ids[0], ids[-1], start_lsn, end_lsn]).fetchone()
    assert row is not None
    return int(row[0])


def delivered(conn: psycopg.Connection, *batch_ids: int) -> None:
    """Mark batches delivered, as a delivery run does once the sink confirmed them."""
    conn.execute("update pgstream.batches set status = %s, delivered_at = now(), launched_at = now() "
                 "where id = any(%s)", [BatchStatus.DELIVERED, list(batch_ids)])


def read_letter(conn: psycopg.Connection, stream_id: int, event_id: int, lsn: str, error: str = "unreadable",
                created: bool = True) -> int:
    """A read-stage dead letter, as the sensor writes one for an event it could not record."""
    row = conn.execute(
        "insert into pgstream.dead_letters (stream_id, event_id, stage, lsn, event_created_at, payload, "
        "metadata, error) select %s, e.id, 'read', %s::pg_lsn, case when %s then e.created_at end, e.payload, "
        "e.metadata, %s from pgstream.events e where e.id = %s returning id",
        [stream_id, lsn, created, error, event_id]).fetchone()
    assert row is not None
    return int(row[0])


def letters(conn: psycopg.Connection, stream_id: int = 1) -> list[tuple[Any, ...]]:
    return conn.execute("select id, event_id, status, attempts, error, resolved_by from pgstream.dead_letters "
                        "where stream_id = %s order by id", [stream_id]).fetchall()


@pytest.fixture
def conn(db_url: str) -> Any:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id) values (1), (2)")
        yield c


@pytest.fixture
def ledger(conn: psycopg.Connection) -> dict[str, Any]:
    """Stream 1: batches A (3 events), B (3), C (2), pending, and 3 events in no batch; stream 2: one
    batch of 2."""
    a, b, c = events(conn, 1, 3, "a"), events(conn, 1, 3, "b"), events(conn, 1, 2, "c")
    other = events(conn, 2, 2, "other")
    loose = events(conn, 1, 3, "loose")  # in no batch: the sensor could not record them (read stage)
    return {"a": a, "b": b, "c": c, "other": other, "loose": loose,
            "A": batch(conn, 1, a, "0/1000", "0/1800"), "B": batch(conn, 1, b, "0/2000", "0/2800"),
            "C": batch(conn, 1, c, "0/3000", "0/3800"), "X": batch(conn, 2, other, "0/1000", "0/1800")}


def stream_config(tmp_path: Path, db_url: str, sink: dict[str, Any], **delivery: Any) -> Path:
    return write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "sink": sink, "delivery": delivery},
        {"id": 2, "sink": {"type": "file", "path": str(tmp_path / "other.jsonl")}}])


# --- set aside, list, show, discard -------------------------------------------------------------


def test_set_aside_an_event_of_a_pending_batch(conn: psycopg.Connection, ledger: dict[str, Any]) -> None:
    b2 = ledger["b"][1]
    assert deadletters.set_aside(conn, 1, [b2], "the consumer crashes on it") == 1
    (letter,) = deadletters.list_dead_letters(conn, 1)
    assert (letter.stage, letter.event_id, letter.batch_id, letter.ord) == ("deliver", b2, ledger["B"], 2)
    assert letter.position == f"batch {ledger['B']} #2"
    assert letter.payload == {"tag": "b", "n": 2} and letter.metadata == {"m": 2}
    assert letter.event_created_at is not None and letter.undeliverable is None
    assert (letter.status, letter.attempts) == ("open", 0)
    assert letter.error == "set aside by an operator: the consumer crashes on it"
    assert letter.waiting_for_batch == ledger["A"]  # batches up to its position are not delivered yet

    # refused, and nothing changes: already set aside, another stream's event, a delivered batch's
    # event, an unknown id, no reason, an unknown stream
    delivered(conn, ledger["A"])
    for stream_id, ids, reason, message in (
        (1, [b2], "again", "already dead letters"),
        (1, [ledger["b"][0], ledger["other"][0]], "x", f"events {{{ledger['other'][0]}}} are not undelivered"),
        (1, [ledger["a"][0]], "x", "are not undelivered events of stream 1"),
        (1, [10**9], "x", "are not undelivered events of stream 1"),
        (1, [ledger["b"][0]], " ", "a reason is required"),
        (1, [], "x", "no event ids given"),
        (9, [ledger["b"][0]], "x", "stream 9 does not exist"),
    ):
        with pytest.raises(DeadLetterError, match=re.escape(message)):
            deadletters.set_aside(conn, stream_id, ids, reason)
    assert [r[1] for r in letters(conn)] == [b2]

    # an event that vanished from the table (deleted by hand) is set aside without a payload: it can
    # never be redelivered, which the dead letter says
    conn.execute("delete from pgstream.events where id = %s", [ledger["c"][0]])
    assert deadletters.set_aside(conn, 1, [ledger["c"][0], ledger["c"][1]], "gone") == 2
    gone = next(d for d in deadletters.list_dead_letters(conn, 1) if d.event_id == ledger["c"][0])
    assert gone.payload_json is None and "vanished" in (gone.undeliverable or "")


def test_list_in_delivery_order_and_show_what_overtook_it(conn: psycopg.Connection, ledger: dict[str, Any]) -> None:
    b, c, r = ledger["b"], ledger["c"], ledger["loose"]
    deadletters.set_aside(conn, 1, [c[0], b[1], b[2]], "poison")
    # read-stage: one committed before any batch, one inside B's range (after B), one after C
    early = read_letter(conn, 1, r[0], "0/0500")
    mid = read_letter(conn, 1, r[1], "0/2400")
    late = read_letter(conn, 1, r[2], "0/3900", created=False)
    deadletters.set_aside(conn, 2, [ledger["other"][0]], "other stream")

    listed = deadletters.list_dead_letters(conn, 1)
    by_event = {d.event_id: d.id for d in listed}
    assert [d.event_id for d in listed] == [r[0], b[1], b[2], r[1], c[0], r[2]]
    assert [d.id for d in listed][3] == mid and listed[0].id == early and listed[-1].id == late
    assert listed[3].position == f"lsn 0/2400 (after batch {ledger['B']})" and listed[0].position == "lsn 0/500"
    assert "could not read the event's created_at" in (listed[-1].undeliverable or "")
    assert [d.event_id for d in deadletters.list_dead_letters(conn, None)] == [*[d.event_id for d in listed],
                                                                               ledger["other"][0]]
    assert len(deadletters.list_dead_letters(conn, 1, limit=2)) == 2
    assert deadletters.list_dead_letters(conn, 1, "discarded") == []
    with pytest.raises(DeadLetterError, match="status must be one of"):
        deadletters.list_dead_letters(conn, 1, "closed")

    def overtaken(event_id: int) -> int | None:
        return deadletters.get_dead_letter(conn, by_event[event_id]).overtaken

    # nothing delivered yet: nothing overtook anything
    assert [overtaken(e) for e in (r[0], b[1], c[0])] == [0, 0, 0]
    # A and B delivered (without b[1] and b[2], set aside): b[1] was overtaken by nothing yet (b[2]
    # is a dead letter too), the early read-stage letter by A's and B's delivered events
    delivered(conn, ledger["A"], ledger["B"])
    assert overtaken(b[1]) == 0
    assert overtaken(r[0]) == 3 + 1  # all of A, and b[0]
    delivered(conn, ledger["C"])
    assert overtaken(b[1]) == 1  # c[1]; c[0] is a dead letter
    assert overtaken(r[1]) == 1  # after B: c[1]
    assert overtaken(r[2]) == 0
    # once a later dead letter is redelivered it has overtaken the earlier one
    conn.execute("update pgstream.dead_letters set status = 'redelivered', resolved_at = now() where id = %s",
                 [by_event[c[0]]])
    assert overtaken(b[1]) == 2
    shown = deadletters.get_dead_letter(conn, by_event[b[1]])
    assert shown.payload == {"tag": "b", "n": 2} and shown.error == "set aside by an operator: poison"
    assert shown.waiting_for_batch is None
    with pytest.raises(DeadLetterError, match="dead letter 999999 does not exist"):
        deadletters.get_dead_letter(conn, 999999)


def test_discard_by_ids_and_all_refuses_wrong_ids(conn: psycopg.Connection, ledger: dict[str, Any]) -> None:
    deadletters.set_aside(conn, 1, ledger["b"], "poison")
    deadletters.set_aside(conn, 2, ledger["other"][:1], "poison")
    one, two, three = (r[0] for r in letters(conn))
    (other,) = (r[0] for r in letters(conn, 2))
    before = letters(conn)
    # another stream's dead letter, an unknown id, one already discarded: refused, nothing changes
    for ids, message in (([one, other], f"dead letters {{{other}}} are not open dead letters of stream 1"),
                         ([one, 424242], "dead letters {424242} are not open"), ([], "no dead letter ids")):
        with pytest.raises(DeadLetterError, match=re.escape(message)):
            deadletters.discard(conn, 1, ids, "tester")
    assert letters(conn) == before
    assert deadletters.discard(conn, 1, [two], "tester") == 1
    with pytest.raises(DeadLetterError, match=re.escape(f"dead letters {{{two}}} are not open dead letters")):
        deadletters.discard(conn, 1, [two, three], "tester")
    assert deadletters.discard(conn, 1, None, "ops") == 2  # all the stream's open ones
    assert [(r[0], r[2], r[5]) for r in letters(conn)] == [(one, "discarded", "ops"), (two, "discarded", "tester"),
                                                            (three, "discarded", "ops")]
    assert letters(conn, 2)[0][2] == "open"  # another stream's are not touched
    assert deadletters.discard(conn, 1, None, "ops") == 0


# --- redelivery ---------------------------------------------------------------------------------


def test_redeliver_to_a_file_sink_in_order_waiting_for_the_stream(conn: psycopg.Connection, db_url: str,
                                                                  ledger: dict[str, Any], tmp_path: Path) -> None:
    b, c, r = ledger["b"], ledger["c"], ledger["loose"]
    out = tmp_path / "redelivered.jsonl"
    stream = load_config(stream_config(tmp_path, db_url, {"type": "file", "path": str(out)}, chunk_size=2)).stream(1)
    deadletters.set_aside(conn, 1, [b[2], c[1], b[0]], "poison")
    mid = read_letter(conn, 1, r[1], "0/2400")
    unreadable = read_letter(conn, 1, r[2], "0/0100", created=False)
    ids = {r[1]: r[0] for r in letters(conn)}

    # nothing is sent while a batch up to a dead letter's position is undelivered
    report = deadletters.redeliver(conn, stream, None, "tester")
    assert report.redelivered == [] and not out.exists()
    assert report.undeliverable == [(unreadable, report.undeliverable[0][1])]
    assert report.waiting_for_batch == ledger["A"]
    assert report.waiting == [ids[b[0]], ids[b[2]], mid, ids[c[1]]]
    assert "wait: batch" in report.summary()

    # A and B delivered: the dead letters up to B go, C's waits; the unreadable one stays open
    delivered(conn, ledger["A"], ledger["B"])
    dry = deadletters.redeliver(conn, stream, None, "tester", dry_run=True)
    assert dry.redelivered == [ids[b[0]], ids[b[2]], mid] and not out.exists()
    assert "would redeliver 3 of 5" in dry.summary()
    report = deadletters.redeliver(conn, stream, None, "tester")
    assert [e["id"] for e in read_jsonl(out)] == [b[0], b[2], r[1]]
    assert read_jsonl(out)[0]["payload"] == {"tag": "b", "n": 1} and read_jsonl(out)[0]["metadata"] == {"m": 1}
    assert report.redelivered == [ids[b[0]], ids[b[2]], mid] and report.waiting == [ids[c[1]]]
    assert not report.complete
    assert {(r[0], r[2], r[5]) for r in letters(conn) if r[2] != "open"} == {
        (ids[b[0]], "redelivered", "tester"), (ids[b[2]], "redelivered", "tester"), (mid, "redelivered", "tester")}

    # ids: only those; a closed or unknown one is refused, nothing sent
    delivered(conn, ledger["C"])
    for wrong in ([ids[b[0]]], [777777]):
        with pytest.raises(DeadLetterError, match="are not open dead letters of stream 1"):
            deadletters.redeliver(conn, stream, wrong, "tester")
    report = deadletters.redeliver(conn, stream, [ids[c[1]]], "tester", chunk_size=1)
    assert report.redelivered == [ids[c[1]]] and [e["id"] for e in read_jsonl(out)][-1] == c[1]
    # what is left can only be discarded
    report = deadletters.redeliver(conn, stream, None, "tester")
    assert report.redelivered == [] and [i for i, _ in report.undeliverable] == [unreadable]
    assert "cannot be redelivered" in report.summary() and "discard it" in report.summary()
    assert [r[2] for r in letters(conn) if r[0] == unreadable] == ["open"]
    assert len(read_jsonl(out)) == 4


def test_redeliver_stops_at_the_first_refusal_keeping_order(conn: psycopg.Connection, db_url: str,
                                                             ledger: dict[str, Any], tmp_path: Path) -> None:
    endpoint = Endpoint()
    try:
        secret = "tok3n-never-shown"
        sink = {**endpoint.sink("batch"), "url": f"{endpoint.url}?token={secret}"}
        stream = load_config(stream_config(tmp_path, db_url, sink, chunk_size=2)).stream(1)
        every = [*ledger["a"], *ledger["b"]]
        deadletters.set_aside(conn, 1, every, "consumer bug")
        delivered(conn, ledger["A"], ledger["B"])
        ids = [d.id for d in deadletters.list_dead_letters(conn, 1)]

        def fail_after_first(n: int) -> None:
            if n == 1:
                endpoint.mode = "error"  # the first chunk is accepted, every later request refused

        endpoint.hook = fail_after_first
        report = deadletters.redeliver(conn, stream, None, "tester")
        assert endpoint.accepted == every[:2]
        assert report.redelivered == ids[:2] and report.failed == ids[2] and report.waiting == ids[3:]
        assert "HTTP 500" in (report.error or "") and secret not in report.summary()
        rows = {r[0]: r for r in letters(conn)}
        assert [rows[i][2] for i in ids] == ["redelivered"] * 2 + ["open"] * 4
        assert rows[ids[2]][3] == 1 and rows[ids[2]][4].startswith("redelivery failed: http sink")
        assert "HTTP 500" in rows[ids[2]][4] and secret not in rows[ids[2]][4]
        assert [rows[i][3] for i in ids[3:]] == [0, 0, 0]  # later ones were not tried
        assert rows[ids[3]][4] == "set aside by an operator: consumer bug"
        again = deadletters.redeliver(conn, stream, None, "tester")  # still refused: one more attempt
        assert again.failed == ids[2] and endpoint.accepted == every[:2]
        assert {r[0]: r[3] for r in letters(conn)}[ids[2]] == 2

        endpoint.hook, endpoint.mode = None, "ok"
        report = deadletters.redeliver(conn, stream, None, "tester")
        assert report.complete and report.redelivered == ids[2:]
        assert endpoint.accepted == every  # in order, each once
        assert {r[2] for r in letters(conn)} == {"redelivered"}
    finally:
        endpoint.down()


def test_one_redelivery_per_stream_at_a_time(conn: psycopg.Connection, db_url: str, ledger: dict[str, Any],
                                             tmp_path: Path) -> None:
    stream = load_config(stream_config(tmp_path, db_url, {"type": "memory", "name": "lock"})).stream(1)
    deadletters.set_aside(conn, 1, ledger["a"][:1], "x")
    delivered(conn, ledger["A"])
    with psycopg.connect(db_url, autocommit=True) as other:
        assert locks.try_lock(other, locks.REDELIVERY_LOCK, 1)
        with pytest.raises(DeadLetterError, match="another redelivery of stream 1"):
            deadletters.redeliver(conn, stream, None, "tester")
        locks.unlock(other, locks.REDELIVERY_LOCK, 1)
    assert [r[2] for r in letters(conn)] == ["open"]
    MemorySink.reset("lock")
    assert deadletters.redeliver(conn, stream, None, "tester").redelivered == [letters(conn)[0][0]]
    assert [e.id for e in MemorySink.delivered("lock")] == ledger["a"][:1]


# --- Dagster: the replay job, the control job, the status asset ---------------------------------


def test_redeliver_through_the_replay_job(conn: psycopg.Connection, db_url: str, ledger: dict[str, Any],
                                          tmp_path: Path, instance: dg.DagsterInstance) -> None:
    MemorySink.reset("replay-dl")
    cfg = stream_config(tmp_path, db_url, {"type": "memory", "name": "replay-dl", "fail_times": 1})
    job = build_definitions(cfg).resolve_job_def(REPLAY_JOB)

    def replay(**config: Any) -> dg.ExecuteInProcessResult:
        return job.execute_in_process(run_config={"ops": {REPLAY_OP: {"config": {"stream_id": 1, **config}}}},
                                      instance=instance, raise_on_error=False)

    deadletters.set_aside(conn, 1, [ledger["b"][0], ledger["a"][2], ledger["a"][0]], "poison")
    delivered(conn, ledger["A"], ledger["B"])
    ids = [d.id for d in deadletters.list_dead_letters(conn, 1)]  # a0, a2, b0: delivery order

    for config, message in (
        ({"dead_letters": True, "from_event_id": 3}, "take no event filter: remove from_event_id"),
        ({"dead_letter_ids": [ids[0]], "all_events": True}, "remove all_events"),
        ({"dead_letters": True, "dead_letter_ids": [ids[0]]}, "not both"),
        ({"dead_letter_ids": [31337]}, "dead letters {31337} are not open dead letters of stream 1"),
    ):
        result = replay(**config)
        assert not result.success and message in run_log(instance, result), config

    dry = replay(dead_letters=True, dry_run=True)
    assert dry.success and MemorySink.delivered("replay-dl") == []
    log = run_log(instance, dry)
    assert "would redeliver 3 of 3 open dead letters" in log and f"dead letter {ids[2]}: stream 1 event" in log

    failed = replay(dead_letters=True)  # the sink refuses the first call
    assert not failed.success
    assert "redelivery of stream 1's dead letters stopped" in run_log(instance, failed)
    assert "injected failure" in run_log(instance, failed)
    attempts = {r[0]: r[3] for r in letters(conn)}
    assert [attempts[i] for i in ids] == [1, 0, 0]  # a0 comes first: its attempt is counted

    only = replay(dead_letter_ids=[ids[1]])
    assert only.success and [e.id for e in MemorySink.delivered("replay-dl")] == [ledger["a"][2]]
    rest = replay(dead_letters=True, chunk_size=1)
    assert rest.success and rest.output_for_node(REPLAY_OP) == 2
    assert [e.id for e in MemorySink.delivered("replay-dl")] == [ledger["a"][2], ledger["a"][0], ledger["b"][0]]
    materialization = rest.asset_materializations_for_node(REPLAY_OP)[0]
    assert materialization.metadata["kind"].value == "dead_letters"
    assert materialization.metadata["redelivered"].value == 2
    assert {r[5] for r in letters(conn)} == {f"dagster run {only.run_id}", f"dagster run {rest.run_id}"}
    nothing = replay(dead_letters=True)
    assert nothing.success and "no open dead letters to redeliver" in run_log(instance, nothing)


def test_control_job_sets_aside_and_discards(conn: psycopg.Connection, db_url: str, ledger: dict[str, Any],
                                             tmp_path: Path, instance: dg.DagsterInstance) -> None:
    cfg = stream_config(tmp_path, db_url, {"type": "memory", "name": "control-dl"})
    control = build_definitions(cfg).resolve_job_def(CONTROL_JOB)

    def run(**config: Any) -> dg.ExecuteInProcessResult:
        return control.execute_in_process(run_config={"ops": {"stream_control": {"config": config}}},
                                          instance=instance, raise_on_error=False)

    b = ledger["b"]
    for config, message in (
        ({"action": "set_aside", "event_ids": [b[0]], "reason": "poison"}, "set confirm: set aside"),
        ({"action": "set_aside", "event_ids": [b[0], 10**9], "reason": "poison", "confirm": "set aside"},
         f"events {{{10**9}}} are not undelivered events of stream 1"),
        ({"action": "set_aside", "event_ids": [b[0]], "confirm": "set aside"}, "a reason is required"),
    ):
        result = run(stream_id=1, **config)
        assert not result.success and message in run_log(instance, result)
    assert letters(conn) == []
    ok = run(stream_id=1, action="set_aside", event_ids=[b[0], b[1], b[2]], reason="poison", confirm="set aside")
    assert ok.success and "3 events set aside as open dead letters" in run_log(instance, ok)
    one, two, three = (r[0] for r in letters(conn))

    for discard, message in (
        ({"dead_letter_ids": [one]}, "set confirm: discard"),
        ({"confirm": "discard"}, "give dead letter ids, or all of the stream's"),
        ({"dead_letter_ids": [one], "all_dead_letters": True, "confirm": "discard"}, "one of them"),
        ({"dead_letter_ids": [one, 5555], "confirm": "discard"}, "dead letters {5555} are not open dead letters"),
    ):
        result = run(stream_id=1, action="discard_dead_letters", **discard)
        assert not result.success and message in run_log(instance, result), discard
    assert {r[2] for r in letters(conn)} == {"open"}
    some = run(stream_id=1, action="discard_dead_letters", dead_letter_ids=[two], confirm="discard")
    assert some.success and "1 dead letters discarded" in run_log(instance, some)
    every = run(stream_id=1, action="discard_dead_letters", all_dead_letters=True, confirm="discard")
    assert every.success and "2 dead letters discarded" in run_log(instance, every)
    assert [(r[0], r[2], r[5]) for r in letters(conn)] == [
        (one, "discarded", f"dagster run {every.run_id}"), (two, "discarded", f"dagster run {some.run_id}"),
        (three, "discarded", f"dagster run {every.run_id}")]


def test_status_counts_open_dead_letters(conn: psycopg.Connection, ledger: dict[str, Any]) -> None:
    (row,) = stream_status(conn, 1, last=0)
    assert status_observation(row).metadata["open_dead_letters"].value == 0
    assert "dead letters: none open" in render_status([row])
    deadletters.set_aside(conn, 1, ledger["b"][:2], "poison")
    (row,) = stream_status(conn, 1, last=0)
    observation = status_observation(row)
    assert observation.metadata["open_dead_letters"].value == 2
    assert "oldest_dead_letter_at" in observation.metadata
    assert "dead letters: 2 open (oldest since" in render_status([row])


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_dead_letter_commands(conn: psycopg.Connection, db_url: str, ledger: dict[str, Any], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.jsonl"
    cfg = stream_config(tmp_path, db_url, {"type": "file", "path": str(out)})
    url = ["--database-url", db_url]
    a, b = ledger["a"], ledger["b"]

    def cli(*argv: str) -> tuple[int, str, str]:
        code = cli_main(list(argv))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    assert cli("dead-letters", "list", *url) == (0, "no open dead letters\n", "")
    # set-aside: needs --yes; wrong ids refused with a one-line error
    code, _, err = cli("dead-letters", "set-aside", "1", str(a[0]), "--reason", "poison", *url)
    assert code == 2 and "pass --yes" in err
    code, _, err = cli("dead-letters", "set-aside", "1", str(a[0]), "999999", "--reason", "poison", "--yes", *url)
    assert code == 1 and err.startswith("error: pgstream: events {999999} are not undelivered events of stream 1")
    assert err.count("\n") == 1
    code, text, _ = cli("dead-letters", "set-aside", "1", str(a[0]), str(b[1]), "--reason", "poison", "--yes", *url)
    assert code == 0 and "2 events set aside" in text
    first, second = (d.id for d in deadletters.list_dead_letters(conn, 1))

    code, text, _ = cli("dead-letters", "list", "1", *url)
    assert code == 0 and text.splitlines()[0].startswith(f"dead letter {first}: stream 1 event {a[0]} deliver "
                                                         f"batch {ledger['A']} #1, open, 0 attempts")
    assert len(text.splitlines()) == 2
    assert cli("dead-letters", "list", "1", "--limit", "1", *url)[1].endswith("--limit N for more)\n")
    delivered(conn, ledger["A"], ledger["B"])
    code, text, _ = cli("dead-letters", "show", str(second), *url)
    assert code == 0 and f"position: batch {ledger['B']} #2" in text
    assert "overtaken by: 1 delivered events of stream 1" in text  # b[2]
    assert '"tag": "b"' in text and "error: set aside by an operator: poison" in text
    code, _, err = cli("dead-letters", "show", "123456", *url)
    assert code == 1 and err == "error: dead letter 123456 does not exist\n"
    # a database without pgstream (the operator's URL names the wrong one): one line that says so
    code, _, err = cli("dead-letters", "show", "1", "--database-url", db_url.rsplit("/", 1)[0] + "/postgres")
    assert code == 1 and err == ('error: relation "pgstream.dead_letters" does not exist: pgstream is not installed '
                                 "in this database, or not at this version: run `pgstream-dagster migrate` (or "
                                 "`init`) with the owner's URL first\n")

    code, text, _ = cli("status", "1", *url)
    assert code == 0 and "dead letters: 2 open" in text
    assert cli("status", "99", *url) == (1, "", "error: stream 99 does not exist in this database "
                                               "(`pgstream-dagster status` lists the streams it has)\n")

    # redeliver: the sink from pgstream.yaml
    code, text, _ = cli("dead-letters", "redeliver", "1", str(second), "--config", str(cfg), "--dry-run")
    assert code == 0 and "would redeliver 1 of 1" in text and not out.exists()
    code, text, _ = cli("dead-letters", "redeliver", "1", str(second), "--config", str(cfg))
    assert code == 0 and f"redelivered 1 of 1 dead letters: {second}" in text
    assert [e["id"] for e in read_jsonl(out)] == [b[1]]
    code, _, err = cli("dead-letters", "redeliver", "1", str(second), "--config", str(cfg))
    assert code == 1 and f"error: dead letters {{{second}}} are not open dead letters of stream 1" in err
    code, _, err = cli("dead-letters", "redeliver", "7", "--config", str(cfg))
    assert code == 1 and err == "error: stream 7 is not configured\n"

    # discard: ids or --all, and --yes
    assert cli("dead-letters", "discard", "1", str(first), *url)[0] == 2
    assert cli("dead-letters", "discard", "1", "--yes", *url)[0] == 2  # neither ids nor --all
    code, _, err = cli("dead-letters", "discard", "1", str(second), "--yes", *url)
    assert code == 1 and f"dead letters {{{second}}} are not open dead letters of stream 1" in err
    code, text, _ = cli("dead-letters", "discard", "1", "--all", "--yes", *url)
    assert code == 0 and "1 dead letters discarded" in text
    code, text, _ = cli("dead-letters", "list", "1", "--all", *url)
    assert "redelivered" in text and "discarded" in text and "by cli " in text
    assert cli("status", "1", *url)[1].count("dead letters: none open") == 1


def test_engine_module_does_not_import_dagster() -> None:
    import subprocess

    code = ("import sys, pgstream_dagster.engine.deadletters; "
            "sys.exit(1 if any(m == 'dagster' or m.startswith('dagster.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent).returncode == 0
