"""Automation: the housekeeping and checks schedules, and the sensor that applies subscription edits.

* ``pgstream_housekeeping`` (``housekeeping.cron``, UTC): materializes ``pgstream/events_partitions``
  (partitions ahead, expired partitions dropped, ledger pruned);
* ``pgstream_checks`` (``checks.cron``, UTC): runs every asset check of the location; a tick that was
  due while Dagster or this code location was down is not caught up when it comes back (the next tick
  runs the checks): at a restart it would compete with the streams' first delivery runs;
* ``pgstream_subscriptions``: an automation condition sensor over the subscription assets, running by
  default, so a new or edited subscription in pgstream.yaml is applied without anyone clicking.
"""

import datetime as dt
import time
import warnings

import dagster as dg

from ..config import PgstreamConfig
from . import sensors
from .assets import subscription_keys, subscription_set_key
from .names import CHECKS_JOB, EVENTS_PARTITIONS_KEY, HOUSEKEEPING_JOB, SCHEDULED_CHECKS_TAG, SUBSCRIPTIONS_SENSOR

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


def checks_schedule(config: PgstreamConfig) -> dg.ScheduleDefinition:
    """``pgstream_checks``: every asset check at ``checks.cron``, no catch-up after downtime."""

    @dg.schedule(name=CHECKS_JOB, job=checks_job, cron_schedule=config.checks.cron, execution_timezone="UTC",
                 default_status=dg.DefaultScheduleStatus.RUNNING,
                 description="All pgstream asset checks (checks.cron); a tick missed while Dagster was down is "
                             "not caught up.")
    def _checks(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        why = missed_while_down(context.scheduled_execution_time, sensors.LOADED_AT, time.time())
        return dg.SkipReason(why) if why is not None else dg.RunRequest(tags={SCHEDULED_CHECKS_TAG: "true"})

    return _checks


def schedules(config: PgstreamConfig) -> list[dg.ScheduleDefinition]:
    return [
        dg.ScheduleDefinition(name=HOUSEKEEPING_JOB, job=housekeeping_job, cron_schedule=config.housekeeping.cron,
                              execution_timezone="UTC", default_status=dg.DefaultScheduleStatus.RUNNING,
                              description="Partition and ledger housekeeping (housekeeping.cron)."),
        checks_schedule(config),
    ]


#: the subscriptions sensor evaluates at most every this many seconds, and at most every
#: ``SUBSCRIPTION_SECS_PER_ASSET`` times the number of assets it evaluates: one evaluation reads Dagster's storage
#: about a dozen times per asset (each read a connection of its own with Postgres storage), so 200 subscription
#: assets (100 streams) evaluated every 15 s were most of the code server's CPU and of Postgres' connections
SUBSCRIPTIONS_MIN_INTERVAL_SECS = 15
SUBSCRIPTION_SECS_PER_ASSET = 0.3


def subscriptions_sensor(config: PgstreamConfig) -> dg.AutomationConditionSensorDefinition:
    keys = [k for s in config.streams for k in [*subscription_keys(config, s.id).values(), subscription_set_key(s.id)]]
    interval = max(SUBSCRIPTIONS_MIN_INTERVAL_SECS, round(len(keys) * SUBSCRIPTION_SECS_PER_ASSET))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)  # use_user_code_server
        return dg.AutomationConditionSensorDefinition(
            SUBSCRIPTIONS_SENSOR, target=dg.AssetSelection.assets(*keys),
            default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=interval,
            use_user_code_server=True,  # the condition has a custom part (CodeVersionOutdated)
            description="Applies new and edited subscriptions of pgstream.yaml (and removes deleted ones).")
