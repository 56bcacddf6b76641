"""Drives a stream the way the daemon does, in-process: evaluate the sensor tick, execute every
run it requests against the real Dagster instance, repeat."""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import yaml

from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import (
    DELIVERY_JOB,
    GROUP_DELIVERY_JOB,
    GROUP_TAG,
    REPLAY_JOB,
    REPLAY_OP,
    STOP_TAG,
    group_tag,
    stream_tag,
)
from pgstream_dagster.defs.sensors import LIVE
from pgstream_dagster.engine.dbconn import url_database
from pgstream_dagster.engine.ledger import streams as ledger_streams
from pgstream_dagster.sinks.memory import MemorySink


def _no_logging_reconfiguration_per_run() -> None:
    """Dagster calls ``logging.config.dictConfig`` each time it builds a run's or step's log manager (to read
    the handlers of ``python_logs`` in dagster.yaml, even when there are none), and ``dictConfig`` closes
    every handler of the process while it holds logging's module lock. The tests run several runs in
    threads of one process (in-process runs, sensors, replays): a thread inside a handler (writing a
    Dagster event to the event log, whose SQLAlchemy logger then waits for the module lock) and a run
    starting in another thread deadlock (cpython#96727). A run worker in production hosts one run, so it
    does not happen there. With no handlers configured, skip the reconfiguration (what it returns is
    the same: no handlers). Applied when this module is imported: by the test process (conftest) and by every
    child process that hosts runs in threads (tests/support/*_child.py, through :class:`Driver`)."""
    original = dg.DagsterInstance.get_yaml_python_handlers

    def yaml_python_handlers(self: dg.DagsterInstance) -> list:  # type: ignore[type-arg]
        if not self.get_python_log_dagster_handler_config():
            return []
        return list(original(self))

    dg.DagsterInstance.get_yaml_python_handlers = yaml_python_handlers  # type: ignore[method-assign,assignment]


_no_logging_reconfiguration_per_run()


def write_config(path: Path, database_url: str, streams: list[dict[str, Any]],
                 subscriptions: list[dict[str, Any]] | None = None, spark: dict[str, Any] | None = None) -> Path:
    """``streams`` as in pgstream.yaml; a stream that says nothing of its mode gets the product's default
    (``delivery.mode: open``) with a short ``max_run_secs`` (:data:`HARNESS_MAX_RUN_SECS`)."""
    streams = [{**s, "delivery": _product_default_unless_said(s.get("delivery", {}))} for s in streams]
    path.write_text(yaml.safe_dump({"database_url": database_url, "streams": streams,
                                    "subscriptions": subscriptions or [],
                                    "spark": spark or {"master": "local[2]"}}))
    return path


#: how long an open run takes new batches in the tests (``delivery.tuning.max_run_secs``; the product's 1800 s):
#: the group delivery run ends after it and the sensor requests a fresh one, as the product does, only sooner
HARNESS_MAX_RUN_SECS = 2.0


def _product_default_unless_said(delivery: dict[str, Any]) -> dict[str, Any]:
    """A stream's ``delivery`` with the product's default mode (open: the stream always has a run open, hosted
    by its group's delivery run) and a short ``max_run_secs``, unless it names its mode or ``max_run_secs``."""
    tuning = delivery.get("tuning", {})
    if "mode" in delivery or "max_run_secs" in tuning:
        return delivery
    return {**delivery, "tuning": {"max_run_secs": HARNESS_MAX_RUN_SECS, **tuning}}


def replay_through_spark(config: Path, stream_id: int, instance: dg.DagsterInstance) -> tuple[bool, list[int]]:
    """Replay every event of ``stream_id`` with ``config`` (its Spark settings), its sink replaced by a
    memory sink and ``delivery.tuning.direct_max_events`` by 0: a file sink takes JSON lines rendered by
    Postgres, and other sinks' replays read without Spark unless it is 0. Whether
    the run succeeded, and the ids the sink got, in order."""
    data = yaml.safe_load(config.read_text())
    name = f"replay-{stream_id}"
    for stream in data["streams"]:
        if stream["id"] == stream_id:
            stream["sink"] = {"type": "memory", "name": name}
            delivery = stream.get("delivery", {})
            stream["delivery"] = {**delivery, "tuning": {**delivery.get("tuning", {}), "direct_max_events": 0}}
    other = config.with_name(f"{config.stem}-replay{config.suffix}")
    other.write_text(yaml.safe_dump(data))
    MemorySink.reset(name)
    result = build_definitions(other).resolve_job_def(REPLAY_JOB).execute_in_process(
        run_config={"ops": {REPLAY_OP: {"config": {"stream_id": stream_id, "all_events": True}}}}, instance=instance,
        raise_on_error=False)
    return result.success, [e.id for e in MemorySink.delivered(name)]


