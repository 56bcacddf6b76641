"""The backfill job (``pgstream_backfill``, one for the location): existing rows of subscribed tables become READ
events of the stream its run config names (``stream_id``), in parallel on Spark (:mod:`~..engine.backfill`;
``pgstream-dagster backfill`` runs it from a shell). The run's tag ``pgstream/backfill`` (not ``pgstream/stream``: the
stream's deliveries go on) becomes the stream's id when it starts; the run queue limits how many backfills run at
once. Terminating the run stops the backfill cleanly (chunks in flight commit); launching it again resumes it.
"""

import time
from contextlib import closing
from functools import partial
from typing import Any

import dagster as dg
from dagster_pyspark import LazyPySparkResource
from pydantic import Field

from ..engine import backfill
from .assets import subscription_keys
from .names import BACKFILL_JOB, BACKFILL_OP, BACKFILL_TAG
from .resources import PgstreamResource

#: how often a running backfill's progress becomes a materialization of its subscription's asset
MATERIALIZE_EVERY_SECS = 60.0


class BackfillConfig(dg.Config):
    """What to backfill. Each subscription key is read through its INSERT subscription (else its
    UPDATE one) on each of its tables; its existing rows become events with ``tg_op: "READ"``. The fields to
    fill have a default, so the Launchpad's template shows them; the default stream, 0, is none: a run launched
    without choosing one fails, naming ``stream_id`` and the streams there are."""

    stream_id: int = Field(0, ge=0, description="the stream whose subscriptions to backfill (required: the "
                                                "default, 0, is none)")
    # a default, so the Launchpad's template shows it (an empty list is refused naming it)
    subscriptions: list[str] = Field([], description="subscription keys of this stream to backfill (at least one)")
    table: str = Field("", description="schema.table: only this table of those subscriptions (empty: every table)")
    where: str = Field("", description="only rows for which this boolean SQL expression over the row "
                                       "(new.<column>) is true; checked like a when_clause (empty: every row)")
    from_key: list[str] = Field([], description="first primary key (inclusive), one value per key column (empty: "
                                                "from the first row)")
    to_key: list[str] = Field([], description="last primary key (inclusive), one value per key column (empty: "
                                              "through the last row)")
    chunk_size: int = Field(backfill.DEFAULT_CHUNK_SIZE, ge=1, le=100_000,
                            description="rows per chunk: one transaction, rows locked FOR SHARE meanwhile")
    parallelism: int = Field(backfill.DEFAULT_PARALLELISM, ge=1, le=1024,
                             description="key-range partitions read at once (Spark tasks); fixed when a backfill "
                                         "starts")
    max_rows_per_sec: float = Field(backfill.DEFAULT_MAX_ROWS_PER_SEC, ge=0,
                                    description="throttle over all partitions (0: none); keeps live events flowing")
    max_backlog: int = Field(backfill.DEFAULT_MAX_BACKLOG, ge=0,
                             description="wait while the stream has more undelivered events than this (0: never), "
                                         "so a live event never queues behind more READ events")
    restart: bool = Field(False, description="cancel an unfinished backfill of the same subscription and table "
                                             "and start over (default: resume it)")
    progress_secs: float = Field(5.0, gt=0, description="seconds between progress lines in the run log")


def _report(context: dg.OpExecutionContext, asset: dg.AssetKey | None, progress: backfill.Progress,
            description: str) -> None:
    """Progress as a materialization of the subscription's asset, with the code version of its latest one (the
    definition applied), so the ``pgstream_subscriptions`` sensor sees the same state as before; an asset never
    materialized gets an observation."""
    if asset is None:
        return
    metadata: dict[str, Any] = {
        "backfill_id": progress.id, "status": progress.status, "rows_total": progress.rows_total,
        "rows_read": progress.rows_read, "events_written": progress.events_written,
        "partitions_done": f"{progress.partitions_done}/{progress.partitions}",
        "rows_per_sec": round(progress.rows_per_sec), "table": progress.target.schema_name + "." +
        progress.target.table_name, **({"error": progress.error} if progress.error else {})}
    applied = context.instance.get_latest_materialization_code_versions([asset]).get(asset)
    context.log_event(dg.AssetObservation(asset_key=asset, description=description, metadata=metadata)
                      if applied is None else
                      dg.AssetMaterialization(asset_key=asset, description=description, metadata=metadata,
                                              tags={"dagster/code_version": applied}))


@dg.op(name=BACKFILL_OP, description="Existing rows of subscribed tables become READ events of the stream stream_id.")
def backfill_rows(context: dg.OpExecutionContext, config: BackfillConfig, pgstream: dg.ResourceParam[PgstreamResource],
                  pyspark: LazyPySparkResource) -> int:
    stream = pgstream.chosen_stream(config.stream_id, "backfill")
    # the run's stream (the UI filters by it); the tag's key is what the run queue limits
    context.instance.add_run_tags(context.run_id, {BACKFILL_TAG: str(stream.id)})
    # the asset of each YAML subscription of the stream, by identity: its progress is reported there
    assets = subscription_keys(pgstream.config, stream.id)
    try:
        request = backfill.Request(
            stream.id, config.subscriptions, table=config.table or None, where=config.where or None,
            from_key=config.from_key or None, to_key=config.to_key or None, chunk_size=config.chunk_size,
            parallelism=config.parallelism, max_rows_per_sec=config.max_rows_per_sec or None,
            max_backlog=config.max_backlog or None, restart=config.restart)
        with pgstream.connect() as conn:
            chosen = backfill.targets(conn, request)
    except backfill.BackfillError as exc:
        raise dg.Failure(str(exc)) from None
    spark = pyspark.spark_session  # after the request was checked: starting Spark takes a while
    written, problems = 0, []
    for target in chosen:
        asset = assets.get((target.key, target.schema_name, target.table_name, target.operation))
        try:
            with pgstream.connect() as conn:
                backfill_id, resumed = backfill.open_backfill(conn, target, request)
            context.log.info(f"{'resuming' if resumed else 'starting'} backfill {backfill_id} of {target.describe()}")
            last_report = time.monotonic()
            executor = backfill.spark_executor(spark, pgstream.executor_database_url)
            with closing(backfill.run(pgstream.database_url, backfill_id, request, executor,
                                      run_id=context.run_id, progress_secs=config.progress_secs,
                                      on_stop=partial(backfill.cancel_spark, spark))) as steps:
                for step in steps:
                    if isinstance(step, backfill.Progress):
                        context.log.info(step.line())
                        if time.monotonic() - last_report >= MATERIALIZE_EVERY_SECS:
                            _report(context, asset, step, f"backfill {backfill_id} running")
                            last_report = time.monotonic()
                        continue
                    progress = step.progress
                    context.log.info(progress.line())
                    _report(context, asset, progress, f"backfill {backfill_id} {progress.status}")
                    written += progress.events_written
                    if not step.done:
                        problems.append(progress.line())
        except backfill.BackfillError as exc:
            problems.append(str(exc))
            context.log.error(str(exc))
    context.add_output_metadata({"targets": len(chosen), "events_written": written})
    if problems:
        raise dg.Failure("backfill did not finish: " + " | ".join(problems))
    return written


@dg.job(name=BACKFILL_JOB, tags={BACKFILL_TAG: "true"}, executor_def=dg.in_process_executor,
        description="Backfill: existing rows of subscribed tables become READ events of a stream (stream_id), in "
                    "parallel key ranges on Spark, throttled, resumable (launch from the Launchpad). Its runs are "
                    f"tagged {BACKFILL_TAG}=<stream_id> when they start.")
def backfill_job() -> None:
    backfill_rows()
