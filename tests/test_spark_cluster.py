"""Delivery and replay runs on a real Spark standalone cluster (a master and two workers on loopback,
tests/support/spark_cluster.py) whose executors' Python does not have pgstream_dagster installed:
the package reaches them through ``spark.submit.pyFiles``, which the product sets up itself. Counts
in = out, commit order (global) and per-key order (``by_key``) kept, a run's share of the cluster
bounded, a failed ``by_key`` task not retried by Spark."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgstream_dagster import sparkserver
from pgstream_dagster.config import ConfigError, load_config
from pgstream_dagster.devdb import free_port
from pgstream_dagster.engine import cluster
from pgstream_dagster.engine.spark import spark_conf

from .support.dagster_dev import repo_root
from .support.harness import event_ids, insert_events, read_jsonl, write_config
from .support.spark_cluster import SparkCluster, pack_executor_env, start_cluster
from .support.spark_source import stream_exactly_once


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, cores=2, memory="1g")
    try:
        yield cluster
    finally:
        cluster.stop()
    assert all(p.poll() is not None for p in cluster.procs)


def test_delivery_by_key_replay_and_backfill_on_a_standalone_cluster(
        db_url: str, dagster_storage_url: str, tmp_path: Path, spark_cluster: SparkCluster) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "tmp": str(tmp_path), "db_url": db_url, "dagster_storage_url": dagster_storage_url,
        "master": spark_cluster.master_url, "webui": spark_cluster.webui,
        # the executors' Python, and small executors: the test machine has 2 CPUs
        "conf": {"spark.pyspark.python": str(spark_cluster.python), "spark.executor.memory": "512m"}}))
    child = subprocess.run([sys.executable, "-m", "tests.support.spark_cluster_child", str(spec)],
                           cwd=repo_root(), capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    result = json.loads(Path(str(spec) + ".out").read_text())

    # the executors ran the configured Python, which imported pgstream_dagster from the shipped zip
    assert result["executors"] and all(
        line.startswith(f"{spark_cluster.python} ") and ".zip/pgstream_dagster/" in line
        for line in result["executors"]), result["executors"]
    # an open run takes a bounded share: 2 of the cluster's 4 cores (default spark.cores.max: the
    # largest by_key parallelism), leaving room for another stream's run or a replay
    assert [a["cores"] for a in result["apps"]] == [2], result["apps"]
    assert sum(w["cores"] for w in spark_cluster.state()["workers"]) == 4

    # global order: delivered once each, in commit order, then replayed in id order
    ids = event_ids(db_url, 1)[:1500]  # then the backfill's 2,000 READ events (not delivered here)
    got = [e["id"] for e in read_jsonl(tmp_path / "global.jsonl")]
    assert len(event_ids(db_url, 1)) == 3500 and all(result["global_runs"]) and result["replay"]
    assert got == ids and result["replayed"] == ids  # the replay through the cluster, to a memory sink

    # by_key: the sink fails from its 5th request on; the run fails (spark.task.maxFailures 1: no
    # task is retried by Spark, so no partition republishes behind the run's back)...
    failed = result["by_key_failed_run"]
    assert failed["success"] is False and failed["accepted"] <= 40
    assert 1 <= failed["refused_answers"] <= 2, failed  # at most one failed attempt per partition
    # ...and the stream's failover delivers the rest: every event; a retry resumes each key after what
    # its task confirmed (pgstream.key_progress), so duplicates are at most the chunk each of the 2
    # tasks had in flight (chunk_size 10), and each key's first deliveries are in commit order
    runs = result["by_key_runs"]
    assert runs[0] is False and runs[-1] is True
    accepted = result["by_key_accepted"]
    key_ids = event_ids(db_url, 2)
    assert sorted(set(accepted)) == key_ids and len(key_ids) == 300
    assert len(accepted) - 300 <= 2 * 10, len(accepted)
    with psycopg.connect(db_url) as c:
        key_of: dict[Any, Any] = dict(c.execute("select id, payload->>'group_id' from pgstream.events "
                                                "where stream_id = 2"))
    seen: set[int] = set()
    firsts = [i for i in accepted if not (i in seen or seen.add(i))]  # type: ignore[func-returns-value]
    for key in ("0", "1", "2"):
        per_key = [i for i in firsts if key_of[i] == key]
        assert per_key == sorted(per_key) and len(per_key) == 100
    # a backfill on the cluster's executors: each row once
    assert result["backfill"] == {"success": True, "read_ids": list(range(1, 2001))}
    # nothing landed in the workers' directories (where a relative sink path would have gone)
    assert not [p for d in spark_cluster.worker_dirs() for p in d.rglob("*.jsonl")]


def test_spark_connect_server_on_the_cluster(db_url: str, dagster_storage_url: str, tmp_path: Path,
                                             spark_cluster: SparkCluster) -> None:
    """`pgstream-dagster spark-connect --master spark://...`, run as a service manager runs it: the server is an
    application of the cluster with the same defaults (the package zip, a bounded share, no task retries), its
    executors run the configured Python; a delivery run and a replay go through it. SIGTERM to the command: the
    server's whole process group (the JVM, its Python workers) is gone when the command exits."""
    port = free_port()
    log = tmp_path / "command.log"
    with log.open("wb") as out:
        wrapper = subprocess.Popen([sys.executable, "-m", "pgstream_dagster.cli", "spark-connect", "--port", str(port),
                                    "--master", spark_cluster.master_url,
                                    "--conf", f"spark.pyspark.python={spark_cluster.python}",
                                    "--conf", "spark.executor.memory=512m"],
                                   cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    jvm_group = 0
    try:
        deadline = time.monotonic() + 180
        while not (match := re.search(r"Spark Connect server \(pid (\d+)\)", log.read_text(errors="replace"))):
            assert wrapper.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        jvm_group = int(match.group(1))
        while not sparkserver.listening(port):
            assert wrapper.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.3)
        out_path = tmp_path / "sink.jsonl"
        cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
            {"id": 1, "batch": {"max_size": 400, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
             "delivery": {"chunk_size": 100, "tuning": {"rows_per_partition": 300, "direct_max_events": 0}},
             "sink": {"type": "file", "path": str(out_path)},
             "retry": {"initial_backoff_secs": 0, "max_backoff_secs": 0}}],
            spark={"remote": f"sc://127.0.0.1:{port}"})
        Path(str(cfg) + ".sink").write_text(json.dumps(str(out_path)))
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute("select pgstream.ensure_stream(1)")
        insert_events(db_url, 1, 700)
        ids = event_ids(db_url, 1)
        child = subprocess.run([sys.executable, "-m", "tests.support.spark_connect_child", str(cfg), "700"],
                               cwd=repo_root(), capture_output=True, text=True, timeout=600,
                               env={**os.environ, "PGSTREAM_TEST_DAGSTER_STORAGE": dagster_storage_url})
        assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-5000:]
        result = json.loads(Path(str(cfg) + ".out").read_text())
        assert all(result["runs"]) and result["replay"], result
        assert [e["id"] for e in read_jsonl(out_path)] == ids and result["replayed"] == ids
        apps = [a for a in spark_cluster.state()["activeapps"] if a["name"] == "pgstream spark connect"]
        assert [a["cores"] for a in apps] == [sparkserver.SERVER_CORES_MAX]

        assert _group_alive(jvm_group)
        wrapper.send_signal(signal.SIGTERM)
        assert wrapper.wait(60) == 0
        assert not _group_alive(jvm_group)  # no JVM (nor Python worker) survives the command
        assert not sparkserver.listening(port)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait(10)
        if jvm_group and _group_alive(jvm_group):
            sparkserver.stop(jvm_group)


