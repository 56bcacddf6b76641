"""One sensor per stream: it reads the stream's slot, cuts and records batches, and decides which
delivery run may start next. The sensor decides; the delivery run does the work.

A tick ((1) and (2) are ``engine/ingest.py``): (1) make sure the slot exists and is usable: a
missing or invalidated slot is (re)created and every event the ledger does not cover is
recovered from the table; (2) peek committed transactions, and once ``max_size`` events are
waiting or the oldest waited ``max_fill_secs``, record them in the ledger and advance the slot,
so WAL is released whatever the sink does;
(3) look at the stream's oldest open batch and request its run (``run_key`` = stream, batches,
attempt, so a re-evaluated tick requests nothing twice), or, while the run in flight is *open*
(``delivery.linger_secs``), hand it the batches recorded behind its own. A tick repeats (2) and
(3) for up to ``sensor.tick_budget_secs`` and ends early only to request a run: with an open run,
an event reaches the sink a fraction of a second after ``max_fill_secs``.

Failover: when a run fails, its first open batch becomes the checkpoint and the stream enters
failover (``pgstream.enter_failover``). Only that batch is retried, alone, with exponential
backoff; once the sink accepts it, runs drain the recorded backlog from the table in commit order
(many batches per run) and the stream leaves failover when it has caught up.
"""


import datetime as dt
import json
import time
from typing import Any

import dagster as dg
import psycopg

from ..config import StreamConfig
from ..engine import ledger
from ..engine.ingest import ConsumeResult, consume
from ..engine.status import last_batches, stream_status
from .names import ATTEMPT_TAG, BATCH_TAG, BATCHES_TAG, DELIVERY_JOB, STREAM_TAG, stream_sensor_name
from .resources import PgstreamResource
from .status import status_observation

_FAILED = {dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
_LIVE = {dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING,
         dg.DagsterRunStatus.STARTED}
#: how often a tick looks at the slot when nothing is waiting, and at the run in flight
POLL_SECS = 0.1
DECIDE_EVERY_SECS = 1.0


def backoff_secs(stream: StreamConfig, attempts: int) -> float:
    # the exponent is capped: 2 ** 1024 no longer converts to a float (a sink down for weeks)
    doubled: float = stream.retry.initial_backoff_secs * 2 ** min(max(0, attempts - 1), 64)
    return min(stream.retry.max_backoff_secs, doubled)


def run_key(stream_id: int, incarnation: str, batch_ids: list[int], attempt: int) -> str:
    span = f"b{batch_ids[0]}" if len(batch_ids) == 1 else f"b{batch_ids[0]}-{batch_ids[-1]}"
    return f"pgstream-s{stream_id}-{incarnation}-{span}-a{attempt}"


def _request(head: ledger.Batch, batch_ids: list[int], attempt: int) -> dg.RunRequest:
    config: dict[str, int] = {"stream_id": head.stream_id, "batch_id": batch_ids[0]}
    if len(batch_ids) > 1:
        config["through_batch_id"] = batch_ids[-1]
    return dg.RunRequest(
        run_key=run_key(head.stream_id, head.incarnation, batch_ids, attempt),
        job_name=DELIVERY_JOB,
        run_config={"ops": {"load_batches": {"config": config}}},
        tags={STREAM_TAG: str(head.stream_id), BATCH_TAG: str(head.id), ATTEMPT_TAG: str(attempt),
              BATCHES_TAG: str(len(batch_ids))},
    )


def _launch(conn: psycopg.Connection, stream: StreamConfig, head: ledger.Batch, in_failover: bool) -> dg.RunRequest:
    # a batch that failed is retried alone (the failover probe); otherwise take the pending backlog
    ids = [head.id] if head.status == "failed" else ledger.open_range(conn, head, stream.delivery.max_events_per_run)
    attempt = head.attempts + 1
    # a run stays open for new batches only on a healthy stream: catch-up runs end when done
    linger = stream.delivery.linger_secs > 0 and not in_failover
    ledger.mark_launched(conn, ids, run_key(head.stream_id, head.incarnation, ids, attempt),
                         open_for=head.stream_id if linger else None)
    return _request(head, ids, attempt)


def run_failure_message(instance: dg.DagsterInstance, run_id: str) -> str | None:
    """The error of the run's failed step (e.g. the sink's answer), for status and the UI."""
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE, limit=1).records
    for record in records:
        event = record.event_log_entry.dagster_event
        data = event.step_failure_data if event else None
        error = data.error if data is not None else None
        while error is not None and error.cause is not None:  # the root cause, e.g. the sink's answer
            error = error.cause
        if error is not None and error.message.strip():
            return error.message.strip().splitlines()[0][:500]
    return None


