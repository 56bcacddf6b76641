"""Asset checks against a real database and a real Dagster instance: each fails when it should
(trigger dropped/disabled/altered by hand, old undelivered events, failover, slot WAL) and passes
otherwise."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.config import load_config
from pgstream_dagster.defs.checks import check_undelivered_age
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import CHECKS_JOB, SCHEDULED_CHECKS_TAG, deliveries_asset_key
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine import replication
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.ledger import streams as ledger_streams
from pgstream_dagster.engine.migrations import WRITER_ROLE

from .support.dagster_instance import postgres_instance
from .support.harness import backdated, slot_of, values, write_config
from .support.legacy_streams import ensure_stream

SIGNUP = {"key": "user-signup", "stream_id": 1, "operation": "INSERT", "schema_name": "public",
          "table_name": "users", "when_clause": "new.verified", "column_names": ["id", "email"]}
AGE, FAILOVER, DEAD = "undelivered_age", "not_in_failover", "no_dead_letters"
#: the slot check of a stream that names no reader group: its group's (``default``), on pgstream/events_partitions
WAL = "group_default_slot_retained_wal"
ORPHANS = "no_orphaned_slots"
CONSUMERS = "consumers_within_retention"


@pytest.fixture
def instance(pg: LocalPostgres, tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with postgres_instance(pg, tmp_path) as inst:
        yield inst


def stream(**checks: Any) -> list[dict[str, Any]]:
    return [{"id": 1, "sink": {"type": "memory"}, "checks": checks}]


class Checks:
    """Runs the ``pgstream_checks`` job (what the schedule launches) and reads its evaluations."""

    def __init__(self, cfg: Path, instance: dg.DagsterInstance) -> None:
        self.defs = build_definitions(cfg)
        self.instance = instance

    def run(self) -> dict[str, dg.AssetCheckEvaluation]:
        result = self.defs.resolve_job_def(CHECKS_JOB).execute_in_process(instance=self.instance,
                                                                          raise_on_error=False)
        out: dict[str, dg.AssetCheckEvaluation] = {}
        for ev in result.get_asset_check_evaluations():
            name = "trigger" if ev.check_name == "trigger_matches" else ev.check_name
            assert name not in out
            out[name] = ev
        # the trigger check is blocking: its failure (only) fails the run, after every check reported
        assert result.success == out["trigger"].passed
        return out

    def failing(self) -> set[str]:
        return {name for name, ev in self.run().items() if not ev.passed}


def execute(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        for statement in statements:
            c.execute(statement)


def execute_backdated(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        for statement in statements:
            backdated(c, statement)


@pytest.fixture
def app(db_url: str) -> str:
    execute(db_url, "create table public.users (id serial primary key, email text, verified bool default false)")
    return db_url


def test_checks_pass_on_a_healthy_stream_and_fail_on_each_fault(app: str, tmp_path: Path,
                                                                   instance: dg.DagsterInstance) -> None:
    cfg = write_config(tmp_path / "pgstream.yaml", app, stream(), [SIGNUP])
    init(cfg)  # stream, slot, subscription
    checks = Checks(cfg, instance)
    first = checks.run()
    assert set(first) == {"trigger", AGE, WAL, FAILOVER, DEAD, ORPHANS, CONSUMERS}
    assert all(ev.passed for ev in first.values()), {n: ev.description for n, ev in first.items()}
    assert first["trigger"].asset_key == dg.AssetKey(
        ["pgstream", "stream_1", "subscriptions", "user_signup_insert_public_users"])
    assert first[AGE].asset_key == deliveries_asset_key(1)
    assert first[WAL].asset_key == dg.AssetKey(["pgstream", "events_partitions"])  # the group's slot: one check
    assert first["trigger"].severity == dg.AssetCheckSeverity.ERROR
    assert first[FAILOVER].severity == dg.AssetCheckSeverity.WARN

    # the drift guard refuses to disable the trigger; with the guard off (an install without
    # superuser has none), the check sees it
    with pytest.raises(psycopg.errors.DependentObjectsStillExist, match="would be disabled"):
        execute(app, "alter table public.users disable trigger pgstream_insert")
    assert checks.failing() == set()
    execute(app, "alter event trigger pgstream_drift_guard_alter disable",
            "alter table public.users disable trigger pgstream_insert")
    assert checks.failing() == {"trigger"}
    execute(app, "alter table public.users enable trigger pgstream_insert",
            "alter event trigger pgstream_drift_guard_alter enable")
    assert checks.failing() == set()

    with psycopg.connect(app) as c:
        (fn,) = c.execute("select p.proname from pg_trigger t join pg_proc p on p.oid = t.tgfoid "
                          "where t.tgname = 'pgstream_insert'").fetchone()  # type: ignore[misc]

    # on an install without the drift guard, code that runs as pgstream_writer (a cast on a table owner's
    # type) makes the function it owns SECURITY INVOKER, or drops its search_path: source and comment still
    # match, the check names it, and regenerating restores it
    for change in ("security invoker", "reset search_path"):
        execute(app, "alter event trigger pgstream_drift_guard_alter disable", f"set role {WRITER_ROLE}",
                f"alter function pgstream.{fn}() {change}", "reset role",
                "alter event trigger pgstream_drift_guard_alter enable")
        ev = checks.run()["trigger"]
        assert not ev.passed and "runs as its caller or without its search_path" in (ev.description or ""), change
        with psycopg.connect(app, autocommit=True) as c:
            c.execute("select pgstream.regenerate_trigger('public', 'users', 'INSERT')")
        assert checks.failing() == set(), change

    # trigger function replaced by hand (the trigger's comment still matches: only its source tells)
    execute(app, "alter event trigger pgstream_drift_guard_alter disable",  # the guard refuses it
            f"create or replace function pgstream.{fn}() returns trigger language plpgsql "
            "as $$ begin return null; end $$", "alter event trigger pgstream_drift_guard_alter enable")
    ev = checks.run()["trigger"]
    assert not ev.passed and "changed by hand" in (ev.description or "")

    # trigger dropped by hand (past the drift guard, switched off by a superuser) -> missing
    execute(app, "alter event trigger pgstream_drift_guard_drop disable",
            "drop trigger pgstream_insert on public.users",
            "alter event trigger pgstream_drift_guard_drop enable")
    ev = checks.run()["trigger"]
    assert not ev.passed and "does not exist" in (ev.description or "")

    # regenerate it (re-applying the subscriptions fixes both)
    with psycopg.connect(app, autocommit=True) as c:
        c.execute("select pgstream.regenerate_trigger('public', 'users', 'INSERT')")
    assert checks.failing() == set()

    # the subscription edited in SQL behind the YAML's back
    execute(app, "update pgstream.subscriptions set column_names = '{id}' where key = 'user-signup'")
    ev = checks.run()["trigger"]
    assert not ev.passed and "column_names differs" in (ev.description or "")
    execute(app, "update pgstream.subscriptions set column_names = '{id,email}' where key = 'user-signup'")
    assert checks.failing() == set()

    # an undelivered batch older than the SLA (default 900 s); delivered, it no longer counts
    execute_backdated(app, "insert into pgstream.events (id, payload, stream_id, created_at) "
                 "values (1000, '{}', 1, now() - interval '2 hours')",
            "insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
            "min_created_at, max_created_at) values (1, '{1000}', 1, 1000, 1000, now() - interval '2 hours', "
            "now() - interval '2 hours')")
    ev = checks.run()[AGE]
    assert not ev.passed
    assert values(ev.metadata)["undelivered_batches"] == 1
    assert 7100 < values(ev.metadata)["oldest_undelivered_age_secs"] < 7300
    with psycopg.connect(app, autocommit=True) as c:
        c.execute("update pgstream.batches set status = %s, delivered_at = now()", [BatchStatus.DELIVERED])
    assert checks.failing() == set()

    # events the ledger has not recorded yet (still waiting in the slot) count too
    execute_backdated(app, "insert into pgstream.events (payload, stream_id, created_at) "
                 "values ('{}', 1, now() - interval '30 minutes')")
    ev = checks.run()[AGE]
    assert not ev.passed and values(ev.metadata)["events_waiting_in_slot"] == 1
    execute(app, "delete from pgstream.events where created_at > now() - interval '1 hour'")
    assert checks.failing() == set()

    # failover (set by the failover machinery; here by hand)
    execute(app, "update pgstream.streams set failover_since = now() where id = 1")
    ev = checks.run()[FAILOVER]
    assert not ev.passed and "in failover since" in (ev.description or "")
    execute(app, "update pgstream.streams set failover_since = null where id = 1")
    assert checks.failing() == set()


def test_dead_letters_check_is_red_while_any_is_open(app: str, tmp_path: Path,
                                                      instance: dg.DagsterInstance) -> None:
    cfg = write_config(tmp_path / "pgstream.yaml", app, stream(), [SIGNUP])
    init(cfg)
    checks = Checks(cfg, instance)
    ev = checks.run()[DEAD]
    assert ev.passed and ev.description == "no open dead letters" and values(ev.metadata)["open_dead_letters"] == 0
    assert ev.severity == dg.AssetCheckSeverity.ERROR and ev.asset_key == deliveries_asset_key(1)

    # 25 events of an undelivered batch set aside (a sink rejected them for good): red, with the first 20
    with psycopg.connect(app, autocommit=True) as c:
        ids = [r[0] for r in c.execute("insert into pgstream.events (payload, stream_id) "
                                       "select jsonb_build_object('n', g), 1 from generate_series(1, 25) g "
                                       "returning id").fetchall()]
        c.execute("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
                  "min_created_at, max_created_at) values (1, %s, 25, %s, %s, now(), now())",
                  [ids, ids[0], ids[-1]])
        c.execute("select pgstream.set_aside_events(1, %s, 'HTTP 422 from the consumer')", [ids])
    ev = checks.run()[DEAD]
    assert not ev.passed and ev.severity == dg.AssetCheckSeverity.ERROR
    assert (ev.description or "").startswith("25 open dead letters (first 20 in the metadata), oldest since")
    assert "pgstream_replay, stream_id: 1, dead_letters: true" in (ev.description or "")
    assert values(ev.metadata)["open_dead_letters"] == 25
    assert values(ev.metadata)["oldest_dead_letter_age_secs"] >= 0
    table = values(ev.metadata)["dead_letters"]
    assert [r.data["event_id"] for r in table.records] == ids[:20]  # in delivery order
    assert table.records[0].data["stage"] == "deliver" and table.records[0].data["position"].endswith("#1")
    assert table.records[0].data["error"] == "set aside by an operator: HTTP 422 from the consumer"
    assert checks.failing() == {DEAD}  # the others are not affected

    # discarded (or redelivered), green again
    with psycopg.connect(app, autocommit=True) as c:
        c.execute("select pgstream.discard_dead_letters(1, null, 'test')")
    assert checks.failing() == set()


def test_slot_wal_check(app: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    # WAL is cluster-wide (other tests write it too): thresholds far from what one test can cause
    roomy = write_config(tmp_path / "roomy.yaml", app, stream(max_retained_wal_bytes=1024**3), [SIGNUP])
    tight = write_config(tmp_path / "tight.yaml", app, stream(max_retained_wal_bytes=64 * 1024), [SIGNUP])
    init(roomy)
    assert Checks(roomy, instance).failing() == set()
    # WAL the slot holds back: nobody consumes it while the table changes (~1 MB)
    execute(app, "insert into public.users (email) select 'u' || g || '@example.com' from generate_series(1, 10000) g")
    ev = Checks(tight, instance).run()[WAL]
    assert not ev.passed
    assert values(ev.metadata)["retained_bytes"] > 64 * 1024
    assert values(ev.metadata)["max_retained_wal_bytes"] == 64 * 1024
    # the same state under the generous threshold passes
    ev = Checks(roomy, instance).run()[WAL]
    assert ev.passed and values(ev.metadata)["retained_bytes"] > 64 * 1024
    # no slot at all fails
    execute(app, f"select pg_drop_replication_slot('{slot_of(app, 1)}')")
    ev = Checks(roomy, instance).run()[WAL]
    assert not ev.passed and "does not exist" in (ev.description or "")


def test_checks_schedule_and_sla_from_config(app: str, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "pgstream.yaml", app, stream(max_undelivered_age_secs=60), [SIGNUP])
    cfg.write_text(cfg.read_text() + "checks: {cron: '*/15 * * * *'}\n")
    defs = build_definitions(cfg)
    schedule = defs.resolve_schedule_def(CHECKS_JOB)
    assert schedule.cron_schedule == "*/15 * * * *"
    assert schedule.job_name == CHECKS_JOB
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    # an event waiting 2 minutes breaks a 60 s SLA, not the default 900 s one
    init(cfg)
    execute_backdated(app, "insert into pgstream.events (payload, stream_id, created_at) "
                 "values ('{}', 1, now() - interval '2 minutes')")
    strict = load_config(cfg)
    with psycopg.connect(app) as conn:
        assert not check_undelivered_age(conn, strict.stream(1)).passed
        default = write_config(tmp_path / "default.yaml", app, stream(), [SIGNUP])
        assert check_undelivered_age(conn, load_config(default).stream(1)).passed


def test_a_slot_no_stream_reads_fails_a_check_and_shows_in_status(app: str, tmp_path: Path,
                                                                   instance: dg.DagsterInstance,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A default-named slot (``pgstream.default_slot_pattern()``) left behind (a deleted stream, a
    changed slot_name) keeps its WAL for ever: the no_orphaned_slots check on the housekeeping asset
    fails, naming it, and ``status`` says how to drop it. Slots that streams read, custom-named slots
    and other databases' slots are not listed."""
    from pgstream_dagster.cli import main as cli_main

    cfg = write_config(tmp_path / "pgstream.yaml", app, stream(), [SIGNUP])
    init(cfg)
    orphan = ORPHANS
    assert Checks(cfg, instance).run()[orphan].passed
    execute(app, "select pg_create_logical_replication_slot('pgstream_stream_7', 'pgoutput')",
            "select pg_create_logical_replication_slot('my_own_slot', 'pgoutput')")
    try:
        ev = Checks(cfg, instance).run()[orphan]
        assert not ev.passed and ev.asset_key == dg.AssetKey(["pgstream", "events_partitions"])
        assert [s["slot_name"] for s in values(ev.metadata)["slots"]] == ["pgstream_stream_7"]
        assert "pgstream_stream_7" in (ev.description or "") and "my_own_slot" not in (ev.description or "")

        with psycopg.connect(app) as c:  # the metric the exporter serves
            assert c.execute("select label from pgstream.metrics where metric = 'orphaned_slot_retained_wal'"
                             ).fetchall() == [("pgstream_stream_7",)]
        assert cli_main(["status", "--database-url", app]) == 0
        out = capsys.readouterr().out
        assert "slot pgstream_stream_7: no stream reads it, and it retains " in out
        assert "select pg_catalog.pg_drop_replication_slot('pgstream_stream_7')" in out and "my_own_slot" not in out

        # a stream given another slot_name leaves its own default slot (a slot each: an install of before every
        # stream was in a reader group) behind: listed too; the group's slot, read for it, is not
        with psycopg.connect(app, autocommit=True) as c:
            default_1 = ledger_streams.stream_slot(c, 1)
            replication.create_slot(c, default_1)
        assert [s["slot_name"] for s in values(Checks(cfg, instance).run()[orphan].metadata)["slots"]] == [
            "pgstream_stream_7"]
        execute(app, "update pgstream.streams set slot_name = 'stream_one' where id = 1")
        ev = Checks(cfg, instance).run()[orphan]
        assert [s["slot_name"] for s in values(ev.metadata)["slots"]] == sorted([default_1, "pgstream_stream_7"])
        assert slot_of(app, 1) not in (ev.description or "")
        execute(app, "update pgstream.streams set slot_name = null where id = 1",
                "select pg_drop_replication_slot('pgstream_stream_7')")
        assert Checks(cfg, instance).run()[orphan].passed
    finally:
        execute(app, "select pg_drop_replication_slot(slot_name) from pg_replication_slots "
                     "where slot_name in ('pgstream_stream_7', 'my_own_slot')")


