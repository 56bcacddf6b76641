"""A reader group's delivery run, without Dagster (docs/architecture.md, "Delivery for many streams"): a
:class:`~.run.DeliveryRun` per member in a thread, each with its own sink, lease and state machine.
:class:`GroupDelivery` starts the member runs the sensor decided (``ledger.groups.member_runs``, a query a
second; :attr:`GroupHost.claim`) as ``<group run id>/<stream id>``, wakes idle ones (one ``LISTEN``, one query
a second) and lets a failing one end its own thread (:attr:`GroupHost.ended`). Its reader thread reads the
group's slot holding the group's reading (:attr:`GroupHost.read`, :attr:`GroupHost.read_ends`). It holds the
group's delivery lease and ends after ``max_run_secs``, at :attr:`GroupHost.stop_check`'s reason or a
:data:`REFUSALS` of its reader.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from ...config import StreamConfig
from .. import dbconn
from ..ledger import groups, locks, state
from ..limits import LimitsExceeded
from ..replication import PublicationTaken
from ..runlog import Log
from .run import DeliveryRun, Host

#: how often the group run looks at what its members want hosted when no notification woke it
POLL_SECS = 1.0
#: the members' reports together, at most this many a second (each is a few writes to Dagster's event log): a
#: member reports every ``max(report_every_secs, members / REPORTS_PER_SEC)`` seconds (100 members: every 20 s)
REPORTS_PER_SEC = 5.0
#: the group run's reader: how long a ``consume_group`` call reads; its waits to claim the reading again
READ_SECS = 5.0
READ_RETRY_SECS = 0.2
READ_EARLY_SECS = 0.5
READ_ERROR_SECS = 5.0
#: what the reader cannot get past with the run's configuration: the group run ends with its line as reason
REFUSALS: tuple[type[Exception], ...] = (groups.GroupChange, PublicationTaken, LimitsExceeded)


def member_run_id(group_run_id: str, stream_id: int) -> str:
    """The run id of a member's delivery run hosted by group delivery run ``group_run_id``: it holds the
    member's delivery lease (the group's sensor reads what became of it with ``ledger.locks.lease_states``)."""
    return f"{group_run_id}/{stream_id}"


def reader_name(group_run_id: str) -> str:
    """How the group's reading lock names the group delivery run ``group_run_id``'s reader while it reads."""
    return f"group delivery run {group_run_id}"


def _one_line(exc: BaseException, *, every_line: bool = False) -> str:
    """The error in one line: its first (or, ``every_line``, all of them: one problem each, as
    ``LimitsExceeded`` has), at most 500 characters."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return ("; ".join(lines) if every_line else lines[0] if lines else "")[:500] or type(exc).__name__


@dataclass(frozen=True)
class GroupHost:
    """What the group run needs from whoever runs it."""

    #: the group run's id (its member runs are ``<run_id>/<stream id>``)
    run_id: str
    log: Log
    #: the host of one member's run (its run id given): log, Spark, reporter, stop check of its own
    member_host: Callable[[StreamConfig, str], Host]
    #: of the member runs ``(stream id, run key)`` wanted, those this group run may host (recorded as its own)
    claim: Callable[[list[tuple[int, str]]], list[tuple[int, str]]] = lambda wanted: wanted
    #: told when a member's run ended: ``error`` None when it closed, else why it failed (one line)
    ended: Callable[[int, str, str | None], None] = lambda _stream_id, _run_key, _error: None
    #: a reason to end the group run that only the host knows (None: none), asked about once a second
    stop_check: Callable[[], str | None] = lambda: None
    #: reads the group's slot on the connection given for up to the seconds given and logs what it did, again
    #: and again while the reader holds the group's reading. None: the group's sensor reads
    read: Callable[[psycopg.Connection, float], None] | None = None
    #: the reader gives the group's reading up: what ``read`` kept open closes (the slot let go)
    read_ends: Callable[[], None] = lambda: None


@dataclass
class _Member:
    run: groups.MemberRun
    thread: threading.Thread


