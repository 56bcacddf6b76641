"""The delivery job: one run delivers consecutive ledger batches of a stream, in order, through
the stream's sink.

``load_batches`` checks the batches may run (the first is the stream's oldest open batch; the
range holds only the stream's open batches) and loads them with PySpark; ``deliver_batches``
opens the stream's sink, publishes the batches in commit order (or per routing key) and marks each
batch delivered as soon as the sink confirmed its last event, so a run that fails half-way keeps
the progress it made. A run then stays open for ``delivery.linger_secs`` (a warm run,
``delivery.keep_warm``, starts with no batch and stays open): it reads the stream's slot itself
(:class:`_Reader`, ``delivery.read_slot``) and delivers every batch recorded meanwhile, so fresh
events are delivered by a warm process and sink (one sink per run, closed when the run ends,
however it ends); rounds small enough (``delivery.direct_max_events``) are read without Spark. The
rounds are reported (:class:`_Report`) as materializations of the stream's deliveries asset, each
followed by an observation of its status asset (fresh counts without waiting for the sensor).

The ordered publish loop (:func:`pgstream_dagster.engine.spark.deliver_in_order`) yields what the
sink confirmed; the run writes it to the ledger before anything more is published:
``Confirmed`` → ``ledger.mark_confirmed`` (a retry resumes after it), ``BatchDone`` →
``ledger.mark_delivered``, ``Progress`` → the run log.
"""


import dataclasses
import datetime as dt
import gc
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import dagster as dg
import psycopg
from dagster_pyspark import LazyPySparkResource

from ..config import StreamConfig
from ..engine import ingest, ledger, spark
from ..engine.collector import fewer_collections
from ..engine.handoff import Handoff
from ..engine.publish import (
    BatchDone,
    Confirmed,
    Finished,
    MissingEventsError,
    Progress,
    RejectPolicy,
    Span,
    max_event_bytes,
    owed_spans,
)
from ..engine.status import stream_status
from ..sinks import Sink, SinkError, build_sink
from .lake import lake_materializations
from .names import CONTROL_JOB, DELIVERY_JOB, RUN_KEY_TAG, STREAM_TAG, deliveries_asset_key
from .resources import PgstreamResource
from .status import status_observation


class DeliveryRunConfig(dg.Config):
    stream_id: int
    batch_id: int | None = None  # None: a warm run (delivery.keep_warm), open for what commits next
    through_batch_id: int | None = None


@dataclass
class LoadedBatches:
    stream_id: int
    batches: list[ledger.Batch]
    frame: Any  # pyspark.sql.DataFrame
    started: float
    lease: psycopg.Connection  # holds the stream's delivery lease until the batches are marked


@dg.op(description="Check the batches may run and load their events from pgstream.events with PySpark.")
def load_batches(context: dg.OpExecutionContext, config: DeliveryRunConfig,
                 pgstream: dg.ResourceParam[PgstreamResource], pyspark: LazyPySparkResource) -> LoadedBatches:
    started = time.monotonic()
    try:
        lease = ledger.acquire_lease(
            pgstream.database_url, config.stream_id, context.run_id,
            lambda replay: context.log.info(f"stream {config.stream_id}: waiting for replay {replay} to end "
                                            "(it holds the delivery lease)"))
    except ledger.LeaseTaken as exc:
        raise dg.Failure(str(exc)) from None
    if config.batch_id is None:
        context.log.info(f"stream {config.stream_id}: warm run, open for what commits (delivery.keep_warm)")
        return LoadedBatches(config.stream_id, [], None, started, lease)
    last = config.through_batch_id or config.batch_id
    try:
        batches = ledger.batches_between(lease, config.stream_id, config.batch_id, last)
        if not batches or batches[0].id != config.batch_id:
            raise dg.Failure(f"batch {config.batch_id} of stream {config.stream_id} does not exist")
        done = [b.id for b in batches if not b.status.is_open]
        if done:
            raise dg.Failure(f"batches {done} of stream {config.stream_id} are already delivered or skipped")
        earlier = ledger.earlier_open(lease, config.stream_id, config.batch_id)
        if earlier is not None:
            raise dg.Failure(f"batch {config.batch_id} would overtake open batch {earlier} of stream "
                             f"{config.stream_id}; batches are delivered in order")
        stream = pgstream.stream(config.stream_id)
        requested = len(batches)
        batches = _direct_round(stream, batches)  # the rest: the next rounds (they are assigned to this run)
        frame = _load(pyspark, pgstream.executor_database_url, stream, batches, lease)
    except BaseException:
        ledger.give_up_lease(lease, config.stream_id)
        raise
    total = sum(b.event_count for b in batches)
    kinds = sorted({b.kind for b in batches})
    rest = f"; the other {requested - len(batches)} batches in the next rounds" if requested > len(batches) else ""
    context.log.info(f"stream {config.stream_id}: {len(batches)} batches {batches[0].id}..{batches[-1].id}, "
                     f"{total} events ({', '.join(kinds)}){rest}")
    return LoadedBatches(config.stream_id, batches, frame, started, lease)


