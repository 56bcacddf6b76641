"""Reading a logical replication slot (pgoutput; transactions whole, in commit order: the delivery order).
A group's sensor *peeks* with ``pg_logical_slot_peek_binary_changes`` and *advances* the slot only after
recording (each decodes the WAL again from ``restart_lsn``); a group delivery run's reader *streams*
(``walstream.ReplicationStream``, each transaction decoded once) and confirms only what is recorded.
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import psycopg

_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


class DecodedEvent(NamedTuple):
    id: int
    created_at: dt.datetime
    #: with ``PgOutputDecoder(keep_stream=True)`` (a reader group's publication): the event's stream
    stream_id: int | None = None
    #: with ``keep_rows`` and a publication that carries them: the payload's text (``payload::text``; None: not
    #: kept, as for a payload over :data:`KEEP_ROW_BYTES`) and the metadata's (None: null, or not kept)
    payload: str | None = None
    metadata: str | None = None


#: a payload (or metadata) longer than this is not kept with its event (``keep_rows``): read from the table
KEEP_ROW_BYTES = 2**20
#: bytes of text the decoder keeps until told they were recorded (:meth:`PgOutputDecoder.recorded`); beyond, its
#: events come without their text (read from the table): what a reader holds stays bounded whatever the payloads
KEEP_BUDGET_BYTES = 64 * 2**20


class Unreadable(NamedTuple):
    """An event the sensor cannot record: it becomes a dead letter (stage 'read') with ``reason``."""

    id: int
    raw_created_at: str
    reason: str
    stream_id: int | None = None  # as DecodedEvent.stream_id


@dataclass
class Transaction:
    """One committed transaction of the events table, as decoded from the WAL."""

    xid: int
    commit_lsn: int = 0
    end_lsn: int = 0
    commit_time: dt.datetime = _PG_EPOCH
    events: list[DecodedEvent] = field(default_factory=list)
    unreadable: list[Unreadable] = field(default_factory=list)


def parse_timestamp(text: str) -> dt.datetime | None:
    """A ``timestamptz`` in Postgres's ISO output, or None when Python cannot represent it
    (``infinity``, ``-infinity``, years after 9999, BC dates)."""
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        return None


def unreadable_timestamp(event_id: int, raw: str, stream_id: int | None = None) -> Unreadable:
    return Unreadable(event_id, raw, f"created_at {raw[:60]!r} cannot be represented by clients (years 1-9999 "
                                     "only): the event was not recorded in a batch", stream_id)


def lsn_to_int(lsn: str) -> int:
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def int_to_lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


_TEXT = 0x74  # 't': a column value in text form (TupleData)
_INSERT = 0x49  # 'I'


class PgOutputDecoder:
    """Decodes pgoutput protocol v1 messages (relations kept across them): of an INSERT only ``id``,
    ``created_at`` (parsed once per value), with ``keep_stream`` ``stream_id`` and with ``keep_rows`` the
    payload's and metadata's text when the publication carries them; :meth:`decode`: many at once."""

    def __init__(self, *, keep_stream: bool = False, keep_rows: bool = False) -> None:
        # relation id (4 bytes, as in the message) -> the positions of the id, created_at, stream_id, payload and
        # metadata columns (-1: not read), and how many columns to read (up to the last of them)
        self._relations: dict[bytes, tuple[int, int, int, int, int, int]] = {}
        self._keep_stream = keep_stream
        #: keep each event's payload and metadata text (a group run hands them to its members: engine.handoff)
        self._keep_rows = keep_rows
        self._kept_bytes = 0  # (since the last recording: KEEP_BUDGET_BYTES)
        self._current: Transaction | None = None
        self._last_ts: tuple[bytes, dt.datetime] = (b"", _PG_EPOCH)

    @property
    def in_transaction(self) -> bool:
        """A transaction's BEGIN was decoded, its COMMIT not yet."""
        return self._current is not None

    def decode(self, messages: Iterable[bytes]) -> list[Transaction]:
        """Consume ``messages`` in order; the transactions whose COMMIT was among them."""
        txns: list[Transaction] = []
        relations = self._relations
        append = self._current.events.append if self._current is not None else None
        unreadable = self._current.unreadable.append if self._current is not None else None
        last = self._last_ts
        last_stream = (b"", 0)
        from_iso = dt.datetime.fromisoformat
        new_tuple = tuple.__new__
        for data in messages:
            if data[0] == _INSERT and append is not None:
                id_col, ts_col, stream_col, payload_col, metadata_col, ncols = relations[data[1:5]]
                # TupleData: per column a kind byte, then for 't' a 4-byte length and the value ('n': nothing);
                # the columns up to the last one wanted, as bytes (None: null)
                values: list[bytes | None] = []
                add = values.append
                pos = 8
                for _ in range(ncols):
                    if data[pos] == _TEXT:
                        start = pos + 5
                        pos = start + int.from_bytes(data[pos + 1:start])
                        add(data[start:pos])
                    else:
                        add(None)
                        pos += 1
                raw_id, raw_ts = values[id_col], values[ts_col]
                if raw_id is None or raw_ts is None:
                    raise ValueError("an event without id or created_at in the WAL")
                event_id = int(raw_id)
                stream = None
                if stream_col >= 0 and (raw_stream := values[stream_col]) is not None:
                    if raw_stream != last_stream[0]:
                        last_stream = (raw_stream, int(raw_stream))
                    stream = last_stream[1]
                if last[0] != raw_ts:
                    try:
                        last = (raw_ts, from_iso(raw_ts.decode()))
                    except ValueError:  # infinity, years after 9999, BC
                        raw = raw_ts.decode(errors="replace")
                        unreadable(unreadable_timestamp(event_id, raw, stream))  # type: ignore[misc]
                        continue
                payload: str | None = None
                metadata: str | None = None
                if payload_col >= 0 and self._kept_bytes < KEEP_BUDGET_BYTES \
                        and (raw_payload := values[payload_col]) is not None and len(raw_payload) <= KEEP_ROW_BYTES \
                        and ((raw_meta := values[metadata_col]) is None or len(raw_meta) <= KEEP_ROW_BYTES):
                    self._kept_bytes += len(raw_payload) + (len(raw_meta) if raw_meta is not None else 0)
                    try:
                        payload = raw_payload.decode()
                        metadata = None if raw_meta is None else raw_meta.decode()
                    except UnicodeDecodeError:  # (the server's encoding is not UTF-8: read from the table)
                        payload = metadata = None
                append(new_tuple(DecodedEvent, (event_id, last[1], stream, payload, metadata)))
            else:
                txn = self.feed(data)
                if txn is not None:
                    txns.append(txn)
                append = self._current.events.append if self._current is not None else None
                unreadable = self._current.unreadable.append if self._current is not None else None
        self._last_ts = last
        return txns

    def recorded(self) -> None:
        """What was decoded so far is recorded: texts are kept again, up to :data:`KEEP_BUDGET_BYTES`."""
        self._kept_bytes = 0

    def feed(self, data: bytes) -> Transaction | None:
        """Consume one message; returns the transaction when its COMMIT arrives."""
        kind = data[:1]
        if kind == b"B":
            _final_lsn, ts_us, xid = struct.unpack_from("!qqI", data, 1)
            self._current = Transaction(xid=xid, commit_time=_PG_EPOCH + dt.timedelta(microseconds=ts_us))
        elif kind == b"R":
            self._relation(data)
        elif kind == b"I":
            assert self._current is not None, "INSERT outside a transaction"
            self.decode([data])
        elif kind == b"C":
            assert self._current is not None, "COMMIT outside a transaction"
            _flags, commit_lsn, end_lsn, _ts = struct.unpack_from("!bqqq", data, 1)
            txn, self._current = self._current, None
            txn.commit_lsn, txn.end_lsn = commit_lsn, end_lsn
            return txn
        # Y (type), O (origin), T (truncate), M (message): nothing to do for an insert-only stream
        return None

    def _relation(self, data: bytes) -> None:
        pos = 5
        for _ in range(2):  # namespace, relation name
            pos = data.index(b"\0", pos) + 1
        pos += 1  # replica identity
        (ncols,) = struct.unpack_from("!h", data, pos)
        pos += 2
        names = []
        for _ in range(ncols):
            pos += 1  # flags
            end = data.index(b"\0", pos)
            names.append(data[pos:end].decode())
            pos = end + 1 + 8  # type oid + typmod
        wanted = ["id", "created_at"] + (["stream_id"] if self._keep_stream else [])
        missing = set(wanted) - set(names)
        if missing:
            raise ValueError(f"the publication does not carry column(s) {sorted(missing)} of pgstream.events")
        if self._keep_rows and {"payload", "metadata"} <= set(names):  # (an older publication carries neither)
            wanted += ["payload", "metadata"]
        cols = {name: names.index(name) for name in wanted}
        self._relations[data[1:5]] = (cols["id"], cols["created_at"], cols.get("stream_id", -1),
                                      cols.get("payload", -1), cols.get("metadata", -1), max(cols.values()) + 1)


