"""A Spark standalone cluster on loopback for the tests: a master and two workers started from the
PySpark distribution (``spark-class``; nothing downloaded), bounded cores and memory each, and an
executor Python that does NOT have pgstream_dagster (nor Dagster) installed.

The executor Python is a venv made with ``venv --without-pip`` (no network) whose site-packages
holds one ``.pth`` naming a directory of symlinks to exactly the distributions the executors need
(:func:`pgstream_dagster.engine.cluster.executor_requirements` and what they require, taken from
this venv): the same list docs/spark-clusters.md gives users. pyspark itself comes from the workers'
``SPARK_HOME`` (``python/lib/pyspark.zip``), as on a real cluster.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgstream_dagster.devdb import free_port
from pgstream_dagster.engine.cluster import executor_requirements
from pgstream_dagster.sparkserver import spark_home

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;(]", requirement.strip(), maxsplit=1)[0]


def _closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions of ``names`` and of what they require (extras left out)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        seen[key] = dist
        for req in dist.requires or []:
            if "extra" not in req.partition(";")[2]:
                todo.append(_name(req))
    return list(seen.values())


def make_executor_python(base: Path) -> Path:
    """A Python for the executors without pgstream_dagster: a venv whose only packages are the
    executor requirements, linked from this environment (offline, a second or two)."""
    venv = base / "executor-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True, env=_clean_env()).stdout.strip())
    deps = base / "executor-deps"
    deps.mkdir()
    for dist in _closure([_name(r) for r in executor_requirements()]):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            if top.endswith(".pth") or top == "__pycache__" or not source.exists() or (deps / top).exists():
                continue
            (deps / top).symlink_to(source)
    (site / "pgstream-executor-deps.pth").write_text(f"{deps}\n")
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print([m for m in "
                            "('pgstream_dagster', 'dagster', 'psycopg', 'pydantic', 'pyarrow') if u.find_spec(m)])"],
                           check=True, capture_output=True, text=True, env=_clean_env(), cwd=base)
    assert probe.stdout.strip() == "['psycopg', 'pydantic', 'pyarrow']", probe.stdout + probe.stderr
    return python


def pack_executor_env(cluster: SparkCluster, archive: Path) -> Path:
    """The executors' environment as one ``.tar.gz`` for ``spark.archives``, as venv-pack makes it:
    the venv with its packages inside (the links of :func:`make_executor_python` followed) and
    ``bin/python*`` still links to the base interpreter, which must be at the same path on each host
    (here: this machine). A ``.tar.gz``: Spark unpacks it with ``tar`` (a ``.tar`` it unpacks itself,
    losing the executable bits and refusing links that point outside the archive)."""
    venv = cluster.python.parent.parent
    site = next((venv / "lib").glob("python3*/site-packages")).relative_to(venv)
    deps = cluster.base / "executor-deps"
    with tarfile.open(archive, "w:gz", compresslevel=1, dereference=True) as tar:
        for path in sorted(venv.rglob("*")):
            if path.suffix == ".pth" or (path.is_dir() and not path.is_symlink()):
                continue  # directories come with their files; the .pth named this machine's deps folder
            tar.dereference = not path.name.startswith("python")
            tar.add(path, arcname=str(path.relative_to(venv)), recursive=False)
        tar.dereference = True
        for top in sorted(deps.iterdir()):
            tar.add(top, arcname=str(site / top.name))
    return archive


def executor_origins() -> list[str]:
    """Run in a cluster child: the interpreter of the runs' session's executors' Python workers, and
    where they import psycopg and pgstream_dagster from (``sys.executable psycopg pgstream_dagster``)."""
    from pyspark.sql import SparkSession

    def probe(_rows: Any) -> Any:
        import sys

        import psycopg

        import pgstream_dagster

        yield f"{sys.executable} {psycopg.__file__} {pgstream_dagster.__file__}"

    # (the runs' session: started in a group delivery run's thread, it is the process's default one here)
    session = SparkSession.active()
    return sorted(set(session.sparkContext.parallelize(range(4), 4).mapPartitions(probe).collect()))


def _clean_env() -> dict[str, str]:
    """This environment without what would hand the workers this venv's packages."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV", "PYTHONHOME")}


@dataclass
class SparkCluster:
    master_url: str
    webui: str
    python: Path
    base: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        """The master's JSON status (workers, cores, applications)."""
        with urllib.request.urlopen(f"{self.webui}/json/", timeout=5) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]

    def worker_dirs(self) -> list[Path]:
        return sorted(self.base.glob("worker-*/work"))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


#: what the master's log says once it listens: its URL, then its web UI's (the port it bound: a port asked for
#: and taken meanwhile by another process is replaced by the next one, which only the log tells)
_MASTER_AT = re.compile(r"Starting Spark master at (spark://\S+)")
_MASTER_UI_AT = re.compile(r"Bound MasterWebUI to \S+, and started at http://[^:/\s]+:(\d+)")


def start_cluster(base: Path, workers: int = 2, cores: int = 1, memory: str = "1g",
                  timeout: float = 90) -> SparkCluster:
    """A master and ``workers`` workers (``cores`` and ``memory`` each) on 127.0.0.1, waiting until
    every worker is registered. The workers start once the master's log says where it listens."""
    python = make_executor_python(base)
    home = spark_home()
    env = {**_clean_env(), "SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_DAEMON_MEMORY": "256m",
           "PYSPARK_PYTHON": str(python)}
    spark_class = str(Path(home) / "bin" / "spark-class")
    cluster = SparkCluster("", "", python, base)
    deadline = time.monotonic() + timeout

    def waiting(what: str) -> None:
        for proc in cluster.procs:
            assert proc.poll() is None, f"a Spark daemon exited with {proc.returncode}; see {base}/*.log"
        assert time.monotonic() < deadline, f"the Spark cluster did not come up in {timeout:.0f}s ({what}); see {base}"
        time.sleep(0.3)

    try:
        master_log = base / "master.log"
        cluster.procs.append(_spawn([spark_class, MASTER_CLASS, "--host", "127.0.0.1", "--port", str(free_port()),
                                     "--webui-port", str(free_port())], master_log, env))
        while not (cluster.master_url and cluster.webui):
            text = master_log.read_text(errors="replace")
            if (url := _MASTER_AT.search(text)) and (ui := _MASTER_UI_AT.search(text)):
                cluster.master_url, cluster.webui = url.group(1), f"http://127.0.0.1:{ui.group(1)}"
            else:
                waiting("the master's URLs not in its log")
        for i in range(workers):
            work = base / f"worker-{i}" / "work"
            work.mkdir(parents=True)
            cluster.procs.append(_spawn(
                [spark_class, WORKER_CLASS, "--host", "127.0.0.1", "--cores", str(cores), "--memory", memory,
                 "--webui-port", str(free_port()), "--work-dir", str(work), cluster.master_url],
                base / f"worker-{i}.log", {**env, "SPARK_WORKER_DIR": str(work)}))
        while True:
            try:
                alive = [w for w in cluster.state().get("workers", []) if w.get("state") == "ALIVE"]
                if len(alive) == workers:
                    return cluster
            except (OSError, ValueError):  # not listening yet, or an empty answer while the UI starts
                pass
            waiting(f"{workers} workers registered")
    except BaseException:
        cluster.stop()
        raise