def insert_events(url: str, stream_id: int, n: int, start: int = 0) -> None:
    with psycopg.connect(url) as conn:
        conn.execute("insert into pgstream.events (payload, stream_id) "
                     "select jsonb_build_object('n', g), %s from generate_series(%s::int, %s::int) g",
                     [stream_id, start, start + n - 1])


def slot_of(url: str, stream_id: int) -> str:
    """The replication slot stream ``stream_id`` is read from in that database: its reader group's, once it is
    a member; else its own (or the one it would read, created now: the database derives its default name,
    ``pgstream.default_slot_name``, unique in the cluster)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("select g.slot from pgstream.streams s join pgstream.reader_groups g "
                           "on g.name = s.reader_group where s.id = %s", [stream_id]).fetchone()
        return str(row[0]) if row else ledger_streams.stream_slot(conn, stream_id)


def group_tag_of(url: str, group: str) -> str:
    """The value of the tag pgstream/group of the delivery runs of reader group ``group`` of the database at
    ``url`` (the tests share one Dagster instance's storage: each test's database has its own groups' runs)."""
    return group_tag(group, url_database(url))


def stream_tag_of(url: str, stream_id: int) -> str:
    """The value of the tag pgstream/stream of the runs of stream ``stream_id`` of the database at ``url``."""
    return stream_tag(stream_id, url_database(url))


def joined(url: str, stream_id: int) -> bool:
    """The stream has joined its reader group: the group's slot exists and the group's reader reads it."""
    with psycopg.connect(url) as conn:
        row = conn.execute("select s.slot_reader = 'group:' || s.reader_group and s.join_lsn is null "
                           "and exists (select 1 from pg_replication_slots r where r.slot_name = g.slot) "
                           "from pgstream.streams s join pgstream.reader_groups g on g.name = s.reader_group "
                           "where s.id = %s", [stream_id]).fetchone()
    return bool(row and row[0])


def event_ids(url: str, stream_id: int) -> list[int]:
    """The ids of the stream's events in ``pgstream.events``, in id order (the database chooses ids:
    a manual insert's id is not the next integer, see ``pgstream._check_event``)."""
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("select id from pgstream.events where stream_id = %s order by id",
                                           [stream_id])]


