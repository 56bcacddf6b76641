"""Dead letters in the ledger (sql/014_event_integrity.sql): a row (:class:`DeadLetter`), what delivery skips, events
no longer in the table, and the writer that sets a rejected event aside (the operator's side: engine/deadletters.py)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Literal

import psycopg

from ...sinks import Event
from ...sinks.base import event_from_text, excerpt, loads_event_json
from .. import dbconn
from ..batches import BatchStatus
from ..publish import TooLarge
from .state import mark_confirmed

Status = Literal["open", "redelivered", "discarded"]  # a dead letter's status (``pgstream.dead_letters.status``)


@dataclass(frozen=True)
class DeadLetter:
    id: int
    stream_id: int
    event_id: int
    stage: Literal["read", "deliver"]
    batch_id: int | None
    ord: int | None
    lsn: str | None
    event_created_at: dt.datetime | None
    payload_json: str | None  # jsonb::text; None when the event had vanished when it was set aside
    metadata_json: str | None
    sink: str | None
    error: str
    attempts: int
    status: Status
    created_at: dt.datetime
    updated_at: dt.datetime
    resolved_at: dt.datetime | None
    resolved_by: str | None
    #: the batch its position is relative to: its own (deliver), or the last starting at or before its LSN (read)
    anchor_batch_id: int = 0
    waiting_for_batch: int | None = None  # the first open batch up to its position: it waits for it
    overtaken: int | None = None  # delivered events after its position (only ``get_dead_letter`` computes it)
    payload_bytes: int | None = None  # listed without its payload: its bytes (``payload_json`` ``""``, or None)

    @property
    def payload(self) -> Any:
        return None if self.payload_json is None else loads_event_json(self.payload_json, self.event_id)

    @property
    def metadata(self) -> Any:
        return None if self.metadata_json is None else loads_event_json(self.metadata_json, self.event_id, "metadata")

    @property
    def position(self) -> str:
        """``batch 12 #3`` (deliver) or ``lsn 0/16B3F28`` (read)."""
        if self.stage == "deliver":
            return f"batch {self.batch_id} #{self.ord}"
        return f"lsn {self.lsn}" + (f" (after batch {self.anchor_batch_id})" if self.anchor_batch_id else "")

    @property
    def undeliverable(self) -> str | None:
        """Why it can never be redelivered (discard it), or None."""
        if self.payload_json is None:
            return "its event had vanished from pgstream.events when it was set aside: there is no payload to send"
        if self.event_created_at is None:
            return "the sensor could not read the event's created_at: there is no timestamp to send"
        return None

    def event(self) -> Event:
        assert self.payload_json is not None and self.event_created_at is not None
        return Event(self.event_id, self.stream_id, created_at=self.event_created_at,
                     payload_json=self.payload_json, metadata_json=self.metadata_json)

    def describe(self) -> str:
        """One line for lists and logs."""
        resolved = (f", {self.status} {self.resolved_at:%Y-%m-%d %H:%M:%S} by {self.resolved_by}"
                    if self.resolved_at else "")
        return (f"dead letter {self.id}: stream {self.stream_id} event {self.event_id} {self.stage} "
                f"{self.position}, {self.status}, {self.attempts} attempts, since "
                f"{self.created_at:%Y-%m-%d %H:%M:%S%z}{resolved}: {excerpt(self.error, 120)}")


def dead_letter_positions(conn: psycopg.Connection, stream_id: int, batch_ids: list[int]) -> frozenset[tuple[int, int]]:
    """The ``(batch_id, ord)`` of the events of ``batch_ids`` that have a dead letter: delivery skips them."""
    # planned with the ids each time (not prepared): a plan made for any ids reads every dead letter of the stream
    rows = conn.execute("select batch_id, ord from pgstream.dead_letters where stream_id = %s and batch_id = any(%s)",
                        [stream_id, batch_ids], prepare=False).fetchall()
    return frozenset((int(b), int(o)) for b, o in rows)


