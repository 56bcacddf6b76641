"""pgstream's own locks (sql/repeatable/00_locks.sql) and what is built on them: the delivery lease and its fate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from enum import StrEnum
from typing import Protocol

import psycopg

from .. import dbconn

# rows of pgstream.locks, which only the owner writes (not advisory locks, which any role could take and hold to
# stall a stream), held by the session that took them until unlock or its end
DELIVERY_LOCK = "delivery"  # per stream (key: stream id): the open run's delivery lease; its holder is the run id
REDELIVERY_LOCK = "redelivery"  # per stream: a redelivery of its dead letters
REPLAY_LOCK = "replay"  # per stream: a replay, while it waits for the lease and delivers (an open run closes)
LEASE_WAIT_LOCK = "delivery_wait"  # per stream: a run waiting for the lease while a replay holds it (alive)
LEASE_POLL_SECS = 0.2  # how often a run or a replay waiting for the delivery lease looks again (seconds)


def try_lock(conn: psycopg.Connection, name: str, key: int, holder: str | None = None) -> bool:
    """Take pgstream's lock ``(name, key)`` for ``conn``'s session (false: another live session holds it);
    ``conn`` in autocommit mode: the lock is a row that must be committed at once."""
    if not conn.autocommit:
        raise ValueError("try_lock needs a connection in autocommit mode")
    row = conn.execute("select pgstream.try_lock(%s, %s, %s)", [name, key, holder]).fetchone()
    return bool(row and row[0])


def unlock(conn: psycopg.Connection, name: str, key: int) -> None:
    """Give pgstream's lock ``(name, key)`` up if ``conn``'s session holds it."""
    conn.execute("select pgstream.unlock(%s, %s)", [name, key])


def lock_holder(conn: psycopg.Connection, name: str, key: int) -> str | None:
    """Who holds pgstream's lock ``(name, key)`` (``""``: a holder without a name), or None when free."""
    row = conn.execute("select pgstream.lock_holder(%s, %s)", [name, key]).fetchone()
    return None if row is None or row[0] is None else str(row[0])


def lease_name(run_id: str) -> str:
    return f"pgstream run {run_id}"


class LeaseTaken(RuntimeError):
    """Another live run holds the stream's delivery lease."""


def acquire_lease(database_url: str, stream_id: int, run_id: str,
                  waiting: Callable[[str], None] | None = None) -> psycopg.Connection:
    """A connection holding the stream's delivery lease (:func:`take_lease`), named after the run."""
    conn = dbconn.connect(database_url, autocommit=True, application_name=lease_name(run_id))
    try:
        take_lease(conn, stream_id, run_id, waiting)
        return conn
    except BaseException:
        conn.close()
        raise


def take_lease(conn: psycopg.Connection, stream_id: int, run_id: str,
               waiting: Callable[[str], None] | None = None) -> None:
    """Take the stream's delivery lease (lock ``delivery``) for ``conn``'s session (it goes if that dies); waits,
    holding ``delivery_wait``, while a replay holds or wants it; another run holding it: :class:`LeaseTaken`."""
    told = 0.0
    try:
        while True:
            if (replay := lock_holder(conn, REPLAY_LOCK, stream_id)) is None:
                if not try_lock(conn, DELIVERY_LOCK, stream_id, run_id):
                    raise LeaseTaken(f"another run is delivering stream {stream_id}")
                unlock(conn, LEASE_WAIT_LOCK, stream_id)
                return
            try_lock(conn, LEASE_WAIT_LOCK, stream_id, run_id)
            if waiting is not None and time.monotonic() - told >= 10:
                told = time.monotonic()
                waiting(replay)
            time.sleep(LEASE_POLL_SECS)
    except BaseException:
        if not conn.closed and not conn.broken:  # (a session hosting other runs' leases goes on: the wait ends)
            with suppress(psycopg.Error):
                unlock(conn, LEASE_WAIT_LOCK, stream_id)
        raise


def acquire_replay_lease(database_url: str, stream_id: int, holder: str,
                         waiting: Callable[[str], None] | None = None) -> psycopg.Connection:
    """A connection holding the stream's ``replay`` lock, then its delivery lease, for replay ``holder`` (the open
    run closes, a new run waits); ``waiting`` told every 10 s; closing it releases both."""
    conn = dbconn.connect(database_url, autocommit=True, application_name=f"pgstream replay {holder}")
    try:
        told = 0.0
        for name, what in ((REPLAY_LOCK, "another replay"), (DELIVERY_LOCK, "the delivery lease")):
            while not try_lock(conn, name, stream_id, holder):
                if waiting is not None and time.monotonic() - told >= 10:
                    told = time.monotonic()
                    waiting(f"{what} (held by {lock_holder(conn, name, stream_id) or 'a session that is ending'})")
                time.sleep(LEASE_POLL_SECS)
        return conn
    except BaseException:
        conn.close()
        raise


