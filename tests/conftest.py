"""Test fixtures: one private Postgres (wal_level=logical) per session, a fresh database per test."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
import yaml
from psycopg import sql

from pgstream_dagster.devdb import LocalPostgres, ensure_running
from pgstream_dagster.engine.migrations import migrate

from .support import faults
from .support.aws import REGION, FakeCredentials, FaultProxy, MotoServer
from .support.dagster_dev import Databases, drop_databases, make_databases, repo_root
from .support.endpoint import Endpoint
from .support.harness import Driver
from .support.http_recorder import HttpRecorder, recording_server
from .support.schema import USERS
from .support.sinks import nats_admin, unique

#: the slowest files, slowest first (each file's total of ``--durations=0`` in a full run): the three test processes
#: of ``make test`` (``-n 3 --dist loadfile --no-loadscope-reorder``: a file per process at a time, in this order)
#: start with them, longest first, so they end together
SLOWEST_FILES = ("test_failover.py", "test_spark_cluster.py", "test_code_location.py", "test_group_delivery.py",
                 "test_fault_integrity.py", "test_reader_groups.py", "test_open_runs.py",
                 "test_spark_connect.py", "test_spark_source.py", "test_asset_checks.py", "test_browser.py",
                 "test_dev.py", "test_backfill.py", "test_kafka_sink.py", "test_standby_failover.py",
                 "test_demo_green.py", "test_security.py", "test_deployment.py", "test_automation_e2e.py",
                 "test_privilege_matrix.py", "test_by_key_resume.py", "test_memory_bytes.py", "test_metrics.py",
                 "test_spark_memory.py", "test_components.py", "test_subscription_assets.py", "test_lake_pipeline.py",
                 "test_runtime_role.py", "test_replay.py", "test_database_core.py", "test_streaming.py",
                 "test_sink_sqs.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in file order


TEMPLATE = "pgstream_template"
_counter = itertools.count()


@pytest.fixture(scope="session")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    server = ensure_running(
        tmp_path_factory.mktemp("pg") / "data",
        extra_settings={"fsync": "off", "full_page_writes": "off",
                        "max_slot_wal_keep_size": "-1"},
    )
    yield server
    _keep_server_log(server.datadir)
    server.destroy()


#: what in the test cluster's log explains tests failing with "connection refused" / "server closed the
#: connection" (the cluster or a backend died)
_NOTABLE = ("PANIC", "terminated by signal", "shutdown request", "was terminated", "out of memory")


def _keep_server_log(datadir: Path) -> None:
    """The test cluster's log outlives its data directory (beside it, as server.log), and the lines
    that say why it stopped or crashed are printed past pytest's capture."""
    log = datadir / "server.log"
    if not log.exists():
        return
    kept = datadir.parent / "server.log"
    shutil.copyfile(log, kept)
    notable = [line for line in log.read_text(errors="replace").splitlines() if any(n in line for n in _NOTABLE)]
    if notable:
        (sys.__stderr__ or sys.stderr).write(f"\ntest Postgres log ({kept}), notable lines:\n"
                                             + "\n".join(notable[-20:]) + "\n")


#: the migrated template of each UTC day the session has run in
_templates: dict[dt.date, str] = {}


@pytest.fixture
def template_db(pg: LocalPostgres) -> str:
    """:func:`migrated_template`."""
    return migrated_template(pg)


def migrated_template(pg: LocalPostgres) -> str:
    """A migrated database to copy, of today (UTC): migrate creates today's partition of pgstream.events and
    the week ahead, and the tests that check those would find yesterday's in a template made before a
    midnight the suite ran across. Made once a day (per test worker)."""
    today = dt.datetime.now(dt.UTC).date()
    if today not in _templates:
        name = f"{TEMPLATE}_{today:%Y%m%d}"
        pg.create_database(name)
        migrate(pg.url_for(name))
        _templates[today] = name
    return _templates[today]


def fresh_database(pg: LocalPostgres, template: str) -> str:
    name = f"t{next(_counter)}"
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("create database {} template {}").format(sql.Identifier(name),
                                                                      sql.Identifier(template)))
    return name


def drop_database(pg: LocalPostgres, name: str) -> None:
    """Drop the test's database and its slots (slot names are the cluster's: one left behind fails
    every later test). A slot still held (a failed test's run thread reading it) is taken from its
    holder first, as often as the holder comes back, for up to 60 s."""
    deadline = time.monotonic() + 60
    with psycopg.connect(pg.url_for(name), autocommit=True) as conn:
        while slots := conn.execute("select slot_name, active_pid from pg_replication_slots where database = %s",
                                    [name]).fetchall():
            for slot, holder in slots:
                if holder is not None:
                    conn.execute("select pg_terminate_backend(%s, 10000)", [holder])
                try:
                    conn.execute("select pg_drop_replication_slot(%s)", [slot])
                except (psycopg.errors.ObjectInUse, psycopg.errors.UndefinedObject):
                    assert time.monotonic() < deadline, f"slot {slot} is still held by a connection"
                    time.sleep(0.1)
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


@pytest.fixture
def db_url(pg: LocalPostgres, template_db: str) -> Iterator[str]:
    """A freshly migrated database of its own."""
    name = fresh_database(pg, template_db)
    yield pg.url_for(name)
    try:
        _close_drivers()  # (their runs end before their database goes: no run waits on a dropped database)
    finally:  # (a run that did not end fails this test only: its database and slots go all the same)
        drop_database(pg, name)