class PublicationTaken(RuntimeError):
    """A publication by a stream's or a reader group's name is not pgstream's (another role created it
    for its own tables): one line naming it and its owner; nothing was created or read through it."""

    @classmethod
    def of(cls, exc: psycopg.Error) -> PublicationTaken:
        return cls((exc.diag.message_primary or str(exc)).removeprefix("pgstream: "))


def publication_exists(conn: psycopg.Connection, name: str) -> bool:
    return conn.execute("select exists (select 1 from pg_catalog.pg_publication where pubname = %s)",
                        [name]).fetchone() == (True,)


def slot_info(conn: psycopg.Connection, slot: str) -> dict[str, object] | None:
    """Slot state: confirmed position, retained WAL bytes, WAL status; a slot synced from a former primary (17+,
    ``synced``: a promoted standby's copy) is ``lost`` (its position may be past what the ledger recorded: replaced
    and recovered, as an invalidated one) unless the group's reader takes it (``slot_wal_status``: its own)."""
    row = conn.execute(
        """select confirmed_flush_lsn::text, wal_status,
                  coalesce((pg_catalog.to_jsonb(s) operator(pg_catalog.->>) 'synced')::boolean, false)
                      and not pg_catalog.pg_is_in_recovery(),
                  pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), restart_lsn)::bigint, active
           from pg_catalog.pg_replication_slots s
           where slot_name = %s and database = pg_catalog.current_database()""",
        [slot]).fetchone()
    if row is None:
        return None
    return {"confirmed_flush_lsn": row[0], "wal_status": "lost" if row[2] else row[1], "slot_wal_status": row[1],
            "synced": bool(row[2]), "retained_bytes": row[3], "active": row[4]}