@dg.op(description="Publish the batches through the stream's sink, in order; each batch is marked delivered "
                   "as soon as the sink confirmed all its events. While the run is open (delivery.linger_secs, "
                   "keep_warm) it reads the stream's slot and delivers what commits, through the same sink; "
                   "rounds are reported as materializations.")
def deliver_batches(context: dg.OpExecutionContext, loaded: LoadedBatches, pgstream: dg.ResourceParam[PgstreamResource],
                    pyspark: LazyPySparkResource) -> None:
    stream = pgstream.stream(loaded.stream_id)
    run_key = loaded.batches[0].run_key if loaded.batches else context.run.tags.get(RUN_KEY_TAG)
    if not loaded.batches and not (run_key and ledger.run_is_open(loaded.lease, stream.id, run_key)):
        # a warm run the stream no longer wants (another run is open): nothing to do
        ledger.give_up_lease(loaded.lease, stream.id)
        context.log.info(f"stream {stream.id}: not the stream's open run; nothing to deliver")
        return
    run_key = run_key or ""
    # the lease is given up when the run ends (it is lost if its process dies); the sink serves every round
    # of the run (by_key: the Spark tasks publish through sinks of their own) and is closed when the run ends
    with fewer_collections(), ledger.holding_lease(loaded.lease, stream.id) as conn, \
            build_sink(stream.sink) as sink, _Reader(context, pgstream.database_url, stream, run_key, conn) as reader:
        ledger.listen_runs(conn, stream.id)
        # what the sink confirms is recorded on ``conn``: once it is broken the sink sends nothing more
        recording = sink.go_on = ledger.RecordingCheck(conn)
        linger = _Linger(context, conn, stream, run_key, reader)
        report = _Report(context, conn, stream, run_key)
        batches, frame, started = loaded.batches, loaded.frame, loaded.started
        after = 0
        try:
            while True:
                if batches:
                    delivered = _deliver_round(context, conn, stream, sink, batches, frame, pgstream, recording)
                    report.add(batches, delivered, started)
                    after = batches[-1].id
                    if reader.handoff is not None:
                        reader.handoff.forget_through(after)
                reader.report()
                batches = _direct_round(stream, linger.next_batches(after))
                if not batches:
                    break
                earlier = ledger.earlier_open(conn, stream.id, batches[0].id)
                if earlier is not None:  # only what is next in line is handed over; never overtake
                    raise dg.Failure(f"batch {batches[0].id} would overtake open batch {earlier} of stream "
                                     f"{stream.id}")
                started = time.monotonic()
                frame = _load(pyspark, pgstream.executor_database_url, stream, batches, conn, reader.handoff)
        finally:
            report.flush()  # what was delivered before the run ended, however it ended


