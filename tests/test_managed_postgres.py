"""No superuser anywhere (docs/managed-postgres.md): on a Postgres of its own, the superuser does what a
managed service does (the administrator, a role with CREATEROLE and no superuser, and its database) and
nothing more; the administrator runs the page's roles block; the owner migrates and applies the
subscriptions; the group's sensor, the group delivery run (hosting the stream's open run) and a replay run
as the runtime's login role, to a real HTTP endpoint that counts the events. No event trigger is created and
no connection after the bootstrap is a superuser's. ``preflight`` names the managed service's setting for each
missing prerequisite."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.cli import main
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import REPLAY_JOB, REPLAY_OP
from pgstream_dagster.devdb import LocalPostgres, ensure_running
from pgstream_dagster.engine.subscriptions import trigger_state

from .support.harness import Driver, tick_until, write_config
from .support.http_recorder import HttpRecorder

ADMIN = "cloud_admin"  # the service's administrator: RDS's master user, Cloud SQL's postgres user
OWNER, RUNTIME, APP = "pgstream_owner", "pgstream_app", "shop"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "managed-postgres.md"


def _roles_block() -> str:
    """The SQL block of docs/managed-postgres.md that the administrator runs."""
    text = DOCS.read_text()
    match = re.search(r"<!-- managed-roles -->\n```sql\n(.*?)```", text, re.S)
    assert match, f"{DOCS}: no sql block after <!-- managed-roles -->"
    return match.group(1)


def _as(server: LocalPostgres, role: str, database: str = "app") -> str:
    return server.url_for(database).replace("postgres@", f"{role}@", 1)


def _run(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        for s in statements:
            c.execute(s)


@pytest.fixture(scope="module")
def managed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A cluster whose log records every connection (``log_connections``)."""
    server = ensure_running(tmp_path_factory.mktemp("pg-managed") / "data",
                            extra_settings={"fsync": "off", "full_page_writes": "off", "log_connections": "on"})
    yield server
    server.destroy()


def _restart_with(server: LocalPostgres, **settings: str) -> None:
    """Restart ``server`` with ``settings`` unless it runs with them."""
    if any(server.settings.get(k) != v for k, v in settings.items()):
        server.settings.update(settings)
        server.restart()


@pytest.fixture
def cloud(managed: LocalPostgres) -> Iterator[LocalPostgres]:
    """What the cloud does as a superuser, and nothing more: the administrator (CREATEROLE, no superuser)
    and its database ``app``. Afterwards the database and its slots are dropped."""
    _restart_with(managed, wal_level="logical", max_replication_slots="32", max_wal_senders="32")
    _run(managed.url, f"create role {ADMIN} login createrole replication", f"create database app owner {ADMIN}")
    yield managed
    _run(managed.url, "select pg_drop_replication_slot(slot_name) from pg_replication_slots where database = 'app'",
         "drop database app with (force)")


def _connections(server: LocalPostgres, since: int) -> Counter[str]:
    """The roles of the connections authorized since byte ``since`` of the server's log (replication
    connections as ``<role> (replication)``)."""
    log = (server.datadir / "server.log").read_bytes()[since:].decode(errors="replace")
    found: Counter[str] = Counter()
    for kind, user in re.findall(r"(replication )?connection authorized: user=(\S+)", log):
        found[f"{user} (replication)" if kind else user] += 1
    return found