def test_a_consumer_past_its_retention_bound_fails_a_check_and_shows_in_status_and_metrics(
        app: str, tmp_path: Path, instance: dg.DagsterInstance, capsys: pytest.CaptureFixture[str]) -> None:
    """A registered consumer (the Spark source) whose oldest unread event is older than its
    max_retention_days: the consumers_within_retention check on the housekeeping asset fails naming it;
    ``status``, ``consumers list``, the status asset's observation and the metrics show its position
    and lag; a longer bound (``consumers retention``) passes the check, ``consumers drop`` forgets it."""
    from pgstream_dagster.cli import main as cli_main
    from pgstream_dagster.defs.status import status_observation
    from pgstream_dagster.engine.status import stream_status

    cfg = write_config(tmp_path / "pgstream.yaml", app, stream(), [SIGNUP])
    init(cfg)
    check = CONSUMERS
    assert Checks(cfg, instance).run()[check].passed
    with psycopg.connect(app, autocommit=True) as c:
        ids = [r[0] for r in backdated(c, "insert into pgstream.events (payload, stream_id, created_at) select "
                                          "'{}', 1, now() - interval '40 days' from generate_series(1, 6) "
                                          "returning id")]
        c.execute("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
                  "min_created_at, max_created_at) values (1, %s, 6, %s, %s, now() - interval '40 days', "
                  "now() - interval '40 days')", [ids, ids[0], ids[-1]])
        batch = c.execute("select max(id) from pgstream.batches").fetchone()
        assert batch is not None
        c.execute("select pgstream.register_consumer('lake', 1, true)")
        c.execute("select pgstream.consumer_commit('lake', 1, %s, 2, pgstream.consumer_token('lake'))", [batch[0]])
        metrics: dict[str, float] = dict(
            c.execute("select metric, value from pgstream.metrics where label = 'lake'").fetchall())
        status_row = stream_status(c, 1)[0]
    assert metrics["consumer_lag_events"] == 4 and metrics["consumer_overrun"] == 1
    assert metrics["consumer_oldest_unread_age"] > 39 * 86400
    observed = values(status_observation(status_row).metadata)
    assert observed["consumers_max_lag_events"] == 4 and observed["consumers_overrun"] == 1
    assert "| lake | " in observed["consumers"]

    ev = Checks(cfg, instance).run()[check]
    assert not ev.passed and ev.asset_key == dg.AssetKey(["pgstream", "events_partitions"])
    assert "consumer lake (stream 1)" in (ev.description or "") and values(ev.metadata)["overrun"] == ["lake"]
    assert cli_main(["status", "1", "--database-url", app]) == 0
    out = capsys.readouterr().out
    assert f"consumer lake (stream 1): read through batch {batch[0]} ordinal 2, 4 events behind" in out
    assert "OVERRUN" in out
    assert cli_main(["consumers", "retention", "lake", "60", "--database-url", app]) == 0
    assert Checks(cfg, instance).run()[check].passed
    assert cli_main(["consumers", "list", "--database-url", app]) == 0
    assert "kept for up to 60 days" in capsys.readouterr().out
    assert cli_main(["consumers", "retention", "lake", "0", "--database-url", app]) == 2  # nothing changed
    assert "days must be 1-3650, got 0" in capsys.readouterr().err
    assert cli_main(["consumers", "list", "--database-url", app]) == 0
    assert "kept for up to 60 days" in capsys.readouterr().out
    assert cli_main(["consumers", "drop", "lake", "--database-url", app]) == 0
    assert cli_main(["consumers", "drop", "lake", "--database-url", app]) == 1
    assert cli_main(["consumers", "list", "--database-url", app]) == 0
    assert "no registered consumers" in capsys.readouterr().out


