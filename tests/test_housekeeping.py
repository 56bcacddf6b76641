"""Partition housekeeping on a simulated calendar: partitions created ahead, expired ones dropped
(measured first), those holding undelivered events kept and reported, the ledger pruned; through
the plain function, the Dagster schedule's job, and ``init`` at start-up."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from pgstream_dagster.config import HousekeepingConfig
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import EVENTS_PARTITIONS_KEY, HOUSEKEEPING_JOB
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.housekeeping import run_housekeeping

from .support.dagster_instance import materializations, postgres_instance, step_failure
from .support.harness import backdated, write_config


@pytest.fixture
def instance(pg: LocalPostgres, tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with postgres_instance(pg, tmp_path) as inst:
        yield inst


def partitions(conn: psycopg.Connection) -> set[dt.date]:
    rows = conn.execute("select c.relname from pg_inherits i join pg_class c on c.oid = i.inhrelid "
                        "where i.inhparent = 'pgstream.events'::regclass "
                        "and c.relname ~ '^events_[0-9]{8}$'").fetchall()
    return {dt.datetime.strptime(r[0][7:], "%Y%m%d").date() for r in rows}


def name(day: dt.date) -> str:
    return f"events_{day:%Y%m%d}"


def add_events(conn: psycopg.Connection, day: dt.date, n: int, status: BatchStatus) -> None:
    """``n`` events at noon UTC of ``day`` in one batch of the ledger with ``status``."""
    ids = [r[0] for r in backdated(
        conn, "insert into pgstream.events (payload, stream_id, created_at) "
        "select jsonb_build_object('n', g), 1, (%s::date + time '12:00') at time zone 'UTC' "
        "from generate_series(1, %s) g returning id", [day, n])]
    conn.execute(
        "insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
        "min_created_at, max_created_at, status, delivered_at) "
        "values (1, %s, %s, %s, %s, (%s::date + time '12:00') at time zone 'UTC', "
        "(%s::date + time '12:00') at time zone 'UTC', %s, case when %s then now() end)",
        [ids, n, ids[0], ids[-1], day, day, status, status is BatchStatus.DELIVERED])


def sensor_read_up_to(conn: psycopg.Connection, day: dt.date) -> None:
    """On the simulated calendar, the streams' sensors have read their slots up to ``day``
    (housekeeping never drops what a stream may not have read yet)."""
    conn.execute("update pgstream.streams set consumed_through = %s",
                 [dt.datetime.combine(day, dt.time(), dt.UTC)])


def test_housekeeping_on_a_simulated_calendar(conn: psycopg.Connection) -> None:
    (d0,) = conn.execute("select pgstream.utc_today()").fetchone()  # type: ignore[misc]
    conn.execute("select pgstream.ensure_stream(1)")
    cfg = HousekeepingConfig(days_ahead=2, retention_days=3, ledger_keep_days=7)
    # migrate created today and 7 ahead: today, nothing to do
    report = run_housekeeping(conn, cfg, today=d0)
    assert (report.created, report.dropped, report.kept, report.batches_pruned) == ([], [], [], 0)
    assert partitions(conn) == {d0 + dt.timedelta(days=i) for i in range(8)}

    add_events(conn, d0 + dt.timedelta(days=1), 300, BatchStatus.DELIVERED)
    add_events(conn, d0 + dt.timedelta(days=3), 2, BatchStatus.PENDING)  # undelivered: protects its day onwards
    # ten days later: three partitions ahead, everything before day +7 expired
    later = d0 + dt.timedelta(days=10)
    sensor_read_up_to(conn, later)
    report = run_housekeeping(conn, cfg, today=later)
    assert report.today == later
    assert report.created == [name(later + dt.timedelta(days=i)) for i in range(3)]
    assert report.dropped == [name(d0), name(d0 + dt.timedelta(days=1)), name(d0 + dt.timedelta(days=2))]
    assert report.kept == [name(d0 + dt.timedelta(days=i)) for i in range(3, 7)]
    assert any("keeping partition" in w for w in report.warnings)
    assert report.rows_dropped == 300
    assert report.bytes_dropped > 8192 * 3  # three tables with their indexes, one holding 300 rows
    # the delivered batch was delivered "now", i.e. ten simulated days ago: pruned (keep 7 days)
    assert report.batches_pruned == 1
    # days +8 and +9 never had a partition: the simulated calendar jumped over them
    assert partitions(conn) == {d0 + dt.timedelta(days=i) for i in (3, 4, 5, 6, 7, 10, 11, 12)}
    assert conn.execute("select count(*) from pgstream.events").fetchone() == (2,)

    # idempotent; once delivered, the kept partitions go too
    again = run_housekeeping(conn, cfg, today=later)
    assert (again.created, again.dropped, again.rows_dropped) == ([], [], 0)
    assert again.kept == report.kept
    conn.execute("update pgstream.batches set status = %s, delivered_at = now()", [BatchStatus.DELIVERED])
    final = run_housekeeping(conn, cfg, today=later)
    assert final.dropped == report.kept and final.kept == []
    assert final.rows_dropped == 2
    assert final.batches_pruned == 1
    assert partitions(conn) == {d0 + dt.timedelta(days=i) for i in (7, 10, 11, 12)}


def test_a_registered_consumer_holds_back_what_it_has_not_read_until_its_bound(conn: psycopg.Connection) -> None:
    """The Spark source's registered consumer keeps the partitions and ledger batches it has not read
    past retention; once its oldest unread event is older than its max_retention_days they are dropped
    anyway and the pass reports the consumer overrun (report, warning, housekeeping_runs, metrics)."""
    (d0,) = conn.execute("select pgstream.utc_today()").fetchone()  # type: ignore[misc]
    conn.execute("select pgstream.ensure_stream(1)")
    cfg = HousekeepingConfig(days_ahead=1, retention_days=3, ledger_keep_days=1)
    day1, day3 = d0 + dt.timedelta(days=1), d0 + dt.timedelta(days=3)
    add_events(conn, day1, 10, BatchStatus.DELIVERED)
    add_events(conn, day3, 5, BatchStatus.DELIVERED)
    first, second = (r[0] for r in conn.execute("select id from pgstream.batches order by id").fetchall())
    conn.execute("select pgstream.register_consumer('lake', 1, true)")  # registered, nothing read yet
    conn.execute("select pgstream.set_consumer_retention('lake', 12)")
    later = d0 + dt.timedelta(days=10)
    sensor_read_up_to(conn, later)

    report = run_housekeeping(conn, cfg, today=later)  # delivered, past retention, but not read by 'lake'
    # from the day of its oldest unread event on, as for undelivered events
    assert report.kept == [name(d0 + dt.timedelta(days=i)) for i in range(1, 7)] and report.rows_dropped == 0
    assert any("a registered consumer has not read it" in w for w in report.warnings)
    assert report.batches_pruned == 0 and report.consumers_overrun == []

    # read the first batch
    conn.execute("select pgstream.consumer_commit('lake', 1, %s, 10, pgstream.consumer_token('lake'))", [first])
    report = run_housekeeping(conn, cfg, today=later)
    assert report.dropped == [name(day1), name(d0 + dt.timedelta(days=2))] and report.rows_dropped == 10
    assert report.kept == [name(d0 + dt.timedelta(days=i)) for i in range(3, 7)]
    assert report.batches_pruned == 1  # the batch it passed; the next one says what it reads next
    assert conn.execute("select id from pgstream.batches").fetchall() == [(second,)]

    # abandoned: ten more days, its oldest unread event (day 3) is 17 days old, past its 12
    abandoned = d0 + dt.timedelta(days=20)
    sensor_read_up_to(conn, abandoned)
    report = run_housekeeping(conn, cfg, today=abandoned)
    assert report.consumers_overrun == ["lake"] and name(day3) in report.dropped and report.rows_dropped == 5
    assert any("consumer lake has not read events since" in w and "max_retention_days (12)" in w
               for w in report.warnings)
    assert "consumers past their retention bound (not kept for): lake" in report.summary()
    assert conn.execute("select overrun, lag_events from pgstream.consumer_positions(%s)",
                        [abandoned]).fetchall() == [(True, 5)]
    assert conn.execute("select value from pgstream.metrics where metric = 'housekeeping_consumers_overrun'"
                        ).fetchall() == [(1.0,)]
    assert conn.execute("select count(*) from pgstream.events").fetchone() == (0,)


def test_expired_rows_of_the_default_partition(conn: psycopg.Connection) -> None:
    (d0,) = conn.execute("select pgstream.utc_today()").fetchone()  # type: ignore[misc]
    # a day with no partition lands in events_default
    conn.execute("insert into pgstream.streams (id) values (1) on conflict do nothing")
    ids = [r[0] for r in backdated(conn, "insert into pgstream.events (payload, stream_id, created_at) "
                                         "select '{}', 1, now() - interval '40 days' from generate_series(1, 4) "
                                         "returning id")]
    # no batch holds them: not read from the slot yet, whatever their date, so they stay
    report = run_housekeeping(conn, HousekeepingConfig(retention_days=7), today=d0)
    assert report.default_rows_deleted == 0
    assert any("4 expired rows of events_default are kept" in w for w in report.warnings)
    # three delivered, one still in an open batch: the delivered ones go
    conn.execute("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
                 "min_created_at, max_created_at, status, delivered_at) "
                 "values (1, %s, 3, %s, %s, now() - interval '40 days', now() - interval '40 days', %s, "
                 "now()), (1, %s, 1, %s, %s, now() - interval '40 days', now() - interval '40 days', %s, null)",
                 [ids[:3], ids[0], ids[2], BatchStatus.DELIVERED, ids[3:], ids[3], ids[3], BatchStatus.PENDING])
    report = run_housekeeping(conn, HousekeepingConfig(retention_days=7), today=d0)
    assert report.default_rows_deleted == 3
    assert conn.execute("select id from pgstream.events_default").fetchall() == [(ids[3],)]


def test_schedule_job_reports_metadata(db_url: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [{"id": 1, "sink": {"type": "memory"}}])
    cfg.write_text(cfg.read_text() + "housekeeping: {cron: '30 2 * * *', days_ahead: 1, retention_days: 2}\n")
    defs = build_definitions(cfg)
    schedule = defs.resolve_schedule_def(HOUSEKEEPING_JOB)
    assert schedule.cron_schedule == "30 2 * * *"
    assert schedule.execution_timezone == "UTC"
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    tick = schedule.evaluate_tick(dg.build_schedule_context(instance=instance))
    assert [r.job_name for r in tick.run_requests or []] in ([HOUSEKEEPING_JOB], [None])

    with psycopg.connect(db_url, autocommit=True) as c:
        (d0,) = c.execute("select pgstream.utc_today()").fetchone()  # type: ignore[misc]
        c.execute("select pgstream.ensure_stream(1)")
        add_events(c, d0, 50, BatchStatus.DELIVERED)
    today = d0 + dt.timedelta(days=30)
    with psycopg.connect(db_url, autocommit=True) as c:
        sensor_read_up_to(c, today)
    job = defs.resolve_job_def(HOUSEKEEPING_JOB)
    result = job.execute_in_process(instance=instance, raise_on_error=False, run_config={
        "ops": {"pgstream__events_partitions": {"config": {"today": today.isoformat()}}}})
    assert result.success, step_failure(result)
    meta = materializations(result)[EVENTS_PARTITIONS_KEY]
    assert meta["today"] == today.isoformat()
    assert meta["partitions_created"] == [name(today), name(today + dt.timedelta(days=1))]
    assert meta["partitions_dropped"] == [name(d0 + dt.timedelta(days=i)) for i in range(8)]
    assert meta["dropped_count"] == 8 and meta["created_count"] == 2 and meta["kept_count"] == 0
    assert meta["rows_dropped"] == 50
    assert meta["bytes_dropped"] > 0
    assert meta["batches_pruned"] == 1
    assert "postgresql://" not in str(meta)  # the database URL never shows


def test_init_runs_housekeeping_so_today_always_has_a_partition(db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        (d0,) = c.execute("select pgstream.utc_today()").fetchone()  # type: ignore[misc]
        c.execute(sql.SQL("alter table pgstream.events detach partition {}").format(
            sql.Identifier("pgstream", name(d0))))
        c.execute(sql.SQL("drop table {}").format(sql.Identifier("pgstream", name(d0))))
        c.execute("select pgstream.create_partitions(0, %s)", [d0 - dt.timedelta(days=30)])  # long expired
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [{"id": 1, "sink": {"type": "memory"}}])
    out = init(cfg)
    assert any(line.startswith(f"housekeeping {d0}: created 0 partitions, dropped 1 ") for line in out), out
    with psycopg.connect(db_url) as c:
        got = partitions(c)
    assert d0 in got and d0 - dt.timedelta(days=30) not in got
    assert not any(line.startswith("housekeeping") for line in init(cfg))  # nothing more to do


@pytest.mark.parametrize(("extra", "where"), [("housekeeping: {cron: 'daily'}", "housekeeping.cron"),
                                              ("checks: {cron: '61 * * * *'}", "checks.cron")])
def test_bad_cron_names_file_and_key(tmp_path: Path, extra: str, where: str) -> None:
    from pgstream_dagster.config import ConfigError

    cfg = write_config(tmp_path / "pgstream.yaml", "postgresql://x", [{"id": 1, "sink": {"type": "memory"}}])
    cfg.write_text(cfg.read_text() + extra + "\n")
    with pytest.raises(ConfigError, match=rf"{cfg}: {where}: Value error, not a valid cron expression"):
        build_definitions(cfg)
