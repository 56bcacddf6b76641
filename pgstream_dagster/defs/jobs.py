"""The delivery jobs, thin Dagster ops around the engine's delivery run (:class:`~..engine.delivery.run.DeliveryRun`):
the delivery job runs a stream in mode per_batch (a run per batch, as the design card has it); the group delivery job
hosts the open runs of a reader group's members. The ops hand the engine what only Dagster has: the PySpark resource
(started when a round first goes to Spark), a stop check and a reporter (:func:`_report`). Engine errors become
``dg.Failure`` s with their metadata.
"""

import json
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
import psycopg
from dagster._utils.interrupts import capture_interrupts  # (Dagster's own: a signal waits meanwhile)
from dagster_pyspark import LazyPySparkResource

from ..config import StreamConfig, streams_fingerprint
from ..engine.collector import fewer_collections
from ..engine.dbconn import connect, database_key, server_gone
from ..engine.delivery.group import GroupDelivery, GroupHost
from ..engine.delivery.run import DeliveryError, DeliveryRun, Host, Summary, waiting_batches
from ..engine.handoff import Handoff
from ..engine.ingest import GroupStream, consume_group, group_log
from ..engine.ledger import locks
from .lake import lake_materializations
from .names import (
    CONFIG_TAG,
    CONTROL_JOB,
    DELIVERY_JOB,
    GROUP_DELIVERY_JOB,
    GROUP_TAG,
    MEMBER_TAG_PREFIX,
    RUN_KEY_TAG,
    STOP_TAG,
    STREAM_TAG,
    deliveries_asset_key,
    group_tag,
    member_tag,
    stream_tag,
)
from .resources import PgstreamResource


class DeliveryRunConfig(dg.Config):
    """A run of a stream in mode per_batch: its batches ``batch_id`` .. ``through_batch_id`` (the sensor's request)."""

    stream_id: int
    batch_id: int
    through_batch_id: int | None = None


@contextmanager
def _failures(who: str, retried: str = "the stream retries after its backoff") -> Iterator[None]:
    """The engine's errors as ``dg.Failure`` s (a delivery error with its metadata). The run's server went away or
    is read-only (a failover): the run fails in one line naming ``who`` and how it is ``retried`` (a stream: after
    its backoff, ``retry``); any other database error as it is."""
    try:
        yield
    except locks.LeaseTaken as exc:
        raise dg.Failure(str(exc)) from None
    except DeliveryError as exc:
        metadata = {k: dg.MetadataValue.json(v) if isinstance(v, list | dict) else v for k, v in exc.metadata.items()}
        raise dg.Failure(str(exc), metadata=metadata) from None
    except psycopg.Error as exc:
        if (line := server_gone(exc)) is None:
            raise
        raise dg.Failure(f"{who}: {line}; {retried}") from None


@dg.op(description="Take the stream's delivery lease and check the batches may run.")
def load_batches(context: dg.OpExecutionContext, config: DeliveryRunConfig,
                 pgstream: dg.ResourceParam[PgstreamResource]) -> DeliveryRun:
    run = DeliveryRun(pgstream.stream(config.stream_id), pgstream.database_url, pgstream.executor_database_url,
                      context.run_id, config.batch_id, config.through_batch_id)
    with _failures(f"stream {config.stream_id}"):
        return run.start(context.log)


@dg.op(description="Publish the batches through the stream's sink, in order; each batch is marked delivered "
                   "as soon as the sink confirmed all its events; rounds are reported as materializations.")
