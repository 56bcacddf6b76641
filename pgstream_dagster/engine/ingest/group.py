"""A reader group's reader: one slot and publication for several streams, the WAL decoded once for all
(docs/architecture.md, "One reader per database"). :func:`consume_group` (a sensor tick, a group run's reader
call): **ensure** (:func:`ensure_group`: members, publication, a usable slot, a lost one replaced and recovered
from ``pgstream.events``), **join** (:func:`join_members`: a member drains its own slot to its join position,
then drops it; the group's slot waits meanwhile), **record** (:class:`~.recorder.Recorder`, over a peek or a
kept :class:`GroupStream`): each transaction split by stream, recorded and handed over in one transaction."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import psycopg

from ...config import StreamConfig, recording_stand_in
from .. import limits, replication, walstream
from ..handoff import Handoff
from ..ledger import groups, recording
from ..replication import Transaction
from ..runlog import Log
from .recorder import FOLLOW_CHECK_SECS, Batching, Recorder, StreamLedger, record_pass
from .source import PeekSource, StreamSource

#: how long creating the group's slot waits for running transactions (then ``replication.SlotCreationWaits``)
SLOT_CREATION_WAIT_SECS = 5.0
#: a joining member: how long a tick waits for the transactions running when its join began
JOIN_WAIT_SECS = 2.0
#: how often the group's slot is peeked again while nothing waits
POLL_SECS = 0.1


@dataclass
class GroupResult:
    """What a tick of the group's reader did."""

    slot: str | None = None
    slot_created: bool = False
    slot_lost: bool = False
    publication: str | None = None  # 'created' (it was missing), 'altered' (the members changed)
    recovered: dict[int, list[int]] = field(default_factory=dict)  # stream -> recovery batches
    joined: list[int] = field(default_factory=list)  # members that finished joining this tick
    joining: list[int] = field(default_factory=list)  # members still handing over
    batches: dict[int, list[int]] = field(default_factory=dict)
    events: dict[int, int] = field(default_factory=dict)
    unreadable: int = 0
    slot_busy: bool = False
    #: members whose registration was refused (stream -> its one line, also in ``notes``): not read
    left_out: dict[int, str] = field(default_factory=dict)
    #: members whose streams[] entry is invalid or missing: recorded, delivered by no run (stream -> its line)
    unconfigured: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, later: GroupResult) -> None:
        """What a later read of the same tick did, added to this one."""
        self.slot = later.slot or self.slot
        self.slot_created |= later.slot_created
        self.slot_lost |= later.slot_lost
        self.publication = later.publication or self.publication
        for sid, ids in later.recovered.items():
            self.recovered.setdefault(sid, []).extend(ids)
        self.joined.extend(later.joined)
        self.joining = later.joining
        for sid, ids in later.batches.items():
            self.batches.setdefault(sid, []).extend(ids)
        for sid, n in later.events.items():
            self.events[sid] = self.events.get(sid, 0) + n
        self.unreadable += later.unreadable
        self.slot_busy |= later.slot_busy
        self.left_out.update(later.left_out)
        self.notes.extend(later.notes)

    def count(self, stream_id: int, target: StreamLedger) -> None:
        """What the loop recorded into ``target``, stream ``stream_id``'s ledger."""
        if target.batches:
            self.batches.setdefault(stream_id, []).extend(target.batches)
            self.events[stream_id] = self.events.get(stream_id, 0) + target.events
        self.unreadable += target.unreadable


def route(members: set[int]) -> Callable[[list[Transaction]], dict[int, list[Transaction]]]:
    """Split each transaction by its events' stream: a transaction touching two members becomes one
    transaction of each (same xid and positions), recorded in both in the same ledger transaction."""

    def split(txns: list[Transaction]) -> dict[int, list[Transaction]]:
        out: dict[int, list[Transaction]] = {}
        for t in txns:
            parts: dict[int, Transaction] = {}
            for e in t.events:
                if e.stream_id in members:
                    _part(parts, t, e.stream_id).events.append(e)
            for u in t.unreadable:
                if u.stream_id in members:
                    _part(parts, t, u.stream_id).unreadable.append(u)
            for sid, part in parts.items():
                out.setdefault(sid, []).append(part)
        return out

    return split


