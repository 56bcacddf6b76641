"""Builds the Dagster definitions from a ``pgstream.yaml``: per stream a sensor, a deliveries asset,
a status asset and a replay job; the subscription assets and their checks, housekeeping, the
delivery and operator control jobs, and the resources."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from dagster_pyspark import PySparkResource

from ..config import PgstreamConfig, config_path, load_config
from ..engine.spark import spark_conf
from .assets import deliveries_deps, events_partitions, subscription_assets
from .checks import stream_checks
from .controls import control_job
from .jobs import delivery_job
from .names import deliveries_asset_key
from .replay import replay_job
from .resources import PgstreamResource
from .schedules import checks_job, housekeeping_job, schedules, subscriptions_sensor
from .sensors import stream_sensor
from .status import status_asset_spec


def deliveries_assets(config: PgstreamConfig) -> list[dg.AssetSpec]:
    return [
        dg.AssetSpec(
            key=deliveries_asset_key(s.id),
            group_name="pgstream",
            description=f"Events of stream {s.id} delivered to its {s.sink.type} sink; one materialization "
                        f"per delivered batch.",
            metadata={"stream_id": s.id, "sink_type": s.sink.type, "slot": s.slot,
                      "batch_max_size": s.batch.max_size, "ordering": s.delivery.ordering},
            kinds={"postgres", "spark"},
            deps=deliveries_deps(config, s.id),
        )
        for s in config.streams
    ]


def status_assets(config: PgstreamConfig) -> list[dg.AssetSpec]:
    return [status_asset_spec(s.id, deliveries_asset_key(s.id)) for s in config.streams]


def build_definitions(path: Path | None = None) -> dg.Definitions:
    path = (path or config_path()).resolve()
    config = load_config(path)
    return dg.Definitions(
        assets=[*deliveries_assets(config), *status_assets(config), *subscription_assets(config),
                events_partitions],
        asset_checks=stream_checks(config),
        jobs=[delivery_job, control_job, *[replay_job(s) for s in config.streams], housekeeping_job, checks_job],
        schedules=schedules(config),
        sensors=[*(stream_sensor(s) for s in config.streams), subscriptions_sensor(config)],
        executor=dg.in_process_executor,  # asset and check runs are small; io_manager is in-memory
        resources={
            # ops hand a Spark DataFrame to each other inside one process
            "io_manager": dg.mem_io_manager,
            "pgstream": PgstreamResource(config_path=str(path)),
            "pyspark": PySparkResource(spark_config=spark_conf(config.spark.master, config.spark.remote,
                                                               dict(config.spark.conf))),
        },
    )

