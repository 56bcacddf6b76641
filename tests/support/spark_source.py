"""What the tests of the ``pgstream`` Spark source share (tests/test_spark_source.py, the cluster and
Connect tests): a stream's events recorded as ledger batches without a sensor, an executor login
role, the child process that runs a streaming query into Parquet (tests/support/spark_source_child.py),
and the rows a Parquet sink committed (its ``_spark_metadata`` log, not every file in the folder)."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
from psycopg import sql

from .dagster_dev import repo_root
from .harness import event_ids, insert_events

_roles = itertools.count()


def record_batches(url: str, stream_id: int, size: int, seed: int = 7) -> list[tuple[int, list[int]]]:
    """Record the stream's events that no batch holds yet as ledger batches of ``size`` events (the
    last one smaller), each in a shuffled order (a commit order is not the id order); returns
    ``(batch id, event ids in order)`` of the new batches."""
    rng = random.Random(seed)
    made: list[tuple[int, list[int]]] = []
    with psycopg.connect(url, autocommit=True) as c:
        rows = c.execute(
            "select e.id, e.created_at from pgstream.events e where e.stream_id = %s and not exists "
            "(select 1 from pgstream.batches b where b.stream_id = e.stream_id and e.id = any(b.event_ids)) "
            "order by e.id", [stream_id]).fetchall()
        for i in range(0, len(rows), size):
            chunk = rows[i:i + size]
            rng.shuffle(chunk)
            ids = [r[0] for r in chunk]
            times = [r[1] for r in chunk]
            row = c.execute(
                "insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
                "min_created_at, max_created_at) values (%s, %s, %s, %s, %s, %s, %s) returning id",
                [stream_id, ids, len(ids), ids[0], ids[-1], min(times), max(times)]).fetchone()
            assert row is not None
            made.append((int(row[0]), ids))
    return made


def ledger_positions(url: str, stream_id: int) -> dict[int, tuple[int, int]]:
    """Per event id: (batch id, ordinal) in the stream's ledger."""
    with psycopg.connect(url) as c:
        rows = c.execute("select o.id, b.id, o.ord from pgstream.batches b cross join lateral "
                         "unnest(b.event_ids) with ordinality o(id, ord) where b.stream_id = %s",
                         [stream_id]).fetchall()
    return {int(e): (int(b), int(o)) for e, b, o in rows}


@contextmanager
def executor_role(url: str) -> Iterator[str]:
    """The database URL of a fresh login member of pgstream_executor (the Spark executors' role)."""
    name = f"src_executor_{os.getpid()}_{next(_roles)}"
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(sql.SQL("create role {} login in role pgstream_executor").format(sql.Identifier(name)))
    base, _, dbname = url.rpartition("/")
    scheme, _, rest = base.partition("://")
    host = rest.rpartition("@")[2]
    try:
        yield f"{scheme}://{name}@{host}/{dbname}"
    finally:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(sql.SQL("select pg_terminate_backend(pid) from pg_stat_activity where usename = {}").format(
                sql.Literal(name)))
            c.execute(sql.SQL("drop owned by {}").format(sql.Identifier(name)))
            c.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))


def committed_rows(out: Path) -> list[dict[str, Any]]:
    """The rows of the Parquet files a Spark file sink committed: the files its ``_spark_metadata``
    log adds (the latest compaction and the batches after it), not the files of an aborted batch."""
    log = out / "_spark_metadata"
    entries = sorted((p for p in log.iterdir() if re.fullmatch(r"[0-9]+(\.compact)?", p.name)),
                     key=lambda p: int(p.name.split(".")[0]))
    compact = [i for i, p in enumerate(entries) if p.name.endswith(".compact")]
    files: dict[str, str] = {}
    for entry in entries[compact[-1] if compact else 0:]:
        lines = entry.read_text().splitlines()
        assert lines[0] == "v1", entry
        for line in lines[1:]:
            item = json.loads(line)
            if item["action"] == "add":
                files[item["path"]] = item["path"]
            else:
                files.pop(item["path"], None)
    rows: list[dict[str, Any]] = []
    for path in files:
        local = path.removeprefix("file://")
        rows.extend(pq.read_table(local).to_pylist())
    return rows


