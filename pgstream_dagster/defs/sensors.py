"""One sensor per reader group (``streams[].reader``, default ``default``) for all its members: it records what
commits on the group's slot as each member's ledger batches and decides the members' delivery runs, one at a time per
stream, in order; the group's delivery run hosts them (a member in mode per_batch has Dagster runs of its own).

A group's tick, repeated for up to ``sensor.tick_budget_secs``:

1. **ingest** (``engine/ingest/group.py``), while the group delivery run's reader does not: make sure the group's slot
   exists and is usable (a missing or invalidated one is recreated, what the ledger does not cover recovered from the
   table), let a stream that had a slot of its own join, record the waiting transactions as batches and advance the
   slot, so WAL is released whatever the sinks do;
2. **decide**, for each member, after each slice of reading (:func:`step`): the streams' states in one query, the run
   each points at as a :class:`~..engine.batches.RunView` (a dead one is reported failed at once), and the pure
   :func:`~..engine.batches.decide` chooses: wait, launch a run, hand new batches to the open run, request a lost run
   again, fail a run (failover), leave failover once caught up;
3. **apply** it (``ledger.state.apply``): a run of a member in mode per_batch becomes a ``RunRequest`` (``run_key`` =
   stream, installation, batches, attempt: a re-evaluated tick requests nothing twice); the group's delivery run is
   requested when none is live.

Each tick also updates the cursor (per member: the last event id and LSN recorded, the backlog) and observes a
member's status asset when its state changed or it is due.
"""

import datetime as dt
import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dagster as dg
import psycopg

from ..config import StreamConfig, reader_groups, streams_fingerprint
from ..engine import limits, replication
from ..engine.batches import NO_RUN, RunOrder, RunStatus, RunView, StreamState, decide, tick_notes
from ..engine.collector import fewer_collections
from ..engine.dbconn import database_key, describe_url, error_line, server_gone
from ..engine.delivery.group import READ_RETRY_SECS, handover_lead, member_run_id
from ..engine.ingest import GroupResult, consume_group, group_log, unconfigured
from ..engine.ledger import groups, locks
from ..engine.ledger import state as ledger_state
from ..engine.limits import LimitsExceeded
from ..engine.replication import PublicationTaken, SlotCreationWaits
from ..engine.status import last_batches, phase, stream_status
from .jobs import delivery_job, group_delivery_job
from .limits import hand_over_blocked
from .names import (
    ATTEMPT_TAG,
    BATCH_TAG,
    BATCHES_TAG,
    CONFIG_TAG,
    DELIVERY_JOB,
    GROUP_DELIVERY_JOB,
    GROUP_TAG,
    RUN_KEY_TAG,
    STOP_TAG,
    STREAM_TAG,
    group_sensor_name,
    group_tag,
    member_tag,
    stream_sensor_name,
    stream_tag,
)
from .resources import PgstreamResource
from .status import status_observation

