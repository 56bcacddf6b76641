"""The names the Dagster definitions share, defined once: jobs, run tags, asset keys, sensors."""

import dagster as dg

from ..config import stream_object_name

#: run tags
#: the stream of a delivery run (at launch) and of a replay run (added when the run starts: the run config names it);
#: value :func:`stream_tag`, the stream and its database: one at a time per stream (dagster.yaml)
STREAM_TAG = "pgstream/stream"
BATCH_TAG = "pgstream/batch"
REPLAY_TAG = "pgstream/replay"
ATTEMPT_TAG = "pgstream/attempt"
BATCHES_TAG = "pgstream/batches"
#: Dagster's own tag of a run a sensor requested with a run key
RUN_KEY_TAG = "dagster/run_key"
#: a backfill run: ``true`` when launched, the stream id from when the run starts (the run config names it); never
#: pgstream/stream, so deliveries go on meanwhile
BACKFILL_TAG = "pgstream/backfill"
#: a reader group's delivery run (value :func:`group_tag`, group and database): one at a time per group (dagster.yaml)
GROUP_TAG = "pgstream/group"
#: a group delivery run: its members' configuration's fingerprint it was requested with (``streams_fingerprint``)
CONFIG_TAG = "pgstream/config"
#: a reader group's delivery run asked to end (value: why), added once by the group's sensor when the
#: run's configuration is not the code location's any more; the run's stop check ends it gracefully
STOP_TAG = "pgstream/stop"
#: a checks run the ``pgstream_checks`` schedule launched (value ``true``): paced (``checks.streams_per_sec``) and
#: in the background (its process's niceness raised); a checks run launched from the UI is neither
SCHEDULED_CHECKS_TAG = "pgstream/scheduled_checks"

#: jobs
DELIVERY_JOB = "pgstream_delivery"
#: a reader group's delivery run: one process hosting the delivery runs of the group's streams
GROUP_DELIVERY_JOB = "pgstream_group_delivery"
CONTROL_JOB = "pgstream_stream_control"
HOUSEKEEPING_JOB = "pgstream_housekeeping"
CHECKS_JOB = "pgstream_checks"
#: the replay and backfill jobs: one each for the location, the stream in their run config (``stream_id``)
REPLAY_JOB = "pgstream_replay"
BACKFILL_JOB = "pgstream_backfill"
#: their ops (what their run config is under: ``ops: {replay: {config: ...}}``)
REPLAY_OP = "replay"
BACKFILL_OP = "backfill"
#: the runs of the subscription assets, and the sensor that requests them
SUBSCRIPTIONS_JOB = "pgstream_subscriptions"
SUBSCRIPTIONS_SENSOR = SUBSCRIPTIONS_JOB

#: assets
EVENTS_PARTITIONS_KEY = dg.AssetKey(["pgstream", "events_partitions"])


def stream_sensor_name(stream_id: int) -> str:
    """The sensor of a stream whose ``streams[]`` entry is invalid (it tells what is wrong)."""
    return stream_object_name(stream_id)


def stream_tag(stream_id: int, database: str) -> str:
    """The value of :data:`STREAM_TAG` of stream ``stream_id`` of ``database`` (``engine.dbconn.database_key``):
    ``1@db.internal:5432/app`` (stream ids repeat across the databases one Dagster instance serves)."""
    return f"{stream_id}@{database}"


def group_tag(group: str, database: str) -> str:
    """The value of :data:`GROUP_TAG` of reader group ``group`` of ``database``, as :func:`stream_tag`'s:
    ``default@db.internal:5432/app``."""
    return f"{group}@{database}"


def group_sensor_name(group: str) -> str:
    """The sensor of a reader group (``streams[].reader``): it reads the group's slot for its streams."""
    return f"pgstream_group_{group}"


def group_slot_check_name(group: str) -> str:
    """The asset check of a reader group's slot (on ``pgstream/events_partitions``: its members share it)."""
    return f"group_{group}_slot_retained_wal"


#: a group delivery run's tags of its members' runs (:func:`member_tag`)
MEMBER_TAG_PREFIX = "pgstream/member_"


def member_tag(stream_id: int) -> str:
    """The tag of a group delivery run saying what became of the member run of stream ``stream_id`` it
    hosts (a JSON object: ``run_key``, ``state`` running, ended or failed, ``error``)."""
    return f"{MEMBER_TAG_PREFIX}{stream_id}"


def subscriptions_op_name(stream_id: int) -> str:
    """The multi-asset that materializes a stream's subscription assets."""
    return f"{stream_object_name(stream_id)}_subscriptions"


def checks_op_name(stream_id: int) -> str:
    """The multi-asset check of a stream's asset checks."""
    return f"{stream_object_name(stream_id)}_checks"


def deliveries_asset_key(stream_id: int) -> dg.AssetKey:
    return dg.AssetKey(["pgstream", f"stream_{stream_id}", "deliveries"])


def status_asset_key(stream_id: int) -> dg.AssetKey:
    return dg.AssetKey(["pgstream", f"stream_{stream_id}", "status"])


def lake_table_asset_key(stream_id: int) -> dg.AssetKey:
    """The lake table (delta, iceberg, parquet sink) a stream's deliveries write."""
    return dg.AssetKey(["pgstream", f"stream_{stream_id}", "lake_table"])


#: the lake table's check: per-day counts against pgstream.events
LAKE_COUNTS_CHECK = "lake_day_counts"
