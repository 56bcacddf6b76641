"""Stream status: state, failover checkpoint, backlog, slot lag, open dead letters, registered
consumers and the last batches of every stream (``pgstream-dagster status`` and the UI)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from . import dbconn, replication
from .batches import BatchStatus


def phase(stream_id: int) -> float:
    """Where in its period a stream's periodic report falls (0 to 1: its deliveries materializations, its status
    observations): spread by the golden ratio, so the members of a reader group, started together, do not all
    write to Dagster's event log in the same second of every period."""
    return (stream_id * 0.618) % 1.0


def _dicts(conn: psycopg.Connection, query: str, params: Any = None) -> list[dict[str, Any]]:
    return conn.cursor(row_factory=dict_row).execute(query, params).fetchall()


def stream_status(conn: psycopg.Connection, stream_id: int | None = None, last: int = 5) -> list[dict[str, Any]]:
    """One dict per stream (all, or ``stream_id``) with its state, its registered consumers
    (:func:`consumers`) and the ``last`` batches (``last = 0``: no batches are read)."""
    streams = _dicts(conn, """
select ss.*, st.open_run_key, st.slot_reader as declared_reader
from pgstream.stream_status ss join pgstream.streams st on st.id = ss.id
where %(stream_id)s::bigint is null or ss.id = %(stream_id)s::bigint
order by ss.id""", {"stream_id": stream_id})
    readers = consumers(conn, stream_id)
    for s in streams:
        s["last_batches"] = last_batches(conn, s["id"], last) if last else []
        s["consumers"] = [c for c in readers if c["stream_id"] == s["id"]]
    return streams


def consumers(conn: psycopg.Connection, stream_id: int | None = None) -> list[dict[str, Any]]:
    """The registered consumers (``pgstream.consumer_status``) of every stream or of ``stream_id``: name,
    position, lag_events, oldest_unread, max_retention_days, overrun (past its bound: no longer kept)."""
    return _dicts(conn, "select * from pgstream.consumer_status where %(s)s::bigint is null or stream_id = %(s)s "
                  "order by name", {"s": stream_id})


def render_consumer(c: dict[str, Any]) -> str:
    """One line of ``status`` and ``consumers list`` for a registered consumer."""
    position = "before every batch" if c["batch_id"] == 0 else f"batch {c['batch_id']} ordinal {c['ord']}"
    unread = (f"{c['lag_events']} events behind (oldest unread created {c['oldest_unread']:%Y-%m-%d %H:%M:%S} UTC)"
              if c["lag_events"] else "caught up")
    overrun = (f"; OVERRUN: its unread events are older than {c['max_retention_days']} days and no longer kept "
               f"(pgstream-dagster consumers drop {c['name']}, if it is abandoned)" if c["overrun"] else
               f"; kept for up to {c['max_retention_days']} days")
    return (f"consumer {c['name']} (stream {c['stream_id']}): read through {position}, {unread}{overrun}; "
            f"updated {c['updated_at']:%Y-%m-%d %H:%M:%S} UTC")


def last_batches(conn: psycopg.Connection, stream_id: int, last: int) -> list[dict[str, Any]]:
    return _dicts(conn, "select id, kind, status, event_count, first_event_id, last_event_id, attempts, error, "
                  "created_at, delivered_at from pgstream.batches where stream_id = %s order by id desc limit %s",
                  [stream_id, last])


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


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
        lines.append(f"  dead letters: {open_letters} open (oldest since {s['oldest_dead_letter_at']}): "
                     f"pgstream-dagster dead-letters list {s['id']}" if open_letters else "  dead letters: none open")
        declared = str(s.get("declared_reader") or "")
        if declared.startswith("group:"):
            lines.append(f"  read by reader group {declared.removeprefix('group:')} (its sensor "
                         f"pgstream_group_{declared.removeprefix('group:')} records the stream's batches)")
        if s.get("open_run_key"):
            lines.append(f"  open run: {s['open_run_key']} (it takes every new batch)")
        if s["failover_since"]:
            lines.append(f"  failover since {s['failover_since']}: checkpoint event {s['failover_checkpoint_id']} "
                         f"(committed {s['failover_checkpoint_ts']}), {s['failover_attempts']} failed attempts, "
                         f"next retry {s['failover_retry_at'] or '-'}")
            if s["failover_error"]:
                lines.append(f"  last error: {s['failover_error']}")
        lines += ["  " + render_consumer(c) for c in s.get("consumers", [])]
        for b in s["last_batches"]:
            err = f" error: {b['error']}" if b["error"] and b["status"] != BatchStatus.DELIVERED else ""
            lines.append(f"  batch {b['id']} {b['kind']} {b['status']}: {b['event_count']} events "
                         f"{b['first_event_id']}..{b['last_event_id']}, attempts {b['attempts']}{err}")
    return "\n".join(lines)


# --- the queries of the stream's asset checks (defs/checks.py) ---------------------------------

_UNDELIVERED_AGE = """with ledger as (
       select min(min_created_at) filter (where pgstream.batch_is_open(status)) as oldest_batch,
              count(*) filter (where pgstream.batch_is_open(status)) as undelivered_batches,
              coalesce(sum(event_count) filter (where pgstream.batch_is_open(status)), 0) as undelivered_events,
              max(max_created_at) as newest_recorded
       from pgstream.batches where stream_id = %(id)s
   ), waiting as (
       select min(e.created_at) as oldest, count(*) as events
       from pgstream.events e, ledger l
       where e.stream_id = %(id)s
         and e.created_at > greatest(l.newest_recorded, now() - make_interval(days => %(keep)s))
   )
   select extract(epoch from now() - least(l.oldest_batch, w.oldest))::float8,
          l.undelivered_batches, l.undelivered_events, w.events
   from ledger l, waiting w"""


