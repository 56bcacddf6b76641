"""Replay: re-deliver a stream's events from ``pgstream.events`` through its sink, selected by event-id range, time
range and/or subscription keys, in id order, in chunks, with progress in the run log. One job for the location
(``pgstream_replay``), the stream in its run config (``stream_id``). A run is tagged with its stream
(``pgstream/stream``) when it starts, so the run queue holds the stream's deliveries behind it, and whatever launches
it (``dagster job execute`` bypasses the queue) it holds the stream's delivery lease throughout
(:func:`~..engine.ledger.locks.acquire_replay_lease`): it never interleaves with them. ``dry_run`` only counts (no
lease). Replays are at-least-once: the sink sees the events again, with the same ids as idempotency keys; the ledger
is not touched. The same job redelivers the stream's open dead letters (``dead_letters: true`` or
``dead_letter_ids``) in their delivery-order position (:func:`~..engine.deadletters.redeliver`, no Spark), queued and
leased like any replay.
"""

import time
from collections.abc import Generator
from contextlib import ExitStack, closing
from typing import Any

import dagster as dg
from dagster_pyspark import LazyPySparkResource
from pydantic import Field

from ..config import StreamConfig
from ..engine import deadletters
from ..engine.dbconn import database_key
from ..engine.delivery.sources import (
    LinesSource,
    Readers,
    Route,
    Selection,
    Source,
    choose_source,
    publish_in_order,
    range_size,
    route,
)
from ..engine.ledger import locks
from ..engine.publish import Finished, Progress, TooLarge
from ..engine.replay import (
    Counted,
    ReplayError,
    count_note,
    count_selected,
    dead_letter_selection,
    deliver_lines,
    plan,
    selection,
)
from ..sinks import build_sink
from ..sinks.base import Sink
from .names import REPLAY_JOB, REPLAY_OP, REPLAY_TAG, STREAM_TAG, deliveries_asset_key, stream_tag
from .resources import PgstreamResource


class ReplayConfig(dg.Config):
    """What to replay. Bounds are inclusive except ``to_time``; at least one filter is required
    (``all_events: true`` replays everything still in the table). The fields to fill have a default, so the
    Launchpad's template shows them; the default stream, 0, is none: a run launched without choosing one fails,
    naming ``stream_id`` and the streams there are."""

    stream_id: int = Field(0, ge=0, description="the stream to replay (required: the default, 0, is none)")
    from_event_id: int = Field(0, ge=0, description="first event id (inclusive; 0: from the first)")
    to_event_id: int = Field(0, ge=0, description="last event id (inclusive; 0: through the last)")
    from_time: str = Field("", description="ISO 8601, events created at or after (UTC if no offset; empty: no "
                                           "lower bound)")
    to_time: str = Field("", description="ISO 8601, events created before (UTC if no offset; empty: no upper bound)")
    # a list default is copied for each config (pydantic), and unlike default_factory Dagster shows it
    subscription_keys: list[str] = Field([], description="only events of these subscriptions")
    all_events: bool = Field(False, description="replay every event of the stream still in pgstream.events")
    dry_run: bool = Field(False, description="count what would be replayed, deliver nothing")
    chunk_size: int = Field(0, ge=0, le=100_000, description="events per publish call (0: the stream's "
                                                             "delivery.chunk_size)")
    dead_letters: bool = Field(False, description="instead of events from the table: redeliver every open dead "
                                                  "letter of the stream, in delivery order (dry_run lists them)")
    dead_letter_ids: list[int] = Field([], description="instead of events from the table: redeliver these open dead "
                                                       "letters of the stream, in delivery order")


