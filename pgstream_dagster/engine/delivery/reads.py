"""The queries every reader of ``pgstream.events`` runs (the run's connection, the replay's, Spark's data sources on
the executors) and the byte budget a read is cut at (:func:`cut`); no Spark, no Dagster here."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from ...sinks.base import event_from_text, parse_event_path
from ..publish import Positioned, Span, TooLarge

if TYPE_CHECKING:
    import psycopg

_T = TypeVar("_T")

ROWS_PER_PARTITION = 50_000  # events per Spark partition (``delivery.rows_per_partition``'s default)
FETCH_ROWS = 5_000  # rows per server-side cursor FETCH, and per packed row


# A batch's events, each looked up by its id on the primary key (id, created_at) in a subquery planned on its own
# (``offset 0``: not flattened into a join) whatever the statistics say: joined, a day partition not analyzed yet
# was scanned whole and hashed for every read (10.6 s for 5,000 events of a 2M-event day instead of 0.05 s:
# bench/sustained.py). ``e.stream_id + 0``: never served by events_stream_created_idx, which with stale statistics
# scanned the stream's whole day per event (bench/cpu.py: a 10k batch 4.74 s instead of 0.20 s).
_BATCH_EVENTS = """\
from pgstream.batches b
cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
cross join lateral (
    select e.id, e.stream_id, e.created_at, e.payload, e.metadata from pgstream.events e
    where e.id = o.id and e.stream_id + 0 = b.stream_id
      and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at
    offset 0) e
"""
_BATCH_SPAN = _BATCH_EVENTS + """\
where b.id = %(batch_id)s and o.ord between %(lo)s and %(hi)s
order by o.ord
"""
BATCH_QUERY = """
select b.id, o.ord, e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text,
       (case when %(routing_source)s::text = 'metadata' then e.metadata else e.payload end) #>> %(path)s::text[]
           as routing_key
""" + _BATCH_SPAN

#: per event of a batch span: its ordinal, id, and the bytes of its payload and metadata as JSON text (rendered
#: by the server, not sent), by which a reader cuts what it reads at a byte budget (:func:`cut`)
BATCH_SIZES = """
select o.ord, e.id, pg_catalog.octet_length(e.payload::pg_catalog.text),
       coalesce(pg_catalog.octet_length(e.metadata::pg_catalog.text), 0)
""" + _BATCH_SPAN

#: :data:`BATCH_QUERY` cut at a byte budget by the server, in one pass: every event comes with its sizes, but with
#: its payload and metadata only if it ``fits`` (payload at most ``limit`` bytes, a null limit: any; the running
#: total at most ``budget``, the first eligible one whatever its size); the rest are read next, in pieces
BATCH_QUERY_BOUNDED = """
select w.batch_id, w.ord, w.id, w.stream_id, w.created_at,
       case when w.fits then w.payload::pg_catalog.text end,
       case when w.fits then w.metadata::pg_catalog.text end,
       w.payload_bytes, w.metadata_bytes
from (select z.*,
             z.eligible and (z.running <= %(budget)s or z.running = z.payload_bytes + z.metadata_bytes) as fits
      from (select y.*,
                   pg_catalog.sum(case when y.eligible then y.payload_bytes + y.metadata_bytes else 0 end)
                       over (order by y.ord rows unbounded preceding) as running
            from (select b.id as batch_id, o.ord, e.id, e.stream_id, e.created_at, e.payload, e.metadata,
                         x.payload_bytes, x.metadata_bytes,
                         %(limit)s::bigint is null or x.payload_bytes <= %(limit)s::bigint as eligible
                  """ + _BATCH_EVENTS + """
                  cross join lateral (
                      select pg_catalog.octet_length(e.payload::pg_catalog.text) as payload_bytes,
                             coalesce(pg_catalog.octet_length(e.metadata::pg_catalog.text), 0) as metadata_bytes
                      offset 0) x
                  where b.id = %(batch_id)s and o.ord between %(lo)s and %(hi)s) y) z) w
