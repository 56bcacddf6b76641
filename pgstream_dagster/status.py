"""Stream status: state, checkpoint, backlog, slot lag and the last batches of every stream."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row


def stream_status(conn: psycopg.Connection) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        streams = cur.execute(
            """
            select s.id, s.paused, s.failover_since, s.failover_checkpoint_id,
                   case when s.paused then 'paused'
                        when s.failover_since is not null
                          or exists (select 1 from pgstream.batches b
                                     where b.stream_id = s.id and b.status = 'failed') then 'failing'
                        else 'healthy' end as state,
                   (select count(*) from pgstream.batches b where b.stream_id = s.id and b.status <> 'delivered')
                       as undelivered_batches,
                   (select coalesce(sum(event_count), 0) from pgstream.batches b
                     where b.stream_id = s.id and b.status <> 'delivered') as undelivered_events,
                   (select min(b.first_commit_at) from pgstream.batches b
                     where b.stream_id = s.id and b.status <> 'delivered') as oldest_undelivered_at,
                   (select coalesce(sum(event_count), 0) from pgstream.batches b
                     where b.stream_id = s.id and b.status = 'delivered'
                       and b.delivered_at >= date_trunc('day', now() at time zone 'UTC') at time zone 'UTC')
                       as delivered_today,
                   r.slot_name, r.wal_status,
                   pg_wal_lsn_diff(pg_current_wal_lsn(), r.restart_lsn)::bigint as slot_retained_bytes
            from pgstream.streams s
            left join pg_replication_slots r
              on r.slot_name = 'pgstream_stream_' || s.id and r.database = current_database()
            order by s.id
            """).fetchall()
        for s in streams:
            s["last_batches"] = cur.execute(
                "select id, kind, status, event_count, first_event_id, last_event_id, attempts, error, "
                "created_at, delivered_at from pgstream.batches where stream_id = %s order by id desc limit 5",
                [s["id"]]).fetchall()
    return streams


def render_status(streams: list[dict[str, Any]]) -> str:
    if not streams:
        return "no streams"
    lines: list[str] = []
    for s in streams:
        slot = (f"slot {s['slot_name']} ({s['wal_status']}, {s['slot_retained_bytes']} bytes retained)"
                if s["slot_name"] else "slot MISSING")
        lines.append(f"stream {s['id']}: {s['state']}; {s['undelivered_events']} undelivered events in "
                     f"{s['undelivered_batches']} batches; oldest undelivered commit {s['oldest_undelivered_at']}; "
                     f"delivered today {s['delivered_today']}; {slot}")
        if s["failover_since"]:
            lines.append(f"  failover since {s['failover_since']}, checkpoint event {s['failover_checkpoint_id']}")
        for b in s["last_batches"]:
            err = f" error: {b['error']}" if b["error"] else ""
            lines.append(f"  batch {b['id']} {b['kind']} {b['status']}: {b['event_count']} events "
                         f"{b['first_event_id']}..{b['last_event_id']}, attempts {b['attempts']}{err}")
    return "\n".join(lines)