def _redeliver_dead_letters(context: dg.OpExecutionContext, stream: StreamConfig, config: ReplayConfig,
                            pgstream: PgstreamResource) -> int:
    started = time.monotonic()
    try:
        ids = dead_letter_selection(config)
        with pgstream.connect() as conn:
            report = deadletters.redeliver(conn, stream, ids, f"dagster run {context.run_id}", config.chunk_size,
                                           dry_run=config.dry_run)
    except (ReplayError, deadletters.DeadLetterError) as exc:
        raise dg.Failure(f"redelivery of stream {stream.id}'s dead letters: {exc}") from None
    for letter in report.planned:
        context.log.info(letter.describe())
    first, *problems = report.lines()
    context.log.info(first)
    for line in problems:
        context.log.warning(line)
    elapsed = time.monotonic() - started
    metadata: dict[str, Any] = {
        "kind": "dead_letters", "dry_run": config.dry_run, "planned": len(report.planned),
        "redelivered": len(report.redelivered),
        "redelivered_ids": dg.MetadataValue.json(report.redelivered),
        "undeliverable_ids": dg.MetadataValue.json([i for i, _ in report.undeliverable]),
        "waiting_ids": dg.MetadataValue.json(report.waiting)}
    if report.redelivered and not config.dry_run:
        context.log_event(dg.AssetMaterialization(
            asset_key=deliveries_asset_key(stream.id), description=f"redelivery of {len(report.redelivered)} "
                                                                   f"dead letters",
            metadata={**metadata, "events": len(report.redelivered), "duration_secs": round(elapsed, 3)}))
    context.add_output_metadata(metadata)
    if report.failed is not None:
        raise dg.Failure(f"redelivery of stream {stream.id}'s dead letters stopped: {report.summary()}",
                         metadata=metadata)
    return 0 if config.dry_run else len(report.redelivered)


@dg.op(name=REPLAY_OP, description="Replay events of the stream stream_id from pgstream.events through its sink, or "
                                    "redeliver its dead letters.")
def replay(context: dg.OpExecutionContext, config: ReplayConfig, pgstream: dg.ResourceParam[PgstreamResource],
           pyspark: LazyPySparkResource) -> int:
    stream = pgstream.chosen_stream(config.stream_id, "replay")
    # the run's stream: the run queue holds the stream's deliveries behind it, the UI filters by it
    with pgstream.connect() as conn:
        context.instance.add_run_tags(context.run_id, {STREAM_TAG: stream_tag(stream.id, database_key(conn))})
    letters = config.dead_letters or config.dead_letter_ids
    try:  # a bad request fails before it takes anything
        if letters:
            dead_letter_selection(config)
        else:
            selection(stream.id, config)
    except ReplayError as exc:
        what = f"redelivery of stream {stream.id}'s dead letters" if letters else f"replay of stream {stream.id}"
        raise dg.Failure(f"{what}: {exc}") from None
    with ExitStack() as held:
        if not config.dry_run:
            # the stream's delivery lease for the whole replay, whatever launched it: live delivery waits
            context.log.info(f"replay of stream {stream.id}: taking the stream's delivery lease (the open "
                             "run, if any, delivers what it was handed and closes)")
            held.enter_context(locks.acquire_replay_lease(
                pgstream.database_url, stream.id, context.run_id,
                lambda what: context.log.info(f"replay of stream {stream.id}: waiting for {what}")))
        if letters:
            return _redeliver_dead_letters(context, stream, config, pgstream)
        return _replay(context, stream, config, pgstream, pyspark)


