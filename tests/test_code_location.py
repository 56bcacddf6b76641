"""End to end, the way a user runs it: ``init`` + ``dg dev`` on the repo's workspace.yaml and
dagster.yaml; a row inserted in Postgres reaches a real HTTP endpoint through the real sensor daemon (the
sensor of reader group ``default``, the group of a stream that names none) and a real group delivery run
hosting the stream's delivery run."""

from __future__ import annotations

import itertools
import json
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import psycopg
import pytest
import yaml
from dagster import DagsterRunStatus, RunsFilter

from pgstream_dagster.config import DEFAULT_READER
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import (
    BACKFILL_JOB,
    BACKFILL_OP,
    BACKFILL_TAG,
    CONTROL_JOB,
    DELIVERY_JOB,
    GROUP_DELIVERY_JOB,
    GROUP_TAG,
    REPLAY_JOB,
    REPLAY_OP,
    SUBSCRIPTIONS_JOB,
    SUBSCRIPTIONS_SENSOR,
    group_sensor_name,
    member_tag,
)
from pgstream_dagster.devdb import free_port
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.migrations import migrate
from pgstream_dagster.instance import FileComputeLogManager

from .support.dagster_dev import (
    READY_TIMEOUT_SECS,
    Databases,
    repo_root,
    start_dagster_dev,
    stop_process_group,
    wait_for,
)
from .support.dagster_instance import step_failure
from .support.harness import group_tag_of, write_config

EVENTS_TIMEOUT_SECS = 240  # the first run starts Spark

SENSOR_QUERY = """
query ($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    __typename
    ... on Sensor { sensorState { status ticks(limit: 1) { status timestamp } } }
  }
}
"""

LAUNCH_MUTATION = """
mutation ($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}
"""

TERMINATE_MUTATION = """
mutation ($runId: String!) {
  terminateRun(runId: $runId) { __typename ... on PythonError { message } ... on TerminateRunFailure { message } }
}
"""


# --------------------------------------------------------------------------------------------
# a real HTTP endpoint


@dataclass
class Received:
    event_id: int
    body: dict[str, Any]
    at: float  # time.time() on arrival


@dataclass
class Hook:
    url: str
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[Received]:
        with self.lock:
            return list(self.received)