#: the WAL timeline this server writes on, in SQL (a primary's only: it fails during recovery)
TIMELINE_SQL = ("('x' operator(pg_catalog.||) pg_catalog.substr(pg_catalog.pg_walfile_name("
                "pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::pg_catalog.bit(32)::pg_catalog.int4")


def current_timeline(conn: psycopg.Connection) -> int:
    """The WAL timeline this server writes on (a promotion starts a new one; an event id carries it)."""
    row = conn.execute(f"select {TIMELINE_SQL}").fetchone()
    assert row is not None
    return int(row[0])


#: the bits of an event id below its timeline's (sql/031_event_ids_per_timeline.sql)
TIMELINE_SHIFT = 48


def timeline_floor(conn: psycopg.Connection) -> int:
    """The first event id of this server's timeline: the ids below it were written on a former primary."""
    return (current_timeline(conn) - 1) << TIMELINE_SHIFT


def slot_database(conn: psycopg.Connection, slot: str) -> str | None:
    """The database of the cluster's slot named ``slot``, if it is another database's (slot names are the
    cluster's: ``pg_create_logical_replication_slot`` would fail with "already exists")."""
    row = conn.execute("select database from pg_catalog.pg_replication_slots where slot_name = %s "
                       "and database is distinct from pg_catalog.current_database()", [slot]).fetchone()
    return None if row is None else str(row[0] or "(a physical slot)")


class SlotCreationWaits(RuntimeError):
    """Creating a slot waited ``wait_secs`` for transactions that were running to end (Postgres needs a
    point where none is): one line naming their backends. Nothing was created; try again later."""


