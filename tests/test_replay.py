"""Replay jobs (by id range, time range, subscription keys, dry run) and the operator controls
(pause, resume, retry-now, skip) through Dagster jobs and the CLI, against real Postgres and a real
Dagster instance; replays go through Spark to a real file sink and are counted."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import CONTROL_JOB, REPLAY_JOB, REPLAY_OP, REPLAY_TAG, STREAM_TAG
from pgstream_dagster.engine.batches import BatchStatus

from .support.dagster_instance import run_log, step_failure
from .support.endpoint import Endpoint
from .support.harness import (
    Driver,
    backdated,
    event_ids,
    joined,
    read_jsonl,
    stream_tag_of,
    tick_until,
    values,
    write_config,
)
from .support.sinks import stream_entries

YESTERDAY = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(days=1)


@pytest.fixture
def replay_setup(db_url: str, tmp_path: Path) -> tuple[Path, Path]:
    """Stream 1 (file sink): 100 events of subscription 'a' created yesterday, 100 of 'b' today,
    and 50 events of stream 2 that a replay of stream 1 must never touch."""
    out = tmp_path / "replayed.jsonl"
    with psycopg.connect(db_url) as c:
        c.execute("select pgstream.create_partitions(2, %s)", [YESTERDAY.date()])
        c.execute("insert into pgstream.streams (id) values (1), (2)")
        backdated(c, "insert into pgstream.events (payload, stream_id, created_at) "
                  "select jsonb_build_object('tg_name', 'a', 'n', g), 1, %s + g * interval '1 second' "
                  "from generate_series(1, 100) g", [YESTERDAY])
        # as the same superuser, so that ids are 1..250 (a manual insert's id is not the next integer)
        backdated(c, "insert into pgstream.events (payload, stream_id) "
                  "select jsonb_build_object('tg_name', 'b', 'n', g), 1 from generate_series(1, 100) g")
        backdated(c, "insert into pgstream.events (payload, stream_id) "
                  "select jsonb_build_object('tg_name', 'a', 'n', g), 2 from generate_series(1, 50) g")
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "sink": {"type": "file", "path": str(out)}, "delivery": {"chunk_size": 7}},
        {"id": 2, "sink": {"type": "file", "path": str(tmp_path / "other.jsonl")}}])
    return cfg, out


def _replay(cfg: Path, instance: dg.DagsterInstance, stream_id: int = 1,
            **config: Any) -> dg.ExecuteInProcessResult:
    job = build_definitions(cfg).resolve_job_def(REPLAY_JOB)
    return job.execute_in_process(run_config={"ops": {REPLAY_OP: {"config": {"stream_id": stream_id, **config}}}},
                                  instance=instance, raise_on_error=False)


def _ids_before(url: str, before: dt.date) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute(
            "select id from pgstream.events where stream_id = 1 and created_at < %s order by id", [before])]


def test_replay_by_id_range_time_range_and_keys(replay_setup: tuple[Path, Path], db_url: str,
                                                instance: dg.DagsterInstance) -> None:
    cfg, out = replay_setup
    result = _replay(cfg, instance, from_event_id=20, to_event_id=150)
    assert result.success
    run = instance.get_run_by_id(result.run_id)
    assert run is not None  # tagged with its stream: the queue holds the stream's deliveries behind it, the UI filters
    assert run.tags[STREAM_TAG] == stream_tag_of(db_url, 1) and run.tags[REPLAY_TAG] == "true"
    assert [e["id"] for e in read_jsonl(out)] == list(range(20, 151))

    out.unlink()
    today = dt.datetime.now(dt.UTC).date()
    assert _replay(cfg, instance, to_time=today.isoformat()).success  # yesterday's only
    assert [e["id"] for e in read_jsonl(out)] == _ids_before(db_url, today)
    assert len(read_jsonl(out)) == 100

    out.unlink()
    assert _replay(cfg, instance, subscription_keys=["b"], from_event_id=150).success
    got = read_jsonl(out)
    assert [e["id"] for e in got] == list(range(150, 201))
    assert {e["payload"]["tg_name"] for e in got} == {"b"}

    out.unlink()
    result = _replay(cfg, instance, all_events=True, chunk_size=3)
    assert result.success
    assert [e["id"] for e in read_jsonl(out)] == list(range(1, 201))  # stream 2's events are not in it
    materialization = result.asset_materializations_for_node(REPLAY_OP)[0]
    assert materialization.metadata["events"].value == 200
    assert materialization.metadata["kind"].value == "replay"


def test_replay_dry_run_counts_and_bad_requests_deliver_nothing(replay_setup: tuple[Path, Path],
                                                                instance: dg.DagsterInstance) -> None:
    cfg, out = replay_setup
    dry = _replay(cfg, instance, subscription_keys=["a"], dry_run=True)
    assert dry.success
    assert dry.output_for_node(REPLAY_OP) == 0 and not out.exists()
    assert "replay of stream 1: 100 events" in run_log(instance, dry)
    # the Launchpad template's values (0, "": not given) select what leaving the fields out selects
    shown = _replay(cfg, instance, subscription_keys=["a"], dry_run=True, from_event_id=0, to_event_id=0,
                    from_time="", to_time="", chunk_size=0, dead_letter_ids=[], all_events=False, dead_letters=False)
    assert shown.success and "replay of stream 1: 100 events" in run_log(instance, shown)
    for config, message in (
        ({}, "give an event-id range, a time range or subscription keys"),
        ({"from_event_id": 0, "to_event_id": 0, "from_time": "", "to_time": ""},
         "give an event-id range, a time range or subscription keys"),
        ({"from_event_id": 9, "to_event_id": 3}, "from_event_id 9 is after to_event_id 3"),
        ({"from_time": "yesterday"}, "from_time: 'yesterday' is not an ISO 8601 timestamp"),
        ({"from_time": "2026-01-02", "to_time": "2026-01-01"}, "is not before to_time"),
    ):
        result = _replay(cfg, instance, **config)
        assert not result.success
        assert message in run_log(instance, result), config
    # the stream comes from the run config: none chosen, or one the code location does not have, is named in one
    # line with the streams there are, before anything is taken; the run is not tagged with a stream
    for stream_id, message in (
            (0, "stream_id: set the stream to replay (the template's 0 is none); the streams of this code location: "
                "1-2"),
            (7, "stream_id 7: no such stream to replay; the streams of this code location: 1-2")):
        result = _replay(cfg, instance, stream_id, all_events=True)
        failure = step_failure(result).strip()
        assert not result.success and failure.endswith(f"Failure: {message}") and "\n" not in failure, failure
        run = instance.get_run_by_id(result.run_id)
        assert run is not None and STREAM_TAG not in run.tags
    assert not out.exists()
    empty = _replay(cfg, instance, from_event_id=10**9)  # nothing selected: a success that delivers nothing
    assert empty.success and empty.output_for_node(REPLAY_OP) == 0
    assert "nothing to replay" in run_log(instance, empty) and not out.exists()
    assert not empty.asset_materializations_for_node(REPLAY_OP)


def _stream(url: str) -> dict[str, Any]:
    with psycopg.connect(url) as c, c.cursor(row_factory=psycopg.rows.dict_row) as cur:
        row = cur.execute("select * from pgstream.streams where id = 1").fetchone()
    assert row is not None
    return row


def _batches(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as c:
        return [(int(r[0]), str(r[1])) for r in c.execute("select id, status from pgstream.batches order by id")]


def test_operator_controls_from_the_ui_job_and_the_cli(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The stream is delivered by its reader group's delivery run (``default``), in the background: each step waits
    for what the operator's control changes (ticking the group's sensor, which decides for the stream)."""
    endpoint = Endpoint()
    try:
        cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
            {"id": 1, "batch": {"max_size": 10, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
             "retry": {"initial_backoff_secs": 3600, "max_backoff_secs": 3600}, "sink": endpoint.sink()}])
        driver = Driver(cfg, instance)
        control = driver.defs.resolve_job_def(CONTROL_JOB)

        def run_control(**config: Any) -> dg.ExecuteInProcessResult:
            return control.execute_in_process(run_config={"ops": {"stream_control": {"config": config}}},
                                              instance=instance, raise_on_error=False)

        tick_until(driver, 1, lambda: joined(db_url, 1))
        assert run_control(stream_id=1, action="pause").success
        with psycopg.connect(db_url) as c:
            c.execute("insert into pgstream.events (payload, stream_id) "
                      "select jsonb_build_object('n', g), 1 from generate_series(1, 30) g")
        tick_until(driver, 1, lambda: len(_batches(db_url)) == 3)  # recorded while paused
        for _ in range(2):
            assert not driver.tick(1).run_requests
        assert {status for _, status in _batches(db_url)} == {BatchStatus.PENDING}  # paused: nothing launched
        assert endpoint.unique() == set()
        assert run_control(stream_id=1, action="resume").success
        endpoint.mode = "error"
        tick_until(driver, 1, lambda: _stream(db_url)["failover_since"] is not None)
        for _ in range(2):  # failover, next retry in an hour
            driver.tick(1)
        assert endpoint.unique() == set()

        assert cli_main(["status", "--database-url", db_url]) == 0
        status = capsys.readouterr().out
        ids = event_ids(db_url, 1)
        assert "stream 1: FAILOVER" in status and f"checkpoint event {ids[0]}" in status and "HTTP 500" in status
        assert "30 undelivered events in 3 batches" in status

        endpoint.mode = "ok"
        assert cli_main(["retry-now", "1", "--database-url", db_url]) == 0  # no need to wait an hour
        assert "will be retried at the next sensor tick" in capsys.readouterr().out
        tick_until(driver, 1, lambda: len(endpoint.unique()) >= 30 and _stream(db_url)["failover_since"] is None
                   and driver.observations[-1].metadata["state"].value == "healthy", timeout=60)
        assert endpoint.unique() == set(ids) and len(ids) == 30
        assert cli_main(["status", "1", "--database-url", db_url]) == 0
        assert "stream 1: HEALTHY" in capsys.readouterr().out
        # the stream status asset was observed at every change of state, with the checkpoint
        states = [o.metadata["state"].value for o in driver.observations]
        assert states[0] == "healthy" and "failover" in states and states[-1] == "healthy"
        failover = next(o for o in driver.observations if o.metadata["state"].value == "failover")
        assert failover.asset_key == dg.AssetKey(["pgstream", "stream_1", "status"])
        assert failover.metadata["failover_checkpoint_event_id"].value == ids[0]
        assert "HTTP 500" in values(failover.metadata)["failover_error"]
        assert "| 1 | stream |" in values(failover.metadata)["last_batches"]

        # skip: refused without confirmation, then a poison batch is given up on
        endpoint.mode = "error"
        with psycopg.connect(db_url) as c:
            c.execute("insert into pgstream.events (payload, stream_id) values ('{\"poison\": true}', 1)")
        tick_until(driver, 1, lambda: BatchStatus.FAILED in {status for _, status in _batches(db_url)})
        with psycopg.connect(db_url) as c:
            (poison_batch,) = c.execute("select id from pgstream.batches where status = %s",
                                        [BatchStatus.FAILED]).fetchone() or ()
        assert not run_control(stream_id=1, action="skip_batch", batch_id=poison_batch).success  # no confirm
        assert cli_main(["skip", "1", str(poison_batch), "--database-url", db_url]) == 2  # no --yes
        assert run_control(stream_id=1, action="skip_batch", batch_id=poison_batch, confirm="skip").success
        tick_until(driver, 1, lambda: _stream(db_url)["failover_since"] is None)
        assert cli_main(["status", "1", "--database-url", db_url]) == 0
        out = capsys.readouterr().out
        assert "stream 1: HEALTHY" in out and BatchStatus.SKIPPED in out
        # errors are clear and change nothing
        assert not run_control(stream_id=9, action="pause").success
        assert cli_main(["pause", "9", "--database-url", db_url]) == 1
        assert "stream 9 does not exist" in capsys.readouterr().err
    finally:
        endpoint.down()


