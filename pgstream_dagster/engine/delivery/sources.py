"""Where a delivery's events come from: a source per :class:`Route`, and the **one** choice among them for a round,
a replay and a redelivery (:func:`route`, :func:`choose_source`). No Dagster; Spark only behind :data:`SparkLoader`."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import psycopg

from ...sinks.base import Event, Sink, event_from_text
from .. import dbconn
from ..handoff import Handoff
from ..ledger.deadletters import DeadLetter
from ..publish import (
    CHUNK_BYTES,
    Deliveries,
    Gate,
    Position,
    Positioned,
    RejectPolicy,
    SetAsideTooLarge,
    Span,
    TooLarge,
    max_event_bytes,
    publish,
)
from .reads import (
    BATCH_QUERY_BOUNDED,
    FETCH_ROWS,
    READ_BYTES,
    Piece,
    cut,
    events_query,
    events_sizes,
    in_turn,
    positioned,
    routing_params,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from ...config import DeliveryConfig

#: how the host starts (or returns) its Spark session: called only when a round goes to Spark
SparkLoader: TypeAlias = "Callable[[], SparkSession]"


class EventSource(Protocol):
    """Events in delivery order at their positions (a replay: ``(0, id)``), or a ``TooLarge`` in one's place."""

    def events(self) -> Iterator[Positioned]: ...


@dataclasses.dataclass(frozen=True)
class TableSource:
    """Route ``table``: ``spans`` (a round of at most ``direct_max_events``) read by the run's own connection (a
    Spark job costs 0.1-0.3 s and half a CPU-second whatever its size: bench/cpu.py), or taken from ``handoff``."""

    conn: psycopg.Connection
    spans: Sequence[Span]
    routing_key: str
    read_bytes: int = READ_BYTES  # one read's bytes at most (one event at least): ``tuning.max_read_bytes``
    event_bytes: int | None = None  # a larger payload is not read (``TooLarge``): the sink's ``max_event_bytes()``
    handoff: Handoff | None = None

    def events(self) -> Iterator[Positioned]:
        for whole in self.spans:
            kept = (self.handoff.take(whole.batch_id, whole.first, whole.last, self.event_bytes)
                    if self.handoff is not None else None)
            if kept is not None:
                yield from kept
                continue
            for span in whole.split(FETCH_ROWS):
                # each piece fetched whole before anything is yielded: the caller writes on the same connection
                yield from self._read(span.batch_id, span.first, span.last)

    def _read(self, batch_id: int, lo: int, hi: int) -> Iterator[Positioned]:
        where = {"batch_id": batch_id, "budget": self.read_bytes, "limit": self.event_bytes}
        rows = self.conn.execute(BATCH_QUERY_BOUNDED, {**where, "lo": lo, "hi": hi}).fetchall()
        utc = dt.UTC
        rest: list[tuple[int, int, int, int]] = []  # (ord, id, payload bytes, metadata bytes) after the cut
        for batch, ord_, event_id, stream_id, created, payload, metadata, payload_bytes, metadata_bytes in rows:
            if rest or (payload is None and (self.event_bytes is None or payload_bytes <= self.event_bytes)):
                rest.append((ord_, event_id, payload_bytes, metadata_bytes))
            elif payload is None:
                assert self.event_bytes is not None
                yield batch, ord_, TooLarge(event_id, payload_bytes, self.event_bytes)
            else:
                yield batch, ord_, event_from_text(event_id, stream_id, created.astimezone(utc), payload, metadata)
        del rows
        if not rest:
            return
        for piece in cut(rest, rest[0][0], hi, self.read_bytes, self.event_bytes):
            if isinstance(piece, Piece):  # fits whole (its events' sizes are known)
                yield from self._read(batch_id, piece.lo, piece.hi)
            else:
                yield batch_id, piece[0], piece[1]