def vanished(conn: psycopg.Connection, batch_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(batch_id, ord, event_id)`` of the events of ``batch_ids`` no longer in ``pgstream.events``, in order."""
    return [(int(b), int(o), int(e)) for b, o, e in conn.execute(
        """select b.id, o.ord, o.id from pgstream.batches b
           cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
           where b.id = any(%s) and not exists (
               select 1 from pgstream.events e
               where e.id = o.id and e.stream_id = b.stream_id
                 and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at)
           order by b.id, o.ord""", [batch_ids]).fetchall()]


class DeadLetterWriter:
    """Records an event the sink rejected for good as a dead letter before the next is published, moving the
    confirmed prefix past it; picklable, a short connection per call; ``token``: a by_key round's, through the owner."""

    def __init__(self, database_url: str, stream_id: int, sink: str, *, resumes: bool = True,
                 token: str | None = None) -> None:
        self.database_url, self.stream_id, self.sink = database_url, stream_id, sink
        self.resumes = resumes  # ordered delivery resumes after the confirmed prefix; by_key does not
        self.token = token

    def __call__(self, batch_id: int, ord: int, event: Event, error: str, attempts: int) -> None:
        self._write(batch_id, ord, error, attempts,
                    """insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, event_created_at,
                                                          payload, metadata, sink, error, attempts)
                       values (%s, %s, 'deliver', %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s)
                       on conflict (stream_id, event_id) do nothing""",
                    [self.stream_id, event.id, batch_id, ord, event.created_at, event.payload_json,
                     event.metadata_json, self.sink, error[:2000], attempts])

    def _write(self, batch_id: int, ord: int, error: str, attempts: int, insert: str, params: list[Any]) -> None:
        """``insert`` it and move the confirmed prefix past it; a by_key task's through ``set_aside_rejected``."""
        with dbconn.connect(self.database_url, autocommit=True) as conn:
            if self.token is not None:
                conn.execute("select pgstream.set_aside_rejected(%s, %s, %s, %s, %s, %s)",
                             [self.token, batch_id, ord, self.sink, error[:2000], attempts])
                return
            with conn.transaction():
                conn.execute(insert, params)
                if self.resumes:
                    mark_confirmed(conn, batch_id, ord)

    def known_good(self) -> Event | None:
        """The stream's last event the sink confirmed still in ``pgstream.events`` (the reject-storm guard's)."""
        with dbconn.connect(self.database_url, autocommit=True) as conn:
            row = conn.execute(_KNOWN_GOOD, {"stream": self.stream_id, "delivered": BatchStatus.DELIVERED}).fetchone()
        if row is None:
            return None
        event_id, stream_id, created_at, payload, metadata = row
        return event_from_text(event_id, stream_id, created_at.astimezone(dt.UTC), payload, metadata)

    def too_large(self, batch_id: int, ord: int, row: TooLarge) -> None:
        """Record an event too large for the sink: the database copies its payload (the run never reads it)."""
        self._write(batch_id, ord, row.reason, 1,
                    """insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, event_created_at,
                                                          payload, metadata, sink, error, attempts)
                       select e.stream_id, e.id, 'deliver', %s, %s, e.created_at, e.payload, e.metadata, %s, %s, 1
                       from pgstream.events e where e.id = %s and e.stream_id = %s
                       on conflict (stream_id, event_id) do nothing""",
                    [batch_id, ord, self.sink, row.reason[:2000], row.id, self.stream_id])

    def __repr__(self) -> str:  # never the URL
        return f"DeadLetterWriter(stream {self.stream_id}, sink {self.sink})"


#: the stream's last confirmed event (:meth:`DeadLetterWriter.known_good`): the last event without a dead letter
#: still in pgstream.events of its last five delivered batches (a batch may hold only dead letters)
_KNOWN_GOOD = """
select e.id, e.stream_id, e.created_at, e.payload::text, e.metadata::text
from (select b.id, b.stream_id, b.event_ids, b.min_created_at, b.max_created_at from pgstream.batches b
      where b.stream_id = %(stream)s and b.status = %(delivered)s order by b.id desc limit 5) b
cross join lateral unnest(b.event_ids) with ordinality as o(id, ord)
join pgstream.events e
  on e.id = o.id and e.stream_id + 0 = b.stream_id
 and e.created_at >= b.min_created_at and e.created_at <= b.max_created_at
where not exists (select 1 from pgstream.dead_letters d where d.stream_id = b.stream_id and d.event_id = o.id)
order by b.id desc, o.ord desc
limit 1
"""