@dataclass
class GroupDelivery:
    """The delivery run of reader group ``group`` (its members: ``streams``)."""

    group: str
    streams: list[StreamConfig]
    database_url: str
    executor_url: str
    host: GroupHost
    max_run_secs: float
    hosted: set[str] = field(default_factory=set)  # every run key this group run took (or refused)
    errors: dict[int, str] = field(default_factory=dict)  # the last failure of each member
    _members: dict[int, _Member] = field(default_factory=dict)
    #: per member: set when its ledger row moved (``ledger.groups.member_signals``) or its run channel was notified
    _wake: dict[int, threading.Event] = field(default_factory=dict)
    _signals: dict[int, tuple[object, ...]] = field(default_factory=dict)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _stop_reason: str | None = None
    #: set by the reader when it met one of :data:`REFUSALS`: the group run ends with this line as the reason
    _refused: str | None = None
    #: set when the group run ends: its reader stops reading and gives the group's reading up
    _reading_ends: threading.Event = field(default_factory=threading.Event)
    _connections: locks.SharedConnections = field(init=False)  # the members' (opened by run())

    def run(self) -> str:
        """Host the members' runs until the group run ends; why it ended."""
        by_id = {s.id: s for s in self.streams}
        lease = locks.acquire_group_lease(self.database_url, self.group, self.host.run_id)
        log = self.host.log
        reader: threading.Thread | None = None
        # the members' leases on one session, their ledger work on a pool (at most one connection each)
        self._connections = locks.SharedConnections(self.database_url, f"pgstream group members {self.host.run_id}")
        try:
            channels = {state.run_channel(stream_id): stream_id for stream_id in by_id}
            for stream_id in by_id:  # a member's batches handed over wake its run (extend_run notifies)
                state.listen_runs(lease, stream_id)
                self._wake[stream_id] = threading.Event()
            log.info(f"reader group {self.group}: group delivery run hosting streams "
                     f"{', '.join(map(str, sorted(by_id)))}")
            reader = threading.Thread(target=self._read, daemon=True, name=f"pgstream-group-reader-{self.group}")
            reader.start()
            opened = time.monotonic()
            checked_at = 0.0
            while True:
                self._reap()
                now = time.monotonic()
                if self._stop_reason is None:
                    if self._refused is not None:
                        self._stop(self._refused)
                    elif now - opened >= self.max_run_secs:
                        self._stop(f"open for {self.max_run_secs:g}s (the shortest delivery.tuning.max_run_secs "
                                   f"of its streams)")
                    elif now - checked_at >= 1.0:
                        checked_at = now
                        reason = self.host.stop_check()
                        if reason is not None:
                            self._stop(reason)
                if self._stop_reason is not None:
                    if not self._members:
                        return self._stop_reason
                    self._wait(lease, channels, 0.2)
                    continue
                self._watch(lease)
                # (a member in mode per_batch has Dagster runs of its own: the design card's run per batch)
                wanted = [m for m in groups.member_runs(lease, self.group)
                          if m.stream_id in by_id and by_id[m.stream_id].delivery.keeps_open
                          and m.run_key not in self.hosted]
                # (a member whose previous run is still ending waits for it)
                starting = [m for m in wanted if m.stream_id not in self._members]
                self.hosted.update(m.run_key for m in starting)
                claimed = set(self.host.claim([(m.stream_id, m.run_key) for m in starting])) if starting else set()
                for order in starting:
                    if (order.stream_id, order.run_key) not in claimed:
                        log.warning(f"stream {order.stream_id}: run {order.run_key} was hosted elsewhere; left to "
                                    f"its sensor")
                        continue
                    self._start(by_id[order.stream_id], order)
                self._wait(lease, channels, POLL_SECS)
        except BaseException:
            self._stop("the group run is ending (interrupted or failed)")
            for member in list(self._members.values()):
                member.thread.join(30)
            raise
        finally:
            self._reading_ends.set()
            if reader is not None:
                reader.join(READ_SECS + 30)
            self._connections.close()
            locks.give_up_group_lease(lease, self.group)

    def reading_ended(self) -> bool:
        """The group run is ending: its reader returns from the read under way (``consume_group``'s ``stop``)
        within half a second, not at its end (:data:`READ_SECS`), so a shutdown does not wait for it."""
        return self._reading_ends.is_set()

    def _read(self) -> None:
        """The group run's reader (its own thread and connection): while it holds the group's reading, it
        reads the group's slot continuously; whenever the group's sensor holds it (its tick), it waits."""
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
                    if not locks.claim_group_reading(conn, self.group, reader_name(self.host.run_id)):
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
                    self._refused = _one_line(exc, every_line=True)
                    return
                except Exception as exc:  # the sensor reads while this one cannot (the lock goes with the session)
                    line = _one_line(exc)
                    if line != told:
                        log.warning(f"reader group {self.group}: the group delivery run's reader stopped ({line}); "
                                    f"the group's sensor reads meanwhile, the run tries again in "
                                    f"{READ_ERROR_SECS:g}s")
                        told = line
                    self.host.read_ends()  # the slot let go before the reading is
                    if conn is not None:
                        conn.close()
                        conn = None
                    self._reading_ends.wait(READ_ERROR_SECS)
        finally:
            self.host.read_ends()
            if conn is not None:
                try:
                    locks.release_group_reading(conn, self.group)
                except psycopg.Error:
                    pass
                conn.close()

    def _stop(self, reason: str) -> None:
        self._stop_reason = reason
        self._stopping.set()
        for event in self._wake.values():
            event.set()
        self.host.log.info(f"reader group {self.group}: the group delivery run ends ({reason}); its members' runs "
                           f"close")

    def _wait(self, lease: psycopg.Connection, channels: dict[str, int], secs: float) -> None:
        """Up to ``secs``, waking each member whose run channel is notified (batches handed to its run)."""
        for notify in lease.notifies(timeout=secs):
            stream_id = channels.get(notify.channel)
            if stream_id is not None:
                self._wake[stream_id].set()

    def _watch(self, lease: psycopg.Connection) -> None:
        """One query for the whole group: wake each member whose ledger row moved; its run looks at the
        ledger only then (and every ``WOKEN_POLL_SECS``), not twice a second."""
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

    def _reap(self) -> None:
        for stream_id in [s for s, m in self._members.items() if not m.thread.is_alive()]:
            del self._members[stream_id]

    def _start(self, stream: StreamConfig, order: groups.MemberRun) -> None:
        thread = threading.Thread(target=self._member, args=(stream, order), daemon=True,
                                  name=f"pgstream-member-{stream.id}")
        self._members[stream.id] = _Member(order, thread)
        thread.start()

    def _member(self, stream: StreamConfig, order: groups.MemberRun) -> None:
        """One member's run, in its own thread: its failure ends only this thread."""
        run_id = member_run_id(self.host.run_id, stream.id)
        base = self.host.member_host(stream, run_id)

        def stop_check() -> str | None:
            if self._stopping.is_set():
                return f"the group delivery run ends ({self._stop_reason})"
            return base.stop_check()

        every = max(stream.delivery.tuning.report_every_secs, len(self.streams) / REPORTS_PER_SEC)
        host = Host(run_id, base.log, spark=base.spark, stop_check=stop_check, report=base.report,
                    control=base.control, wake=self._waker(stream.id), report_every_secs=every)
        error: str | None = None
        try:
            run = DeliveryRun(stream, self.database_url, self.executor_url, run_id, order.batch_id,
                              order.through_batch_id, order.run_key,
                              connections=self._connections.for_run()).start(host.log)
            for _round in run.deliver(host):
                pass
        except Exception as exc:
            text = str(exc).strip()
            error = (text.splitlines()[0] if text else type(exc).__name__)[:500]
            self.errors[stream.id] = error
            host.log.error(f"stream {stream.id}: member run {run_id} ({order.run_key}) failed: {error}")
        finally:
            self.host.ended(stream.id, order.run_key, error)