@dataclasses.dataclass(frozen=True)
class RangeSource:
    """Route ``range``: a replay's id ``ranges``, each read by a connection of its own while one is published."""

    database_url: str
    ranges: Sequence[tuple[int, int]]
    params: dict[str, Any]
    routing_key: str
    read_bytes: int = READ_BYTES  # (as TableSource's)
    event_bytes: int | None = None

    def events(self) -> Iterator[Positioned]:
        if not self.ranges:
            return
        params = {**self.params, **routing_params(self.routing_key)}
        query, sizes = events_query(params), events_sizes(params)
        with dbconn.connect(self.database_url, autocommit=True, options="-c TimeZone=UTC",
                             application_name="pgstream replay") as conn:

            def read(lo: int, hi: int) -> Callable[[], list[Positioned]]:
                return lambda: list(positioned(conn.execute(query, {**params, "lo": lo, "hi": hi}).fetchall()))

            def reads() -> Iterator[Callable[[], list[Positioned]]]:
                """A read per piece of a range within the byte budget (the next sizes query waits for it)."""
                for lo, hi in self.ranges:
                    pieces = list(cut(conn.execute(sizes, {**params, "lo": lo, "hi": hi}).fetchall(), lo, hi,
                                      self.read_bytes, self.event_bytes))
                    for piece in pieces:
                        if isinstance(piece, Piece):
                            yield read(piece.lo, piece.hi)
                        else:
                            yield lambda piece=piece: [(0, piece[0], piece[1])]  # type: ignore[misc]

            # the piece after the one being published is read meanwhile: two pieces in memory at most
            with contextlib.closing(in_turn(reads())) as pieces:
                for rows in pieces:
                    yield from rows


@dataclasses.dataclass(frozen=True)
class SparkSource:
    """Route ``spark``: packed single-partition DataFrames collected one at a time (``prefetch``: the next too)."""

    frames: list[DataFrame]
    prefetch: bool = True

    def events(self) -> Iterator[Positioned]:
        from .. import spark

        return spark.frame_events(self.frames, self.prefetch)


@dataclasses.dataclass(frozen=True)
class KeyedSource:
    """Route ``by_key``: one DataFrame the Spark tasks publish per routing key; only counts come to the driver."""

    frame: DataFrame


@dataclasses.dataclass(frozen=True)
class LinesSource:
    """Route ``lines``: a replay to a sink that takes JSON lines (the file sink), rendered by Postgres."""

    database_url: str
    params: dict[str, Any]
    read_bytes: int = READ_BYTES


@dataclasses.dataclass(frozen=True)
class DeadLetterSource:
    """Route ``letters``: open dead letters in chunks of at most ``chunk_size`` and ``read_bytes`` (one at least)."""

    conn: psycopg.Connection
    letters: Sequence[DeadLetter]
    chunk_size: int
    read_bytes: int = READ_BYTES

    def chunks(self) -> Iterator[tuple[list[DeadLetter], list[Event]]]:
        letters, start = list(self.letters), 0
        while start < len(letters):
            end, used = start, 0
            while end < len(letters) and end - start < self.chunk_size and \
                    (end == start or used + (letters[end].payload_bytes or 0) <= self.read_bytes):
                used += letters[end].payload_bytes or 0
                end += 1
            chunk = letters[start:end]
            yield chunk, self._events(chunk)
            start = end

    def _events(self, letters: list[DeadLetter]) -> list[Event]:
        if all(d.payload_bytes is None and d.payload_json for d in letters):  # listed with their payloads
            return [d.event() for d in letters]
        texts = {row[0]: row[1:] for row in self.conn.execute(
            "select id, payload::text, metadata::text from pgstream.dead_letters where id = any(%s)",
            [[d.id for d in letters]])}
        return [dataclasses.replace(d, payload_json=texts[d.id][0], metadata_json=texts[d.id][1]).event()
                for d in letters]


Source: TypeAlias = "TableSource | SparkSource | KeyedSource | RangeSource | LinesSource | DeadLetterSource"


class Route(StrEnum):
    TABLE = "table"
    SPARK = "spark"
    BY_KEY = "by_key"
    RANGE = "range"
    LINES = "lines"
    LETTERS = "letters"


@dataclasses.dataclass(frozen=True)
class Owed:
    """A delivery round: what the run owes of its batches, in order."""

    spans: Sequence[Span]

    @property
    def events(self) -> int:
        return sum(s.events for s in self.spans)


@dataclasses.dataclass(frozen=True)
class Selection:
    """A replay: the parameters of ``replay.selection`` and the id ranges of ``replay.plan`` (:func:`range_size`)."""

    params: dict[str, Any]
    ranges: Sequence[tuple[int, int]] = ()


@dataclasses.dataclass(frozen=True)
class Letters:
    """A redelivery: open dead letters in delivery order."""

    letters: Sequence[DeadLetter]
    chunk_size: int


@dataclasses.dataclass(frozen=True)
class Readers:
    """What the host can read with; ``database_url``: the runtime's (the run's own reads)."""

    database_url: str
    executor_url: str = ""  # what Spark executors connect with
    conn: psycopg.Connection | None = None  # the run's own: a round is read on it (else every round goes to Spark)
    spark: SparkLoader | None = None  # the host's Spark session, started when first needed
    sink: Sink | None = None  # the sink the events go to: whether it takes JSON lines, the largest event it takes
    handoff: Handoff | None = None  # what the group run's reader recorded (a round takes its batches there first)


