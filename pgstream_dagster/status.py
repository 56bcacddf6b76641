"""Stream status: state, failover checkpoint, backlog, slot lag and the last batches of every
stream (``pgstream-dagster status`` and the UI)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

_STREAMS = """
select s.id, s.paused, s.failover_since, s.failover_checkpoint_id, s.failover_checkpoint_ts,
       s.failover_error, s.failover_retry_at, s.failover_attempts, s.consumed_through, s.recovery_pending,
       case when s.paused then 'paused'
            when s.recovery_pending then 'recovering'
            when s.failover_since is not null and exists (
                 select 1 from pgstream.batches b where b.stream_id = s.id and b.status = 'failed') then 'failover'
            when s.failover_since is not null then 'catching up'
            else 'healthy' end as state,
       o.batches as undelivered_batches, o.events as undelivered_events,
       o.oldest_event_id as oldest_undelivered_event_id, o.oldest_commit_at as oldest_undelivered_at,
       (select coalesce(sum(event_count), 0) from pgstream.batches b
         where b.stream_id = s.id and b.status = 'delivered'
           and b.delivered_at >= date_trunc('day', now() at time zone 'UTC') at time zone 'UTC')
           as delivered_today,
       (select max(b.last_event_id) from pgstream.batches b where b.stream_id = s.id) as last_recorded_event_id,
       r.slot_name, r.wal_status,
       pg_wal_lsn_diff(pg_current_wal_lsn(), r.restart_lsn)::bigint as slot_retained_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), r.confirmed_flush_lsn)::bigint as slot_lag_bytes
from pgstream.streams s
cross join lateral (
    select count(*) as batches, coalesce(sum(b.event_count), 0) as events,
           min(b.first_event_id) as oldest_event_id, min(b.first_commit_at) as oldest_commit_at
    from pgstream.batches b
    where b.stream_id = s.id and b.status not in ('delivered', 'skipped')) o
left join pg_replication_slots r
  on r.slot_name = %(slot_prefix)s || s.id and r.database = current_database()
where %(stream_id)s::bigint is null or s.id = %(stream_id)s::bigint
order by s.id
"""

_LAST_BATCHES = """
select id, kind, status, event_count, first_event_id, last_event_id, attempts, error, created_at, delivered_at
from pgstream.batches where stream_id = %s order by id desc limit %s
"""


def stream_status(conn: psycopg.Connection, stream_id: int | None = None, last: int = 5) -> list[dict[str, Any]]:
    """One dict per stream (all, or ``stream_id``) with its state and the ``last`` batches."""
    with conn.cursor(row_factory=dict_row) as cur:
        streams = cur.execute(_STREAMS, {"slot_prefix": "pgstream_stream_", "stream_id": stream_id}).fetchall()
        for s in streams:
            s["last_batches"] = cur.execute(_LAST_BATCHES, [s["id"], last]).fetchall()
    return streams


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def render_status(streams: list[dict[str, Any]]) -> str:
    if not streams:
        return "no streams"
    lines: list[str] = []
    for s in streams:
        slot = (f"slot {s['slot_name']} ({s['wal_status']}, lag {_bytes(s['slot_lag_bytes'])}, "
                f"retains {_bytes(s['slot_retained_bytes'])} of WAL)" if s["slot_name"] else "slot MISSING")
        lines.append(f"stream {s['id']}: {s['state'].upper()}")
        lines.append(f"  backlog: {s['undelivered_events']} undelivered events in {s['undelivered_batches']} "
                     f"batches; oldest undelivered event {s['oldest_undelivered_event_id'] or '-'} "
                     f"(committed {s['oldest_undelivered_at'] or '-'})")
        lines.append(f"  delivered today: {s['delivered_today']}; last recorded event "
                     f"{s['last_recorded_event_id'] or '-'}; {slot}")
        if s["failover_since"]:
            lines.append(f"  failover since {s['failover_since']}: checkpoint event {s['failover_checkpoint_id']} "
                         f"(committed {s['failover_checkpoint_ts']}), {s['failover_attempts']} failed attempts, "
                         f"next retry {s['failover_retry_at'] or '-'}")
            if s["failover_error"]:
                lines.append(f"  last error: {s['failover_error']}")
        for b in s["last_batches"]:
            err = f" error: {b['error']}" if b["error"] and b["status"] != "delivered" else ""
            lines.append(f"  batch {b['id']} {b['kind']} {b['status']}: {b['event_count']} events "
                         f"{b['first_event_id']}..{b['last_event_id']}, attempts {b['attempts']}{err}")
    return "\n".join(lines)