def test_the_whole_pipeline_runs_with_no_superuser_after_the_clouds_bootstrap(
        cloud: LocalPostgres, http_server: HttpRecorder, instance: dg.DagsterInstance, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    managed = cloud
    since = (managed.datadir / "server.log").stat().st_size
    admin = _as(managed, ADMIN)
    # the application: its role (made by the administrator) and its table
    _run(admin, f"create role {APP} login", f"grant create on schema public to {APP}")
    app = _as(managed, APP)
    _run(app, "create table public.orders (id bigint primary key, amount int not null)")
    _run(admin, _roles_block())
    owner, runtime = _as(managed, OWNER), _as(managed, RUNTIME)
    config = write_config(tmp_path / "pgstream.yaml", runtime, [
        {"id": 1, "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 1},
         "delivery": {"mode": "open"},  # the run stays open and reads the slot itself
         "sink": {"type": "http", "url": http_server.url, "mode": "per_event"}}],
        [{"key": "orders", "stream_id": 1, "operation": "INSERT", "schema_name": "public", "table_name": "orders",
          "column_names": ["id", "amount"]}])
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    capsys.readouterr()
    assert main(["preflight", "--config", str(config)]) == 0
    assert main(["init", "--config", str(config), "--owner-database-url", owner]) == 0
    out = capsys.readouterr()
    assert "ready" in out.out and "created slot" in out.out
    assert out.err.splitlines() == [line for line in out.err.splitlines() if "schema-drift guard is NOT active" in line]
    assert len(out.err.splitlines()) == 1  # init says once that the drift guard is off

    driver = Driver(config, instance)
    _run(app, "insert into public.orders select g, g * 10 from generate_series(1, 20) g")
    # the first tick requests the group delivery run (launched in the background): it hosts the stream's open run
    assert tick_until(driver, 1, lambda: len(http_server.received) >= 20, timeout=120) == []
    # handed to the open run; the group delivery run's reader reads them from the slot over the replication
    # protocol
    _run(app, "insert into public.orders select g, g * 10 from generate_series(21, 30) g")
    assert tick_until(driver, 1, lambda: len(http_server.received) >= 30, timeout=120) == []
    driver.stop_group_runs()
    (run,) = driver.group_runs["default"]  # one group delivery run delivered them all
    assert run.wait(timeout=60).success
    with psycopg.connect(runtime) as c:
        events = [r[0] for r in c.execute("select id from pgstream.events where stream_id = 1 order by id")]
    assert len(events) == 30
    assert [int(r.headers["webhook-id"]) for r in http_server.received] == events  # once each, in commit order
    assert [r.body["new"]["id"] for r in http_server.received] == list(range(1, 31))

    # a replay of every event, as the runtime: each once more
    replay = build_definitions(config).resolve_job_def(REPLAY_JOB).execute_in_process(
        run_config={"ops": {REPLAY_OP: {"config": {"stream_id": 1, "all_events": True}}}}, instance=instance,
        raise_on_error=False)
    assert replay.success
    assert Counter(int(r.headers["webhook-id"]) for r in http_server.received) == Counter(events * 2)

    # the administrator may not create the drift guard's event triggers here (RDS's master user may): refused
    # in one line, nothing changed
    capsys.readouterr()
    assert main(["install-drift-guard", "--database-url", admin]) == 1
    assert capsys.readouterr().err == ("error: install-drift-guard: the role of --database-url may not create event "
                                       "triggers: it must be a superuser (on Amazon RDS: the master user); nothing "
                                       "was changed\n")

    # no event trigger anywhere, and every connection since the bootstrap was one of the profile's roles
    connected = _connections(managed, since)
    with psycopg.connect(admin) as c:
        assert c.execute("select count(*) from pg_event_trigger").fetchone() == (0,)
        supers = {r[0] for r in c.execute("select rolname from pg_roles where rolsuper")}
        roles = {r[0]: r[1:] for r in c.execute(
            "select rolname, rolcreaterole, rolreplication from pg_roles where rolname = any(%s)",
            [[ADMIN, OWNER, RUNTIME, APP]])}
    assert {user.split()[0] for user in connected} == {ADMIN, APP, OWNER, RUNTIME}, connected
    assert not {user.split()[0] for user in connected} & supers
    assert connected[f"{RUNTIME} (replication)"] >= 1  # the group delivery run's reader of the slot
    assert roles == {ADMIN: (True, True), OWNER: (False, False), RUNTIME: (False, True), APP: (False, False)}

    # the drift guard is off (docs/security.md, Without the drift guard): the table's owner disables the
    # trigger (the trigger_matches check names it) and drops a subscribed column (the writes fail)
    _run(app, "alter table public.orders disable trigger pgstream_insert")
    with psycopg.connect(runtime) as c:
        assert trigger_state(c, "public", "orders", "INSERT").problems() == ["trigger pgstream_insert is disabled"]
    _run(app, "alter table public.orders enable trigger pgstream_insert",
         "alter table public.orders drop column amount")
    with pytest.raises(psycopg.errors.UndefinedColumn, match='record "new" has no field "amount"'):
        _run(app, "insert into public.orders values (31)")


def test_preflight_names_the_managed_services_setting_for_each_missing_prerequisite(
        managed: LocalPostgres, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server with none of the prerequisites (wal_level replica, one slot and one WAL sender for two reader
    groups) and a runtime role that may not read slots: one line each, naming postgresql.conf, then each
    service's own setting once the cluster holds that service's administrator role; on RDS, membership in
    rds_replication is the replication right."""
    server = managed
    _restart_with(server, wal_level="replica", max_replication_slots="1", max_wal_senders="1")
    _run(server.url, "create role reader login")
    try:
        config = write_config(tmp_path / "pgstream.yaml", _as(server, "reader", "postgres"), [
            {"id": i, "reader": reader, "sink": {"type": "http", "url": "http://127.0.0.1:9/hook"}}
            for i, reader in ((1, "default"), (2, "other"))])  # two reader groups: a slot and a WAL sender each
        monkeypatch.delenv("DAGSTER_HOME", raising=False)

        def preflight(service_role: str | None = None) -> list[str]:
            if service_role:
                _run(server.url, f"create role {service_role} nologin")
            try:
                capsys.readouterr()
                assert main(["preflight", "--config", str(config)]) == 1
                return capsys.readouterr().err.splitlines()
            finally:
                if service_role:
                    _run(server.url, f"drop role {service_role}")

        needs = ["wal_level is replica; the streams' slots need logical decoding: ",
                 "role reader (database_url) may not read replication slots and the reader groups' sensors and "
                 "delivery runs read their slots as it: ",
                 "max_replication_slots is 1 and 0 are in use; reader group other needs one more: ",
                 "max_wal_senders is 1 and 0 are in use by others; 2 reader groups' delivery runs read their group's "
                 "slot over replication, one WAL sender each: "]
        assert preflight() == [a + b for a, b in zip(needs, [
            "set wal_level = logical in postgresql.conf and restart Postgres",
            "as a superuser: alter role reader replication",
            "set max_replication_slots = 8 in postgresql.conf and restart Postgres",
            "set max_wal_senders = 8 in postgresql.conf and restart Postgres"], strict=True)]
        rds = " in the DB parameter group (Aurora: the DB cluster parameter group) and reboot the instance"
        assert preflight("rds_superuser") == [a + b for a, b in zip(needs, [
            f"set rds.logical_replication = 1{rds}",
            "as the master user (rds_superuser): grant rds_replication to reader",
            f"set max_replication_slots = 8{rds}", f"set max_wal_senders = 8{rds}"], strict=True)]
        assert preflight("cloudsqlsuperuser") == [a + b for a, b in zip(needs, [
            "set the database flag cloudsql.logical_decoding = on and restart the instance",
            "as a cloudsqlsuperuser (the postgres user): alter role reader with replication",
            "set the database flag max_replication_slots = 8 and restart the instance",
            "set the database flag max_wal_senders = 8 and restart the instance"], strict=True)]
        assert preflight("azure_pg_admin") == [a + b for a, b in zip(needs, [
            "set the server parameter wal_level = logical and restart the server",
            "as the administrator (azure_pg_admin): alter role reader with replication",
            "set the server parameter max_replication_slots = 8 and restart the server",
            "set the server parameter max_wal_senders = 8 and restart the server"], strict=True)]
        # RDS gives the right through its role: a member of rds_replication may read slots
        _run(server.url, "create role rds_replication nologin", "grant rds_replication to reader")
        assert [line for line in preflight("rds_superuser") if line.startswith("role reader")] == []
    finally:
        _run(server.url, "drop role if exists rds_replication", "drop role reader")
