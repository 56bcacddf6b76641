"""A ``by_key`` partition on its own (``engine/spark._publish_partition``, what each Spark task runs
in ``mapInArrow``), against the real ledger and an in-process sink: it records what the sink
confirmed per bucket, chunk by chunk, in ``pgstream.key_progress``; a second attempt (a Spark task
retry, or the next run) skips it, and the counts it returns cover every event exactly once."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from pgstream_dagster.engine.ledger import keyprogress, locks
from pgstream_dagster.engine.spark import _publish_partition
from pgstream_dagster.sinks import MemorySink, MemorySinkConfig, SinkError

from .support.dagster_dev import repo_root

CHUNK = 4
PARTITIONS = 3


def _rows() -> list[dict[str, Any]]:
    """Two batches of 30 events; keys k0..k2, each in its bucket (as Spark's hash partitioning puts
    them); this partition holds buckets 0 and 1 (keys k0 and k1): k2 is another partition's."""
    created = dt.datetime(2026, 11, 23, tzinfo=dt.UTC)
    rows = []
    for batch_id in (1, 2):
        for ord in range(1, 31):
            event_id = batch_id * 100 + ord
            key = f"k{ord % 2}"
            rows.append({"batch_id": batch_id, "ord": ord, "id": event_id, "stream_id": 1, "created_at": created,
                         "payload": f'{{"group_id": "{key}", "n": {event_id}}}', "metadata": None,
                         "routing_key": key, "bucket": ord % 2})
    return rows


def _attempt(rows: list[dict[str, Any]], progress: keyprogress.KeyProgress, **sink: Any) -> dict[int, tuple[int, int]]:
    """One attempt of the partition: its result per batch, ``(handled, resumed)``."""
    batches: Iterator[Any] = iter([pa.RecordBatch.from_pylist(rows[:25]), pa.RecordBatch.from_pylist(rows[25:])])
    out = list(_publish_partition(batches, MemorySinkConfig(name="resume", **sink), CHUNK, frozenset(), None,
                                  progress))
    assert len(out) == 1
    return {r["batch_id"]: (r["handled"], r["resumed"]) for r in out[0].to_pylist()}


def test_a_retried_partition_resumes_per_bucket_and_counts_every_event_once(db_url: str) -> None:
    MemorySink.reset("resume")
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
    rows = _rows()
    lease = locks.acquire_lease(db_url, 1, "r-1")  # the run, which gives its round's tasks the token
    progress = keyprogress.KeyProgress(db_url, 1, PARTITIONS, token=keyprogress.issue_delivery_token(lease, 1, "r-1"))
    poison = 210  # batch 2 #10: its chunk (207..210) delivers 207..209, then the sink refuses 210
    with pytest.raises(SinkError):
        _attempt(rows, progress, reject_ids=[poison], reject_times=1)
    first = [e.id for e in MemorySink.delivered("resume")]
    assert first == [r["id"] for r in rows][:first.index(poison - 1) + 1] and first[-1] == 209
    with psycopg.connect(db_url) as c:
        recorded = c.execute("select bucket, batch_id, ord from pgstream.key_progress where stream_id = 1 "
                             "and partitions = %s order by bucket", [PARTITIONS]).fetchall()
    assert recorded == [(0, 2, 6), (1, 2, 6)]  # the last chunk the sink confirmed in full: 203..206

    result = _attempt(rows, progress)  # the retry: the same rows, the same partitioning
    assert result == {1: (30, 30), 2: (30, 6)}  # every event counted once; 36 of them not published again
    delivered = [e.id for e in MemorySink.delivered("resume")]
    assert set(delivered) == {r["id"] for r in rows}
    assert sorted(n for n in Counter(delivered).values() if n > 1) == [2, 2, 2]  # 207..209: the chunk in flight
    for key in ("k0", "k1"):
        ids = [r["id"] for r in rows if r["routing_key"] == key]
        seen = list(dict.fromkeys(i for i in delivered if i in set(ids)))
        assert seen == ids  # each key in commit order
    with psycopg.connect(db_url) as c:
        assert c.execute("select bucket, batch_id, ord from pgstream.key_progress where stream_id = 1 "
                         "order by bucket").fetchall() == [(0, 2, 30), (1, 2, 30)]
        keyprogress.clear_key_progress(c, 1, through_batch_id=1)  # a round of batch 1 alone keeps what is past it
        assert c.execute("select count(*) from pgstream.key_progress").fetchone() == (2,)
        keyprogress.clear_key_progress(c, 1, through_batch_id=2)
        assert c.execute("select count(*) from pgstream.key_progress").fetchone() == (0,)
    assert "postgresql" not in repr(progress)  # pickled to the executors, shown in tracebacks: never the URL
    assert progress.token and progress.token not in repr(progress)  # nor the token
    lease.close()


def test_a_task_stops_once_its_run_no_longer_holds_the_delivery_lease(db_url: str) -> None:
    """A Spark Connect server keeps an abandoned query running for minutes: its tasks check, with
    every record, that the run still holds its lease, and stop after the chunk in flight."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
    progress = keyprogress.KeyProgress(db_url, 1, PARTITIONS)
    with progress.connect() as task:
        lease = locks.acquire_lease(db_url, 1, "r-1")
        progress.token = keyprogress.issue_delivery_token(lease, 1, "r-1")
        progress.record(task, [0], 1, 4)
        lease.close()  # the run's process died: its backend ends a moment after the socket closes
        deadline = time.monotonic() + 10
        while locks.lease_state(task, "r-1") is locks.LeaseState.HELD and time.monotonic() < deadline:
            time.sleep(0.02)
        # another session naming itself after the run (any role can set its application_name) keeps
        # nothing alive: the lease is pgstream's lock row
        with psycopg.connect(db_url, application_name=locks.lease_name("r-1")):
            with pytest.raises(keyprogress.RunGone,
                               match="the run of this by_key round no longer holds the delivery lease"):
                progress.record(task, [0], 1, 8)
        assert progress.read(task) == {0: (1, 4)}  # nothing recorded once the run is gone


def test_spark_retries_a_failed_by_key_task_and_the_retry_resumes_per_key(db_url: str, dagster_storage_url: str,
                                                                         tmp_path: Path) -> None:
    """End to end with Spark's own task retries (``local[2,3]``): the sink refuses one chunk in the
    middle of a partition, Spark runs the task again within the same run, and the retry publishes only
    what no attempt confirmed: every event exactly once, in order per key, one successful run."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"tmp": str(tmp_path), "db_url": db_url, "dagster_storage_url": dagster_storage_url}))
    child = subprocess.run([sys.executable, "-m", "tests.support.by_key_retry_child", str(spec)],
                           cwd=repo_root(), capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    result = json.loads(Path(str(spec) + ".out").read_text())
    # no failover: Spark's retry finished the run (hosted by the reader group's delivery run)
    assert result["runs"] and all(result["runs"]) and result["failover"] == [False, 0], result
    assert result["members"] and all(m["state"] == "ended" for m in result["members"]), result["members"]
    assert result["refused_answers"] == 1
    accepted, sent = result["accepted"], result["sent"]
    assert len(sent) == 400 and sorted(accepted) == sent  # each event once: the retry skipped what was confirmed
    groups = {int(k): v for k, v in result["groups"].items()}
    for key in set(groups.values()):  # commit (id) order within each key
        mine = [i for i in accepted if groups[i] == key]
        assert mine == sorted(mine)
    assert any("confirmed by an interrupted attempt were not published again" in m for m in result["messages"])