def _hand_to_open_run(conn: psycopg.Connection, instance: dg.DagsterInstance, stream: StreamConfig) -> bool:
    """Assign the pending batches to the stream's open run, if it is still there; true if it took them."""
    key = ledger.open_run_key(conn, stream.id)
    if key is None:
        return False
    runs = instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": key}), limit=1)
    if runs and runs[0].status in _LIVE:
        # empty if it closed meanwhile: then a new run is requested
        return bool(ledger.extend_run(conn, stream.id, key, stream.delivery.max_events_per_run))
    ledger.clear_open_run(conn, stream.id, key)  # it ended without closing (failed, canceled)
    return False


def _run_is_dead(conn: psycopg.Connection, instance: dg.DagsterInstance, run: dg.DagsterRun,
                 stream: StreamConfig, now: dt.datetime) -> bool:
    record = instance.get_run_record_by_id(run.run_id)
    started = record.start_time if record else None
    if started is None or now.timestamp() - started < stream.delivery.run_grace_secs:
        return False
    return not ledger.lease_alive(conn, run.run_id)


def decide(conn: psycopg.Connection, instance: dg.DagsterInstance, stream: StreamConfig,
           log: list[str]) -> dg.RunRequest | None:
    """The run to request for the stream's oldest open batch, if one may start now; also moves the
    stream into and out of failover."""
    head = ledger.head(conn, stream.id)
    in_failover = ledger.failover_since(conn, stream.id) is not None
    if in_failover and ledger.caught_up(conn, stream.id, head):
        ledger.leave_failover(conn, stream.id)
        log.append(f"stream {stream.id} caught up: failover over")
        in_failover = False
    if head is None:
        return None
    if ledger.is_paused(conn, stream.id):
        log.append(f"stream {stream.id} is paused: batch {head.id} waits (`pgstream-dagster resume {stream.id}`)")
        return None
    now = dt.datetime.now(dt.UTC)
    if head.status == "pending":
        if _hand_to_open_run(conn, instance, stream):
            return None
        return _launch(conn, stream, head, in_failover)
    if head.status == "failed":
        if head.next_attempt_at is not None and head.next_attempt_at > now:
            log.append(f"stream {stream.id} in failover at batch {head.id} ({head.error}); "
                       f"retry at {head.next_attempt_at:%H:%M:%S}")
            return None
        return _launch(conn, stream, head, in_failover)
    # launched: find its run
    runs = instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": head.run_key or ""}), limit=1)
    if not runs:
        # the tick that requested it may have died before Dagster created the run: asking again
        # with the same run_key is harmless (Dagster skips run keys it has seen)
        ids = ledger.launched_batch_ids(conn, head.run_key) or [head.id]
        return _request(head, ids, head.attempts)
    run = runs[0]
    if run.status == dg.DagsterRunStatus.STARTED and _run_is_dead(conn, instance, run, stream, now):
        instance.report_run_failed(run, f"pgstream: run {run.run_id} holds no delivery lease "
                                        f"{stream.delivery.run_grace_secs:.0f}s after it started: its process died")
        run = instance.get_run_by_id(run.run_id) or run
        log.append(f"stream {stream.id}: run {run.run_id} died (no delivery lease); marked failed")
    if run.status in _FAILED:
        retry_at = now + dt.timedelta(seconds=backoff_secs(stream, head.attempts))
        reason = run_failure_message(instance, run.run_id) or run.status.value
        ledger.fail_run(conn, head, head.run_key or "", f"run {run.run_id}: {reason}", retry_at)
        log.append(f"stream {stream.id} in failover at batch {head.id}: run {run.run_id} {run.status.value} "
                   f"({reason}); retry at {retry_at:%H:%M:%S}")
        return None
    if run.status in _LIVE:
        # the run may still be open: hand it what was recorded behind its batches
        ledger.extend_run(conn, stream.id, head.run_key or "", stream.delivery.max_events_per_run)
        return None
    if run.status == dg.DagsterRunStatus.SUCCESS:
        # a successful run delivers all its batches; a success without it is an inconsistency
        ledger.fail_run(conn, head, head.run_key or "", f"run {run.run_id} succeeded without confirming "
                        f"batch {head.id}", now)
    return None


