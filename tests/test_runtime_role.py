"""The least-privilege runtime: pgstream installed by a non-superuser owner, the whole pipeline run as
a login member of ``pgstream_runtime`` (sensor ticks, delivery runs, a backfill, a replay, housekeeping,
metrics) with Spark executors connecting as a login member of ``pgstream_executor``; and what those roles
cannot do, each tried from a fresh connection as the role (sql/024_runtime_roles.sql,
sql/repeatable/99_runtime.sql)."""

from __future__ import annotations

import datetime as dt
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
import yaml
from psycopg import sql

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.config import DEFAULT_READER, ConfigError, HousekeepingConfig, load_config
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import BACKFILL_JOB, BACKFILL_OP, GROUP_TAG, REPLAY_JOB, REPLAY_OP, member_tag
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine import housekeeping, metrics
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.migrations import WRITER_ROLE, migrate
from pgstream_dagster.engine.subscriptions import SubscriptionError, apply_stream, trigger_state

from .support.harness import Driver, group_tag_of, read_jsonl, tick_until, write_config

RUNTIME_GROUP = "pgstream_runtime"
EXECUTOR_GROUP = "pgstream_executor"
_ids = itertools.count()


@dataclass
class Install:
    owner: str
    runtime: str
    executor: str
    owner_url: str
    runtime_url: str
    executor_url: str
    superuser_url: str
    config: Path
    out: Path


def _as(url: str, role: str) -> str:
    return url.replace("postgres@", f"{role}@", 1)


def _run(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        for s in statements:
            c.execute(s)


@pytest.fixture
def install(pg: LocalPostgres, template_db: str, tmp_path: Path) -> Iterator[Install]:
    """A database owned by a non-superuser owner (a member of pgstream_writer, no CREATEROLE: the group
    roles exist in the cluster already), migrated by it; a runtime login role (REPLICATION, member of
    pgstream_runtime) and an executor login role (member of pgstream_executor); public.items (owned by
    the owner) with 30 rows subscribed on INSERT, applied by ``init`` as the owner while the streams and
    slots are made as the runtime."""
    n = next(_ids)
    owner, runtime, executor = f"rt_owner_{n}", f"rt_runtime_{n}", f"rt_executor_{n}"
    name = f"rt_{n}"
    _run(pg.url, f"create role {owner} login", f"grant {WRITER_ROLE} to {owner}",
         f"create role {runtime} login replication in role {RUNTIME_GROUP}",
         f"create role {executor} login in role {EXECUTOR_GROUP}",
         f"create database {name} owner {owner}")
    url = pg.url_for(name)
    owner_url, runtime_url, executor_url = _as(url, owner), _as(url, runtime), _as(url, executor)
    try:
        migrate(owner_url)
        _run(owner_url, "create table public.items (id bigint primary key, name text not null)",
             "insert into public.items select g, 'item ' || g from generate_series(1, 30) g")
        out = tmp_path / "sink.jsonl"
        cfg = write_config(tmp_path / "pgstream.yaml", runtime_url, [
            {"id": 1, "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 1},
             # Spark reads every round: the executors connect as the executor role; the stream's run stays
             # open (its group delivery run's reader reads the slot: replication protocol)
             "delivery": {"mode": "open", "tuning": {"direct_max_events": 0}},
             "sink": {"type": "file", "path": str(out)}},
            # by_key: Spark tasks publish and record their resume points as the executor role
            # (its group's delivery run, hosting both streams, stays up for the test: max_run_secs)
            {"id": 2, "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 1},
             "delivery": {"ordering": "by_key", "routing_key": "new.id", "parallelism": 2,
                          "tuning": {"max_run_secs": 600}},
             "sink": {"type": "file", "path": str(tmp_path / "by_key.jsonl")}}],
            [{"key": "items", "stream_id": s, "operation": "INSERT", "schema_name": "public", "table_name": "items",
              "column_names": ["id", "name"]} for s in (1, 2)],
            spark={"master": "local[2]", "executor_database_url": executor_url})
        init(cfg, owner_url=owner_url)
        yield Install(owner, runtime, executor, owner_url, runtime_url, executor_url, pg.url, cfg, out)
    finally:
        for driver in Driver.made:  # the group delivery runs end before their slot is dropped
            driver.close()
        with psycopg.connect(pg.url_for(name), autocommit=True) as c:
            slots = c.execute("select slot_name from pg_replication_slots where database = %s", [name]).fetchall()
            for (slot,) in slots:
                c.execute("select pg_drop_replication_slot(%s)", [slot])
        _run(pg.url, sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)).as_string(),
             *(f"drop role if exists {r}" for r in (runtime, executor, owner)))