def test_replay_to_a_file_writes_what_the_sink_writes_without_spark(db_url: str, tmp_path: Path,
                                                                    instance: dg.DagsterInstance) -> None:
    """A file sink takes the lines Postgres renders (engine.replay.EVENT_JSON_LINE): byte for byte what
    the file sink writes for the same events read through Spark, for payloads and metadata that are
    hard to render (escapes, control characters, non-ASCII, huge numbers, JSON null, no metadata) and
    timestamps with and without microseconds; no Spark session is started."""
    from pyspark.sql import SparkSession

    from .support.harness import replay_through_spark

    with psycopg.connect(db_url) as c:
        c.execute("insert into pgstream.streams (id) values (1)")
        backdated(c, """
            insert into pgstream.events (payload, metadata, stream_id, created_at) values
              ('{"tg_name": "a", "s": "quote \\" backslash \\\\ newline \\n tab \\t ctl \\u0001 </script>"}',
               null, 1, '2026-01-02 03:04:05+00'),
              ('{"tg_name": "a", "s": "é 😀 \\u2028", "n": 1e400, "f": -0.000001, "arr": [null, true, {}]}',
               '{"region": "eu", "nested": {"k": [1, 2]}}', 1, '2026-01-02 03:04:05.000001+00'),
              ('{"tg_name": "b"}', 'null', 1, %s), ('{}', '{}', 1, %s)""",
                 [YESTERDAY + dt.timedelta(microseconds=123450), YESTERDAY.replace(year=1999)])
    out = tmp_path / "replayed.jsonl"
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [{"id": 1, "sink": {"type": "file", "path": str(out)},
                                                             "delivery": {"chunk_size": 3}}])
    active = SparkSession.getActiveSession()
    result = _replay(cfg, instance, all_events=True)
    assert result.success and result.output_for_node(REPLAY_OP) == 4
    assert SparkSession.getActiveSession() is active  # the file replay started no Spark session
    assert "replay of stream 1: 4 events (events first..last, time [-inf, +inf), subscriptions all) in 2 chunks" \
        in run_log(instance, result)

    spark_ok, spark_ids = replay_through_spark(cfg, 1, instance)
    from pgstream_dagster.sinks.memory import MemorySink
    through_spark = "".join(e.to_json() + "\n" for e in MemorySink.delivered("replay-1")).encode()
    assert spark_ok and len(spark_ids) == 4
    assert out.read_bytes() == through_spark
    got = read_jsonl(out)
    assert got[0]["payload"]["s"] == 'quote " backslash \\ newline \n tab \t ctl \x01 </script>'
    assert got[0]["created_at"] == "2026-01-02T03:04:05+00:00" and got[0]["metadata"] is None
    assert got[1]["created_at"] == "2026-01-02T03:04:05.000001+00:00" and got[1]["payload"]["n"] == 10**400
    assert got[1]["metadata"] == {"region": "eu", "nested": {"k": [1, 2]}}
    assert dt.datetime.fromisoformat(got[2]["created_at"]) == YESTERDAY + dt.timedelta(microseconds=123450)


