"""Asset checks, one multi-asset check per stream (run by the ``pgstream_checks`` schedule, or from the UI):

* on each subscription asset, ``trigger_matches`` (blocking): the subscription is in the database as the YAML declares
  it, and its table's generated trigger (and its copy on each partition) exists, is enabled, carries the md5 of what
  ``pgstream.generated_trigger`` produces now and calls the unmodified generated function;
* on the stream's deliveries asset: ``undelivered_age``, ``not_in_failover`` (WARN) and ``no_dead_letters``.

On ``pgstream/events_partitions``: ``no_orphaned_slots``, ``consumers_within_retention``, and per reader group
``group_<name>_slot_retained_wal`` (one check for the slot its members share: each check is a few event-log writes).
"""

import datetime as dt
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import suppress
from typing import Any

import dagster as dg
import psycopg

from ..config import StreamConfig, SubscriptionConfig, reader_groups
from ..engine import deadletters, status
from ..engine.ledger import groups
from ..engine.ledger import streams as ledger_streams
from ..engine.subscriptions import differences, identity, stored_definition, trigger_state
from ..sinks.base import excerpt
from .assets import stream_subscription_keys
from .names import (
    CONTROL_JOB,
    EVENTS_PARTITIONS_KEY,
    REPLAY_JOB,
    SCHEDULED_CHECKS_TAG,
    checks_op_name,
    deliveries_asset_key,
    group_sensor_name,
    group_slot_check_name,
)
from .resources import PgstreamResource

#: the niceness a scheduled checks run takes: its process (the run worker) yields the CPUs to the deliveries
#: sharing them; a health check can wait a few seconds, an event should not
CHECKS_NICENESS = 10


def _pause(secs: float) -> None:
    """A scheduled checks run's pause before a stream's checks (``checks.streams_per_sec``)."""
    time.sleep(secs)


def _background() -> None:
    """A scheduled checks run's process goes to the background: its niceness raised to
    :data:`CHECKS_NICENESS` (never lowered; where the platform has none, nothing)."""
    if hasattr(os, "setpriority"):
        with suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), CHECKS_NICENESS))


TRIGGER_CHECK = "trigger_matches"
UNDELIVERED_AGE_CHECK = "undelivered_age"
FAILOVER_CHECK = "not_in_failover"
DEAD_LETTERS_CHECK = "no_dead_letters"
ORPHANED_SLOTS_CHECK = "no_orphaned_slots"
CONSUMERS_CHECK = "consumers_within_retention"
#: open dead letters shown in the check's metadata
DEAD_LETTERS_SHOWN = 20


def check_subscription(conn: psycopg.Connection, sub: SubscriptionConfig, key: dg.AssetKey) -> dg.AssetCheckResult:
    """The subscription is stored as declared and its trigger matches its generated definition."""
    stored = stored_definition(conn, sub.stream_id, identity(sub))
    state = trigger_state(conn, sub.schema_name, sub.table_name, sub.operation, sub.trigger_mode)
    problems = (["the subscription is not in pgstream.subscriptions (not applied yet?)"] if stored is None else
                [f"{field} differs from pgstream.yaml (not applied yet?)" for field in differences(sub, stored)]
                + state.problems())
    return dg.AssetCheckResult(
        asset_key=key, check_name=TRIGGER_CHECK, passed=not problems, severity=dg.AssetCheckSeverity.ERROR,
        description="; ".join(problems) or f"{state.trigger_name} on {sub.schema_name}.{sub.table_name} matches",
        metadata={"table": f"{sub.schema_name}.{sub.table_name}", "operation": sub.operation,
                  "trigger": state.trigger_name,
                  "trigger_oid": state.trigger_oid if state.trigger_oid is not None else dg.MetadataValue.null(),
                  "expected_hash": state.expected_hash or "", "installed_hash": state.installed_hash or "",
                  "problems": dg.MetadataValue.json(problems)},
    )