def replay_waiting(conn: psycopg.Connection, stream_id: int) -> bool:
    """Whether a replay of the stream holds or waits for its delivery lease (:func:`acquire_replay_lease`)."""
    return lock_holder(conn, REPLAY_LOCK, stream_id) is not None


class LeaseState(StrEnum):
    """What became of a run's delivery lease (:func:`lease_state`)."""

    HELD = "held"  # a live backend of the run holds it
    LOST = "lost"  # the backend that held it ended without giving it up: the run's process (or connection) died
    NOT_TAKEN = "not taken"  # no lease names the run: it has not taken one yet (or gave it up, ending)
    WAITING = "waiting"  # (a group's lease) a live backend of the run waits for the run holding it to end


def lease_state(conn: psycopg.Connection, run_id: str) -> LeaseState:
    """What became of run ``run_id``'s delivery lease, or its wait for it (its row names it until given up)."""
    return lease_states(conn, [run_id])[run_id]


def lease_states(conn: psycopg.Connection, run_ids: list[str]) -> dict[str, LeaseState]:
    """:func:`lease_state` of each of ``run_ids``, in one query."""
    states = dict.fromkeys(run_ids, LeaseState.NOT_TAKEN)
    # the lease, or the wait for it while a replay holds it (LEASE_WAIT_LOCK): a run waiting is alive
    for holder, alive in conn.execute(
            "select l.holder, bool_or(pgstream.backend_alive(l.pid, l.backend_start, l.usesysid)) "
            "from pgstream.locks l where l.name in (%s, %s) and l.holder = any(%s) and l.pid is not null "
            "group by l.holder", [DELIVERY_LOCK, LEASE_WAIT_LOCK, run_ids]):
        states[str(holder)] = LeaseState.HELD if alive else LeaseState.LOST
    return states


def give_up_lease(conn: psycopg.Connection, stream_id: int) -> None:
    """A run that ends gives its delivery lease up and closes its connection (only a run whose process died
    leaves a :attr:`LeaseState.LOST` lease); a broken connection gives up nothing (its backend has ended)."""
    _give_up(conn, DELIVERY_LOCK, stream_id)


def _give_up(conn: psycopg.Connection, name: str, key: int) -> None:
    try:
        with suppress(psycopg.Error):
            if not conn.closed and not conn.broken:
                unlock(conn, name, key)
    finally:
        conn.close()


class RecordingCheck:
    """Whether the run's ledger connection still answers (``Sink.go_on``), asked every ``every_secs`` at most."""

    def __init__(self, conn: psycopg.Connection, every_secs: float = 0.2) -> None:
        self.conn, self.every_secs = conn, every_secs
        self.broken: str | None = None  # why it no longer answers
        self._asked = 0.0
        self._lock = threading.Lock()

    def answered(self) -> None:
        """A statement on the connection has just returned: the sink's next request does not ask again soon."""
        with self._lock:
            if self.broken is None:
                self._asked = time.monotonic()

    def __call__(self) -> bool:
        with self._lock:
            if self.broken is None and (self.conn.closed or self.conn.broken):
                self.broken = "the connection is closed"
            if self.broken is not None:
                return False
            if time.monotonic() - self._asked < self.every_secs:
                return True
            try:
                self.conn.execute("select 1")
            except psycopg.Error as exc:
                self.broken = dbconn.first_line(exc)
                return False
            self._asked = time.monotonic()
            return True


class RunConnections(Protocol):
    """Where a delivery run holds its delivery lease and does its ledger work."""

    def take_lease(self, stream_id: int, run_id: str, waiting: Callable[[str], None] | None = None) -> None:
        """:func:`take_lease`, for the run's lease session."""

    def give_up_lease(self, stream_id: int) -> None:
        """The run ends (however it ends, short of its process dying): its lease is given up."""

    def connection(self) -> AbstractContextManager[psycopg.Connection]:
        """A connection (autocommit) for one piece of the run's ledger work: a round, a look at the ledger."""

    def lease_session(self) -> AbstractContextManager[psycopg.Connection]:
        """The session holding the run's lease (what only its holder may ask: a by_key round's token)."""