def _count(url: str, query: str) -> int:
    with psycopg.connect(url) as c:
        row = c.execute(query).fetchone()
        assert row is not None
        return int(row[0])


def _id_list(url: str, query: str) -> list[int]:
    with psycopg.connect(url) as c:
        return [int(r[0]) for r in c.execute(query).fetchall()]


def cli(args: list[str], env: dict[str, str]) -> int:
    """``pgstream-dagster ARGS`` with ``env`` set (the URL it connects with)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        return cli_main(args)


def _job(cfg: Path, name: str, op: str, config: dict[str, Any], instance: dg.DagsterInstance) -> bool:
    job = build_definitions(cfg).resolve_job_def(name)
    return job.execute_in_process(run_config={"ops": {op: {"config": config}}}, instance=instance,
                                  raise_on_error=False).success


def test_the_whole_pipeline_runs_as_the_runtime_role(install: Install, instance: dg.DagsterInstance) -> None:
    """The group's sensor ticks and its delivery run (its slot reader over the replication protocol; rounds read
    by Spark executors as the executor role), a by_key stream (Spark tasks publish and record resume
    points as the executor role), a backfill of the 40 rows (partitions on Spark), a replay, pause,
    set-aside, resume and a dead-letter redelivery through the CLI, housekeeping, metrics and the
    subscription check, all connected as the runtime role: every event is delivered, counted."""
    i = install
    # the code location's only connection is the runtime's (the owner's URL is not in its configuration)
    assert load_config(i.config).database_url.get_secret_value() == i.runtime_url
    driver = Driver(i.config, instance)
    by_key = i.out.with_name("by_key.jsonl")
    _run(i.owner_url, "insert into public.items select g, 'item ' || g from generate_series(31, 35) g")
    # streams 1 and 2 are in the default reader group: its delivery run (in the background) hosts their runs
    assert tick_until(driver, 1, lambda: len(read_jsonl(i.out)) >= 5, timeout=300) == []
    (run,) = driver.group_runs[DEFAULT_READER]
    # the run is open: these are handed to it, no new run is requested
    _run(i.owner_url, "insert into public.items select g, 'item ' || g from generate_series(36, 40) g")
    assert tick_until(driver, 1, lambda: len(read_jsonl(i.out)) >= 10, timeout=300) == []
    assert sorted(e["payload"]["new"]["id"] for e in read_jsonl(i.out)) == list(range(31, 41))
    with psycopg.connect(i.owner_url) as c:
        # every batch went to the one open run
        assert c.execute("select count(distinct run_key), count(*) filter (where status <> 'delivered') "
                         "from pgstream.batches where stream_id = 1").fetchone() == (1, 0)

    # stream 2 (by_key) delivers the same 10 events from Spark tasks
    tick_until(driver, 2, lambda: len(read_jsonl(by_key)) >= 10, timeout=300)
    assert sorted(e["payload"]["new"]["id"] for e in read_jsonl(by_key)) == list(range(31, 41))
    driver.stop_group_runs()
    assert run.wait(timeout=120).success
    assert [r for r in instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(i.runtime_url, DEFAULT_READER)}))
            if '"failed"' in r.tags.get(member_tag(1), "") + r.tags.get(member_tag(2), "")] == []

    # runs that end once delivered from here on (an open run only waits in this in-process driver)
    data = yaml.safe_load(i.config.read_text())
    data["streams"][0]["delivery"]["mode"] = "per_batch"
    i.config.write_text(yaml.safe_dump(data))
    driver = Driver(i.config, instance)

    # a backfill: the 40 rows become READ events (partitions run on the executors), then delivered
    assert _job(i.config, BACKFILL_JOB, BACKFILL_OP,
                {"stream_id": 1, "subscriptions": ["items"], "parallelism": 2, "chunk_size": 7}, instance)
    driver.run_until(1, lambda: len(read_jsonl(i.out)) >= 50, timeout=300)
    assert driver.results and all(r.success for r in driver.results)
    reads = Counter(e["payload"]["new"]["id"] for e in read_jsonl(i.out) if e["payload"]["tg_op"] == "READ")
    assert reads == Counter(range(1, 41))
    assert _count(i.owner_url, "select count(*) from pgstream.backfills where status = 'done'") == 1

    # a replay of every event, through the same sink: each event once more
    assert _job(i.config, REPLAY_JOB, REPLAY_OP, {"stream_id": 1, "all_events": True}, instance)
    delivered = Counter(e["id"] for e in read_jsonl(i.out))
    assert len(delivered) == 50 and set(delivered.values()) == {2}

    # operator controls and dead letters, through the CLI as the runtime role: pause, set an event of an
    # open batch aside, resume; the run delivers the rest, the redelivery the dead letter
    env = {"PGSTREAM_DATABASE_URL": i.runtime_url}
    assert cli(["pause", "1"], env) == 0
    _run(i.owner_url, "insert into public.items values (41, 'item 41')")
    tick_until(driver, 1, lambda: _count(i.owner_url, "select count(*) from pgstream.batches "
                                                      "where stream_id = 1 and status = 'pending'") == 1)
    (event_41,) = _id_list(i.owner_url, "select id from pgstream.events "
                                        "where stream_id = 1 and payload->'new'->>'id' = '41'")
    assert cli(["dead-letters", "set-aside", "1", str(event_41), "--reason", "test", "--yes"], env) == 0
    assert cli(["resume", "1"], env) == 0
    driver.run_until(1, lambda: _count(i.owner_url, "select count(*) from pgstream.batches where stream_id = 1 "
                                                    "and status <> 'delivered'") == 0, timeout=300)
    assert event_41 not in {e["id"] for e in read_jsonl(i.out)}
    assert cli(["dead-letters", "redeliver", "1", "--config", str(i.config)], env) == 0
    assert Counter(e["id"] for e in read_jsonl(i.out))[event_41] == 1
    assert _count(i.owner_url, "select count(*) from pgstream.dead_letters where status = 'redelivered'") == 1

    with psycopg.connect(i.runtime_url, autocommit=True) as c:
        # housekeeping (partitions ahead, retention, pruning) and the exporter's read
        report = housekeeping.run_housekeeping(c, HousekeepingConfig(days_ahead=3))
        assert report.warnings == []
        counters = {r.metric: r.value for r in metrics.read(c, 5.0) if r.stream_id == 1 and not r.label}
        assert counters["events_delivered"] == 50  # the live events and the READ events; a replay is not counted
        # the subscription assets as the runtime: they check the owner applied the YAML, and write nothing
        config = load_config(i.config)
        assert apply_stream(c, config.subscriptions, 1, "pgstream.yaml").changes == {}
        edited = [s.model_copy(update={"column_names": ["id"]}) for s in config.subscriptions]
        with pytest.raises(SubscriptionError, match=f"role {i.runtime} may not write pgstream.subscriptions.*"
                                                    "pgstream-dagster init.*column_names differ"):
            apply_stream(c, edited, 1, "pgstream.yaml")
    with psycopg.connect(i.owner_url) as c:
        assert c.execute("select distinct column_names from pgstream.subscriptions").fetchall() == [(["id", "name"],)]
        assert c.execute("select rolsuper from pg_roles where rolname = current_user").fetchone() == (False,)


#: every function of pgstream: signature, security definer, owner, body, settings, privileges
FUNCTIONS = ("select p.oid::regprocedure::text, p.prosecdef, p.proowner::regrole::text, md5(p.prosrc), "
             "p.proconfig, p.proacl::text from pg_proc p where p.pronamespace = 'pgstream'::regnamespace order by 1")

#: what the runtime role tries, each from a fresh connection; every one is refused
RUNTIME_ATTEMPTS = [
    "insert into pgstream.subscriptions (key, stream_id, operation, table_name) values ('x', 1, 'INSERT', 'items')",
    "update pgstream.subscriptions set when_clause = 'true'",
    "delete from pgstream.subscriptions",
    "select pgstream.set_subscriptions(1, array[]::pgstream.subscriptions[], 'yaml')",
    "select pgstream.regenerate_trigger('public', 'items', 'INSERT')",
    "insert into pgstream.events (payload, stream_id) values ('{}', 1)",
    "update pgstream.streams set paused = true",
    "update pgstream.streams set slot_name = 'elsewhere'",
    "insert into pgstream.streams (id) values (9)",
    "delete from pgstream.batches",
    "truncate pgstream.batches",
    "create table pgstream.mine (id int)",
    "create function pgstream.mine() returns int language sql as 'select 1'",
    "create or replace function pgstream.ensure_publications(p_stream_id bigint) returns setof text "
    "language sql as 'select null::text'",
    "alter function pgstream.register_stream(bigint, text) security invoker",
    # the owner's tools for a stream reading a slot of its own: nothing the runtime needs
    "select pgstream.register_stream(2, 'two')",
    "select pgstream.register_stream(1, 'x; drop')",
    "select pgstream.ensure_stream(9)",
    "select pgstream.ensure_publications(1)",
    "select pgstream.slot_holder('pgstream_stream_1', 2)",
    "alter function pgstream.backfill_chunk(bigint, integer, uuid, integer) owner to current_user",
    "alter table pgstream.events owner to current_user",
    "create trigger mine after insert on pgstream.batches execute function pgstream._touch_updated_at()",
    "drop publication pgstream_stream_1",
    "alter publication pgstream_stream_1_rows set table pgstream.events",
    "create publication mine for table pgstream.events",
    "select pgstream.lock_for_transaction('regenerate')",
    "select pgstream._backfill_drop_function(1)",
    "create table public.items_copy (like public.items)",
    "set role pgstream_writer",
]


def test_the_runtime_and_executor_roles_cannot_change_definitions_or_become_the_owner(install: Install) -> None:
    """From fresh connections: the runtime role cannot write subscriptions, events or the stream rows
    beyond its columns, create, alter, own or drop anything in pgstream (tables, functions, triggers,
    publications), call the owner's internal functions (those of a stream reading a slot of its own among them),
    nor become the owner or the writer. The executor role cannot write the ledger or call the runtime's API.
    Afterwards every pgstream object still belongs to the owner (or, generated, to pgstream_writer)
    and neither role is superuser."""
    i = install
    with psycopg.connect(i.owner_url) as c:
        before = c.execute(FUNCTIONS).fetchall()
        subscriptions = c.execute("select * from pgstream.subscriptions").fetchall()
    attempts = [*RUNTIME_ATTEMPTS, f"set role {i.owner}", f"grant {i.owner} to {i.runtime}",
                f"grant {RUNTIME_GROUP} to {i.executor}", f"alter role {i.runtime} superuser"]
    for statement in attempts:
        with psycopg.connect(i.runtime_url, autocommit=True) as c:  # a fresh connection each time
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(statement)
    with psycopg.connect(i.runtime_url, autocommit=True) as c:
        # what it may do: its own columns, through its API (stream 1 reads with its reader group, default)
        c.execute("select pgstream.register_group_member(1, 'default')")
        c.execute("update pgstream.streams set consumed_through = consumed_through where id = 1")
    for statement in ("update pgstream.batches set status = 'delivered'", "delete from pgstream.key_progress",
                      "select pgstream.register_stream(2, 'two')", "select pgstream.ensure_publications(1)",
                      "select pgstream.try_lock('delivery', 1)", "select * from pgstream.subscriptions",
                      "insert into pgstream.events (payload, stream_id) values ('{}', 1)",
                      "select * from pgstream.locks",
                      # it writes through the owner's functions with a token only (tests/test_executor_role.py)
                      "insert into pgstream.dead_letters (stream_id, event_id, stage, error) values (1, 1, 'read', '')",
                      "update pgstream.key_progress set ord = 0", "begin; lock table pgstream.key_progress",
                      "begin; lock table pgstream.dead_letters in row exclusive mode",
                      "select pgstream.issue_delivery_token(1, 'r')", "select pgstream.consumer_token('lake')",
                      f"set role {i.owner}", f"set role {i.runtime}"):
        with psycopg.connect(i.executor_url, autocommit=True) as c:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(statement)
    with psycopg.connect(i.executor_url, autocommit=True) as c:  # its writes, with a token (none here: nothing)
        assert c.execute("select pgstream.record_key_progress('no token', 3, '{0}', 1, 1)").fetchone() == (False,)
    app = f"rt_app_{i.runtime.rsplit('_', 1)[-1]}"
    _run(i.superuser_url, f"create role {app} login")
    try:  # a role of the application's: not even that
        with psycopg.connect(i.runtime_url.replace(f"{i.runtime}@", f"{app}@", 1), autocommit=True) as c:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute("select pgstream.record_key_progress('no token', 3, '{0}', 1, 1)")
    finally:
        _run(i.superuser_url, f"drop role {app}")
    with psycopg.connect(i.owner_url) as c:
        assert c.execute(FUNCTIONS).fetchall() == before
        assert c.execute("select * from pgstream.subscriptions").fetchall() == subscriptions
        owners = {r[0] for r in c.execute(
            "select relowner::regrole::text from pg_class where relnamespace = 'pgstream'::regnamespace "
            "union select proowner::regrole::text from pg_proc where pronamespace = 'pgstream'::regnamespace "
            "union select pubowner::regrole::text from pg_publication "
            "union select nspowner::regrole::text from pg_namespace where nspname = 'pgstream'")}
        assert owners == {i.owner, WRITER_ROLE}
        assert c.execute("select count(*) from pgstream.streams").fetchone() == (2,)
        for role in (i.runtime, i.executor, i.owner):
            assert c.execute("select rolsuper, rolcreaterole, pg_has_role(%s, %s, 'MEMBER') from pg_roles "
                             "where rolname = %s", [role, i.owner if role != i.owner else WRITER_ROLE, role]
                             ).fetchone() == (False, False, role == i.owner)


def test_make_dev_installs_as_a_non_superuser_owner_and_runs_as_the_runtime(pg: LocalPostgres, template_db: str,
                                                                            tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What `make dev` does before `dg dev`: the superuser makes the three login roles and the database
    (owned by the owner); the owner migrates; the superuser adds the drift guard's event triggers (the
    one step that needs it); init applies the demo's subscriptions as the owner and makes the slot as
    the runtime, whose URL is the demo configuration's database_url; the executors' URL is the
    executor role's. Done twice, it changes nothing."""
    from pgstream_dagster.dev import DEMO_EXECUTOR, DEMO_OWNER, DEMO_RUNTIME, demo_roles
    from pgstream_dagster.engine.migrations import (
        MigrationError,
        drift_guard_installed,
        install_drift_guard,
        sql_dir,
    )

    name = f"rt_dev_{next(_ids)}"
    urls = demo_roles(pg.url, name)
    try:
        assert demo_roles(pg.url, name) == urls
        migrate(urls["owner"])
        with psycopg.connect(urls["owner"]) as c:
            assert not drift_guard_installed(c)  # the owner cannot create event triggers: `migrate` warns
        with pytest.raises(MigrationError, match=r"must be a superuser.*nothing was changed"):
            install_drift_guard(urls["owner"])
        install_drift_guard(pg.url_for(name))
        _run(urls["owner"], (sql_dir() / "demo" / "demo_schema.sql").read_text())
        monkeypatch.setenv("PGSTREAM_DATABASE_URL", urls["runtime"])
        monkeypatch.setenv("PGSTREAM_EXECUTOR_DATABASE_URL", urls["executor"])
        monkeypatch.setenv("PGSTREAM_DEMO_SINK", str(tmp_path / "demo.jsonl"))
        monkeypatch.delenv("PGSTREAM_SPARK_REMOTE", raising=False)
        demo = Path(__file__).resolve().parent.parent / "pgstream.yaml"
        init(demo, owner_url=urls["owner"])
        config = load_config(demo)
        assert (config.database_url.get_secret_value(), config.executor_url) == (urls["runtime"], urls["executor"])
        with psycopg.connect(pg.url_for(name)) as c:
            assert drift_guard_installed(c)
            assert c.execute("select rolname::text, rolsuper, rolcreaterole, rolreplication, "
                             "array(select b.rolname::text from pg_auth_members m join pg_roles b on b.oid = m.roleid "
                             "      where m.member = r.oid order by 1) "
                             "from pg_roles r where rolname = any(%s) order by 1",
                             [[DEMO_OWNER, DEMO_RUNTIME, DEMO_EXECUTOR]]).fetchall() == [
                (DEMO_EXECUTOR, False, False, False, [EXECUTOR_GROUP]),
                (DEMO_OWNER, False, False, False, [WRITER_ROLE]),
                (DEMO_RUNTIME, False, False, True, [RUNTIME_GROUP])]
            assert c.execute("select nspowner::regrole::text from pg_namespace where nspname in ('pgstream', 'demo')"
                             ).fetchall() == [(DEMO_OWNER,), (DEMO_OWNER,)]
            assert c.execute("select count(*) from pgstream.subscriptions").fetchone() == (2,)
            # (the demo's streams read with their reader group, default: its one slot)
            assert c.execute("select slot_name from pg_replication_slots where database = %s", [name]).fetchall() == [
                (c.execute("select slot from pgstream.reader_groups where name = 'default'").fetchall()[0][0],)]
        _run(urls["owner"], "insert into demo.users (email, email_verified) values ('ada@example.com', true)")
        assert _count(urls["runtime"], "select count(*) from pgstream.events") == 1
        with psycopg.connect(urls["runtime"]) as c:
            # the runtime has no right on schema demo, and needs none: its subscription checks pass
            assert c.execute("select has_schema_privilege('demo', 'usage')").fetchone() == (False,)
            for sub in config.subscriptions:
                state = trigger_state(c, sub.schema_name, sub.table_name, sub.operation, sub.trigger_mode)
                assert state.trigger_oid is not None and state.problems() == []
        init(demo, owner_url=urls["owner"])  # again: nothing to do
    finally:
        with psycopg.connect(pg.url_for(name), autocommit=True) as c:
            for (slot,) in c.execute("select slot_name from pg_replication_slots where database = %s",
                                     [name]).fetchall():
                c.execute("select pg_drop_replication_slot(%s)", [slot])
        _run(pg.url, f"drop database if exists {name} with (force)",
             *(f"drop role if exists {r}" for r in (DEMO_RUNTIME, DEMO_EXECUTOR, DEMO_OWNER)))


