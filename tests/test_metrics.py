"""The Prometheus exporter, scraped over real HTTP while a real pipeline (sensor ticks, runs on Spark,
an HTTP endpoint) delivers: counters equal the ledger, backlog and lag move, failover gauges during
an outage, counters unchanged across exporter restarts and ledger pruning, a read-only role that
can scrape and nothing else, bad configuration refused; the stream status asset's fresh counts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pgstream_dagster import cli, exporter
from pgstream_dagster.config import DEFAULT_READER, ConfigError, StreamConfig, load_config, load_metrics_settings
from pgstream_dagster.defs.names import status_asset_key
from pgstream_dagster.devdb import free_port
from pgstream_dagster.engine import ingest
from pgstream_dagster.engine.ledger import recording
from pgstream_dagster.engine.metrics import HISTOGRAMS, METRICS, SCRAPE_DURATION, UP

from .support.endpoint import Endpoint
from .support.faults import STREAM, delivered_all, drive, in_failover, sent_ids, stream_config
from .support.harness import Driver, insert_events, joined, slot_of, tick_until, write_config
from .support.metrics import Samples, bucket, scrape, value
from .support.schema import USERS, subscribe

S = str(STREAM)
LAG = "pgstream_delivery_lag_seconds"
FAILOVER = "pgstream_failover_duration_seconds"
GRAFANA = Path(__file__).resolve().parents[1] / "docs" / "grafana-pgstream.json"


@pytest.fixture
def metrics_url(db_url: str) -> Iterator[str]:
    """An exporter (the server in a thread, as `pgstream-dagster metrics` runs it) on a free port."""
    running = exporter.start(db_url, "127.0.0.1", 0)
    yield running.url
    running.stop()


def ledger(url: str) -> dict[str, Any]:
    with psycopg.connect(url) as c, c.cursor(row_factory=psycopg.rows.dict_row) as cur:
        row = cur.execute(
            """select coalesce(sum(event_count) filter (where status = 'delivered'), 0) as delivered_events,
                      count(*) filter (where status = 'delivered') as delivered_batches,
                      coalesce(sum(event_count) filter (where pgstream.batch_is_open(status)), 0) as open_events,
                      count(*) filter (where pgstream.batch_is_open(status)) as open_batches,
                      count(*) filter (where status = 'launched') as launched
               from pgstream.batches where stream_id = %s""", [STREAM]).fetchone()
    assert row is not None
    return row


def started(db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> Driver:
    """The in-process driver of stream 1 (to the HTTP endpoint), once its group's ticks made its stream row and
    slot (the group's delivery run, in the background, reads it)."""
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(endpoint)]), instance)
    tick_until(driver, STREAM, lambda: joined(db_url, STREAM))
    return driver


def delivered(db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint, events: int) -> Driver:
    """A started driver that has delivered ``events`` events, and every batch marked delivered."""
    driver = started(db_url, tmp_path, instance, endpoint)
    insert_events(db_url, STREAM, events)
    drive(driver, lambda: len(endpoint.unique()) >= events and ledger(db_url)["open_events"] == 0)
    return driver


def counters(samples: Samples) -> Samples:
    """The samples that must never go down: counters and histograms."""
    return {k: v for k, v in samples.items() if k[0].endswith(("_total", "_bucket", "_sum", "_count"))}


