"""Stream status: state, failover checkpoint, backlog, slot lag, open dead letters and the last
batches of every stream (``pgstream-dagster status`` and the UI)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import dagster as dg
import psycopg
from psycopg.rows import dict_row

_STREAMS = """
select ss.*, st.open_run_key
from pgstream.stream_status ss join pgstream.streams st on st.id = ss.id
where %(stream_id)s::bigint is null or ss.id = %(stream_id)s::bigint
order by ss.id
"""

_LAST_BATCHES = """
select id, kind, status, event_count, first_event_id, last_event_id, attempts, error, created_at, delivered_at
from pgstream.batches where stream_id = %s order by id desc limit %s
"""


def stream_status(conn: psycopg.Connection, stream_id: int | None = None, last: int = 5) -> list[dict[str, Any]]:
    """One dict per stream (all, or ``stream_id``) with its state and the ``last`` batches
    (``last = 0``: no batches are read)."""
    with conn.cursor(row_factory=dict_row) as cur:
        streams = cur.execute(_STREAMS, {"stream_id": stream_id}).fetchall()
    for s in streams:
        s["last_batches"] = last_batches(conn, s["id"], last) if last else []
    return streams


def last_batches(conn: psycopg.Connection, stream_id: int, last: int) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(_LAST_BATCHES, [stream_id, last]).fetchall()


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_status(streams: list[dict[str, Any]]) -> str:
    if not streams:
        return "no streams"
    lines: list[str] = []
    for s in streams:
        slot = (f"slot {s['slot_name']} ({s['wal_status']}, lag {_bytes(s['slot_lag_bytes'])}, "
                f"retains {_bytes(s['slot_retained_bytes'])} of WAL)" if s["slot_exists"]
                else f"slot {s['slot_name']} MISSING")
        lines.append(f"stream {s['id']}: {s['state'].upper()}")
        lines.append(f"  backlog: {s['undelivered_events']} undelivered events in {s['undelivered_batches']} "
                     f"batches; oldest undelivered event {s['oldest_undelivered_event_id'] or '-'} "
                     f"(committed {s['oldest_undelivered_at'] or '-'})")
        lines.append(f"  delivered today: {s['delivered_today']}; last recorded event "
                     f"{s['last_recorded_event_id'] or '-'}; {slot}")
        open_letters = int(s.get("open_dead_letters") or 0)
        if open_letters:
            lines.append(f"  dead letters: {open_letters} open (oldest since {s['oldest_dead_letter_at']}): "
                         f"pgstream-dagster dead-letters list {s['id']}")
        else:
            lines.append("  dead letters: none open")
        if s.get("open_run_key"):
            lines.append(f"  open run: {s['open_run_key']} (the sensor hands it every new batch)")
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


# --- the stream status asset: observed by the stream's sensor ---------------------------------

def status_asset_key(stream_id: int) -> dg.AssetKey:
    return dg.AssetKey(["pgstream", f"stream_{stream_id}", "status"])


def status_asset_spec(stream_id: int, deliveries_key: dg.AssetKey) -> dg.AssetSpec:
    return dg.AssetSpec(
        key=status_asset_key(stream_id), group_name="pgstream", deps=[deliveries_key], kinds={"postgres"},
        description=f"Health of stream {stream_id}, observed by its sensor when the state changes and at least "
                    f"every sensor.status_every_secs: healthy / failover since when, checkpoint, cursor, slot lag, "
                    f"backlog, events delivered today, open dead letters, last batches.",
        metadata={"stream_id": stream_id})


def _markdown_batches(batches: list[dict[str, Any]]) -> str:
    rows = ["| batch | kind | status | events | ids | attempts | delivered at |", "|---|---|---|---|---|---|---|"]
    for b in batches:
        rows.append(f"| {b['id']} | {b['kind']} | {b['status']} | {b['event_count']} | "
                    f"{b['first_event_id']}..{b['last_event_id']} | {b['attempts']} | {b['delivered_at'] or ''} |")
    return "\n".join(rows)


def status_observation(s: dict[str, Any], cursor: dict[str, Any]) -> dg.AssetObservation:
    """The stream's status row (``stream_status``) as an observation of its status asset."""
    now = dt.datetime.now(dt.UTC)
    oldest = s["oldest_undelivered_at"]
    metadata: dict[str, Any] = {
        "state": s["state"],
        "undelivered_events": int(s["undelivered_events"]),
        "undelivered_batches": int(s["undelivered_batches"]),
        "oldest_undelivered_event_id": s["oldest_undelivered_event_id"],
        "oldest_undelivered_age_secs": round((now - oldest).total_seconds(), 1) if oldest else 0.0,
        "delivered_today": int(s["delivered_today"]),
        "cursor_last_event_id": cursor.get("last_event_id"),
        "cursor_last_lsn": cursor.get("last_lsn"),
        "slot": f"{s['slot_name']} ({s['wal_status']})" if s["slot_exists"] else f"{s['slot_name']} (missing)",
        "slot_lag_bytes": s["slot_lag_bytes"],
        "slot_retained_wal_bytes": s["slot_retained_bytes"],
        "failover_since": dg.MetadataValue.timestamp(s["failover_since"]) if s["failover_since"] else None,
        "failover_checkpoint_event_id": s["failover_checkpoint_id"],
        "failover_attempts": s["failover_attempts"],
        "failover_next_retry": dg.MetadataValue.timestamp(s["failover_retry_at"]) if s["failover_retry_at"] else None,
        "failover_error": s["failover_error"],
        "open_run_key": s.get("open_run_key"),
        "open_dead_letters": int(s.get("open_dead_letters") or 0),
        "oldest_dead_letter_at": (dg.MetadataValue.timestamp(s["oldest_dead_letter_at"])
                                  if s.get("oldest_dead_letter_at") else None),
        "last_batches": dg.MetadataValue.md(_markdown_batches(s["last_batches"])),
    }
    return dg.AssetObservation(asset_key=status_asset_key(s["id"]), description=f"stream {s['id']}: {s['state']}",
                               metadata={k: v for k, v in metadata.items() if v is not None})