class _Reader:
    """The open run's slot reader (``delivery.read_slot``): a thread running
    :func:`~..engine.ingest.follow` while the run is the stream's open run, so recording overlaps
    delivery and each transaction is decoded once. Stopped before the run closes, and however the
    run ends; the sensor reads the slot again once it is free."""

    def __init__(self, context: dg.OpExecutionContext, database_url: str, stream: StreamConfig, run_key: str,
                 conn: psycopg.Connection) -> None:
        self.context, self.stream = context, stream
        self.stats = ingest.FollowStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = 0
        #: what it records, for the run's rounds read without Spark (none: every round goes to Spark)
        self.handoff: Handoff | None = None
        if stream.delivery.read_slot and run_key and ledger.run_is_open(conn, stream.id, run_key):
            self.stats.slot = ledger.stream_slot(conn, stream.id)
            self._thread = threading.Thread(target=self._follow, args=(database_url, run_key), daemon=True,
                                            name=f"pgstream-reader-{stream.id}")
            if stream.delivery.ordering == "global" and stream.delivery.direct_max_events > 0:
                self.handoff = Handoff(max(stream.delivery.direct_max_events, stream.batch.max_size),
                                       4 * stream.delivery.max_read_bytes)

    def _follow(self, database_url: str, run_key: str) -> None:
        try:
            ingest.follow(database_url, self.stream, run_key, self._stop, self.stats,
                          application_name=f"pgstream reader {self.context.run_id}", handoff=self.handoff)
        except BaseException as exc:  # reported by the run's thread; the sensor reads the slot instead
            self._error = exc

    def __enter__(self) -> "_Reader":
        if self._thread is not None:
            self._thread.start()
            self.context.log.info(f"stream {self.stream.id}: this open run reads slot {self.stats.slot} "
                                  "(replication protocol)")
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.report()
        kept = (f"; {self.handoff.taken} of the events delivered were taken as read, not read back from "
                f"pgstream.events ({self.handoff.missed} batches were)") if self.handoff is not None else ""
        self.context.log.info(f"stream {self.stream.id}: stopped reading slot {self.stats.slot}: "
                              f"{self.stats.events} events recorded in {self.stats.batches} batches{kept}")

    def report(self) -> None:
        """What the reader has to say, in the run log (from the run's own thread)."""
        notes = self.stats.notes
        while self._reported < len(notes):
            self.context.log.warning(f"stream {self.stream.id}: {notes[self._reported]}")
            self._reported += 1
        if self._error is not None:
            error, self._error = self._error, None
            self.context.log.error(f"stream {self.stream.id}: the slot reader stopped: {error!r}; the sensor "
                                   "reads the slot instead")


class _Linger:
    """Keeps a run open after its batches (sql/010_open_runs.sql): it waits for batches the sensor
    assigns to it and closes once idle ``delivery.linger_secs``, open ``delivery.max_run_secs``, or
    when the stream is paused, no longer hands it batches (failover), another run of the stream
    (a replay) is queued behind it or a replay waits for the delivery lease, however it was launched
    (:func:`~..engine.ledger.acquire_replay_lease`)."""

    def __init__(self, context: dg.OpExecutionContext, conn: psycopg.Connection, stream: StreamConfig,
                 run_key: str, reader: _Reader) -> None:
        self.context, self.conn, self.stream, self.run_key = context, conn, stream, run_key
        self.reader = reader
        self.opened = time.monotonic()
        self._frozen = not (stream.delivery.linger_secs > 0 or stream.delivery.keep_warm)

    def next_batches(self, after: int) -> list[ledger.Batch]:
        """The batches assigned to the run after batch ``after``; empty once the run is closed."""
        delivery = self.stream.delivery
        if not self._frozen:
            # a run that stays open allocates tuples per event for long: what its process holds after
            # the first round (Dagster, the Spark session) is not garbage, so the full collections stop
            # scanning it (collections over 0.1 s: 21 s in a 2-minute sustained run before). Done here,
            # not at start-up: the first round's events do not wait for it
            gc.collect()
            gc.freeze()
            self._frozen = True
        idle_since = time.monotonic()
        checked_at = 0.0
        while True:
            batches = ledger.assigned_after(self.conn, self.run_key, after)
            # a replay waits for the delivery lease (whatever launched it): take nothing more, deliver what
            # was handed over, close (the lease goes to the replay when the run ends)
            replay = ledger.replay_waiting(self.conn, self.stream.id)
            if batches:
                if replay:
                    self.reader.stop()
                return batches
            now = time.monotonic()
            reason = None
            if replay:
                reason = "a replay of the stream waits for the delivery lease"
            elif now - idle_since >= delivery.linger_secs and not delivery.keep_warm:
                reason = f"idle for {delivery.linger_secs:g}s"
            elif now - self.opened >= delivery.max_run_secs:
                reason = f"open for {delivery.max_run_secs:g}s (delivery.max_run_secs)"
            elif now - checked_at >= 1.0:
                checked_at = now
                reason = self._stop_reason()
            if reason is not None:
                self.reader.stop()  # what it received is recorded (and handed to this run) before it closes
                if ledger.close_run(self.conn, self.stream.id, self.run_key):
                    if delivery.linger_secs > 0:
                        self.context.log.info(f"stream {self.stream.id}: run closed ({reason})")
                    return []
                continue  # the sensor assigned batches just before: deliver them first
            wait = 0.5 if delivery.keep_warm else min(0.5, max(0.01, delivery.linger_secs - (now - idle_since)))
            for _ in self.conn.notifies(timeout=wait, stop_after=1):
                pass

    def _stop_reason(self) -> str | None:
        if not ledger.run_is_open(self.conn, self.stream.id, self.run_key):
            return "the sensor hands it no more batches (failover or catch-up)"
        if ledger.is_paused(self.conn, self.stream.id):
            return "the stream is paused"
        if self.context.instance.get_runs_count(dg.RunsFilter(tags={STREAM_TAG: str(self.stream.id)},
                                                           statuses=[dg.DagsterRunStatus.QUEUED])):
            return "another run of the stream is queued"
        return None