def test_a_checks_tick_missed_while_dagster_was_down_is_not_caught_up(
        app: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dagster's scheduler, when it starts again, launches the last tick of a schedule that passed while it
    was down: `pgstream_checks` would start a run at every `dg dev` start, beside the streams' first
    delivery runs. Dagster's own scheduler iteration, on a real instance, over this code location: the
    tick due while the location was not running is skipped, naming why, and no run starts; a tick due while
    it runs (and evaluated on time) requests its run."""
    import logging

    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.scheduler.instigation import (
        InstigatorState,
        InstigatorStatus,
        InstigatorType,
        ScheduleInstigatorData,
        TickStatus,
    )
    from dagster._core.test_utils import create_test_daemon_workspace_context
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget
    from dagster._scheduler.scheduler import launch_scheduled_runs
    from dagster._time import get_current_datetime

    from pgstream_dagster.defs import schedules, sensors

    cfg = write_config(tmp_path / "pgstream.yaml", app, stream(), [SIGNUP])
    cfg.write_text(cfg.read_text() + "checks: {cron: '* * * * *'}\n")
    location = tmp_path / "location.py"
    location.write_text("from pathlib import Path\nfrom pgstream_dagster.defs.location import build_definitions\n"
                        f"defs = build_definitions(Path({str(cfg)!r}))\n")
    origin = InProcessCodeLocationOrigin(LoadableTargetOrigin(python_file=str(location), attribute="defs",
                                                              working_directory=str(tmp_path)),
                                         location_name="pgstream")
    with create_test_daemon_workspace_context(InProcessWorkspaceLoadTarget(origin), instance) as workspace:
        (entry,) = workspace.create_request_context().get_code_location_entries().values()
        assert entry.code_location is not None, entry.load_error
        (repo,) = entry.code_location.get_repositories().values()
        remote = repo.get_schedule(CHECKS_JOB)
        # "started just now" is taken after the (slow) load and not in a minute's last seconds, so no tick falls
        # due between the location's start and the scheduler's iteration
        if (now := time.time()) % 60 > 55:
            time.sleep(61 - now % 60)
            now = time.time()
        # running since 5 minutes (its ticks every minute), and `dg dev` (this location) started just now
        instance.add_instigator_state(InstigatorState(
            remote.get_remote_origin(), InstigatorType.SCHEDULE, InstigatorStatus.RUNNING,
            ScheduleInstigatorData(remote.cron_schedule, start_timestamp=now - 300)))
        monkeypatch.setattr(sensors, "LOADED_AT", now)
        list(launch_scheduled_runs(workspace, logging.getLogger("scheduler"), get_current_datetime(), {}))
        ticks = instance.get_ticks(remote.get_remote_origin_id(), remote.selector_id)
        assert [t.status for t in ticks] == [TickStatus.SKIPPED], ticks
        assert "passed while this code location was not running: not caught up" in (ticks[0].skip_reason or "")
        assert not instance.get_runs(dg.RunsFilter(job_name=CHECKS_JOB))
    # on time, the location running: its run; the scheduler down for long: skipped too
    defs = build_definitions(cfg)
    due = dg.build_schedule_context(instance=instance, scheduled_execution_time=get_current_datetime())
    monkeypatch.setattr(sensors, "LOADED_AT", now - 600)
    # (a scheduled run is paced and in the background: the tag says so)
    assert [r.tags.get(SCHEDULED_CHECKS_TAG) for r in
            defs.resolve_schedule_def(CHECKS_JOB).evaluate_tick(due).run_requests or []] == ["true"]
    late = dt.datetime.fromtimestamp(time.time() - schedules.CATCH_UP_AFTER_SECS - 60, dt.UTC)
    skipped = defs.resolve_schedule_def(CHECKS_JOB).evaluate_tick(
        dg.build_schedule_context(instance=instance, scheduled_execution_time=late))
    assert not skipped.run_requests and "late (the scheduler was down): not caught up" in (skipped.skip_message or "")


def test_a_scheduled_checks_run_paces_its_streams_and_one_from_the_ui_does_not(
        app: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run the ``pgstream_checks`` schedule launched goes to the background (its process's niceness raised)
    and waits ``1 / checks.streams_per_sec`` before each stream's checks (many streams' check events spread
    over time instead of at once); a run launched by hand does neither. Every check reports either way."""
    from pgstream_dagster.defs import checks as checks_module

    streams = [{"id": i, "sink": {"type": "memory"}} for i in (1, 2, 3)]
    cfg = write_config(tmp_path / "pgstream.yaml", app, streams,
                       [{**SIGNUP, "stream_id": i, "key": f"signup-{i}"} for i in (1, 2, 3)])
    cfg.write_text(cfg.read_text() + "checks: {streams_per_sec: 4}\n")
    init(cfg)
    slept: list[float] = []
    backgrounded: list[bool] = []
    monkeypatch.setattr(checks_module, "_pause", slept.append)
    # (the test's own process is not to be niced: what _background does is tried in a process of its own, below)
    monkeypatch.setattr(checks_module, "_background", lambda: backgrounded.append(True))
    job = build_definitions(cfg).resolve_job_def(CHECKS_JOB)
    for tags, pauses in (({SCHEDULED_CHECKS_TAG: "true"}, [0.25] * 3), ({}, [])):
        slept.clear()
        backgrounded.clear()
        result = job.execute_in_process(instance=instance, raise_on_error=False, tags=tags)
        assert slept == pauses
        assert backgrounded == [True] * len(pauses)
        # (trigger + 3 a stream; 2 of the location, and the slot check of their reader group, default)
        assert len(result.get_asset_check_evaluations()) == 3 * 4 + 3


def test_a_scheduled_checks_runs_process_yields_the_cpus_and_never_lowers_its_niceness() -> None:
    """``_background`` (what a scheduled checks run calls, in its own process) raises the process's niceness
    to CHECKS_NICENESS, and leaves a higher one alone."""
    probe = ("import os; from pgstream_dagster.defs.checks import CHECKS_NICENESS, _background; "
             "os.nice({start}); _background(); _background(); "
             "print(os.getpriority(os.PRIO_PROCESS, 0), CHECKS_NICENESS)")
    for start in (0, 15):
        out = subprocess.run([sys.executable, "-c", probe.format(start=start)], capture_output=True, text=True,
                             check=True).stdout.split()
        niceness, wanted = int(out[0]), int(out[1])
        assert wanted == 10
        assert niceness == max(min(19, start + os.getpriority(os.PRIO_PROCESS, 0)), wanted)  # (19: the most)


def test_a_reader_groups_slot_has_one_check_for_its_streams(app: str, tmp_path: Path,
                                                            instance: dg.DagsterInstance) -> None:
    """A reader group's streams share one slot: it is checked once (``group_<name>_slot_retained_wal`` on
    ``pgstream/events_partitions``, the smallest ``max_retained_wal_bytes`` of its streams), and the members'
    deliveries carry no slot check of their own (a stream naming no group is in group ``default``: its check). It
    fails on WAL held back past the limit, and on no slot."""
    streams = [{"id": 1, "sink": {"type": "memory"}, "reader": "team",
                "checks": {"max_retained_wal_bytes": 1024**3}},
               {"id": 2, "sink": {"type": "memory"}, "reader": "team",
                "checks": {"max_retained_wal_bytes": 1024**3}},
               {"id": 3, "sink": {"type": "memory"}}]  # (a stream naming no group: the default group's check)
    subs = [{**SIGNUP, "stream_id": i, "key": f"signup-{i}"} for i in (1, 2, 3)]
    roomy = write_config(tmp_path / "roomy.yaml", app, streams, subs)
    streams[1]["checks"] = {"max_retained_wal_bytes": 64 * 1024}  # (one member's tighter limit is the group's)
    tight = write_config(tmp_path / "tight.yaml", app, streams, subs)
    init(roomy)
    group_check = "group_team_slot_retained_wal"

    def run(cfg: Path) -> dict[tuple[str, str], dg.AssetCheckEvaluation]:
        result = build_definitions(cfg).resolve_job_def(CHECKS_JOB).execute_in_process(instance=instance,
                                                                                        raise_on_error=False)
        return {(ev.asset_key.to_user_string(), ev.check_name): ev for ev in result.get_asset_check_evaluations()}

    evs = run(roomy)
    slot_checks = sorted(k for k in evs if "slot_retained_wal" in k[1])
    assert slot_checks == [("pgstream/events_partitions", WAL), ("pgstream/events_partitions", group_check)]
    ev = evs[("pgstream/events_partitions", group_check)]
    assert ev.passed, ev.description
    meta = values(ev.metadata)
    with psycopg.connect(app) as c:
        group_slot = c.execute("select slot from pgstream.reader_groups where name = 'team'").fetchone()
    assert group_slot is not None and meta["slot"] == group_slot[0] and meta["members"] == 2
    assert meta["max_retained_wal_bytes"] == 1024**3
    # WAL the group's slot holds back (nobody reads it while the table changes, ~1 MB): over the tighter limit
    execute(app, "insert into public.users (email) select 'g' || g || '@example.com' from generate_series(1, 10000) g")
    ev = run(tight)[("pgstream/events_partitions", group_check)]
    assert not ev.passed and values(ev.metadata)["max_retained_wal_bytes"] == 64 * 1024
    assert f"slot {group_slot[0]} retains" in (ev.description or "") and "(limit 65536)" in (ev.description or "")
    assert run(roomy)[("pgstream/events_partitions", group_check)].passed
    # no slot: the group's check fails, naming it
    execute(app, f"select pg_drop_replication_slot('{group_slot[0]}')")
    ev = run(roomy)[("pgstream/events_partitions", group_check)]
    assert not ev.passed and f"slot {group_slot[0]} does not exist" in (ev.description or "")


def test_a_streams_own_slot_is_checked_with_its_groups_until_it_has_joined(app: str, tmp_path: Path,
                                                                           instance: dg.DagsterInstance) -> None:
    """A stream that had a slot of its own and is now declared in a reader group keeps reading its own slot
    until its join is done (the group's sensor drains it, then drops it): the group's check looks at that
    slot too, and names it when it holds back too much WAL."""
    alone = [{"id": 1, "sink": {"type": "memory"}}, {"id": 2, "sink": {"type": "memory"}}]
    subs = [{**SIGNUP, "stream_id": i, "key": f"signup-{i}"} for i in (1, 2)]
    with psycopg.connect(app, autocommit=True) as c:  # an install of before every stream was in a group: a slot each
        for i in (1, 2):
            replication.create_slot(c, ensure_stream(c, i))
    own = slot_of(app, 1)
    grouped = [{**s, "reader": "team", "checks": {"max_retained_wal_bytes": 64 * 1024}} for s in alone]
    cfg = write_config(tmp_path / "grouped.yaml", app, grouped, subs)
    init(cfg)  # (registers the streams in the group; each joins at the group sensor's first tick: none ran)
    execute(app, "insert into public.users (email) select 'j' || g || '@example.com' from generate_series(1, 10000) g")
    result = build_definitions(cfg).resolve_job_def(CHECKS_JOB).execute_in_process(instance=instance,
                                                                                    raise_on_error=False)
    (ev,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "group_team_slot_retained_wal"]
    assert not ev.passed
    assert f"stream 1's own slot {own} (not joined yet) retains" in (ev.description or "")
    assert {s["slot"] for s in values(ev.metadata)["slots"] if s["stream"] == 1} == {own}


def test_reconcile_without_a_failover_and_with_bad_ids_says_so_in_one_line(
        app: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``reconcile`` on a database that was never promoted has nothing to reconcile; ids it cannot read are
    refused naming the file and line (the phantoms of a real failover: tests/test_standby_failover.py)."""
    from pgstream_dagster.cli import main as cli_main

    cfg = write_config(tmp_path / "pgstream.yaml", app, stream(), [SIGNUP])
    init(cfg)
    assert cli_main(["reconcile", "1", "--config", str(cfg)]) == 0
    assert capsys.readouterr().out.strip() == ("stream 1: every event this database holds was written on its "
                                               "current timeline: no failover to reconcile")
    received = tmp_path / "ids.txt"
    received.write_text("12, 13\n14 x15\n")
    assert cli_main(["reconcile", "1", "--config", str(cfg), "--received", str(received)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {received} line 2: 'x15' is not an event id"