def deliver_batches(context: dg.OpExecutionContext, loaded: DeliveryRun, pyspark: LazyPySparkResource) -> None:
    stream_id = loaded.stream.id
    tag = context.run.tags.get(STREAM_TAG)
    if tag is None:  # launched by hand: no other run of the stream is held back by it either
        with connect(loaded.database_url) as conn:
            tag = stream_tag(stream_id, database_key(conn))

    def queued() -> str | None:
        waiting = context.instance.get_runs_count(dg.RunsFilter(tags={STREAM_TAG: tag},
                                                                statuses=[dg.DagsterRunStatus.QUEUED]))
        return "another run of the stream is queued" if waiting else None

    host = Host(context.run_id, context.log, spark=lambda: pyspark.spark_session, stop_check=queued,
                report=lambda summary: _report(context, loaded.stream, summary), control=f"the {CONTROL_JOB} job")
    rounds = loaded.deliver(host)
    try:
        with _failures(f"stream {stream_id}"):
            for _round in rounds:
                pass
    except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
        # a shutdown (`make stop`, Ctrl-C: SIGINT) or a termination: the run ends, not fails; what it held waits
        # for the next run (no failover). A second signal waits until that is written (capture_interrupts).
        # (KeyboardInterrupt: once a local Spark runs in the process, PySpark's own SIGINT handler raises it)
        with capture_interrupts():
            rounds.close()  # (interrupted between two rounds: its reader stopped and its lease given up first)
            waiting = loaded.give_back()
        context.log.info(f"stream {stream_id}: the run was interrupted (shutdown) and closed; "
                         f"{waiting_batches(waiting)} for the next run")


def _report(context: dg.OpExecutionContext, stream: StreamConfig, s: Summary, *, line: bool = True) -> None:
    """The rounds of a reporting period: a line in the run log (``line``) and a materialization of the stream's
    deliveries asset (its status asset is observed by the group's sensor)."""
    if line:
        rounds = f" in {s.rounds} rounds" if s.rounds > 1 else ""
        context.log.info(f"stream {s.stream_id}: sink {s.sink_type} handled {s.events} events of "
                         f"{s.batches} batches {s.first.id}..{s.last.id}{rounds}")
    metadata: dict[str, Any] = {
        "batches": s.batches, "rounds": s.rounds, "first_batch_id": s.first.id, "last_batch_id": s.last.id,
        "kinds": ", ".join(s.kinds), "events": s.events, "first_event_id": s.first.first_event_id,
        "last_event_id": s.last.last_event_id, "duration_secs": s.duration_secs}
    if s.max_lag_secs is not None:  # the slowest round's first batch: commit -> delivered
        metadata["commit_to_delivery_lag_secs"] = s.max_lag_secs
    context.log_event(dg.AssetMaterialization(asset_key=deliveries_asset_key(s.stream_id),
                                              description=f"batches {s.first.id}..{s.last.id} delivered",
                                              metadata=metadata))
    for materialization in lake_materializations(stream, metadata):  # a lake sink's table (defs/lake.py)
        context.log_event(materialization)


@dg.job(name=DELIVERY_JOB, executor_def=dg.in_process_executor,
        description="Deliver consecutive batches of a stream's events to its sink (a stream in mode per_batch; "
                    "requested by its reader group's sensor).")
def delivery_job() -> None:
    deliver_batches(load_batches())


# --- a reader group's delivery run -------------------------------------------------------------------

class GroupDeliveryConfig(dg.Config):
    group: str


def member_state(run_key: str, state: str, error: str | None = None) -> str:
    """The value of a group delivery run's :func:`~.names.member_tag`."""
    return json.dumps({"run_key": run_key, "state": state, "error": error}, sort_keys=True)


def _hosted_by_other_group_runs(instance: dg.DagsterInstance, tag: str, run_id: str) -> set[tuple[int, str]]:
    """The member runs (stream id, run key) the group's other delivery runs took: runs that ended or died
    (one group delivery run at a time), so read once when a group run starts."""
    runs = instance.get_runs(dg.RunsFilter(job_name=GROUP_DELIVERY_JOB, tags={GROUP_TAG: tag}), limit=100)
    return {(int(key.removeprefix(MEMBER_TAG_PREFIX)), str(json.loads(value).get("run_key")))
            for run in runs if run.run_id != run_id
            for key, value in run.tags.items() if key.startswith(MEMBER_TAG_PREFIX)}