def create_slot(conn: psycopg.Connection, slot: str, *, wait_secs: float | None = None) -> str:
    """Create the pgoutput slot (outside a transaction that wrote); its consistent point. Waits for running
    transactions to end: with ``wait_secs`` at most that long, then :class:`SlotCreationWaits`."""
    # a failover slot (17+): a primary's synchronized_standby_slots holds decoding until the standby has the WAL
    failover = ", failover => true" if conn.info.server_version >= 170000 else ""
    query = f"select lsn::text from pg_catalog.pg_create_logical_replication_slot(%s, 'pgoutput'{failover})"  # noqa: S608
    if wait_secs is None:
        row = conn.execute(query, [slot]).fetchone()
    else:
        try:
            with conn.transaction():
                conn.execute("select pg_catalog.set_config('statement_timeout', %s, true)",
                             [f"{max(1, int(wait_secs * 1000))}ms"])
                row = conn.execute(query, [slot]).fetchone()
        except psycopg.errors.QueryCanceled:
            holders = conn.execute(
                "select l.pid, coalesce(a.usename::pg_catalog.text, '?') from pg_catalog.pg_locks l "
                "left join pg_catalog.pg_stat_activity a on a.pid operator(pg_catalog.=) l.pid "
                "where l.locktype operator(pg_catalog.=) 'transactionid' and l.granted "
                "and l.mode operator(pg_catalog.=) 'ExclusiveLock' "
                "and l.pid operator(pg_catalog.<>) pg_catalog.pg_backend_pid() order by 1").fetchall()
            named = ", ".join(f"{pid} (role {role})" for pid, role in holders) or "none left"
            raise SlotCreationWaits(f"creating replication slot {slot} waited {wait_secs:g} s for transactions that "
                                    f"were running to end (backends {named}); it is tried again at the next "
                                    "tick") from None
    assert row is not None
    return str(row[0])


#: messages (and bytes of them) of a peek decoded at a time
PEEK_CHUNK = 1_000
PEEK_CHUNK_BYTES = 2**20


def peek_rows(conn: psycopg.Connection, slot: str, publication: str,
              max_changes: int, *, keep_stream: bool = False) -> tuple[list[Transaction], int]:
    """Committed transactions waiting in the slot, in commit order (not consumed), and the number of decoded
    messages (fewer than ``max_changes``: the end of what was committed was reached); ``keep_stream``: each
    event's stream id."""
    decoder, txns, count = PgOutputDecoder(keep_stream=keep_stream), list[Transaction](), 0
    chunk: list[bytes] = []
    size = 0
    # a row at a time, decoded in chunks as they come: the publication carries each event's payload (for the group
    # run's reader), and this process holds a chunk of at most PEEK_CHUNK messages or bytes, not the whole peek
    with conn.cursor(binary=True) as cur:
        for (data,) in cur.stream("select data from pg_catalog.pg_logical_slot_peek_binary_changes(%s, null, %s, "
                                  "'proto_version', '1', 'publication_names', %s)", [slot, max_changes, publication]):
            chunk.append(data)
            size += len(data)
            if len(chunk) >= PEEK_CHUNK or size >= PEEK_CHUNK_BYTES:
                count += len(chunk)
                txns += decoder.decode(chunk)  # (empty transactions are kept: they still move the slot forward)
                chunk, size = [], 0
    count += len(chunk)
    txns += decoder.decode(chunk)
    return txns, count


def drop_slot(conn: psycopg.Connection, slot: str) -> None:
    conn.execute("select pg_catalog.pg_drop_replication_slot(slot_name) from pg_catalog.pg_replication_slots "
                 "where slot_name = %s and database = pg_catalog.current_database()", [slot])


def advance(conn: psycopg.Connection, slot: str, lsn: int) -> None:
    """Release WAL up to ``lsn`` (an end LSN of a recorded transaction)."""
    conn.execute("select pg_catalog.pg_replication_slot_advance(%s, %s::pg_lsn)", [slot, int_to_lsn(lsn)])


def flush_lsn(conn: psycopg.Connection) -> int:
    """The WAL position flushed now: a peek that starts later sees every commit before it."""
    # fetchone() is typed optional; a select without from returns one row
    (lsn,) = conn.execute("select pg_catalog.pg_current_wal_flush_lsn()::text").fetchone()  # type: ignore[misc]
    return lsn_to_int(str(lsn))


def advance_at_least(conn: psycopg.Connection, slot: str, lsn: int) -> None:
    """Advance the slot to ``lsn`` unless it is there already (after a peek that found nothing)."""
    conn.execute("select pg_catalog.pg_replication_slot_advance(slot_name, %s::pg_lsn) "
                 "from pg_catalog.pg_replication_slots where slot_name = %s "
                 "and database = pg_catalog.current_database() and confirmed_flush_lsn < %s::pg_lsn",
                 [int_to_lsn(lsn), slot, int_to_lsn(lsn)])

