"""Automation: the housekeeping and checks schedules, and the subscriptions job with its sensor.

* ``pgstream_housekeeping`` (``housekeeping.cron``, UTC): materializes ``pgstream/events_partitions``;
* ``pgstream_checks`` (``checks.cron``, UTC): every asset check of the location; a tick due while Dagster or this code
  location was down is not caught up (at a restart it would compete with the streams' first delivery runs);
* ``pgstream_subscriptions``: the job of the subscription assets, and its sensor, which requests a run of the new,
  edited and removed subscriptions of pgstream.yaml: the run applies them as the owner, or checks them as the runtime
  role (``engine.subscriptions.apply_stream``).
"""

import datetime as dt
import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import dagster as dg

from ..config import PgstreamConfig
from . import sensors
from .assets import subscription_keys, subscription_set_key
from .names import (
    CHECKS_JOB,
    EVENTS_PARTITIONS_KEY,
    HOUSEKEEPING_JOB,
    SCHEDULED_CHECKS_TAG,
    SUBSCRIPTIONS_JOB,
    SUBSCRIPTIONS_SENSOR,
)

if TYPE_CHECKING:  # what define_asset_job returns (not exported by dagster)
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

housekeeping_job = dg.define_asset_job(
    HOUSEKEEPING_JOB, selection=dg.AssetSelection.assets(EVENTS_PARTITIONS_KEY),
    description="Create daily partitions ahead, drop expired ones, prune the batch ledger.")

checks_job = dg.define_asset_job(
    CHECKS_JOB, selection=dg.AssetSelection.all_asset_checks(),
    description="Run every pgstream asset check: subscription triggers, backlog age, slot WAL, failover.")


#: a checks tick evaluated later than this after its time was due while the scheduler was down (Dagster's
#: scheduler launches the last missed tick of a schedule when it starts again; it ticks within seconds
#: when it runs)
CATCH_UP_AFTER_SECS = 120.0


def missed_while_down(due: dt.datetime | None, loaded_at: float, now: float) -> str | None:
    """Why a tick due at ``due`` is a catch-up not to run (``None``: run it): it was due before this code
    location was loaded (``loaded_at``: `dg dev` or the deployment was down), or it is evaluated more than
    :data:`CATCH_UP_AFTER_SECS` late (the scheduler was down)."""
    if due is None:  # evaluated by hand (the UI's "test schedule")
        return None
    if due.timestamp() < loaded_at:
        return (f"the tick due at {due.astimezone(dt.UTC):%Y-%m-%d %H:%M} UTC passed while this code location was "
                "not running: not caught up (the next tick runs the checks)")
    late = now - due.timestamp()
    if late > CATCH_UP_AFTER_SECS:
        return (f"the tick due at {due.astimezone(dt.UTC):%Y-%m-%d %H:%M} UTC is evaluated {late:.0f} s "
                "late (the scheduler was down): not caught up (the next tick runs the checks)")
    return None


