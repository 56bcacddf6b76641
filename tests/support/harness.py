"""Drives a stream the way the daemon does, in-process: evaluate the sensor tick, execute every
run it requests against the real Dagster instance, repeat."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import yaml

from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import DELIVERY_JOB, REPLAY_JOB, REPLAY_OP
from pgstream_dagster.engine.ledger import streams as ledger_streams
from pgstream_dagster.sinks.memory import MemorySink


def write_config(path: Path, database_url: str, streams: list[dict[str, Any]],
                 subscriptions: list[dict[str, Any]] | None = None, spark: dict[str, Any] | None = None) -> Path:
    """``streams`` as in pgstream.yaml; a stream that says nothing of its mode gets the product's default
    (``delivery.mode: open``) with a short linger (:data:`HARNESS_LINGER_SECS`)."""
    streams = [{**s, "delivery": _product_default_unless_said(s.get("delivery", {}))} for s in streams]
    path.write_text(yaml.safe_dump({"database_url": database_url, "streams": streams,
                                    "subscriptions": subscriptions or [],
                                    "spark": spark or {"master": "local[2]"}}))
    return path


#: an open run's idle linger in the tests (``delivery.tuning.linger_secs``; the product's is 120 s) and how
#: long it takes new batches (``tuning.max_run_secs``; the product's 1800 s): the in-process driver executes
#: a run before it ticks again, so a run waits out its linger before the next tick, and one that a writer
#: keeps busy would never hand back to the test
HARNESS_LINGER_SECS = 0.3
HARNESS_MAX_RUN_SECS = 2.0


def _product_default_unless_said(delivery: dict[str, Any]) -> dict[str, Any]:
    """A stream's ``delivery`` with the product's default mode (open: the run stays open and reads the
    slot) and a short linger, unless it says otherwise."""
    tuning = delivery.get("tuning", {})
    if "mode" in delivery or "linger_secs" in tuning:
        return delivery
    return {**delivery, "tuning": {"linger_secs": HARNESS_LINGER_SECS, "max_run_secs": HARNESS_MAX_RUN_SECS,
                                   **tuning}}


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
    """The replication slot stream ``stream_id`` reads in that database (or would read, created now): the
    database derives its default name (``pgstream.default_slot_name``), unique in the cluster."""
    with psycopg.connect(url) as conn:
        return ledger_streams.stream_slot(conn, stream_id)


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
    # lines end in "\n" only: str.splitlines() would also split inside a payload holding U+2028
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


@dataclass(frozen=True)
class Tick:
    """What one sensor evaluation returned (Dagster's ``SensorExecutionData``), typed for the tests."""

    run_requests: list[dg.RunRequest]
    skip_message: str | None
    cursor: str | None
    asset_events: Sequence[dg.AssetMaterialization | dg.AssetObservation | dg.AssetCheckEvaluation]


class Driver:
    def __init__(self, config_path: Path, instance: dg.DagsterInstance) -> None:
        self.defs = build_definitions(config_path)
        self.config_path = config_path
        self.instance = instance
        self.cursors: dict[int, str | None] = {}
        self.results: list[dg.ExecuteInProcessResult] = []
        self.observations: list[dg.AssetObservation] = []  # of the stream status assets

    def tick(self, stream_id: int) -> Tick:
        sensor = self.defs.resolve_sensor_def(f"pgstream_stream_{stream_id}")
        resources = self.defs.resources or {}
        ctx = dg.build_sensor_context(instance=self.instance, cursor=self.cursors.get(stream_id),
                                      sensor_name=sensor.name, resources={"pgstream": resources["pgstream"]})
        result = sensor.evaluate_tick(ctx)
        self.cursors[stream_id] = result.cursor
        self.observations += [e for e in result.asset_events or [] if isinstance(e, dg.AssetObservation)]
        return Tick(list(result.run_requests or []), result.skip_message, result.cursor, result.asset_events)

    def execute(self, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
        """Execute the run ``request`` asks for (its job: a stream's delivery run, or a reader group's)."""
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
                raise TimeoutError(f"stream {stream_id} did not finish in {timeout}s")
            tick = self.tick(stream_id)
            for request in tick.run_requests or []:
                self.execute(request)


class Background:
    """Executes one requested run in a thread (as the run launcher would), while the test ticks."""

    def __init__(self, driver: Driver, request: dg.RunRequest) -> None:
        self.result: dg.ExecuteInProcessResult | None = None
        self.thread = threading.Thread(target=self._run, args=(driver, request), daemon=True)
        self.thread.start()

    def _run(self, driver: Driver, request: dg.RunRequest) -> None:
        self.result = driver.execute(request)

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
        assert time.monotonic() < deadline, "timed out"
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