def _owed(stream: StreamConfig, batches: list[ledger.Batch]) -> list[Span]:
    """What the run owes of ``batches``: a retry resumes after the events the sink already confirmed
    (global order; ``by_key`` reads every event and its Spark tasks skip, per key, what an earlier attempt
    recorded in ``pgstream.key_progress``)."""
    return owed_spans(batches, resume=stream.delivery.ordering == "global")


def _direct_round(stream: StreamConfig, batches: list[ledger.Batch]) -> list[ledger.Batch]:
    """A run's next round of ``batches``, all assigned to it (ordering global): the first of them up
    to ``delivery.direct_max_events`` events (at least one batch), so that it is read without Spark;
    the rest come in the next rounds. A backlog is then delivered in rounds the run reads itself
    instead of a Spark job that, started while the writers take the CPUs, held the stream for 1-2
    minutes (bench/sustained.py)."""
    limit = stream.delivery.direct_max_events
    if stream.delivery.ordering != "global" or limit <= 0:
        return batches
    total = 0
    for i, batch in enumerate(batches):
        total += batch.event_count
        if total > limit and i > 0:
            return batches[:i]
    return batches


def _load(pyspark: LazyPySparkResource, executor_url: str, stream: StreamConfig, batches: list[ledger.Batch],
          conn: psycopg.Connection | None = None, handoff: Handoff | None = None) -> Any:
    """The round's events: Spark DataFrames (the executors read them with ``executor_url``), or with
    ``conn`` a round of at most ``delivery.direct_max_events`` (ordering global) read by ``conn`` when it
    is delivered, or taken from ``handoff`` (what the run's slot reader recorded)."""
    owed = _owed(stream, batches)
    delivery = stream.delivery
    if conn is not None and delivery.ordering == "global" and sum(s.events for s in owed) <= delivery.direct_max_events:
        return spark.DirectRead(conn, owed, delivery.routing_key, handoff, delivery.max_read_bytes)
    return spark.load_batches(pyspark.spark_session, executor_url, owed, delivery.routing_key,
                              rows_per_partition=delivery.rows_per_partition, packed=delivery.ordering == "global",
                              sizes=conn, read_bytes=delivery.max_read_bytes)


def _dead_letters(stream: StreamConfig, database_url: str) -> ledger.DeadLetterWriter:
    """The stream's dead-letter writer: what ``on_reject: dead_letter`` sets aside, and an event too large
    for the sink whatever ``on_reject`` says (it can never be delivered)."""
    return ledger.DeadLetterWriter(database_url, stream.id, stream.sink.type,
                                   resumes=stream.delivery.ordering == "global")


def _reject_policy(stream: StreamConfig, database_url: str) -> RejectPolicy | None:
    delivery = stream.delivery
    if delivery.on_reject != "dead_letter":
        return None
    writer = _dead_letters(stream, database_url)
    return RejectPolicy(writer, max_attempts=delivery.max_attempts,
                        max_consecutive=delivery.max_consecutive_rejects,
                        backoff_secs=min(stream.retry.initial_backoff_secs, 5.0), known_good=writer.known_good)