def _part(parts: dict[int, Transaction], t: Transaction, stream_id: int) -> Transaction:
    """Stream ``stream_id``'s part of transaction ``t`` in ``parts`` (made at its first event)."""
    found = parts.get(stream_id)
    if found is None:
        found = parts[stream_id] = Transaction(t.xid, t.commit_lsn, t.end_lsn, t.commit_time)
    return found


def _past(until: float) -> Callable[[], bool]:
    return lambda: time.monotonic() > until


def unconfigured(state: groups.Group, streams: list[StreamConfig], invalid: Mapping[int, str]) -> dict[int, str]:
    """The members the database has in the group that ``streams`` does not deliver, each with its one line:
    its entry is invalid (``invalid``), or missing (removed, or added by a configuration not loaded yet)."""
    configured = {s.id for s in streams}
    lines: dict[int, str] = {}
    for m in state.members:
        if m.id in configured:
            continue
        if m.id in invalid:
            lines[m.id] = (f"reader group {state.name}: stream {m.id} is left out of delivery, its streams[] entry "
                           f"is invalid ({invalid[m.id]}): its events are recorded and wait until it is fixed")
        else:
            lines[m.id] = (f"reader group {state.name}: stream {m.id} is in the group in the database but has no "
                           f"streams[] entry with reader: {state.name} in pgstream.yaml: its events are recorded "
                           f"and wait (configure it again and reload the code location, or retire it: its row "
                           f"in pgstream.streams deleted by the owner)")
    return lines


def ensure_group(conn: psycopg.Connection, group: str, streams: list[StreamConfig],
                 result: GroupResult, invalid: Mapping[int, str] | None = None) -> groups.Group | None:
    """Register the members, keep the publication on them and the slot usable (replaced and recovered when lost);
    a refused member is left out in one line (``None``: all were); an :func:`unconfigured` one is recorded as a
    stand-in (:func:`~...config.recording_stand_in`: nothing of it is lost, no run delivers it), told in notes."""
    # one query when every member is registered (each tick, each pass of the group run's reader)
    _added, refused = groups.register_missing_members(conn, group, [s.id for s in streams])
    if refused:
        result.left_out.update(refused)
        result.notes.extend(refused.values())
        streams = [s for s in streams if s.id not in refused]
        if groups.group_state(conn, group) is None:
            return None
    result.publication = groups.ensure_group_publication(conn, group)
    state = groups.group_state(conn, group)
    assert state is not None  # registered above
    lines = unconfigured(state, streams, invalid or {})
    result.unconfigured.update(lines)
    result.notes.extend(lines.values())
    streams = streams + [recording_stand_in(sid, group) for sid in lines]
    result.slot = state.slot
    joined = [m for m in state.members if m.joined]
    if result.publication == "created":
        # decoding skips what committed while the publication was missing: recovered from the table
        groups.set_group_recovery_pending(conn, group, True)
    info = replication.slot_info(conn, state.slot)
    # a former primary's slot of that name, kept through a switchover and pg_rewind: not the one recorded through
    stale = info is not None and state.slot_lsn is not None and info["confirmed_flush_lsn"] is not None \
        and replication.lsn_to_int(str(info["confirmed_flush_lsn"])) < state.slot_lsn
    if info is not None and stale:
        result.notes.append(f"reader group {group}: replication slot {state.slot} is behind the point the group's "
                            f"slot was created at ({replication.int_to_lsn(state.slot_lsn or 0)}): a former "
                            "primary's, kept through a switchover; replaced, and every member recovers from "
                            "pgstream.events")
        info["wal_status"] = "lost"
    elif info is not None and info["synced"]:
        _take_synchronized(conn, group, state, info, result)
    pending = state.recovery_pending or result.publication == "created"
    if info is not None and info["wal_status"] != "lost" and not pending:
        return state
    if info is None and (elsewhere := replication.slot_database(conn, state.slot)) is not None:
        raise groups.GroupChange(f"reader group {group}: replication slot {state.slot} belongs to database "
                                 f"{elsewhere}, not to this one: drop it there if nothing reads it")
    # crash-safe: pending first, cleared once every member recovered
    groups.set_group_recovery_pending(conn, group, True)
    for m in joined:
        recording.set_recovery_pending(conn, m.id)
    if info is not None and info["wal_status"] == "lost":
        replication.drop_slot(conn, state.slot)
        result.slot_lost = not stale  # (a stale one is told in notes)
        info = None
    if info is None:
        try:
            created_at = replication.create_slot(conn, state.slot, wait_secs=SLOT_CREATION_WAIT_SECS)
        except psycopg.errors.ConfigurationLimitExceeded:  # all replication slots are in use
            raise limits.LimitsExceeded([limits.group_slot_problem(conn, group) or (
                f"reader group {group}: no replication slot is free; raise max_replication_slots in "
                "postgresql.conf and restart Postgres")]) from None
        groups.set_group_slot(conn, group, replication.current_timeline(conn), created_at)
        result.slot_created = True
    by_id = {s.id: s for s in streams}
    for m in joined:
        result.recovered[m.id] = recording.recover_from_table(conn, m.id, by_id[m.id].batch.max_size)
    groups.set_group_recovery_pending(conn, group, False)
    return groups.group_state(conn, group) or state