def test_the_executors_url_is_checked_and_kept_secret(tmp_path: Path) -> None:
    """spark.executor_database_url is what executors connect with: on a cluster whose executors run on
    other hosts it is the URL checked (named in the error, never shown); database_url stays the runtime's
    and may then be local to the run's host; empty means database_url."""
    remote = {"master": "spark://spark-master.internal:7077"}
    cfg = write_config(tmp_path / "a.yaml", "postgresql://runtime:rt-secret@db.internal/app",
                       [{"id": 1, "sink": {"type": "file", "path": "/shared/x.jsonl"}}],
                       spark={**remote, "executor_database_url": "postgresql://spark:ex-secret@127.0.0.1/app"})
    with pytest.raises(ConfigError, match=r"spark\.executor_database_url names a loopback host") as err:
        load_config(cfg)
    assert "ex-secret" not in str(err.value) and "rt-secret" not in str(err.value)
    cfg = write_config(tmp_path / "b.yaml", "postgresql://runtime:rt-secret@127.0.0.1/app",
                       [{"id": 1, "sink": {"type": "file", "path": "/shared/x.jsonl"}}],
                       spark={**remote, "executor_database_url": "postgresql://spark:ex-secret@db.internal/app"})
    config = load_config(cfg)
    assert config.executor_url == "postgresql://spark:ex-secret@db.internal/app"
    assert "ex-secret" not in repr(config) and "ex-secret" not in str(config.spark)
    cfg = write_config(tmp_path / "c.yaml", "postgresql://runtime:rt-secret@db.internal/app",
                       [{"id": 1, "sink": {"type": "file", "path": "/x"}}], spark={"executor_database_url": " "})
    assert load_config(cfg).executor_url == "postgresql://runtime:rt-secret@db.internal/app"