class OwnConnection:
    """A run alone in its process: one connection, named after the run, holds its lease and does its ledger work."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.conn: psycopg.Connection | None = None

    def take_lease(self, stream_id: int, run_id: str, waiting: Callable[[str], None] | None = None) -> None:
        self.conn = acquire_lease(self.database_url, stream_id, run_id, waiting)

    def give_up_lease(self, stream_id: int) -> None:
        if self.conn is not None:
            give_up_lease(self.conn, stream_id)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if self.conn is None:
            raise RuntimeError("the run holds no delivery lease (take_lease first)")
        yield self.conn

    lease_session = connection


POOL_IDLE_SECS = 60.0  # how long a connection of the pool stays idle before it is closed
#: the connections of the pool working at once: a run that wants one more waits for one to be given back (100
#: trickling streams delivered as fast with 8 as with one each: bench/RESULTS.md)
POOL_SIZE = 8
#: a connection a run has held this long no longer counts toward ``POOL_SIZE`` (its sink call hangs, a retry
#: waits, a large round): the runs behind it do not wait for it
POOL_HELD_SECS = 1.0


class SharedConnections:
    """The connections of the runs one process hosts (docs/architecture.md, "Connections"): every run's lease on
    one session named ``name`` (it ends with the process: how the sensor tells a dead run from a slow one), their
    ledger work on a pool, a connection at a time per run. A run whose lease session ended closes at its next look
    (``state.next_assigned``) and publishes nothing once another run took its lease (``state.publishing``)."""

    def __init__(self, database_url: str, name: str, size: int = POOL_SIZE) -> None:
        self.database_url, self.name, self.size = database_url, name, size
        self._lock = threading.Lock()
        self._given_back = threading.Condition(self._lock)
        self._session: psycopg.Connection | None = None
        self._idle: list[tuple[float, psycopg.Connection]] = []  # given back, the last one last
        self._out: dict[int, float] = {}  # the connections runs hold (by id, and an opening one's), since when
        self._closed = False

    @contextmanager
    def session(self) -> Iterator[psycopg.Connection]:
        """The lease session (a fresh one once it broke: the leases it held ended with it)."""
        with self._lock:
            if self._session is None or self._session.closed or self._session.broken:
                self._session = dbconn.connect(self.database_url, autocommit=True, application_name=self.name)
            session = self._session
        yield session

    def _working(self, now: float) -> int:  # the connections out held less than POOL_HELD_SECS
        return sum(1 for since in self._out.values() if now - since < POOL_HELD_SECS)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        stale: list[psycopg.Connection] = []
        conn: psycopg.Connection | None = None
        ticket = object()  # (the key of a connection being opened)
        with self._given_back:
            while True:
                now = time.monotonic()
                stale += [c for at, c in self._idle if now - at >= POOL_IDLE_SECS]
                self._idle = [(at, c) for at, c in self._idle if now - at < POOL_IDLE_SECS]
                if self._idle:
                    conn = self._idle.pop()[1]
                    self._out[id(conn)] = now
                    break
                if self._working(now) < self.size:
                    self._out[id(ticket)] = now
                    break
                # until one is given back, or the oldest one that counts stops counting (not on one that no longer
                # counts: the wait would wake at once, again and again)
                oldest = min(since for since in self._out.values() if now - since < POOL_HELD_SECS)
                self._given_back.wait(max(0.001, oldest + POOL_HELD_SECS - now))
        for old in stale:
            old.close()
        if conn is None:
            try:
                conn = dbconn.connect(self.database_url, autocommit=True, application_name=self.name)
            finally:
                with self._given_back:
                    since = self._out.pop(id(ticket))
                    if conn is not None:
                        self._out[id(conn)] = since
                    self._given_back.notify()
        try:
            yield conn
        finally:
            usable = not conn.broken and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            with self._given_back:
                self._out.pop(id(conn), None)
                if usable and not self._closed and len(self._idle) + self._working(time.monotonic()) < self.size:
                    self._idle.append((time.monotonic(), conn))
                    conn = None
                self._given_back.notify()
            if conn is not None:
                conn.close()

    # (the :class:`RunConnections` of every run it hosts)
    def take_lease(self, stream_id: int, run_id: str, waiting: Callable[[str], None] | None = None) -> None:
        with self.session() as session:
            take_lease(session, stream_id, run_id, waiting)

    def give_up_lease(self, stream_id: int) -> None:
        # (never raises, as give_up_lease: the run's own error is the one told; a session not opened holds nothing)
        with suppress(psycopg.Error), self.session() as session:
            unlock(session, DELIVERY_LOCK, stream_id)

    lease_session = session

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            session, self._session = self._session, None
        for _at, conn in idle:
            conn.close()
        if session is not None:
            session.close()


#: per reader group (name: this and the group's; key 0): its group delivery run's lease, for its process's life
GROUP_DELIVERY_LOCK = "group_delivery"
#: per reader group: the reading of its slot, by the group run's reader while it reads or the sensor for its tick
GROUP_READER_LOCK = "group_reader"
GROUP_WAIT_LOCK = "group_wait"  # per group: a successor waiting for the group's lease (alive while it waits)


def _group_lock(group: str, name: str = GROUP_DELIVERY_LOCK) -> str:
    return f"{name}:{group}"


def acquire_group_lease(database_url: str, group: str, run_id: str,
                        waits: Callable[[], bool] = lambda: False) -> psycopg.Connection:
    """A connection holding group ``group``'s delivery lease for group run ``run_id``. While another live run holds
    it, tried again every :data:`LEASE_POLL_SECS` as long as ``waits()`` (a successor waiting for the run it takes
    over from to end), then :class:`LeaseTaken`."""
    conn = dbconn.connect(database_url, autocommit=True, application_name=lease_name(run_id))
    waiting = False  # (its wait is a lock of its session: a run that dies waiting is seen dead at once)
    try:
        while not try_lock(conn, _group_lock(group), 0, run_id):
            if not waits():
                if waiting:
                    unlock(conn, _group_lock(group, GROUP_WAIT_LOCK), 0)
                raise LeaseTaken(f"another group delivery run ({lock_holder(conn, _group_lock(group), 0)}) hosts "
                                 f"the deliveries of reader group {group}")
            waiting = waiting or try_lock(conn, _group_lock(group, GROUP_WAIT_LOCK), 0, run_id)
            time.sleep(LEASE_POLL_SECS)
        if waiting:
            unlock(conn, _group_lock(group, GROUP_WAIT_LOCK), 0)
        return conn
    except BaseException:
        conn.close()
        raise


def group_lease_state(conn: psycopg.Connection, group: str, run_id: str) -> LeaseState:
    """What became of group delivery run ``run_id``'s lease of reader group ``group``, or its wait for it."""
    rows: dict[str, bool] = dict(conn.execute(
        "select l.name, pgstream.backend_alive(l.pid, l.backend_start, l.usesysid) from pgstream.locks l "
        "where l.name in (%s, %s) and l.key = 0 and l.holder = %s and l.pid is not null",
        [_group_lock(group), _group_lock(group, GROUP_WAIT_LOCK), run_id]).fetchall())
    if rows.get(_group_lock(group)):
        return LeaseState.HELD
    if rows.get(_group_lock(group, GROUP_WAIT_LOCK)):
        return LeaseState.WAITING
    return LeaseState.LOST if rows else LeaseState.NOT_TAKEN


