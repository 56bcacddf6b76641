"""A reader group's delivery run, without Dagster (docs/architecture.md, "Delivery for many streams"): a
:class:`~.run.DeliveryRun` per member in a thread, as the sensor decided, and a reader thread on the group's slot.
It ends after ``max_run_secs``, at :attr:`GroupHost.stop_check`'s reason or a :data:`REFUSALS` of its reader, and
rides a database outage out: its members' runs stop, and are hosted again once the database accepts writes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

import psycopg

from ...config import StreamConfig
from .. import dbconn
from ..handoff import Handoff
from ..ledger import groups, locks, state
from ..limits import LimitsExceeded
from ..replication import PublicationTaken
from ..runlog import Log
from .run import DeliveryRun, Host, LedgerConnectionBroken

POLL_SECS = 1.0  # how often the group run looks at what its members want hosted when no notification woke it
#: the members' reports together, at most this many a second (each is a few writes to Dagster's event log): a
#: member reports every ``max(report_every_secs, members / REPORTS_PER_SEC)`` seconds (100 members: every 20 s)
REPORTS_PER_SEC = 5.0
#: the group run's reader: how long a ``consume_group`` call reads; its waits to claim the reading again
READ_SECS = 5.0
READ_RETRY_SECS = 0.2
READ_EARLY_SECS = 0.5
READ_ERROR_SECS = 5.0
OUTAGE_RETRY_SECS = 0.1  # while the database is away: how often the group run (and its reader) try to connect again
OUTAGE_JOIN_SECS = 5.0  # the database went away: how long the group run waits for its members' runs to stop, at most
#: what the reader cannot get past with the run's configuration: the group run ends with its line as reason
REFUSALS: tuple[type[Exception], ...] = (groups.GroupChange, PublicationTaken, LimitsExceeded)


def handover_lead(max_run_secs: float, run_grace_secs: float) -> float:
    """How long before a group delivery run's ``max_run_secs`` its successor is requested: it starts meanwhile and
    waits for the group's lease, and the run ends once it is up (its members' deliveries pause for a hand-over,
    not for a process to start): ``run_grace_secs`` (how long a run may take to start), half of ``max_run_secs``
    at most."""
    return min(run_grace_secs, max_run_secs / 2)


def _database_gone(exc: BaseException) -> bool:
    """Whether a member's run stopped because the database (or its connection to it) went away, not its sink."""
    return isinstance(exc, LedgerConnectionBroken) or (
        isinstance(exc, psycopg.Error) and dbconn.server_gone(exc) is not None)


def member_run_id(group_run_id: str, stream_id: int) -> str:
    """The run id of a member's delivery run hosted by group run ``group_run_id`` (its delivery lease's holder)."""
    return f"{group_run_id}/{stream_id}"


@dataclass(frozen=True)
class GroupHost:
    """What the group run needs from whoever runs it; its member runs are ``<run_id>/<stream id>``."""

    run_id: str
    log: Log
    #: the host of one member's run (its run id given): log, Spark, reporter, stop check of its own
    member_host: Callable[[StreamConfig, str], Host]
    #: of the member runs ``(stream id, run key)`` wanted, those this group run may host (recorded as its own)
    claim: Callable[[list[tuple[int, str]]], list[tuple[int, str]]] = lambda wanted: wanted
    #: told when a member's run ended: ``error`` None when it closed, else why it failed (one line)
    ended: Callable[[int, str, str | None], None] = lambda _stream_id, _run_key, _error: None
    stop_check: Callable[[], str | None] = lambda: None  # a reason to end only the host knows (asked once a second)
    #: reads the group's slot on the connection given for up to the seconds given and logs what it did, again
    #: and again while the reader holds the group's reading. None: the group's sensor reads
    read: Callable[[psycopg.Connection, float], None] | None = None
    read_ends: Callable[[], None] = lambda: None  # the reader gives the reading up: what ``read`` kept open closes