def _take_synchronized(conn: psycopg.Connection, group: str, state: groups.Group, info: dict[str, object],
                       result: GroupResult) -> None:
    """A promoted standby's synchronized copy of the group's slot (a failover slot, 17+) is used, ``info`` made its
    own, when the ledger was recorded through its position (nothing before it is missing from the ledger) or it
    was taken on this timeline already; else it stays ``lost`` (replaced and recovered from the table)."""
    timeline = replication.current_timeline(conn)
    confirmed = info["confirmed_flush_lsn"]
    if state.slot_timeline != timeline:
        if confirmed is None or state.recorded_through is None \
                or replication.lsn_to_int(str(confirmed)) > state.recorded_through:
            return
        groups.set_group_slot(conn, group, timeline)
        result.notes.append(f"reader group {group}: took the failover slot {state.slot} the promoted standby "
                            f"synchronized (at {confirmed}, within what the ledger recorded: "
                            f"{replication.int_to_lsn(state.recorded_through)}); nothing is recovered from the table")
    info["wal_status"] = info["slot_wal_status"]


def _running_xids(conn: psycopg.Connection) -> list[int]:
    return [int(r[0]) for r in conn.execute(
        "select pg_catalog.pg_snapshot_xip(pg_catalog.pg_current_snapshot())::pg_catalog.text::pg_catalog.int8")]


def _wait_ended(conn: psycopg.Connection, xids: list[int], until: float) -> bool:
    """Whether every transaction of ``xids`` has ended (committed or aborted) before ``until``."""
    while xids:
        row = conn.execute("select coalesce(pg_catalog.array_agg(x), '{}') "
                           "from pg_catalog.unnest(%s::pg_catalog.int8[]) x "
                           "where pg_catalog.pg_xact_status(x::pg_catalog.text::pg_catalog.xid8) "
                           "operator(pg_catalog.=) 'in progress'", [xids]).fetchone()
        xids = [int(x) for x in (row[0] if row else [])]
        if not xids:
            return True
        if time.monotonic() > until:
            return False
        time.sleep(0.02)
    return True


def _drain(conn: psycopg.Connection, stream: StreamConfig, member: groups.Member, group: str, join_lsn: int,
           until: float, result: GroupResult) -> bool:
    """Record the member's transactions that end at or before its join position from its own slot
    (with the group's reader as its declared reader); true once every one is recorded."""
    info = replication.slot_info(conn, member.own_slot)
    if info is None or info["wal_status"] == "lost":
        # nothing to drain (a new stream, or its slot was lost): what it has is recorded from the table
        recording.set_recovery_pending(conn, stream.id)
        result.recovered[stream.id] = recording.recover_from_table(conn, stream.id, stream.batch.max_size)
        return True
    source = PeekSource(conn, member.own_slot, stream.publication, max(stream.batch.max_size * 4, 100_000))
    target = StreamLedger(stream, groups.group_reader(group), run_key=member.open_run_key)
    try:
        while True:
            txns = source.read(0)
            mine = [t for t in txns if t.end_lsn <= join_lsn]
            if mine:
                if record_pass(conn, {stream.id: target}, {stream.id: mine}, give_up=_past(until)):
                    return False  # not the declared reader (cannot happen once begin_join ran)
                source.confirm(mine[-1].end_lsn)
            if len(mine) < len(txns) or (source.drained and source.flushed >= join_lsn):
                # drained to L: its slot says so (finish_join checks it)
                replication.advance_at_least(conn, member.own_slot, join_lsn)
                break
            if time.monotonic() > until:
                return False
            if source.drained:
                time.sleep(0.02)  # the WAL up to the join position is being flushed
    except walstream.SlotBusy:
        result.notes.append(f"stream {stream.id}: its own slot {member.own_slot} is still held by its earlier reader "
                            "(a reader of the version before lets go within a second); the join goes on at the next "
                            "tick")
        return False
    except recording.NotVisibleYet:
        return False
    finally:
        result.count(stream.id, target)
    return True