@pytest.fixture
def empty_db_url(pg: LocalPostgres) -> Iterator[str]:
    """A database without pgstream installed."""
    name = fresh_database(pg, "template1")
    yield pg.url_for(name)
    try:
        _close_drivers()
    finally:
        drop_database(pg, name)


@pytest.fixture(scope="session")
def dagster_storage_url(pg: LocalPostgres) -> str:
    pg.create_database("dagster_storage")
    # SQLAlchemy 2.1 defaults to psycopg 3 for postgresql://; Dagster's storage wants psycopg2
    return pg.url_for("dagster_storage").replace("postgresql://", "postgresql+psycopg2://")


def storage_overrides(postgres_url: str) -> dict[str, Any]:
    """The repository's dagster.yaml storage (what users run: Postgres, pooled), on ``postgres_url``; runs
    executed in process keep no compute logs: Dagster's local capture follows each run's output with a
    ``tail -F`` and waits up to 30 s for it when a run ends in a thread (no test reads compute logs)."""
    storage = yaml.safe_load((repo_root() / "dagster.yaml").read_text())["storage"]
    for kind in storage.values():
        (kind.get("config", kind))["postgres_url"] = postgres_url
    return {"storage": storage,
            "compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                             "class": "NoOpComputeLogManager"}}


@pytest.fixture
def instance(dagster_storage_url: str, tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    """A real Dagster instance with the repository's Postgres storage (shared by the tests: filter by run)."""
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(overrides=storage_overrides(dagster_storage_url),
                              temp_dir=str(tmp_path / "dagster_home")) as inst:
        yield inst


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(db_url, autocommit=True) as c:
        yield c


@pytest.fixture
def databases(pg: LocalPostgres) -> Iterator[Databases]:
    """An application database and a Dagster storage database of their own (for `dagster dev`)."""
    dbs = make_databases(pg)
    try:
        yield dbs
    finally:
        drop_databases(pg, dbs)


@pytest.fixture(params=faults.MODES)
def delivery_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fault-matrix row on each delivery mode (``faults.MODES``; the fault files use it for every row):
    ``faults.stream_config`` configures stream 1 in it."""
    mode = str(request.param)
    monkeypatch.setattr(faults, "MODE", mode)
    return mode


@pytest.fixture(autouse=True)
def _drivers_closed() -> Iterator[None]:
    """The group delivery runs a test's drivers launched end with the test (asked, as the sensor asks)."""
    yield
    _close_drivers()


def _close_drivers() -> None:
    made, Driver.made[:] = list(Driver.made), []
    failed: list[str] = []
    for driver in made:  # (every driver's runs are asked to end, even when one's do not)
        try:
            driver.close()
        except AssertionError as exc:
            failed.append(str(exc))
    assert not failed, "\n".join(failed)


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    """A recording HTTP endpoint (tests/support/endpoint.py), taken down after the test."""
    ep = Endpoint()
    yield ep
    ep.down()


@pytest.fixture
def http_server() -> Iterator[HttpRecorder]:
    """A real HTTP server on loopback that records what a sink sends (tests/support/http_recorder.py)."""
    with recording_server() as recorder:
        yield recorder


@pytest.fixture
def manual_role(db_url: str) -> Iterator[str]:
    """A LOGIN role with the documented manual-event grant, and nothing else."""
    name = f"manual_{next(_counter)}_{db_url.rsplit('/', 1)[1]}"
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(sql.SQL("create role {} login").format(sql.Identifier(name)))
        c.execute(sql.SQL("grant usage on schema pgstream to {}").format(sql.Identifier(name)))
        c.execute(sql.SQL("grant insert (payload, metadata, stream_id) on pgstream.events to {}").format(
            sql.Identifier(name)))
        c.execute(sql.SQL("grant usage on sequence pgstream.events_id_seq to {}").format(sql.Identifier(name)))
    yield name
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(name)))
        c.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))


@pytest.fixture
def users(conn: psycopg.Connection) -> psycopg.Connection:
    """A fresh pgstream database with ``public.users`` (tests/support/schema.py)."""
    conn.execute(USERS)
    return conn


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto's standalone server on a free loopback port, for the session (tests/support/aws.py)."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    yield server
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> FakeCredentials:
    """Fake credentials and the region in the environment, where boto3's standard chain finds them;
    no shared config files, no instance metadata."""
    credentials = FakeCredentials("AKIDPGSTREAMTEST", "fake-secret-" + uuid.uuid4().hex,
                                  "fake-token-" + uuid.uuid4().hex)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", credentials.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", credentials.secret_access_key)
    monkeypatch.setenv("AWS_SESSION_TOKEN", credentials.session_token)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return credentials


@pytest.fixture
def fault_proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    """A proxy in front of the moto server that injects per-entry failures and outages."""
    proxy = FaultProxy(moto_server.url)
    yield proxy
    proxy.stop()


@pytest.fixture
def nats_stream() -> Iterator[tuple[str, str]]:
    """A JetStream stream of its own on the NATS server on loopback: (name, subject); it captures the
    subject and ``subject.>``."""
    name = unique("PGSTREAM_TEST").replace("-", "_")
    subject = f"pgstream.test.{name}"
    asyncio.run(nats_admin("create", name, subject))
    yield name, subject
    asyncio.run(nats_admin("delete", name))
