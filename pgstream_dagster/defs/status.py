"""The stream status asset, observed by its reader group's sensor (the queries: ``engine/status.py``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

import dagster as dg

from .names import status_asset_key


def status_asset_spec(stream_id: int, deliveries_key: dg.AssetKey) -> dg.AssetSpec:
    return dg.AssetSpec(
        key=status_asset_key(stream_id), group_name="pgstream", deps=[deliveries_key], kinds={"postgres"},
        description=f"Health of stream {stream_id}, observed by its delivery run after every round of batches and "
                    f"by its sensor whenever something changes and at least every sensor.status_every_secs: "
                    f"healthy / failover since when, checkpoint, cursor, slot lag, backlog, events delivered today, "
                    f"the open run (live, starting or gone), open dead letters, registered consumers (the Spark "
                    f"source: position, lag, overrun), last batches.",
        metadata={"stream_id": stream_id})


def _markdown(header: list[str], rows: Iterable[list[Any]]) -> str:
    """A Markdown table: the ``header`` cells, then each row's."""
    lines = [f"| {' | '.join(map(str, cells))} |" for cells in [header, *rows]]
    return "\n".join([lines[0], "|" + "---|" * len(header), *lines[1:]])


def status_observation(s: dict[str, Any], open_run_state: str | None = None) -> dg.AssetObservation:
    """The stream's status row (``stream_status``) as its reader group's sensor observes it (its cursor:
    the last event id and LSN the ledger recorded, whoever read the slot);
    ``open_run_state``: what became of the open run (live, starting, gone: see the sensor)."""
    oldest = s["oldest_undelivered_at"]
    def when(key: str) -> Any:
        return dg.MetadataValue.timestamp(s[key]) if s.get(key) else None

    metadata: dict[str, Any] = {
        "state": s["state"],
        "undelivered_events": int(s["undelivered_events"]), "undelivered_batches": int(s["undelivered_batches"]),
        "oldest_undelivered_event_id": s["oldest_undelivered_event_id"],
        "oldest_undelivered_age_secs": round((dt.datetime.now(dt.UTC) - oldest).total_seconds(), 1) if oldest else 0.0,
        "delivered_today": int(s["delivered_today"]),
        "cursor_last_event_id": s.get("last_recorded_event_id"), "cursor_last_lsn": s.get("last_recorded_lsn"),
        "slot": f"{s['slot_name']} ({s['wal_status']})" if s["slot_exists"] else f"{s['slot_name']} (missing)",
        "slot_lag_bytes": s["slot_lag_bytes"], "slot_retained_wal_bytes": s["slot_retained_bytes"],
        "failover_since": when("failover_since"), "failover_checkpoint_event_id": s["failover_checkpoint_id"],
        "failover_attempts": s["failover_attempts"], "failover_next_retry": when("failover_retry_at"),
        "failover_error": s["failover_error"],
        "open_run_key": s.get("open_run_key"),
        "open_run_state": open_run_state if s.get("open_run_key") else None,
        "observed_by": "sensor", "open_dead_letters": int(s.get("open_dead_letters") or 0),
        "oldest_dead_letter_at": when("oldest_dead_letter_at"),
        "last_batches": dg.MetadataValue.md(_markdown(
            ["batch", "kind", "status", "events", "ids", "attempts", "delivered at"],
            ([b["id"], b["kind"], b["status"], b["event_count"], f"{b['first_event_id']}..{b['last_event_id']}",
              b["attempts"], b["delivered_at"] or ""] for b in s["last_batches"]))),
    }
    readers = s.get("consumers") or []
    if readers:  # registered consumers (the Spark source): how far each has read
        metadata["consumers"] = dg.MetadataValue.md(_markdown(
            ["consumer", "position", "lag (events)", "oldest unread", "kept for (days)", "overrun"],
            ([c["name"], f"{c['batch_id']}:{c['ord']}", c["lag_events"], c["oldest_unread"] or "",
              c["max_retention_days"], "yes" if c["overrun"] else "no"] for c in readers)))
        metadata["consumers_max_lag_events"] = max(int(c["lag_events"]) for c in readers)
        metadata["consumers_overrun"] = sum(1 for c in readers if c["overrun"])
    return dg.AssetObservation(asset_key=status_asset_key(s["id"]), description=f"stream {s['id']}: {s['state']}",
                               metadata={k: v for k, v in metadata.items() if v is not None})