def test_replay_to_a_file_that_cannot_be_written_fails_clearly(replay_setup: tuple[Path, Path], tmp_path: Path,
                                                                instance: dg.DagsterInstance, db_url: str) -> None:
    cfg, out = replay_setup
    out.mkdir()  # the sink's path is a directory
    result = _replay(cfg, instance, from_event_id=1, to_event_id=20)
    assert not result.success
    log = run_log(instance, result)
    assert f"file sink: events 1..7 (7 events): cannot append to {out}" in log
    assert not list(out.iterdir())
    with psycopg.connect(db_url, autocommit=True) as c:  # the result holds the error: no session with it
        assert _replay_sessions(c, 0) == 0


def _stream_seven(c: psycopg.Connection) -> list[int]:
    """Streams 7 and 8: 40 events, of subscriptions 'orders' and 'other', with a gap; the ids of
    stream 7's 'orders' events, in order."""
    c.execute("insert into pgstream.streams (id) values (7), (8) on conflict do nothing")
    c.execute("delete from pgstream.events where stream_id in (7, 8)")
    ids = [int(i) for (i,) in c.execute(
        "insert into pgstream.events (payload, stream_id) select pg_catalog.jsonb_build_object("
        "'tg_name', case when g % 3 = 0 then 'other' else 'orders' end, 'n', g), case when g % 5 = 0 "
        "then 8 else 7 end from generate_series(1, 40) g returning id").fetchall()]
    c.execute("delete from pgstream.events where id = any(%s)", [ids[10:14]])  # a gap
    return [int(i) for (i,) in c.execute(
        "select id from pgstream.events where stream_id = 7 and payload ->> 'tg_name' = 'orders' order by id")]