def group_successor_waits(conn: psycopg.Connection, group: str) -> bool:
    """Whether a live group delivery run waits for reader group ``group``'s lease (:func:`acquire_group_lease`)."""
    return lock_holder(conn, _group_lock(group, GROUP_WAIT_LOCK), 0) is not None


def delivery_lease_holders(conn: psycopg.Connection, stream_ids: list[int]) -> dict[int, str]:
    """The runs whose live sessions hold the delivery leases of ``stream_ids`` (the free ones left out)."""
    return {int(key): str(holder) for key, holder in conn.execute(
        "select l.key, l.holder from pgstream.locks l where l.name = %s and l.key = any(%s) and l.pid is not null "
        "and pgstream.backend_alive(l.pid, l.backend_start, l.usesysid)", [DELIVERY_LOCK, stream_ids])}


def group_lease_age(conn: psycopg.Connection, group: str, run_id: str) -> float | None:
    """How long group delivery run ``run_id`` has held reader group ``group``'s lease (seconds; None: it does not)."""
    row = conn.execute("select extract(epoch from clock_timestamp() - l.taken_at)::float8 from pgstream.locks l "
                       "where l.name = %s and l.key = 0 and l.holder = %s "
                       "and pgstream.backend_alive(l.pid, l.backend_start, l.usesysid)",
                       [_group_lock(group), run_id]).fetchone()
    return None if row is None else float(row[0])


def give_up_group_lease(conn: psycopg.Connection, group: str, *, close: bool = True) -> None:
    """A group delivery run that ends (short of its process dying) gives the group's lease up; ``close=False``: the
    connection stays open (a run that gives way to its successor while its members' runs close)."""
    if close:
        _give_up(conn, _group_lock(group), 0)
    else:
        unlock(conn, _group_lock(group), 0)


def claim_group_reading(conn: psycopg.Connection, group: str, holder: str) -> bool:
    """Take the reading of reader group ``group``'s slot for ``conn``'s session (false: another live one reads it)."""
    return try_lock(conn, _group_lock(group, GROUP_READER_LOCK), 0, holder)


def release_group_reading(conn: psycopg.Connection, group: str) -> None:
    """Give the reading of :func:`claim_group_reading` up (a connection already broken holds nothing)."""
    if not conn.closed and not conn.broken:
        unlock(conn, _group_lock(group, GROUP_READER_LOCK), 0)


def group_reading_holder(conn: psycopg.Connection, group: str) -> str | None:
    """Who reads reader group ``group``'s slot now (:func:`claim_group_reading`), or None."""
    return lock_holder(conn, _group_lock(group, GROUP_READER_LOCK), 0)