def start_child(spec: dict[str, Any], path: Path) -> subprocess.Popen[str]:
    """The streaming query of tests/support/spark_source_child.py, in a process group of its own."""
    path.write_text(json.dumps(spec))
    log = open(str(path) + ".log", "a")  # the child writes it; closed when this process ends
    return subprocess.Popen([sys.executable, "-m", "tests.support.spark_source_child", str(path)], cwd=repo_root(),
                            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill_hard(proc: subprocess.Popen[str]) -> None:
    """kill -9 the child and its JVM (its process group)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    return len([p for p in commits.iterdir() if p.name.isdigit()]) if commits.exists() else 0


def wait_for(done: Any, proc: subprocess.Popen[str], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"the streaming child exited with {proc.returncode}:\n" + log.read_text()[-4000:]
        assert time.monotonic() < deadline, "the streaming child made no progress:\n" + log.read_text()[-4000:]
        time.sleep(0.2)


def consumer_row(url: str, name: str) -> tuple[int, int, int] | None:
    """(batch id, ordinal, lag in events) of a registered consumer."""
    with psycopg.connect(url) as c:
        row = c.execute("select batch_id, ord, lag_events from pgstream.consumer_status where name = %s",
                        [name]).fetchone()
    return None if row is None else (int(row[0]), int(row[1]), int(row[2]))


def kill_and_restart(url: str, tmp: Path, conf: dict[str, str], *, inserts: Any,
                     owner_url: str, token: str, restart: str = "until_caught_up") -> list[dict[str, Any]]:
    """A streaming query from the source into Parquet with a checkpoint (at most 300 events a
    micro-batch) is killed with SIGKILL once two micro-batches are committed, ``inserts()`` adds
    events and batches meanwhile, and the query is started again on the same checkpoint until the
    consumer's position is the ledger's end (``owner_url`` reads it; ``token``: the consumer's; ``restart``
    ``available_now``: with ``Trigger.AvailableNow``, until the query stops by itself); returns the
    committed rows."""
    checkpoint, out = tmp / "checkpoint", tmp / "out"
    spec = {"url": url, "stream": 1, "consumer": "lake-test", "token": token, "checkpoint": str(checkpoint),
            "out": str(out), "conf": conf, "max_events": 300, "partitions": 3, "owner_url": owner_url}
    first = start_child({**spec, "mode": "forever"}, tmp / "first.json")
    log = tmp / "first.json.log"
    try:
        wait_for(lambda: committed_batches(checkpoint) >= 2, first, log)
    finally:
        kill_hard(first)
    inserts()
    second = start_child({**spec, "mode": restart}, tmp / "second.json")
    try:
        assert second.wait(600) == 0, (tmp / "second.json.log").read_text()[-6000:]
    finally:
        if second.poll() is None:
            kill_hard(second)
    return committed_rows(out)


def stream_exactly_once(db_url: str, tmp: Path, conf: dict[str, str], restart: str = "until_caught_up") -> None:
    """Stream 1 has 1,500 events in ledger batches of 170 (stream 2's 50 events beside them); a
    streaming query (``conf``: its Spark) is killed mid-stream (:func:`kill_and_restart`), 700 more
    events are recorded in batches of 230 meanwhile, and the restarted query ends with each of the
    2,200 events exactly once, at its ledger position, and the consumer's position at the ledger's end."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
        c.execute("select pgstream.ensure_stream(2)")
    insert_events(db_url, 1, 1500)
    insert_events(db_url, 2, 50)
    record_batches(db_url, 2, 50)
    record_batches(db_url, 1, 170)
    with psycopg.connect(db_url, autocommit=True) as c:  # the operator registers the query's consumer
        c.execute("select pgstream.register_consumer('lake-test', 1)")
        token = c.execute("select pgstream.consumer_token('lake-test')").fetchone()
    assert token is not None

    def more() -> None:  # recorded while the query is down
        insert_events(db_url, 1, 700, 1500)
        record_batches(db_url, 1, 230, seed=11)

    with executor_role(db_url) as url:
        rows = kill_and_restart(url, tmp, conf, inserts=more, owner_url=db_url, token=token[0], restart=restart)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 2200  # each event once
    assert sorted(ids) == event_ids(db_url, 1)
    positions = ledger_positions(db_url, 1)
    assert all((r["batch_id"], r["ord"]) == positions[r["id"]] for r in rows)  # at its ledger position
    assert {r["stream_id"] for r in rows} == {1}
    last = max(positions.values())
    assert consumer_row(db_url, "lake-test") == (last[0], last[1], 0)  # the checkpoint's end, committed