def check_undelivered_age(conn: psycopg.Connection, stream: StreamConfig,
                          ledger_keep_days: int = 7) -> dg.AssetCheckResult:
    """Oldest undelivered event (ledger batches not delivered, plus events newer than anything the
    ledger recorded, i.e. still waiting in the slot) is younger than the SLA."""
    row = status.undelivered_age(conn, stream.id, ledger_keep_days)
    age, batches, events, waiting = row[0], int(row[1]), int(row[2]), int(row[3])
    limit = stream.checks.max_undelivered_age_secs
    passed = age is None or age <= limit
    return dg.AssetCheckResult(
        asset_key=deliveries_asset_key(stream.id), check_name=UNDELIVERED_AGE_CHECK, passed=passed,
        severity=dg.AssetCheckSeverity.ERROR,
        description=("nothing undelivered" if age is None else
                     f"oldest undelivered event is {age:.0f}s old (SLA {limit:.0f}s)"),
        metadata={"oldest_undelivered_age_secs": round(age, 3) if age is not None else dg.MetadataValue.null(),
                  "max_undelivered_age_secs": limit, "undelivered_batches": batches,
                  "undelivered_events": events, "events_waiting_in_slot": waiting},
    )


def group_wal_limit(members: Sequence[StreamConfig]) -> int:
    """The WAL a reader group's slot may hold back: the smallest ``checks.max_retained_wal_bytes`` of its streams."""
    return min(m.checks.max_retained_wal_bytes for m in members)


def check_group_slot(conn: psycopg.Connection, group: str, members: Sequence[StreamConfig]) -> dg.AssetCheckResult:
    """Reader group ``group``'s slot exists, is not lost and retains at most :func:`group_wal_limit` of its
    ``members``; so does the own slot of a member not joined yet (one missing is not a failure)."""
    limit = group_wal_limit(members)
    state = groups.group_state(conn, group)
    own = {m.id: m.own_slot for m in state.members if not m.joined} if state is not None else {}
    registered = {m.id for m in state.members} if state is not None else set()
    # a stream of the configuration the group's sensor has not registered yet still reads its own slot, if any
    own.update({m.id: ledger_streams.stream_slot(conn, m.id) for m in members if m.id not in registered})
    problems: list[str] = []
    slots: list[dict[str, Any]] = []
    if state is None:
        problems.append(f"reader group {group} has no slot yet (its sensor, {group_sensor_name(group)}, creates it "
                        f"at its first tick)")
    for slot, stream_id in ([(state.slot, None)] if state is not None else []) + [(v, k) for k, v in own.items()]:
        row = status.slot_wal(conn, slot)
        if row is None:
            if stream_id is None:
                problems.append(f"slot {slot} does not exist")
            continue
        wal_status, retained = row[0], int(row[1] or 0)
        whose = f"stream {stream_id}'s own slot {slot} (not joined yet)" if stream_id is not None else f"slot {slot}"
        if wal_status == "lost":
            problems.append(f"{whose} is lost: its WAL was removed")
        elif retained > limit:
            problems.append(f"{whose} retains {retained} bytes of WAL (limit {limit})")
        slots.append({"slot": slot, "stream": stream_id, "wal_status": wal_status or "", "retained_bytes": retained,
                      "active": bool(row[2])})
    group_slot = next((s for s in slots if s["stream"] is None), None)
    return dg.AssetCheckResult(
        asset_key=EVENTS_PARTITIONS_KEY, check_name=group_slot_check_name(group), passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        description="; ".join(problems) or (f"slot {group_slot['slot']} retains {group_slot['retained_bytes']} "
                                            f"bytes of WAL (limit {limit})" if group_slot else ""),
        metadata={"group": group, "slot": state.slot if state is not None else dg.MetadataValue.null(),
                  "members": len(members), "max_retained_wal_bytes": limit,
                  "retained_bytes": group_slot["retained_bytes"] if group_slot else dg.MetadataValue.null(),
                  "slots": dg.MetadataValue.json(slots)},
    )


def check_failover(conn: psycopg.Connection, stream: StreamConfig) -> dg.AssetCheckResult:
    """The stream is not in failover (``pgstream.streams.failover_since`` is null)."""
    row = status.failover_state(conn, stream.id)
    if row is None:
        passed, description = False, f"stream {stream.id} is not in pgstream.streams (run pgstream-dagster init)"
        metadata: dict[str, Any] = {}
    else:
        passed = row[0] is None
        description = "not in failover" if passed else f"in failover since {row[0].isoformat()}"
        metadata = {"failover_since": row[0].isoformat() if row[0] else dg.MetadataValue.null(),
                    "failover_checkpoint_id": row[1] if row[1] is not None else dg.MetadataValue.null()}
    return dg.AssetCheckResult(
        asset_key=deliveries_asset_key(stream.id), check_name=FAILOVER_CHECK, passed=passed,
        severity=dg.AssetCheckSeverity.WARN, description=description, metadata=metadata,
    )