def test_a_reader_groups_checks_run_as_the_runtime_role(install: Install, instance: dg.DagsterInstance,
                                                        tmp_path: Path) -> None:
    """The checks of a reader group's streams (the group's slot check, each member's own) read what they need
    as the runtime role: every check of the location runs and passes, none fails for want of a grant."""
    from pgstream_dagster.defs.names import CHECKS_JOB

    i = install
    cfg = write_config(tmp_path / "grouped.yaml", i.runtime_url, [
        {"id": s, "reader": "rt", "sink": {"type": "file", "path": str(tmp_path / f"g{s}.jsonl")}} for s in (3, 4)],
        [{"key": f"items-{s}", "stream_id": s, "operation": "INSERT", "schema_name": "public", "table_name": "items",
          "column_names": ["id", "name"]} for s in (3, 4)])
    init(cfg, owner_url=i.owner_url)
    result = build_definitions(cfg).resolve_job_def(CHECKS_JOB).execute_in_process(instance=instance,
                                                                                    raise_on_error=False)
    evaluations = {(e.asset_key.to_user_string(), e.check_name): e for e in result.get_asset_check_evaluations()}
    assert ("pgstream/events_partitions", "group_rt_slot_retained_wal") in evaluations
    assert len(evaluations) == 2 * 4 + 3  # (trigger, age, failover, dead letters a member; the location's three)
    failed = {k: e.description for k, e in evaluations.items() if not e.passed}
    assert not failed and result.success