def test_counters_backlog_and_lag_follow_a_real_pipeline(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                                         endpoint: Endpoint, metrics_url: str) -> None:
    driver = started(db_url, tmp_path, instance, endpoint)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(USERS)
        subscribe(conn, "user-signup", columns=["id", "email"])
    s = scrape(metrics_url)
    assert value(s, UP) == 1
    assert value(s, "pgstream_events_delivered_total", stream=S) == 0
    assert value(s, "pgstream_backlog_events", stream=S) == 0
    assert value(s, "pgstream_slot_exists", stream=S) == 1
    assert value(s, "pgstream_slot_wal_status", stream=S, wal_status="reserved") == 1
    assert value(s, "pgstream_slot_info", stream=S, slot=slot_of(db_url, STREAM)) == 1

    # the endpoint holds its answers: the stream's run (in its group's delivery run) takes the batches and waits
    held = threading.Event()

    def hold(_n: int) -> None:
        held.wait(120)

    endpoint.hook = hold
    insert_events(db_url, STREAM, 120)  # manual events: no subscription key
    with psycopg.connect(db_url) as conn:
        conn.execute("insert into public.users (email) select 'u' || g || '@example.com' from generate_series(1, 7) g")
    tick_until(driver, STREAM, lambda: ledger(db_url)["open_events"] >= 127 and ledger(db_url)["launched"] >= 1,
               timeout=60)
    s = scrape(metrics_url)
    state = ledger(db_url)
    assert value(s, "pgstream_events_recorded_total", stream=S) == 127
    assert value(s, "pgstream_events_written_total", stream=S, subscription="") == 120
    assert value(s, "pgstream_events_written_total", stream=S, subscription="user-signup") == 7
    assert value(s, "pgstream_backlog_events", stream=S) == 127 == state["open_events"]
    assert value(s, "pgstream_backlog_batches", stream=S) == state["open_batches"] >= 3
    assert value(s, "pgstream_batches_in_flight", stream=S) == state["launched"] >= 1
    assert value(s, "pgstream_events_delivered_total", stream=S) == 0
    first_age = value(s, "pgstream_oldest_undelivered_age_seconds", stream=S)
    time.sleep(1.2)
    assert value(scrape(metrics_url), "pgstream_oldest_undelivered_age_seconds", stream=S) >= first_age + 1

    assert driver.group_runs[DEFAULT_READER]  # (the stream's runs are its group delivery run's)
    held.set()
    drive(driver, lambda: ledger(db_url)["open_events"] == 0)
    s = scrape(metrics_url)
    state = ledger(db_url)
    assert value(s, "pgstream_events_delivered_total", stream=S) == state["delivered_events"] == 127
    assert value(s, "pgstream_batches_delivered_total", stream=S) == state["delivered_batches"]
    assert len(endpoint.unique()) == 127
    assert value(s, "pgstream_backlog_events", stream=S) == 0
    assert value(s, "pgstream_backlog_batches", stream=S) == 0
    assert value(s, "pgstream_batches_in_flight", stream=S) == 0
    assert value(s, "pgstream_oldest_undelivered_age_seconds", stream=S) == 0
    assert value(s, "pgstream_delivery_attempts_total", stream=S) == state["delivered_batches"]
    assert value(s, "pgstream_delivery_attempts_failed_total", stream=S) == 0
    # one lag observation per delivered batch; the lag is at least the 1.2 s the events waited above
    assert value(s, f"{LAG}_count", stream=S) == bucket(s, LAG, "+Inf", stream=S) == state["delivered_batches"]
    assert value(s, f"{LAG}_sum", stream=S) >= 1.2 * state["delivered_batches"]
    assert bucket(s, LAG, "1", stream=S) == 0
    with psycopg.connect(db_url) as conn:
        lags = [r[0] for r in conn.execute("select extract(epoch from delivered_at - first_commit_at)::float8 "
                                           "from pgstream.batches where stream_id = %s", [STREAM])]
    assert value(s, f"{LAG}_sum", stream=S) == pytest.approx(sum(lags), abs=1e-3)
    assert bucket(s, LAG, "600", stream=S) == len([x for x in lags if x <= 600])

    # the status asset: the group's sensor observes it with fresh counts (a member's delivery rounds do not: a
    # hundred members' reports asking for their status were a group's largest query load)
    def fresh() -> bool:
        latest = driver.observations[-1].metadata if driver.observations else {}
        return latest.get("undelivered_events") is not None and latest["undelivered_events"].value == 0 \
            and latest["delivered_today"].value == 127
    tick_until(driver, STREAM, fresh, timeout=60)
    latest = driver.observations[-1]
    assert latest.asset_key == status_asset_key(STREAM)
    assert latest.metadata["observed_by"].value == "sensor"


def test_failover_gauges_during_an_outage(db_url: str, tmp_path: Path, instance: dg.DagsterInstance,
                                          endpoint: Endpoint, metrics_url: str) -> None:
    driver = delivered(db_url, tmp_path, instance, endpoint, 40)
    s = scrape(metrics_url)
    assert value(s, "pgstream_failover_active", stream=S) == 0
    assert value(s, "pgstream_failovers_entered_total", stream=S) == 0

    endpoint.mode = "error"
    insert_events(db_url, STREAM, 60, 40)
    entered = time.time()
    deadline = time.monotonic() + 120
    while not in_failover(db_url):
        assert time.monotonic() < deadline
        assert driver.tick(STREAM).run_requests == []  # (its runs are its group delivery run's)
    time.sleep(1.0)  # (the failover lasts a second at least: the gauge of its duration)
    s = scrape(metrics_url)
    assert value(s, "pgstream_failover_active", stream=S) == 1
    assert value(s, "pgstream_failovers_entered_total", stream=S) == 1
    assert value(s, "pgstream_failovers_recovered_total", stream=S) == 0
    assert value(s, "pgstream_delivery_attempts_failed_total", stream=S) >= 1
    assert value(s, "pgstream_failover_checkpoint_attempts", stream=S) >= 1
    assert value(s, "pgstream_failover_current_seconds", stream=S) >= 1
    since = value(s, "pgstream_failover_since_timestamp_seconds", stream=S)
    assert entered - 60 < since <= time.time()
    assert value(s, "pgstream_backlog_events", stream=S) == 60
    assert value(s, "pgstream_events_delivered_total", stream=S) == 40

    endpoint.mode = "ok"
    drive(driver, delivered_all(endpoint, db_url))
    s = scrape(metrics_url)
    assert value(s, "pgstream_failover_active", stream=S) == 0
    assert value(s, "pgstream_failover_current_seconds", stream=S) == 0
    assert value(s, "pgstream_failovers_recovered_total", stream=S) == 1
    assert value(s, f"{FAILOVER}_count", stream=S) == 1
    assert value(s, f"{FAILOVER}_sum", stream=S) >= 1
    assert value(s, "pgstream_events_delivered_total", stream=S) == len(sent_ids(db_url)) == 100
    assert value(s, "pgstream_backlog_events", stream=S) == 0


