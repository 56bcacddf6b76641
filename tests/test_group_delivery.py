"""A reader group's delivery run (``pgstream_group_delivery``) end to end through `dg dev`, as a user runs
it: the daemon ticks the sensors, the queued run coordinator (``max_concurrent_runs`` 2 here, fewer than
the streams) launches the runs as processes. Twelve streams of one group (more than Postgres' default 10
slots, more than the instance's runs) are delivered by one group run hosting a delivery run per stream in
threads. A member's trouble never holds the others back: one whose sink refuses goes to failover and recovers
once its sink answers, one whose sink hangs in a call delays no one else's deliveries, one whose receiver
rejects an event for good sets it aside and goes on; kill -9 of the group run's process loses nothing and the
run is replaced."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
import yaml

from pgstream_dagster.config import load_config, streams_fingerprint
from pgstream_dagster.defs.names import DELIVERY_JOB, GROUP_DELIVERY_JOB, GROUP_TAG
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.ledger import locks
from pgstream_dagster.engine.migrations import migrate

from .support.dagster_dev import (
    READY_TIMEOUT_SECS,
    Databases,
    descendants,
    repo_root,
    start_dagster_dev,
    stop_process_group,
    wait_for,
)
from .support.endpoint import Endpoint
from .support.harness import group_tag_of, insert_events, read_jsonl, write_config

GROUP = "all"
IDS = list(range(1, 13))
FAILING = 12  # its sink is an HTTP endpoint that answers 500 until the test lets it through
HANGING = 11  # its sink's calls hang until the test lets them through
POISON = 10  # its receiver rejects (422) the events marked "poison" for good: each becomes a dead letter
MAX_RUNS = 2


def _sent(url: str, stream_id: int) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select id from pgstream.events where stream_id = %s order by id",
                                        [stream_id])]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stdout(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def _run_worker(root: int, run_id: str) -> int:
    """The process of run ``run_id`` among ``root``'s descendants: the one whose stdout is the run's compute log
    file (``<home>/storage/<run id>/compute_logs/*.out``: dagster.yaml's ``FileComputeLogManager``)."""
    (worker,) = {pid for pid in descendants(root) if f"/storage/{run_id}/compute_logs/" in _stdout(pid)}
    assert "python" in _cmdline(worker) and worker != root, _cmdline(worker)
    return worker


def _dev_env(config_path: Path, databases: Databases, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             max_concurrent_runs: int | None = None) -> dict[str, str]:
    """``init`` of ``config_path``, a Dagster home with the repository's dagster.yaml (its run queue's
    ``max_concurrent_runs`` set, when given), and the environment of `dg dev` (this process's too: the test
    reads the instance)."""
    print("\n" + "\n".join(init(config_path)))
    home = tmp_path / "dagster_home"
    home.mkdir()
    instance_yaml = yaml.safe_load((repo_root() / "dagster.yaml").read_text())
    if max_concurrent_runs is not None:
        instance_yaml["run_coordinator"]["config"]["max_concurrent_runs"] = max_concurrent_runs
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance_yaml))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("DAGSTER_POSTGRES_URL", databases.dagster_url)
    return {"PGSTREAM_CONFIG": str(config_path), "DAGSTER_HOME": str(home),
            "DAGSTER_POSTGRES_URL": databases.dagster_url, "PYTHONUNBUFFERED": "1"}


def _group_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """The instance's group delivery runs, newest first."""
    return list(instance.get_runs(dg.RunsFilter(job_name=GROUP_DELIVERY_JOB)))


def _group_state(instance: dg.DagsterInstance, app: str, ids: list[int],
                 delivered: Callable[[int], list[int]]) -> str:
    """What a test waited on in vain: each stream's delivered and sent events, and the group runs (stop tags)."""
    return (f"delivered/sent {[(len(delivered(i)), len(_sent(app, i))) for i in ids]}; group runs "
            f"{[(r.run_id[:8], r.status.value, r.tags.get('pgstream/stop')) for r in _group_runs(instance)]}")


def _all_at_least(delivered: Callable[[int], list[int]], ids: list[int], n: int) -> Callable[[], bool]:
    return lambda: all(len(delivered(i)) >= n for i in ids)


def test_a_group_delivery_run_hosts_twelve_streams_isolates_refusing_hanging_and_rejecting_sinks_and_survives_kill_9(
        databases: Databases, endpoint: Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = databases.app_url
    migrate(app)
    endpoint.mode = "error"
    hanging, poison = Endpoint(), Endpoint()
    release = threading.Event()

    def hang(_request: int) -> None:  # every call waits until the test lets it through
        release.wait(120)

    hanging.hook = hang
    poison.reject_marker = b'"poison"'
    sinks: dict[int, dict[str, Any]] = {FAILING: endpoint.sink(), HANGING: hanging.sink(),
                                        POISON: poison.sink("per_event")}
    streams = [{"id": i, "reader": GROUP, "batch": {"max_size": 100, "max_fill_secs": 0.2},
                "sensor": {"interval_secs": 1, "tick_budget_secs": 2},
                "retry": {"initial_backoff_secs": 1, "max_backoff_secs": 2},
                "delivery": {"mode": "open", "tuning": {"max_run_secs": 600},
                             **({"on_reject": "dead_letter", "max_attempts": 1} if i == POISON else {})},
                "sink": sinks.get(i) or {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}}
               for i in IDS]
    config_path = write_config(tmp_path / "pgstream.yaml", app, streams)
    env = _dev_env(config_path, databases, tmp_path, monkeypatch, max_concurrent_runs=MAX_RUNS)  # fewer than streams

    def delivered(i: int) -> list[int]:
        if i in (FAILING, HANGING, POISON):
            return {FAILING: endpoint, HANGING: hanging, POISON: poison}[i].first_seen_order()
        path = tmp_path / f"out{i}.jsonl"
        return [e["id"] for e in read_jsonl(path)] if path.exists() else []

    def counts() -> str:
        return str({i: (len(delivered(i)), len(_sent(app, i))) for i in IDS})

    started = time.monotonic()
    dev = start_dagster_dev(tmp_path, env)
    try:
        with dg.DagsterInstance.get() as instance:
            def runs(job: str, *statuses: dg.DagsterRunStatus) -> list[dg.DagsterRun]:
                return list(instance.get_runs(dg.RunsFilter(job_name=job, statuses=list(statuses) or None)))

            def state() -> str:
                return (f"delivered/sent {counts()}; endpoint refused {endpoint.refused_answers}; runs "
                        f"{[(r.job_name, r.status.value, r.tags.get(GROUP_TAG)) for r in instance.get_runs()]}")

            # 1. a first wave on every stream: the healthy ones arrive, each event once, in commit order, while
            # stream 12's sink refuses (its member run fails, the stream goes to failover), stream 11's sink hangs
            # in its first call and stream 10's receiver rejects its poison events: none holds the others back
            for i in IDS:
                insert_events(app, i, 20)
            with psycopg.connect(app) as c:
                poisoned = [r[0] for r in c.execute(
                    "insert into pgstream.events (payload, stream_id) select jsonb_build_object('kind', 'poison', "
                    "'n', g), %s from generate_series(1, 3) g returning id", [POISON])]
            insert_events(app, POISON, 5, start=100)
            others = [i for i in IDS if i not in (FAILING, HANGING)]
            wait_for("the first wave on the healthy streams and stream 10's events around its poison",
                     lambda: all(len(delivered(i)) >= 20 for i in others) and len(delivered(POISON)) >= 25,
                     READY_TIMEOUT_SECS, dev, state)
            assert hanging.requests >= 1 and not hanging.accepted  # stream 11's call still hangs meanwhile
            assert sorted(set(poison.rejected)) == poisoned and not set(poisoned) & set(delivered(POISON))
            with psycopg.connect(app) as c:
                assert sorted(r[0] for r in c.execute("select event_id from pgstream.dead_letters where stream_id "
                                                      "= %s", [POISON])) == poisoned
            first_wave = time.monotonic()
            with psycopg.connect(app) as c:
                wait_for("stream 12 in failover", lambda: c.execute(
                    "select state from pgstream.stream_status where id = %s", [FAILING]).fetchone() == ("failover",),
                    60, dev, state)
            assert endpoint.refused_answers > 0 and not endpoint.unique()
            for wave in range(1, 3):  # the failing member's retries and the hanging call hold no one back
                for i in others:
                    insert_events(app, i, 10, start=100 * (wave + 1))
                wait_for(f"wave {wave} on the healthy streams",
                         _all_at_least(delivered, others, 20 + 10 * wave), 60, dev, state)
            assert not hanging.accepted and not release.is_set()
            release.set()  # stream 11's sink answers: what it held is delivered
            wait_for("stream 11 once its sink answers", lambda: hanging.unique() == set(_sent(app, HANGING)), 60,
                     dev, state)
            # one group delivery run, no run per stream: one of the instance's 2 run slots for 12 streams
            (group_run,) = runs(GROUP_DELIVERY_JOB)
            assert group_run.status == dg.DagsterRunStatus.STARTED
            assert group_run.tags[GROUP_TAG] == group_tag_of(app, GROUP)
            assert not runs(DELIVERY_JOB)

            # 2. the sink comes back: stream 12 recovers (failover probe, then its open run), the rest follows
            endpoint.mode = "ok"
            wait_for("stream 12 to recover", lambda: endpoint.unique() == set(_sent(app, FAILING)), 60, dev, state)
            recovered = time.monotonic()

            # 3. kill -9 of the group run's process, with a wave committed right after it: the group's sensor
            # sees its lease lost and replaces the run, which takes its members back
            (group_run,) = runs(GROUP_DELIVERY_JOB, dg.DagsterRunStatus.STARTED)
            worker = _run_worker(dev.proc.pid, group_run.run_id)
            # its output in files only (the UI reads them), no process copying it back (tail -F, watchers)
            helpers = [_cmdline(pid) for pid in descendants(dev.proc.pid)
                       if "tail -F" in _cmdline(pid) or "watch_orphans" in _cmdline(pid)]
            assert not helpers, helpers
            print("killing", worker, _cmdline(worker)[:200])
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            for i in IDS:
                insert_events(app, i, 15, start=1000)
            wait_for("every event of every stream after the kill", lambda: all(
                set(delivered(i)) == set(_sent(app, i)) - set(poisoned if i == POISON else []) for i in IDS), 120,
                dev, state)
            replaced = time.monotonic()
            print(state())
            dead = instance.get_run_by_id(group_run.run_id)
            assert dead is not None and dead.status == dg.DagsterRunStatus.FAILURE
            assert [r.status for r in runs(GROUP_DELIVERY_JOB)].count(dg.DagsterRunStatus.STARTED) == 1
            assert not runs(DELIVERY_JOB)
            for i in IDS:
                sent = [e for e in _sent(app, i) if i != POISON or e not in poisoned]
                if i in (FAILING, HANGING, POISON):  # an HTTP sink: at least once; first deliveries in commit order
                    assert delivered(i) == sent, i
                else:  # nothing was in flight when the process died: each event once, in commit order
                    assert delivered(i) == sent, i
                assert all(a < b for a, b in itertools.pairwise(delivered(i)))
            print(json.dumps({"first_wave_secs": round(first_wave - started, 1),
                              "recovery_secs": round(recovered - first_wave, 1),
                              "after_kill_secs": round(replaced - killed, 1)}))
    finally:
        release.set()
        survivors = stop_process_group(dev.proc)
        hanging.down()
        poison.down()
    assert not survivors, f"processes of `dg dev` survived SIGKILL: {survivors}"
    # 4. the shutdown (SIGTERM to `dg dev`'s processes, as `make stop`) ends the live group run, not fails it
    with dg.DagsterInstance.get() as instance:
        last = instance.get_runs(dg.RunsFilter(job_name=GROUP_DELIVERY_JOB), limit=1)[0]
        assert last.status == dg.DagsterRunStatus.SUCCESS, last.status
        said = [e.user_message for e in instance.all_logs(last.run_id)]
        assert any("group delivery run ended (interrupted (shutdown)" in m for m in said), said[-5:]


RELOAD = """
mutation ($name: String!) {
  reloadRepositoryLocation(repositoryLocationName: $name) {
    __typename
    ... on WorkspaceLocationEntry { locationOrLoadError { __typename } }
  }
}
"""


def test_a_stream_added_to_a_group_reaches_its_sink_within_seconds_of_a_code_location_reload(
        databases: Databases, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `dg dev`: streams 1..3 of group ``grows`` are delivered by its group run (max_run_secs 600);
    pgstream.yaml gains stream 4 in the group and the code location is reloaded (as an operator does): the group's
    sensor registers stream 4 and requests a group run of the new configuration; once that one has started and
    waits for the group's lease, the live run is asked to end (tag pgstream/stop) and ends gracefully (success): a
    hand-over, the new run up before the old one ended. Every event of the four streams, written before, during and
    after, reaches its file once, in commit order."""
    app = databases.app_url
    migrate(app)

    def stream(i: int) -> dict[str, Any]:
        return {"id": i, "reader": "grows", "batch": {"max_size": 100, "max_fill_secs": 0.2},
                "sensor": {"interval_secs": 1, "tick_budget_secs": 2},
                "delivery": {"mode": "open", "tuning": {"max_run_secs": 600}},
                "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}}

    config_path = write_config(tmp_path / "pgstream.yaml", app, [stream(i) for i in (1, 2, 3)])
    env = _dev_env(config_path, databases, tmp_path, monkeypatch)

    def delivered(i: int) -> list[int]:
        return [e["id"] for e in read_jsonl(tmp_path / f"out{i}.jsonl")]

    dev = start_dagster_dev(tmp_path, env)
    try:
        with dg.DagsterInstance.get() as instance:
            def group_runs() -> list[dg.DagsterRun]:
                return _group_runs(instance)

            def state() -> str:
                return _group_state(instance, app, [1, 2, 3, 4], delivered)

            for i in (1, 2, 3):
                insert_events(app, i, 20)
            wait_for("the first wave", _all_at_least(delivered, [1, 2, 3], 20), READY_TIMEOUT_SECS, dev, state)
            (old,) = group_runs()
            assert old.status == dg.DagsterRunStatus.STARTED
            for i in (1, 2, 3):  # written before the reload
                insert_events(app, i, 10, start=100)

            write_config(config_path, app, [stream(i) for i in (1, 2, 3, 4)])
            answer = dev.graphql(RELOAD, {"name": "pgstream"})
            assert answer["data"]["reloadRepositoryLocation"]["__typename"] == "WorkspaceLocationEntry", answer
            reloaded = time.monotonic()
            with psycopg.connect(app) as c:
                wait_for("stream 4 registered", lambda: c.execute(
                    "select reader_group from pgstream.streams where id = 4").fetchone() == ("grows",), 30, dev, state)
            for i in (1, 2, 3, 4):  # written while the old run ends
                insert_events(app, i, 10, start=200)

            def ended() -> bool:
                run = instance.get_run_by_id(old.run_id)
                return run is not None and run.status not in (dg.DagsterRunStatus.STARTED,
                                                              dg.DagsterRunStatus.STARTING)
            wait_for("the old group run to end", ended, 60, dev, state)
            ended_secs = time.monotonic() - reloaded
            finished = instance.get_run_by_id(old.run_id)
            assert finished is not None and finished.status == dg.DagsterRunStatus.SUCCESS, state()
            new = group_runs()[0]
            assert finished.tags["pgstream/stop"] == (f"its successor {new.run_id} is up (the configuration of its "
                                                      f"streams changed)"), state()
            old_record, new_record = (instance.get_run_record_by_id(r.run_id) for r in (old, new))
            assert old_record and new_record and old_record.end_time and new_record.start_time
            assert new_record.start_time < old_record.end_time, state()  # up before the old one ended
            for i in (1, 2, 3, 4):  # written to the new run
                insert_events(app, i, 10, start=300)
            wait_for("every event of the four streams",
                     lambda: all(len(delivered(i)) >= len(_sent(app, i)) for i in (1, 2, 3, 4)), 120, dev, state)
            for i in (1, 2, 3, 4):
                assert delivered(i) == _sent(app, i), i  # once each, in commit order
            runs = group_runs()
            assert len(runs) == 2 and runs[0].status == dg.DagsterRunStatus.STARTED, state()
            assert "pgstream/stop" not in runs[0].tags
            # the new run is of the reloaded configuration (the four streams)
            assert runs[0].tags["pgstream/config"] == streams_fingerprint(load_config(config_path).streams)
            assert runs[0].tags["pgstream/config"] != old.tags["pgstream/config"]
            print(json.dumps({"old_run_ended_secs": round(ended_secs, 1),
                              "all_delivered_secs": round(time.monotonic() - reloaded, 1)}))
    finally:
        survivors = stop_process_group(dev.proc)
    assert not survivors, f"processes of `dg dev` survived SIGKILL: {survivors}"


def test_a_group_run_is_taken_over_by_a_successor_started_before_its_max_run_secs(
        databases: Databases, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `dg dev`: three streams of group ``relay`` with max_run_secs 40 (the hand-over's lead: 20 s), an
    event on each every 0.1 s. The group's sensor requests the group run's successor 20 s before its
    end; the successor starts while the run delivers and waits for the group's lease; once it waits, the run is
    asked to end (tag pgstream/stop), ends gracefully, and the successor takes over: the run ended after its
    successor had started (no member waits for a process to start). Then kill -9 of the next successor as it
    waits: it alone is marked failed, and a group run goes on (the run it was to succeed is handed over to the
    next successor, or ends at its max_run_secs should that one not be up by then). Every event reaches its file
    once, in commit order."""
    app = databases.app_url
    migrate(app)
    ids = [1, 2, 3]
    config_path = write_config(tmp_path / "pgstream.yaml", app, [
        {"id": i, "reader": "relay", "batch": {"max_size": 100, "max_fill_secs": 0.05},
         "sensor": {"interval_secs": 1, "tick_budget_secs": 2},
         "delivery": {"mode": "open", "tuning": {"max_run_secs": 40}},
         "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in ids])
    env = _dev_env(config_path, databases, tmp_path, monkeypatch)

    def delivered(i: int) -> list[int]:
        path = tmp_path / f"out{i}.jsonl"
        return [e["id"] for e in read_jsonl(path)] if path.exists() else []

    committed: dict[int, float] = {}  # event id: when its commit returned
    seen: dict[int, float] = {}  # event id: when the test first saw it in its file
    stop = threading.Event()

    def write() -> None:
        with psycopg.connect(app, autocommit=True) as c:
            while not stop.wait(0.1):
                for i in ids:
                    (event_id,) = c.execute("insert into pgstream.events (payload, stream_id) values ('{}', %s) "
                                            "returning id", [i]).fetchone()  # type: ignore[misc]
                    committed[event_id] = time.monotonic()

    def look() -> None:
        now = time.monotonic()
        for i in ids:
            for event_id in delivered(i):
                seen.setdefault(event_id, now)

    dev = start_dagster_dev(tmp_path, env)
    writer = threading.Thread(target=write, daemon=True)
    try:
        with dg.DagsterInstance.get() as instance:
            def group_runs() -> list[dg.DagsterRun]:
                return _group_runs(instance)

            def state() -> str:
                return _group_state(instance, app, ids, delivered)

            insert_events(app, 1, 1)
            wait_for("the group run", lambda: len(delivered(1)) == 1, READY_TIMEOUT_SECS, dev, state)
            writer.start()

            def watch(what: str, done: Callable[[], bool], timeout: float = 60) -> None:
                deadline = time.monotonic() + timeout
                while not done():
                    assert time.monotonic() < deadline, f"timed out waiting for {what}: {state()}"
                    look()
                    time.sleep(0.05)

            def ended(status: dg.DagsterRunStatus) -> list[dg.DagsterRun]:
                return [r for r in group_runs() if r.status == status]

            def successor_of(run: dg.DagsterRun) -> str:
                return run.tags.get("pgstream/stop", "").removeprefix("its successor ").split(" ")[0]

            # kill -9 of the next successor as it waits for the lease: the sensor sees its wait lost at once and
            # marks it failed; the run it was to succeed goes on (or, already asked to end, a fresh one is started)
            with psycopg.connect(app, autocommit=True) as c:
                def lease(run_id: str) -> locks.LeaseState:
                    return locks.group_lease_state(c, "relay", run_id)

                watch("the first hand-over", lambda: any(lease(successor_of(r)) is locks.LeaseState.HELD
                                                         for r in ended(dg.DagsterRunStatus.SUCCESS)))

                def waiting() -> tuple[str, str] | None:
                    """The successor waiting for the lease and the run holding it."""
                    newest, holder = group_runs()[:2]
                    return (newest.run_id, holder.run_id) if lease(newest.run_id) is locks.LeaseState.WAITING \
                        and lease(holder.run_id) is locks.LeaseState.HELD else None
                watch("a successor waiting", lambda: waiting() is not None)
                pair = waiting()
                assert pair is not None
                killed, orphaned = pair
                os.kill(_run_worker(dev.proc.pid, killed), signal.SIGKILL)
            watch("the killed successor marked failed", lambda: [r.run_id for r in ended(
                dg.DagsterRunStatus.FAILURE)] == [killed], 30)
            watch("a group run after it", lambda: group_runs()[0].run_id != killed
                  and group_runs()[0].status == dg.DagsterRunStatus.STARTED)
            time.sleep(2)
            stop.set()
            writer.join(10)
            watch("every event", lambda: all(len(delivered(i)) >= len(_sent(app, i)) for i in ids))
            look()
            for i in ids:
                assert delivered(i) == _sent(app, i), i  # once each, in commit order
            runs = group_runs()  # newest first
            assert [r.run_id for r in runs if r.status == dg.DagsterRunStatus.FAILURE] == [killed], state()
            records = {r.dagster_run.run_id: r for r in instance.get_run_records(
                dg.RunsFilter(job_name=GROUP_DELIVERY_JOB))}
            handed = [r for r in runs if r.status == dg.DagsterRunStatus.SUCCESS]
            assert handed, state()
            checked = 0
            for run in handed:  # each ended after its successor had started
                if run.run_id == orphaned:  # (asked to end for the one killed, or ended at its max_run_secs before
                    continue  # the next was up, or handed over to the next: each as the product does)
                successor = successor_of(run)
                checked += 1
                assert successor in records and successor != killed, state()
                started, end = records[successor].start_time, records[run.run_id].end_time
                assert started is not None and end is not None and started < end, state()
            assert checked >= 1, state()
            latencies = sorted(seen[e] - committed[e] for e in committed if e in seen)
            print(json.dumps({"group_runs": len(runs), "events": len(latencies),
                              "p99_secs": round(latencies[int(len(latencies) * 0.99)], 3),
                              "max_secs": round(latencies[-1], 3)}))
    finally:
        stop.set()
        survivors = stop_process_group(dev.proc)
    assert not survivors, f"processes of `dg dev` survived SIGKILL: {survivors}"


def test_preflight_counts_a_group_run_once_and_a_groups_pool_once(db_url: str, tmp_path: Path) -> None:
    """The limits a group delivery run leaves: one of ``max_concurrent_runs`` for the whole group (streams
    without ``reader:`` are the group ``default``'s: one run for all of them too; a line only once the groups'
    runs and one more do not fit), and its members' pool of connections (at most ``POOL_SIZE`` working at
    once) whatever the group's size: a group of more streams than ``max_connections`` fits; the server's
    line names the setting and the value to set once the groups do not."""
    from pgstream_dagster.config import load_config
    from pgstream_dagster.engine import limits
    from pgstream_dagster.engine.ledger.locks import POOL_SIZE

    with psycopg.connect(db_url) as c:
        server = limits.server_limits(c)
    usable = server.max_connections - server.reserved_connections
    members = usable + 1  # more streams than connections: the group's pool serves them
    streams = [{"id": i, "reader": "big", "delivery": {"mode": "open"},
                "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in range(1, members + 1)]
    streams += [{"id": 1000 + i, "delivery": {"mode": "open"},
                 "sink": {"type": "file", "path": str(tmp_path / f"own{i}.jsonl")}} for i in (1, 2)]
    config = load_config(write_config(tmp_path / "pgstream.yaml", db_url, streams))
    # group big's run + group default's run (the 2 streams without a reader) + 1: fits in 3 whatever the
    # groups' sizes, not in 2
    assert limits.run_problem(3, config.streams, "dagster.yaml") is None
    assert limits.run_problem(2, config.streams, "dagster.yaml") == (
        "max_concurrent_runs is 2 and 2 reader groups keep a group delivery run, plus one for housekeeping, checks "
        "and replays: a stream without a run waits up to delivery.tuning.max_run_secs: set max_concurrent_runs = 8 "
        "under run_coordinator.config (or concurrency.runs) in dagster.yaml")
    with psycopg.connect(db_url) as c:
        assert [p for p in limits.postgres_problems(c, config.streams) if "max_connections" in p] == []
    # as many groups of 2 as make the connections too many: each needs its pool (2: as many as its streams),
    # its sensor, run, lease, reader and its members' lease session; housekeeping 4
    groups = usable // 7 + 1
    streams = [{"id": i, "reader": f"g{(i - 1) // 2}", "delivery": {"mode": "open"},
                "sink": {"type": "file", "path": str(tmp_path / f"out{i}.jsonl")}} for i in range(1, 2 * groups + 1)]
    config = load_config(write_config(tmp_path / "pgstream.yaml", db_url, streams))
    with psycopg.connect(db_url) as c:
        (line,) = [p for p in limits.postgres_problems(c, config.streams) if "max_connections" in p]
    needed = groups * (2 + 5) + 4
    suggest = max(8, -(-(needed + server.reserved_connections) // 8) * 8)
    assert line == (
        f"max_connections is {server.max_connections} ({usable} usable by the streams); {2 * groups} streams in "
        f"{groups} reader group(s) need up to {needed} (a connection per stream delivering at once, {POOL_SIZE} at "
        f"most per group, the groups' sensors, readers and leases, housekeeping): set max_connections = {suggest} "
        f"in postgresql.conf and restart Postgres")
