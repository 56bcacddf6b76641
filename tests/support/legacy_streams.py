"""Stream rows as versions with a slot per stream made them (each outside any group, reading a slot of its own),
for tests and benches: :func:`ensure_stream` makes such a row, as a stream that has not joined its group yet has."""

from __future__ import annotations

import psycopg

from pgstream_dagster.engine.ledger.groups import GroupChange
from pgstream_dagster.engine.ledger.streams import stream_slot
from pgstream_dagster.engine.replication import PublicationTaken

#: The unique index on the slot a stream reads, ``pgstream.streams.slot`` (sql/022_lock_timeouts_and_slot_names.sql).
SLOT_INDEX = "streams_slot_key"
#: A reader group's slot (``pgstream.reader_groups.slot``): register_stream refuses it for a stream.
GROUP_SLOT_KEY = "reader_groups_slot_key"


class SlotInUse(RuntimeError):
    """A stream was to read a replication slot that another stream already reads."""

    def __init__(self, stream_id: int, slot: str, holder: int | None, group: str | None = None) -> None:
        self.stream_id, self.slot, self.holder = stream_id, slot, holder
        other = f"stream {holder}" if holder is not None else "another stream"
        if group is not None:
            other = f"reader group {group} (its slot)"
        advice = f"give stream {stream_id} another streams[].slot_name in pgstream.yaml"
        if holder is not None:  # advice for the operator, never executed
            advice += (f", or, if stream {holder} is no longer used, delete it (delete from pgstream.streams "  # noqa: S608
                       f"where id = {holder}) and drop its slot (select pg_drop_replication_slot('{slot}'))")
        super().__init__(f"stream {stream_id}: slot {slot} is already used by {other}; a slot belongs to one "
                         f"stream (each would advance it past the other's events): {advice}")


def slot_holder(conn: psycopg.Connection, slot: str, stream_id: int) -> int | None:
    """The stream other than ``stream_id`` that reads ``slot`` (``pgstream.streams.slot``)."""
    row = conn.execute("select pgstream.slot_holder(%s, %s)", [slot, stream_id]).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def ensure_stream(conn: psycopg.Connection, stream_id: int, slot_name: str | None = None) -> str:
    """The stream row, outside any group, reading ``slot_name`` (``None``: its default) as a version with a slot per
    stream made it; that slot. :class:`SlotInUse`, :class:`PublicationTaken`: nothing changed."""
    try:
        with conn.transaction():
            # the owner's function: the row exists and reads slot_name (null: its default), locked only on a change
            conn.execute("select pgstream.register_stream(%s, %s)", [stream_id, slot_name])
            return stream_slot(conn, stream_id)
    except psycopg.errors.FeatureNotSupported as exc:  # a reader group's member (it may not leave)
        raise GroupChange((exc.diag.message_primary or str(exc)).removeprefix("pgstream: ")) from None
    except psycopg.errors.DuplicateObject as exc:  # its publication's name is another role's publication
        raise PublicationTaken.of(exc) from None
    except psycopg.errors.UniqueViolation as exc:
        if exc.diag.constraint_name == GROUP_SLOT_KEY and slot_name is not None:
            row = conn.execute("select name from pgstream.reader_groups where slot = %s", [slot_name]).fetchone()
            raise SlotInUse(stream_id, slot_name, None, group=str(row[0]) if row else "?") from None
        if exc.diag.constraint_name != SLOT_INDEX:
            raise
        wanted = slot_name or stream_slot(conn, stream_id)
        raise SlotInUse(stream_id, wanted, slot_holder(conn, wanted, stream_id)) from None