def test_counters_survive_exporter_restarts_and_ledger_pruning(db_url: str, tmp_path: Path,
                                                               instance: dg.DagsterInstance,
                                                               endpoint: Endpoint) -> None:
    delivered(db_url, tmp_path, instance, endpoint, 150)

    first, second = exporter.start(db_url, "127.0.0.1", 0), exporter.start(db_url, "127.0.0.1", 0)
    try:
        before = counters(scrape(first.url))
        assert counters(scrape(second.url)) == before  # replicas agree
    finally:
        first.stop()
        second.stop()
    assert before[("pgstream_events_delivered_total", frozenset({("stream", S)}))] == 150

    # pruning: every delivered batch goes from the ledger, not from the totals
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("update pgstream.batches set delivered_at = delivered_at - interval '30 days'")
        (pruned,) = conn.execute("select pgstream.prune_batches(interval '1 day')").fetchone()  # type: ignore[misc]
        assert pruned >= 3
        assert conn.execute("select count(*) from pgstream.batches").fetchone() == (0,)

    # a new exporter process, started from the command line
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pgstream_dagster.cli", "metrics", "--database-url", db_url,
                             "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/metrics" in line, line
        after = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert counters(after) == before
    assert value(after, "pgstream_backlog_events", stream=S) == 0
    assert value(after, "pgstream_backlog_batches", stream=S) == 0