def route(delivery: DeliveryConfig, want: Owed | Selection | Letters, readers: Readers) -> Route:
    """Where a round (``Owed``), a replay (``Selection``) or a redelivery (``Letters``) is read: ``by_key`` on Spark
    tasks; an ordered round by the run's connection up to ``tuning.direct_max_events`` (else, or 0: Spark); a
    replay as JSON lines when the sink takes them, else by the run's connections (0: Spark)."""
    direct = delivery.direct_max_events
    if isinstance(want, Letters):
        return Route.LETTERS
    if isinstance(want, Selection):
        if readers.sink is not None and readers.sink.accepts_json_lines:
            return Route.LINES
        return Route.RANGE if delivery.tuning.direct_max_events > 0 else Route.SPARK  # whatever the mode
    if delivery.ordering == "by_key":
        return Route.BY_KEY
    if direct <= 0 or readers.conn is None or want.events > direct:
        return Route.SPARK
    return Route.TABLE


def range_size(delivery: DeliveryConfig, readers: Readers) -> int:
    """The events per id range a replay is planned in: a read of the run's connections, or a Spark partition."""
    return FETCH_ROWS if route(delivery, Selection({}), readers) is Route.RANGE else delivery.tuning.rows_per_partition


def choose_source(delivery: DeliveryConfig, want: Owed | Selection | Letters, readers: Readers) -> Source:
    """The source :func:`route` chooses, ready to read."""
    chosen = route(delivery, want, readers)
    limit = max_event_bytes(readers.sink) if readers.sink is not None else None
    read_bytes = delivery.tuning.max_read_bytes
    if isinstance(want, Letters):
        assert readers.conn is not None, "a redelivery reads the dead letters' payloads on the caller's connection"
        return DeadLetterSource(readers.conn, want.letters, want.chunk_size, read_bytes)
    if isinstance(want, Selection):
        if chosen is Route.LINES:
            return LinesSource(readers.database_url, want.params, read_bytes)
        if chosen is Route.RANGE:
            return RangeSource(readers.database_url, want.ranges, want.params, delivery.routing_key, read_bytes, limit)
        from .. import spark

        params = want.params
        loaded = spark.load_events(
            _session(readers), readers.executor_url, params["stream_id"], list(want.ranges), delivery.routing_key,
            from_time=params["from_time"].isoformat() if params.get("from_time") else None,
            to_time=params["to_time"].isoformat() if params.get("to_time") else None,
            keys=params.get("keys") or None, packed=True)
        assert isinstance(loaded, list)  # packed: one single-partition DataFrame per id range
        return SparkSource(loaded, delivery.tuning.prefetch_partitions)
    if chosen is Route.TABLE:
        assert readers.conn is not None
        return TableSource(readers.conn, want.spans, delivery.routing_key, read_bytes, limit, readers.handoff)
    from .. import spark

    frames = spark.load_batches(_session(readers), readers.executor_url, want.spans, delivery.routing_key,
                                rows_per_partition=delivery.tuning.rows_per_partition,
                                packed=chosen is Route.SPARK, sizes=readers.conn, read_bytes=read_bytes)
    if chosen is Route.BY_KEY:
        assert not isinstance(frames, list)
        return KeyedSource(frames)
    assert isinstance(frames, list)
    return SparkSource(frames, delivery.tuning.prefetch_partitions)


def _session(readers: Readers) -> SparkSession:
    if readers.spark is None:
        raise RuntimeError("this round goes to Spark, and the host gave no Spark session")
    return readers.spark()


def publish_in_order(source: EventSource, sink: Sink, chunk_size: int, *, skip: frozenset[Position] = frozenset(),
                     reject: RejectPolicy | None = None, owed: Sequence[Span] | None = None,
                     too_large: SetAsideTooLarge | None = None, chunk_bytes: int = CHUNK_BYTES,
                     gate: Gate = contextlib.nullcontext, ended_below: int = 0) -> Deliveries:
    """``publish`` of ``source``'s events; closing it closes them in the caller's thread (a prefetch waited for)."""
    events = source.events()
    try:
        yield from publish(sink, events, chunk_size, skip=skip, reject=reject, owed=owed, too_large=too_large,
                           chunk_bytes=chunk_bytes, gate=gate, ended_below=ended_below)
    finally:
        if (close := getattr(events, "close", None)) is not None:
            close()
