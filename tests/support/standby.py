"""A primary and a streaming standby made by ``pg_basebackup``, for failover tests: asynchronous or
synchronous replication, a standby made to lag (its WAL receiver cut off: what it has not received,
promotion cannot replay), kill -9 of the primary, promotion, and a libpq multi-host URL that reaches
whichever of the two accepts writes (``target_session_attrs=read-write``).

The pair rolls: after :meth:`StandbyPair.fail_over` the promoted standby is the primary, and
:meth:`StandbyPair.add_standby` makes it a new standby, so one module's tests share one ``initdb``;
:meth:`StandbyPair.switch_over` keeps both servers, the old primary rewound into the new one's standby.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psycopg

from pgstream_dagster.devdb import LocalPostgres, _demote, ensure_running, free_port

#: the test servers' durability shortcuts (as tests/conftest.py's ``pg``); ``synchronous_standby_names``
#: is set on the primary when the pair replicates synchronously (reloaded, no restart)
_SETTINGS = {"fsync": "off", "full_page_writes": "on", "max_slot_wal_keep_size": "-1", "wal_keep_size": "256MB",
             "hot_standby_feedback": "on", "wal_receiver_status_interval": "1", "checkpoint_timeout": "30min"}


def _wait(what: str, done: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class StandbyPair:
    """A primary and (after :meth:`add_standby`) one streaming standby under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._generation = 0
        self.primary = ensure_running(root / "node0", extra_settings=_SETTINGS)
        self.standby: LocalPostgres | None = None
        self.dead: list[LocalPostgres] = []

    # -- building ------------------------------------------------------------------------------------

    def add_standby(self, synchronous: bool = False, failover_slots: bool = False) -> LocalPostgres:
        """A new standby of the primary (``pg_basebackup -R``), caught up; ``synchronous``: the primary
        waits for its flush at each commit (``synchronous_standby_names = '*'``), else asynchronous.
        ``failover_slots`` (Postgres 17+): the standby streams through a physical slot, synchronizes the
        primary's failover slots (``sync_replication_slots``), and the primary's decoding of them waits
        for it (``synchronized_standby_slots``)."""
        assert self.standby is None, "the pair has a standby already"
        self._generation += 1
        datadir = self.root / f"node{self._generation}"
        datadir.mkdir(parents=True)
        ids = _demote()
        if ids is not None:
            os.chown(datadir, *ids)
        datadir.chmod(0o700)
        slot = f"standby{self._generation}"
        extra: list[str] = []
        settings = {k: v for k, v in self.primary.settings.items() if k != "sync_replication_slots"}
        if failover_slots:
            with psycopg.connect(self.primary.url, autocommit=True) as c:
                c.execute("select pg_create_physical_replication_slot(%s)", [slot])
            extra = ["-S", slot, "-d", "dbname=postgres"]  # the slot sync worker connects to a database
            settings["sync_replication_slots"] = "on"
        self.primary._run(["pg_basebackup", "-D", str(datadir), "-h", "127.0.0.1", "-p", str(self.primary.port),
                           "-U", "postgres", "-R", "-X", "stream", "-c", "fast", *extra])
        if failover_slots:
            with psycopg.connect(self.primary.url, autocommit=True) as c:
                c.execute(f"alter system set synchronized_standby_slots = '{slot}'")
                c.execute("select pg_reload_conf()")
        else:  # a primary that was such a standby passed its physical slot's name on (the new one has none)
            auto = datadir / "postgresql.auto.conf"
            auto.write_text("".join(line for line in auto.read_text().splitlines(keepends=True)
                                    if not line.startswith("primary_slot_name")))
        standby = LocalPostgres(datadir, free_port(), settings)
        standby.start()
        self.standby = standby
        self.set_synchronous(synchronous)
        _wait("the standby to stream", lambda: self._streaming())
        self.catch_up()
        return standby

    def set_synchronous(self, synchronous: bool) -> None:
        with psycopg.connect(self.primary.url, autocommit=True) as c:
            c.execute(f"alter system set synchronous_standby_names = '{'*' if synchronous else ''}'")
            c.execute("select pg_reload_conf()")
        expected = "sync" if synchronous else "async"
        _wait(f"{expected} replication", lambda: self._sync_state() == expected)

    # -- what the two servers say --------------------------------------------------------------------

    def _sync_state(self) -> str | None:
        """The standby's WAL sender's sync state (None: it does not stream); a logical one (a group delivery run's
        reader, connected to its database) is not the standby's."""
        with psycopg.connect(self.primary.url) as c:
            row = c.execute("select r.sync_state from pg_stat_replication r join pg_stat_activity a on a.pid = r.pid "
                            "where a.datname is null").fetchone()
        return None if row is None else str(row[0])

    def _streaming(self) -> bool:
        return self._sync_state() is not None

    def url_for(self, dbname: str) -> str:
        """The multi-host URL: libpq tries the primary, then the standby, and keeps the one that accepts
        writes (after a promotion: the former standby)."""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in (self.primary, self.standby) if n is not None)
        return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write&connect_timeout=2"

    def create_database(self, name: str) -> None:
        self.primary.create_database(name)
        self.catch_up()

    def catch_up(self) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        assert self.standby is not None
        with psycopg.connect(self.primary.url) as c:
            row = c.execute("select pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        with psycopg.connect(self.standby.url, autocommit=True) as s:
            _wait("the standby to replay", lambda: bool(s.execute(
                "select pg_last_wal_replay_lsn() >= %s::pg_lsn", [row[0]]).fetchone()[0]))  # type: ignore[index]

    # -- faults --------------------------------------------------------------------------------------

    def cut_off_standby(self) -> None:
        """The standby stops receiving WAL (its ``primary_conninfo`` emptied, reloaded): from now on it
        falls behind by everything the primary commits, as an asynchronous standby seconds behind does.
        Only with asynchronous replication (a synchronous primary would wait for it)."""
        assert self.standby is not None
        with psycopg.connect(self.standby.url, autocommit=True) as c:
            c.execute("alter system set primary_conninfo = ''")
            c.execute("select pg_reload_conf()")
        _wait("the standby to stop streaming", lambda: not self._streaming())

    def kill_primary(self) -> None:
        """kill -9 of the primary's postmaster and every process it started (no shutdown checkpoint,
        no last WAL sent: a crash)."""
        pid = int((self.primary.datadir / "postmaster.pid").read_text().split()[0])
        children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == pid]
        os.kill(pid, signal.SIGKILL)
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait("the primary to die", lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid))
        self.dead.append(self.primary)

    def promote(self) -> float:
        """Promote the standby (``pg_promote``, waiting for it to accept writes); it is the primary from
        now on. Returns time.monotonic() when it accepted writes."""
        assert self.standby is not None
        with psycopg.connect(self.standby.url, autocommit=True) as c:
            c.execute("select pg_promote(wait => true, wait_seconds => 60)")
            promoted = time.monotonic()
            # a standby taken while the primary replicated synchronously inherited the settings: alone, it
            # would wait for a standby it does not have at every commit, and its decoding for a slot it lacks
            c.execute("alter system reset synchronous_standby_names")
            c.execute("alter system reset synchronized_standby_slots")
            c.execute("select pg_reload_conf()")
        self.primary, self.standby = self.standby, None
        return promoted

    def switch_over(self) -> int:
        """A planned switchover: the primary shut down cleanly (its last WAL streamed to the standby first), the
        standby promoted, and the old primary rewound (``pg_rewind``) and started as the new primary's standby,
        with the replication slots it had (pg_rewind keeps them). Returns the WAL position the standby had
        replayed when promoted: every slot the new primary creates lies past it, every one the old had before."""
        old = self.primary
        old.stop("fast")
        assert self.standby is not None
        with psycopg.connect(self.standby.url, autocommit=True) as c:
            _wait("the standby to replay the shutdown", lambda: bool(c.execute(
                "select pg_last_wal_replay_lsn() = pg_last_wal_receive_lsn()").fetchone()[0]))  # type: ignore[index]
            (replayed,) = c.execute("select pg_last_wal_replay_lsn() - '0/0'").fetchone()  # type: ignore[misc]
        self.promote()
        old._run(["pg_rewind", "-D", str(old.datadir), "-R",
                  f"--source-server=host=127.0.0.1 port={self.primary.port} user=postgres dbname=postgres"])
        old.start()
        self.standby = old
        _wait("the former primary to stream as a standby", lambda: self._streaming())
        self.catch_up()
        return int(replayed)

    def remove_standby(self) -> None:
        """The standby stopped and deleted (the next test adds its own)."""
        assert self.standby is not None
        self.standby.destroy()
        self.standby = None

    def fail_over(self) -> float:
        """kill -9 of the primary, then the standby promoted."""
        self.kill_primary()
        return self.promote()

    def destroy(self) -> None:
        for node in [self.primary, self.standby, *self.dead]:
            if node is None:
                continue
            if node in self.dead:
                (node.datadir / "postmaster.pid").unlink(missing_ok=True)
            node.destroy()


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