order by w.ord
"""  # noqa: S608 (constant fragments; every value a parameter)

READ_BYTES = 32 * 2**20  # bytes of payload and metadata one read holds at most, unless one event is larger


@dataclasses.dataclass(frozen=True)
class Piece:
    """Positions ``lo..hi`` (ordinals, or event ids) to read at once, within the byte budget (``size`` bytes)."""

    lo: int
    hi: int
    size: int = 0


def cut(sizes: Iterable[tuple[int, int, int, int]], lo: int, hi: int, budget: int,
        limit: int | None, rows: int | None = None) -> Iterator[Piece | tuple[int, TooLarge]]:
    """``lo..hi`` as :class:`Piece` s of at most ``budget`` bytes (one event at least) and ``rows`` positions, by
    ``sizes`` (:data:`BATCH_SIZES`); a payload over ``limit`` comes as ``(position, TooLarge)``, never read."""
    start, used = lo, 0
    for position, event_id, payload, metadata in sizes:
        if limit is not None and payload > limit:
            if start < position:
                yield Piece(start, position - 1, used)
            yield position, TooLarge(event_id, payload, limit)
            start, used = position + 1, 0
            continue
        size = payload + metadata
        if (used and used + size > budget) or (rows is not None and position - start >= rows):
            yield Piece(start, position - 1, used)
            start, used = position, 0
        used += size
    if start <= hi:
        yield Piece(start, hi, used)


def sized_spans(conn: psycopg.Connection, spans: Sequence[Span], rows: int, budget: int) -> list[tuple[Span, int]]:
    """``spans`` in pieces of at most ``rows`` ordinals and ``budget`` bytes (one event at least), with their bytes."""
    pieces: list[tuple[Span, int]] = []
    for whole in spans:
        for span in whole.split(max(rows, 100_000)):  # (a query per 100,000 sizes at most)
            sizes = conn.execute(BATCH_SIZES, {"batch_id": span.batch_id, "lo": span.first,
                                                "hi": span.last}).fetchall()
            pieces += [(Span(span.batch_id, p.lo, p.hi), p.size)
                       for p in cut(sizes, span.first, span.last, budget, None, rows) if isinstance(p, Piece)]
    return pieces


def events_where(params: Mapping[str, Any]) -> str:
    """The filter of a replay's selection (``params``, shared with ``replay.plan``)."""
    tests = ["e.stream_id = %(stream_id)s", "e.id between %(lo)s and %(hi)s"]
    if params.get("from_time") is not None:
        tests.append("e.created_at >= %(from_time)s::timestamptz")
    if params.get("to_time") is not None:
        tests.append("e.created_at < %(to_time)s::timestamptz")
    if params.get("keys") is not None:
        tests.append("e.payload ->> 'tg_name' = any (%(keys)s::text[])")
    return " and ".join(tests)


def events_query(params: Mapping[str, Any]) -> str:
    """The events of a replay's selection (:func:`events_where`), a range of ids at a time."""
    return _select_events("""0::bigint, e.id, e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text,
       (case when %(routing_source)s::text = 'metadata' then e.metadata else e.payload end) #>> %(path)s::text[]
           as routing_key""", params)


def events_sizes(params: Mapping[str, Any]) -> str:
    """:data:`BATCH_SIZES` for a replay's selection: positions are event ids."""
    return _select_events("""e.id, e.id, pg_catalog.octet_length(e.payload::pg_catalog.text),
       coalesce(pg_catalog.octet_length(e.metadata::pg_catalog.text), 0)""", params)


def _select_events(columns: str, params: Mapping[str, Any]) -> str:
    return "\nselect " + columns + "\nfrom pgstream.events e\nwhere " + events_where(params) + "\norder by e.id\n"


def routing_params(routing_key: str) -> dict[str, Any]:
    """The query parameters of ``delivery.routing_key``: the column it reads (payload, metadata) and its path."""
    source, dotted = parse_event_path(routing_key)
    return {"routing_source": source, "path": dotted.split(".")}


def in_turn(calls: Iterable[Callable[[], _T]], prefetch: bool = True) -> Generator[_T, None, None]:
    """The results of ``calls``, in order, each made in a thread; ``prefetch``: the next one while this one is used."""
    pending = iter(calls)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgstream-prefetch") as pool:
        call = next(pending, None)
        ahead: Future[_T] | None = None if call is None else pool.submit(call)
        while ahead is not None:
            result = ahead.result()
            ahead = None
            if prefetch and (call := next(pending, None)) is not None:
                ahead = pool.submit(call)
            yield result
            if not prefetch and (call := next(pending, None)) is not None:
                ahead = pool.submit(call)


def positioned(rows: list[tuple[Any, ...]]) -> Iterator[Positioned]:
    """Events of rows of :data:`BATCH_QUERY` or :func:`events_query` read by psycopg, in order."""
    for batch_id, ord_, event_id, stream_id, created, payload, metadata, _key in rows:
        yield batch_id, ord_, event_from_text(event_id, stream_id, created.astimezone(dt.UTC), payload, metadata)