def test_spark_conf_of_a_cluster_master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)  # restored after the test: spark_conf sets it
    conf = spark_conf("spark://10.1.2.3:7077", None, {"spark.pyspark.python": "/opt/venv/bin/python"},
                      by_key_parallelism=[3, 2])
    # the configured executors' Python wins, in the conf and where PySpark reads it (the environment)
    assert conf["spark.pyspark.python"] == os.environ["PYSPARK_PYTHON"] == "/opt/venv/bin/python"
    assert conf["spark.pyspark.driver.python"] == sys.executable
    assert (conf["spark.cores.max"], conf["spark.task.maxFailures"]) == ("3", "1")
    shipped = Path(conf["spark.submit.pyFiles"])
    assert shipped.parent == tmp_path / "cache"
    with zipfile.ZipFile(shipped) as zf:
        names = zf.namelist()
    assert "pgstream_dagster/engine/spark.py" in names and "pgstream_dagster/sinks/http.py" in names
    assert not [n for n in names if "__pycache__" in n]
    # cached: the same content gives the same zip, not rebuilt
    built = shipped.stat().st_ino  # a rebuild replaces the file (a new inode); a use only touches it
    assert cluster.package_zip() == shipped and shipped.stat().st_ino == built
    # the user's settings win; their pyFiles are kept
    mine = {"spark.cores.max": "8", "spark.task.maxFailures": "2", "spark.submit.pyFiles": "/deps/a.zip"}
    conf = spark_conf("spark://10.1.2.3:7077", None, mine)
    assert (conf["spark.cores.max"], conf["spark.task.maxFailures"]) == ("8", "2")
    assert conf["spark.submit.pyFiles"] == f"/deps/a.zip,{shipped}"
    assert spark_conf("spark://h:7077", None, {})["spark.cores.max"] == "1"  # ordered delivery: 1 job at a time
    assert "spark.submit.pyFiles" not in spark_conf("k8s://https://k8s.internal:443", None, {}, ship_package=False)
    assert "spark.cores.max" not in spark_conf("k8s://https://k8s.internal:443", None, {})  # not a standalone knob
    local = spark_conf("local[2]", None, {})
    assert not {"spark.submit.pyFiles", "spark.cores.max", "spark.task.maxFailures"} & set(local)
    assert local["spark.pyspark.python"] == "/opt/venv/bin/python"  # $PYSPARK_PYTHON, as set above