def _replay(context: dg.OpExecutionContext, stream: StreamConfig, config: ReplayConfig, pgstream: PgstreamResource,
            pyspark: LazyPySparkResource) -> int:
    with build_sink(stream.sink) as sink:  # closed however the replay ends
        # where the events come from: the choice every delivery makes (engine.delivery.sources.route): JSON
        # lines rendered by Postgres for a sink that takes them, else the run's own connections unless every
        # read goes to Spark
        readers = Readers(pgstream.database_url, pgstream.executor_database_url,
                          spark=lambda: pyspark.spark_session, sink=sink)
        chosen = route(stream.delivery, Selection({}), readers)
        as_lines, direct = chosen is Route.LINES, chosen is Route.RANGE
        started = time.monotonic()
        chunk_size = config.chunk_size or stream.delivery.chunk_size
        what = (f"events {config.from_event_id or 'first'}..{config.to_event_id or 'last'}, "
                f"time [{config.from_time or '-inf'}, {config.to_time or '+inf'}), "
                f"subscriptions {config.subscription_keys or 'all'}")
        count: int | None = None  # a lines replay counts while its first chunks are read (Counted)
        ranges: list[tuple[int, int]] = []  # the ranges read (a lines replay streams its ranges)
        try:
            if as_lines:
                params = selection(stream.id, config)
                if config.dry_run:
                    with pgstream.connect() as conn:
                        count = count_selected(conn, params)
            else:
                with pgstream.connect() as conn:
                    count, ranges, params = plan(conn, stream.id, config, range_size(stream.delivery, readers))
        except ReplayError as exc:
            raise dg.Failure(f"replay of stream {stream.id}: {exc}") from None

        def planned(n: int) -> None:
            context.log.info(f"replay of stream {stream.id}: {n} events ({what}) in " + (
                f"{-(-n // chunk_size)} chunks of JSON lines rendered by Postgres" if as_lines
                else f"{len(ranges)} ranges read without Spark" if direct else f"{len(ranges)} Spark partitions"))

        if count is not None:
            planned(count)
            if config.dry_run or count == 0:
                context.log.info("dry run: nothing delivered" if config.dry_run else "nothing to replay")
                context.add_output_metadata({"events": count, "dry_run": config.dry_run})
                return 0
        next_log, delivered = 0, 0  # next_log 0: the first progress line once the count is known
        first: tuple[float, int] | None = None  # (time, count) of the first confirmed chunk
        source = choose_source(stream.delivery, Selection(params, ranges), readers)
        with closing(deliver_lines(source.database_url, source.params, chunk_size, sink, source.read_bytes)
                     if isinstance(source, LinesSource)
                     else _published(context, stream, source, sink, chunk_size)) as progress:
            for done in progress:
                if isinstance(done, Counted):
                    count = done.events
                    planned(count)
                    continue
                first = first or (time.monotonic(), done)
                delivered = done
                if count and next_log <= done < count:
                    if next_log:
                        rate = done / max(time.monotonic() - started, 1e-6)
                        context.log.info(f"replayed {done}/{count} events ({100 * done // count}%, "
                                         f"{rate:.0f} events/s)")
                    next_log = done + max(10_000, count // 20)
        if not count and not delivered:
            context.log.info("nothing to replay")
            context.add_output_metadata({"events": 0, "dry_run": False})
            return 0
        elapsed = time.monotonic() - started
        context.log.info(f"replay of stream {stream.id}: sink {stream.sink.type} confirmed {delivered} events "
                         f"in {elapsed:.1f}s")
        note = count_note(count or 0, delivered)
        if note is not None:  # events committed or deleted while the replay ran: the sink got what was there
            context.log.warning(f"replay of stream {stream.id}: {note}")
        metadata: dict[str, Any] = {
            "kind": "replay", "events": delivered, "planned": count, "duration_secs": round(elapsed, 3),
            "events_per_sec": round(delivered / max(elapsed, 1e-6)), "selection": what}
        if first:  # the rate once events flow (without Spark start-up and the first partition's read)
            metadata["first_chunk_secs"] = round(first[0] - started, 3)
            metadata["streaming_events_per_sec"] = round((delivered - first[1]) /
                                                         max(time.monotonic() - first[0], 1e-6))
        context.log_event(dg.AssetMaterialization(asset_key=deliveries_asset_key(stream.id),
                                                  description=f"replay of {delivered} events",
                                                  metadata=metadata))
        context.add_output_metadata({"events": delivered, "dry_run": False})
        return delivered


def _published(context: dg.OpExecutionContext, stream: StreamConfig, source: Source, sink: Sink,
               chunk_size: int) -> Generator[int, None, None]:
    """The events confirmed so far, as ``source`` reads the selected events (at most
    ``delivery.tuning.max_read_bytes`` at a time) and they are published in order. An event larger than
    the sink can ever take is not read and not sent: the run log names it."""
    assert hasattr(source, "events"), f"{type(source).__name__} is no source of a replay's events"

    def too_large(_batch_id: int, _ord: int, row: TooLarge) -> None:
        context.log.warning(f"replay of stream {stream.id}: {row.reason} (not replayed)")

    with closing(publish_in_order(source, sink, chunk_size, too_large=too_large,
                                  chunk_bytes=stream.delivery.tuning.max_read_bytes)) as deliveries:
        for delivery in deliveries:
            if isinstance(delivery, Progress | Finished):
                yield delivery.handled


@dg.job(name=REPLAY_JOB, tags={REPLAY_TAG: "true"}, executor_def=dg.in_process_executor,
        description="Replay events of a stream (stream_id) by id range, time range or subscription keys, or redeliver "
                    "its dead letters (launch from the Launchpad; dry_run only counts). Its runs are tagged "
                    f"{STREAM_TAG}=<stream_id>@<host:port/database> when they start.")
def replay_job() -> None:
    replay()
