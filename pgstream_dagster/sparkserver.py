"""A Spark Connect server for the delivery and replay runs (``spark.remote`` in pgstream.yaml), run by
``pgstream-dagster spark-connect`` (foreground) or ``make dev`` (background, kept under ``.pgstream/``).

Each Dagster run is a process of its own, which with a local Spark starts a JVM and Spark's Python workers before
its first event (10-35 s on 2 CPUs); with the server kept warm a run only opens a session (~0.3 s). It comes with
PySpark (nothing is downloaded). Its Python workers run this interpreter (or ``spark.pyspark.python`` of its
conf), so a local master imports the data sources from the same environment; on a cluster master each run ships
the package to its session (:func:`pgstream_dagster.engine.spark.ship_package`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .engine.cluster import cluster_conf, driver_python_problem, is_local

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_PORT = 15002
#: the server's default spark.cores.max on a standalone master (its runs share it)
SERVER_CORES_MAX = 4


class SparkServerError(RuntimeError):
    """The Spark Connect server did not start."""


def spark_home() -> str:
    from pyspark.find_spark_home import _find_spark_home

    return str(_find_spark_home())


def command(port: int = DEFAULT_PORT, master: str = "local[*]", host: str = "127.0.0.1",
            conf: dict[str, str] | None = None) -> list[str]:
    """The ``spark-submit`` command line of a Spark Connect server listening on ``host:port``, to run
    from this working directory: :class:`SparkServerError` if the server could not start the Python
    workers' interpreter (``spark.pyspark.python`` of ``conf``, a relative path) to plan the data sources."""
    python = (conf or {}).get("spark.pyspark.python")
    if python and (problem := driver_python_problem(python, Path.cwd(), "the Spark Connect server")) is not None:
        raise SparkServerError(problem)
    # a local master: nothing but the Connect port is for other hosts, and that one is ``host``: the driver's RPC
    # and block manager (random ports, on every interface by default) listen on the loopback only. A cluster
    # master's executors connect to the driver: its address stays Spark's (or conf's)
    loopback = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"} if is_local(master) else {}
    settings = {
        **loopback,
        "spark.connect.grpc.binding.address": host,
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.driver.extraJavaOptions": "-Dio.netty.tryReflectionSetAccessible=true",
        **(conf or {}),
    }
    # a cluster master: a bounded share (the server serves the runs of every stream at once:
    # SERVER_CORES_MAX unless conf says), no task retries; the package reaches its executors as a
    # session artifact of each run (engine.spark.ship_package: a JVM server ignores pyFiles)
    settings.update(cluster_conf(master, conf or {}, by_key_parallelism=[SERVER_CORES_MAX], ship_package=False))
    return [str(Path(spark_home()) / "bin" / "spark-submit"), "--class", SERVER_CLASS,
            "--name", "pgstream spark connect", "--master", master,
            *(arg for key, value in settings.items() for arg in ("--conf", f"{key}={value}"))]


def environment(conf: dict[str, str] | None = None, master: str = "local[*]") -> dict[str, str]:
    """The server's environment: its Python workers run ``spark.pyspark.python`` of ``conf`` if set
    (the executors' Python), else this interpreter; with a local master, Spark's own address is the
    loopback (``SPARK_LOCAL_IP``: whatever else it binds, none on another interface)."""
    conf = conf or {}
    local = {"SPARK_LOCAL_IP": "127.0.0.1"} if is_local(master) else {}
    return {**os.environ, **local, "SPARK_HOME": spark_home(),
            "PYSPARK_PYTHON": conf.get("spark.pyspark.python") or sys.executable,
            "PYSPARK_DRIVER_PYTHON": conf.get("spark.pyspark.driver.python") or sys.executable}


def listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first found, then theirs), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # (ended)
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found = list(children.get(pid, ()))
    for parent in found:  # (the list grows while it is read: each child's children after the children)
        found += children.get(parent, [])
    return found


def socket_inodes(pids: list[int]) -> set[str]:
    """The inodes of the sockets the processes ``pids`` hold (from /proc; none of a process that ended)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # (ended)
            continue
        for fd in fds:
            with contextlib.suppress(OSError):  # (closed since it was listed)
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    return inodes


def _listens_itself(pid: int, port: int) -> bool | None:
    """Whether the process ``pid`` or one below it listens on TCP ``port`` (from /proc; ``None`` without it): a
    listener on the port may be another process's, which took the port while the server's JVM was starting."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            return None
        for row in rows:
            fields = row.split()  # local address (hex ip:port), remote, state (0A: listening), ..., inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return bool(inodes & socket_inodes([pid, *descendants(pid)]))


def start(port: int = DEFAULT_PORT, master: str = "local[*]", log: Path | None = None,
          timeout: float = 120, conf: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a server in a session of its own and wait until it accepts connections: its own, not another
    process's on the same port (:class:`SparkServerError` when the port is taken)."""
    if listening(port):
        raise SparkServerError(f"port {port} is in use by another process: give the Spark Connect server another "
                               "(--port, PGSTREAM_SPARK_PORT)")
    with log.open("ab") if log is not None else contextlib.nullcontext(subprocess.DEVNULL) as out:
        proc = subprocess.Popen(command(port, master, conf=conf), env=environment(conf, master), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not (listening(port) and _listens_itself(proc.pid, port) is not False):
        if proc.poll() is not None:
            raise SparkServerError(f"the Spark Connect server exited with {proc.returncode} before listening on "
                                   f"port {port}" + (f"; see {log}" if log else ""))
        if time.monotonic() > deadline:
            stop(proc)
            raise SparkServerError(f"the Spark Connect server did not listen on port {port} within {timeout:.0f}s")
        time.sleep(0.2)
    return proc


def stop(proc: subprocess.Popen[bytes] | int, timeout: float = 20) -> None:
    """Stop a server started by :func:`start` (its whole process group: JVM and Python workers)."""
    pid = proc if isinstance(proc, int) else proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if isinstance(proc, subprocess.Popen):
                if proc.poll() is not None:
                    return
            else:
                try:
                    os.killpg(pid, 0)
                except ProcessLookupError:
                    return
            time.sleep(0.2)


def ensure_running(state: Path, port: int = DEFAULT_PORT, master: str = "local[*]") -> str:
    """A server for ``make dev``: reuse the one recorded in ``state/spark-connect.pid`` if it still
    listens on the port itself, else start one in the background. Returns its ``sc://`` URL."""
    pid = recorded_pid(state)
    if pid is None or not listening(port) or _listens_itself(pid, port) is False:
        proc = start(port, master, log=state / "spark-connect.log")
        (state / "spark-connect.pid").write_text(str(proc.pid))
    return f"sc://127.0.0.1:{port}"


def recorded_pid(state: Path) -> int | None:
    """The pid of the server ``make dev`` started (``state/spark-connect.pid``) if its process group is still
    alive and still the server: a pid the system gave to another process since (another user's, or one whose
    command line does not name :data:`SERVER_CLASS`) is not, and is never signalled."""
    try:
        pid = int((state / "spark-connect.pid").read_text())
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.killpg(pid, 0)
    except OSError:  # (ended, or another user's)
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # the leader ended, its group (the server's workers) not; or no /proc to look at
        return pid
    return pid if SERVER_CLASS.encode() in cmdline else None


def stop_recorded(state: Path) -> bool:
    """Stop the server ``make dev`` started (``state/spark-connect.pid``); true if one was running."""
    pid = recorded_pid(state)
    (state / "spark-connect.pid").unlink(missing_ok=True)
    if pid is not None:
        stop(pid)
    return pid is not None
