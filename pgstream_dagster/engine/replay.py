"""Replay planning, without Dagster: validate a request (``ReplayConfig``, the ``pgstream_replay`` job) and
split the selected events into id ranges (:func:`plan`). A sink that takes JSON lines is replayed by
:func:`deliver_lines`, Postgres rendering each line (:data:`EVENT_JSON_LINE`, about the cost of a ``COPY``:
bench/replay.py); other sinks read the ranges through the source :func:`~.delivery.sources.route` picks.
"""


import datetime as dt
import threading
from collections import deque
from collections.abc import Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any, Protocol

import psycopg
from psycopg import sql

from ..sinks.base import Sink
from . import dbconn
from .delivery import reads


class ReplaySelection(Protocol):
    """What to replay (``defs.replay.ReplayConfig`` has these fields). A bound that is ``None``, 0 or ``""`` is
    not given (the Launchpad's template shows 0 and ``""``): event ids start at 1."""

    @property
    def from_event_id(self) -> int | None: ...
    @property
    def to_event_id(self) -> int | None: ...
    @property
    def from_time(self) -> str | None: ...
    @property
    def to_time(self) -> str | None: ...
    @property
    def subscription_keys(self) -> list[str]: ...
    @property
    def all_events(self) -> bool: ...
    @property
    def dead_letters(self) -> bool: ...
    @property
    def dead_letter_ids(self) -> list[int]: ...


class ReplayError(ValueError):
    """The replay request is invalid; nothing was delivered."""