def test_the_package_zip_cache_keeps_what_runs_use(tmp_path: Path) -> None:
    """Each use touches the zip; zips (and leftover temporary files) unused for a week are deleted
    when another one is built; the rest stay."""
    old_zip = tmp_path / "pgstream_dagster-0.1-0123456789abcdef.zip"
    recent_zip = tmp_path / "pgstream_dagster-0.2-0123456789abcdef.zip"
    leftover = tmp_path / ".pgstream-zip-x.tmp"
    mine = tmp_path / "notes.zip"
    for path in (old_zip, recent_zip, leftover, mine):
        path.write_bytes(b"x")
    week = cluster.ZIP_UNUSED_SECS
    for path in (old_zip, leftover, mine):
        os.utime(path, (time.time() - week - 60, time.time() - week - 60))
    os.utime(recent_zip, (time.time() - week + 3600, time.time() - week + 3600))
    built = cluster.package_zip(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([built.name, recent_zip.name, mine.name])
    os.utime(built, (time.time() - week - 60, time.time() - week - 60))
    assert cluster.package_zip(tmp_path) == built and built.stat().st_mtime > time.time() - 60  # used: touched


def test_executor_requirements() -> None:
    reqs = cluster.executor_requirements()
    names = [r.split("==")[0] for r in reqs]
    assert {"psycopg", "pydantic", "httpx", "tenacity", "pyarrow"} <= set(names)
    assert not {"dagster", "pgstream-dagster", "pyspark"} & set(names)
    assert all("==" in r for r in reqs)  # pinned to what the driver runs
    with_sinks = [r.split("==")[0] for r in cluster.executor_requirements(["redis", "kinesis", "file"])]
    assert {"redis", "boto3"} <= set(with_sinks)
    assert {"deltalake", "pyiceberg"} <= {r.split("==")[0] for r in cluster.executor_requirements(["delta"])}


def test_settings_that_mean_something_else_on_an_executor_are_refused(tmp_path: Path) -> None:
    remote_master = {"master": "spark://spark-master.internal:7077"}
    loopback_master = {"master": "spark://127.0.0.1:7077"}
    by_key = {"ordering": "by_key"}
    # by_key builds the sink on the executors: a relative path is each executor's working directory
    cfg = write_config(tmp_path / "a.yaml", "postgresql://u:pw@db.internal/app", [
        {"id": 1, "delivery": by_key, "sink": {"type": "file", "path": "out/events.jsonl"}}], spark=loopback_master)
    with pytest.raises(ConfigError, match=r"sink.path: a relative path is relative to each executor's working"):
        load_config(cfg)
    # executors on other hosts: loopback hosts (sink, database) are each executor's own
    cfg = write_config(tmp_path / "b.yaml", "postgresql://u:secret-pw@127.0.0.1/app", [
        {"id": 1, "sink": {"type": "file", "path": "/shared/x.jsonl"}},
        {"id": 2, "delivery": by_key, "sink": {"type": "http", "url": "http://localhost:8080/hook?token=tok-123"}},
        {"id": 3, "delivery": by_key, "sink": {"type": "kafka", "bootstrap_servers": "[::1]:9092", "topic": "t"}}],
        spark=remote_master)
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    message = str(err.value)
    assert "database_url names a loopback host" in message
    assert "streams[id=2] (ordering by_key: its sink is built on the executors): sink.url: a loopback host" in message
    assert "streams[id=3]" in message and "sink.bootstrap_servers" in message
    assert "secret-pw" not in message and "tok-123" not in message  # never a value
    # allowed: a local master (the tests' loopback services), global order (the sink is the
    # driver's), a loopback cluster's loopback services, and the explicit opt-out
    for name, spark, delivery in (("c", {"master": "local[2]"}, by_key), ("d", remote_master, {}),
                                  ("e", loopback_master, by_key),
                                  ("f", {**remote_master, "host_local_settings": True}, by_key)):
        db = "postgresql://u@127.0.0.1/app" if name != "d" else "postgresql://u@db.internal/app"
        cfg = write_config(tmp_path / f"{name}.yaml", db, [
            {"id": 1, "delivery": delivery, "sink": {"type": "http", "url": "http://127.0.0.1:9/x"}}], spark=spark)
        assert load_config(cfg).streams[0].id == 1
    # a Unix-socket database URL means each executor's own socket
    cfg = write_config(tmp_path / "g.yaml", "postgresql:///app", [
        {"id": 1, "sink": {"type": "file", "path": "/x"}}], spark=remote_master)
    with pytest.raises(ConfigError, match="database_url names a Unix socket"):
        load_config(cfg)


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in process group ``pgid`` (from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def test_a_packed_environment_in_spark_archives(db_url: str, dagster_storage_url: str, tmp_path: Path,
                                                 spark_cluster: SparkCluster) -> None:
    """The executors' Python as a packed environment (``spark.archives: env.tar.gz#env``,
    ``spark.pyspark.python: ./env/bin/python``), the other way docs/spark-clusters.md gives: the executors run it
    from their working directory and import the libraries from it. The run's host needs the same
    relative path (Spark plans the data sources there with that interpreter): without it the run
    fails before reading anything, saying so; with it, every event arrives, each key in order."""
    archive = pack_executor_env(spark_cluster, tmp_path / "env.tar.gz")
    cwd = tmp_path / "run-cwd"
    cwd.mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"tmp": str(tmp_path), "db_url": db_url, "dagster_storage_url": dagster_storage_url,
                                "master": spark_cluster.master_url, "archive": str(archive)}))
    child = subprocess.run([sys.executable, "-m", "tests.support.spark_archives_child", str(spec)],
                           cwd=cwd, env={**os.environ, "PYTHONPATH": str(repo_root())},
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    result = json.loads(Path(str(spec) + ".out").read_text())

    first = result["first_run"]
    assert first["success"] is False and first["accepted"] == 0
    assert "spark.pyspark.python './env/bin/python' is relative" in first["error"], first["error"]
    assert f"working directory {str(cwd)!r}" in first["error"]

    # the executors' interpreter and libraries come from the archive, unpacked in their work directory
    assert result["executors"], result
    for line in result["executors"]:
        python, psycopg_file, package_file = line.split(" ")
        env = Path(python).parent.parent
        assert re.fullmatch(r".*/worker-\d/work/app-[\d-]+/\d+/env", str(env)), line
        assert psycopg_file.startswith(f"{env}/lib/") and ".zip/pgstream_dagster/" in package_file, line

    # every event once at least, and per key the first deliveries in commit (id) order
    assert result["runs"][-1] is True
    with psycopg.connect(db_url) as conn:
        key_of: dict[Any, Any] = dict(conn.execute("select id, payload->>'group_id' from pgstream.events "
                                                   "where stream_id = 1"))
    assert set(result["accepted"]) == set(key_of)
    for key in set(key_of.values()):
        firsts = list(dict.fromkeys(i for i in result["accepted"] if key_of[i] == key))
        assert firsts == sorted(firsts), key


def test_a_relative_executor_python_must_exist_on_the_runs_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    exe = tmp_path / "env" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    assert cluster.driver_python_problem("/opt/venv/bin/python", tmp_path) is None  # absolute: the user's call
    assert cluster.driver_python_problem("python3", tmp_path) is None  # looked up on PATH
    problem = cluster.driver_python_problem("./env/bin/python", tmp_path)  # not executable
    assert problem is not None and f"working directory {str(tmp_path)!r}" in problem
    exe.chmod(0o755)
    assert cluster.driver_python_problem("./env/bin/python", tmp_path) is None
    assert cluster.driver_python_problem("env/bin/python", tmp_path) is None
    assert cluster.driver_python_problem("./other/bin/python", tmp_path) is not None

    # a Spark Connect server plans the data sources from its own working directory: refused before it starts
    monkeypatch.chdir(tmp_path / "env")
    with pytest.raises(sparkserver.SparkServerError, match="the Spark Connect server's working directory"):
        sparkserver.start(free_port(), conf={"spark.pyspark.python": "./env/bin/python"})
    from pgstream_dagster.cli import main as cli_main

    port = str(free_port())
    assert cli_main(["spark-connect", "--port", port, "--conf", "spark.pyspark.python=./env/bin/python"]) == 1
    assert "error: spark.pyspark.python './env/bin/python' is relative" in capsys.readouterr().err


def test_spark_source_stream_killed_and_restarted_on_a_standalone_cluster(
        db_url: str, tmp_path: Path, spark_cluster: SparkCluster) -> None:
    """``readStream.format("pgstream")`` on the cluster (executors without pgstream_dagster: the source
    reaches them in the shipped zip) into Parquet, killed with SIGKILL mid-stream and restarted on its
    checkpoint: each event exactly once (tests/support/spark_source.py)."""
    stream_exactly_once(db_url, tmp_path, {"spark.master": spark_cluster.master_url,
                                           "spark.pyspark.python": str(spark_cluster.python),
                                           "spark.executor.memory": "512m"})