def _vanished_failure(conn: psycopg.Connection, stream_id: int, batch_ids: list[int]) -> dg.Failure:
    """The run stops at events that vanished from pgstream.events: say which, and how to go on."""
    skip = ledger.dead_letter_positions(conn, stream_id, batch_ids)
    gone = [(b, o, e) for b, o, e in ledger.vanished(conn, batch_ids) if (b, o) not in skip]
    ids = [e for _b, _o, e in gone]
    shown = ", ".join(f"{e} (batch {b} #{o})" for b, o, e in gone[:20]) + (" ..." if len(gone) > 20 else "")
    return dg.Failure(
        f"stream {stream_id}: {len(gone)} events the ledger owes are no longer in pgstream.events: {shown}. "
        f"Nothing after the first of them was delivered. To go on without them, set them aside (they become dead "
        f"letters without payload): `pgstream-dagster dead-letters set-aside {stream_id} "
        f"{' '.join(map(str, ids[:20]))} --reason vanished --yes`, or the {CONTROL_JOB} job with "
        f"action set_aside; or skip their batch.",
        metadata={"vanished_event_ids": dg.MetadataValue.json(ids[:1000])})


def _deliver_round(context: dg.OpExecutionContext, conn: psycopg.Connection, stream: StreamConfig, sink: Sink,
                   batches: list[ledger.Batch], frame: Any, pgstream: PgstreamResource,
                   recording: ledger.RecordingCheck) -> int:
    """Deliver ``batches`` (loaded as ``frame``) through the run's ``sink``, marking each delivered;
    returns the events handled (confirmed by the sink, or set aside as dead letters). What runs on the
    executors (``by_key`` tasks) connects with the executors' URL, what runs here with the runtime's.
    Once ``conn`` is broken (``recording``: Postgres restarted, the connection was cut) the run stops
    before the sink's next request, as nothing it confirms could be recorded."""
    try:
        return _round(context, conn, stream, sink, batches, frame, pgstream)
    except (psycopg.Error, SinkError):
        if recording():  # the connection still answers: not what stopped the run
            raise
        raise dg.Failure(
            f"stream {stream.id}: the run's ledger connection is broken ({recording.broken}): what the sink "
            f"confirms can no longer be recorded, so the run stopped publishing; the next run resumes after the "
            f"last confirmation recorded") from None


def _round(context: dg.OpExecutionContext, conn: psycopg.Connection, stream: StreamConfig, sink: Sink,
           batches: list[ledger.Batch], frame: Any, pgstream: PgstreamResource) -> int:
    by_key = stream.delivery.ordering == "by_key"
    database_url = pgstream.executor_database_url if by_key else pgstream.database_url
    batch_ids = [b.id for b in batches]
    owed = _owed(stream, batches)
    expected = {span.batch_id: span.events for span in owed}
    skip = ledger.dead_letter_positions(conn, stream.id, batch_ids)
    reject = _reject_policy(stream, database_url)
    before = ledger.count_dead_letters(conn, stream.id)
    for batch_id in [b for b, events in expected.items() if events == 0]:
        _mark_delivered(context, conn, expected, batch_id, 0)  # confirmed in full by a run that died before marking it
    try:
        if stream.delivery.ordering == "by_key":
            delivered = _deliver_by_key(context, conn, stream, frame, expected, skip, reject, database_url)
        else:
            if isinstance(frame, spark.DirectRead):  # the sink's limit: larger events are not read
                frame = dataclasses.replace(frame, event_bytes=max_event_bytes(sink))
            delivered = _deliver_in_order(context, conn, stream, sink, frame, owed, skip, reject,
                                          _dead_letters(stream, database_url))
    except MissingEventsError:
        raise _vanished_failure(conn, stream.id, batch_ids) from None
    missing = ledger.not_delivered(conn, batch_ids)
    if missing:
        raise dg.Failure(f"batches {missing} had no events in pgstream.events; refusing to mark them delivered")
    set_aside = ledger.count_dead_letters(conn, stream.id) - before
    if set_aside:
        context.log.warning(f"stream {stream.id}: {set_aside} events were rejected by the sink or larger than it can "
                            f"ever take and set aside as dead letters (pgstream-dagster dead-letters list {stream.id})")
    return delivered


