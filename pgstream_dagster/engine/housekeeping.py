"""Partition and ledger housekeeping: daily partitions ahead, expired ones dropped, the batch ledger pruned;
run by the ``pgstream_housekeeping`` schedule and once by ``pgstream-dagster init``. The retention policy is
SQL's (``pgstream.expired_partitions``, ``pgstream.drop_partition``: partitions holding undelivered events are
kept, with a WARNING, and no lock on ``pgstream.events`` is waited for longer than
``housekeeping.lock_timeout_ms``); here each partition is dropped in its own transaction and what was kept or
left for the next pass is reported. A registered consumer holds back what it has not read for at most its
``max_retention_days``; past that it is **overrun** (``consumers_overrun``, a warning and a metric).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg

from ..config import HousekeepingConfig
from .status import standby_slots


@dataclass
class HousekeepingReport:
    today: dt.date
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # expired but kept: they hold undelivered events
    busy: list[str] = field(default_factory=list)  # expired, but their locks stayed held: the next pass tries again
    rows_dropped: int = 0
    bytes_dropped: int = 0
    default_rows_deleted: int = 0
    batches_pruned: int = 0
    #: registered consumers whose unread events are past their max_retention_days (no longer kept)
    consumers_overrun: list[str] = field(default_factory=list)
    #: pgstream's slots dropped on a standby of a multi-host URL (a former primary's: status.standby_slots)
    standby_slots_dropped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        busy = (f", left {len(self.busy)} for the next pass (their locks were held: {', '.join(self.busy)})"
                if self.busy else "")
        return (f"housekeeping {self.today}: created {len(self.created)} partitions, dropped {len(self.dropped)} "
                f"({self.rows_dropped} rows, {self.bytes_dropped} bytes), kept {len(self.kept)} past retention"
                f"{busy}, deleted {self.default_rows_deleted} expired rows of events_default, "
                f"pruned {self.batches_pruned} delivered batches"
                + (f"; consumers past their retention bound (not kept for): {', '.join(self.consumers_overrun)}"
                   if self.consumers_overrun else "")
                + (f"; dropped a former primary's slots on its standby: {', '.join(self.standby_slots_dropped)}"
                   if self.standby_slots_dropped else ""))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "today": self.today.isoformat()}


def run_housekeeping(conn: psycopg.Connection, config: HousekeepingConfig,
                     today: dt.date | None = None, database_url: str | None = None) -> HousekeepingReport:
    """One pass for UTC day ``today`` (default: the database's), each step committing on its own: partitions ahead,
    expired ones dropped one transaction each, expired ``events_default`` rows deleted, old delivered batches
    pruned; locks tried ``lock_attempts`` times for ``lock_timeout_ms``, a partition still held left (``busy``).
    With ``database_url`` (a multi-host URL), pgstream's slots its standbys hold unsynchronized are dropped."""
    if today is None:
        row = conn.execute("select pgstream.utc_today()").fetchone()
        assert row is not None
        today = row[0]
    report = HousekeepingReport(today=today)
    notices: list[str] = []
    locks = [config.lock_timeout_ms, config.lock_attempts]

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        if diag.severity_nonlocalized in ("WARNING", "NOTICE") and diag.message_primary:
            notices.append(diag.message_primary)

    conn.add_notice_handler(on_notice)
    try:
        for name, oldest, days in conn.execute(
                "select name, oldest_unread, max_retention_days from pgstream.consumer_positions(%s) where overrun",
                [today]).fetchall():
            report.consumers_overrun.append(name)
            notices.append(f"pgstream: consumer {name} has not read events since {oldest:%Y-%m-%d %H:%M} UTC, older "
                           f"than its max_retention_days ({days}): they are no longer kept (an abandoned consumer? "
                           f"pgstream-dagster consumers drop {name})")
        with conn.transaction():
            report.created = [r[0] for r in conn.execute("select * from pgstream.create_partitions(%s, %s, %s, %s)",
                                                         [config.days_ahead, today, *locks]).fetchall()]
        with conn.transaction():  # the 'fail' policy raises here, before anything is dropped
            expired = [r[0] for r in conn.execute("select * from pgstream.expired_partitions(%s, %s, %s)",
                                                  [config.retention_days, today, config.undelivered_policy])]
        for name in expired:
            if report.busy:  # every detach needs the lock the last one could not take
                report.busy.append(name)
                continue
            with conn.transaction():
                row = conn.execute("select status, rows_dropped, bytes_dropped from "
                                   "pgstream.drop_partition(%s, %s, %s, %s, %s)",
                                   [name, config.retention_days, today, *locks]).fetchone()
            assert row is not None
            status, rows, size = row
            if status == "dropped":
                report.dropped.append(name)
                report.rows_dropped += int(rows)
                report.bytes_dropped += int(size)
            elif status == "kept":
                report.kept.append(name)
            elif status == "busy":
                report.busy.append(name)
        if len(report.busy) > 1:
            notices.append(f"pgstream: partitions {', '.join(report.busy[1:])} not dropped this pass either: "
                           f"they need the same locks; the next pass tries again")
        with conn.transaction():
            row = conn.execute("select pgstream.delete_expired_default(%s, %s)",
                               [config.retention_days, today]).fetchone()
            report.default_rows_deleted = int(row[0]) if row and row[0] is not None else 0
        with conn.transaction():
            # keep_days counted back from the (possibly simulated) today, not from now()
            row = conn.execute("select pgstream.prune_batches("
                               "make_interval(days => %s - (%s::date - pgstream.utc_today())))",
                               [config.ledger_keep_days, today]).fetchone()
            report.batches_pruned = int(row[0]) if row and row[0] is not None else 0
        if database_url is not None:
            for slot in standby_slots(database_url, drop=True):
                if slot["dropped"]:
                    report.standby_slots_dropped.append(f"{slot['slot_name']} on {slot['server']}")
                else:
                    notices.append(f"pgstream: slot {slot['slot_name']} on standby {slot['server']}, a former "
                                   f"primary's, could not be dropped: {slot.get('error')}")
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
                   (today, partitions_created, partitions_dropped, partitions_kept, partitions_busy, rows_dropped,
                    bytes_dropped, default_rows_deleted, batches_pruned, warnings, consumers_overrun)
               values (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
            [report.today, len(report.created), len(report.dropped), len(report.kept), len(report.busy),
             report.rows_dropped, report.bytes_dropped, report.default_rows_deleted, report.batches_pruned,
             len(report.warnings), len(report.consumers_overrun)])
        conn.execute("delete from pgstream.housekeeping_runs where id <= "
                     "(select id from pgstream.housekeeping_runs order by id desc offset %s limit 1)", [KEEP_RUNS])
