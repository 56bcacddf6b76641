"""The delivery job: one run delivers one or more consecutive ledger batches of a stream, in
order, through the stream's sink.

``load_batches`` checks the batches may run (the first is the stream's oldest open batch; the
range holds only the stream's open batches) and loads them with PySpark; ``deliver_batches``
publishes them in commit order (or per routing key) and marks each batch delivered as soon as the
sink confirmed its last event, so a run that fails half-way keeps the progress it made;
``report_deliveries`` reports the materialization of the stream's deliveries asset.
"""


import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

import dagster as dg
import psycopg
from dagster_pyspark import PySparkResource

from . import ledger, spark
from .resources import PgstreamResource

STREAM_TAG = "pgstream/stream"
BATCH_TAG = "pgstream/batch"
DELIVERY_JOB = "pgstream_delivery"


def deliveries_asset_key(stream_id: int) -> dg.AssetKey:
    return dg.AssetKey(["pgstream", f"stream_{stream_id}", "deliveries"])


class DeliveryRunConfig(dg.Config):
    stream_id: int
    batch_id: int
    through_batch_id: int | None = None


@dataclass
class LoadedBatches:
    stream_id: int
    batches: list[ledger.Batch]
    frame: Any  # pyspark.sql.DataFrame
    started: float
    lease: psycopg.Connection  # holds the stream's delivery lease until the batches are marked


@dataclass
class DeliveryReport:
    stream_id: int
    batches: list[ledger.Batch]
    delivered: int
    started: float


@dg.op(description="Check the batches may run and load their events from pgstream.events with PySpark.")
def load_batches(context: dg.OpExecutionContext, config: DeliveryRunConfig, pgstream: PgstreamResource,
                 pyspark: PySparkResource) -> LoadedBatches:
    started = time.monotonic()
    last = config.through_batch_id or config.batch_id
    try:
        lease = ledger.acquire_lease(pgstream.database_url, config.stream_id, context.run_id)
    except ledger.LeaseTaken as exc:
        raise dg.Failure(str(exc)) from None
    try:
        batches = ledger.batches_between(lease, config.stream_id, config.batch_id, last)
        if not batches or batches[0].id != config.batch_id:
            raise dg.Failure(f"batch {config.batch_id} of stream {config.stream_id} does not exist")
        done = [b.id for b in batches if b.status in ("delivered", "skipped")]
        if done:
            raise dg.Failure(f"batches {done} of stream {config.stream_id} are already delivered or skipped")
        earlier = ledger.earlier_open(lease, config.stream_id, config.batch_id)
        if earlier is not None:
            raise dg.Failure(f"batch {config.batch_id} would overtake open batch {earlier} of stream "
                             f"{config.stream_id}; batches are delivered in order")
        stream = pgstream.stream(config.stream_id)
        frame = spark.load_batches(pyspark.spark_session, pgstream.database_url,
                                   [(b.id, b.event_count, b.confirmed_count if stream.delivery.ordering == "global"
                                     else 0) for b in batches], stream.delivery.routing_key,
                                   rows_per_partition=stream.delivery.rows_per_partition,
                                   packed=stream.delivery.ordering == "global")
    except BaseException:
        lease.close()
        raise
    total = sum(b.event_count for b in batches)
    kinds = sorted({b.kind for b in batches})
    context.log.info(f"stream {config.stream_id}: {len(batches)} batches {batches[0].id}..{batches[-1].id}, "
                     f"{total} events ({', '.join(kinds)})")
    return LoadedBatches(config.stream_id, batches, frame, started, lease)


@dg.op(description="Publish the batches through the stream's sink, in order; each batch is marked delivered "
                   "as soon as the sink confirmed all its events.")
def deliver_batches(context: dg.OpExecutionContext, loaded: LoadedBatches,
                    pgstream: PgstreamResource) -> DeliveryReport:
    stream = pgstream.stream(loaded.stream_id)
    by_key = stream.delivery.ordering == "by_key"
    # a retry resumes after the events the sink already confirmed (global order only)
    expected = {b.id: b.event_count - (0 if by_key else b.confirmed_count) for b in loaded.batches}
    total = sum(expected.values())
    step = max(stream.delivery.chunk_size, total // 10)
    next_log = [step]

    with loaded.lease as conn:  # released when the batches are marked (or the process dies)
        def batch_done(batch_id: int, events: int) -> None:
            if events != expected[batch_id]:
                raise dg.Failure(f"batch {batch_id}: {expected[batch_id]} events were owed but {events} were "
                                 f"found in pgstream.events; refusing to mark it delivered")
            if not ledger.mark_delivered(conn, batch_id, context.run_id):
                raise dg.Failure(f"batch {batch_id} was already marked delivered by another run")

        def progress(count: int) -> None:
            if count >= next_log[0] and count < total:
                context.log.info(f"stream {stream.id}: {count}/{total} events confirmed by the sink")
                next_log[0] = count + step

        for batch_id in [b for b, owed in expected.items() if owed == 0]:
            batch_done(batch_id, 0)  # confirmed in full by an earlier run that died before marking it
        if by_key:
            delivered = spark.deliver_by_key(loaded.frame, stream.sink, stream.delivery.chunk_size,
                                             stream.delivery.parallelism)
            if delivered != total:
                raise dg.Failure(f"the ledger lists {total} events but {delivered} were found in pgstream.events "
                                 f"and delivered; refusing to mark batches delivered")
            for b in loaded.batches:
                batch_done(b.id, expected[b.id])
        else:
            delivered = spark.deliver_in_order(loaded.frame, stream.sink, stream.delivery.chunk_size,
                                               batch_done, progress,
                                               lambda batch_id, ord: ledger.mark_confirmed(conn, batch_id, ord),
                                               prefetch=stream.delivery.prefetch_partitions)
        missing = ledger.not_delivered(conn, [b.id for b in loaded.batches])
    if missing:
        raise dg.Failure(f"batches {missing} had no events in pgstream.events; refusing to mark them delivered")
    context.log.info(f"stream {stream.id}: sink {stream.sink.type} confirmed {delivered} events "
                     f"of {len(loaded.batches)} batches")
    return DeliveryReport(loaded.stream_id, loaded.batches, delivered, loaded.started)


@dg.op(description="Report the deliveries materialization of the stream.")
def report_deliveries(context: dg.OpExecutionContext, report: DeliveryReport) -> None:
    first, last = report.batches[0], report.batches[-1]
    now = dt.datetime.now(dt.UTC)
    metadata: dict[str, Any] = {
        "batches": len(report.batches),
        "first_batch_id": first.id,
        "last_batch_id": last.id,
        "kinds": ", ".join(sorted({b.kind for b in report.batches})),
        "events": report.delivered,
        "first_event_id": first.first_event_id,
        "last_event_id": last.last_event_id,
        "duration_secs": round(time.monotonic() - report.started, 3),
    }
    if first.first_commit_at is not None:
        metadata["commit_to_delivery_lag_secs"] = round((now - first.first_commit_at).total_seconds(), 3)
    context.log_event(dg.AssetMaterialization(
        asset_key=deliveries_asset_key(report.stream_id),
        description=f"batches {first.id}..{last.id} delivered", metadata=metadata))


@dg.job(
    name=DELIVERY_JOB,
    description="Deliver consecutive batches of a stream's events to its sink (requested by the stream's sensor).",
    executor_def=dg.in_process_executor,
)
def delivery_job() -> None:
    report_deliveries(deliver_batches(load_batches()))