@pytest.fixture
def hook() -> Iterator[Hook]:
    state: list[Hook] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the sink's httpx client expects

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            event_id = int(self.headers["X-Pgstream-Event-Id"])
            with state[0].lock:
                state[0].received.append(Received(event_id, body, time.time()))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.append(Hook(url=f"http://127.0.0.1:{server.server_address[1]}/hook"))
    thread = threading.Thread(target=server.serve_forever, name="hook-server", daemon=True)
    thread.start()
    try:
        yield state[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


# --------------------------------------------------------------------------------------------


def test_dagster_dev_delivers_inserted_rows_to_http(databases: Databases, hook: Hook, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    test_started = time.monotonic()
    app = databases.app_url
    migrate(app)
    with psycopg.connect(app, autocommit=True) as conn:
        conn.execute("create table public.users (id serial primary key, email text, verified bool default false)")

    config_path = write_config(
        tmp_path / "pgstream.yaml", app,
        streams=[{"id": 1, "sink": {"type": "http", "url": hook.url, "mode": "per_event"},
                  "batch": {"max_size": 100, "max_fill_secs": 0.5},
                  "sensor": {"interval_secs": 1, "tick_budget_secs": 3},
                  "delivery": {"mode": "open"}}],
        subscriptions=[{"key": "user-signup", "stream_id": 1, "operation": "INSERT", "schema_name": "public",
                        "table_name": "users", "when_clause": "new.verified", "column_names": ["id", "email"]}],
    )
    print("\n" + "\n".join(init(config_path)))

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(repo_root() / "dagster.yaml", home / "dagster.yaml")
    env = {"PGSTREAM_CONFIG": str(config_path), "DAGSTER_HOME": str(home),
           "DAGSTER_POSTGRES_URL": databases.dagster_url, "PYTHONUNBUFFERED": "1"}

    dev = start_dagster_dev(tmp_path, env)
    try:
        # 1. the code location is loaded and the daemon ticks the sensor of the stream's group (default)
        selector = {"repositoryLocationName": "pgstream", "repositoryName": "__repository__",
                    "sensorName": group_sensor_name(DEFAULT_READER)}
        last_answer: list[object] = [None]

        def sensor_ticked() -> bool:
            try:
                answer = dev.graphql(SENSOR_QUERY, {"selector": selector})
            except httpx.HTTPError as exc:
                last_answer[0] = exc
                return False
            last_answer[0] = answer
            sensor = (answer.get("data") or {}).get("sensorOrError") or {}
            state = sensor.get("sensorState") or {}
            ticks = state.get("ticks") or [{}]
            return state.get("status") == "RUNNING" and ticks[0].get("status") in ("SKIPPED", "SUCCESS")

        ready_secs = wait_for("the sensor's first completed tick", sensor_ticked, READY_TIMEOUT_SECS, dev,
                              lambda: f"last GraphQL answer: {last_answer[0]!r}")
        print(f"dg dev up and sensor ticking after {time.monotonic() - test_started:.1f}s "
              f"(waited {ready_secs:.1f}s)")

        # 2. 20 verified and 5 unverified users, in 5 transactions
        expected: list[str] = []
        unverified: list[str] = []
        commits: list[float] = []
        with psycopg.connect(app) as conn:
            for txn in range(5):
                with conn.transaction():
                    for i in range(5):
                        n = txn * 5 + i
                        verified = i != 2
                        email = f"user{n:02d}@example.com"
                        (expected if verified else unverified).append(email)
                        conn.execute("insert into public.users (email, verified) values (%s, %s)", [email, verified])
                commits.append(time.time())
        first_commit_at, last_commit_at = commits[0], commits[-1]
        assert len(expected) == 20 and len(unverified) == 5

        # 3. they arrive at the endpoint
        def batches() -> list[tuple[Any, ...]]:
            with psycopg.connect(app, autocommit=True) as c:
                return c.execute("select id, status, event_count, attempts, error, run_key from pgstream.batches "
                                 "where stream_id = 1 order by id").fetchall()

        def state() -> str:
            got = hook.snapshot()
            return (f"received {len(got)} bodies: {[r.body.get('new', {}).get('email') for r in got]}\n"
                    f"batches (id, status, events, attempts, error, run key): {batches()}")

        wait_for("20 events at the HTTP endpoint", lambda: len(hook.snapshot()) >= 20, EVENTS_TIMEOUT_SECS,
                 dev, state)
        time.sleep(1)  # anything extra (an unverified user, a duplicate) would arrive now
        got = hook.snapshot()
        assert [r.body["new"]["email"] for r in got] == expected, state()
        assert {r.body["tg_name"] for r in got} == {"user-signup"}
        assert {r.body["tg_op"] for r in got} == {"INSERT"}
        assert all(r.body["new"]["email"] not in unverified for r in got)
        ids = [r.event_id for r in got]
        assert all(a < b for a, b in itertools.pairwise(ids)), ids
        first_latency = got[0].at - first_commit_at
        last_latency = got[-1].at - last_commit_at

        # 3b. the member run stays open in the group run: a second wave is handed to it, no new run
        with psycopg.connect(app, autocommit=True) as conn:
            conn.execute("insert into public.users (email, verified) select 'late' || g || '@example.com', true "
                         "from generate_series(1, 5) g")
            second_commit_at = time.time()
        wait_for("5 more events at the HTTP endpoint", lambda: len(hook.snapshot()) >= 25, 60, dev, state)
        warm_latency = hook.snapshot()[-1].at - second_commit_at
        expected += [f"late{g}@example.com" for g in range(1, 6)]
        assert [r.body["new"]["email"] for r in hook.snapshot()] == expected, state()
        with psycopg.connect(app, autocommit=True) as conn:
            assert len({r[0] for r in conn.execute("select run_key from pgstream.batches")}) == 1, state()
            conn.execute("select pgstream.set_paused(1, true)")  # the open member run closes within a second

        # 4. the ledger and Dagster agree: every batch delivered by the member run the group run hosted, which
        # ended (not failed); the group run lives on, no run of the stream's own
        wait_for("every batch of stream 1 to be delivered",
                 lambda: bool(batches()) and all(b[1] == BatchStatus.DELIVERED for b in batches()), 60, dev, state)
        recorded = batches()
        assert sum(b[2] for b in recorded) == 25, recorded

        monkeypatch.setenv("DAGSTER_HOME", str(home))
        monkeypatch.setenv("DAGSTER_POSTGRES_URL", databases.dagster_url)
        with dg.DagsterInstance.get() as instance:
            def member() -> dict[str, Any]:
                runs = instance.get_runs(RunsFilter(job_name=GROUP_DELIVERY_JOB))
                return json.loads(runs[0].tags.get(member_tag(1), "{}")) if runs else {}

            # the batch is marked delivered inside the member run, a moment before the run says it ended
            wait_for("the member run of stream 1 to end", lambda: member().get("state") == "ended", 60, dev,
                     lambda: f"runs: {[(r.run_id, r.status, r.tags) for r in instance.get_runs()]}")
            runs = list(instance.get_runs(RunsFilter(job_name=GROUP_DELIVERY_JOB)))
            assert len(runs) == 1 and runs[0].status == DagsterRunStatus.STARTED, runs  # one group run, still up
            assert runs[0].tags.get(GROUP_TAG) == group_tag_of(app, DEFAULT_READER)
            assert member() == {"run_key": recorded[0][5], "state": "ended", "error": None}  # it delivered both waves
            assert not instance.get_runs(RunsFilter(job_name=DELIVERY_JOB))

            # 5. a backfill launched as the Launchpad does, cancelled as the UI does (terminateRun): it
            # stops cleanly, resumable; launched again, it resumes: every verified user once
            _backfill_cancelled_and_resumed(dev, app, instance)

        print(f"{len(recorded)} batches {[b[2] for b in recorded]} delivered by one member run of group run "
              f"{runs[0].run_id}")
        print(f"latency insert commit -> arrival: first event {first_latency:.2f}s, "
              f"last event {last_latency:.2f}s (last commit -> last arrival), "
              f"second wave {warm_latency:.2f}s (open member run)")
    finally:
        survivors = stop_process_group(dev.proc)
    assert not survivors, f"processes of `dg dev` survived SIGKILL: {survivors}"
    print(f"test took {time.monotonic() - test_started:.1f}s")


def _backfill_cancelled_and_resumed(dev: Any, app: str, instance: dg.DagsterInstance) -> None:
    with psycopg.connect(app, autocommit=True) as conn, conn.transaction():
        conn.execute("set local session_replication_role = replica")  # rows that exist: no events
        conn.execute("insert into public.users (email, verified) select 'old' || g || '@example.com', g % 4 <> 0 "
                     "from generate_series(1, 3000) g")

    def launch(rate: int) -> str:
        config = {"stream_id": 1, "subscriptions": ["user-signup"], "parallelism": 2, "chunk_size": 50,
                  "max_rows_per_sec": rate, "progress_secs": 1}
        answer = dev.graphql(LAUNCH_MUTATION, {"params": {
            "selector": {"repositoryLocationName": "pgstream", "repositoryName": "__repository__",
                         "jobName": BACKFILL_JOB},
            "runConfigData": {"ops": {BACKFILL_OP: {"config": config}}}}})
        launched = answer["data"]["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", answer
        return str(launched["run"]["runId"])

    def backfill_state() -> tuple[str, int, int]:
        with psycopg.connect(app, autocommit=True) as c:
            row = c.execute("select status, rows_read, events_written from pgstream.backfill_progress").fetchone()
        return (str(row[0]), int(row[1]), int(row[2])) if row else ("none", 0, 0)

    def run_status(run_id: str) -> DagsterRunStatus:
        run = instance.get_run_by_id(run_id)
        assert run is not None
        return run.status

    first = launch(200)
    wait_for("the backfill to read rows", lambda: backfill_state()[1] > 0, 240, dev,
             lambda: f"backfill {backfill_state()}, run {run_status(first)}")
    answer = dev.graphql(TERMINATE_MUTATION, {"runId": first})
    assert answer["data"]["terminateRun"]["__typename"] == "TerminateRunSuccess", answer
    wait_for("the cancelled run to end", lambda: run_status(first) == DagsterRunStatus.CANCELED, 120, dev,
             lambda: f"backfill {backfill_state()}, run {run_status(first)}")
    status, read, _ = backfill_state()
    assert status == "stopped" and 0 < read < 3025, backfill_state()  # stopped cleanly, mid-way

    second = launch(0)
    wait_for("the resumed backfill to finish", lambda: run_status(second) == DagsterRunStatus.SUCCESS, 240, dev,
             lambda: f"backfill {backfill_state()}, run {run_status(second)}")
    # both runs carry their stream, for the Runs page's filter (pgstream/backfill=1)
    assert {r.run_id for r in instance.get_runs(RunsFilter(job_name=BACKFILL_JOB, tags={BACKFILL_TAG: "1"}))} == {
        first, second}
    with psycopg.connect(app, autocommit=True) as conn:
        verified = conn.execute("select count(*) from public.users where verified").fetchone()
        reads = conn.execute("select count(*), count(distinct payload->'new'->>'id') from pgstream.events "
                             "where payload->>'tg_op' = 'READ'").fetchone()
    assert backfill_state()[0] == "done" and reads is not None and verified is not None
    assert reads[0] == reads[1] == verified[0]  # every verified user once, across the cancel
    _output_kept_for_the_ui(instance, second)


def _output_kept_for_the_ui(instance: dg.DagsterInstance, run_id: str) -> None:
    """The run's stdout and stderr are kept in files (dagster.yaml's FileComputeLogManager), complete once it
    ended, and read back through the compute log manager as the UI's run page reads them."""
    manager = instance.compute_log_manager
    assert isinstance(manager, FileComputeLogManager), manager
    keys = sorted({p.stem for p in Path(manager._base_dir, run_id, "compute_logs").glob("*.err")})
    assert keys, f"no compute log of run {run_id}"
    key = [run_id, "compute_logs", keys[0]]
    assert manager.is_capture_complete(key)
    stderr = manager.get_log_data(key).stderr or b""
    assert b"backfill" in stderr.lower(), stderr[:2000]  # what the run logged (Dagster's console handler: stderr)


TICKS_QUERY = """
query ($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    ... on Sensor { sensorState { ticks(limit: 100) { status timestamp skipReason } } }
  }
}
"""


def test_dagster_dev_killed_whole_recovers_at_the_next_ticks(databases: Databases, hook: Hook, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 of the whole `dg dev` group while the stream's open member run (hosted by the group delivery
    run of group default) holds its delivery lease, then `dg dev` again on the same home: the first ticks of
    the group's sensor see that the session holding the dead group run's lease has ended, mark the run failed
    (well before delivery.run_grace_secs, counted from its start) and request the next group run, which
    delivers what committed meanwhile; nothing lost, commit order kept."""
    app = databases.app_url
    migrate(app)
    with psycopg.connect(app, autocommit=True) as conn:
        conn.execute("create table public.users (id serial primary key, email text)")
    config_path = write_config(
        tmp_path / "pgstream.yaml", app,
        streams=[{"id": 1, "sink": {"type": "http", "url": hook.url, "mode": "per_event"},
                  "batch": {"max_size": 100, "max_fill_secs": 0.2},
                  "sensor": {"interval_secs": 1, "tick_budget_secs": 2},
                  "delivery": {"mode": "open"}}],  # run_grace_secs: the default, 120
        subscriptions=[{"key": "users", "stream_id": 1, "operation": "INSERT", "schema_name": "public",
                        "table_name": "users", "column_names": ["id", "email"]}],
    )
    init(config_path)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(repo_root() / "dagster.yaml", home / "dagster.yaml")
    env = {"PGSTREAM_CONFIG": str(config_path), "DAGSTER_HOME": str(home),
           "DAGSTER_POSTGRES_URL": databases.dagster_url, "PYTHONUNBUFFERED": "1"}
    selector = {"repositoryLocationName": "pgstream", "repositoryName": "__repository__",
                "sensorName": group_sensor_name(DEFAULT_READER)}

    def insert(n: int, start: int) -> None:
        with psycopg.connect(app, autocommit=True) as conn:
            for i in range(start, start + n):
                conn.execute("insert into public.users (email) values (%s)", [f"u{i}@example.com"])

    def lease() -> tuple[Any, ...] | None:
        with psycopg.connect(app, autocommit=True) as c:
            return c.execute("select holder, pgstream.backend_alive(pid, backend_start, usesysid) from pgstream.locks "
                             "where name = 'delivery' and key = 1 and pid is not null").fetchone()

    def sensor_answers(dev: Any) -> bool:
        try:
            answer = dev.graphql(SENSOR_QUERY, {"selector": selector})
        except httpx.HTTPError:
            return False
        return bool(((answer.get("data") or {}).get("sensorOrError") or {}).get("sensorState"))

    def received() -> list[int]:
        return [r.event_id for r in hook.snapshot()]

    first = tmp_path / "first"
    first.mkdir()
    dev = start_dagster_dev(first, env)
    try:
        insert(5, 0)
        wait_for("5 events at the endpoint", lambda: len(received()) >= 5, EVENTS_TIMEOUT_SECS, dev)
        held = lease()
        assert held is not None and held[1], held  # the open member run holds the lease
        dead_run_id, member = str(held[0]).rsplit("/", 1)  # the member run's id: <group run id>/<stream id>
        assert member == "1", held
    finally:
        survivors = stop_process_group(dev.proc, crash=True)  # kill -9 of the whole group
    assert not survivors, survivors
    killed_at = time.monotonic()
    while (held := lease()) is not None and held[1]:  # Postgres sees the dead run's session end
        assert time.monotonic() - killed_at < 30, held
        time.sleep(0.1)
    insert(5, 5)  # committed while `dg dev` is down

    second = tmp_path / "second"
    second.mkdir()
    dev = start_dagster_dev(second, env)
    try:
        wait_for("the code location to answer", lambda: sensor_answers(dev), READY_TIMEOUT_SECS, dev)
        back_at = time.monotonic()
        wait_for("the 5 events committed while down", lambda: len(set(received())) >= 10, 120, dev,
                 lambda: f"received {received()}; lease {lease()}")
        first_delivery_secs = time.monotonic() - back_at  # (polled every 0.5 s)
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        monkeypatch.setenv("DAGSTER_POSTGRES_URL", databases.dagster_url)
        with dg.DagsterInstance.get() as instance:
            record = instance.get_run_record_by_id(dead_run_id)
            assert record is not None and record.dagster_run.status == DagsterRunStatus.FAILURE
            failures = instance.get_records_for_run(dead_run_id, of_type=dg.DagsterEventType.RUN_FAILURE).records
            assert failures, "the dead group run was not marked failed"
            assert record.dagster_run.job_name == GROUP_DELIVERY_JOB
            message = failures[0].event_log_entry.dagster_event.message  # type: ignore[union-attr]
            assert message is not None and "session holding the group's delivery lease has ended" in message, message
            # failed by the lease, not by delivery.run_grace_secs (120 s) counted from its start
            assert record.start_time is not None
            assert failures[0].event_log_entry.timestamp - record.start_time < 120
        ticks = dev.graphql(TICKS_QUERY, {"selector": selector})["data"]["sensorOrError"]["sensorState"]["ticks"]
        reasons = [t["skipReason"] for t in ticks if t["skipReason"]]
        print(f"first delivery {first_delivery_secs:.1f}s after the code location answered; skip reasons: "
              f"{sorted(set(reasons))[:10]}")
        assert first_delivery_secs < 60
        ids = received()
        with psycopg.connect(app, autocommit=True) as c:
            committed = [r[0] for r in c.execute("select id from pgstream.events where stream_id = 1 order by id")]
        assert set(ids) == set(committed) and len(committed) == 10  # nothing lost, nothing extra
        firsts = list(dict.fromkeys(ids))
        assert firsts == committed  # first arrivals in commit order
    finally:
        survivors = stop_process_group(dev.proc)
    assert not survivors, survivors


# --------------------------------------------------------------------------------------------
# the Launchpad, as the UI shows the demo's jobs


def _launchpad_template(job: dg.JobDefinition) -> Any:
    """The YAML the Launchpad opens a job with: the webserver's own function (``rootDefaultYaml``), the fields
    with a default."""
    from dagster._core.snap.snap_to_yaml import default_values_yaml_from_type_snap

    snap = job.get_job_snapshot()
    schema = snap.config_schema_snapshot
    root_key = snap.mode_def_snaps[0].root_config_key
    assert root_key is not None
    root = schema.get_config_snap(root_key)
    return yaml.safe_load(default_values_yaml_from_type_snap(schema, root))


def test_the_jobs_are_the_same_at_any_number_of_streams(tmp_path: Path) -> None:
    """The replay and backfill jobs are one each for the location (the stream in their run config): the
    location's jobs, and what the code server sends of them, do not grow with streams (issue 45)."""
    names = []
    for count in (1, 12):
        cfg = write_config(tmp_path / f"{count}.yaml", "postgresql://demo@127.0.0.1:1/demo",
                           [{"id": i, "sink": {"type": "file", "path": "x"}} for i in range(1, count + 1)])
        names.append({j.name for j in build_definitions(cfg).get_repository_def().get_all_jobs()})
    assert names[0] == names[1] and {REPLAY_JOB, BACKFILL_JOB} <= names[0], names


def test_the_launchpad_templates_show_what_to_type_and_subscription_runs_have_a_job_of_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGSTREAM_DATABASE_URL", "postgresql://demo@127.0.0.1:1/demo")
    repo = build_definitions(repo_root() / "pgstream.yaml").get_repository_def()
    control = repo.get_job(CONTROL_JOB)
    template = _launchpad_template(control)
    assert template == {"ops": {"stream_control": {"config": {
        "stream_id": 0, "action": "pause", "batch_id": 0, "event_ids": [], "reason": "", "dead_letter_ids": [],
        "all_dead_letters": False, "confirm": ""}}}}
    # launched as the template opens, it names what to set, before it connects to anything
    unedited = control.execute_in_process(run_config=template, raise_on_error=False)
    assert not unedited.success
    assert "stream_id: set the stream to act on" in step_failure(unedited)

    # the replay and backfill jobs, one each for the location: they open with the stream and every field to fill
    # in; launched as they open, they name the stream to set and the streams there are
    replay = repo.get_job(REPLAY_JOB)
    template = _launchpad_template(replay)
    assert template["ops"] == {REPLAY_OP: {"config": {
        "stream_id": 0, "from_event_id": 0, "to_event_id": 0, "from_time": "", "to_time": "", "subscription_keys": [],
        "all_events": False, "dry_run": False, "chunk_size": 0, "dead_letters": False, "dead_letter_ids": []}}}
    unedited = replay.execute_in_process(run_config={"ops": template["ops"]}, raise_on_error=False)
    assert not unedited.success
    assert ("stream_id: set the stream to replay (the template's 0 is none); the streams of this code location: 1"
            in step_failure(unedited))
    backfill = repo.get_job(BACKFILL_JOB)
    template = _launchpad_template(backfill)
    assert template["ops"] == {BACKFILL_OP: {"config": {
        "stream_id": 0, "subscriptions": [], "table": "", "where": "", "from_key": [], "to_key": [],
        "chunk_size": 1000, "parallelism": 4, "max_rows_per_sec": 5000.0, "max_backlog": 20_000, "restart": False,
        "progress_secs": 5.0}}}
    unedited = backfill.execute_in_process(run_config={"ops": template["ops"]}, raise_on_error=False)
    assert not unedited.success and "stream_id: set the stream to backfill" in step_failure(unedited)
    # the stream chosen, it names the subscription keys to fill in
    chosen = {BACKFILL_OP: {"config": {**template["ops"][BACKFILL_OP]["config"], "stream_id": 1}}}
    unedited = backfill.execute_in_process(run_config={"ops": chosen}, raise_on_error=False)
    assert not unedited.success and "name at least one subscription key" in step_failure(unedited)

    # the subscriptions' runs are of a job named for them (not Dagster's __ASSET_JOB), the one the sensor requests
    sensor = repo.get_sensor_def(SUBSCRIPTIONS_SENSOR)
    assert sensor.job_name == SUBSCRIPTIONS_JOB
    subscriptions = repo.get_job(SUBSCRIPTIONS_JOB)
    assert {k.path[-1] for k in subscriptions.asset_layer.selected_asset_keys} == {
        "user_signup_insert_demo_users", "user_email_changed_update_demo_users", "subscription_set"}
    assert sensor.description is not None and "checks them as the runtime role" in sensor.description


def test_a_database_the_sensors_cannot_reach_is_one_line_per_tick_logged_once(
        tmp_path: Path, instance: dg.DagsterInstance, capfd: pytest.CaptureFixture[str]) -> None:
    """A wrong database_url (nothing listens there): the location loads (nothing connects at load), and each
    tick of the default group's sensor (stream 1 names no reader) and of a named reader group's sensor is skipped
    with one line naming the URL's role and host (never its password) and why, logged as an error: no
    SensorExecutionError, no stack trace."""
    url = f"postgresql://app:s3cret@127.0.0.1:{free_port()}/nowhere"
    config = write_config(tmp_path / "pgstream.yaml", url, [
        {"id": 1, "sink": {"type": "memory", "name": "m1"}},
        {"id": 2, "reader": "pair", "sink": {"type": "memory", "name": "m2"}},
        {"id": 3, "reader": "pair", "sink": {"type": "memory", "name": "m3"}}])
    defs = build_definitions(config)
    port = url.split(":")[-1].split("/")[0]
    for name in (group_sensor_name(DEFAULT_READER), group_sensor_name("pair")):
        sensor = defs.resolve_sensor_def(name)
        ctx = dg.build_sensor_context(instance=instance, sensor_name=name,
                                      resources={"pgstream": (defs.resources or {})["pgstream"]})
        capfd.readouterr()
        result = sensor.evaluate_tick(ctx)
        assert not result.run_requests
        message = result.skip_message or ""
        assert message.startswith(f"cannot connect to the database (role app at 127.0.0.1:{port}/nowhere, from "
                                  "database_url): connection failed: "), message
        assert "\n" not in message and "s3cret" not in message
        err = capfd.readouterr().err
        assert f" - ERROR - {message}" in err and "Traceback" not in err and "s3cret" not in err
        # the next tick (the cursor carried, as the daemon does) says it again in its skip reason, and logs it no
        # more: a long outage is one line in the log, not one a tick
        again = sensor.evaluate_tick(dg.build_sensor_context(
            instance=instance, sensor_name=name, cursor=result.cursor,
            resources={"pgstream": (defs.resources or {})["pgstream"]}))
        assert again.skip_message == message
        assert message not in capfd.readouterr().err
