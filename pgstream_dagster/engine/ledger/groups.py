"""Reader groups (``pgstream.reader_groups``): streams sharing one slot and publication (:mod:`..ingest.group`).
Membership, the publication and a hand-over go through the owner's functions (sql/repeatable/27_reader_groups.sql);
the runtime writes only how far the group read and recorded."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import psycopg

from ..replication import PublicationTaken

GROUP_PREFIX = "group:"  # a member's declared reader: ``group:<name>`` (streams.slot_reader)


def group_reader(group: str) -> str:  # the declared reader of its members once they have joined
    return f"{GROUP_PREFIX}{group}"


def group_publication(group: str) -> str:  # (pgstream.group_publication_name)
    return f"pgstream_group_{group}"


class GroupChange(RuntimeError):
    """A stream was to leave or change its reader group (not supported), or the group's publication name is taken."""


def _refused(exc: psycopg.Error) -> GroupChange:
    return GroupChange((exc.diag.message_primary or str(exc)).removeprefix("pgstream: "))


def register_group_member(conn: psycopg.Connection, stream_id: int, group: str) -> str:
    """The stream reads with ``group`` (a new row joins at once); the group's slot. :class:`GroupChange`: refused."""
    try:
        with conn.transaction():
            row = conn.execute("select pgstream.register_group_member(%s, %s)", [stream_id, group]).fetchone()
    except psycopg.errors.FeatureNotSupported as exc:
        raise _refused(exc) from None
    except psycopg.errors.DuplicateObject as exc:  # a new stream row: its publication's name is another role's
        raise PublicationTaken.of(exc) from None
    assert row is not None
    return str(row[0])


def register_missing_members(conn: psycopg.Connection, group: str,
                             stream_ids: list[int]) -> tuple[list[int], dict[int, str]]:
    """Register the streams not yet in ``group``; those registered, and those refused with their one line."""
    known = {int(r[0]) for r in conn.execute("select id from pgstream.streams where reader_group = %s", [group])}
    added: list[int] = []
    refused: dict[int, str] = {}
    for stream_id in (i for i in stream_ids if i not in known):
        try:
            register_group_member(conn, stream_id, group)
            added.append(stream_id)
        except (GroupChange, PublicationTaken) as exc:
            why = str(exc).removeprefix(f"stream {stream_id}: ")
            refused[stream_id] = f"reader group {group}: stream {stream_id} is left out: {why}"
    return added, refused


@dataclass(frozen=True)
class Member:  # a stream of a group, as the database has it
    id: int
    slot_reader: str
    join_lsn: int | None  # while it hands over from its own slot (pgstream.begin_join); 0: a new stream
    own_slot: str  # streams.slot: its own slot, read before it joined
    open_run_key: str | None

    @property
    def joined(self) -> bool:
        return self.slot_reader.startswith(GROUP_PREFIX) and self.join_lsn is None

    @property
    def join_begun(self) -> bool:
        """``begin_join`` set its join position (a new stream starts with ``0/0``: not begun)."""
        return self.slot_reader.startswith(GROUP_PREFIX) and bool(self.join_lsn)


@dataclass(frozen=True)
class Group:
    name: str
    slot: str
    recovery_pending: bool
    recorded_through: int | None
    members: list[Member]
    slot_lsn: int | None = None  # where the group's slot was created (None: not known, before migration 033)
    #: the timeline it was created or taken on (migration 034: a synchronized copy promoted later is decided again)
    slot_timeline: int | None = None


def group_state(conn: psycopg.Connection, group: str) -> Group | None:
    """The group's row and its members (``None``: no such group yet)."""
    row = conn.execute("select slot, recovery_pending, (recorded_through - '0/0')::bigint, (slot_lsn - '0/0')::bigint, "
                       "slot_timeline from pgstream.reader_groups where name = %s", [group]).fetchone()
    if row is None:
        return None
    members = [Member(int(r[0]), str(r[1]), r[2], str(r[3]), r[4])  # (bigint: an int or None)
               for r in conn.execute("select id, slot_reader, (join_lsn - '0/0')::bigint, slot, open_run_key "
                                     "from pgstream.streams where reader_group = %s order by id", [group])]
    return Group(group, str(row[0]), bool(row[1]), row[2], members, row[3], row[4])


def ensure_group_publication(conn: psycopg.Connection, group: str) -> str | None:
    """The group's publication exists and filters on its members: ``'created'``, ``'altered'`` or ``None``
    (:class:`GroupChange`: its name is another publication's)."""
    try:
        with conn.transaction():
            row = conn.execute("select pgstream.ensure_group_publication(%s)", [group]).fetchone()
    except psycopg.errors.DuplicateObject as exc:  # a publication by its name that is not the group's
        raise _refused(exc) from None
    return None if row is None or row[0] is None else str(row[0])