class _Orders:
    from_event_id = to_event_id = from_time = to_time = None
    subscription_keys = ["orders"]
    all_events = dead_letters = False
    dead_letter_ids: list[int] = []


def _replay_sessions(c: psycopg.Connection, expected: int) -> int:
    """The sessions of replays open now (waiting up to 10 s for them to be ``expected``: a closed
    connection's backend leaves pg_stat_activity when it has exited)."""
    deadline = time.monotonic() + 10
    while True:
        row = c.execute("select count(*) from pg_stat_activity where application_name = 'pgstream replay'").fetchone()
        n = int(row[0]) if row else -1
        if n == expected or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


@pytest.mark.parametrize("size", [1, 3, 4, 5, 100])
def test_ranges_and_their_count_come_from_one_pass(db_url: str, size: int) -> None:
    """The bounds of the replay's ranges and the count of the selection come from one scan: the ranges
    cover exactly the selected ids (gaps, other streams and keys left out), each holds ``size`` events
    but the last, and the count is known once the last range is out, for a multiple of ``size`` too."""
    from pgstream_dagster.engine.replay import IdRanges, selection

    with psycopg.connect(db_url, autocommit=True) as c:
        wanted = _stream_seven(c)
        params = selection(7, _Orders())
        ranges = IdRanges(c, params, size)
        bounds = list(ranges)
        assert ranges.total == len(wanted)
        per_range = [[i for i in wanted if lo <= i <= hi] for lo, hi in bounds]
        assert [i for chunk in per_range for i in chunk] == wanted
        assert all(len(chunk) == size for chunk in per_range[:-1]) and 1 <= len(per_range[-1]) <= size
        assert [lo for lo, _hi in bounds] == [chunk[0] for chunk in per_range]

        params_none = {**params, "keys": ["nobody"]}
        empty = IdRanges(c, params_none, size)
        assert list(empty) == [] and empty.total == 0

    with psycopg.connect(db_url) as c2:  # in a transaction of the caller's: each walk is a savepoint of it
        c2.execute("select 1")
        assert list(IdRanges(c2, params, size)) == bounds == list(IdRanges(c2, params, size))