@dataclass
class GroupDelivery:
    """The delivery run of reader group ``group`` (its members: ``streams``)."""

    group: str
    streams: list[StreamConfig]
    database_url: str
    executor_url: str
    host: GroupHost
    max_run_secs: float
    #: how long a successor waits for the run it takes over from to give the group's lease up (beyond
    #: :func:`handover_lead`) before it fails with :class:`~..ledger.locks.LeaseTaken`
    run_grace_secs: float
    handoff: Handoff | None = None  # what the group's reader records for the members, taken by their runs
    hosted: set[str] = field(default_factory=set)  # every run key taken (or refused) since the last outage
    _members: dict[int, threading.Thread] = field(default_factory=dict)  # (their threads)
    _wake: dict[int, threading.Event] = field(default_factory=dict)  # per member: set when its row moved
    _signals: dict[int, tuple[object, ...]] = field(default_factory=dict)
    _stop_reason: str | None = None  # (set once: the members' runs close)
    _refused: str | None = None  # set by the reader at one of REFUSALS: the group run ends with this line
    _reading_ends: threading.Event = field(default_factory=threading.Event)  # the group run ends: its reader stops
    _connections: locks.SharedConnections = field(init=False)  # the members' (opened by run())
    _outage: str | None = None  # while the database is away: why (one line)
    _interrupted: dict[int, str] = field(default_factory=dict)  # stream id: the run key an outage stopped
    _outage_line: str | None = None  # the last outage's line
    _resumed: int = 0  # how many outages the run rode out

    def run(self) -> str:
        """Host the members' runs until the group run ends; why it ended."""
        by_id = {s.id: s for s in self.streams}
        lease = self._take_lease()
        if isinstance(lease, str):
            return lease
        reader: threading.Thread | None = None
        self._connections = self._members_pool()
        self._wake.update({stream_id: threading.Event() for stream_id in by_id})
        self.host.log.info(f"reader group {self.group}: group delivery run hosting streams "
                           f"{', '.join(map(str, sorted(by_id)))}")
        try:
            reader = threading.Thread(target=self._read, daemon=True, name=f"pgstream-group-reader-{self.group}")
            reader.start()
            opened = time.monotonic()
            while True:
                try:
                    return self._host(lease, by_id, opened)
                except psycopg.Error as exc:
                    if (line := dbconn.server_gone(exc)) is None:
                        raise
                    taken = self._ride_out(lease, line, opened)
                    if isinstance(taken, str):
                        return taken
                    lease = taken
        except BaseException:
            self._stop("the group run is ending (interrupted or failed)")
            self._join_members(30)
            raise
        finally:
            self._reading_ends.set()
            if reader is not None:
                reader.join(READ_SECS + 30)
            self._connections.close()
            locks.give_up_group_lease(lease, self.group)
            for stream_id, run_key in self._interrupted.items():  # stopped by an outage, not hosted again
                self.host.ended(stream_id, run_key, self._outage_line or "the database went away")

    def _host(self, lease: psycopg.Connection, by_id: dict[int, StreamConfig], opened: float) -> str:
        """Host the members' runs until the group run ends (why); a psycopg error when the database goes away."""
        log = self.host.log
        channels = {state.run_channel(stream_id): stream_id for stream_id in by_id}
        for stream_id in by_id:  # a member's batches handed over wake its run (extend_run notifies)
            state.listen_runs(lease, stream_id)
        checked_at = 0.0
        while True:
            self._reap()
            now = time.monotonic()
            if self._stop_reason is None:
                if self._refused is not None:
                    self._stop(self._refused)
                elif now - opened >= self.max_run_secs:
                    self._stop(self._open_too_long())
                elif now - checked_at >= 1.0:
                    checked_at = now
                    if (reason := self.host.stop_check()) is not None:
                        self._stop(reason)
            if self._stop_reason is not None:
                if not self._members:
                    return self._stop_reason
                if not self._reading_ends.is_set() and locks.group_successor_waits(lease, self.group):
                    self._give_way(lease)
                self._wait(lease, channels, 0.2)
                continue
            self._watch(lease)
            # (a member in mode per_batch has Dagster runs of its own: the design card's run per batch)
            wanted = [m for m in groups.member_runs(lease, self.group)
                      if m.stream_id in by_id and by_id[m.stream_id].delivery.keeps_open]
            self._resume_interrupted(wanted)
            wanted = [m for m in wanted if m.run_key not in self.hosted]
            # (a member whose previous run is still ending waits for it: in this run, or in the run this one took
            # over from, whose member holds the stream's delivery lease until its sink call returns)
            starting = [m for m in wanted if m.stream_id not in self._members]
            if starting:
                held = locks.delivery_lease_holders(lease, [m.stream_id for m in starting])
                starting = [m for m in starting if held.get(m.stream_id) in (None, self._member_id(m.stream_id))]
            self.hosted.update(m.run_key for m in starting)
            claimed = set(self.host.claim([(m.stream_id, m.run_key) for m in starting])) if starting else set()
            for order in starting:
                if (order.stream_id, order.run_key) not in claimed:
                    log.warning(f"stream {order.stream_id}: run {order.run_key} was hosted elsewhere; left to "
                                f"its sensor")
                    continue
                thread = threading.Thread(target=self._member, args=(by_id[order.stream_id], order), daemon=True,
                                          name=f"pgstream-member-{order.stream_id}")
                self._members[order.stream_id] = thread
                thread.start()
            self._wait(lease, channels, POLL_SECS)

    def _resume_interrupted(self, wanted: list[groups.MemberRun]) -> None:
        """The runs an outage stopped: hosted again (no failure counted) if still wanted, else reported ended."""
        keys = {(m.stream_id, m.run_key) for m in wanted}
        for stream_id, run_key in list(self._interrupted.items()):
            if stream_id in self._members:
                continue  # (its thread is still ending)
            del self._interrupted[stream_id]
            if (stream_id, run_key) in keys:
                self.hosted.discard(run_key)
                continue
            with self._connections.session() as session:  # (taken again by _ride_out)
                locks.unlock(session, locks.DELIVERY_LOCK, stream_id)
            self.host.ended(stream_id, run_key, self._outage_line or "the database went away")

    def _ride_out(self, lease: psycopg.Connection, line: str, opened: float) -> psycopg.Connection | str:
        """The database went away: the members' runs stop; the new lease once it is back, or why the run ends."""
        log, began = self.host.log, time.monotonic()
        log.warning(f"reader group {self.group}: {line}; its members' runs stop, the group run goes on once the "
                    f"database accepts writes again")
        self._outage = self._outage_line = line
        for event in self._wake.values():
            event.set()
        # (a member's run stops at its next look; one in a sink call stops once the call returns: not waited for
        # past OUTAGE_JOIN_SECS, it is hosted again once it has stopped, the others as soon as the database is back)
        self._join_members(OUTAGE_JOIN_SECS)
        self._reap()
        lease.close()
        self._connections.close()
        if self._stop_reason is not None:  # (it was ending anyway: nothing to wait for)
            return self._stop_reason
        checked_at = 0.0
        while True:
            now = time.monotonic()
            if now - opened >= self.max_run_secs:
                return self._open_too_long()
            if now - checked_at >= 1.0:
                checked_at = now
                if (reason := self._asked_to_end()) is not None:
                    return reason
            try:
                taken = locks.acquire_group_lease(self.database_url, self.group, self.host.run_id)
            except locks.LeaseTaken as exc:
                return f"{exc} (it took the group over while the database was away)"
            except psycopg.Error as exc:
                if dbconn.server_gone(exc) is None:
                    raise
                time.sleep(OUTAGE_RETRY_SECS)
                continue
            if (reason := self._asked_to_end()) is not None:  # (e.g. the sensor marked it failed: a fresh one goes on)
                locks.give_up_group_lease(taken, self.group)
                return reason
            connections = self._members_pool()
            try:  # the stopped members' leases taken again at once: the group's sensor sees them held, not lost
                with connections.session() as session:
                    for stream_id in self._interrupted:
                        locks.try_lock(session, locks.DELIVERY_LOCK, stream_id,
                                       member_run_id(self.host.run_id, stream_id))
            except psycopg.Error as exc:
                connections.close()
                locks.give_up_group_lease(taken, self.group)
                if dbconn.server_gone(exc) is None:
                    raise
                continue
            self._connections = connections
            self._outage, self._signals = None, {}
            # the ledger it came back with may be older (a promoted standby that had replayed less): what it wants is
            # hosted, run keys this run took before the outage included
            self.hosted.clear()
            self._resumed += 1
            log.info(f"reader group {self.group}: the database accepts writes again after "
                     f"{time.monotonic() - began:.1f}s: the group delivery run goes on")
            return taken

    def _take_lease(self) -> psycopg.Connection | str:
        """The group's lease; while the run it succeeds holds it, waited for (up to :func:`handover_lead` and
        ``run_grace_secs``: that run ends once its sensor sees this one started). Asked to end meanwhile: why."""
        deadline = time.monotonic() + handover_lead(self.max_run_secs, self.run_grace_secs) + self.run_grace_secs
        told, checked_at, reason = False, time.monotonic(), None

        def waits() -> bool:
            nonlocal told, checked_at, reason
            if not told:
                told = True
                self.host.log.info(f"reader group {self.group}: the group delivery run waits for the one it takes "
                                   f"over from to end")
            if time.monotonic() - checked_at >= 1.0:
                checked_at = time.monotonic()
                reason = self._asked_to_end()
            return reason is None and time.monotonic() < deadline
        try:
            return locks.acquire_group_lease(self.database_url, self.group, self.host.run_id, waits)
        except locks.LeaseTaken:
            if reason is not None:
                return reason
            raise

    def _members_pool(self) -> locks.SharedConnections:
        return locks.SharedConnections(self.database_url, f"pgstream group members {self.host.run_id}")

    def _open_too_long(self) -> str:
        return f"open for {self.max_run_secs:g}s (the shortest delivery.tuning.max_run_secs of its streams)"

    def _asked_to_end(self) -> str | None:
        """:attr:`GroupHost.stop_check` while the database is away (Dagster's storage may be away too: None)."""
        with suppress(Exception):
            return self.host.stop_check()
        return None

    def reading_ended(self) -> bool:
        """The group run is ending (``consume_group``'s ``stop``: a shutdown does not wait for the read under way)."""
        return self._reading_ends.is_set()

    def _read(self) -> None:
        """The group run's reader: it reads the group's slot while it holds the group's reading (else the sensor)."""
        log, read = self.host.log, self.host.read
        if read is None:
            return
        conn: psycopg.Connection | None = None
        told: str | None = None
        try:
            while not self._reading_ends.is_set():
                try:
                    if conn is None:
                        conn = dbconn.connect(self.database_url, autocommit=True,
                                              application_name=f"pgstream group reader {self.host.run_id}")
                    if not locks.claim_group_reading(conn, self.group, f"group delivery run {self.host.run_id}"):
                        self._reading_ends.wait(READ_RETRY_SECS)
                        continue
                    if told is not None:
                        log.info(f"reader group {self.group}: the group delivery run reads the group's slot again")
                        told = None
                    began = time.monotonic()
                    read(conn, READ_SECS)
                    if time.monotonic() - began < READ_SECS / 2:  # it returned early (a join waits, nothing joined
                        self._reading_ends.wait(READ_EARLY_SECS)  # yet, a slot lost): not a busy loop
                except REFUSALS as exc:  # the run's configuration cannot go on: it ends (run() sees this)
                    # every line of it, one problem each (LimitsExceeded)
                    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                    self._refused = "; ".join(lines)[:500] or type(exc).__name__
                    return
                except Exception as exc:  # the sensor reads while this one cannot (the lock goes with the session)
                    resumed = self._resumed
                    line = dbconn.first_line(exc)[:500]
                    if line != told and self._outage is None:  # (riding an outage out, the group run says it)
                        log.warning(f"reader group {self.group}: the group delivery run's reader stopped ({line}); "
                                    f"the group's sensor reads meanwhile, the run tries again in "
                                    f"{READ_ERROR_SECS:g}s (at once when the database is back from an outage)")
                        told = line
                    self.host.read_ends()  # the slot let go before the reading is
                    if conn is not None:
                        conn.close()
                        conn = None
                    waited = time.monotonic() + READ_ERROR_SECS
                    # (the group run back from riding out an outage: the reader reads again at once)
                    while time.monotonic() < waited and self._resumed == resumed:
                        if self._reading_ends.wait(OUTAGE_RETRY_SECS):
                            break
        finally:
            self.host.read_ends()
            if conn is not None:
                with suppress(psycopg.Error):
                    locks.release_group_reading(conn, self.group)
                conn.close()

    def _give_way(self, lease: psycopg.Connection) -> None:
        """Ending with members' runs still closing (a sink call under way) while a successor waits: the group's
        lease and its reading are given up at once, so the successor hosts the members that closed (and reads)
        while these finish; each still holds its stream's delivery lease, which the successor waits for."""
        self._reading_ends.set()
        locks.give_up_group_lease(lease, self.group, close=False)
        self.host.log.info(f"reader group {self.group}: its successor waits: the group's lease and the reading of its "
                           f"slot given up; the members' runs still open close meanwhile")

    def _member_id(self, stream_id: int) -> str:
        return member_run_id(self.host.run_id, stream_id)

    def _stop(self, reason: str) -> None:
        self._stop_reason = reason
        for event in self._wake.values():
            event.set()
        self.host.log.info(f"reader group {self.group}: the group delivery run ends ({reason}); its members' runs "
                           f"close")

    def _wait(self, lease: psycopg.Connection, channels: dict[str, int], secs: float) -> None:
        """Up to ``secs``, waking each member whose run channel is notified (batches handed to its run); at once
        when a member without a run is (its sensor opened it one: hosted now, not at the next look)."""
        deadline = time.monotonic() + secs
        while (left := deadline - time.monotonic()) > 0:
            for notify in lease.notifies(timeout=left, stop_after=1):
                if (stream_id := channels.get(notify.channel)) is None:
                    continue
                self._wake[stream_id].set()
                member = self._members.get(stream_id)
                if self._stop_reason is None and (member is None or not member.is_alive()):
                    return

    def _watch(self, lease: psycopg.Connection) -> None:
        """Wake each member whose ledger row moved (one query): its run looks at the ledger only then."""
        signals = groups.member_signals(lease, self.group)
        for stream_id, row in signals.items():
            if stream_id in self._wake and self._signals.get(stream_id) != row:
                self._wake[stream_id].set()
        self._signals = signals

    def _waker(self, stream_id: int) -> Callable[[float], bool]:
        event = self._wake[stream_id]

        def wake(timeout: float) -> bool:
            woken = event.wait(timeout)
            event.clear()  # before the run looks at the ledger: a change after this wakes it again
            return woken

        return wake

    def _join_members(self, secs: float) -> None:
        """Wait for the members' runs to end, ``secs`` at most for all of them together."""
        deadline = time.monotonic() + secs
        for thread in list(self._members.values()):
            thread.join(max(0.0, deadline - time.monotonic()))

    def _reap(self) -> None:
        self._members = {s: m for s, m in self._members.items() if m.is_alive()}

    def _member(self, stream: StreamConfig, order: groups.MemberRun) -> None:
        """One member's run, in its own thread: its failure ends only this thread."""
        run_id = member_run_id(self.host.run_id, stream.id)
        base = self.host.member_host(stream, run_id)

        def stop_check() -> str | None:
            if (reason := self._stop_reason) is not None:
                return f"the group delivery run ends ({reason})"
            if self._outage is not None:
                return f"the database went away ({self._outage})"
            return base.stop_check()

        every = max(stream.delivery.tuning.report_every_secs, len(self.streams) / REPORTS_PER_SEC)
        host = Host(run_id, base.log, spark=base.spark, stop_check=stop_check, report=base.report,
                    control=base.control, wake=self._waker(stream.id), report_every_secs=every)
        error: str | None = None
        interrupted = False  # the database went away: the run stops, hosted again once it is back
        try:
            run = DeliveryRun(stream, self.database_url, self.executor_url, run_id, order.batch_id,
                              order.through_batch_id, order.run_key,
                              connections=self._connections, handoff=self.handoff).start(host.log)
            for _round in run.deliver(host):
                pass
        except Exception as exc:
            if self._outage is not None or _database_gone(exc):
                interrupted = True
                host.log.warning(f"stream {stream.id}: member run {run_id} stopped ({dbconn.first_line(exc)[:500]}); "
                                 f"hosted again once the database accepts writes")
            else:
                error = dbconn.first_line(exc)[:500]
                host.log.error(f"stream {stream.id}: member run {run_id} ({order.run_key}) failed: {error}")
        finally:
            if interrupted or (error is None and self._outage is not None):
                self._interrupted[stream.id] = order.run_key  # (_resume_interrupted)
            else:
                self.host.ended(stream.id, order.run_key, error)