def begin_join(conn: psycopg.Connection, stream_id: int, group: str) -> int:
    """The joining member hands over: its join position L. Refused (``ObjectNotInPrerequisiteState``) while a
    transaction older than the publication's last change runs."""
    with conn.transaction():
        row = conn.execute("select (pgstream.begin_join(%s, %s) operator(pg_catalog.-) '0/0')::bigint",
                           [stream_id, group]).fetchone()
    assert row is not None and row[0] is not None
    return int(row[0])


def finish_join(conn: psycopg.Connection, stream_id: int, group: str) -> None:
    """The stream's own slot was drained to its join position, or is gone (recovered from the table)."""
    conn.execute("select pgstream.finish_join(%s, %s)", [stream_id, group])


def set_group_recovery_pending(conn: psycopg.Connection, group: str, pending: bool) -> None:
    conn.execute("update pgstream.reader_groups set recovery_pending = %s where name = %s", [pending, group])


def set_group_slot(conn: psycopg.Connection, group: str, timeline: int, lsn: str | None = None) -> None:
    """The group's slot was created at ``lsn`` (migration 033: a slot of its name behind it is another's) on
    ``timeline``, or (no ``lsn``) a synchronized copy of it was taken on ``timeline`` (migration 034)."""
    conn.execute("update pgstream.reader_groups set slot_lsn = coalesce(%s::pg_lsn, slot_lsn), slot_timeline = %s "
                 "where name = %s", [lsn, timeline, group])


def record_group_through(conn: psycopg.Connection, group: str, end_lsn: int) -> None:
    """In a recording transaction: the group's reader recorded through ``end_lsn``."""
    conn.execute("update pgstream.reader_groups set recorded_through = greatest(recorded_through, "
                 "'0/0'::pg_lsn + %s::numeric) where name = %s", [end_lsn, group])


def mark_group_consumed(conn: psycopg.Connection, group: str, through: dt.datetime) -> None:
    """Everything committed before ``through`` has been read from the group's slot."""
    conn.execute("update pgstream.reader_groups set consumed_through = greatest(consumed_through, %s) "
                 "where name = %s", [through, group])


def mark_members_consumed(conn: psycopg.Connection, group: str, through: dt.datetime) -> None:
    """As :func:`mark_group_consumed`, for each joined member (``streams.consumed_through``: partition retention)."""
    conn.execute("update pgstream.streams set consumed_through = greatest(consumed_through, %s) "
                 "where reader_group = %s and slot_reader = 'group:' || reader_group and join_lsn is null "
                 "and consumed_through is distinct from greatest(consumed_through, %s)", [through, group, through])


def open_run_keys(conn: psycopg.Connection, group: str) -> dict[int, str | None]:
    """Each member's open run (the group's reader hands it what it records for the member)."""
    return {int(r[0]): r[1] for r in conn.execute(
        "select id, open_run_key from pgstream.streams where reader_group = %s", [group])}


@dataclass(frozen=True)
class MemberRun:
    """A member's run to host: its launched head's (``batch_id`` .. ``through_batch_id``), or its open run's."""

    stream_id: int
    run_key: str
    batch_id: int | None = None
    through_batch_id: int | None = None


def member_runs(conn: psycopg.Connection, group: str) -> list[MemberRun]:
    """The runs the group's members want hosted now (a launched head, an open run), in stream order."""
    rows = conn.execute(
        """select s.id, s.open_run_key, h.run_key, r.first_id, r.last_id
           from pgstream.streams s
           left join lateral (
               select b.run_key, b.status from pgstream.batches b
               where b.stream_id = s.id and pgstream.batch_is_open(b.status) order by b.id limit 1) h on true
           left join lateral (
               select min(b.id) as first_id, max(b.id) as last_id from pgstream.batches b
               where b.stream_id = s.id and b.run_key = h.run_key and b.status = 'launched') r
               on h.status = 'launched'
           where s.reader_group = %s and not s.paused
           order by s.id""", [group]).fetchall()
    out = []
    for stream_id, open_key, head_key, first, last in rows:
        if head_key is not None and first is not None:
            out.append(MemberRun(int(stream_id), str(head_key), int(first), int(last)))
        elif open_key is not None and head_key is None:
            out.append(MemberRun(int(stream_id), str(open_key)))
    return out


def member_signals(conn: psycopg.Connection, group: str) -> dict[int, tuple[object, ...]]:
    """Per member: paused, its open run, a replay holding or waiting for its lease, its newest launched batch."""
    return {int(r[0]): tuple(r[1:]) for r in conn.execute(
        """select s.id, s.paused, s.open_run_key, pgstream.lock_holder('replay', s.id) is not null,
                  (select max(b.id) from pgstream.batches b
                   where b.stream_id = s.id and b.status <> 'delivered' and b.status = 'launched')
           from pgstream.streams s where s.reader_group = %s""", [group])}