def tick(conn: psycopg.Connection, instance: dg.DagsterInstance, stream: StreamConfig,
         log: list[str]) -> tuple[ConsumeResult, dg.RunRequest | None]:
    """One sensor evaluation: keep recording what commits (and handing it to the open run) until a
    new run must be requested or ``sensor.tick_budget_secs`` is spent. A long tick is what lets an
    open run deliver an event well under a second after its commit: the daemon starts ticks every
    few seconds at best."""
    total = ConsumeResult()
    deadline = time.monotonic() + stream.sensor.tick_budget_secs
    decided_at = 0.0
    first = True
    while True:
        consumed = consume(conn, stream, max(0.0, deadline - time.monotonic()), check_slot=first,
                           mark=first or time.monotonic() - decided_at >= DECIDE_EVERY_SECS)
        first = False
        total.add(consumed)
        request = None
        if consumed.batches or time.monotonic() - decided_at >= DECIDE_EVERY_SECS:
            request = decide(conn, instance, stream, log)
            decided_at = time.monotonic()
        remaining = deadline - time.monotonic()
        if request is not None or consumed.slot_lost or remaining <= 0:
            return total, request
        if not consumed.batches:
            time.sleep(min(POLL_SECS, remaining))


def _observe_status(conn: psycopg.Connection, stream: StreamConfig, row: dict[str, Any],
                    cursor: dict[str, Any]) -> dg.AssetObservation | None:
    """An observation of the stream status asset when the state changed or it is due."""
    due = time.time() - float(cursor.get("status_at", 0)) >= stream.sensor.status_every_secs
    dead_letters = int(row.get("open_dead_letters") or 0)
    if not due and cursor.get("status_state") == row["state"] and cursor.get("status_dead_letters", 0) == dead_letters:
        return None
    cursor["status_at"] = time.time()
    cursor["status_state"] = row["state"]
    cursor["status_dead_letters"] = dead_letters
    return status_observation({**row, "last_batches": last_batches(conn, stream.id, 5)}, cursor)


def stream_sensor(stream: StreamConfig) -> dg.SensorDefinition:
    """The sensor of one stream."""

    @dg.sensor(
        name=stream_sensor_name(stream.id),
        job_name=DELIVERY_JOB,
        minimum_interval_seconds=stream.sensor.interval_secs,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Reads slot {stream.slot}, records batches of stream {stream.id} and requests "
                    f"one delivery run at a time, in order.",
    )
    def _sensor(context: dg.SensorEvaluationContext, pgstream: dg.ResourceParam[PgstreamResource]) -> dg.SensorResult:
        cursor = json.loads(context.cursor) if context.cursor else {}
        log: list[str] = []
        with pgstream.connect() as conn:
            consumed, request = tick(conn, context.instance, stream, log)
            (row,) = stream_status(conn, stream.id, last=0)  # the tick's one read of the stream's state
            pending_batches, pending_events = int(row["undelivered_batches"]), int(row["undelivered_events"])
            if consumed.last_event_id is not None:
                cursor["last_event_id"] = consumed.last_event_id
            if consumed.last_lsn is not None:
                cursor["last_lsn"] = consumed.last_lsn
            cursor["undelivered_batches"] = pending_batches
            cursor["undelivered_events"] = pending_events
            observed = _observe_status(conn, stream, row, cursor)
        if consumed.slot_lost:
            context.log.warning(f"slot {stream.slot} was invalidated (WAL limit) or dropped; replacing it and "
                                "recovering undelivered events from pgstream.events")
        if consumed.slot_created:
            context.log.info(f"created slot {stream.slot}; recovered {len(consumed.recovered)} batches from the table")
        if consumed.batches:
            context.log.info(f"recorded batches {consumed.batches} ({consumed.events} events)")
        if consumed.unreadable:
            context.log.error(f"{consumed.unreadable} events could not be recorded and were set aside as dead letters "
                              f"(stage 'read'): `pgstream-dagster dead-letters list {stream.id}`")
        for line in log:
            context.log.warning(line)
        new_cursor = json.dumps(cursor, sort_keys=True, default=str)
        events = [observed] if observed is not None else []
        if request is None:
            return dg.SensorResult(skip_reason=dg.SkipReason(
                f"{pending_events} undelivered events in {pending_batches} batches"), cursor=new_cursor,
                asset_events=events)
        return dg.SensorResult(run_requests=[request], cursor=new_cursor, asset_events=events)

    return _sensor
