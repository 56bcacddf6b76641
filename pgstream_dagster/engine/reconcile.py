"""After a failover of the primary with its standby behind: which events a sink received that this database lacks.
An event id carries its WAL timeline (migration 031: ``(timeline - 1) * 2**48 +`` the sequence's value); what a former
primary committed that its standby had not received is on an ended timeline, missing here, and what of it went out
before it died is a *phantom*: an id of an ended timeline this database lacks, not older than the oldest event of that
timeline it holds for the stream (older ones may have gone with housekeeping). Sequence gaps (a rolled-back insert)
are ids no sink ever received, so they are never listed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import psycopg

from ..sinks.lake import LakeSink
from . import replication


@dataclass(frozen=True)
class EndedTimeline:
    """What this database holds of the stream's events written on an ended timeline (a former primary's)."""

    timeline: int
    events: int
    first_id: int
    last_id: int

    @property
    def range_end(self) -> int:
        """The last id the timeline could hand out."""
        return (self.timeline << replication.TIMELINE_SHIFT) - 1

    def describe(self, stream_id: int) -> str:
        return (f"stream {stream_id}: timeline {self.timeline} ended (a promotion); this database holds {self.events} "
                f"of its events, ids {self.first_id}..{self.last_id}: an id of it the sink received that is missing "
                "here was committed on the former primary and lost with it")


def ended_timelines(conn: psycopg.Connection, stream_id: int) -> list[EndedTimeline]:
    """The stream's events per timeline before the current one, in timeline order."""
    rows = conn.execute(
        "select (id operator(pg_catalog.>>) %s) operator(pg_catalog.+) 1 as timeline, pg_catalog.count(*), "
        "pg_catalog.min(id), pg_catalog.max(id) from pgstream.events where stream_id operator(pg_catalog.=) %s "
        "and id operator(pg_catalog.<) %s::pg_catalog.int8 group by 1 order by 1",
        [replication.TIMELINE_SHIFT, stream_id, replication.timeline_floor(conn)]).fetchall()
    return [EndedTimeline(int(t), int(n), int(lo), int(hi)) for t, n, lo, hi in rows]


def phantoms(conn: psycopg.Connection, stream_id: int, received: Iterable[int],
             ended: list[EndedTimeline]) -> list[int]:
    """Of ``received`` (event ids a sink of the stream got), those of an ``ended`` timeline (:func:`ended_timelines`),
    not older than the oldest event of it held here, that ``pgstream.events`` lacks: in id order."""
    spans = [(t.first_id, t.range_end) for t in ended]
    candidates = sorted({i for i in received if any(lo <= i <= hi for lo, hi in spans)})
    if not candidates:
        return []
    held = {int(r[0]) for r in conn.execute(
        "select id from pgstream.events where stream_id operator(pg_catalog.=) %s "
        "and id operator(pg_catalog.=) any(%s::pg_catalog.int8[])", [stream_id, candidates])}
    return [i for i in candidates if i not in held]


def lake_ids(sink: LakeSink, stream_id: int, ended: list[EndedTimeline]) -> list[int]:
    """The ids of ``ended`` timelines' ranges (from the oldest held of each) that the stream's lake table holds."""
    return [i for t in ended for i in sink.present_ids(stream_id, t.first_id, t.range_end)]