class _Reporter:
    """Writes the members' reports (materializations) to Dagster's event log from a thread of its own, in order: a
    member's delivery loop only queues them, so a hundred members do not wait for each other's event-log writes."""

    def __init__(self, context: dg.OpExecutionContext) -> None:
        self.context = context
        self.queue: queue.SimpleQueue[tuple[StreamConfig, Summary, str] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._write, name="pgstream-group-reports", daemon=True)
        self.thread.start()

    def told(self, stream: StreamConfig, member: str) -> Callable[[Summary], None]:
        return lambda summary: self.queue.put((stream, summary, member))

    def _write(self) -> None:
        while (item := self.queue.get()) is not None:
            stream, summary, member = item
            try:  # (no line in the run log: the materialization in it says the same, one write less per report)
                _report(self.context, stream, summary, line=False)
            except Exception as exc:  # a report lost is logged; deliveries go on
                self.context.log.warning(f"stream {stream.id}: report of member run {member} not written: {exc}")

    def close(self) -> None:
        """Write what is queued, then stop."""
        self.queue.put(None)
        self.thread.join(60)


@dg.op(description="Host the delivery runs of a reader group's streams in one process, one thread each (each with "
                   "its own sink, delivery lease and ledger state); the group's sensor decides their runs as for a "
                   "run per stream (a stream in mode per_batch has Dagster runs of its own). Ends after the shortest "
                   "delivery.tuning.max_run_secs of its streams, or when the group's sensor asks it to "
                   "end (its configuration is not the code location's any more) or its reader is refused (e.g. a "
                   "stream added to the group by a newer configuration). Rides out the database going away (a "
                   "restart, a failover): its members' runs stop and are hosted again once it accepts writes.")
