"""Dead letters (``pgstream.dead_letters``), events a stream went on without: list, show, set aside, redeliver,
discard; no Dagster here. Stage ``deliver``: rejected or set aside from a batch, at ``(batch_id, ord)``; stage
``read``: not recordable, at its commit LSN, right after the last batch with ``start_lsn <= lsn`` in the
delivery order (:func:`list_dead_letters`, :func:`redeliver`). **Overtaken**: the stream's events after it
that were delivered. One is redelivered only once every batch up to it is done (the first waiting stops it).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..config import StreamConfig
from ..sinks import Sink, SinkError
from ..sinks.base import excerpt
from . import dbconn
from .batches import BatchStatus
from .delivery.sources import DeadLetterSource, Letters, Readers, choose_source
from .ledger import locks
from .ledger.deadletters import DeadLetter

STATUSES: tuple[str, ...] = ("open", "redelivered", "discarded")

#: longest error text stored with a dead letter (the SQL functions use the same limit)
ERROR_CHARS = 2000


class DeadLetterError(RuntimeError):
    """The dead-letter operation was refused (unknown ids, nothing given...); nothing changed."""


_PAYLOADS = "d.payload::text as payload_json, d.metadata::text as metadata_json"
#: a dead letter without its payload: its size instead (what reading it will cost)
_SIZES = ("case when d.payload is not null then '' end as payload_json, null as metadata_json, "
          "pg_catalog.octet_length(d.payload::pg_catalog.text) "
          "+ coalesce(pg_catalog.octet_length(d.metadata::pg_catalog.text), 0) as payload_bytes")

_SELECT = """
select d.id, d.stream_id, d.event_id, d.stage, d.batch_id, d.ord, d.lsn::text as lsn, d.event_created_at,
       {payloads}, d.sink, d.error, d.attempts,
       d.status, d.created_at, d.updated_at, d.resolved_at, d.resolved_by,
       a.anchor_batch_id,
       (select min(b.id) from pgstream.batches b
         where b.stream_id = d.stream_id and b.id <= a.anchor_batch_id
           and pgstream.batch_is_open(b.status)) as waiting_for_batch
from pgstream.dead_letters d
cross join lateral (
    select case when d.stage = 'deliver' then d.batch_id
                else coalesce(d.batch_id,
                              (select max(b.id) from pgstream.batches b
                                where b.stream_id = d.stream_id and b.start_lsn <= d.lsn), 0)
           end as anchor_batch_id) a
"""

#: the delivery order of dead letters (see the module docstring)
_ORDER = " order by d.stream_id, a.anchor_batch_id, d.stage = 'read', d.ord, d.lsn, d.event_id, d.id"


def _row(row: dict[str, Any]) -> DeadLetter:
    return DeadLetter(**{**row, "anchor_batch_id": int(row["anchor_batch_id"] or 0)})


def list_dead_letters(conn: psycopg.Connection, stream_id: int | None = None, status: str | None = "open",
                      limit: int | None = 100, *, payloads: bool = True) -> list[DeadLetter]:
    """Dead letters of one stream (or all), with ``status`` (``None``: any), in delivery order, at most
    ``limit`` (``None``: all). ``payloads=False``: their sizes instead (:attr:`DeadLetter.payload_bytes`)."""
    if status is not None and status not in STATUSES:
        raise DeadLetterError(f"status must be one of {', '.join(STATUSES)} (or None for all), not {status!r}")
    if limit is not None and limit < 1:
        raise DeadLetterError(f"limit must be at least 1, not {limit}")
    query = (_SELECT.format(payloads=_PAYLOADS if payloads else _SIZES) +
             " where (%(stream)s::bigint is null or d.stream_id = %(stream)s::bigint)"
             " and (%(status)s::text is null or d.status = %(status)s::text)" + _ORDER +
             " limit %(limit)s")
    rows = conn.cursor(row_factory=dict_row).execute(query, {"stream": stream_id, "status": status, "limit": limit})
    return [_row(r) for r in rows]


def count_open(conn: psycopg.Connection, stream_id: int) -> tuple[int, dt.datetime | None]:
    """How many dead letters of the stream are open, and when the oldest was created."""
    row = conn.execute("select count(*), min(created_at) from pgstream.dead_letters "
                       "where stream_id = %s and status = 'open'", [stream_id]).fetchone()
    assert row is not None
    return int(row[0]), row[1]


_OVERTAKEN = """
with p as (select %(stream)s::bigint as stream_id, %(anchor)s::bigint as anchor, %(batch)s::bigint as batch,
                  %(ord)s::int as ord),
after as (  -- delivered batches after the position, and the rest of its own batch once delivered
    select b.id, case when b.id = p.batch then p.ord else 0 end as from_ord,
           b.event_count - case when b.id = p.batch then p.ord else 0 end as events
    from pgstream.batches b, p
    where b.stream_id = p.stream_id and b.status = %(delivered)s
      and (b.id > p.anchor or (b.id = p.batch and p.batch is not null)))