def _timestamp(name: str, value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError as exc:
        raise ReplayError(f"{name}: {value!r} is not an ISO 8601 timestamp ({exc})") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _filter(params: Mapping[str, Any]) -> sql.SQL:
    return sql.SQL(reads.events_where(params))


def dead_letter_selection(config: ReplaySelection) -> list[int] | None:
    """The dead letters ``config`` selects (``None``: all open ones of the stream)."""
    others = [name for name, value in (("from_event_id", config.from_event_id), ("to_event_id", config.to_event_id),
                                       ("from_time", config.from_time), ("to_time", config.to_time),
                                       ("subscription_keys", config.subscription_keys),
                                       ("all_events", config.all_events)) if value]
    if others:
        raise ReplayError(f"dead_letters/dead_letter_ids redeliver dead letters and take no event filter: "
                          f"remove {', '.join(others)}")
    if config.dead_letters and config.dead_letter_ids:
        raise ReplayError("give dead_letters: true (every open dead letter) or dead_letter_ids, not both")
    return None if config.dead_letters else list(config.dead_letter_ids)


def selection(stream_id: int, config: ReplaySelection) -> dict[str, Any]:
    """Validate ``config``: the query parameters of :func:`~pgstream_dagster.engine.reads.events_where`
    that select its events."""
    if not (config.all_events or config.subscription_keys or any(
            (config.from_event_id, config.to_event_id, config.from_time, config.to_time))):
        raise ReplayError("give an event-id range, a time range or subscription keys "
                          "(or all_events: true to replay the whole table)")
    from_time = _timestamp("from_time", config.from_time)
    to_time = _timestamp("to_time", config.to_time)
    if from_time and to_time and from_time >= to_time:
        raise ReplayError(f"from_time {from_time.isoformat()} is not before to_time {to_time.isoformat()}")
    lo = config.from_event_id or 0
    hi = config.to_event_id or 2**63 - 1
    if lo > hi:
        raise ReplayError(f"from_event_id {lo} is after to_event_id {hi}")
    return {"stream_id": stream_id, "lo": lo, "hi": hi, "from_time": from_time, "to_time": to_time,
            "keys": config.subscription_keys or None}


def count_selected(conn: psycopg.Connection, params: Mapping[str, Any]) -> int:
    """How many events :func:`selection`'s ``params`` select."""
    row = conn.execute(sql.SQL("select pg_catalog.count(*) from pgstream.events e where {}").format(_filter(params)),
                       params).fetchone()
    return int(row[0]) if row else 0


#: the selected ids walked by ``MOVE``: every size-th id fetched (a range starts there), the ids between
#: skipped and counted inside Postgres: bounds and count from one index scan
_SELECTED_IDS = sql.SQL("declare pgstream_replay_ids no scroll cursor for "
                        "select e.id from pgstream.events e where {} order by e.id")


class IdRanges:
    """The selected events in id ranges of ``size`` events (the last may hold fewer), read with ``conn`` when
    iterated; :attr:`total` is known once the last range has been yielded."""

    def __init__(self, conn: psycopg.Connection, params: Mapping[str, Any], size: int) -> None:
        self._conn, self._params, self._size = conn, params, size
        #: the events selected, once the walk has reached the last of them (None before)
        self.total: int | None = None

    def __iter__(self) -> Generator[tuple[int, int], None, None]:
        seen = 0
        with self._conn.transaction(), self._conn.cursor() as cur:
            cur.execute(_SELECTED_IDS.format(_filter(self._params)), self._params)
            start: int | None = None
            while (row := cur.execute("fetch forward 1 from pgstream_replay_ids").fetchone()) is not None:
                if start is not None:
                    yield start, int(row[0]) - 1
                start = int(row[0])
                seen += 1
                if self._size > 1:  # (a move of 0 rows would count the current one)
                    seen += cur.execute(sql.SQL("move forward {} in pgstream_replay_ids").format(
                        sql.Literal(self._size - 1))).rowcount
            cur.execute("close pgstream_replay_ids")  # (the transaction may be a savepoint in the caller's)
            self.total = seen
            if start is not None:
                yield start, self._params["hi"]


def plan(conn: psycopg.Connection, stream_id: int, config: ReplaySelection,
         rows_per_partition: int = reads.ROWS_PER_PARTITION) -> tuple[int, list[tuple[int, int]], dict[str, Any]]:
    """Validate ``config`` and count the events: ``(count, id ranges of at most
    rows_per_partition events each, in order, query parameters)``."""
    params = selection(stream_id, config)
    ranges = IdRanges(conn, params, rows_per_partition)
    bounds = list(ranges)
    return ranges.total or 0, bounds, params


def count_note(planned: int, delivered: int) -> str | None:
    """What happened when a replay delivered another number of events than it planned (None: the same): events
    committed into the selection meanwhile are delivered too, events deleted meanwhile (retention) are not."""
    if delivered == planned:
        return None
    if delivered > planned:
        return (f"{planned} events were planned but {delivered} were delivered: {delivered - planned} more events "
                "were committed within the selection after the replay was planned (its upper bound is open or not "
                "reached yet), and the replay delivered them too, in id order; give to_event_id to replay a "
                "fixed set")
    return (f"{planned} events were planned but {delivered} were delivered: {planned - delivered} of the selected "
            "events were deleted (retention) before the replay read them; the replay delivered the others, in "
            "id order")


#: one event as :meth:`pgstream_dagster.sinks.base.Event.to_json` renders it (what the file sink writes),
#: rendered by Postgres (``created_at`` as ``isoformat()`` writes it in UTC; payload and metadata as jsonb text)
EVENT_JSON_LINE = """
    '{"id":' || e.id || ',"stream_id":' || e.stream_id || ',"created_at":"'
    || pg_catalog.replace(pg_catalog.to_char(pg_catalog.timezone('UTC', e.created_at), 'YYYY-MM-DD"T"HH24:MI:SS.US'),
                          '.000000', '')
    || '+00:00","payload":' || e.payload::pg_catalog.text
    || ',"metadata":' || coalesce(e.metadata::pg_catalog.text, 'null') || '}'"""

#: one chunk of the selection (an id range of :func:`plan`) as UTF-8 lines in id order, cut by the server at
#: ``budget`` bytes (the first whatever its size): the lines that fit (a prefix), how many come after (``cut``)
_LINES_QUERY = sql.SQL("""
select pg_catalog.count(*) filter (where x.fits)::int, pg_catalog.min(x.id) filter (where x.fits),
       pg_catalog.max(x.id) filter (where x.fits),
       pg_catalog.convert_to(pg_catalog.string_agg(x.line, E'\\n' order by x.id) filter (where x.fits)
                             || E'\\n', 'UTF8'),
       pg_catalog.count(*) filter (where not x.fits)::int
from (select y.id, y.line,
             pg_catalog.sum(pg_catalog.octet_length(y.line)) over w <= %(budget)s
             or pg_catalog.row_number() over w = 1 as fits
      from (select e.id, {line} as line from pgstream.events e where {where} order by e.id) y
      window w as (order by y.id rows between unbounded preceding and current row)) x""")

#: chunks read ahead (by _READERS connections) while the sink takes the current one
_AHEAD = 3
_READERS = 2


@dataclass(frozen=True)
class Counted:
    """How many events the replay's selection holds (counted while the first chunks are read)."""

    events: int


@dataclass(frozen=True)
class Lines:
    """A chunk of events as JSON lines (``data``: ``count`` newline-terminated UTF-8 lines, ids
    ``first_id``..``last_id`` in order); ``count`` 0 when the range's events were deleted meanwhile."""

    count: int
    first_id: int
    last_id: int
    data: bytes
    #: events of the range after ``last_id`` that did not fit the read's byte budget (read next)
    cut: int = 0


def read_lines(database_url: str, params: Mapping[str, Any], size: int, read_bytes: int = reads.READ_BYTES
               ) -> Generator[Counted | Lines, None, None]:
    """The selected events in id order as :class:`Lines` of ``size`` events and ``read_bytes`` (one at least), and
    :class:`Counted` once known: ids walked in a thread (:class:`IdRanges`), two connections reading ahead."""
    idle: SimpleQueue[psycopg.Connection] = SimpleQueue()
    options = "-c TimeZone=UTC -c client_encoding=UTF8"
    # the walk's ranges in order, then None (or the exception that ended the walk)
    walked: SimpleQueue[tuple[int, int] | Exception | None] = SimpleQueue()
    stop = threading.Event()

    def walk(ranges: IdRanges) -> None:
        with closing(iter(ranges)) as bounds:  # a walk stopped early ends its transaction here
            try:
                for lo_hi in bounds:
                    if stop.is_set():
                        return
                    walked.put(lo_hi)
                walked.put(None)
            except Exception as exc:  # raised by the caller's thread, after the ranges walked before it
                walked.put(exc)

    query = _LINES_QUERY.format(line=sql.SQL(EVENT_JSON_LINE), where=_filter(params))
    budget = max(1, read_bytes // _AHEAD)  # what the chunks read ahead hold in all: read_bytes at most
    sizes_query = reads.events_sizes(params)

    def pieces(lo: int, hi: int) -> list[reads.Piece]:
        """The range in pieces within one read's ``budget`` (by the sizes of its events, rendered by the
        server), so that :func:`fetch` reads each whole."""
        conn = idle.get()
        try:
            sizes = conn.execute(sizes_query, {**params, "lo": lo, "hi": hi}).fetchall()
        finally:
            idle.put(conn)
        return [p for p in reads.cut(sizes, lo, hi, budget, None) if isinstance(p, reads.Piece)]

    def fetch(lo: int, hi: int) -> Lines:
        conn = idle.get()
        try:
            # binary: the bytea arrives as it is (no hex text to decode)
            row = conn.cursor(binary=True).execute(query, {**params, "lo": lo, "hi": hi, "budget": budget}
                                                   ).fetchone()
        finally:
            idle.put(conn)
        assert row is not None  # an aggregate without group by returns one row
        n, first, last, data, cut = row
        return Lines(n, first or lo, last or hi, data or b"", cut)

    def rest(lines: Lines, hi: int) -> Iterator[Lines]:
        """What came after a cut chunk, up to ``hi``: in pieces within the budget by the sizes of its
        events (rendered once more, for those ranges only), each read in turn."""
        for piece in pieces(lines.last_id + 1, hi):
            got = fetch(piece.lo, piece.hi)
            yield got
            if got.cut:  # grown meanwhile (an event rewritten by a superuser): the rest again
                yield from rest(got, piece.hi)

    with ExitStack() as stack:
        ranges = IdRanges(stack.enter_context(dbconn.connect(database_url, application_name="pgstream replay",
                                                              options=options)), params, size)
        for _ in range(_READERS):
            idle.put(stack.enter_context(dbconn.connect(database_url, autocommit=True,
                                                         application_name="pgstream replay", options=options)))
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=_READERS + 1,
                                                      thread_name_prefix="pgstream-replay"))
        stack.callback(stop.set)  # runs before the pool waits for the walk: it stops at its next range
        pool.submit(walk, ranges)
        ahead: deque[tuple[Future[Lines], int]] = deque()  # chunks being read, with their range's end
        counted, walking = False, True
        failed: Exception | None = None
        try:
            while True:
                # _AHEAD chunks ahead, each of read_bytes / _AHEAD at most (one event at least)
                while walking and len(ahead) < _AHEAD:
                    nxt = walked.get()
                    if isinstance(nxt, tuple):
                        ahead.append((pool.submit(fetch, *nxt), nxt[1]))
                    else:  # the end of the walk, or the exception that ended it
                        failed, walking = nxt, False
                if not counted and ranges.total is not None:
                    counted = True
                    yield Counted(ranges.total)
                if not ahead:
                    if failed is not None:
                        raise failed
                    return
                pending, hi = ahead.popleft()
                lines = pending.result()
                yield lines
                if lines.cut:
                    yield from rest(lines, hi)
        finally:
            for pending, _hi in ahead:
                pending.cancel()


def deliver_lines(database_url: str, params: Mapping[str, Any], chunk_size: int, sink: Sink,
                  read_bytes: int = reads.READ_BYTES) -> Generator[Counted | int, None, None]:
    """Replay through a sink that :attr:`~pgstream_dagster.sinks.base.Sink.accepts_json_lines`, in order, in
    ``publish_json_lines`` calls; yields :class:`Counted` once, then the events confirmed after each chunk."""
    if not sink.accepts_json_lines:
        raise TypeError(f"the {sink.type_name} sink does not take JSON lines")
    done = 0
    # closed here however this ends: a sink error's traceback would otherwise keep the sessions open
    with closing(read_lines(database_url, params, chunk_size, read_bytes=read_bytes)) as chunks:
        for chunk in chunks:
            if isinstance(chunk, Counted):
                yield chunk
                continue
            if chunk.count:
                sink.publish_json_lines(chunk.data, chunk.count, chunk.first_id, chunk.last_id)
                done += chunk.count
            yield done
