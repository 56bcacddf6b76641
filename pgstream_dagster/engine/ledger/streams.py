"""Stream rows and the slot each reads (``pgstream.streams.slot``): the one place Python learns a slot's name.
A joined stream reads its group's slot; ``slot`` is the own one it had before, drained and dropped when it joins."""

from __future__ import annotations

import psycopg


def stream_slot(conn: psycopg.Connection, stream_id: int) -> str:
    """The slot the stream reads, or the default a new stream row would get (``pgstream.default_slot_name``)."""
    row = conn.execute("select pgstream.stream_slot(%s)", [stream_id]).fetchone()
    assert row is not None and row[0] is not None
    return str(row[0])
