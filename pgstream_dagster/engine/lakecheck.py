"""The lake tables' asset check, without Dagster: per UTC day, the events the ledger says were delivered
against those the lake table holds, over a settled window ``[since, upto)`` of ``created_at`` (the oldest event
still in ``pgstream.events``; the oldest undelivered batch, or just after the newest delivered event). Dead
letters not redelivered are not owed to the table.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import psycopg

_WINDOW = """
select (select pg_catalog.min(e.created_at) from pgstream.events e where e.stream_id = %(stream_id)s),
       coalesce((select pg_catalog.min(b.min_created_at) from pgstream.batches b
                 where b.stream_id = %(stream_id)s and b.status <> 'delivered'),
                (select pg_catalog.max(b.max_created_at) from pgstream.batches b
                 where b.stream_id = %(stream_id)s and b.status = 'delivered') + interval '1 microsecond')
"""

_DAY_COUNTS = """
select (e.created_at at time zone 'UTC')::date, pg_catalog.count(*)
from pgstream.events e
where e.stream_id = %(stream_id)s and e.created_at >= %(since)s and e.created_at < %(upto)s
  and not exists (select 1 from pgstream.dead_letters d
                  where d.stream_id = e.stream_id and d.event_id = e.id and d.status <> 'redelivered')
group by 1
"""


@dataclass(frozen=True)
class DayCounts:
    """Events per UTC day of ``created_at`` in ``[since, upto)``; no window: nothing delivered yet."""

    since: dt.datetime | None
    upto: dt.datetime | None
    counts: dict[dt.date, int]


def delivered_day_counts(conn: psycopg.Connection, stream_id: int) -> DayCounts:
    """The stream's settled window and, per day in it, the events owed to its lake table."""
    row = conn.execute(_WINDOW, {"stream_id": stream_id}).fetchone()
    since, upto = row if row is not None else (None, None)
    if since is None or upto is None or since >= upto:
        return DayCounts(since, upto, {})
    rows = conn.execute(_DAY_COUNTS, {"stream_id": stream_id, "since": since, "upto": upto}).fetchall()
    return DayCounts(since, upto, {day: int(count) for day, count in rows})


def differences(expected: dict[dt.date, int], actual: dict[dt.date, int]) -> list[tuple[dt.date, int, int]]:
    """``(day, expected, actual)`` of each day whose counts differ, in day order."""
    return [(day, expected.get(day, 0), actual.get(day, 0)) for day in sorted(set(expected) | set(actual))
            if expected.get(day, 0) != actual.get(day, 0)]