def _drop_own_slot(conn: psycopg.Connection, slot: str) -> None:
    """A joined member's own slot goes (an earlier reader's connection may still hold it a moment: the
    next tick drops it)."""
    with contextlib.suppress(psycopg.errors.ObjectInUse, psycopg.errors.UndefinedObject):
        conn.execute("select pg_catalog.pg_drop_replication_slot(slot_name) from pg_catalog.pg_replication_slots "
                     "where slot_name operator(pg_catalog.=) %s and database operator(pg_catalog.=) "
                     "pg_catalog.current_database() and not active", [slot])


def join_members(conn: psycopg.Connection, group: str, state: groups.Group, streams: dict[int, StreamConfig],
                 until: float, result: GroupResult) -> bool:
    """Hand every member that still had its own slot over to the group (see the module); true once every
    member has joined. Also drops a joined member's own slot left behind."""
    for m in state.members:
        if m.joined:
            _drop_own_slot(conn, m.own_slot)
    joining = [m for m in state.members if not m.joined]
    if not joining:
        return True
    # a transaction running now may have written before the publication included them (and be incomplete in
    # the group's slot); once all have ended, every one ending after the join position wrote after it
    if any(not m.join_begun for m in joining) and \
            not _wait_ended(conn, _running_xids(conn), min(until, time.monotonic() + JOIN_WAIT_SECS)):
        result.joining = [m.id for m in joining]
        result.notes.append(f"reader group {group}: stream(s) {', '.join(str(m.id) for m in joining)} wait for "
                            "transactions older than the publication's change to end before joining")
        return False
    done = True
    for m in joining:
        if m.join_begun and m.join_lsn is not None:
            join_lsn = m.join_lsn
        else:
            try:
                join_lsn = groups.begin_join(conn, m.id, group)
            except psycopg.errors.ObjectNotInPrerequisiteState as exc:  # (the owner's check of the wait above)
                result.notes.append(str(exc.diag.message_primary or exc).removeprefix("pgstream: "))
                result.joining.append(m.id)
                done = False
                continue
        if _drain(conn, streams[m.id], m, group, join_lsn, until, result):
            groups.finish_join(conn, m.id, group)
            _drop_own_slot(conn, m.own_slot)
            result.joined.append(m.id)
        else:
            result.joining.append(m.id)
            done = False
    return done


class GroupStream:
    """The group's slot over the replication protocol (a :class:`~.source.StreamSource` and its recording loop),
    kept across :func:`consume_group` calls until the slot, connection or members change or :meth:`close`;
    ``handoff``: where what it records for the members the group run hosts goes in memory (their runs take it)."""

    def __init__(self, database_url: str, application_name: str, handoff: Handoff | None = None) -> None:
        self.database_url, self.application_name, self.handoff = database_url, application_name, handoff
        self.source: StreamSource | None = None
        self._recorder: Recorder | None = None
        self._key: tuple[str, str, frozenset[int]] | None = None
        #: when the loop last moved the slot past what was all received (``skip_idle``; monotonic)
        self.checked_at = 0.0

    def recorder(self, conn: psycopg.Connection, group: str, slot: str, ledgers: dict[int, StreamLedger],
                 rule: Batching) -> Recorder:
        """The recording loop over the group's slot into ``ledgers`` (this call's: what they record is
        counted in them) on ``conn``: the open one, or a new one over a new replication connection."""
        key = (slot, groups.group_publication(group), frozenset(ledgers))
        recorder = self._recorder
        if recorder is None or recorder.conn is not conn or key != self._key:
            self.close()
            self.source = StreamSource(self.database_url, slot, key[1], self.application_name,
                                       max_bytes=rule.max_bytes, keep_stream=True, keep_rows=self.handoff is not None)
            recorder = self._recorder = Recorder(
                conn, self.source, ledgers, rule, standby=self.application_name, route=route(set(ledgers)),
                recorded_through=lambda c, lsn: groups.record_group_through(c, group, lsn))
            self._key = key
            self.checked_at = 0.0
        recorder.ledgers = ledgers
        return recorder

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        self.source = self._recorder = self._key = None