def test_the_runtime_needs_no_right_on_the_application_schema(install: Install, instance: dg.DagsterInstance,
                                                              pg: LocalPostgres, tmp_path: Path) -> None:
    """A table owner's schema grants ``pgstream_runtime`` nothing (revoked here, as its owner may at any time):
    the subscription assets, the stream's checks (``trigger_matches`` among them) and a lake stream with
    ``typed_columns`` (its catalog types) still run as the runtime role and pass; every event is delivered,
    typed. Nothing the runtime does reads the application's schema by a path that needs ``USAGE`` on it."""
    from pgstream_dagster.defs.assets import subscription_keys, subscription_set_key
    from pgstream_dagster.defs.checks import TRIGGER_CHECK
    from pgstream_dagster.defs.names import CHECKS_JOB
    from pgstream_dagster.sinks import build_sink
    from pgstream_dagster.sinks.lake import LakeSink, catalog_columns

    from .support.dagster_instance import materialize
    from .support.lake import lake_config

    i = install
    _run(i.owner_url, "create schema app",
         "create table app.orders (id bigint primary key, qty integer, placed date, note text)",
         f"revoke all on schema app from {RUNTIME_GROUP}, {i.runtime}, public")
    with psycopg.connect(i.runtime_url) as c:
        assert c.execute("select has_schema_privilege('app', 'usage')").fetchone() == (False,)
    sink = {**lake_config("parquet", tmp_path, pg), "typed_columns": True,
            "database_url": i.runtime_url}
    cfg = write_config(tmp_path / "app.yaml", i.runtime_url, [
        {"id": 5, "reader": "app", "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 1},
         "sink": sink}],  # (a group of its own: the install's streams 1 and 2 are in the default group)
        [{"key": "orders", "stream_id": 5, "operation": "INSERT", "schema_name": "app", "table_name": "orders",
          "column_names": ["id", "qty", "placed", "note"]}])
    init(cfg, owner_url=i.owner_url)
    # the subscription assets, as the runtime: they find the owner applied the YAML
    config = load_config(cfg)
    driver = Driver(cfg, instance)
    materialized = materialize(driver.defs, instance, [*subscription_keys(config, 5).values(),
                                                       subscription_set_key(5)])
    assert materialized.success, [e.message for e in materialized.all_events if e.is_failure]
    # the lake sink's catalog types, read as the runtime
    assert [(c.name, c.kind) for c in catalog_columns(i.runtime_url, 5)] == [
        ("row_id", "int64"), ("row_note", "string"), ("row_placed", "date32"), ("row_qty", "int32")]
    _run(i.owner_url, "insert into app.orders select g, g * 10, date '2026-12-01' + g, 'order ' || g "
                      "from generate_series(1, 12) g")
    driver.run_until(5, lambda: _count(i.owner_url, "select count(*) from pgstream.batches "
                                                    "where stream_id = 5 and status <> 'delivered'") == 0
                     and _count(i.owner_url, "select count(*) from pgstream.batches where stream_id = 5") > 0,
                     timeout=300)
    driver.stop_group_runs()  # (its group's delivery runs: ended, each a success, no member run failed)
    assert driver.results and all(r.success for r in driver.results)
    assert not [r for r in instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(i.runtime_url, "app")}))
                if '"failed"' in r.tags.get(member_tag(5), "")]
    typed = build_sink(sink)
    assert isinstance(typed, LakeSink)
    with typed:
        table = typed.read(5, ["row_id", "row_qty", "row_placed", "row_note"])
    assert {f.name: str(f.type) for f in table.schema} == {"row_id": "int64", "row_qty": "int32",
                                                           "row_placed": "date32[day]", "row_note": "string"}
    rows = sorted(table.to_pylist(), key=lambda r: r["row_id"])
    assert [r["row_id"] for r in rows] == list(range(1, 13))
    assert rows[0] == {"row_id": 1, "row_qty": 10, "row_placed": dt.date(2026, 12, 2), "row_note": "order 1"}
    # every check of the location, as the runtime (trigger_matches reads the app table's trigger)
    checked = build_definitions(cfg).resolve_job_def(CHECKS_JOB).execute_in_process(instance=instance,
                                                                                     raise_on_error=False)
    evaluations = {(e.asset_key.to_user_string(), e.check_name): e for e in checked.get_asset_check_evaluations()}
    assert ("app/orders/orders", TRIGGER_CHECK) in evaluations or any(n == TRIGGER_CHECK for _, n in evaluations)
    failed = {k: e.description for k, e in evaluations.items() if not e.passed}
    assert not failed and checked.success