def deliver_group(context: dg.OpExecutionContext, config: GroupDeliveryConfig,
                  pgstream: dg.ResourceParam[PgstreamResource], pyspark: LazyPySparkResource) -> None:
    group = config.group
    streams = [s for s in pgstream.config.streams if s.reader == group]
    if not streams:
        raise dg.Failure(f"reader group {group} has no stream in {pgstream.config_path} (streams[].reader)")
    instance, run_id = context.instance, context.run_id
    lock = threading.Lock()  # the run's tags written one member at a time
    spark_lock = threading.Lock()  # one Spark session for the process, started by the first member needing it
    tag = context.run.tags.get(GROUP_TAG)
    if tag is None:  # launched by hand: tagged as the group's sensor tags the runs it requests
        with pgstream.connect() as conn:
            tag = group_tag(group, database_key(conn))
        instance.add_run_tags(run_id, {GROUP_TAG: tag})
    elsewhere = _hosted_by_other_group_runs(instance, tag, run_id)
    reporter = _Reporter(context)

    def spark() -> Any:
        with spark_lock:
            return pyspark.spark_session

    def member_host(stream: StreamConfig, member: str) -> Host:
        return Host(member, context.log, spark=spark, report=reporter.told(stream, member),
                    control=f"the {CONTROL_JOB} job")

    def claim(wanted: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """Of the member runs wanted, those no run of the stream's own (requested before its group's run
        delivered it) or other group delivery run took: a member run is hosted once; recorded in the members'
        tags, all in one write (as the look-up: one query for every run key)."""
        keys = [key for _, key in wanted]
        own = {r.tags.get(RUN_KEY_TAG) for r in instance.get_runs(dg.RunsFilter(tags={RUN_KEY_TAG: keys}))}
        mine = [(sid, key) for sid, key in wanted if (sid, key) not in elsewhere and key not in own]
        if mine:
            tell({member_tag(sid): member_state(key, "running") for sid, key in mine})
        return mine

    def ended(stream_id: int, run_key: str, error: str | None) -> None:
        tell({member_tag(stream_id): member_state(run_key, "ended" if error is None else "failed", error)})

    # Dagster writes a run's tags by reading the run and writing it back whole (``add_run_tags``, also a status
    # change): a write by another process meanwhile (the group's sensor asking the run to end, an operator's
    # tag) can put back a member's older state. The run keeps what it wrote and, at each stop check and when it
    # ends, writes again what the run does not show.
    told: dict[str, str] = {}

    def tell(tags: dict[str, str]) -> None:
        with lock:
            instance.add_run_tags(run_id, tags)
            told.update(tags)

    def retell(run: dg.DagsterRun | None) -> None:
        if run is None:
            return
        with lock:
            lost = {k: v for k, v in told.items() if run.tags.get(k) != v}
            if lost:
                instance.add_run_tags(run_id, lost)

    requested = context.run.tags.get(CONFIG_TAG)
    if requested is not None and requested != streams_fingerprint(streams):
        context.log.warning(f"reader group {group}: the configuration this run loaded ({pgstream.config_path}) is "
                            f"not the one the group's sensor requested it with (changed since the code location "
                            f"loaded it: reload the code location); the run delivers with the one it loaded")

    def stop_check() -> str | None:
        """Why the run ends, asked about once a second: it was asked to (:data:`~.names.STOP_TAG`: by the group's
        sensor, its configuration changed; or by hand), or the group's sensor marked it failed."""
        run = instance.get_run_by_id(run_id)
        retell(run)
        reason = run.tags.get(STOP_TAG) if run is not None else None
        if run is not None and run.status in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED):
            return f"Dagster shows it {run.status.value} (marked by the group's sensor)"
        return f"asked to end ({STOP_TAG}): {reason}" if reason else None

    noted: set[str] = set()
    # the group's slot over the replication protocol, kept open across the reader's calls (one WAL sender)
    handoff = Handoff()  # what the reader records, handed to the members' runs in memory
    kept = GroupStream(pgstream.database_url, application_name=f"pgstream group slot reader {run_id}",
                       handoff=handoff)

    def read(conn: psycopg.Connection, secs: float) -> None:
        """The group run's reader: the group's slot read as the group's sensor reads it, over ``kept``."""
        with fewer_collections():  # the reader records in bulk (as the group's sensor's tick does)
            result = consume_group(conn, group, streams, secs, kept=kept, invalid=pgstream.config.left_out,
                                   stop=delivery.reading_ended)
        group_log(context.log, group, result, batches=False, noted=noted)

    host = GroupHost(run_id, context.log, member_host, claim=claim, ended=ended, stop_check=stop_check, read=read,
                     read_ends=kept.close)
    delivery = GroupDelivery(group, streams, pgstream.database_url, pgstream.executor_database_url, host,
                             max_run_secs=min(s.delivery.tuning.max_run_secs for s in streams),
                             run_grace_secs=min(s.delivery.run_grace_secs for s in streams), handoff=handoff)
    try:
        with _failures(f"reader group {group}", "the group's sensor requests a fresh group run"):
            reason = delivery.run()
    except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
        # a shutdown (`make stop`, Ctrl-C, the run worker's SIGTERM) or a termination: the group run ends, not
        # fails (its members' runs closed and its leases given up first: ``GroupDelivery.run``); what they held
        # waits for the next group run, and no member goes to failover
        reason = "interrupted (shutdown): its members' runs closed; what they held waits for the next group run"
    finally:
        reporter.close()
    retell(instance.get_run_by_id(run_id))
    context.log.info(f"reader group {group}: group delivery run ended ({reason})")


@dg.job(name=GROUP_DELIVERY_JOB, executor_def=dg.in_process_executor,
        description="Deliver the events of a reader group's streams, each stream's runs hosted in a thread of this "
                    "one run (requested by the group's sensor).")
def group_delivery_job() -> None:
    deliver_group()