def test_lines_come_in_order_with_the_count_and_leave_nothing_open(db_url: str) -> None:
    """``read_lines``: the selection's events as lines of ``size`` events in id order, the count once
    (from the walk of the ids, which runs ahead in a thread); a caller that stops early stops the walk
    and closes every session; a walk that fails fails the caller instead of leaving it waiting."""
    import threading

    from pgstream_dagster.engine import replay
    from pgstream_dagster.engine.replay import Counted, Lines, read_lines, selection

    with psycopg.connect(db_url, autocommit=True) as c:
        wanted = _stream_seven(c)
        params = selection(7, _Orders())
        items = list(read_lines(db_url, params, 4))
        counts = [i.events for i in items if isinstance(i, Counted)]
        chunks = [i for i in items if isinstance(i, Lines)]
        assert counts == [len(wanted)]
        lines = [json.loads(line) for chunk in chunks for line in chunk.data.decode().splitlines()]
        assert [e["id"] for e in lines] == wanted and {e["stream_id"] for e in lines} == {7}
        assert [chunk.count for chunk in chunks] == [4] * (len(wanted) // 4) + [len(wanted) % 4] * bool(len(wanted) % 4)
        assert all(chunk.first_id == ids[0] and chunk.last_id == ids[-1] for chunk, ids in zip(
            chunks, [wanted[i:i + 4] for i in range(0, len(wanted), 4)], strict=True))

        reader = read_lines(db_url, params, 1)
        assert isinstance(next(x for x in reader if isinstance(x, Lines)), Lines)
        assert _replay_sessions(c, 3) == 3  # the walk and two readers
        reader.close()  # the caller stops after one chunk
        assert _replay_sessions(c, 0) == 0
        assert not [t for t in threading.enumerate() if t.name.startswith("pgstream-replay")]

        real_iter = replay.IdRanges.__iter__

        def broken(self: replay.IdRanges) -> Any:
            with closing(real_iter(self)) as walked:
                yield next(walked)
                raise psycopg.OperationalError("the walk's connection was lost")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(replay.IdRanges, "__iter__", broken)
            got: list[Counted | Lines] = []
            with pytest.raises(psycopg.OperationalError, match="the walk's connection was lost"):
                got.extend(read_lines(db_url, params, 4))
        assert [chunk.count for chunk in got if isinstance(chunk, Lines)] == [4]  # the range walked before it
        assert _replay_sessions(c, 0) == 0


def test_replay_to_a_broker_reads_without_spark(replay_setup: tuple[Path, Path], db_url: str, tmp_path: Path,
                                               instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sink that takes no JSON lines (Redis here) gets the selected events read by the run's own
    connections (delivery.tuning.direct_max_events above 0, the default), in id order, with the same
    selections and the same events as the file replay's lines and as the Spark read it replaces; a
    chunk_size smaller than the ranges, and ranges of several chunks, keep the order."""
    import redis

    from pgstream_dagster.engine.delivery import sources

    monkeypatch.setattr(sources, "FETCH_ROWS", 30)  # ranges of 30 events: 7 for the whole stream
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    key = f"pgstream-replay-{uuid.uuid4().hex[:8]}"
    cfg = write_config(tmp_path / "redis.yaml", db_url, [
        {"id": 1, "sink": {"type": "redis", "url": "redis://127.0.0.1:6379/0", "stream": key},
         "delivery": {"chunk_size": 7}},
        {"id": 2, "sink": {"type": "file", "path": str(tmp_path / "other.jsonl")}}])
    file_cfg, out = replay_setup

    def replayed(cfg: Path, **config: Any) -> list[dict[str, Any]]:
        client.delete(key)
        result = _replay(cfg, instance, **config)
        assert result.success, step_failure(result)
        return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in stream_entries(client, key)]

    try:
        got = replayed(cfg, from_event_id=20, to_event_id=150)
        assert [int(e["id"]) for e in got] == list(range(20, 151))
        today = dt.datetime.now(dt.UTC).date()
        assert [int(e["id"]) for e in replayed(cfg, to_time=today.isoformat())] == _ids_before(db_url, today)
        got = replayed(cfg, subscription_keys=["b"], from_event_id=150)
        assert [int(e["id"]) for e in got] == list(range(150, 201))
        assert {json.loads(e["payload"])["tg_name"] for e in got} == {"b"}

        result = _replay(cfg, instance, all_events=True, chunk_size=3)
        assert "200 events (events first..last, time [-inf, +inf), subscriptions all) in 7 ranges read without " \
            "Spark" in run_log(instance, result)
        direct = [{k.decode(): v.decode() for k, v in f.items()} for _, f in stream_entries(client, key)][-200:]
        assert [int(e["id"]) for e in direct] == list(range(1, 201))

        # the same events, field for field, as the file replay's lines (created_at, payload, metadata)
        assert _replay(file_cfg, instance, all_events=True).success
        lines = read_jsonl(out)
        assert [(str(e["id"]), e["created_at"], json.loads(d["payload"])) for e, d in zip(lines, direct, strict=True)
                ] == [(d["id"], d["created_at"], e["payload"]) for e, d in zip(lines, direct, strict=True)]
    finally:
        client.delete(key)


def test_a_replay_without_spark_stops_at_a_failing_sink_and_a_new_one_delivers_all(
        replay_setup: tuple[Path, Path], db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A webhook that fails mid-replay (from its 5th request of 7 events on): the run fails, saying so; what
    the sink confirmed before is a prefix of the selection in id order, nothing after the failure is
    sent; a new replay once the webhook is back delivers every event, in order (at-least-once: the
    prefix twice)."""
    from pgstream_dagster.engine.delivery import sources

    monkeypatch.setattr(sources, "FETCH_ROWS", 30)
    endpoint = Endpoint()
    try:
        cfg = write_config(tmp_path / "http.yaml", db_url, [
            {"id": 1, "sink": endpoint.sink(), "delivery": {"chunk_size": 7}},
            {"id": 2, "sink": {"type": "file", "path": str(tmp_path / "other.jsonl")}}])
        endpoint.hook = lambda n: setattr(endpoint, "mode", "error") if n == 4 else None
        failed = _replay(cfg, instance, all_events=True)
        assert not failed.success
        assert "http sink: events 29..35 (7 events): POST" in run_log(instance, failed)
        assert endpoint.accepted == list(range(1, 29))  # four chunks of 7, in order; nothing after
        endpoint.hook, endpoint.mode = None, "ok"
        assert _replay(cfg, instance, all_events=True).success
        assert endpoint.accepted[28:] == list(range(1, 201))
    finally:
        endpoint.down()


def test_the_replay_says_whether_events_were_added_or_removed_while_it_ran(
        replay_setup: tuple[Path, Path], db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An unbounded replay also delivers what commits into its selection after it was planned, and not
    what is deleted before it is read: the run log says which happened, how many, and what the replay did."""
    from pgstream_dagster.engine.delivery import sources

    monkeypatch.setattr(sources, "FETCH_ROWS", 30)
    endpoint = Endpoint()
    try:
        cfg = write_config(tmp_path / "http.yaml", db_url, [
            {"id": 1, "sink": endpoint.sink(), "delivery": {"chunk_size": 7}},
            {"id": 2, "sink": {"type": "file", "path": str(tmp_path / "other.jsonl")}}])

        def on_first(statement: str) -> Any:
            def hook(n: int) -> None:
                if n == 1:
                    with psycopg.connect(db_url, autocommit=True) as c:
                        c.execute(statement)
            return hook

        endpoint.hook = on_first("insert into pgstream.events (payload, stream_id) "
                                 "select jsonb_build_object('tg_name', 'a', 'n', g), 1 from generate_series(1, 5) g")
        added = _replay(cfg, instance, all_events=True)
        assert added.success, step_failure(added)
        assert len(endpoint.accepted) == 205
        log = run_log(instance, added)
        assert ("200 events were planned but 205 were delivered: 5 more events were committed within the selection "
                "after the replay was planned") in log
        assert "removed" not in log and "deleted" not in log

        endpoint.accepted.clear()
        endpoint.requests = 0
        endpoint.hook = on_first("delete from pgstream.events where stream_id = 1 and id between 190 and 195")
        removed = _replay(cfg, instance, all_events=True)
        assert removed.success, step_failure(removed)
        assert len(endpoint.accepted) == 199
        log = run_log(instance, removed)
        assert ("205 events were planned but 199 were delivered: 6 of the selected events were deleted (retention) "
                "before the replay read them; the replay delivered the others") in log
        assert "committed" not in log
    finally:
        endpoint.down()