def test_a_command_refused_a_privilege_on_pgstream_says_which_role_to_connect_as(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A login role with no pgstream role: an operator's command says it connected as that role and which one to use
    (the runtime's, or the owner's for an owner's command), in the one error line, and changes nothing."""
    from psycopg.conninfo import make_conninfo

    stranger = f"stranger_{abs(hash(db_url)) % 10**8}"
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(sql.SQL("create role {} login").format(sql.Identifier(stranger)))
    try:
        url = make_conninfo(db_url, user=stranger)
        assert cli_main(["pause", "1", "--database-url", url]) == 1
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: permission denied for schema pgstream: connected as {stranger}; connect as a login member of "
            f"pgstream_runtime (as a superuser: grant pgstream_runtime to {stranger}) or as the owner "
            "(docs/security.md, Roles)"]
        assert cli_main(["migrate", "--database-url", url]) == 1
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.endswith(f": this command runs as the owner of schema pgstream, not as {stranger}: pass the "
                             "owner's URL (docs/security.md, Roles)"), line
        with psycopg.connect(db_url) as c:
            assert c.execute("select paused from pgstream.streams").fetchall() == []
    finally:
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute(sql.SQL("drop owned by {}").format(sql.Identifier(stranger)))
            c.execute(sql.SQL("drop role {}").format(sql.Identifier(stranger)))