def schedules(config: PgstreamConfig) -> list[dg.ScheduleDefinition]:
    """``pgstream_housekeeping``, and ``pgstream_checks``: every asset check at ``checks.cron``, no catch-up after
    downtime."""

    @dg.schedule(name=CHECKS_JOB, job=checks_job, cron_schedule=config.checks.cron, execution_timezone="UTC",
                 default_status=dg.DefaultScheduleStatus.RUNNING,
                 description="All pgstream asset checks (checks.cron); a tick missed while Dagster was down is "
                             "not caught up.")
    def _checks(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        why = missed_while_down(context.scheduled_execution_time, sensors.LOADED_AT, time.time())
        return dg.SkipReason(why) if why is not None else dg.RunRequest(tags={SCHEDULED_CHECKS_TAG: "true"})

    return [
        dg.ScheduleDefinition(name=HOUSEKEEPING_JOB, job=housekeeping_job, cron_schedule=config.housekeeping.cron,
                              execution_timezone="UTC", default_status=dg.DefaultScheduleStatus.RUNNING,
                              description="Partition and ledger housekeeping (housekeeping.cron)."),
        _checks,
    ]


#: the subscriptions sensor evaluates at most every this many seconds, and at most every
#: ``SUBSCRIPTION_SECS_PER_ASSET`` times the number of assets it evaluates (a tick reads Dagster's storage twice,
#: whatever the number of streams, but a hundred streams need no more than a tick a minute)
SUBSCRIPTIONS_MIN_INTERVAL_SECS = 15
SUBSCRIPTION_SECS_PER_ASSET = 0.3
#: a subscription whose run failed is requested again when it is edited, else after this many seconds: never in
#: a loop (the cause may be another subscription of the file, or a table not created yet)
RETRY_SECS = 300.0
#: a run of the subscriptions job in one of these: the sensor waits for it
_UNFINISHED = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def _subscription_asset_keys(config: PgstreamConfig) -> list[dg.AssetKey]:
    """Every subscription asset of ``config``'s streams, and each stream's subscription set."""
    return [k for s in config.streams for k in [*subscription_keys(config, s.id).values(), subscription_set_key(s.id)]]


def subscriptions_job(config: PgstreamConfig) -> "UnresolvedAssetJobDefinition":
    """``pgstream_subscriptions``: the runs of the subscription assets, the ones its sensor requests and the ones
    launched by hand from the job's page (Jobs → pgstream_subscriptions → Materialize)."""
    return dg.define_asset_job(
        SUBSCRIPTIONS_JOB, selection=dg.AssetSelection.assets(*_subscription_asset_keys(config)),
        description="Apply the subscriptions of pgstream.yaml when the code location's role may write them (the "
                    "owner's), else check them against what `pgstream-dagster init` applied (the runtime role's); "
                    "a stream's subscription set removes, or checks the removal of, those deleted from the file.")


def due_subscriptions(current: Mapping[dg.AssetKey, str | None], applied: Mapping[dg.AssetKey, str | None],
                      requested: Mapping[str, Sequence[Any]], now: float) -> list[dg.AssetKey]:
    """The subscription assets to run: those whose latest materialization (``applied``: its code version, ``None``:
    never materialized) is not of their ``current`` code version (new, edited; a stream's subscription set: one
    removed), unless ``requested`` for that code version less than :data:`RETRY_SECS` before ``now`` (``requested``:
    by key, the code version and time of the sensor's last request, its cursor)."""
    due = []
    for key, version in current.items():
        if applied.get(key) == version:
            continue
        asked = requested.get(key.to_user_string())
        if asked is not None and asked[0] == version and now - float(asked[1]) < RETRY_SECS:
            continue
        due.append(key)
    return due


def subscriptions_sensor(config: PgstreamConfig, job: "UnresolvedAssetJobDefinition") -> dg.SensorDefinition:
    """``pgstream_subscriptions``: requests a run of ``job`` for the subscription assets :func:`due_subscriptions`
    names, once no run of it is in progress."""
    keys = _subscription_asset_keys(config)
    interval = max(SUBSCRIPTIONS_MIN_INTERVAL_SECS, round(len(keys) * SUBSCRIPTION_SECS_PER_ASSET))

    @dg.sensor(name=SUBSCRIPTIONS_SENSOR, job=job, default_status=dg.DefaultSensorStatus.RUNNING,
               minimum_interval_seconds=interval,
               description="Requests a pgstream_subscriptions run for the subscriptions of pgstream.yaml that are "
                           "new, edited or removed since their last run (which applies them as the owner, or checks "
                           f"them as the runtime role); a failed one again when edited, else after {RETRY_SECS:.0f} s.")
    def _subscriptions(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        repository = context.repository_def
        if repository is None:
            raise dg.DagsterInvariantViolationError(f"{SUBSCRIPTIONS_SENSOR}: evaluated without its repository")
        current = {key: repository.asset_graph.get(key).code_version for key in keys}
        instance = context.instance
        if instance.get_runs_count(dg.RunsFilter(job_name=SUBSCRIPTIONS_JOB, statuses=_UNFINISHED)):
            return dg.SkipReason(f"a {SUBSCRIPTIONS_JOB} run is in progress")
        requested: dict[str, list[Any]] = json.loads(context.cursor) if context.cursor else {}
        now = time.time()
        due = due_subscriptions(current, instance.get_latest_materialization_code_versions(keys), requested, now)
        if not due:
            return dg.SkipReason("every subscription is as its last run applied or checked it")
        names = {key.to_user_string() for key in keys}
        cursor = {name: asked for name, asked in requested.items() if name in names}
        cursor.update({key.to_user_string(): [current[key], now] for key in due})
        return dg.SensorResult(run_requests=[dg.RunRequest(asset_selection=due)],
                               cursor=json.dumps(cursor, sort_keys=True))

    return _subscriptions
