"""Delivery and replay runs against a real Spark Connect server (``spark.remote``), started by
``pgstream_dagster.sparkserver`` from PySpark's own jars: counts in = out, commit order kept."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # (a dependency of dagster)
import psycopg
import pytest

from pgstream_dagster import sparkserver
from pgstream_dagster.config import ConfigError, load_config
from pgstream_dagster.devdb import free_port

from .support.dagster_dev import repo_root
from .support.endpoint import Endpoint
from .support.faults import stream_config
from .support.harness import event_ids, insert_events, read_jsonl, write_config
from .support.spark_source import stream_exactly_once


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("spark-connect") / "server.log"
    proc = sparkserver.start(port, "local[2]", log=log)
    try:
        yield f"sc://127.0.0.1:{port}"
    finally:
        sparkserver.stop(proc)
    assert proc.poll() is not None


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_the_server_listens_on_the_loopback_only(connect_url: str, tmp_path: Path) -> None:
    """The server on a local master (what `make dev` starts): its Connect port, the driver's RPC and block
    manager and whatever its Python workers open listen on 127.0.0.1, none on another interface (no UI)."""
    port = int(connect_url.rsplit(":", 1)[1])
    (pid,) = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    server = psutil.Process(pid)
    listening = [(p.pid, c.laddr.ip, c.laddr.port) for p in [server, *server.children(recursive=True)]
                 for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert len({lport for _pid, _ip, lport in listening}) >= 3, listening  # Connect, driver RPC, block manager
    assert [x for x in listening if not _loopback(x[1])] == [], listening
    (state := tmp_path / "state").mkdir()  # the server recorded as make dev records its own: taken for the server
    (state / "spark-connect.pid").write_text(str(os.getpgid(pid)))
    assert sparkserver.recorded_pid(state) == os.getpgid(pid)


def _child_env(dagster_storage_url: str) -> dict[str, str]:
    """The child's environment: the Dagster storage its instance writes to (the group delivery runs, in threads)."""
    return {**os.environ, "PGSTREAM_TEST_DAGSTER_STORAGE": dagster_storage_url}


def test_delivery_and_replay_through_spark_connect(db_url: str, tmp_path: Path, connect_url: str,
                                                   dagster_storage_url: str) -> None:
    out = tmp_path / "sink.jsonl"
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 400, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         "delivery": {"chunk_size": 100, "tuning": {"rows_per_partition": 300, "direct_max_events": 0}},
         "sink": {"type": "file", "path": str(out)}}],
        spark={"remote": connect_url})
    Path(str(cfg) + ".sink").write_text(json.dumps(str(out)))
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
    insert_events(db_url, 1, 1000)
    insert_events(db_url, 1, 500, 1000)
    ids = event_ids(db_url, 1)
    child = subprocess.run([sys.executable, "-m", "tests.support.spark_connect_child", str(cfg), "1500"],
                           cwd=repo_root(), capture_output=True, text=True, timeout=600,
                           env=_child_env(dagster_storage_url))
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-5000:]
    result = json.loads(Path(str(cfg) + ".out").read_text())
    assert all(result["runs"]) and result["replay"], result
    got = [e["id"] for e in read_jsonl(out)]
    assert got == ids and len(ids) == 1500  # delivered once each, in commit order
    assert result["replayed"] == ids  # then replayed through the server (to a memory sink), in id order
    assert [e["payload"]["n"] for e in read_jsonl(out)[:3]] == [0, 1, 2]


def test_by_key_through_spark_connect_resumes_per_key_after_a_failure(db_url: str, tmp_path: Path,
                                                                      connect_url: str,
                                                                      dagster_storage_url: str) -> None:
    """``ordering: by_key`` on a Spark Connect server: the first run (a member run hosted by the group delivery
    run of group default) fails mid-way (the sink refuses the chunk holding one key's event near the end); the
    failover probe and the catch-up run resume from what the Spark tasks recorded, so only chunks in flight when
    the run stopped (at most one per other partition) are delivered twice, each key keeps its order and the
    counts add up (each batch counted once in the group runs' materializations)."""
    parallelism, chunk = 3, 20
    endpoint = Endpoint()
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(
        endpoint, batch={"max_size": 200, "max_fill_secs": 0},
        delivery={"ordering": "by_key", "routing_key": "group_id", "parallelism": parallelism,
                  "chunk_size": chunk, "run_grace_secs": 2})], spark={"remote": connect_url})
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(1)")
        c.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object("
                  "'group_id', 'k' || (g % 4), 'n', g), 1 from generate_series(0, 799) g")
        events = c.execute("select id, payload->>'group_id', (payload->>'n')::int from pgstream.events "
                           "where stream_id = 1 order by id").fetchall()
    endpoint.fail_once_ids = {i for i, _k, n in events if n == 790}  # key k2, in the last batch
    child = subprocess.run([sys.executable, "-m", "tests.support.spark_connect_child", str(cfg), "800", "by_key"],
                           cwd=repo_root(), capture_output=True, text=True, timeout=600,
                           env=_child_env(dagster_storage_url))
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-5000:]
    result = json.loads(Path(str(cfg) + ".out").read_text())
    assert result["runs"][0] is False and result["runs"][-1] is True, result
    assert sum(n for rounds in result["rounds"] for n in rounds) == 800, result  # each batch counted once
    assert endpoint.unique() == {i for i, _k, _n in events}
    first_seen = endpoint.first_seen_order()
    for key in ("k0", "k1", "k2", "k3"):
        ids = [i for i, k, _n in events if k == key]
        assert [i for i in first_seen if i in set(ids)] == ids  # each key in commit order
    # resumed: of what the first run delivered (at least the ~190 events of k2 before the failure)
    # only chunks in flight in the other partitions when the run stopped came again
    assert endpoint.accepted_at_failure is not None and endpoint.accepted_at_failure > 150
    assert endpoint.duplicates() <= (parallelism - 1) * chunk, endpoint.duplicates()
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from pgstream.key_progress").fetchone() == (0,)
        assert c.execute("select value from pgstream.stream_counters where stream_id = 1 "
                         "and name = 'events_delivered'").fetchone() == (800,)