def _mark_delivered(context: dg.OpExecutionContext, conn: psycopg.Connection, expected: dict[int, int],
                    batch_id: int, handled: int) -> None:
    """Every event the run owed of the batch was handled: mark it delivered."""
    if handled != expected[batch_id]:
        raise dg.Failure(f"batch {batch_id}: {expected[batch_id]} events were owed but {handled} were "
                         f"handled; refusing to mark it delivered")
    if not ledger.mark_delivered(conn, batch_id, context.run_id):
        raise dg.Failure(f"batch {batch_id} was already marked delivered by another run")


def _deliver_in_order(context: dg.OpExecutionContext, conn: psycopg.Connection, stream: StreamConfig, sink: Sink,
                      frame: Any, owed: list[Span], skip: frozenset[tuple[int, int]],
                      reject: RejectPolicy | None, too_large: ledger.DeadLetterWriter) -> int:
    """Global order: the publish loop yields what the sink confirmed and the run records each step in
    the ledger before the loop publishes anything more. Returns the events handled."""
    expected = {span.batch_id: span.events for span in owed}
    total = sum(expected.values())
    step = max(stream.delivery.chunk_size, total // 10)
    next_log, delivered = step, 0
    with closing(spark.deliver_in_order(frame, sink, stream.delivery.chunk_size,
                                        prefetch=stream.delivery.prefetch_partitions,
                                        skip=skip, reject=reject, owed=owed, too_large=too_large.too_large,
                                        chunk_bytes=stream.delivery.max_read_bytes)) as deliveries:
        for delivery in deliveries:
            match delivery:
                case Confirmed(batch_id, ord):  # a retry resumes after it
                    ledger.mark_confirmed(conn, batch_id, ord)
                case BatchDone(batch_id, events):
                    _mark_delivered(context, conn, expected, batch_id, events)
                case Progress(handled) if next_log <= handled < total:
                    context.log.info(f"stream {stream.id}: {handled}/{total} events handled")
                    next_log = handled + step
                case Finished(handled):
                    delivered = handled
    return delivered


def _deliver_by_key(context: dg.OpExecutionContext, conn: psycopg.Connection, stream: StreamConfig, frame: Any,
                    expected: dict[int, int], skip: frozenset[tuple[int, int]], reject: RejectPolicy | None,
                    database_url: str) -> int:
    """Per routing key, on the executors (each Spark task with a sink of its own, recording what it
    confirmed in ``pgstream.key_progress`` as it goes: a retry resumes per key); the tasks return
    their counts per batch, and each batch is marked delivered once every task is done and the
    counts add up. Returns the events handled."""
    batch_ids = list(expected)
    # no resume point per batch: every event must be there (or set aside) before anything is sent
    gone = [(b, o) for b, o, _e in ledger.vanished(conn, batch_ids)]
    if any(p not in skip for p in gone):
        raise MissingEventsError([p for p in gone if p not in skip])
    # an interrupted attempt's resume points hold for its partitioning: keep it until the round is delivered
    partitions = ledger.key_progress_partitions(conn, stream.id, batch_ids[0]) or stream.delivery.parallelism
    ledger.clear_key_progress(conn, stream.id, keep_partitions=partitions)
    if partitions != stream.delivery.parallelism:
        context.log.info(f"stream {stream.id}: resuming an interrupted by_key attempt with its {partitions} "
                         f"partitions (delivery.parallelism {stream.delivery.parallelism} applies from the next round)")
    progress = ledger.KeyProgress(database_url, stream.id, partitions, run_id=context.run_id)
    result = spark.deliver_by_key(frame, stream.sink, stream.delivery.chunk_size, partitions,
                                  skip=skip, reject=reject, progress=progress,
                                  too_large=_dead_letters(stream, database_url).too_large,
                                  chunk_bytes=stream.delivery.max_read_bytes)
    vanished_in = {b: sum(1 for g, _o in gone if g == b) for b in batch_ids}
    wrong = {b: (result.handled.get(b, 0), events) for b, events in expected.items()
             if result.handled.get(b, 0) + vanished_in[b] != events}
    if wrong:
        shown = ", ".join(f"batch {b}: {got} of {events}" for b, (got, events) in list(wrong.items())[:10])
        raise dg.Failure(f"the ledger and the events handled by the Spark tasks disagree ({shown}); "
                         f"refusing to mark batches delivered")
    for b, events in expected.items():
        _mark_delivered(context, conn, expected, b, events)
    ledger.clear_key_progress(conn, stream.id, through_batch_id=batch_ids[-1])
    if result.resumed:
        context.log.info(f"stream {stream.id}: {result.resumed} events confirmed by an interrupted attempt "
                         f"were not published again")
    return result.total


class _Report:
    """What the run's rounds delivered, told to Dagster: a line in the run log, a materialization of
    the stream's deliveries asset and an observation of its status asset (fresh counts without
    waiting for the sensor). The first round is reported at once; later rounds of an open run
    together, at most every ``delivery.report_every_secs`` and when the run ends, so a trickle of
    single events does not become an event-log entry each."""

    def __init__(self, context: dg.OpExecutionContext, conn: psycopg.Connection, stream: StreamConfig,
                 run_key: str) -> None:
        self.context, self.conn, self.stream, self.run_key = context, conn, stream, run_key
        self.reported_at = -float("inf")
        self._reset()

    def _reset(self) -> None:
        self.first: ledger.Batch | None = None
        self.last: ledger.Batch | None = None
        self.kinds: set[str] = set()
        self.batches = self.events = self.rounds = 0
        self.started = 0.0
        self.max_lag: float | None = None

    def add(self, batches: list[ledger.Batch], delivered: int, started: float) -> None:
        now = dt.datetime.now(dt.UTC)
        if self.first is None:
            self.first, self.started = batches[0], started
        self.last = batches[-1]
        self.kinds |= {b.kind for b in batches}
        self.batches += len(batches)
        self.events += delivered
        self.rounds += 1
        if batches[0].first_commit_at is not None:
            lag = (now - batches[0].first_commit_at).total_seconds()
            self.max_lag = lag if self.max_lag is None else max(self.max_lag, lag)
        if time.monotonic() - self.reported_at >= self.stream.delivery.report_every_secs:
            self.flush()

    def flush(self) -> None:
        first, last = self.first, self.last
        if first is None or last is None:
            return
        stream_id = self.stream.id
        rounds = f" in {self.rounds} rounds" if self.rounds > 1 else ""
        self.context.log.info(f"stream {stream_id}: sink {self.stream.sink.type} handled {self.events} events of "
                              f"{self.batches} batches {first.id}..{last.id}{rounds}")
        metadata: dict[str, Any] = {
            "batches": self.batches,
            "rounds": self.rounds,
            "first_batch_id": first.id,
            "last_batch_id": last.id,
            "kinds": ", ".join(sorted(self.kinds)),
            "events": self.events,
            "first_event_id": first.first_event_id,
            "last_event_id": last.last_event_id,
            "duration_secs": round(time.monotonic() - self.started, 3),
        }
        if self.max_lag is not None:  # the slowest round's first batch: commit -> delivered
            metadata["commit_to_delivery_lag_secs"] = round(self.max_lag, 3)
        self.context.log_event(dg.AssetMaterialization(
            asset_key=deliveries_asset_key(stream_id),
            description=f"batches {first.id}..{last.id} delivered", metadata=metadata))
        for materialization in lake_materializations(self.stream, metadata):  # a lake sink's table (defs/lake.py)
            self.context.log_event(materialization)
        rows = stream_status(self.conn, stream_id, last=5) if not (self.conn.closed or self.conn.broken) else []
        if rows:
            row = rows[0]
            state = f"live: run {self.context.run_id} (this run)" if row.get("open_run_key") == self.run_key else None
            self.context.log_event(status_observation(row, state, observer=f"delivery run {self.context.run_id}"))
        self.reported_at = time.monotonic()
        self._reset()


@dg.job(
    name=DELIVERY_JOB,
    description="Deliver consecutive batches of a stream's events to its sink (requested by the stream's sensor).",
    executor_def=dg.in_process_executor,
)
def delivery_job() -> None:
    deliver_batches(load_batches())