_DEAD_LETTER_COLUMNS = dg.TableSchema(columns=[
    dg.TableColumn("id", "int"), dg.TableColumn("event_id", "int"), dg.TableColumn("stage", "string"),
    dg.TableColumn("position", "string"), dg.TableColumn("attempts", "int"), dg.TableColumn("since", "string"),
    dg.TableColumn("error", "string")])


def check_dead_letters(conn: psycopg.Connection, stream: StreamConfig) -> dg.AssetCheckResult:
    """No open dead letter: every event the stream went on without was redelivered or discarded."""
    count, oldest = deadletters.count_open(conn, stream.id)
    first = deadletters.list_dead_letters(conn, stream.id, "open", limit=DEAD_LETTERS_SHOWN) if count else []
    metadata: dict[str, Any] = {"open_dead_letters": count}
    if oldest is not None:
        metadata["oldest_dead_letter_at"] = dg.MetadataValue.timestamp(oldest)
        metadata["oldest_dead_letter_age_secs"] = round((dt.datetime.now(dt.UTC) - oldest).total_seconds(), 1)
        metadata["dead_letters"] = dg.MetadataValue.table(
            [dg.TableRecord({"id": d.id, "event_id": d.event_id, "stage": d.stage, "position": d.position,
                             "attempts": d.attempts, "since": d.created_at.isoformat(),
                             "error": excerpt(d.error, 200)}) for d in first],
            schema=_DEAD_LETTER_COLUMNS)
    shown = f" (first {len(first)} in the metadata)" if count > len(first) else ""
    return dg.AssetCheckResult(
        asset_key=deliveries_asset_key(stream.id), check_name=DEAD_LETTERS_CHECK, passed=count == 0,
        severity=dg.AssetCheckSeverity.ERROR,
        description=("no open dead letters" if count == 0 else
                     f"{count} open dead letters{shown}, oldest since {oldest:%Y-%m-%d %H:%M:%S%z}: redeliver them "
                     f"(job {REPLAY_JOB}, stream_id: {stream.id}, dead_letters: true) or discard them (job "
                     f"{CONTROL_JOB}, action discard_dead_letters)"),
        metadata=metadata,
    )


def stream_checks(stream: StreamConfig, subs: Sequence[SubscriptionConfig]) -> dg.AssetChecksDefinition:
    """The stream's checks (``subs``: its subscriptions)."""
    keys = stream_subscription_keys(stream.id, subs)
    deliveries = deliveries_asset_key(stream.id)
    specs = [dg.AssetCheckSpec(TRIGGER_CHECK, asset=keys[identity(s)], blocking=True,
                               description="The subscription is applied and its generated trigger exists, is "
                                           "enabled and matches its definition.")
             for s in subs]
    # (the stream's slot is its reader group's: checked once, for every member, by group_slot_check)
    specs += [dg.AssetCheckSpec(name, asset=deliveries, description=said) for name, said in (
        (UNDELIVERED_AGE_CHECK, f"Oldest undelivered event younger than "
                                f"{stream.checks.max_undelivered_age_secs:.0f}s."),
        (FAILOVER_CHECK, "The stream is not in failover."),
        (DEAD_LETTERS_CHECK, "No open dead letter: every event the stream went on without (rejected by the sink, "
                             "unreadable, set aside) was redelivered or discarded."))]

    @dg.multi_asset_check(name=checks_op_name(stream.id), specs=specs, can_subset=True,
                          description=f"Health of stream {stream.id}: subscription triggers, backlog, slot, failover, "
                                      f"dead letters.")
    def _checks(context: dg.AssetCheckExecutionContext,
                pgstream: dg.ResourceParam[PgstreamResource]) -> Iterator[dg.AssetCheckResult]:
        selected = context.selected_asset_check_keys
        rate = pgstream.config.checks.streams_per_sec
        if context.run.tags.get(SCHEDULED_CHECKS_TAG) == "true":  # (the run's own process: the run worker)
            _background()
            if rate > 0:
                _pause(1 / rate)  # (the run's streams are checked one after the other: in-process executor)
        with pgstream.connect() as conn:
            for sub in subs:
                key = keys[identity(sub)]
                if dg.AssetCheckKey(key, TRIGGER_CHECK) in selected:
                    yield check_subscription(conn, sub, key)
            if dg.AssetCheckKey(deliveries, UNDELIVERED_AGE_CHECK) in selected:
                yield check_undelivered_age(conn, stream, pgstream.config.housekeeping.ledger_keep_days)
            if dg.AssetCheckKey(deliveries, FAILOVER_CHECK) in selected:
                yield check_failover(conn, stream)
            if dg.AssetCheckKey(deliveries, DEAD_LETTERS_CHECK) in selected:
                yield check_dead_letters(conn, stream)

    return _checks


