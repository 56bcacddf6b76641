"""One sensor per stream: it reads the stream's slot, cuts and records batches, and decides which
single batch may be delivered next. The sensor decides; the delivery run does the work.

A tick: (1) make sure the slot exists (creating it recovers every event the ledger does not
cover from the table); (2) peek committed transactions, and once ``max_size`` events are waiting
or the oldest waited ``max_fill_secs``, record them in the ledger and advance the slot; (3) look at
the stream's oldest undelivered batch and request its run (``run_key`` = stream, batch, attempt, so
a re-evaluated tick requests nothing twice), or wait for the run in flight, or schedule a retry
with exponential backoff when it failed.
"""


import datetime as dt
import json
import time
from dataclasses import dataclass, field

import dagster as dg
import psycopg
from dagster._core.storage.dagster_run import DagsterRunStatus, RunsFilter

from . import ledger, replication
from .config import StreamConfig
from .jobs import BATCH_TAG, DELIVERY_JOB, STREAM_TAG
from .resources import PgstreamResource

_FAILED = {DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


@dataclass
class ConsumeResult:
    batches: list[int] = field(default_factory=list)
    events: int = 0
    last_event_id: int | None = None
    last_lsn: str | None = None
    slot_created: bool = False
    recovered: list[int] = field(default_factory=list)


def ensure_slot(conn: psycopg.Connection, stream: StreamConfig, result: ConsumeResult) -> None:
    """Create the stream row, publication and slot when missing; a new slot is followed by a
    recovery pass so that events committed before it existed are not lost."""
    ledger.ensure_stream(conn, stream.id)
    if replication.slot_exists(conn, stream.slot):
        return
    replication.create_slot(conn, stream.slot)
    result.slot_created = True
    result.recovered = ledger.recover_from_table(conn, stream.id, stream.batch.max_size)


def consume(conn: psycopg.Connection, stream: StreamConfig, budget_secs: float) -> ConsumeResult:
    """Move committed events from the slot into the ledger (see module docstring)."""
    result = ConsumeResult()
    ensure_slot(conn, stream, result)
    deadline = time.monotonic() + budget_secs
    cap = max(stream.batch.max_size * 4, 1000)
    while True:
        txns = replication.peek(conn, stream.slot, stream.publication, cap)
        recorded_to = ledger.last_end_lsn(conn, stream.id)
        if recorded_to is not None:
            txns = [t for t in txns if t.end_lsn > recorded_to]
        if txns:
            seen = ledger.recovered_ids_since(conn, stream.id, txns[0].commit_lsn)
            if seen:
                for t in txns:
                    t.events = [e for e in t.events if e.id not in seen]
        waiting = sum(len(t.events) for t in txns)
        oldest = next((t.commit_time for t in txns if t.events), None)
        now = dt.datetime.now(dt.UTC)
        full = waiting >= stream.batch.max_size
        ripe = oldest is not None and (now - oldest).total_seconds() >= stream.batch.max_fill_secs
        if txns and (full or ripe or waiting == 0):
            with_events = [t for t in txns if t.events]
            if with_events:
                result.batches += ledger.record(conn, stream.id, with_events, stream.batch.max_size)
                result.events += waiting
                result.last_event_id = with_events[-1].events[-1].id
            replication.advance(conn, stream.slot, txns[-1].end_lsn)
            result.last_lsn = replication.int_to_lsn(txns[-1].end_lsn)
            if full and time.monotonic() < deadline:
                continue  # more may be waiting behind the peek cap
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        wait = 0.2
        if oldest is not None:
            wait = max(0.05, min(wait, stream.batch.max_fill_secs - (now - oldest).total_seconds()))
        time.sleep(min(wait, remaining))
    return result


def backoff_secs(stream: StreamConfig, attempts: int) -> float:
    return min(stream.retry.max_backoff_secs, stream.retry.initial_backoff_secs * 2 ** max(0, attempts - 1))


def run_key(batch: ledger.Batch, attempt: int) -> str:
    return f"pgstream-s{batch.stream_id}-{batch.incarnation}-b{batch.id}-a{attempt}"


def _request(batch: ledger.Batch, attempt: int) -> dg.RunRequest:
    return dg.RunRequest(
        run_key=run_key(batch, attempt),
        job_name=DELIVERY_JOB,
        run_config={"ops": {"load_batch": {"config": {"stream_id": batch.stream_id, "batch_id": batch.id}}}},
        tags={STREAM_TAG: str(batch.stream_id), BATCH_TAG: str(batch.id), "pgstream/attempt": str(attempt)},
    )


def decide(conn: psycopg.Connection, instance: dg.DagsterInstance, stream: StreamConfig,
           log: list[str]) -> dg.RunRequest | None:
    """The run to request for the stream's oldest undelivered batch, if any may start now."""
    batch = ledger.head(conn, stream.id)
    if batch is None:
        return None
    paused = conn.execute("select paused from pgstream.streams where id = %s", [stream.id]).fetchone()
    if paused and paused[0]:
        log.append(f"stream {stream.id} is paused: batch {batch.id} waits (`pgstream-dagster resume {stream.id}`)")
        return None
    now = dt.datetime.now(dt.UTC)
    if batch.status == "pending":
        ledger.mark_launched(conn, batch.id, run_key(batch, batch.attempts + 1))
        return _request(batch, batch.attempts + 1)
    if batch.status == "failed":
        if batch.next_attempt_at is not None and batch.next_attempt_at > now:
            log.append(f"batch {batch.id} failed ({batch.error}); retry at {batch.next_attempt_at:%H:%M:%S}")
            return None
        ledger.mark_launched(conn, batch.id, run_key(batch, batch.attempts + 1))
        return _request(batch, batch.attempts + 1)
    # launched: find its run
    runs = instance.get_runs(RunsFilter(tags={"dagster/run_key": batch.run_key or ""}), limit=1)
    if not runs:
        # the tick that requested it may have died before Dagster created the run: asking again
        # with the same run_key is harmless (Dagster skips run keys it has seen)
        return _request(batch, batch.attempts)
    run = runs[0]
    if run.status in _FAILED:
        retry_at = now + dt.timedelta(seconds=backoff_secs(stream, batch.attempts))
        ledger.mark_failed(conn, batch.id, f"run {run.run_id} {run.status.value}", retry_at)
        log.append(f"batch {batch.id}: run {run.run_id} {run.status.value}; retry at {retry_at:%H:%M:%S}")
        return None
    if run.status == DagsterRunStatus.SUCCESS:
        # a successful run marks its batch delivered; a success without it is an inconsistency
        ledger.mark_failed(conn, batch.id, f"run {run.run_id} succeeded without confirming the batch", now)
    return None


def stream_sensor(stream: StreamConfig) -> dg.SensorDefinition:
    """The sensor of one stream."""

    @dg.sensor(
        name=f"pgstream_stream_{stream.id}",
        job_name=DELIVERY_JOB,
        minimum_interval_seconds=stream.sensor.interval_secs,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Reads slot {stream.slot}, records batches of stream {stream.id} and requests "
                    f"one delivery run at a time, in order.",
    )
    def _sensor(context: dg.SensorEvaluationContext, pgstream: PgstreamResource) -> dg.SensorResult:
        cursor = json.loads(context.cursor) if context.cursor else {}
        log: list[str] = []
        with pgstream.connect() as conn:
            consumed = consume(conn, stream, stream.sensor.tick_budget_secs)
            request = decide(conn, context.instance, stream, log)
            pending_batches, pending_events = ledger.undelivered_count(conn, stream.id)
        if consumed.slot_created:
            context.log.info(f"created slot {stream.slot}; recovered {len(consumed.recovered)} batches from the table")
        if consumed.batches:
            context.log.info(f"recorded batches {consumed.batches} ({consumed.events} events)")
        for line in log:
            context.log.warning(line)
        if consumed.last_event_id is not None:
            cursor["last_event_id"] = consumed.last_event_id
        if consumed.last_lsn is not None:
            cursor["last_lsn"] = consumed.last_lsn
        cursor["undelivered_batches"] = pending_batches
        cursor["undelivered_events"] = pending_events
        new_cursor = json.dumps(cursor, sort_keys=True)
        if request is None:
            return dg.SensorResult(skip_reason=dg.SkipReason(
                f"{pending_events} undelivered events in {pending_batches} batches"), cursor=new_cursor)
        return dg.SensorResult(run_requests=[request], cursor=new_cursor)

    return _sensor
