"""What a run's Spark needs when its executors are not this process: :func:`package_zip` (cached under
``$PGSTREAM_CACHE_DIR`` by version and content), shipped by :func:`cluster_conf` with a bounded share of a cluster
master and ``spark.task.maxFailures`` 1 (the user's ``spark.conf`` wins); :func:`executor_requirements`; and the
settings the executors, or the run's host, cannot use (:func:`sink_problems`, :func:`driver_python_problem`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import ipaddress
import os
import re
import tempfile
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

#: the pgstream_dagster package directory (this module is pgstream_dagster/engine/cluster.py)
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

#: Distributions the executors import (data sources: psycopg, pyarrow; ``by_key``'s sinks and progress:
#: pydantic, httpx, tenacity, pyyaml, croniter), before a sink's client library (:data:`SINK_EXTRAS`).
EXECUTOR_REQUIREMENTS = ("psycopg", "psycopg-binary", "pydantic", "httpx", "tenacity", "pyarrow", "pyyaml",
                         "croniter")

#: The pgstream-dagster extra that holds a sink type's client library.
SINK_EXTRAS = {"redis": "redis", "rabbitmq": "rabbitmq", "nats": "nats", "kafka": "kafka", "mqtt": "mqtt",
               "sqs": "aws", "sns": "aws", "kinesis": "aws", "delta": "lake", "iceberg": "lake", "parquet": "lake"}

#: The settings this module defaults for a cluster master (each one the user's spark.conf may set).
PY_FILES = "spark.submit.pyFiles"
CORES_MAX = "spark.cores.max"
MAX_FAILURES = "spark.task.maxFailures"

_ZIP_SUFFIXES = {".py", ".typed", ".yaml", ".sql"}


def is_local(master: str) -> bool:
    """``local``, ``local[4]``, ``local[*]``, ``local[4,2]``: Spark in this process, no executors
    elsewhere (``local-cluster[...]`` has executors of its own)."""
    return re.fullmatch(r"local(\[[^\]]*\])?", master.strip()) is not None


def is_loopback(host: str) -> bool:
    host = host.strip().strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def master_hosts(master: str) -> list[str] | None:
    """The hosts of a master URL (``spark://h1:7077,h2:7077``, ``k8s://https://h:443``), None when
    it names none (``yarn``: the Hadoop configuration does)."""
    m = master.strip()
    if m.startswith("k8s://"):
        m = m.removeprefix("k8s://")
        host = urlsplit(m if "://" in m else "https://" + m).hostname
        return [host] if host else None
    if m.startswith("spark://"):
        return [_host_of(part) for part in m.removeprefix("spark://").split(",") if part]
    return None


def _host_of(hostport: str) -> str:
    """``h``, ``h:9092``, ``[::1]:9092`` -> the host."""
    hostport = hostport.strip()
    if hostport.startswith("["):
        return hostport[1:].split("]", 1)[0]
    return hostport.rsplit(":", 1)[0] if hostport.count(":") == 1 else hostport


def executors_elsewhere(master: str, remote: str | None) -> bool:
    """Whether executors may run on another machine: a cluster master that is not on loopback, or
    a Spark Connect server that is not (its executors are where it runs, or further)."""
    if remote:
        host = urlsplit(remote.replace("sc://", "http://", 1)).hostname or ""
        return not is_loopback(host)
    if is_local(master) or master.strip().startswith("local-cluster"):
        return False
    hosts = master_hosts(master)
    return hosts is None or not all(is_loopback(h) for h in hosts)


def cluster_conf(master: str, conf: dict[str, str], by_key_parallelism: Iterable[int] = (),
                 ship_package: bool = True) -> dict[str, str]:
    """What pgstream adds for a cluster ``master`` to the user's ``conf`` (which wins): the package zip, a bounded
    ``spark.cores.max`` (standalone) and ``spark.task.maxFailures`` 1 (failover retries, not Spark); local: none."""
    if is_local(master):
        return {}
    out: dict[str, str] = {}
    if ship_package:
        files = [f for f in conf.get(PY_FILES, "").split(",") if f.strip()]
        out[PY_FILES] = ",".join([*files, str(package_zip())])
    if master.strip().startswith(("spark://", "local-cluster")) and CORES_MAX not in conf:
        # a run's share, what its busiest stage can use: 1 core for ordered delivery and replay (a partition at a
        # time), delivery.parallelism for by_key
        out[CORES_MAX] = str(max([1, *by_key_parallelism]))
    if MAX_FAILURES not in conf:
        out[MAX_FAILURES] = "1"
    return out


def cache_dir() -> Path:
    base = os.environ.get("PGSTREAM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pgstream-dagster")
    return Path(base)


#: a cached package zip unused this long is deleted (:func:`_prune`), and so is a writer's leftover temporary file
ZIP_UNUSED_SECS = 7 * 24 * 3600


def package_zip(directory: Path | None = None) -> Path:
    """A zip of the imported ``pgstream_dagster`` package, built once per version and content in ``directory``
    (default :func:`cache_dir`) and touched at each use; others unused for :data:`ZIP_UNUSED_SECS` are deleted."""
    files = [path for path in sorted(PACKAGE_ROOT.rglob("*"))
             if path.is_file() and "__pycache__" not in path.parts and path.suffix in _ZIP_SUFFIXES]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(PACKAGE_ROOT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    version = "0"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        version = importlib.metadata.version("pgstream-dagster")
    name = f"pgstream_dagster-{version}-{digest.hexdigest()[:16]}.zip"
    if directory is not None:
        return _write_zip(files, directory, name)
    try:
        return _write_zip(files, cache_dir(), name)
    except OSError:  # a read-only home (a container): the temporary directory instead
        return _write_zip(files, Path(tempfile.gettempdir()) / f"pgstream-dagster-{os.getuid()}", name)


def _write_zip(files: list[Path], target_dir: Path, name: str) -> Path:
    target = target_dir / name
    if target.exists():
        os.utime(target)  # in use: see _prune
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    _prune(target_dir)
    fd, tmp = tempfile.mkstemp(dir=target_dir, prefix=".pgstream-zip-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in files:
                zf.write(path, "pgstream_dagster/" + path.relative_to(PACKAGE_ROOT).as_posix())
        os.replace(tmp, target)  # atomic: a concurrent run sees the whole zip or none
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _prune(directory: Path) -> None:
    """Delete the package zips (and leftover temporary files) of ``directory`` no run has used (touched) for
    :data:`ZIP_UNUSED_SECS`: each new version or content of the package adds one."""
    cutoff = time.time() - ZIP_UNUSED_SECS
    for path in [*directory.glob("pgstream_dagster-*.zip"), *directory.glob(".pgstream-zip-*.tmp")]:
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to delete
            if path.stat().st_mtime < cutoff:
                path.unlink()


def executor_requirements(sink_types: Iterable[str] = ()) -> list[str]:
    """The distributions an executor's Python needs (pinned to the versions installed here), plus the client
    libraries of ``sink_types`` (the sinks of ``by_key`` streams); pyspark comes from the workers' Spark."""
    names = list(EXECUTOR_REQUIREMENTS)
    extras = {SINK_EXTRAS[t] for t in sink_types if t in SINK_EXTRAS}
    if extras:
        requires: list[str] = []
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            requires = importlib.metadata.requires("pgstream-dagster") or []
        for req in requires:
            spec, _, marker = req.partition(";")
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if extra and extra.group(1) in extras:
                names.append(re.split(r"[\s<>=!~\[]", spec.strip(), maxsplit=1)[0])
    out: list[str] = []
    for name in dict.fromkeys(names):
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out


def driver_python_problem(python: str, cwd: Path, driver: str = "the run") -> str | None:
    """Why the Spark driver (the run, or a Spark Connect server) could not start ``python`` from ``cwd`` to plan
    the data sources, or None: a path relative to the executors' directory missing here fails each first read."""
    if os.path.isabs(python) or "/" not in python:
        return None
    if (cwd / python).is_file() and os.access(cwd / python, os.X_OK):
        return None
    return (f"spark.pyspark.python {python!r} is relative: the executors run it in their working directory "
            f"(a packed environment in spark.archives), and Spark also starts it on {driver}'s host, from "
            f"{driver}'s working directory {str(cwd)!r}, to plan pgstream's data sources; it is not there. Unpack "
            f"the same environment into that directory, or give an absolute path that exists on every host")


def _url_host(value: str) -> str | None:
    if "://" not in value:
        return None
    try:
        return urlsplit(value).hostname
    except ValueError:
        return None


def database_problem(url: str) -> str | None:
    """Why the executors cannot use ``url`` (they read pgstream.events with it), or None."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(url)
    except Exception:  # an invalid URL fails at connect time with psycopg's own message
        return None
    # the hosts it names ('' for a Unix socket: this machine's)
    hosts = str(info.get("host") or info.get("hostaddr") or "").split(",")
    if any(h == "" or h.startswith("/") for h in hosts):
        return "names a Unix socket (no host): each executor would connect to a Postgres on its own host"
    if any(is_loopback(h) for h in hosts):
        return "names a loopback host: each executor would connect to a Postgres on its own host"
    return None


#: per sink type, its fields that are file paths, and those that name hosts without a URL (``host[:port],...``)
_PATH_FIELDS = {"file": ("sink.path",), "mqtt": ("sink.tls.ca_certs", "sink.tls.certfile", "sink.tls.keyfile")}
_HOST_FIELDS = {"mqtt": ("sink.host",), "kafka": ("sink.bootstrap_servers",)}


def sink_problems(sink: object, elsewhere: bool) -> list[str]:
    """What in a sink config (built on the executors: ``by_key``) means something else there: relative file
    paths, an in-memory sink and, with ``elsewhere``, loopback hosts. ``key: why`` each, never a value."""
    from pydantic import BaseModel, SecretStr

    problems: list[str] = []
    kind = getattr(sink, "type", "")
    if kind == "memory":
        return ["sink.type: memory: the events would stay in the executors' memory"]
    loopback = "a loopback host means each executor's own host"

    def check(key: str, value: object) -> None:
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, BaseModel):
            for name in type(value).model_fields:
                check(f"{key}.{name}", getattr(value, name))
        elif isinstance(value, dict):
            for k, v in value.items():
                check(f"{key}.{k}", v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                check(f"{key}[{i}]", v)
        elif not isinstance(value, str):
            return
        elif key in _PATH_FIELDS.get(kind, ()):
            if value and not os.path.isabs(value):
                problems.append(f"{key}: a relative path is relative to each executor's working directory")
        elif not elsewhere:
            return
        elif key in _HOST_FIELDS.get(kind, ()):
            if any(is_loopback(_host_of(host)) for host in value.split(",") if host.strip()):
                problems.append(f"{key}: {loopback}")
        elif (host := _url_host(value)) is not None and is_loopback(host):
            problems.append(f"{key}: {loopback}")
        elif kind == "postgres" and key == "sink.url" and host is None and (problem := database_problem(value)):
            problems.append(f"{key}: {problem}")

    if isinstance(sink, BaseModel):
        check("sink", sink)
    return problems