def test_a_read_only_role_with_the_documented_grants_scrapes_and_can_do_nothing_else(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    delivered(db_url, tmp_path, instance, endpoint, 30)
    role = f"metrics_{db_url.rsplit('/', 1)[1]}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create role {} login").format(sql.Identifier(role)))
        # the grants docs/monitoring.md documents
        conn.execute(sql.SQL("grant usage on schema pgstream to {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("grant select on pgstream.metrics to {}").format(sql.Identifier(role)))
    reader_url = make_conninfo(db_url, user=role)
    running = exporter.start(reader_url, "127.0.0.1", 0)
    try:
        s = scrape(running.url)
        assert value(s, UP) == 1
        assert value(s, "pgstream_events_delivered_total", stream=S) == 30
        assert value(s, "pgstream_slot_exists", stream=S) == 1
        assert value(s, "pgstream_slot_retained_wal_bytes", stream=S) >= 0
        with psycopg.connect(reader_url, autocommit=True) as conn:
            for statement in ("select * from pgstream.batches", "select * from pgstream.stream_counters",
                              "select * from pgstream.events", "select * from pgstream.stream_status",
                              "select pgstream.set_paused(1, true)", "select pgstream.prune_batches()",
                              "insert into pgstream.events (payload, stream_id) values ('{}', 1)",
                              "delete from pgstream.stream_counters", "select pgstream._count(1, 'x', '', 1)"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
    finally:
        running.stop()
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop owned by {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


def test_a_scrape_never_blocks_delivery_and_never_waits_long_for_a_lock(db_url: str, metrics_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("insert into pgstream.streams (id) values (1)")
        conn.execute("insert into pgstream.events (payload, stream_id) values ('{}', 1)")
        conn.execute("""insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id,
                                                      min_created_at, max_created_at, first_commit_at)
                        select 1, array_agg(id), count(*), min(id), max(id), min(created_at), max(created_at),
                               min(created_at) from pgstream.events""")
    # a scrape's transaction left open does not hold up a batch being marked delivered
    with psycopg.connect(db_url) as scraper, psycopg.connect(db_url, autocommit=True) as delivery:
        scraper.execute("set transaction read only")
        scraper.execute("select * from pgstream.metrics").fetchall()
        delivery.execute("set lock_timeout = '1s'")
        delivery.execute("update pgstream.batches set status = 'delivered', delivered_at = now()")
        scraper.rollback()
    assert value(scrape(metrics_url), "pgstream_events_delivered_total", stream="1") == 1
    # a scrape does not read the events table: a lock on it (a partition being dropped) is no matter
    with psycopg.connect(db_url) as locker:
        locker.execute("lock table pgstream.events in access exclusive mode")
        started = time.monotonic()
        assert value(scrape(metrics_url), UP) == 1
        assert time.monotonic() - started < 5
    # a lock it does need (a migration altering the ledger) makes it answer pgstream_up 0 within
    # lock_timeout rather than queue behind it (and hold up the deliveries queued behind the scrape)
    with psycopg.connect(db_url) as locker:
        locker.execute("lock table pgstream.batches in access exclusive mode")
        started = time.monotonic()
        s = scrape(metrics_url)
        assert value(s, UP) == 0 and time.monotonic() - started < 5
        assert not any(k[0] == "pgstream_events_delivered_total" for k in s)
    assert value(scrape(metrics_url), UP) == 1


def test_the_status_shows_what_became_of_a_members_open_run(db_url: str, tmp_path: Path,
                                                            instance: dg.DagsterInstance, endpoint: Endpoint) -> None:
    """The ledger names an open run of stream 1 that no group delivery run has taken yet: its status shows it
    starting, waiting for its group's run (not gone: the group's live run takes every member run its ledger
    wants), then live once that run hosts it; a change of what the status shows is observed at once, nothing
    new is not observed."""
    open_run = stream_config(endpoint, delivery={"tuning": {"max_run_secs": 120}})
    driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [open_run]), instance)
    tick_until(driver, STREAM, lambda: joined(db_url, STREAM))
    (group_run,) = driver.group_runs[DEFAULT_READER]
    key = "pgstream-s1-gone-b1-a1"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("update pgstream.streams set open_run_key = %s where id = 1", [key])
    driver.observations.clear()
    tick_until(driver, STREAM, lambda: bool(driver.observations))
    first = driver.observations[0]
    assert first.metadata["open_run_key"].value == key
    assert str(first.metadata["open_run_state"].value) in (
        f"starting: the delivery run of reader group {DEFAULT_READER} to take run {key}",
        f"live: member run {group_run.run_id}/{STREAM} (it holds the delivery lease)")  # (taken meanwhile)
    tick_until(driver, STREAM, lambda: str(driver.observations[-1].metadata["open_run_state"].value) ==
               f"live: member run {group_run.run_id}/{STREAM} (it holds the delivery lease)", timeout=60)
    # nothing new, nothing observed
    driver.observations.clear()
    driver.tick(STREAM)
    assert driver.observations == []


def test_bad_metrics_configuration_is_refused_with_a_clear_message(db_url: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    base = {"database_url": "postgresql://reader:hunter2@127.0.0.1/x",
            "streams": [{"id": 1, "sink": {"type": "memory", "name": "m"}}]}
    cases = [({"port": 70000}, "metrics.port: Input should be less than or equal to 65535"),
             ({"prot": 9187}, "metrics.prot: unknown key (allowed: enabled, host, port, "),
             ({"scrape_timeout_secs": 0}, "metrics.scrape_timeout_secs: Input should be greater than 0"),
             ({"host": "a b"}, "metrics.host: String should match pattern"),
             ({"database_url": "postgresql://u:hunter2@h/db", "enabled": "maybe"},
              "metrics.enabled: Input should be a valid boolean")]
    for metrics, message in cases:
        path = tmp_path / "bad.yaml"
        path.write_text(json.dumps({**base, "metrics": metrics}))
        for load in (load_config, load_metrics_settings):
            with pytest.raises(ConfigError) as err:
                load(path)
            assert f"{path}: {message}" in str(err.value) and "hunter2" not in str(err.value)
        assert cli.main(["metrics", "--config", str(path)]) == 1
        err_text = capsys.readouterr().err
        assert message in err_text and "hunter2" not in err_text
    # a good block is read (and a component-free file needs no sink secrets for it)
    path = tmp_path / "good.yaml"
    path.write_text(json.dumps({**base, "streams": [{"id": 1, "sink": {"type": "http", "url": "${UNSET_TOKEN_URL}"}}],
                                "metrics": {"port": 9999, "host": "0.0.0.0", "scrape_timeout_secs": 2}}))
    settings = load_metrics_settings(path)
    assert (settings.metrics.port, settings.metrics.host, settings.metrics.scrape_timeout_secs) == (9999, "0.0.0.0", 2)
    # a port in use
    running = exporter.start(db_url, "127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match=rf"metrics: cannot listen on 127\.0\.0\.1:{running.port}"):
            exporter.start(db_url, "127.0.0.1", running.port)
    finally:
        running.stop()


def exported_names() -> set[str]:
    names = {UP, SCRAPE_DURATION}
    for spec in METRICS.values():
        names.add(f"{spec.name}_total" if spec.kind == "counter" else spec.name)
    for name, _help in HISTOGRAMS.values():
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_the_grafana_dashboard_is_valid_and_uses_exported_metrics_only() -> None:
    dashboard = json.loads(GRAFANA.read_text())
    assert any(v.get("type") == "datasource" and v.get("query") == "prometheus"
               for v in dashboard["templating"]["list"])
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 8
    names = exported_names()
    used: set[str] = set()
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            found = set(re.findall(r"\bpgstream_[a-z_]+", target["expr"]))
            assert found, target["expr"]
            assert found <= names, f"{panel['title']}: {sorted(found - names)} are not exported"
            used |= found
    # what an on-call engineer needs first
    assert {"pgstream_oldest_undelivered_age_seconds", "pgstream_backlog_events", "pgstream_failover_active",
            "pgstream_slot_retained_wal_bytes", "pgstream_dead_letters_open", f"{LAG}_bucket",
            "pgstream_events_delivered_total"} <= used


def test_the_metric_reference_names_every_exported_metric() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "metrics.md").read_text()
    missing = sorted(n for n in exported_names() if not n.endswith(("_sum", "_count")) and f"`{n}`" not in page
                     and f"`{n.removesuffix('_bucket')}`" not in page)
    assert missing == []


def _plans_of_recording(c: psycopg.Connection, ids: list[int], lo: object, hi: object) -> list[str]:
    """Record a batch of ``ids`` (created between ``lo`` and ``hi``) for stream 1; the plans of the statements
    that counted its events by subscription key (auto_explain)."""
    plans: list[str] = []
    c.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
    c.execute("load 'auto_explain'")
    c.execute("set auto_explain.log_min_duration = 0")
    c.execute("set auto_explain.log_nested_statements = on")
    c.execute("set auto_explain.log_level = notice")
    c.execute("insert into pgstream.batches (stream_id, kind, event_ids, event_count, first_event_id, "
              "last_event_id, min_created_at, max_created_at) values (1, 'stream', %s, %s, %s, %s, %s, %s)",
              [ids, len(ids), ids[0], ids[-1], lo, hi])
    c.execute("set auto_explain.log_min_duration = -1")
    return [p for p in plans if "tg_name" in p]


def _count_plans(c: psycopg.Connection, ids: list[int], lo: object, hi: object) -> list[str]:
    """The plans of :func:`_plans_of_recording` that counted a batch's events in one statement."""
    return [p for p in _plans_of_recording(c, ids, lo, hi) if "Query Text: insert into pgstream.stream_counters" in p]


def _written(c: psycopg.Connection) -> dict[str, int]:
    return {str(label): int(value) for label, value in c.execute(
        "select label, value from pgstream.stream_counters where stream_id = 1 and name = 'events_written'")}


def test_recording_a_batch_reads_its_events_once_whatever_the_statistics(db_url: str) -> None:
    """The batch trigger counts the batch's events by subscription (``events_written``): once the
    partition has statistics, a batch newer than its histogram looked empty to the planner, which
    then scanned the stream's (stream_id, created_at) index range once per event id: seconds per
    batch of 10,000 under load, the reader stalled and the run closed. A batch whose ids are dense
    (the usual case) is read by one scan of its id range, the ids hashed: no nested loop, whatever
    the plan chooses for the scan; only the batch's events of the stream are counted, each by its
    tg_name (plan read with auto_explain)."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id) values (1), (2) on conflict do nothing")
        c.execute("insert into pgstream.events (payload, stream_id) "
                  "select jsonb_build_object('tg_name', 'k', 'n', g), 1 from generate_series(1, 30000) g")
        c.execute("analyze pgstream.events")
        # the batch's 3,000 events, among them 500 without a subscription key ('other' is no key of stream 1);
        # interleaved: 1,000 events of stream 2 and 500 of stream 1 that are not in the batch, in its id range
        c.execute("insert into pgstream.events (payload, stream_id) "
                  "select jsonb_build_object('tg_name', case when g % 6 = 0 then 'other' else 'k' end, 'n', g), "
                  "case when g % 5 = 4 then 2 else 1 end from generate_series(1, 5000) g")
        c.execute("create table if not exists public.keyed (id bigint)")
        c.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name) "
                  "values ('k', 1, 'INSERT', 'keyed')")
        rows = c.execute("select id, created_at, stream_id from pgstream.events order by id desc limit 5000"
                         ).fetchall()[::-1]
        mine = [(i, at) for n, (i, at, sid) in enumerate(rows) if sid == 1 and n % 7 != 3][:3000]
        ids = [i for i, _at in mine]
        assert max(ids) - min(ids) < 4 * len(ids)  # dense: the scan of the range
        plans = _count_plans(c, ids, min(at for _i, at in mine), max(at for _i, at in mine))
        assert len(plans) == 1, plans
        assert "Nested Loop" not in plans[0], plans[0]
        expected = c.execute("select count(*) filter (where payload ->> 'tg_name' = 'k'), "
                             "count(*) filter (where payload ->> 'tg_name' <> 'k') from pgstream.events "
                             "where id = any(%s)", [ids]).fetchone()
        assert expected is not None and expected[0] > 0 and expected[1] > 0
        assert _written(c) == {"k": expected[0], "": expected[1]}


def test_recording_a_sparse_batch_probes_its_events_by_key(db_url: str) -> None:
    """A batch whose ids are spread over a range more than 4 times its size (a long transaction's
    events recorded with recent ones) is not read by a scan of the range: one primary key probe per
    id, whatever the statistics."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id) values (1) on conflict do nothing")
        c.execute("insert into pgstream.events (payload, stream_id) "
                  "select jsonb_build_object('tg_name', 'k', 'n', g), 1 from generate_series(1, 30000) g")
        c.execute("analyze pgstream.events")
        rows = c.execute("select id, created_at from pgstream.events order by id").fetchall()
        picked = rows[::20][:1000] + rows[-100:]
        ids = [i for i, _at in picked]
        assert max(ids) - min(ids) >= 4 * len(ids)
        plans = _count_plans(c, ids, min(at for _i, at in picked), max(at for _i, at in picked))
        assert len(plans) == 1, plans
        assert "events_" in plans[0] and "_pkey" in plans[0], plans[0]
        assert "stream_id_created_at" not in plans[0], plans[0]
        assert _written(c) == {"": 1100}


def test_recording_a_one_event_batch_counts_it_by_one_probe(db_url: str) -> None:
    """A quiet stream's batch holds one event: it is counted by its key (``''`` for none) through one probe of
    an index, without the range's sorts and hash (0.4 ms a batch in the 100-stream bench); an id of
    another stream's event is not counted, whatever the array's bounds."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id) values (1), (2) on conflict do nothing")
        c.execute("create table if not exists public.keyed (id bigint)")
        c.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name) "
                  "values ('k', 1, 'INSERT', 'keyed')")
        rows = c.execute("insert into pgstream.events (payload, stream_id) values "
                         "('{\"tg_name\": \"k\"}', 1), ('{\"tg_name\": \"other\"}', 1), "
                         "('{\"tg_name\": \"k\"}', 2), ('{\"tg_name\": \"k\"}', 1) "
                         "returning id, created_at").fetchall()
        keyed, other, foreign, bounded = rows
        plans = []
        for event_id, at in (keyed, other, foreign):
            plans += [p for p in _plans_of_recording(c, [event_id], at, at) if "pgstream.events" in p]
        assert _written(c) == {"k": 1, "": 1}
        c.execute("insert into pgstream.batches (stream_id, kind, event_ids, event_count, first_event_id, "
                  "last_event_id, min_created_at, max_created_at) values (1, 'stream', %s::bigint[], 1, %s, %s, "
                  "%s, %s)", [f"[3:3]={{{bounded[0]}}}", bounded[0], bounded[0], bounded[1], bounded[1]])
        assert _written(c) == {"k": 2, "": 1}
    assert len(plans) == 3, plans
    assert all("Index Scan" in p and not any(w in p for w in ("Hash", "Sort", "Seq Scan")) for p in plans), (
        "\n".join(plans))


# --- events just decoded from the slot: counted and read back whatever the commit's visibility -------

WRITERS = 8


def _subscribed_stream(db_url: str, tmp_path: Path, *, fill_secs: float) -> StreamConfig:
    """Stream STREAM (a file sink) with a subscription on public.users, a member of the default group (the
    group's slot created, the stream joined)."""
    config = load_config(write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": STREAM, "batch": {"max_size": 100, "max_fill_secs": fill_secs},
         "delivery": {"mode": "open"}, "sink": {"type": "file", "path": str(tmp_path / "out.jsonl")}}]))
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(USERS)
        subscribe(c, "user-signup", columns=["id", "email"])
        ingest.consume_group(c, DEFAULT_READER, list(config.streams), 0)
    return config.streams[0]


class _Read:
    """What a reader recorded so far (events), and a note per pass of the group's sensor."""

    def __init__(self) -> None:
        self.events = 0
        self.notes: list[str] = []


def _group_run_reader(url: str, stream: StreamConfig, stop: threading.Event, read: _Read,
                      application_name: str = "pgstream reader t") -> None:
    """The group delivery run's reader: the default group's slot over the replication protocol, read pass after
    pass (as ``GroupDelivery`` calls ``consume_group``) until ``stop``; its connections named
    ``application_name``."""
    kept = ingest.GroupStream(url, application_name)
    try:
        with psycopg.connect(url, autocommit=True, application_name=application_name) as c:
            while not stop.is_set():
                result = ingest.consume_group(c, DEFAULT_READER, [stream], 0.2, kept=kept, stop=stop.is_set)
                read.events += sum(result.events.values())
    finally:
        kept.close()


def _recorded_and_written(url: str) -> dict[str, int]:
    """The stream's events_recorded and events_written counters, by ``name:label``."""
    with psycopg.connect(url) as c:
        rows = c.execute("select name || ':' || label, value::bigint from pgstream.stream_counters "
                         "where stream_id = %s and name in ('events_recorded', 'events_written')",
                         [STREAM]).fetchall()
    return {str(k): int(v) for k, v in rows}


def _hammer(url: str, stop: threading.Event, written: list[int]) -> None:
    """One writer: single-row transactions on public.users as fast as it can (each a commit the
    reader decodes while, often, the writer's backend has not yet left the proc array)."""
    with psycopg.connect(url, autocommit=True) as c:
        while not stop.is_set():
            c.execute("insert into public.users (name, email) values ('x', 'x@example.com')")
            written.append(1)


def _read_batches_as_recorded(url: str, stop: threading.Event, short: list[tuple[int, int, int]]) -> None:
    """A run's direct read of every batch as soon as it is recorded: (batch, events, found) when some
    of its events were not found."""
    last = 0
    with psycopg.connect(url, autocommit=True) as c:
        while not stop.is_set():
            rows = c.execute("select b.id, b.event_count, (select count(*) from pgstream.events e "
                             "where e.id = any(b.event_ids) and e.created_at between b.min_created_at "
                             "and b.max_created_at) from pgstream.batches b where b.id > %s order by b.id",
                             [last]).fetchall()
            short += [r for r in rows if r[1] != r[2]]
            last = rows[-1][0] if rows else last


def test_every_event_just_decoded_is_counted_by_subscription_under_concurrent_writers(db_url: str,
                                                                                    tmp_path: Path) -> None:
    """Logical decoding hands out a transaction's commit once its WAL is flushed, before the writer's
    backend leaves the proc array: for a moment other snapshots do not see its rows yet. The group
    delivery run's reader records such transactions 1-12 ms after their commit; the batch trigger's
    per-subscription count (and any read of the batch's events right after) must still see every
    event: ``events_written`` by key equals what was written, to the event, under 8 writers."""
    stream = _subscribed_stream(db_url, tmp_path, fill_secs=0.2)
    stop_reader, stats = threading.Event(), _Read()
    reader = threading.Thread(target=_group_run_reader, args=(db_url, stream, stop_reader, stats))
    reader.start()
    stop = threading.Event()
    written: list[list[int]] = [[] for _ in range(WRITERS)]
    writers = [threading.Thread(target=_hammer, args=(db_url, stop, w)) for w in written]
    short: list[tuple[int, int, int]] = []
    poller = threading.Thread(target=_read_batches_as_recorded, args=(db_url, stop_reader, short))
    poller.start()
    try:
        for w in writers:
            w.start()
        time.sleep(3)
    finally:
        stop.set()
        for w in writers:
            w.join()
    total = sum(len(w) for w in written)
    deadline = time.monotonic() + 60
    while stats.events < total:
        assert time.monotonic() < deadline, f"the reader recorded {stats.events} of {total} events"
        time.sleep(0.05)
    stop_reader.set()
    reader.join()
    poller.join()
    counted = _recorded_and_written(db_url)
    assert short == []  # every direct read of a just-recorded batch found all its events
    assert total > 500 and counted == {"events_recorded:": total, "events_written:user-signup": total}, \
        (total, counted)


HELD = 5


def _reload(admin: psycopg.Connection, url: str, name: str, value: str) -> None:
    """Reload the server's configuration and wait until a new session sees ``name`` at ``value``: the
    postmaster reads the file when it handles the signal, and a session started before that keeps the old
    value (a transaction meant to be held by synchronous replication would commit at once)."""
    admin.execute("select pg_reload_conf()")
    deadline = time.monotonic() + 10
    while True:
        with psycopg.connect(url) as c:
            if c.execute("select current_setting(%s)", [name]).fetchone() == (value,):
                return
        assert time.monotonic() < deadline, f"{name} never became {value!r}"
        time.sleep(0.05)


def _commit_held(url: str) -> None:
    """One event committed, then held out of the proc array by synchronous replication (its commit
    record is flushed, so decodable, but its rows stay invisible until the standby answers)."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("set synchronous_commit = on")
        c.execute("insert into public.users (name, email) values ('held', 'held@example.com')")


def _reader_waits_for_visibility(url: str) -> bool:
    """The reader's ledger connection is in its recording transaction, waiting for the decoded
    transactions to become visible."""
    with psycopg.connect(url) as c:
        return c.execute("select exists (select 1 from pg_stat_activity where application_name = "
                         "'pgstream reader t' and backend_type = 'client backend' and "
                         "state = 'idle in transaction' and query like '%%pg_visible_in_snapshot%%')"
                         ).fetchone() == (True,)


def _sensor(url: str, stream: Any, stop: threading.Event, stats: _Read) -> None:
    """The group's sensor's ticks (peek, record) on a connection named like the reader's, until stopped."""
    with psycopg.connect(url, autocommit=True, application_name="pgstream reader t") as c:
        while not stop.is_set():
            stats.events += sum(ingest.consume_group(c, DEFAULT_READER, [stream], 0.2).events.values())
            stats.notes.append("tick ended")


@pytest.mark.parametrize("recorder", ["group run's reader", "sensor"])
def test_a_transaction_decoded_before_it_is_visible_is_counted_and_read_once_visible(
        pg: Any, db_url: str, tmp_path: Path, recorder: str) -> None:
    """The window made wide and certain: synchronous replication to a standby that never answers
    holds ``HELD`` committed transactions between their flushed commit record (decodable) and the
    proc array (nobody sees their rows). The group delivery run's reader (replication protocol) and the
    group's sensor (peek) wait for them instead of recording batches whose events they cannot see; once the standby
    requirement is lifted, each event is counted by subscription and its batch reads whole."""
    stream = _subscribed_stream(db_url, tmp_path, fill_secs=0.1)
    stop, stats = threading.Event(), _Read()
    reader = (threading.Thread(target=_group_run_reader, args=(db_url, stream, stop, stats)) if recorder != "sensor"
              else threading.Thread(target=_sensor, args=(db_url, stream, stop, stats)))
    held = [threading.Thread(target=_commit_held, args=(db_url,)) for _ in range(HELD)]
    with psycopg.connect(pg.url, autocommit=True) as admin:
        admin.execute("alter system set synchronous_commit = 'local'")  # every other session: no wait
        admin.execute("alter system set synchronous_standby_names = 'pgstream_absent_standby'")
        _reload(admin, pg.url, "synchronous_standby_names", "pgstream_absent_standby")
        try:
            reader.start()
            for t in held:
                t.start()
            deadline = time.monotonic() + 60
            # today's recorders record them at once (their events unseen); correct ones wait
            while stats.events < HELD and not _reader_waits_for_visibility(db_url):
                assert time.monotonic() < deadline, "the recorder neither recorded nor waited"
                time.sleep(0.02)
            if recorder == "sensor" and stats.events < HELD:
                # a tick waits at most its budget (a second at least), records nothing, and the next peeks again
                ticks = len(stats.notes)
                while len(stats.notes) < ticks + 2:
                    assert time.monotonic() < deadline, "the sensor's tick never ended"
                    time.sleep(0.02)
                assert stats.events == 0
            elif stats.events < HELD:
                # the run stops while its reader waits: it ends at once, having recorded and confirmed
                # nothing; the next reader receives them again
                stop.set()
                reader.join()
                assert stats.events == 0
                stop = threading.Event()
                reader = threading.Thread(target=_group_run_reader, args=(db_url, stream, stop, stats))
                reader.start()
        finally:
            admin.execute("alter system reset synchronous_standby_names")
            admin.execute("alter system reset synchronous_commit")
            _reload(admin, pg.url, "synchronous_standby_names", "")
            for t in held:
                t.join()
    deadline = time.monotonic() + 60
    while stats.events < HELD:
        assert time.monotonic() < deadline, f"recorded {stats.events} of {HELD} events"
        time.sleep(0.02)
    stop.set()
    reader.join()
    counted = _recorded_and_written(db_url)
    with psycopg.connect(db_url) as c:
        found = c.execute("select count(*) from pgstream.batches b join pgstream.events e "
                          "on e.id = any(b.event_ids)").fetchone()
    assert counted == {"events_recorded:": HELD, "events_written:user-signup": HELD}, counted
    assert found == (HELD,)


def test_a_reader_made_a_synchronous_standby_says_so_instead_of_waiting_for_its_writers(
        pg: Any, db_url: str, tmp_path: Path) -> None:
    """``synchronous_standby_names`` naming the reader's replication connection: a writer waits for the
    reader to confirm its commit, the reader for the commit to become visible. The reader stops with
    a clear error (the run reports it); once the setting lists real standbys only, the sensor records
    every event, counted by subscription."""
    stream = _subscribed_stream(db_url, tmp_path, fill_secs=0.1)
    failed: list[BaseException] = []
    stop = threading.Event()

    def follow() -> None:
        try:
            _group_run_reader(db_url, stream, stop, _Read())
        except BaseException as exc:  # what the run's reader thread reports
            failed.append(exc)

    reader = threading.Thread(target=follow)
    held = threading.Thread(target=_commit_held, args=(db_url,))
    with psycopg.connect(pg.url, autocommit=True) as admin:
        admin.execute("alter system set synchronous_commit = 'local'")
        admin.execute("""alter system set synchronous_standby_names = '"pgstream reader t"'""")
        admin.execute("select pg_reload_conf()")
        try:
            reader.start()
            deadline = time.monotonic() + 60
            # the reader has confirmed a position once (nothing to record): it is the synchronous standby
            while admin.execute("select sync_state from pg_stat_replication where application_name = "
                                "'pgstream reader t'").fetchall() != [("sync",)]:
                assert time.monotonic() < deadline, "the reader never became the synchronous standby"
                time.sleep(0.05)
            held.start()
            reader.join(timeout=60)
            assert not reader.is_alive()
        finally:
            stop.set()
            admin.execute("alter system reset synchronous_standby_names")
            admin.execute("alter system reset synchronous_commit")
            admin.execute("select pg_reload_conf()")
            held.join()
            reader.join()
    assert len(failed) == 1 and isinstance(failed[0], recording.ReaderIsSynchronousStandby), failed
    assert "'pgstream reader t'" in str(failed[0]) and "synchronous_standby_names" in str(failed[0])
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select count(*) from pgstream.batches").fetchone() == (0,)  # nothing recorded unseen
        assert ingest.consume_group(c, DEFAULT_READER, [stream], 1.0).events == {STREAM: 1}
        assert c.execute("select name || ':' || label, value::bigint from pgstream.stream_counters where "
                         "name in ('events_recorded', 'events_written') order by 1").fetchall() == [
            ("events_recorded:", 1), ("events_written:user-signup", 1)]
