"""The code location's definitions.

Streams come from ``pgstream.yaml`` and from ``pgstream_dagster.StreamComponent``s (a ``defs.yaml`` in the defs
folder), each with the same definitions wherever declared (:func:`stream_definitions`): deliveries and status assets,
subscription assets, checks (and a lake sink's table asset and check); its reader group's sensor decides for it. The
rest is defined once (:func:`shared_definitions`): the jobs (a replay, backfill or control run names its stream in its
run config), the housekeeping asset, the subscribed tables, the schedules, sensors, executor and resources.

The configuration is read once, at load: the ``pgstream`` resource holds ``pgstream.yaml`` plus every
StreamComponent's stream, validated together (ids and slots unique), so every definition sees the same streams and no
run reads a file. :func:`pgstream_location` is what ``dg.load_from_defs_folder`` loads: it finds the StreamComponents
as :class:`StreamDeclaringComponent`s (this module does not import the component package, which imports it), each of
which builds its own stream's definitions; :func:`build_definitions` builds everything from a ``pgstream.yaml`` alone
(tests, scripts).
"""

from collections.abc import Sequence
from pathlib import Path

import dagster as dg

from ..config import PgstreamConfig, StreamConfig, StreamDeclaration, config_path, load_config, with_streams
from ..engine.spark import location_conf
from .assets import (
    DeclaredIn,
    events_partitions,
    source_table_specs,
    stream_subscription_assets,
    stream_subscription_keys,
)
from .backfill import backfill_job
from .checks import consumers_check, group_slot_checks, orphaned_slots_check, stream_checks
from .controls import control_job
from .jobs import delivery_job, group_delivery_job
from .lake import lake_definitions
from .names import deliveries_asset_key
from .replay import replay_job
from .resources import PgstreamResource, PgstreamSparkResource
from .schedules import checks_job, housekeeping_job, schedules, subscriptions_job, subscriptions_sensor
from .sensors import group_sensors, left_out_sensor
from .status import status_asset_spec


class StreamDeclaringComponent(dg.Component):
    """A component that declares one stream (``declaration``, in the file ``source``):
    :class:`pgstream_dagster.StreamComponent`. The location finds its streams by this type."""

    def __init__(self, declaration: StreamDeclaration, source: str = "<StreamComponent>") -> None:
        self.declaration = declaration
        #: the defs.yaml declaring it (named in errors)
        self.source = source

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        """The stream's definitions (:func:`stream_definitions`); the shared ones are the location's."""
        return stream_definitions(self.declaration.stream,
                                  DeclaredIn(self.declaration.subscriptions, self.source, "defs.yaml"))


def stream_definitions(stream: StreamConfig, declared: DeclaredIn) -> dg.Definitions:
    """Everything of one stream (``declared``: the file that declares it, with its subscriptions)."""
    subs = declared.of_stream(stream.id)
    deliveries = dg.AssetSpec(
        key=deliveries_asset_key(stream.id), group_name="pgstream", kinds={"postgres", "spark"},
        deps=list(stream_subscription_keys(stream.id, subs).values()),
        description=f"Events of stream {stream.id} delivered to its {stream.sink.type} sink; a run's first round "
                    f"is one materialization, its later rounds one at most every "
                    f"{stream.delivery.tuning.report_every_secs:g} s (delivery.tuning.report_every_secs) and one when "
                    f"it ends.",
        metadata={"stream_id": stream.id, "sink_type": stream.sink.type, "reader_group": stream.reader,
                  "batch_max_size": stream.batch.max_size, "ordering": stream.delivery.ordering,
                  "mode": stream.delivery.mode})
    lake_assets, lake_checks = lake_definitions(stream)
    return dg.Definitions(
        assets=[deliveries, status_asset_spec(stream.id, deliveries.key),
                stream_subscription_assets(stream.id, declared), *lake_assets],
        asset_checks=[stream_checks(stream, subs), *lake_checks],
    )


def shared_definitions(config: PgstreamConfig, path: Path) -> dg.Definitions:
    """The definitions of the location, defined once, for every stream of ``config`` (read from
    ``path`` and the StreamComponents)."""
    subscriptions = subscriptions_job(config)
    return dg.Definitions(
        assets=[events_partitions, *source_table_specs(config)],
        asset_checks=[orphaned_slots_check, consumers_check, *group_slot_checks(list(config.streams))],
        jobs=[delivery_job, group_delivery_job, replay_job, backfill_job, control_job, housekeeping_job, checks_job,
              subscriptions],
        schedules=schedules(config),
        sensors=[subscriptions_sensor(config, subscriptions), *group_sensors(list(config.streams))],
        executor=dg.in_process_executor,  # asset and check runs are small; io_manager is in-memory
        resources={
            # ops hand a Spark DataFrame to each other inside one process
            "io_manager": dg.mem_io_manager,
            "pgstream": PgstreamResource(config, str(path)),
            "pyspark": PgstreamSparkResource(spark_config=location_conf(config)),
        },
    )


def location_definitions(path: Path, components: Sequence[StreamDeclaringComponent] = ()) -> dg.Definitions:
    """The streams of ``pgstream.yaml`` at ``path`` and the shared definitions, whose resource also
    holds the streams of ``components`` (validated with pgstream.yaml's: ids and slots unique). The
    components' own definitions are theirs to build (:meth:`StreamComponent.build_defs`)."""
    # a streams[] entry that is invalid on its own leaves that stream out (its sensor tells why), not the others
    config = load_config(path, leave_out_invalid=True)
    merged = with_streams(config, [c.declaration for c in components],
                          f"{path} + {', '.join(sorted({c.source for c in components}))}")
    declared = DeclaredIn(config.subscriptions, str(path), "pgstream.yaml")
    return dg.Definitions.merge(shared_definitions(merged, path),
                                *(stream_definitions(s, declared) for s in config.streams),
                                dg.Definitions(sensors=[left_out_sensor(i, line)
                                                        for i, line in sorted(config.left_out.items())]))


def build_definitions(path: Path | None = None) -> dg.Definitions:
    """Everything of a ``pgstream.yaml`` (default ``$PGSTREAM_CONFIG``): its streams and the shared definitions."""
    return location_definitions((path or config_path()).resolve())


@dg.definitions
def pgstream_location(context: dg.ComponentLoadContext) -> dg.Definitions:
    """``pgstream.yaml`` ($PGSTREAM_CONFIG) and the shared definitions, for every StreamComponent of
    the project too (import this into a module of your own project's defs folder to get them)."""
    components = context.component_tree.get_all_components(of_type=StreamDeclaringComponent)
    return location_definitions(config_path().resolve(), components)