_FAILED = {dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
#: a run Dagster shows live (not yet ended)
LIVE = {dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING,
        dg.DagsterRunStatus.STARTED}
#: the run tag and value Dagster sets on a run whose process was interrupted (SIGINT/SIGTERM) with no
#: termination requested (dagster._core.storage.tags.RUN_FAILURE_REASON_TAG, RunFailureReason)
FAILURE_REASON_TAG = "dagster/failure_reason"
_INTERRUPTED = "UNEXPECTED_TERMINATION"
#: when this code location was loaded (epoch seconds): `dg dev` (or a deployment) started it, or reloaded it
LOADED_AT = time.time()


def _interrupted_before_load(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """The run was interrupted (SIGINT/SIGTERM, no termination requested) and ended before this code
    location was loaded: stopped by the shutdown that preceded this start, not by anything of its batch (one
    interrupted later backs off as any failure: a retry requested during a shutdown would fail to launch)."""
    if run.tags.get(FAILURE_REASON_TAG) != _INTERRUPTED:
        return False
    record = instance.get_run_record_by_id(run.run_id)
    return record is not None and record.end_time is not None and record.end_time < LOADED_AT


#: how long a group's tick reads the group's slot before it decides for the members again
DECIDE_EVERY_SECS = 1.0
#: while the group delivery run's reader records, how often a group's tick looks for a member's batch waiting for a
#: decision (one indexed query): a member without a run gets its first batch's run within this, not at the next tick
LAUNCH_LOOK_SECS = 0.5


def _request(order: RunOrder, database: str) -> dg.RunRequest:
    """The Dagster run of a member in mode per_batch (the design card's run per batch) of ``database``."""
    head, batch_ids = order.head, order.batch_ids
    config: dict[str, int] = {"stream_id": head.stream_id, "batch_id": batch_ids[0]}
    if len(batch_ids) > 1:
        config["through_batch_id"] = batch_ids[-1]
    return dg.RunRequest(
        run_key=order.run_key, job_name=DELIVERY_JOB, run_config={"ops": {"load_batches": {"config": config}}},
        tags={STREAM_TAG: stream_tag(head.stream_id, database), BATCH_TAG: str(head.id),
              ATTEMPT_TAG: str(order.attempt), BATCHES_TAG: str(len(batch_ids))})


def run_failure_message(instance: dg.DagsterInstance, run_id: str) -> str | None:
    """The error of the run's failed step (e.g. the sink's answer), for status and the UI."""
    for record in instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE, limit=1).records:
        event = record.event_log_entry.dagster_event
        data = event.step_failure_data if event else None
        error = data.error if data is not None else None
        while error is not None and error.cause is not None:  # the root cause, e.g. the sink's answer
            error = error.cause
        if error is not None and error.message.strip():
            return error.message.strip().splitlines()[0][:500]
    return None


def _not_taken(instance: dg.DagsterInstance, run: dg.DagsterRun, grace: float, now: float) -> tuple[bool, str]:
    """A started run that has taken no delivery lease yet: whether ``grace`` has passed since it started
    (it is dead), and how long ago it started."""
    record = instance.get_run_record_by_id(run.run_id)
    started = record.start_time if record else None
    age = now - started if started is not None else 0.0
    return (started is not None and age >= grace,
            f"started {age:.0f} s ago, has not taken its delivery lease yet (run_grace_secs {grace:g})")


#: a lease found lost is looked at again for up to this long before its run is taken for dead: a group delivery
#: run that rode out the database's absence (a restart, a failover) takes its lease, and its members', again within
#: a moment of the database accepting writes (engine/delivery/group.py, OUTAGE_RETRY_SECS)
LOST_RECHECK_SECS = 2.0


def _looked_again(look: Callable[[], dict[str, locks.LeaseState]]) -> dict[str, locks.LeaseState]:
    """``look()`` (lease states by run id), again every 0.1 s while one is LOST, up to :data:`LOST_RECHECK_SECS`."""
    deadline = time.monotonic() + LOST_RECHECK_SECS
    while locks.LeaseState.LOST in (states := look()).values() and time.monotonic() < deadline:
        time.sleep(0.1)
    return states


def _group_lease(conn: psycopg.Connection, group: str, run_id: str) -> dict[str, locks.LeaseState]:
    return {run_id: locks.group_lease_state(conn, group, run_id)}


def _run_view(conn: psycopg.Connection, instance: dg.DagsterInstance, run: dg.DagsterRun | None,
              stream: StreamConfig, now: dt.datetime) -> tuple[RunView, str | None]:
    """What :func:`decide` needs to know of the Dagster run ``run``, and what it is doing (for the skip reason)."""
    if run is None:
        return NO_RUN, None
    if run.status == dg.DagsterRunStatus.STARTED:
        # by its delivery lease: dead at once when the backend that held it has ended (its process died, or
        # Postgres restarted under it: it can record nothing more); one that has not taken it yet is given
        # delivery.run_grace_secs from its start. A dead one is reported failed by step().
        state = locks.lease_state(conn, run.run_id)
        if state is locks.LeaseState.HELD:
            return RunView(RunStatus.LIVE, run.run_id), f"run {run.run_id} (it holds the delivery lease)"
        if state is locks.LeaseState.LOST:
            dead = ("the database session holding its delivery lease has ended (its process died, or Postgres "
                    "restarted): it delivers nothing more")
        else:
            grace = stream.delivery.run_grace_secs
            late, doing = _not_taken(instance, run, grace, now.timestamp())
            if not late:
                return RunView(RunStatus.LIVE, run.run_id), f"run {run.run_id}: {doing}"
            dead = f"no delivery lease {grace:g} s after it started (delivery.run_grace_secs): its process died"
        return RunView(RunStatus.DEAD, run.run_id, dg.DagsterRunStatus.FAILURE.value, dead), None
    if run.status in LIVE:
        return RunView(RunStatus.LIVE, run.run_id), f"run {run.run_id} ({run.status.value.lower()})"
    if run.status in _FAILED:
        return (RunView(RunStatus.FAILED, run.run_id, run.status.value, run_failure_message(instance, run.run_id),
                        interrupted=_interrupted_before_load(instance, run)), None)
    if run.status == dg.DagsterRunStatus.SUCCESS:
        return RunView(RunStatus.SUCCEEDED, run.run_id), None
    return RunView(RunStatus.OTHER, run.run_id), f"run {run.run_id} ({run.status.value.lower()})"


def _group_runs(instance: dg.DagsterInstance, conn: psycopg.Connection, group: str,
                limit: int = 20) -> list[dg.DagsterRun]:
    """The reader group's delivery runs (of ``conn``'s database), newest first."""
    return list(instance.get_runs(dg.RunsFilter(job_name=GROUP_DELIVERY_JOB,
                                                tags={GROUP_TAG: group_tag(group, database_key(conn))}), limit=limit))


@dataclass(frozen=True)
class GroupLook:
    """What a reader group's sensor reads once a tick for all its members: the group's newest delivery runs
    and the delivery leases of the member runs they host."""

    runs: list[dg.DagsterRun]
    leases: dict[str, locks.LeaseState]

    @classmethod
    def of(cls, conn: psycopg.Connection, instance: dg.DagsterInstance, group: str,
           streams: list[StreamConfig]) -> "GroupLook":
        runs = _group_runs(instance, conn, group, limit=3)
        ids = [member_run_id(r.run_id, s.id) for r in runs if r.status == dg.DagsterRunStatus.STARTED
               for s in streams]
        if not ids:
            return cls(runs, {})
        leases = locks.lease_states(conn, ids)
        # members' leases lost with their group run's: it may be riding out the database's absence (it takes them
        # again with its own); a member's lease lost under a group run holding its own is told at once
        if locks.LeaseState.LOST in leases.values() and any(
                locks.group_lease_state(conn, group, r.run_id) is not locks.LeaseState.HELD
                for r in runs if r.status == dg.DagsterRunStatus.STARTED):
            leases = _looked_again(lambda: locks.lease_states(conn, ids))
        return cls(runs, leases)


def _member_host(instance: dg.DagsterInstance, conn: psycopg.Connection, group: str, stream_id: int,
                 run_key: str, look: GroupLook) -> tuple[dg.DagsterRun, dict[str, Any]] | None:
    """The group delivery run that took member run ``run_key`` of stream ``stream_id``, and its member tag: the
    newest group runs first (``look.runs``, read once for all members: nearly always one of them), then older ones."""
    for newest in (True, False):
        for run in look.runs if newest else _group_runs(instance, conn, group, limit=100):
            raw = run.tags.get(member_tag(stream_id))
            member = json.loads(raw) if raw else {}
            if member.get("run_key") == run_key:
                return run, member
    return None


def _member_view(conn: psycopg.Connection, instance: dg.DagsterInstance, stream: StreamConfig,
                 run_key: str, look: GroupLook) -> tuple[RunView, str | None] | None:
    """The member run ``run_key`` of a reader group's stream: what its group delivery run's member tag says, the group
    run's status and, while it is started, the member's delivery lease (lost: dead). None: no group run took it yet."""
    found = _member_host(instance, conn, stream.reader, stream.id, run_key, look)
    if found is None:
        return None
    run, member = found
    member_id = member_run_id(run.run_id, stream.id)
    if member.get("state") == "failed":
        return RunView(RunStatus.FAILED, member_id, dg.DagsterRunStatus.FAILURE.value, member.get("error")), None
    if member.get("state") == "ended":
        return RunView(RunStatus.SUCCEEDED, member_id), None
    if run.status == dg.DagsterRunStatus.STARTED:
        state = look.leases[member_id] if member_id in look.leases else locks.lease_state(conn, member_id)
        if state is locks.LeaseState.LOST:
            return RunView(RunStatus.DEAD, member_id, dg.DagsterRunStatus.FAILURE.value,
                           "the database session holding its delivery lease has ended (the group delivery run's "
                           "process died, or Postgres restarted): it delivers nothing more"), None
        held = "it holds the delivery lease" if state is locks.LeaseState.HELD else "starting"
        return RunView(RunStatus.LIVE, member_id), f"member run {member_id} ({held})"
    if run.status in LIVE:
        return RunView(RunStatus.LIVE, member_id), f"member run {member_id} ({run.status.value.lower()})"
    error = run_failure_message(instance, run.run_id) or f"group delivery run {run.run_id} is {run.status.value}"
    return RunView(RunStatus.FAILED, member_id, run.status.value, error,
                   interrupted=run.status in _FAILED and _interrupted_before_load(instance, run)), None


def _waiting_member(stream: StreamConfig, run_key: str) -> tuple[RunView, str]:
    """A member run no group run took yet: it waits for the group's delivery run (requested when none is live)."""
    return RunView(RunStatus.LIVE, run_key), f"the delivery run of reader group {stream.reader} to take run {run_key}"


def step(conn: psycopg.Connection, instance: dg.DagsterInstance, stream: StreamConfig, log: list[str],
         said: dict[str, Any], look: GroupLook, state: StreamState | None) -> tuple[dg.RunRequest | None, str | None]:
    """One decision: read the stream's state (unless given), look at its run in Dagster, decide, apply; the run to
    request, if any, and what the run the stream waits for is doing (for the skip reason). ``log`` gets the tick log's
    lines (``said``: what was said before, :func:`~..engine.batches.tick_notes`); ``look`` and ``state``: read once
    for all the group's members. A dead run is reported failed to Dagster as soon as it is seen."""
    if state is None:
        state = ledger_state.stream_state(conn, stream.id, stream.delivery.max_events_per_run)
    now = dt.datetime.now(dt.UTC)
    key = state.watched_run_key
    # an open run is hosted by the group's delivery run; a run in mode per_batch (or one requested
    # before the stream joined its group) is a Dagster run of its own
    member = _member_view(conn, instance, stream, key, look) if key else None
    runs = instance.get_runs(dg.RunsFilter(tags={RUN_KEY_TAG: key}), limit=1) if member is None and key else []
    run = runs[0] if runs else None
    if member is not None:
        view, doing = member
    elif run is None and stream.delivery.keeps_open and key:
        # (a member in mode per_batch has Dagster runs of its own: one requested that Dagster does not have was
        # lost, and is requested again below, as a stream's own)
        view, doing = _waiting_member(stream, key)
    else:
        view, doing = _run_view(conn, instance, run, stream, now)
    action = decide(state, view, now, stream)
    if view.status is RunStatus.DEAD and run is not None:
        instance.report_run_failed(run, f"pgstream: run {run.run_id} of stream {stream.id} died: {view.error}")
        log.append(f"stream {stream.id}: run {run.run_id} died ({view.error}); marked failed")
    waiting = f"waiting for {doing}" if doing is not None and state.head is not None else None
    log.extend(tick_notes(action, said, time.time()))
    order = ledger_state.apply(conn, stream, action)
    if order is None or stream.delivery.keeps_open:
        return None, waiting  # an open run: the group's delivery run hosts it
    # mode per_batch: a run of its own (the design card's run per batch)
    return _request(order, database_key(conn)), waiting


def open_run_state(conn: psycopg.Connection, instance: dg.DagsterInstance, run_key: str, stream: StreamConfig,
                   look: GroupLook) -> str:
    """What became of the stream's open run (its member run in the group's delivery run), for the status
    asset: ``live`` (it holds the delivery lease), ``starting`` (not delivering yet), or ``gone`` with why."""
    view, doing = _member_view(conn, instance, stream, run_key, look) or _waiting_member(stream, run_key)
    if view.status is RunStatus.LIVE:
        held = doing is not None and "holds the delivery lease" in doing
        return f"{'live' if held else 'starting'}: {doing}"
    return f"gone: member run {view.run_id} {view.status.value}" + (f" ({view.error})" if view.error else "")


#: what the status asset shows that a new observation must not wait for: the state (the counts wait until due)
_SEEN_STATE = ("state", "open_dead_letters", "open_run_key", "failover_attempts", "wal_status")
#: a reader group's sensor observes its members' changed counts at most this many times a second together (each
#: observation is a few writes to Dagster's event log; the state, when it changes, at once): a member's counts
#: are observed every ``max(sensor.status_every_secs, members / OBSERVATIONS_PER_SEC)`` seconds
OBSERVATIONS_PER_SEC = 5.0
#: and at most this many in one tick of the group's sensor
OBSERVATIONS_PER_TICK = 10


def _observe_status(conn: psycopg.Connection, instance: dg.DagsterInstance, stream: StreamConfig,
                    row: dict[str, Any], cursor: dict[str, Any], look: GroupLook,
                    members: int) -> dg.AssetObservation | None:
    """An observation of the stream status asset, a member of a reader group of ``members`` streams, when its state
    changed or it is due (``sensor.status_every_secs``, at least ``members / OBSERVATIONS_PER_SEC`` seconds)."""
    run_state = (open_run_state(conn, instance, row["open_run_key"], stream, look) if row.get("open_run_key")
                 else None)
    # (a digest: a group's cursor holds one per member)
    seen = hashlib.sha1(json.dumps([*(row.get(k) for k in _SEEN_STATE), run_state], default=str).encode()).hexdigest()
    every = max(stream.sensor.status_every_secs, members / OBSERVATIONS_PER_SEC)
    due = time.time() - float(cursor.get("status_at", 0)) >= every
    if not due and cursor.get("status_seen") == seen:
        return None
    # a group's members each at their own phase of the period (not a hundred observations in one tick)
    cursor["status_at"] = time.time() - every * phase(stream.id)
    cursor["status_seen"] = seen
    return status_observation({**row, "last_batches": last_batches(conn, stream.id, 5)}, run_state)


#: how often the sensor of a stream whose entry is invalid tells it (:func:`left_out_sensor`)
LEFT_OUT_TELL_SECS = 30


def left_out_sensor(stream_id: int, problem: str) -> dg.SensorDefinition:
    """The sensor of a stream whose ``streams[]`` entry is invalid (the code location left it out, the other
    streams go on): each tick tells ``problem`` in one line (log and skip reason), and does nothing else. The
    stream's events wait for the entry to be fixed: its group records them meanwhile."""
    line = f"stream {stream_id} is left out: its streams[] entry is invalid: {problem}"

    @dg.sensor(name=stream_sensor_name(stream_id), minimum_interval_seconds=LEFT_OUT_TELL_SECS,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"{line}. Fix the entry and reload the code location.")
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SkipReason:
        context.log.error(line)
        return dg.SkipReason(line)

    return _sensor


# --- a reader group's sensor ------------------------------------------------------------------------

def _ask_to_end(instance: dg.DagsterInstance, run: dg.DagsterRun, group: str, fingerprint: str,
                log: list[str]) -> str:
    """A live group run requested with another configuration than the code location's (its
    :data:`~.names.CONFIG_TAG`) is asked to end, once (:data:`~.names.STOP_TAG`, logged when added): its
    members' runs close as at ``max_run_secs``. What the skip reason adds ('' for the current configuration)."""
    if run.tags.get(CONFIG_TAG) == fingerprint:
        return ""
    if STOP_TAG not in run.tags:
        reason = (f"the configuration of its streams changed ({CONFIG_TAG} {run.tags.get(CONFIG_TAG) or 'none'}, "
                  f"the code location's {fingerprint})")
        instance.add_run_tags(run.run_id, {STOP_TAG: reason})
        log.append(f"reader group {group}: group delivery run {run.run_id} asked to end: {reason}; a fresh one is "
                   f"requested once it has ended")
    return "; asked to end (configuration changed)"


def group_delivery(conn: psycopg.Connection, instance: dg.DagsterInstance, group: str, streams: list[StreamConfig],
                   log: list[str], left_out: dict[int, str]) -> tuple[dg.RunRequest | None, str]:
    """The group's delivery run: the one live (queued, starting, or started and holding the group's delivery lease),
    or one to request (with the members' :data:`~.names.CONFIG_TAG`). A started one whose lease was lost, or that took
    none ``delivery.run_grace_secs`` after it started (unless it waits for the one holding it), is reported failed
    (the sensor then retries its members' runs).

    The run holding the lease gets a successor :func:`~..engine.delivery.group.handover_lead` before its
    ``max_run_secs``, and at once when the members' configuration changed (:func:`_succession_due`): requested then,
    it starts and waits for the lease; once it waits, the run it takes over from is asked to end
    (:data:`~.names.STOP_TAG`), so the members' deliveries pause for the hand-over only. A successor of a changed
    configuration that cannot take over (the run queue allows one group run, it failed, or it does not wait within
    ``delivery.run_grace_secs``) has the run asked to end all the same (:func:`_ask_to_end`): the next one follows.

    Members the database does not have in the group yet are registered first (one query when none is missing), even
    while an older group run's reader reads: it records them meanwhile and is asked to end (:func:`_ask_to_end`); the
    next one hosts them. A member whose registration is refused (a stream of another group, a publication by its name
    that another role made) is left out in one line (``log``, ``left_out``)."""
    added, refused = groups.register_missing_members(conn, group, [s.id for s in streams])
    log.extend(refused.values())
    left_out.update(refused)
    if added:
        log.append(f"reader group {group}: stream(s) {', '.join(map(str, added))} registered; they join at the "
                   f"group reader's next pass")
    fingerprint = streams_fingerprint(streams)
    grace = min(s.delivery.run_grace_secs for s in streams)
    max_run_secs = min(s.delivery.tuning.max_run_secs for s in streams)
    blocked = hand_over_blocked(instance, streams)  # (the run queue's limit: no successor beside the run)
    # newest first: the lease's state once started, and whether it took it again after the database's absence
    live: list[tuple[dg.DagsterRun, locks.LeaseState | None, bool]] = []
    runs = _group_runs(instance, conn, group, limit=5)
    for run in runs:
        if run.status not in LIVE:
            continue
        lease, back = None, False
        if run.status == dg.DagsterRunStatus.STARTED:
            lease = locks.group_lease_state(conn, group, run.run_id)
            if lease is locks.LeaseState.LOST:  # (its process died, or the database went away and is back)
                lease = _looked_again(functools.partial(_group_lease, conn, group, run.run_id))[run.run_id]
                back = lease is locks.LeaseState.HELD
        live.append((run, lease, back))
    holder = next((run for run, lease, _back in live if lease is locks.LeaseState.HELD), None)
    for run, lease, back in live:
        late, doing = False, ""
        if back:
            doing = " (it took the group's delivery lease again: it rode out the database's absence)"
        elif lease is locks.LeaseState.HELD:
            doing = " (it holds the group's delivery lease)"
        elif lease is locks.LeaseState.WAITING:
            doing = " (it waits for the group's delivery lease)"
        elif lease is locks.LeaseState.NOT_TAKEN:  # (the run's record only then: Dagster reads it costly)
            late, doing = _not_taken(instance, run, grace, time.time())
            doing = f": {doing}"
            if late and locks.LeaseState.HELD in locks.lease_states(
                    conn, [member_run_id(run.run_id, s.id) for s in streams]).values():
                # it gave the group's lease to its successor while a member's run of it closes (a sink call)
                late, doing = False, " (it gave the group's delivery lease up: its members' runs close)"
        if lease is locks.LeaseState.LOST or late:
            why = ("the database session holding the group's delivery lease has ended (its process died)"
                   if lease is locks.LeaseState.LOST else
                   f"no group delivery lease {grace:g} s after it started (delivery.run_grace_secs)")
            instance.report_run_failed(run, f"pgstream: group delivery run {run.run_id} of reader group {group} "
                                            f"died: {why}")
            log.append(f"reader group {group}: group delivery run {run.run_id} died ({why}); marked failed")
            continue
        if holder is not None and run is not holder:  # its successor: it takes the lease once the holder has ended
            if STOP_TAG not in holder.tags:
                _hand_over(instance, holder, run, lease, group, grace, log)
            queued = f": {blocked}" if run.status == dg.DagsterRunStatus.QUEUED and blocked else ""
            return None, f"group delivery run {run.run_id}{doing or f' ({run.status.value.lower()})'} takes over " \
                         f"from {holder.run_id}{queued}"
        if run is holder and STOP_TAG not in run.tags:
            # (a successor of the code location's configuration that ended without taking over: not one of an
            # earlier configuration, or one requested at max_run_secs)
            successor_ended = any(r.status not in LIVE and r.tags.get(CONFIG_TAG) == fingerprint
                                  for r in runs[:runs.index(run)])
            due = _succession_due(conn, group, run, fingerprint, max_run_secs, grace,
                                  successor_ended or blocked is not None)
            if due is not None:
                log.append(f"reader group {group}: group delivery run {run.run_id}: {due}")
                return _requested(conn, group, fingerprint), f"{run.run_id}: {due}"
        ending = _ask_to_end(instance, run, group, fingerprint, log)
        if doing:  # started: whether it holds its lease, or how long it has not taken it
            return None, f"group delivery run {run.run_id}{doing}{ending}"
        return None, f"group delivery run {run.run_id} ({run.status.value.lower()}{ending})"
    hosted = {s.id for s in streams if s.delivery.keeps_open}  # (a per_batch member's runs are its own)
    # a group with streams in mode open keeps its delivery run up (a first event after a quiet spell, or the
    # location's start, waits for no process to start); one of streams in mode per_batch only has none
    if not hosted:
        return None, "its streams (mode per_batch) have runs of their own"
    wanted = [m for m in groups.member_runs(conn, group) if m.stream_id in hosted]
    members = ", ".join(str(m.stream_id) for m in wanted)
    return _requested(conn, group, fingerprint), (
        f"requested for stream(s) {members}" if wanted else "requested (its streams keep their runs open)")


def _succession_due(conn: psycopg.Connection, group: str, run: dg.DagsterRun, fingerprint: str,
                    max_run_secs: float, grace: float, no_hand_over: bool) -> str | None:
    """Why the run holding the group's lease gets its successor requested now (``None``: not now): its members'
    configuration changed (unless ``no_hand_over``: the run queue allows one group run, or a successor requested
    for it has ended without taking over: it is asked to end instead, :func:`_ask_to_end`), or it is
    :func:`~..engine.delivery.group.handover_lead` from its ``max_run_secs``."""
    if run.tags.get(CONFIG_TAG) != fingerprint:
        if no_hand_over:
            return None
        return (f"the configuration of its streams changed ({CONFIG_TAG} {run.tags.get(CONFIG_TAG) or 'none'}, the "
                f"code location's {fingerprint}): its successor requested, it ends once that one waits")
    age = locks.group_lease_age(conn, group, run.run_id)
    if age is not None and age >= max_run_secs - handover_lead(max_run_secs, grace):
        return (f"open {age:.0f} s of {max_run_secs:g} (delivery.tuning.max_run_secs): its successor requested, it "
                f"ends once that one waits")
    return None


def _hand_over(instance: dg.DagsterInstance, holder: dg.DagsterRun, successor: dg.DagsterRun,
               lease: locks.LeaseState | None, group: str, grace: float, log: list[str]) -> None:
    """The run holding the group's lease is asked to end (:data:`~.names.STOP_TAG`) once its successor waits for
    the lease; a successor of a changed configuration that does not wait ``grace`` seconds after it was requested
    has it asked to end all the same (its members pause until the successor takes over)."""
    changed = successor.tags.get(CONFIG_TAG) != holder.tags.get(CONFIG_TAG)
    why = "the configuration of its streams changed" if changed else \
        "a fresh group delivery run every delivery.tuning.max_run_secs"
    if lease is locks.LeaseState.WAITING:
        instance.add_run_tags(holder.run_id, {STOP_TAG: f"its successor {successor.run_id} is up ({why})"})
        return
    record = instance.get_run_record_by_id(successor.run_id) if changed else None
    if record is not None and time.time() - record.create_timestamp.timestamp() >= grace:
        reason = (f"{why}; its successor {successor.run_id} is not up {grace:g} s after it was requested "
                  f"(delivery.run_grace_secs)")
        instance.add_run_tags(holder.run_id, {STOP_TAG: reason})
        log.append(f"reader group {group}: group delivery run {holder.run_id} asked to end: {reason}")


def _requested(conn: psycopg.Connection, group: str, fingerprint: str) -> dg.RunRequest:
    """The request of a group delivery run (of the members' configuration, ``fingerprint``)."""
    # (its run key: the request's time to the millisecond; Dagster skips a request whose key it has seen, and a run
    # and its successor can be requested within a second of each other)
    return dg.RunRequest(run_key=f"pgstream-group-{group}-{int(time.time() * 1000)}", job_name=GROUP_DELIVERY_JOB,
                         run_config={"ops": {"deliver_group": {"config": {"group": group}}}},
                         tags={GROUP_TAG: group_tag(group, database_key(conn)), CONFIG_TAG: fingerprint})


#: what a group's tick tells in one line (its skip reason), without a traceback
_TOLD_IN_ONE_LINE = (LimitsExceeded, groups.GroupChange, SlotCreationWaits, PublicationTaken)


def _told(context: dg.SensorEvaluationContext, line: str) -> dg.SensorResult:
    """The tick ends with ``line``: its skip reason, and logged when the last tick did not end with the same line
    (the cursor's ``told``; a tick that gets through drops it), so an outage or a refusal that lasts is one line in
    the log, not one a tick."""
    cursor = json.loads(context.cursor) if context.cursor else {}
    if cursor.get("told") != line:
        context.log.error(line)
    cursor["told"] = line
    return dg.SensorResult(skip_reason=line, cursor=json.dumps(cursor, sort_keys=True, default=str))


Tick = Callable[[dg.SensorEvaluationContext, PgstreamResource], dg.SensorResult]


def _tells_in_one_line(tick: Tick) -> Tick:
    """A tick refused (:data:`_TOLD_IN_ONE_LINE`), that cannot connect (a wrong URL, Postgres down), or whose server
    goes away mid-way (crashed, failing over) or is read-only (:func:`~..engine.dbconn.server_gone`) ends with that in
    one line (:func:`_told`; the database by the URL's role and host, never the URL): no traceback; the next tick
    tries again."""
    @functools.wraps(tick)
    def waiting(context: dg.SensorEvaluationContext, pgstream: PgstreamResource) -> dg.SensorResult:
        try:
            return tick(context, pgstream)
        except _TOLD_IN_ONE_LINE as exc:
            return _told(context, str(exc))
        except psycopg.Error as exc:
            line = server_gone(exc)
            if line is None:
                raise
            return _told(context, f"{describe_url(pgstream.database_url)}: {line}")
    return waiting


def _launch_waits(conn: psycopg.Connection, ids: list[int], deadline: float) -> bool:
    """Look every LAUNCH_LOOK_SECS until ``deadline`` for a member of ``ids`` whose batch waits for a decision
    (``ledger.state.launch_waiting``): true as soon as one does."""
    while time.monotonic() + LAUNCH_LOOK_SECS < deadline:
        time.sleep(LAUNCH_LOOK_SECS)
        if ledger_state.launch_waiting(conn, ids):
            return True
    return False


def _decide_members(conn: psycopg.Connection, instance: dg.DagsterInstance, group: str, streams: list[StreamConfig],
                    cursor: dict[str, Any], log: list[str], requests: list[dg.RunRequest], observations: int,
                    waits: dict[int, str | None]) -> list[dg.AssetObservation]:
    """The decisions of every member, once each (:func:`step`; the runs of members in mode per_batch are added
    to ``requests``), and the observations of their status assets (at most ``observations``; ``waits``: what
    the run of each member in mode per_batch is doing, for the skip reason)."""
    state = groups.group_state(conn, group)
    joined = {m.id for m in state.members if m.joined} if state is not None else set()
    # a member the database does not have in the group was left out (its registration refused, told by the tick)
    registered = {m.id for m in state.members} if state is not None else set()
    streams = [s for s in streams if s.id in registered]
    look = GroupLook.of(conn, instance, group, streams)
    states = ledger_state.stream_states(conn, {s.id: s.delivery.max_events_per_run for s in streams})
    members: dict[str, Any] = cursor.setdefault("members", {})
    # a run a member in mode per_batch got this tick: Dagster creates it when the tick returns (decided once)
    asked = {r.tags.get(STREAM_TAG) for r in requests}
    database = database_key(conn)
    for stream in streams:
        if stream_tag(stream.id, database) in asked:
            continue
        mine = members.setdefault(str(stream.id), {})
        request, waiting = step(conn, instance, stream, log, said=mine.setdefault("said", {}), look=look,
                                state=states[stream.id] if stream.id in joined else None)
        if not stream.delivery.keeps_open:  # (a run of its own: the group run's are told)
            waits[stream.id] = waiting
        if request is not None:
            requests.append(request)
    by_id = {s.id: s for s in streams}
    observed: list[dg.AssetObservation] = []
    rows = [r for r in stream_status(conn, None, last=0) if int(r["id"]) in by_id]  # the tick's one read of them
    for row in rows:
        members[str(row["id"])].update(
            last_event_id=row["last_recorded_event_id"], last_lsn=row["last_recorded_lsn"],
            undelivered_batches=int(row["undelivered_batches"]), undelivered_events=int(row["undelivered_events"]))
    # at most OBSERVATIONS_PER_TICK, the members observed longest ago first (the others at the next ticks): the
    # daemon stores what a tick returns before the group's next tick starts, and a hundred observations at
    # once (the first tick, or many states changing together) held the members' decisions for seconds
    rows.sort(key=lambda r: float(members[str(r["id"])].get("status_at", 0)))
    for row in rows:
        if len(observed) >= observations:
            break
        member = by_id[int(row["id"])]
        observation = _observe_status(conn, instance, member, row, members[str(member.id)], look,
                                      members=len(streams))
        if observation is not None:
            observed.append(observation)
    return observed


def _slot_fits(conn: psycopg.Connection, group: str) -> None:
    """:class:`LimitsExceeded` (the slot line of ``engine.limits``) when the group's slot does not exist and
    every replication slot is in use: a group run requested then would end at once (its reader refused), and
    the next tick would request another."""
    state = groups.group_state(conn, group)
    if state is None or replication.slot_info(conn, state.slot) is not None:
        return
    line = limits.group_slot_problem(conn, group)
    if line is not None:
        raise LimitsExceeded([line])


def group_sensor(group: str, streams: list[StreamConfig]) -> dg.SensorDefinition:
    """The sensor of reader group ``group`` (``streams``: its members); its tick is the module docstring's."""
    budget = min(s.sensor.tick_budget_secs for s in streams)
    ids = sorted(s.id for s in streams)

    @dg.sensor(
        name=group_sensor_name(group),
        jobs=[group_delivery_job, delivery_job],  # (a per_batch member's runs are runs of the delivery job)
        minimum_interval_seconds=min(s.sensor.interval_secs for s in streams),
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"The sensor of streams {', '.join(map(str, ids))} (reader group {group}): reads the group's "
                    f"slot (one decoding of the WAL) while its delivery run does not, records each stream's "
                    f"batches, decides each stream's runs, in order, and requests the group's delivery run (one "
                    f"process hosting their runs) when none is live.",
    )
    @_tells_in_one_line
    def _sensor(context: dg.SensorEvaluationContext, pgstream: dg.ResourceParam[PgstreamResource]) -> dg.SensorResult:
        cursor = json.loads(context.cursor) if context.cursor else {}
        cursor.pop("streams", None)  # what cursors of earlier versions kept (now under "members")
        cursor.pop("told", None)  # (what the last tick ended with: _told)
        invalid = pgstream.config.left_out  # streams[] entries left out of the code location: recorded, not delivered
        decisions: list[str] = []
        left_out: dict[int, str] = {}  # members whose registration was refused: not read, told in one line each
        try:
            connection = pgstream.connect()
        except psycopg.OperationalError as exc:
            return _told(context, f"cannot connect to the database ({describe_url(pgstream.database_url)}, from "
                                  f"database_url): {error_line(exc)}")
        with connection as conn:
            runs = _group_runs(context.instance, conn, group, limit=5)
            if not any(r.status in LIVE for r in runs):
                # the group run's process takes seconds to start: requested first, and this tick ends (the
                # next one reads and decides meanwhile, or the run's reader reads once it is up)
                notes_: list[str] = []
                request, delivery = group_delivery(conn, context.instance, group, streams, notes_, left_out)
                if request is not None:
                    _slot_fits(conn, group)
                    for line in notes_:
                        context.log.warning(line)
                    context.log.info(f"reader group {group}: group delivery run {delivery}")
                    return dg.SensorResult(run_requests=[request],
                                           cursor=json.dumps(cursor, sort_keys=True, default=str))
            # one reader of the group's slot at a time: the tick reads only when the group run's reader does not
            # (its lock ends with its session), in slices of DECIDE_EVERY_SECS, deciding for the members after each:
            # what it recorded is handed on within a second. With a group run started, the tick leaves the reading
            # free for a moment between slices, so the run's reader (which tries every READ_RETRY_SECS) takes it over
            # at the first one: a run that took over from another reads at once, not after this tick. A run still
            # starting is looked at again after each slice (it starts during the tick). (Without a live group run,
            # its members all in mode per_batch: the whole budget.)
            started = any(r.status == dg.DagsterRunStatus.STARTED for r in runs)
            starting = [r.run_id for r in runs if r.status in LIVE and r.status != dg.DagsterRunStatus.STARTED]

            def has_started() -> bool:
                nonlocal started
                if not started and starting:
                    started = any((run := context.instance.get_run_by_id(run_id)) is not None
                                  and run.status == dg.DagsterRunStatus.STARTED for run_id in starting)
                return started

            result, observed = GroupResult(), list[dg.AssetObservation]()
            own_runs: list[dg.RunRequest] = []  # the runs of members in mode per_batch (Dagster runs of their own)
            waits: dict[int, str | None] = {}  # what the runs of members in mode per_batch are doing

            def decide() -> None:
                observed.extend(_decide_members(conn, context.instance, group, streams, cursor, decisions, own_runs,
                                                OBSERVATIONS_PER_TICK - len(observed), waits))

            deadline = time.monotonic() + budget
            while True:
                reading = None
                if locks.claim_group_reading(conn, group, f"sensor {group_sensor_name(group)}"):
                    try:
                        with fewer_collections():  # the tick records in bulk
                            result.add(consume_group(conn, group, streams,
                                                     min(DECIDE_EVERY_SECS, max(0.0, deadline - time.monotonic())),
                                                     invalid=invalid))
                    finally:
                        locks.release_group_reading(conn, group)
                else:
                    reading = locks.group_reading_holder(conn, group) or "a session that is ending"
                decide()
                if reading is not None or result.slot_lost or result.slot_busy or time.monotonic() >= deadline:
                    break
                if has_started():  # (the run's reader takes the reading now, or the tick reads on)
                    time.sleep(min(READ_RETRY_SECS + 0.05, max(0.0, deadline - time.monotonic())))
            notes_ = []
            request, delivery = group_delivery(conn, context.instance, group, streams, notes_, left_out)
            # the group run's reader records: a batch it records for a member without a run waits for a decision,
            # taken when the tick sees one waiting (within LAUNCH_LOOK_SECS, not at the next tick); after the
            # group's run was seen to (members registered, a run of another configuration asked to end)
            if request is None and reading is not None:
                while _launch_waits(conn, ids, deadline):
                    decide()
            # the members the configuration does not deliver (their streams[] entry invalid, or missing), in one
            # line each as the group's reader tells them: told at every tick, whoever read
            if (state := groups.group_state(conn, group)) is not None:
                left_out.update(unconfigured(state, streams, invalid))
        for line in [*decisions, *notes_]:
            context.log.warning(line)
        group_log(context.log, group, result, noted=set(notes_))  # (a member left out: told once)
        left_out.update(result.left_out)
        members = cursor.get("members", {})
        pending = sum(int(m.get("undelivered_events") or 0) for m in members.values())
        batches = sum(int(m.get("undelivered_batches") or 0) for m in members.values())
        recorded = sum(result.events.values())
        joining = f"; stream(s) {result.joining} joining" if result.joining else ""
        left = "".join(f"; {line}" for _, line in sorted(left_out.items()))
        new_cursor = json.dumps(cursor, sort_keys=True, default=str)
        if request is not None or own_runs:
            if request is not None:
                context.log.info(f"reader group {group}: group delivery run {delivery}")
            for run in own_runs:
                stream_id = run.run_config["ops"]["load_batches"]["config"]["stream_id"]
                context.log.info(f"stream {stream_id}: run {run.run_key} requested (mode per_batch)")
            return dg.SensorResult(run_requests=[*own_runs, *([request] if request is not None else [])],
                                   cursor=new_cursor, asset_events=observed)
        read = (f"recorded {recorded} events for {sum(1 for b in result.batches.values() if b)} of {len(ids)} streams"
                if reading is None else f"read nothing: {reading} reads the group's slot")
        why = "".join(f"; stream {sid} {line}" for sid, line in sorted(waits.items()) if line)
        return dg.SensorResult(skip_reason=dg.SkipReason(
            f"{read}{joining}{left}; {pending} undelivered events in {batches} batches{why}; {delivery}"),
            cursor=new_cursor, asset_events=observed)

    return _sensor


def group_sensors(streams: list[StreamConfig]) -> list[dg.SensorDefinition]:
    """One sensor per reader group named by ``streams[].reader``."""
    return [group_sensor(name, members) for name, members in reader_groups(streams).items()]