def undelivered_age(conn: psycopg.Connection, stream_id: int, ledger_keep_days: int) -> tuple[Any, ...]:
    """``(age of the oldest undelivered event in seconds or None, undelivered batches, undelivered events,
    events waiting in the slot)``: batches not delivered, plus events newer than the ledger recorded."""
    row = conn.execute(_UNDELIVERED_AGE, {"id": stream_id, "keep": ledger_keep_days}).fetchone()
    assert row is not None
    return row


def slot_wal(conn: psycopg.Connection, slot: str) -> tuple[Any, ...] | None:
    """``(wal_status, retained WAL bytes, active)`` of the slot in this database; ``None`` if missing."""
    return conn.execute(
        """select wal_status, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, active
           from pg_catalog.pg_replication_slots where slot_name = %s and database = current_database()""",
        [slot]).fetchone()


def orphaned_slots(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """``pgstream.orphaned_slots``: this database's slots named like a stream's default slot that no stream
    reads (its stream deleted or renamed its slot), each keeping its WAL (``retained_bytes``) until dropped."""
    return _dicts(conn, "select slot_name, retained_bytes, active, wal_status from pgstream.orphaned_slots "
                  "order by slot_name")


def render_orphaned_slots(slots: list[dict[str, Any]]) -> str:
    """What ``pgstream-dagster status`` says of :func:`orphaned_slots` (empty when there are none)."""
    return "".join(
        f"\nslot {s['slot_name']}: no stream reads it, and it retains {_bytes(s['retained_bytes'])} of WAL"
        f"{' (in use by a connection)' if s['active'] else ''}; once no consumer needs it: select "
        f"pg_catalog.pg_drop_replication_slot('{s['slot_name']}')" for s in slots)


#: pgstream's logical slots a standby holds that it did not synchronize from the primary: the names pgstream derives
#: (a stream's default slot, a reader group's; a custom ``slot_name`` may be another consumer's and is not listed)
_STANDBY_SLOTS = """
select r.slot_name::text,
       coalesce(pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_last_wal_replay_lsn(), r.restart_lsn), 0)::bigint,
       r.wal_status
from pg_catalog.pg_replication_slots r
where pg_catalog.pg_is_in_recovery()
  and r.database operator(pg_catalog.=) pg_catalog.current_database()
  and r.slot_type operator(pg_catalog.=) 'logical'
  and not coalesce((pg_catalog.to_jsonb(r) operator(pg_catalog.->>) 'synced')::boolean, false)
  and (r.slot_name::text operator(pg_catalog.~) pgstream.default_slot_pattern()
       or r.slot_name::text in (select g.slot from pgstream.reader_groups g))
order by 1
"""


def standby_slots(database_url: str, *, drop: bool = False) -> list[dict[str, Any]]:
    """pgstream's slots that the standbys of ``database_url`` (the servers of a multi-host URL in recovery) hold and
    did not synchronize from the primary: a former primary's, kept by ``pg_rewind`` when it rejoined as a standby,
    each retaining WAL there. pgstream reads slots on the primary only, and replaces one behind the point the ledger
    says its slot was created at (migration 033): ``drop`` drops them. A server that does not answer is passed over
    (the old primary is often down for a while)."""
    found: list[dict[str, Any]] = []
    info = conninfo_to_dict(database_url)  # each server the multi-host URL names, in its order
    ports = str(info.get("port") or "5432").split(",")
    hosts = [(host, ports[i] if len(ports) > 1 else ports[0])
             for i, host in enumerate(str(info.get("host") or info.get("hostaddr") or "").split(",")) if host]
    if len(hosts) < 2:
        return found
    for host, port in hosts:
        try:
            conn = dbconn.connect(database_url, host=host, port=port, target_session_attrs="any", connect_timeout=2,
                                  autocommit=True)
        except psycopg.OperationalError:
            continue
        with conn:
            try:
                rows = conn.execute(_STANDBY_SLOTS).fetchall()
            except psycopg.Error:  # (not a server of this database's cluster: nothing of pgstream's to look at)
                continue
            for name, retained, wal_status in rows:
                slot = {"server": f"{host}:{port}", "slot_name": name, "retained_bytes": int(retained),
                        "wal_status": wal_status, "dropped": False}
                if drop:
                    try:
                        replication.drop_slot(conn, name)
                        slot["dropped"] = True
                    except psycopg.Error as exc:  # in use, or being synchronized since the look
                        slot["error"] = dbconn.error_line(exc)
                found.append(slot)
    return found


def render_standby_slots(slots: list[dict[str, Any]]) -> str:
    """What ``pgstream-dagster status`` and the ``no_orphaned_slots`` check say of :func:`standby_slots`."""
    return "".join(
        f"\nslot {s['slot_name']} on standby {s['server']}: a former primary's (not synchronized from the primary), "
        f"it retains {_bytes(s['retained_bytes'])} of WAL there; dropped by the next housekeeping, or there: select "
        f"pg_catalog.pg_drop_replication_slot('{s['slot_name']}')" for s in slots if not s["dropped"])


def failover_state(conn: psycopg.Connection, stream_id: int) -> tuple[Any, ...] | None:
    """``(failover_since, failover_checkpoint_id)`` of the stream; ``None`` if it is not in pgstream.streams."""
    return conn.execute("select failover_since, failover_checkpoint_id from pgstream.streams where id = %s",
                        [stream_id]).fetchone()