def test_blank_spark_remote_means_classic_spark(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "pgstream.yaml", "postgresql://x/y", [
        {"id": 3, "delivery": {"ordering": "by_key"}, "sink": {"type": "file", "path": str(tmp_path / "x")}}],
        spark={"remote": "sc://127.0.0.1:15002"})
    assert load_config(cfg).streams[0].delivery.ordering == "by_key"  # by_key is fine with Spark Connect
    # ...but its sink is built on the server's workers, whose working directory is the server's
    relative = write_config(tmp_path / "relative.yaml", "postgresql://x/y", [
        {"id": 3, "delivery": {"ordering": "by_key"}, "sink": {"type": "file", "path": "x"}}],
        spark={"remote": "sc://127.0.0.1:15002"})
    with pytest.raises(ConfigError, match=r"spark.remote: streams\[id=3\] .*sink.path: a relative path"):
        load_config(relative)
    blank = write_config(tmp_path / "blank.yaml", "postgresql://x/y", [
        {"id": 1, "sink": {"type": "file", "path": "x"}}], spark={"remote": ""})
    assert load_config(blank).spark.remote is None  # ${PGSTREAM_SPARK_REMOTE:-} unset: classic Spark


def test_backfill_through_spark_connect(db_url: str, tmp_path: Path, connect_url: str) -> None:
    """`pgstream-dagster backfill run` on a Spark Connect server: the partitions run as the server's
    tasks (mapInArrow, no sparkContext); every row once, as a READ event."""
    from pgstream_dagster.engine.bootstrap import init

    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table public.things (id int primary key, label text)")
        c.execute("insert into public.things select g, 'thing ' || g from generate_series(1, 5000) g")
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "sink": {"type": "file", "path": str(tmp_path / "sink.jsonl")}}],
        [{"key": "things", "stream_id": 1, "operation": "INSERT", "table_name": "things",
          "column_names": ["id", "label"]}], spark={"remote": connect_url})
    init(cfg)
    child = subprocess.run([sys.executable, "-m", "pgstream_dagster.cli", "backfill", "run", "1", "things",
                            "--config", str(cfg), "--parallelism", "3", "--chunk-size", "400",
                            "--max-rows-per-sec", "0"], cwd=repo_root(), capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-5000:]
    assert "done, 5000/5000 rows (100%), 5000 events, 3/3 partitions done" in child.stdout
    with psycopg.connect(db_url) as c:
        ids = [r[0] for r in c.execute("select (payload->'new'->>'id')::int from pgstream.events "
                                       "where payload->>'tg_op' = 'READ' order by 1")]
    assert ids == list(range(1, 5001))


def test_spark_source_stream_killed_and_restarted_through_spark_connect(db_url: str, tmp_path: Path,
                                                                        connect_url: str) -> None:
    """``readStream.format("pgstream")`` registered from a Spark Connect client (the server's Python
    workers import the source) into Parquet, the client killed with SIGKILL mid-stream (the server
    keeps running: its query goes on until the server notices, so the restart waits for nothing but
    the checkpoint) and restarted: each event exactly once (tests/support/spark_source.py)."""
    stream_exactly_once(db_url, tmp_path, {"spark.remote": connect_url})


def test_a_port_another_process_listens_on_is_refused_in_one_line(tmp_path: Path) -> None:
    """The server's port taken by another process (before the start, or while its JVM starts): a listener there
    is not the server's, so starting it is refused, saying so, instead of reported started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(sparkserver.SparkServerError,
                           match=rf"^port {port} is in use by another process: give the Spark Connect server another"):
            sparkserver.start(port, "local[1]", log=tmp_path / "server.log")
        assert sparkserver._listens_itself(os.getpid(), port) is True  # this process: the listener is its own
        other = subprocess.Popen(["sleep", "30"], start_new_session=True)  # another process: not its
        try:
            assert sparkserver._listens_itself(other.pid, port) is False
            # make dev's server recorded as that live process (its pid given to another since), the port another's:
            # not taken for the server, so neither reused nor stopped: starting one is refused the same way
            (tmp_path / "spark-connect.pid").write_text(str(other.pid))
            assert sparkserver.recorded_pid(tmp_path) is None
            with pytest.raises(sparkserver.SparkServerError, match=rf"^port {port} is in use by another process"):
                sparkserver.ensure_running(tmp_path, port, "local[1]")
            (tmp_path / "spark-connect.pid").write_text(str(other.pid))
            assert sparkserver.stop_recorded(tmp_path) is False
            assert other.poll() is None  # not signalled
        finally:
            other.kill()
            other.wait()