select coalesce((select sum(events) from after), 0)
     - (select count(*) from pgstream.dead_letters o join after on o.batch_id = after.id
        where o.stream_id = %(stream)s and o.id <> %(id)s and o.stage = 'deliver' and o.ord > after.from_ord
          and o.status <> 'redelivered')
"""


def get_dead_letter(conn: psycopg.Connection, dead_letter_id: int) -> DeadLetter:
    """Everything about one dead letter, with how many later events of its stream were delivered (``overtaken``)."""
    row = conn.cursor(row_factory=dict_row).execute(_SELECT.format(payloads=_PAYLOADS) + " where d.id = %s",
                                                    [dead_letter_id]).fetchone()
    if row is None:
        raise DeadLetterError(f"dead letter {dead_letter_id} does not exist")
    letter = _row(row)
    found = conn.execute(_OVERTAKEN, {"stream": letter.stream_id, "anchor": letter.anchor_batch_id,
                                      "batch": letter.batch_id if letter.stage == "deliver" else None,
                                      "ord": letter.ord or 0, "id": letter.id,
                                      "delivered": BatchStatus.DELIVERED}).fetchone()
    assert found is not None
    return replace(letter, overtaken=int(found[0]))


# --- operator actions (thin wrappers of the SQL functions) --------------------------------------

def _count(conn: psycopg.Connection, query: str, params: list[Any]) -> int:
    """The count an SQL function returns; its refusal as a :class:`DeadLetterError` (with its hint)."""
    try:
        row = conn.execute(query, params).fetchone()
    except (psycopg.errors.NoDataFound, psycopg.errors.InvalidParameterValue) as exc:
        raise DeadLetterError(dbconn.error_line(exc)) from None
    assert row is not None
    return int(row[0])


def set_aside(conn: psycopg.Connection, stream_id: int, event_ids: Sequence[int], reason: str) -> int:
    """Move undelivered events of the stream's open batches into dead letters; how many. Refuses, changing
    nothing, ids in no open batch of the stream or already dead letters."""
    return _count(conn, "select pgstream.set_aside_events(%s, %s, %s)", [stream_id, list(event_ids), reason])


def discard(conn: psycopg.Connection, stream_id: int, ids: Sequence[int] | None, by: str) -> int:
    """Give up on open dead letters of the stream (``ids``, or all when None); returns how many.
    Refuses, changing nothing, ids that are not open dead letters of the stream."""
    if ids is not None and not ids:
        raise DeadLetterError("no dead letter ids given (give ids, or discard all of the stream's)")
    return _count(conn, "select pgstream.discard_dead_letters(%s, %s, %s)",
                  [stream_id, None if ids is None else list(ids), by])


# --- redelivery ---------------------------------------------------------------------------------

@dataclass
class RedeliveryReport:
    """What :func:`redeliver` did. ``planned`` is every selected open dead letter, in order."""

    stream_id: int
    planned: list[DeadLetter]
    dry_run: bool = False
    redelivered: list[int] = field(default_factory=list)
    #: dead letters that can never be redelivered: (id, why); left open for the operator to discard
    undeliverable: list[tuple[int, str]] = field(default_factory=list)
    #: the dead letter the sink refused (its error and attempts were recorded), and why
    failed: int | None = None
    error: str | None = None
    #: the first batch up to the position of ``waiting[0]`` that the stream has not delivered yet
    waiting_for_batch: int | None = None
    #: selected dead letters left open after a failure or behind an undelivered batch, in order
    waiting: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every selected dead letter was redelivered (or, in a dry run, could be)."""
        return self.failed is None and not self.undeliverable and not self.waiting

    def lines(self) -> list[str]:
        """The report, one line per fact (for the run log and the CLI)."""
        s = self.stream_id
        if not self.planned:
            return [f"stream {s}: no open dead letters to redeliver"]
        if self.dry_run:
            out = [f"stream {s}: would redeliver {len(self.redelivered)} of {len(self.planned)} open dead letters, in "
                   f"this order: {_ids(self.redelivered)}"]
        else:
            out = [f"stream {s}: redelivered {len(self.redelivered)} of {len(self.planned)} dead letters"
                   + (f": {_ids(self.redelivered)}" if self.redelivered else "")]
        for letter_id, why in self.undeliverable:
            out.append(f"dead letter {letter_id} cannot be redelivered: {why}; it stays open (discard it)")
        if self.failed is not None:
            out.append(f"dead letter {self.failed} was refused by the sink (error recorded, attempts + 1): "
                       f"{self.error}")
        if self.waiting and self.failed is not None:
            out.append(f"dead letters {_ids(self.waiting)} stay open, in order behind dead letter {self.failed}; "
                       f"redeliver again once the sink accepts it")
        elif self.waiting:
            out.append(f"dead letters {_ids(self.waiting)} wait: batch {self.waiting_for_batch} of stream {s} "
                       f"(at or before their position) is neither delivered nor skipped yet; redeliver them once "
                       f"the stream has delivered it")
        return out

    def summary(self) -> str:
        return "; ".join(self.lines())


