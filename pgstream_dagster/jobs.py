"""The delivery job: one run delivers one ledger batch through the stream's sink.

``load_batch`` checks the batch may run (it is the stream's oldest undelivered one) and loads it
with PySpark; ``deliver_batch`` publishes it in commit order (or per routing key); ``confirm_batch``
marks it delivered, only after the sink confirmed every event, and reports the materialization of
the stream's deliveries asset.
"""


import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

import dagster as dg
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


@dataclass
class LoadedBatch:
    batch: ledger.Batch
    frame: Any  # pyspark.sql.DataFrame
    started: float


@dataclass
class DeliveryReport:
    batch: ledger.Batch
    delivered: int
    started: float


@dg.op(description="Load the batch's events from pgstream.events with PySpark, in commit order.")
def load_batch(context: dg.OpExecutionContext, config: DeliveryRunConfig, pgstream: PgstreamResource,
               pyspark: PySparkResource) -> LoadedBatch:
    started = time.monotonic()
    with pgstream.connect() as conn:
        batch = ledger.get(conn, config.batch_id)
        if batch is None or batch.stream_id != config.stream_id:
            raise dg.Failure(f"batch {config.batch_id} of stream {config.stream_id} does not exist")
        if batch.status == "delivered":
            raise dg.Failure(f"batch {batch.id} is already delivered (run {batch.run_id})")
        earlier = ledger.earlier_undelivered(conn, batch)
        if earlier is not None:
            raise dg.Failure(f"batch {batch.id} would overtake undelivered batch {earlier} of stream "
                             f"{batch.stream_id}; batches are delivered in order")
    stream = pgstream.stream(config.stream_id)
    frame = spark.load_batch(
        pyspark.spark_session, pgstream.database_url, batch.id, batch.event_count,
        stream.delivery.routing_key,
        stream.delivery.parallelism if stream.delivery.ordering == "by_key" else 1,
    )
    context.log.info(f"batch {batch.id}: {batch.event_count} events, ids {batch.first_event_id}.."
                     f"{batch.last_event_id} ({batch.kind})")
    return LoadedBatch(batch, frame, started)


@dg.op(description="Publish the batch through the stream's sink; fails unless every event was confirmed.")
def deliver_batch(context: dg.OpExecutionContext, loaded: LoadedBatch, pgstream: PgstreamResource) -> DeliveryReport:
    stream = pgstream.stream(loaded.batch.stream_id)
    if stream.delivery.ordering == "by_key":
        delivered = spark.deliver_by_key(loaded.frame, stream.sink, stream.delivery.chunk_size,
                                         stream.delivery.parallelism)
    else:
        delivered = spark.deliver_in_order(loaded.frame, stream.sink, stream.delivery.chunk_size)
    if delivered != loaded.batch.event_count:
        raise dg.Failure(
            f"batch {loaded.batch.id}: the ledger lists {loaded.batch.event_count} events but "
            f"{delivered} were found in pgstream.events and delivered; refusing to mark it delivered")
    context.log.info(f"batch {loaded.batch.id}: sink {stream.sink.type} confirmed {delivered} events")
    return DeliveryReport(loaded.batch, delivered, loaded.started)


@dg.op(description="Mark the batch delivered in the ledger and report the deliveries materialization.")
def confirm_batch(context: dg.OpExecutionContext, report: DeliveryReport, pgstream: PgstreamResource) -> None:
    batch = report.batch
    with pgstream.connect() as conn:
        if not ledger.mark_delivered(conn, batch.id, context.run_id):
            raise dg.Failure(f"batch {batch.id} was already marked delivered by another run")
    now = dt.datetime.now(dt.UTC)
    metadata: dict[str, Any] = {
        "batch_id": batch.id,
        "kind": batch.kind,
        "events": report.delivered,
        "first_event_id": batch.first_event_id,
        "last_event_id": batch.last_event_id,
        "duration_secs": round(time.monotonic() - report.started, 3),
    }
    if batch.first_commit_at is not None:
        metadata["commit_to_delivery_lag_secs"] = round((now - batch.first_commit_at).total_seconds(), 3)
    context.log_event(dg.AssetMaterialization(asset_key=deliveries_asset_key(batch.stream_id),
                                              description=f"batch {batch.id} delivered",
                                              metadata=metadata))


@dg.job(
    name=DELIVERY_JOB,
    description="Deliver one batch of a stream's events to its sink (requested by the stream's sensor).",
    executor_def=dg.in_process_executor,
)
def delivery_job() -> None:
    confirm_batch(deliver_batch(load_batch()))