def backdated(conn: psycopg.Connection, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run ``query`` (an insert of events with a chosen ``created_at`` or ``id``) the only way the
    database allows it: as a superuser with triggers off (``session_replication_role = replica``
    skips ``pgstream._check_event``) for one transaction. Tests use it to simulate a calendar or a
    hostile superuser; returns the rows of a ``returning`` clause."""
    with conn.transaction():
        conn.execute("set local session_replication_role = replica")
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    # lines end in "\n" only: str.splitlines() would also split inside a payload holding U+2028. What follows
    # the last "\n" is a line being written (the file sink appends each with its "\n"), read when it is whole
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n")[:-1] if line]


@dataclass(frozen=True)
class Tick:
    """What one sensor evaluation returned (Dagster's ``SensorExecutionData``), typed for the tests."""

    run_requests: list[dg.RunRequest]
    skip_message: str | None
    cursor: str | None
    asset_events: Sequence[dg.AssetMaterialization | dg.AssetObservation | dg.AssetCheckEvaluation]


class Driver:
    """Drives streams as Dagster's daemon does, in-process: :meth:`tick` evaluates the sensor of the stream's
    reader group (every stream has one: ``default`` unless it names another); the group delivery run it requests
    is launched at once in a thread of the test (:class:`Background`, one live run per group, as the tag
    pgstream/group allows), the runs of a stream in mode per_batch are returned for the test to execute
    (:meth:`execute`). :meth:`close` (after every test: ``tests/conftest.py``) asks the live group runs to end and
    waits for them."""

    #: every driver a test made (closed after the test)
    made: list[Driver] = []

    def __init__(self, config_path: Path, instance: dg.DagsterInstance) -> None:
        self.defs = build_definitions(config_path)
        self.config_path = config_path
        self.instance = instance
        self.cursors: dict[str, str | None] = {}  # per reader group
        self.results: list[dg.ExecuteInProcessResult] = []
        self.observations: list[dg.AssetObservation] = []  # of the stream status assets
        self.group_runs: dict[str, list[Background]] = {}  # per reader group, in launch order
        self.last_skip: str | None = None  # the last tick's skip message
        Driver.made.append(self)

    def group_of(self, stream_id: int) -> str:
        resources = self.defs.resources or {}
        for stream in resources["pgstream"].config.streams:
            if stream.id == stream_id:
                return str(stream.reader)
        raise KeyError(f"no stream {stream_id} in {self.config_path}")

    def reload(self, config_path: Path) -> None:
        """The code location reloaded with another pgstream.yaml: the sensors are the new ones (their cursors
        kept); the runs already executing keep the definitions they started with."""
        self.defs = build_definitions(config_path)
        self.config_path = config_path

    def tick(self, stream_id: int) -> Tick:
        """One tick of the sensor of ``stream_id``'s reader group: the group delivery run it requests is
        launched (in the background); the runs of members in mode per_batch are the tick's ``run_requests``."""
        return self.tick_group(self.group_of(stream_id))

    def tick_group(self, group: str) -> Tick:
        sensor = self.defs.resolve_sensor_def(f"pgstream_group_{group}")
        resources = self.defs.resources or {}
        ctx = dg.build_sensor_context(instance=self.instance, cursor=self.cursors.get(group),
                                      sensor_name=sensor.name, resources={"pgstream": resources["pgstream"]})
        result = sensor.evaluate_tick(ctx)
        self.cursors[group] = result.cursor
        self.last_skip = result.skip_message
        self.observations += [e for e in result.asset_events or [] if isinstance(e, dg.AssetObservation)]
        own: list[dg.RunRequest] = []
        for request in result.run_requests or []:
            if request.job_name == GROUP_DELIVERY_JOB:
                self.launch_group_run(group, request)
            else:
                own.append(request)
        return Tick(own, result.skip_message, result.cursor, result.asset_events)

    def launch_group_run(self, group: str, request: dg.RunRequest) -> Background:
        url = (self.defs.resources or {})["pgstream"].database_url
        assert request.tags.get(GROUP_TAG) == group_tag_of(url, group), request.tags
        runs = self.group_runs.setdefault(group, [])
        for run in runs:  # Dagster shows a run ended a moment before execute_in_process returns
            if not run.live():  # (a live one is succeeded: its successor waits for the group's lease, as launched)
                run.wait(30)
        run = Background(self, request)
        runs.append(run)
        # as the daemon does, the run exists (queued) before the next tick looks for a live one
        deadline = time.monotonic() + 30
        while run.run_id is None:
            assert time.monotonic() < deadline, "the requested group run was not created"
            time.sleep(0.02)
        return run

    def execute(self, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
        """Execute the run ``request`` asks for (its job: a stream's run in mode per_batch, or a reader group's
        delivery run), in this thread."""
        job = self.defs.resolve_job_def(request.job_name or DELIVERY_JOB)
        tags = {**request.tags, "dagster/run_key": request.run_key or ""}
        result = job.execute_in_process(run_config=request.run_config, instance=self.instance, tags=tags,
                                        raise_on_error=False)
        self.results.append(result)
        return result

    def run_until(self, stream_id: int, done: Callable[[], bool], timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {stream_id} did not finish in {timeout}s\n{self.described(stream_id)}")
            tick = self.tick(stream_id)
            for request in tick.run_requests or []:
                self.execute(request)

    def stop_group_runs(self, reason: str = "the test ends", timeout: float = 60) -> None:
        """Ask every live group delivery run to end (tag pgstream/stop, as the group's sensor does) and wait.
        As the sensor, asks again while a run does not show the tag: Dagster writes a run's tags by reading the
        run and writing it back whole, so a write of the run's own (a member's state) can put back its tags
        from before the request."""
        live = [run for runs in self.group_runs.values() for run in runs if run.thread.is_alive()]
        deadline = time.monotonic() + timeout
        while (live := [run for run in live if run.thread.is_alive()]) and time.monotonic() < deadline:
            for run in live:
                dagster_run = self.instance.get_run_by_id(run.run_id) if run.run_id is not None else None
                if dagster_run is not None and STOP_TAG not in dagster_run.tags:
                    self.instance.add_run_tags(dagster_run.run_id, {STOP_TAG: reason})
            live[0].thread.join(1)
        for run in live:
            assert not run.thread.is_alive(), f"a group delivery run did not end when asked: {run.described()}"

    def close(self) -> None:
        self.stop_group_runs()

    def described(self, stream_id: int) -> str:
        """Why a test waited in vain on the stream: its ledger row, its batches not delivered, the last ticks'
        outcome and every group run this driver launched (what each of its threads is doing)."""
        url = (self.defs.resources or {})["pgstream"].database_url
        lines = []
        with psycopg.connect(url, autocommit=True) as conn:
            stream = conn.execute("select paused, failover_since, open_run_key, slot_reader, reader_group "
                                  "from pgstream.streams where id = %s", [stream_id]).fetchone()
            lines.append(f"stream {stream_id}: paused, failover_since, open_run_key, slot_reader, group = {stream}")
            for row in conn.execute("select id, status, run_key, attempts, error from pgstream.batches "
                                    "where stream_id = %s and status <> 'delivered' order by id limit 20",
                                    [stream_id]):
                lines.append(f"  batch {row}")
            for row in conn.execute("select name, pgstream.lock_holder(name, key) from pgstream.locks "
                                    "where key = %s and pgstream.lock_holder(name, key) is not null", [stream_id]):
                lines.append(f"  lock {row[0]} held by {row[1]!r}")
        lines.append(f"last tick: {self.last_skip}")
        lines += [run.described() for runs in self.group_runs.values() for run in runs if run.thread.is_alive()]
        return "\n".join(lines)


class Background:
    """Executes one requested run in a thread (as the run launcher would), while the test ticks."""

    def __init__(self, driver: Driver, request: dg.RunRequest) -> None:
        self.result: dg.ExecuteInProcessResult | None = None
        self.request = request
        self.driver = driver
        self.thread = threading.Thread(target=self._run, args=(driver, request), daemon=True)
        self.thread.start()

    @property
    def run_id(self) -> str | None:
        """The Dagster run's id, once it exists (a run key is unique per sensor: the group ``default`` of two
        databases can have the same one, told apart by their tag pgstream/group)."""
        tags = {"dagster/run_key": self.request.run_key or "",
                **{k: v for k, v in self.request.tags.items() if k == GROUP_TAG}}
        runs = self.driver.instance.get_runs(dg.RunsFilter(tags=tags), limit=1)
        return runs[0].run_id if runs else None

    def _run(self, driver: Driver, request: dg.RunRequest) -> None:
        self.result = driver.execute(request)

    def described(self) -> str:
        """What a run that did not end was doing: its Dagster status and tags, and where each of this process's
        pgstream threads is (why a test waited in vain for it)."""
        run_id = self.run_id
        run = self.driver.instance.get_run_by_id(run_id) if run_id else None
        lines = [f"run {run_id} ({run.status.value if run else 'not in Dagster'}), tags {run.tags if run else {}}"]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            name = names.get(ident, "")
            if name.startswith("pgstream") or ident == self.thread.ident:
                lines.append(f"thread {name}:\n" + "".join(traceback.format_stack(frame)[-8:]))
        return "\n".join(lines)

    def live(self) -> bool:
        """Whether Dagster shows the run live (not yet ended)."""
        run_id = self.run_id
        run = self.driver.instance.get_run_by_id(run_id) if run_id else None
        return run is not None and run.status in LIVE

    def wait(self, timeout: float) -> dg.ExecuteInProcessResult:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not end"
        assert self.result is not None
        return self.result


def tick_until(driver: Driver, stream_id: int, done: Callable[[], bool], timeout: float = 120) -> list[dg.RunRequest]:
    """Tick until ``done()``; returns the run requests the ticks made (none are executed)."""
    requests: list[dg.RunRequest] = []
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out\n{driver.described(stream_id)}"
        requests += driver.tick(stream_id).run_requests or []
    return requests


def values(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Dagster metadata as plain values (each ``MetadataValue``'s ``value``)."""
    return {k: getattr(v, "value", v) for k, v in metadata.items()}


def run_metadata(result: dg.ExecuteInProcessResult, kind: str) -> list[dict[str, Any]]:
    """The metadata (plain values) of the run's events of ``kind``, ``ASSET_MATERIALIZATION`` or
    ``ASSET_OBSERVATION``, in order."""
    found: list[dict[str, Any]] = []
    for event in result.all_events:
        if event.event_type_value != kind:
            continue
        data: Any = event.event_specific_data
        found.append(values((data.materialization if kind == "ASSET_MATERIALIZATION" else data.asset_observation)
                            .metadata))
    return found


def at_least(count: Callable[[], int], n: int) -> Callable[[], bool]:
    """``done`` for :func:`tick_until`: ``count()`` reached ``n`` (bound now, not when called)."""
    return lambda: count() >= n