def _record(conn: psycopg.Connection, group: str, recorder: Recorder, ledgers: dict[int, StreamLedger],
            until: float, result: GroupResult) -> bool:
    """Record what waits, handed to each member's open run in the same transaction; false when nothing was
    (not visible by ``until``, or a member's reader is no longer the group's: ``result.slot_busy``)."""
    # each member's open run, read at each pass: what is recorded is handed to it (not a stand-in's: no run of
    # this configuration delivers it, and its key is a run that ended without closing, its group run killed)
    for sid, run_key in groups.open_run_keys(conn, group).items():
        if sid in ledgers and ledgers[sid].stream.sink is not None:
            ledgers[sid].run_key = run_key
    try:
        if not recorder.record(give_up=_past(until)):
            result.slot_busy = True  # a member's reader is no longer the group's (cannot happen)
            return False
    except recording.NotVisibleYet:
        return False  # nothing recorded, the slot not advanced: read again (kept, or from the slot)
    return True


def consume_group(conn: psycopg.Connection, group: str, streams: list[StreamConfig], budget_secs: float, *,
                  kept: GroupStream | None = None, invalid: Mapping[int, str] | None = None,
                  stop: Callable[[], bool] | None = None) -> GroupResult:
    """A tick of the group's reader (see the module) for every member until ``budget_secs`` is spent (``0``:
    one look). ``kept``: the replication connection kept across calls (the group run's reader), else a peek;
    closed when a member drains its own slot, the slot is busy or lost, or on an error. ``invalid``: entries
    the code location left out (:func:`ensure_group`). ``stop``: true once the reader ends (back in 0.5 s)."""
    result, keep = GroupResult(), False
    try:
        keep = _consume_group(conn, group, streams, budget_secs, kept, invalid or {}, stop, result)
    finally:
        if kept is not None and not keep:
            kept.close()
    return result


def _consume_group(conn: psycopg.Connection, group: str, streams: list[StreamConfig], budget_secs: float,
                   kept: GroupStream | None, invalid: Mapping[int, str], stop: Callable[[], bool] | None,
                   result: GroupResult) -> bool:
    """:func:`consume_group` into ``result``; whether ``kept`` stays open."""
    started = time.monotonic()
    deadline = started + budget_secs
    until = max(deadline, started + 1.0)  # how long a recording waits for its transactions to be visible
    state = ensure_group(conn, group, streams, result, invalid)
    if state is None:
        return False  # every member is left out
    # (read without those left out: tried again next time; with those whose entry is invalid or missing: recorded)
    streams = [s for s in streams if s.id not in result.left_out] + [
        recording_stand_in(sid, group) for sid in result.unconfigured]
    by_id = {s.id: s for s in streams}
    joined_all = join_members(conn, group, state, by_id, until, result)
    state = groups.group_state(conn, group) or state  # (who has joined now: they are read from here on)
    if not joined_all and any(m.join_begun and not m.joined for m in state.members):
        return False  # one is draining its own slot: the group's slot waits (the stream's order)
    # a member that waits for older transactions to end is not read here: what of it the group's slot holds
    # ends before its join position (its own slot, or for a new stream the table, gives it)
    reader = groups.group_reader(group)
    joined = {m.id for m in state.members if m.joined}
    # what the group run's reader records for a member it hosts (not one in mode per_batch, nor a stand-in) is
    # handed to the member's run in memory as well
    handoff = kept.handoff if kept is not None else None
    ledgers = {sid: StreamLedger(s, reader, handoff=handoff if s.sink is not None and s.delivery.keeps_open else None)
               for sid, s in by_id.items() if sid in joined}
    if not ledgers:
        return False

    marked = 0.0

    def seen(through: dt.datetime | None) -> None:
        nonlocal marked
        if through is not None and time.monotonic() - marked >= 1.0:
            marked = time.monotonic()
            groups.mark_group_consumed(conn, group, through)
            groups.mark_members_consumed(conn, group, through)

    try:
        if kept is not None:
            _follow_group(conn, group, kept, kept.recorder(conn, group, state.slot, ledgers, Batching.of(streams)),
                          ledgers, deadline, until, result, seen, stop)
        else:
            _peek_group(conn, group, streams, state.slot, ledgers, deadline, until, result, seen)
    except walstream.SlotBusy:
        result.slot_busy = True
    except walstream.SlotGone:
        groups.set_group_recovery_pending(conn, group, True)  # the next tick replaces it and recovers
        result.slot_lost = True
    for sid, target in ledgers.items():
        result.count(sid, target)
    return not (result.slot_busy or result.slot_lost)


