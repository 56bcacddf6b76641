"""Partition and ledger housekeeping: create daily partitions ahead, drop expired ones, prune the
batch ledger. Run by the ``pgstream_housekeeping`` schedule (``housekeeping.cron``) and once by
``pgstream-dagster init`` at start-up, so a fresh install never lacks today's partition.

The retention policy itself lives in SQL (``pgstream.drop_partitions``): it keeps partitions that
hold undelivered events and says so with a WARNING. Here we measure what is about to be dropped,
capture those notices and report partitions kept past retention.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ..config import HousekeepingConfig

_PARTITION = re.compile(r"^events_(\d{8})$")
_KEEPING = re.compile(r"keeping partition (\S+)")


@dataclass
class HousekeepingReport:
    today: dt.date
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # expired but kept: they hold undelivered events
    rows_dropped: int = 0
    bytes_dropped: int = 0
    default_rows_deleted: int = 0
    batches_pruned: int = 0
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"housekeeping {self.today}: created {len(self.created)} partitions, dropped {len(self.dropped)} "
                f"({self.rows_dropped} rows, {self.bytes_dropped} bytes), kept {len(self.kept)} past retention, "
                f"deleted {self.default_rows_deleted} expired rows of events_default, "
                f"pruned {self.batches_pruned} delivered batches")

    def as_dict(self) -> dict[str, Any]:
        return {"today": self.today.isoformat(), "created": self.created, "dropped": self.dropped,
                "kept": self.kept, "rows_dropped": self.rows_dropped, "bytes_dropped": self.bytes_dropped,
                "default_rows_deleted": self.default_rows_deleted, "batches_pruned": self.batches_pruned,
                "warnings": self.warnings}


def _partitions(conn: psycopg.Connection) -> dict[str, dt.date]:
    rows = conn.execute(
        """select c.relname::text from pg_catalog.pg_inherits i
           join pg_catalog.pg_class c on c.oid = i.inhrelid
           where i.inhparent = 'pgstream.events'::regclass""").fetchall()
    out: dict[str, dt.date] = {}
    for (name,) in rows:
        m = _PARTITION.match(name)
        if m:
            out[name] = dt.datetime.strptime(m.group(1), "%Y%m%d").date()
    return out


def _measure(conn: psycopg.Connection, name: str, day: dt.date) -> tuple[int, int]:
    # through pgstream.events (the runtime role may read it, not each partition): the day's range
    # prunes the scan to the partition
    row = conn.execute("select (select count(*) from pgstream.events where tableoid = r.oid "
                       "          and created_at >= (%s::date::timestamp at time zone 'UTC') "
                       "          and created_at < ((%s::date + 1)::timestamp at time zone 'UTC')), "
                       "pg_total_relation_size(r.oid) "
                       "from (select format('pgstream.%%I', %s::text)::regclass::oid as oid) r",
                       [day, day, name]).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _default_expired(conn: psycopg.Connection, cutoff: dt.date) -> int:
    row = conn.execute("select count(*) from pgstream.events_default "
                       "where created_at < (%s::date::timestamp at time zone 'UTC')", [cutoff]).fetchone()
    return int(row[0]) if row else 0


def run_housekeeping(conn: psycopg.Connection, config: HousekeepingConfig,
                     today: dt.date | None = None) -> HousekeepingReport:
    """One housekeeping pass for UTC day ``today`` (default: the database's UTC today).

    Each step commits on its own (short locks): create partitions ahead; measure and drop the
    expired ones (rows and bytes counted before dropping, in the dropping transaction); prune
    delivered batches older than ``ledger_keep_days`` (relative to ``today``).
    """
    if today is None:
        row = conn.execute("select pgstream.utc_today()").fetchone()
        assert row is not None
        today = row[0]
    assert today is not None
    report = HousekeepingReport(today=today)
    notices: list[str] = []

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        if diag.severity_nonlocalized in ("WARNING", "NOTICE") and diag.message_primary:
            notices.append(diag.message_primary)

    conn.add_notice_handler(on_notice)
    try:
        with conn.transaction():
            report.created = [r[0] for r in conn.execute("select * from pgstream.create_partitions(%s, %s)",
                                                         [config.days_ahead, today]).fetchall()]
        cutoff = today - dt.timedelta(days=config.retention_days)
        with conn.transaction():
            expired = {n: _measure(conn, n, day) for n, day in sorted(_partitions(conn).items()) if day < cutoff}
            default_before = _default_expired(conn, cutoff)
            report.dropped = [r[0] for r in conn.execute("select * from pgstream.drop_partitions(%s, %s, %s)",
                                                         [config.retention_days, today,
                                                          config.undelivered_policy]).fetchall()]
            report.default_rows_deleted = default_before - _default_expired(conn, cutoff)
        for name in report.dropped:
            rows, size = expired.get(name, (0, 0))
            report.rows_dropped += rows
            report.bytes_dropped += size
        kept = {n for n in expired if n not in report.dropped}
        kept |= {m.group(1) for n in notices if (m := _KEEPING.search(n))}
        report.kept = sorted(kept)
        with conn.transaction():
            # keep_days counted back from the (possibly simulated) today, not from now()
            row = conn.execute("select pgstream.prune_batches("
                               "make_interval(days => %s - (%s::date - pgstream.utc_today())))",
                               [config.ledger_keep_days, today]).fetchone()
            report.batches_pruned = int(row[0]) if row and row[0] is not None else 0
    finally:
        conn.remove_notice_handler(on_notice)
    report.warnings = notices
    record_run(conn, report)
    return report


#: housekeeping passes kept in pgstream.housekeeping_runs (the exporter shows the last one)
KEEP_RUNS = 100


def record_run(conn: psycopg.Connection, report: HousekeepingReport) -> None:
    """Record the pass in ``pgstream.housekeeping_runs`` (the ``pgstream_housekeeping_*`` metrics)."""
    with conn.transaction():
        conn.execute(
            """insert into pgstream.housekeeping_runs
                   (today, partitions_created, partitions_dropped, partitions_kept, rows_dropped, bytes_dropped,
                    default_rows_deleted, batches_pruned, warnings)
               values (%s, %s, %s, %s, %s, %s, %s, %s, %s)""",
            [report.today, len(report.created), len(report.dropped), len(report.kept), report.rows_dropped,
             report.bytes_dropped, report.default_rows_deleted, report.batches_pruned, len(report.warnings)])
        conn.execute("delete from pgstream.housekeeping_runs where id <= "
                     "(select id from pgstream.housekeeping_runs order by id desc offset %s limit 1)", [KEEP_RUNS])
