"""Backfills: existing rows become READ events of a subscription, through the real job (Spark) and
the CLI, against a real Postgres with logical replication, delivered by the real pipeline to a
file sink and counted; the engine's stop / resume / ownership / bad-row paths; what a backfill
refuses; who evaluates what."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import BACKFILL_JOB, BACKFILL_OP, BACKFILL_TAG, STREAM_TAG
from pgstream_dagster.engine import backfill
from pgstream_dagster.engine.bootstrap import init

from .support.dagster_dev import repo_root
from .support.dagster_instance import run_log, step_failure
from .support.harness import Driver, read_jsonl, write_config

ITEMS = """
create table public.items (id bigint primary key, name text not null, qty int not null, status text not null);
insert into public.items
select g, 'item ' || g, g % 7, case when g % 5 = 0 then 'hidden' else 'ok' end from generate_series(1, %s) g;
"""


def _items(url: str, rows: int) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(ITEMS.replace("%s", str(int(rows))))


def _subscription(op: str = "INSERT", **extra: Any) -> dict[str, Any]:
    return {"key": "items", "stream_id": 1, "operation": op, "schema_name": "public", "table_name": "items",
            "column_names": ["id", "name", "qty", "status"], **extra}


def _config(tmp_path: Path, url: str, subscriptions: list[dict[str, Any]]) -> tuple[Path, Path]:
    out = tmp_path / "sink.jsonl"
    cfg = write_config(tmp_path / "pgstream.yaml", url, [
        {"id": 1, "batch": {"max_size": 5000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 1},
         "delivery": {"chunk_size": 1000}, "sink": {"type": "file", "path": str(out)}}], subscriptions)
    init(cfg)
    return cfg, out


def _launch(cfg: Path, instance: dg.DagsterInstance, **config: Any) -> dg.ExecuteInProcessResult:
    job = build_definitions(cfg).resolve_job_def(BACKFILL_JOB)
    return job.execute_in_process(run_config={"ops": {BACKFILL_OP: {"config": {"stream_id": 1, **config}}}},
                                  instance=instance, raise_on_error=False)


def _deliver_all(cfg: Path, instance: dg.DagsterInstance, url: str, out: Path) -> list[dict[str, Any]]:
    """Tick and run deliveries until every event of stream 1 is in the sink."""
    with psycopg.connect(url) as c:
        total = c.execute("select count(*) from pgstream.events where stream_id = 1").fetchone()[0]  # type: ignore[index]
    Driver(cfg, instance).run_until(1, lambda: len(read_jsonl(out)) >= total, timeout=400)
    return read_jsonl(out)


def _reads(events: Sequence[dict[str, Any]]) -> Counter[int]:
    return Counter(e["payload"]["new"]["id"] for e in events if e["payload"]["tg_op"] == "READ")


def _ok_rows_but_qty_3(url: str) -> set[int]:
    with psycopg.connect(url) as c:
        return {r[0] for r in c.execute("select id from public.items where status = 'ok' and qty <> 3")}


def _thread_executor(url: str) -> backfill.Executor:
    """Partitions in threads (the engine's own run_partition, without Spark): for the engine's paths."""
    def execute(backfill_id: int, token: str, parts: Sequence[int], chunk_size: int,
                pace: backfill.Pace) -> list[backfill.PartitionResult]:
        with ThreadPoolExecutor(len(parts)) as pool:
            return list(pool.map(lambda p: backfill.run_partition(url, backfill_id, p, token, chunk_size, pace), parts))
    return execute


def _run(url: str, request: backfill.Request, backfill_id: int, **kwargs: Any) -> backfill.Outcome:
    steps = list(backfill.run(url, backfill_id, request, _thread_executor(url), run_id="test", **kwargs))
    outcome = steps[-1]
    assert isinstance(outcome, backfill.Outcome)
    return outcome


def _open(url: str, request: backfill.Request) -> tuple[backfill.Target, int]:
    with psycopg.connect(url, autocommit=True) as c:
        (target,) = backfill.targets(c, request)
        backfill_id, _ = backfill.open_backfill(c, target, request)
    return target, backfill_id


def _read_payloads(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select payload from pgstream.events where payload->>'tg_op' = 'READ' "
                                        "order by id")]


# ------------------------------------------------------------------------------------------------
# End to end.

def test_backfill_50k_rows_in_parallel_exactly_once_after_a_kill(db_url: str, tmp_path: Path,
                                                                  instance: dg.DagsterInstance) -> None:
    """50,000 rows, when_clause + filter, parallelism 4: the CLI starts it and is killed (-9, with its
    Spark) mid-run; the job resumes it; every selected row reaches the sink exactly once as a READ
    event whose payload is the live trigger's."""
    _items(db_url, 50_000)
    cfg, out = _config(tmp_path, db_url, [_subscription(
        when_clause="new.status = 'ok'", payload_extensions=[{"json_path": "group_id", "expression": "new.id::text"}],
        metadata={"source": "items"})])
    where = "new.qty <> 3"
    expected = _ok_rows_but_qty_3(db_url)
    assert len(expected) > 30_000

    cli = subprocess.Popen(
        [sys.executable, "-m", "pgstream_dagster.cli", "backfill", "run", "1", "items", "--config", str(cfg),
         "--where", where, "--parallelism", "4", "--chunk-size", "500", "--max-rows-per-sec", "3000",
         "--progress-secs", "1"], cwd=repo_root(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, env={**os.environ, "PYTHONPATH": str(repo_root())})
    try:
        deadline = time.monotonic() + 240
        with psycopg.connect(db_url, autocommit=True) as c:
            while True:
                row = c.execute("select rows_read from pgstream.backfill_progress").fetchone()
                if row and row[0] >= 6000:
                    break
                assert cli.poll() is None, cli.stdout.read().decode() if cli.stdout else ""
                assert time.monotonic() < deadline, "the CLI backfill made no progress"
                time.sleep(0.2)
    finally:
        os.killpg(cli.pid, signal.SIGKILL)  # the CLI, its Spark JVM and Python workers, mid-chunk
        cli.wait()
    with psycopg.connect(db_url, autocommit=True) as c:
        status, read = c.execute("select status, rows_read from pgstream.backfill_progress").fetchone()  # type: ignore[misc]
    assert status == "running" and 6000 <= read < 50_000  # its owner is gone; the lock went with its session

    # resumed by the job (same selection), unthrottled
    result = _launch(cfg, instance, subscriptions=["items"], where=where, parallelism=4, chunk_size=500,
                     max_rows_per_sec=0)
    assert result.success, result.all_events
    run = instance.get_run_by_id(result.run_id)
    assert run is not None and run.tags[BACKFILL_TAG] == "1"  # the run's stream, once it started
    with psycopg.connect(db_url, autocommit=True) as c:
        progress = backfill.list_backfills(c, 1)
    assert len(progress) == 1 and progress[0].status == "done" and progress[0].rows_read == 50_000
    assert progress[0].events_written == len(expected)
    asset = dg.AssetKey(["pgstream", "stream_1", "subscriptions", "items_insert_public_items"])
    seen = instance.fetch_observations(asset, limit=5).records  # never materialized (init applied it)
    assert seen and seen[0].asset_observation is not None
    assert seen[0].asset_observation.metadata["status"].value == "done"
    log = run_log(instance, result)
    assert "resuming backfill 1 of subscription \"items\" (INSERT) on public.items" in log
    assert "done, 50000/50000 rows (100%)" in log

    events = _deliver_all(cfg, instance, db_url, out)
    reads = _reads(events)
    assert set(reads) == expected and max(reads.values()) == 1  # every selected row once: none lost, none twice

    # the payload is the live trigger's: the same rows inserted again write INSERT events
    sample = sorted(expected)[:3]
    by_id = {e["payload"]["new"]["id"]: e for e in events if e["payload"]["tg_op"] == "READ"}
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table items_copy as select * from public.items where id = any(%s)", [sample])
        c.execute("delete from public.items where id = any(%s)", [sample])
        c.execute("insert into public.items select * from items_copy")
        live = {r[0]["new"]["id"]: r for r in c.execute(
            "select payload, metadata from pgstream.events where payload->>'tg_op' = 'INSERT'")}
    for i in sample:
        read, (payload, metadata) = by_id[i], live[i]
        assert {k: v for k, v in read["payload"].items() if k not in ("tg_op", "timestamp")} == \
               {k: v for k, v in payload.items() if k not in ("tg_op", "timestamp")}
        assert read["metadata"] == metadata == {"source": "items"}
        assert read["payload"]["old"] is None and read["payload"]["group_id"] == str(i)


def test_backfill_job_is_not_queued_with_deliveries_and_names_the_streams_there_are(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [{"id": i, "sink": {"type": "file", "path": "x"}}
                                                            for i in (1, 2, 3, 5)])
    job = build_definitions(cfg).resolve_job_def(BACKFILL_JOB)
    # the run queue limits backfills by the tag's key; live delivery runs go on beside them
    assert job.tags.get(BACKFILL_TAG) == "true" and STREAM_TAG not in job.tags
    for stream_id, message in (
            (0, "stream_id: set the stream to backfill (the template's 0 is none); the streams of this code "
                "location: 1-3, 5"),
            (4, "stream_id 4: no such stream to backfill; the streams of this code location: 1-3, 5")):
        result = job.execute_in_process(run_config={"ops": {BACKFILL_OP: {"config": {
            "stream_id": stream_id, "subscriptions": ["items"]}}}}, instance=instance, raise_on_error=False)
        failure = step_failure(result).strip()
        assert not result.success and failure.endswith(f"Failure: {message}") and "\n" not in failure, failure
        run = instance.get_run_by_id(result.run_id)
        assert run is not None and run.tags[BACKFILL_TAG] == "true"


def test_backfill_consistent_with_concurrent_changes(db_url: str, tmp_path: Path,
                                                     instance: dg.DagsterInstance) -> None:
    """Updates, deletes and inserts while a parallel backfill runs: a consumer applying the stream's
    events in order (READ/INSERT/UPDATE set a row, DELETE removes it) ends with the table's state."""
    _items(db_url, 8000)
    cfg, out = _config(tmp_path, db_url, [_subscription("INSERT"), _subscription("UPDATE"), _subscription("DELETE")])
    stop = threading.Event()
    changes = Counter[str]()

    def writer() -> None:
        rng = random.Random(7)
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute("set lock_timeout = '30s'")
            next_id = 100_000
            while not stop.is_set():
                op = rng.choice(("update", "update", "update", "delete", "insert"))
                i = rng.randint(1, 8000)
                if op == "update":
                    c.execute("update public.items set qty = qty + 1, name = name || '+' where id = %s", [i])
                elif op == "delete":
                    c.execute("delete from public.items where id = %s", [i])
                else:
                    next_id += 1
                    c.execute("insert into public.items values (%s, 'new', 1, 'ok')", [next_id])
                changes[op] += 1
                # (about 200 changes a second, whatever the host: the rows still there from the start, counted
                # below, do not depend on how long the backfill's Spark session takes to start)
                stop.wait(0.005)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        result = _launch(cfg, instance, subscriptions=["items"], parallelism=3, chunk_size=100,
                         max_rows_per_sec=1500, progress_secs=1)
    finally:
        stop.set()
        thread.join(30)
    assert result.success, result.all_events
    assert changes["update"] > 100 and changes["delete"] > 10, changes  # the writer ran during the backfill

    events = _deliver_all(cfg, instance, db_url, out)
    state: dict[int, dict[str, Any]] = {}
    for e in events:  # in delivery (commit) order
        p = e["payload"]
        if p["tg_op"] == "DELETE":
            state.pop(p["old"]["id"], None)
        else:
            state[p["new"]["id"]] = p["new"]
    with psycopg.connect(db_url) as c:
        table = {r[0]: {"id": r[0], "name": r[1], "qty": r[2], "status": r[3]}
                 for r in c.execute("select id, name, qty, status from public.items")}
    assert state == table
    # the changes really interleaved with the reads: rows updated both before and after their READ event
    order = [(e["payload"]["tg_op"], (e["payload"]["new"] or e["payload"]["old"])["id"]) for e in events]
    read_at = {i: n for n, (op, i) in enumerate(order) if op == "READ"}
    updated = [(n, i) for n, (op, i) in enumerate(order) if op == "UPDATE" and i in read_at]
    assert any(n < read_at[i] for n, i in updated) and any(n > read_at[i] for n, i in updated)
    # every row there from the start to the end was read, once (how many the writer deleted before
    # their read depends on its speed against the backfill's: not a fixed count)
    reads, kept = _reads(events), {i for i in table if i <= 8000}
    assert len(kept) > 1000 and kept <= set(reads) and max(reads.values()) == 1


# ------------------------------------------------------------------------------------------------
# The engine: stop, resume, ownership, a changed subscription, a bad row.

@pytest.fixture
def items_stream(db_url: str, tmp_path: Path) -> str:
    _items(db_url, 3000)
    _config(tmp_path, db_url, [_subscription("INSERT"), _subscription("DELETE")])
    return db_url


def test_stop_resume_and_one_run_at_a_time(items_stream: str) -> None:
    url = items_stream
    # 150 rows/s: a round (5 s) reads 250 rows per partition, then the driver waits
    request = backfill.Request(1, ["items"], parallelism=3, chunk_size=50, max_rows_per_sec=150)
    target, backfill_id = _open(url, request)
    assert target.operation == "INSERT"  # the key's DELETE subscription has no rows to read

    # another session holds the backfill: a second run is refused, changing nothing
    with psycopg.connect(url, autocommit=True) as holder:
        assert backfill.lock(holder, backfill_id)
        with pytest.raises(backfill.BackfillBusy, match=f"backfill {backfill_id} .* is running in another process"):
            list(backfill.run(url, backfill_id, request, _thread_executor(url), run_id="second"))
    # a second launch of the same subscription resumes that backfill (one unfinished per subscription)
    assert _open(url, request)[1] == backfill_id

    # stopped by an operator mid-run: chunks in flight commit, the run ends, nothing is read twice
    def stop_soon() -> None:
        with psycopg.connect(url, autocommit=True) as c:
            while backfill.progress(c, backfill_id).rows_read < 500:
                time.sleep(0.05)
            backfill.stop(c, backfill_id, cancel=False)

    stopper = threading.Thread(target=stop_soon)
    stopper.start()
    outcome = _run(url, request, backfill_id, progress_secs=0.2)
    stopper.join()
    assert outcome.progress.status == "stopped" and 500 <= outcome.progress.rows_read < 3000
    assert {r.status for r in outcome.results} == {"stopped"}

    # closing the run early (a cancelled Dagster run, Ctrl-C) stops it too
    steps = backfill.run(url, backfill_id, request, _thread_executor(url), run_id="closed", progress_secs=0.1)
    assert isinstance(next(steps), backfill.Progress)
    steps.close()
    with psycopg.connect(url, autocommit=True) as c:
        assert backfill.progress(c, backfill_id).status == "stopped"

    outcome = _run(url, backfill.Request(1, ["items"], chunk_size=500), backfill_id)
    assert outcome.done and outcome.progress.rows_read == 3000
    payloads = _read_payloads(url)
    assert sorted(p["new"]["id"] for p in payloads) == list(range(1, 3001))  # exactly once across three runs
    with psycopg.connect(url, autocommit=True) as c:
        assert c.execute("select count(*) from pg_proc where proname = %s",
                         [f"_backfill_{backfill_id}"]).fetchone() == (0,)  # its function went with it
        # a finished backfill is not resumed: the next launch starts a new one
        assert _open(url, request)[1] != backfill_id


def test_a_changed_subscription_applies_to_the_rows_not_read_yet(items_stream: str) -> None:
    url = items_stream
    request = backfill.Request(1, ["items"], parallelism=1, chunk_size=100)
    _, backfill_id = _open(url, request)
    steps = backfill.run(url, backfill_id, backfill.Request(1, ["items"], parallelism=1, chunk_size=100,
                                                            max_rows_per_sec=100), _thread_executor(url),
                         run_id="first", progress_secs=0.3)
    next(steps)
    steps.close()
    with psycopg.connect(url, autocommit=True) as c:
        done = backfill.progress(c, backfill_id).rows_read
        c.execute("""update pgstream.subscriptions set payload_extensions =
                     '[{"json_path": "v2", "expression": "true"}]' where key = 'items' and operation = 'INSERT'""")
    assert 0 < done < 3000
    assert _run(url, request, backfill_id).done
    payloads = _read_payloads(url)
    assert sorted(p["new"]["id"] for p in payloads) == list(range(1, 3001))
    assert [p["new"]["id"] for p in payloads if "v2" not in p] == list(range(1, done + 1))


def test_a_row_that_cannot_become_an_event_is_named_and_holds_only_its_partition(db_url: str, tmp_path: Path) -> None:
    _items(db_url, 2000)
    _config(tmp_path, db_url, [_subscription(when_clause="100 / (new.qty - 3) <> 0 or new.id = 1234")])
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("update public.items set qty = 0 where qty = 3 and id <> 1234")  # one bad row left: 1234
        c.execute("update public.items set qty = 3 where id = 1234")
    request = backfill.Request(1, ["items"], parallelism=2, chunk_size=300)
    _, backfill_id = _open(db_url, request)
    outcome = _run(db_url, request, backfill_id)
    assert outcome.progress.status == "failed"
    assert "row with key [1234]: division by zero" in (outcome.progress.error or "")
    assert sorted(r.status for r in outcome.results) == ["done", "failed"]  # the other partition finished
    ids = sorted(p["new"]["id"] for p in _read_payloads(db_url))
    assert ids == list(range(1, 1234))  # partition 0 whole, partition 1 up to the bad row, each once

    with psycopg.connect(db_url, autocommit=True) as c:  # the operator fixes the row and resumes
        c.execute("update public.items set qty = 4 where id = 1234")
    assert _run(db_url, request, backfill_id).done
    assert sorted(p["new"]["id"] for p in _read_payloads(db_url)) == list(range(1, 2001))


# ------------------------------------------------------------------------------------------------
# What a backfill refuses, and who evaluates what.

@pytest.mark.parametrize(("setup", "request_kwargs", "message"), [
    ("", {"where": "new.qty > (select 1)"}, "where: subqueries are not allowed"),
    ("", {"where": "new.qty > 1; drop table public.items"}, 'where: statement separator ";" is not allowed'),
    ("", {"where": "new.qty"}, "where: must be a boolean expression, got type integer"),
    ("", {"where": "new.nope = 1"}, 'where: column new.nope does not exist'),
    ("", {"from_key": ["abc"]}, 'invalid input syntax for type bigint: "abc"'),
    ("", {"to_key": ["1", "2"]}, '"to" must give one value for each primary key column of public.items'),
    ("", {"keys": ["gone"]}, 'stream 1 has no INSERT or UPDATE subscription "gone"'),
    ("", {"keys": ["items-deleted"]}, 'no INSERT or UPDATE subscription "items-deleted"'),
    ("alter table public.items drop constraint items_pkey", {}, "has no primary key"),
])
def test_bad_requests_are_refused_and_change_nothing(db_url: str, tmp_path: Path, setup: str,
                                                     request_kwargs: dict[str, Any], message: str) -> None:
    _items(db_url, 10)
    _config(tmp_path, db_url, [_subscription(), {**_subscription("DELETE"), "key": "items-deleted"}])
    if setup:
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute(setup)
    request = backfill.Request(1, request_kwargs.pop("keys", ["items"]), **request_kwargs)
    with psycopg.connect(db_url, autocommit=True) as c, pytest.raises(backfill.BackfillError) as raised:
        for target in backfill.targets(c, request):
            backfill.open_backfill(c, target, request)
    assert message in str(raised.value)
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.backfills").fetchone() == (0,)
        assert c.execute("select count(*) from pg_proc where proname ~ '^_backfill_[0-9]+$'").fetchone() == (0,)
        assert c.execute("select count(*) from pgstream.events").fetchone() == (0,)


def test_filter_runs_as_pgstream_writer_and_roles_cannot_touch_backfills(items_stream: str) -> None:
    url = items_stream
    with psycopg.connect(url, autocommit=True) as c:
        # an application role's function, called by the filter: it sees who evaluates it
        c.execute("create role app_owner login")
        c.execute("create function public.evaluated_as_writer(i int) returns boolean language sql "
                  "as $$ select current_user = 'pgstream_writer' $$")
        c.execute("alter function public.evaluated_as_writer(int) owner to app_owner")
        c.execute("grant execute on function public.evaluated_as_writer(int) to pgstream_writer")
    request = backfill.Request(1, ["items"], where="public.evaluated_as_writer(new.qty)", parallelism=2)
    _, backfill_id = _open(url, request)
    assert _run(url, request, backfill_id).progress.events_written == 3000  # true for every row: pgstream_writer

    with psycopg.connect(url, autocommit=True) as c:
        c.execute("create role intruder login")
        c.execute("grant usage on schema pgstream to intruder")
        owner = c.execute("select proowner::regrole::text from pg_proc where proname = %s",
                          [f"_backfill_{backfill_id}"]).fetchone()
    assert owner is None  # dropped once done
    with psycopg.connect(url, user="intruder", autocommit=True) as intruder:  # a fresh session
        for sql in ("select * from pgstream.backfills", "select * from pgstream.backfill_progress",
                    "select pgstream.backfill_start(1, 'items', 'public', 'items', null, null, null, 1)",
                    "select pgstream.backfill_try_lock(1)", f"select pgstream.backfill_stop({backfill_id}, true)",
                    "select * from pgstream.backfill_chunk(1, 0, gen_random_uuid(), 10)"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                intruder.execute(sql)


def test_composite_key_range_in_parallel_partitions(db_url: str, tmp_path: Path) -> None:
    """A two-column key (text, int), split in 3 partitions, read 37 rows at a time, bounded by
    from/to (inclusive): every row of the range once, in no other event."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table public.pairs (region text, n int, note text, primary key (region, n))")
        c.execute("insert into public.pairs select r, g, 'x' from unnest(array['eu', 'us', 'ap']) r, "
                  "generate_series(1, 400) g")
    _config(tmp_path, db_url, [{"key": "pairs", "stream_id": 1, "operation": "INSERT", "table_name": "pairs",
                                "column_names": ["region", "n"]}])
    request = backfill.Request(1, ["pairs"], from_key=["ap", "350"], to_key=["us", "10"], parallelism=3,
                               chunk_size=37)
    _, backfill_id = _open(db_url, request)
    outcome = _run(db_url, request, backfill_id)
    assert outcome.done and outcome.progress.partitions == 3
    got = Counter((p["new"]["region"], p["new"]["n"]) for p in _read_payloads(db_url))
    want = {("ap", n) for n in range(350, 401)} | {("eu", n) for n in range(1, 401)} | {("us", n) for n in range(1, 11)}
    assert set(got) == want and max(got.values()) == 1


def test_update_subscription_in_its_own_schema_sees_old_as_null(db_url: str, tmp_path: Path) -> None:
    """A key with only an UPDATE subscription, on a table in a schema pgstream_writer has no USAGE
    on: its when_clause and extensions read old.* as null; payload like its live UPDATE events."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create schema shop")
        c.execute("revoke all on schema shop from public")
        c.execute("create table shop.orders (id int primary key, total numeric)")
        c.execute("insert into shop.orders select g, g * 1.5 from generate_series(1, 300) g")
    _config(tmp_path, db_url, [{"key": "order-total", "stream_id": 1, "operation": "UPDATE", "schema_name": "shop",
                                "table_name": "orders", "column_names": ["id", "total"],
                                "when_clause": "new.total is distinct from old.total",
                                "payload_extensions": [{"json_path": "previous", "expression": "old.total"}]}])
    request = backfill.Request(1, ["order-total"], parallelism=2, chunk_size=64)
    target, backfill_id = _open(db_url, request)
    assert target.operation == "UPDATE"
    assert _run(db_url, request, backfill_id).done
    payloads = _read_payloads(db_url)
    assert sorted(p["new"]["id"] for p in payloads) == list(range(1, 301))
    assert {(p["old"], p["previous"], p["tg_table_schema"]) for p in payloads} == {(None, None, "shop")}


def test_a_backfill_waits_while_the_stream_has_a_large_backlog(items_stream: str) -> None:
    """``max_backlog``: no chunk while the stream has more undelivered events than that (live
    events never queue behind more READ events); it goes on once the stream caught up."""
    url = items_stream
    with psycopg.connect(url, autocommit=True) as c:  # 50,000 recorded, 10,000 delivered: 40,000 undelivered
        c.execute("insert into pgstream.stream_counters (stream_id, name, label, value) values "
                  "(1, 'events_recorded', '', 50000), (1, 'events_done', '', 10000)")
        assert c.execute("select pgstream.backfill_backlog(1)").fetchone() == (40_000,)
    request = backfill.Request(1, ["items"], parallelism=2, chunk_size=500, max_backlog=30_000)
    _, backfill_id = _open(url, request)
    outcomes: list[backfill.Outcome] = []
    thread = threading.Thread(target=lambda: outcomes.append(_run(url, request, backfill_id, progress_secs=0.2)))
    thread.start()
    time.sleep(2)
    with psycopg.connect(url, autocommit=True) as c:
        assert backfill.progress(c, backfill_id).rows_read == 0  # waiting: nothing read
        c.execute("update pgstream.stream_counters set value = 45000 where name = 'events_done'")  # 5,000 left
    thread.join(60)
    assert outcomes and outcomes[0].done and outcomes[0].progress.rows_read == 3000


def test_read_payload_is_byte_for_byte_the_triggers_payload(db_url: str, tmp_path: Path) -> None:
    """The backfill builds its payload with to_jsonb of typed rows (types resolved once per chunk),
    the trigger with jsonb_build_object: for the same row, with columns of many types (nulls, a
    domain, a composite, arrays, json with duplicate keys, NaN), a subset of the columns in another
    order, a column named like a payload key, one PL/pgSQL reads as a keyword (by), one named like
    the chunk's alias (t), payload extensions and metadata, the two payloads are the same jsonb,
    byte for byte (binary send form and text), but for tg_op and timestamp."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create domain public.money2 as numeric(12, 2)")
        c.execute("create type public.pt as (x int, label text)")
        c.execute("""create table public.kinds (
            id int primary key, n numeric, m public.money2, f float8, txt text, ts timestamptz, d date,
            b boolean, j json, jb jsonb, arr int[], tarr text[], p public.pt, bin bytea, u uuid, iv interval,
            "timestamp" text, "new" int, big bigint, "by" text, t text)""")
        rows = """insert into public.kinds select g, g * 1.50, g / 3.0, case when g %% 7 = 0 then 'NaN'::float8
                  else g / 7.0 end, case when g %% 5 = 0 then null else e'caf\\u00e9 "q" \\\\ ' || g end,
                  '2026-01-02 03:04:05.123456+00'::timestamptz + g * interval '1 min', date '2026-01-01' + g,
                  g %% 2 = 0, '{"a": 1, "a": 2, "z": [1, 2.50]}'::json, jsonb_build_object('k', g, 'n', null),
                  array[g, null, 3], array['x', null], row(g, 'l' || g)::public.pt, '\\xdeadbeef'::bytea,
                  gen_random_uuid(), g * interval '1 hour', 'ts ' || g, -g, 9007199254740993 + g, 'by ' || g, 't ' || g
                  from generate_series(%s::int, %s::int) g"""
    _config(tmp_path, db_url, [{
        "key": "kinds", "stream_id": 1, "operation": "INSERT", "schema_name": "public", "table_name": "kinds",
        "column_names": ["tarr", "id", "n", "m", "f", "txt", "ts", "d", "b", "j", "jb", "arr", "p", "bin", "u", "iv",
                         "timestamp", "new", "big", "by", "t"],
        "metadata": {"source": "kinds"},
        "payload_extensions": [{"json_path": "extra.total", "expression": "new.n * 2"},
                               {"json_path": "kind", "expression": "'row ' || new.txt"}]}])
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("set session_replication_role = replica")  # no trigger: rows the backfill reads
        c.execute(rows, [1, 120])
        c.execute("set session_replication_role = origin")
    request = backfill.Request(1, ["kinds"], parallelism=2, chunk_size=17, where="new.id % 2 = 0 or new.txt is null")
    _, backfill_id = _open(db_url, request)
    assert _run(db_url, request, backfill_id).progress.events_written == 72
    with psycopg.connect(db_url, autocommit=True) as c:
        reads = c.execute("select id, (payload->'new'->>'id')::int from pgstream.events "
                          "where payload->>'tg_op' = 'READ' order by id").fetchall()
        assert len(reads) == 72
        for event_id, row_id in reads:
            # the same row through the trigger: deleted and inserted again, same values
            with c.transaction():
                c.execute("create temp table pgstream_test_row on commit drop as "
                          "select * from public.kinds where id = %s", [row_id])
                c.execute("delete from public.kinds where id = %s", [row_id])
                c.execute("insert into public.kinds select * from pgstream_test_row")
            same = c.execute("""
                select jsonb_send(t.payload - 'tg_op' - 'timestamp') = jsonb_send(r.payload - 'tg_op' - 'timestamp'),
                       (t.payload - 'tg_op' - 'timestamp')::text = (r.payload - 'tg_op' - 'timestamp')::text,
                       r.payload->>'tg_op', jsonb_typeof(r.payload->'timestamp'), r.metadata = t.metadata,
                       r.metadata, t.payload::text, r.payload::text
                from pgstream.events r,
                     lateral (select * from pgstream.events t where t.payload->>'tg_op' = 'INSERT'
                              order by t.id desc limit 1) t
                where r.id = %s""", [event_id]).fetchone()
            assert same is not None
            assert same[:6] == (True, True, "READ", "number", True, {"source": "kinds"}), same
            assert f'"new": {{"id": {row_id},' in same[7] or f'"id": {row_id}' in same[7]


def _claimed(url: str, request: backfill.Request) -> tuple[int, str]:
    """A backfill opened and claimed by a fresh owner token (as ``run`` does), for run_partition."""
    _, backfill_id = _open(url, request)
    token = str(uuid.uuid4())
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("select pgstream.backfill_claim(%s, %s::uuid, 'test')", (backfill_id, token))
    return backfill_id, token


def test_a_partition_task_waits_for_the_backlog_before_each_chunk(items_stream: str) -> None:
    """Inside a round (a Spark task), before each chunk: no chunk while the stream has more than
    ``max_backlog`` undelivered events; it goes on once the stream caught up."""
    url = items_stream
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("insert into pgstream.stream_counters (stream_id, name, label, value) values "
                  "(1, 'events_recorded', '', 50000), (1, 'events_done', '', 10000)")
    backfill_id, token = _claimed(url, backfill.Request(1, ["items"], parallelism=1))
    waits: list[float] = []

    def sleep(secs: float) -> None:
        waits.append(secs)
        with psycopg.connect(url, autocommit=True) as c:
            assert backfill.progress(c, backfill_id).rows_read == 0  # waiting: nothing read
            if len(waits) == 3:
                c.execute("update pgstream.stream_counters set value = 45000 where name = 'events_done'")

    pace = backfill.Pace(60, max_backlog=30_000, stream_id=1)
    result = backfill.run_partition(url, backfill_id, 0, token, 500, pace, sleep=sleep)
    assert (result.status, result.rows, len(waits)) == ("done", 3000, 3)


def test_a_throttled_partition_reads_small_chunks_not_bursts(items_stream: str) -> None:
    """With a rate, a chunk holds at most PACED_CHUNK_SECS of the partition's share of it (here 2,000
    rows/s: 500 rows, not the 1,000 of chunk_size), and the task sleeps between chunks to keep it."""
    url = items_stream
    backfill_id, token = _claimed(url, backfill.Request(1, ["items"], parallelism=1))
    slept: list[float] = []

    def sleep(secs: float) -> None:
        slept.append(secs)
        time.sleep(secs)

    pace = backfill.Pace(60, rows_per_sec=2000)
    result = backfill.run_partition(url, backfill_id, 0, token, 1000, pace, sleep=sleep)
    assert (result.status, result.rows, result.chunks) == ("done", 3000, 3000 // int(2000 * backfill.PACED_CHUNK_SECS))
    with psycopg.connect(url) as c:
        assert c.execute("select count(*) from pgstream.events where payload->>'tg_op' = 'READ'").fetchone() == (3000,)