def group_slot_check(group: str, members: Sequence[StreamConfig]) -> dg.AssetChecksDefinition:
    """Reader group ``group``'s slot check (``members``: the streams naming it), on the location's asset."""
    limit = group_wal_limit(members)

    @dg.asset_check(asset=EVENTS_PARTITIONS_KEY, name=group_slot_check_name(group), blocking=False,
                    description=f"Reader group {group}'s slot, read once for its {len(members)} streams, exists and "
                                f"retains at most {limit} bytes of WAL (the smallest checks.max_retained_wal_bytes "
                                f"of its streams); so does the own slot of a stream still joining the group.")
    def _check(pgstream: dg.ResourceParam[PgstreamResource]) -> dg.AssetCheckResult:
        with pgstream.connect() as conn:
            return check_group_slot(conn, group, members)

    return _check


def group_slot_checks(streams: Sequence[StreamConfig]) -> list[dg.AssetChecksDefinition]:
    """One slot check per reader group named by ``streams[].reader``."""
    return [group_slot_check(name, members) for name, members in reader_groups(streams).items()]


@dg.asset_check(asset=EVENTS_PARTITIONS_KEY, name=ORPHANED_SLOTS_CHECK, blocking=False,
                description="No replication slot of this database named like a stream's default slot is left "
                            "without a stream (a deleted stream's or a changed slot_name's old slot keeps its WAL "
                            "until dropped), and no standby of a multi-host database_url holds a slot of pgstream's "
                            "it did not synchronize (a former primary's, kept through pg_rewind).")
def orphaned_slots_check(pgstream: dg.ResourceParam[PgstreamResource]) -> dg.AssetCheckResult:
    with pgstream.connect() as conn:
        slots = status.orphaned_slots(conn)
    on_standbys = status.standby_slots(pgstream.database_url)
    retained = sum(s["retained_bytes"] for s in [*slots, *on_standbys])
    said = [f"{len(slots)} slots no stream reads retain {sum(s['retained_bytes'] for s in slots)} bytes of WAL: "
            f"{', '.join(s['slot_name'] for s in slots)}; drop each once no consumer needs it "
            "(select pg_catalog.pg_drop_replication_slot('<name>'))"] if slots else []
    said += [status.render_standby_slots(on_standbys).strip()] if on_standbys else []
    return dg.AssetCheckResult(
        passed=not said, severity=dg.AssetCheckSeverity.ERROR,
        description="; ".join(said) or "every default-named slot of this database belongs to a stream",
        metadata={"slots": dg.MetadataValue.json(slots), "standby_slots": dg.MetadataValue.json(on_standbys),
                  "retained_bytes": retained},
    )


@dg.asset_check(asset=EVENTS_PARTITIONS_KEY, name=CONSUMERS_CHECK, blocking=False,
                description="Every registered consumer (a Spark source query) has read what is older than its "
                            "max_retention_days: housekeeping keeps what a consumer has not read only that long, "
                            "then drops it anyway (an abandoned consumer must not fill the disk).")
def consumers_check(pgstream: dg.ResourceParam[PgstreamResource]) -> dg.AssetCheckResult:
    with pgstream.connect() as conn:
        readers = status.consumers(conn)
    overrun = [c for c in readers if c["overrun"]]
    return dg.AssetCheckResult(
        passed=not overrun, severity=dg.AssetCheckSeverity.ERROR,
        description=("; ".join(status.render_consumer(c) for c in overrun) if overrun else
                     f"{len(readers)} registered consumers, none past its retention bound"),
        metadata={"consumers": len(readers), "overrun": [c["name"] for c in overrun],
                  "max_lag_events": max((int(c["lag_events"]) for c in readers), default=0)},
    )
