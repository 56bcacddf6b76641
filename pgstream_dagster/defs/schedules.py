"""Automation: the housekeeping and checks schedules, and the sensor that applies subscription edits.

* ``pgstream_housekeeping`` (``housekeeping.cron``, UTC): materializes ``pgstream/events_partitions``
  (partitions ahead, expired partitions dropped, ledger pruned);
* ``pgstream_checks`` (``checks.cron``, UTC): runs every asset check of the location;
* ``pgstream_subscriptions``: an automation condition sensor over the subscription assets, running by
  default, so a new or edited subscription in pgstream.yaml is applied without anyone clicking.
"""

import warnings

import dagster as dg

from ..config import PgstreamConfig
from .assets import subscription_keys, subscription_set_key
from .names import CHECKS_JOB, EVENTS_PARTITIONS_KEY, HOUSEKEEPING_JOB, SUBSCRIPTIONS_SENSOR

housekeeping_job = dg.define_asset_job(
    HOUSEKEEPING_JOB, selection=dg.AssetSelection.assets(EVENTS_PARTITIONS_KEY),
    description="Create daily partitions ahead, drop expired ones, prune the batch ledger.")

checks_job = dg.define_asset_job(
    CHECKS_JOB, selection=dg.AssetSelection.all_asset_checks(),
    description="Run every pgstream asset check: subscription triggers, backlog age, slot WAL, failover.")


def schedules(config: PgstreamConfig) -> list[dg.ScheduleDefinition]:
    return [
        dg.ScheduleDefinition(name=HOUSEKEEPING_JOB, job=housekeeping_job, cron_schedule=config.housekeeping.cron,
                              execution_timezone="UTC", default_status=dg.DefaultScheduleStatus.RUNNING,
                              description="Partition and ledger housekeeping (housekeeping.cron)."),
        dg.ScheduleDefinition(name=CHECKS_JOB, job=checks_job, cron_schedule=config.checks.cron,
                              execution_timezone="UTC", default_status=dg.DefaultScheduleStatus.RUNNING,
                              description="All pgstream asset checks (checks.cron)."),
    ]


def subscriptions_sensor(config: PgstreamConfig) -> dg.AutomationConditionSensorDefinition:
    keys = [k for s in config.streams for k in [*subscription_keys(config, s.id).values(), subscription_set_key(s.id)]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)  # use_user_code_server
        return dg.AutomationConditionSensorDefinition(
            SUBSCRIPTIONS_SENSOR, target=dg.AssetSelection.assets(*keys),
            default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=15,
            use_user_code_server=True,  # the condition has a custom part (CodeVersionOutdated)
            description="Applies new and edited subscriptions of pgstream.yaml (and removes deleted ones).")
