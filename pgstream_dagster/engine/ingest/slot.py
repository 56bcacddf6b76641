"""The stream's slot exists and is usable (:func:`ensure_slot`): created when missing, replaced when
invalidated, and what the ledger does not cover recovered from ``pgstream.events``. The sensor calls it
at the start of each tick, whoever reads the slot."""

from __future__ import annotations

import psycopg

from ...config import StreamConfig
from .. import limits, replication
from ..ledger import recording, streams
from .results import ConsumeResult

#: how long the sensor's creation of a slot waits for the transactions running then to end (any role that
#: writes a table can keep one open): then the tick ends naming them (replication.SlotCreationWaits)
SLOT_CREATION_WAIT_SECS = 5.0


def ensure_slot(conn: psycopg.Connection, stream: StreamConfig, result: ConsumeResult, *,
                wait_secs: float | None = None) -> None:
    """Create the stream row, publication and slot when missing. A slot that was dropped or
    invalidated (``wal_status = 'lost'``, e.g. ``max_slot_wal_keep_size`` exceeded) is replaced,
    then every event no batch covers is recovered from the table. ``wait_secs``: how long creating the
    slot may wait for running transactions (:func:`~..replication.create_slot`; ``None``: as long as
    they run).

    Crash-safe: ``recovery_pending`` is set before the slot is touched and cleared in the
    transaction that records the recovery, so an interruption anywhere makes the next tick
    recover again (duplicates possible, losses not). An open run's reader does not read while a
    recovery is pending (it gives the slot back to the sensor)."""
    # (a reader group's member that is joining was registered by register_group_member: its own slot
    # is read until the group's reader takes over)
    slot = result.slot = streams.stream_slot(conn, stream.id) if stream.reader is not None else \
        streams.ensure_stream(conn, stream.id, stream.slot_name)
    # a publication dropped by hand: logical decoding skips the stream's events without an error
    # (Postgres 18 only warns), so it is put back, and what committed meanwhile is recovered from the
    # table (decoding looks publications up as of each change: re-created, it does not see those)
    result.publications_created = replication.ensure_publications(conn, stream.id)
    if result.publications_created:
        recording.set_recovery_pending(conn, stream.id)
    info = replication.slot_info(conn, slot)
    pending = recording.recovery_pending(conn, stream.id)
    if info is not None and info["wal_status"] != "lost" and not pending:
        return
    if info is None and (elsewhere := replication.slot_database(conn, slot)) is not None:
        raise streams.SlotElsewhere(stream.id, slot, elsewhere)
    recording.set_recovery_pending(conn, stream.id)
    if info is not None and info["wal_status"] == "lost":
        replication.drop_slot(conn, slot)
        result.slot_lost = True
        info = None
    if info is None:
        try:
            replication.create_slot(conn, slot, wait_secs=wait_secs)
        except psycopg.errors.ConfigurationLimitExceeded:  # all replication slots are in use
            row = conn.execute("select count(*) from pg_catalog.pg_replication_slots").fetchone()
            line = limits.slot_problem(limits.server_limits(conn), int(row[0]) if row else 0, [stream.id])
            raise limits.LimitsExceeded([line or f"stream {stream.id}: no replication slot is free; raise "
                                                 f"max_replication_slots in postgresql.conf and restart Postgres"]
                                        ) from None
        result.slot_created = True
    result.recovered = recording.recover_from_table(conn, stream.id, stream.batch.max_size)