def _peek_group(conn: psycopg.Connection, group: str, streams: list[StreamConfig], slot: str,
                ledgers: dict[int, StreamLedger], deadline: float, until: float, result: GroupResult,
                seen: Callable[[dt.datetime | None], None]) -> None:
    """The group's sensor: peek the group's slot every :data:`POLL_SECS` until ``deadline``."""
    source = PeekSource(conn, slot, groups.group_publication(group),
                        max(max(s.batch.max_size for s in streams) * 4, 100_000), keep_stream=True)
    recorder = Recorder(conn, source, ledgers, Batching.of(streams), route=route(set(ledgers)),
                        recorded_through=lambda c, lsn: groups.record_group_through(c, group, lsn))
    while True:
        recorder.read(0)
        if recorder.pending.txns and recorder.due():
            if not _record(conn, group, recorder, ledgers, until, result):
                break
            if not source.drained and time.monotonic() < deadline:
                continue  # more waits behind the peek's cap
            seen(source.seen_through)
        elif not recorder.pending.txns:
            seen(source.skip_idle(conn))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(max(recorder.until_due(POLL_SECS), 0.005), remaining))


def _follow_group(conn: psycopg.Connection, group: str, kept: GroupStream, recorder: Recorder,
                  ledgers: dict[int, StreamLedger], deadline: float, until: float, result: GroupResult,
                  seen: Callable[[dt.datetime | None], None], stop: Callable[[], bool] | None = None) -> None:
    """A group delivery run's reader: what the server sends until ``deadline`` or ``stop()`` (what is not
    recorded by then waits in ``kept``), moving the slot past other tables' WAL once a second when idle."""
    source = kept.source
    assert source is not None
    while True:
        remaining = deadline - time.monotonic()
        recorder.read(max(0.0, min(recorder.until_due(0.5), remaining)))
        if recorder.due() and not _record(conn, group, recorder, ledgers, until, result):
            break
        now = time.monotonic()
        if not recorder.pending.txns and not source.in_transaction and now - kept.checked_at >= FOLLOW_CHECK_SECS:
            # every transaction that committed before the server's position has been received and recorded
            kept.checked_at = now
            seen(source.skip_idle(conn))
        if now >= deadline or (stop is not None and stop()):
            break


def group_log(log: Log, group: str, result: GroupResult, *, batches: bool = True,
              noted: set[str] | None = None) -> None:
    """What a pass of the group's reader did that an operator should see; the group run's reader passes
    ``batches`` False (no batches listed) and ``noted``, the notes it logged last pass (updated)."""
    if result.slot_lost:
        log.warning(f"reader group {group}: slot {result.slot} was invalidated (WAL limit) or dropped; "
                    "replaced, and every member recovers undelivered events from pgstream.events")
    if result.publication == "created" and not result.slot_created:  # (a new group creates both)
        log.warning(f"reader group {group}: its publication was missing (dropped by hand?) and was created "
                    "again; events committed meanwhile are recovered from pgstream.events")
    if result.slot_created:
        recovered = sum(len(b) for b in result.recovered.values())
        log.info(f"reader group {group}: created slot {result.slot}; recovered {recovered} batches from the table")
    for sid in result.joined:
        log.info(f"reader group {group}: stream {sid} joined (its own slot, if it had one, drained and dropped)")
    for sid, recorded in sorted(result.batches.items()):
        if recorded and batches:
            log.info(f"stream {sid}: recorded batches {recorded} ({result.events.get(sid, 0)} events)")
    if result.unreadable:
        log.error(f"reader group {group}: {result.unreadable} events could not be recorded and were set aside "
                  "as dead letters (stage 'read')")
    for line in dict.fromkeys(result.notes):  # (a tick's reads may note the same line)
        if noted is None or line not in noted:
            log.warning(line)
    if noted is not None:
        noted.clear()
        noted.update(result.notes)