def _ids(ids: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:50])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > 50 else "")


def redelivery_plan(conn: psycopg.Connection, stream_id: int, ids: Sequence[int] | None = None) -> list[DeadLetter]:
    """The stream's open dead letters (all, or ``ids``) in delivery order, without their payloads (their
    sizes: :attr:`DeadLetter.payload_bytes`). Ids that are not open dead letters of the stream are refused."""
    if ids is not None and not ids:
        raise DeadLetterError("no dead letter ids given (give ids, or redeliver all of the stream's)")
    letters = list_dead_letters(conn, stream_id, "open", limit=None, payloads=False)
    if ids is None:
        return letters
    wanted = set(ids)
    wrong = sorted(wanted - {d.id for d in letters})
    if wrong:
        # (the ids as the SQL functions show them in their errors: {3,5})
        raise DeadLetterError(f"dead letters {{{','.join(map(str, wrong))}}} are not open dead letters of stream "
                              f"{stream_id}")
    return [d for d in letters if d.id in wanted]


def redeliver(conn: psycopg.Connection, stream: StreamConfig, ids: Sequence[int] | None, by: str,
              chunk_size: int | None = None, *, dry_run: bool = False) -> RedeliveryReport:
    """Publish the stream's open dead letters (all, or ``ids``) through its sink in delivery order, in chunks
    of ``chunk_size`` (default ``delivery.chunk_size``) and ``tuning.max_read_bytes``, each marked
    ``redelivered`` once confirmed (``conn`` in autocommit). One without payload or timestamp is reported and
    left open; one the stream has not passed yet waits, with every later one; a :class:`SinkError` is recorded
    on the refused chunk's first letter and stops it. One at a time per stream (lock ``redelivery``)."""
    size = chunk_size or stream.delivery.chunk_size
    if size < 1:
        raise DeadLetterError(f"chunk_size must be at least 1, not {size}")
    if not locks.try_lock(conn, locks.REDELIVERY_LOCK, stream.id):
        raise DeadLetterError(f"another redelivery of stream {stream.id}'s dead letters is running")
    try:
        report = RedeliveryReport(stream.id, redelivery_plan(conn, stream.id, ids), dry_run=dry_run)
        sendable: list[DeadLetter] = []
        for i, letter in enumerate(report.planned):
            if letter.waiting_for_batch is not None:
                report.waiting_for_batch = letter.waiting_for_batch
                report.waiting = [d.id for d in report.planned[i:] if d.undeliverable is None]
                report.undeliverable += [(d.id, why) for d in report.planned[i:] if (why := d.undeliverable)]
                break
            if (why := letter.undeliverable) is not None:
                report.undeliverable.append((letter.id, why))
            else:
                sendable.append(letter)
        if dry_run:
            report.redelivered = [d.id for d in sendable]
        elif sendable:
            _publish(conn, stream, sendable, size, by, report)
        return report
    finally:
        locks.unlock(conn, locks.REDELIVERY_LOCK, stream.id)


def _publish(conn: psycopg.Connection, stream: StreamConfig, letters: list[DeadLetter], size: int, by: str,
             report: RedeliveryReport) -> None:
    sink: Sink | None = None
    # chosen as every delivery's source: chunks of at most size letters and max_read_bytes, payloads read when due
    source = choose_source(stream.delivery, Letters(letters, size), Readers("", conn=conn))
    assert isinstance(source, DeadLetterSource)
    position = 0  # letters handled before the chunk
    with ExitStack() as stack:  # the sink, once built, closed however this ends
        for chunk, events in source.chunks():
            try:
                if sink is None:
                    sink = stack.enter_context(stream.sink.build())
                sink.publish(events)
            except SinkError as exc:
                first = chunk[0]
                message = excerpt(f"redelivery failed: {exc}", ERROR_CHARS)
                with conn.transaction():
                    conn.execute("update pgstream.dead_letters set error = %s, attempts = attempts + 1, "
                                 "sink = %s, updated_at = now() where id = %s and status = 'open'",
                                 [message, stream.sink.type, first.id])
                report.failed, report.error = first.id, str(exc)
                report.waiting = [d.id for d in letters[position + 1:]] + report.waiting
                return
            with conn.transaction():
                marked = conn.execute(
                    "update pgstream.dead_letters set status = 'redelivered', resolved_at = now(), "
                    "updated_at = now(), resolved_by = left(%s, 200), sink = %s "
                    "where id = any(%s) and status = 'open' returning id",
                    [by, stream.sink.type, [d.id for d in chunk]]).fetchall()
            done = {r[0] for r in marked}  # one discarded meanwhile stays discarded
            report.redelivered += [d.id for d in chunk if d.id in done]
            position += len(chunk)
