"""Many streams on one database through `dg dev` (issue 30; run by hand: `make bench-streams`).

Per phase (1, 10, 100 streams by default): fresh databases on a private Postgres left at Postgres'
own defaults for ``max_replication_slots`` and ``max_wal_senders`` (10 each, what a platform team
finds), N tables each with an INSERT subscription and a stream delivering to its own webhook path,
`dg dev` started as `make dev` starts it (the repo's dagster.yaml: daemon, queued runs, Postgres
storage). Measured:

- time from `dg dev` start to the code location being loaded, and from then to each stream's first
  event at its webhook (one row per table is committed once the location is loaded);
- with one row a second on every table for ``--duration`` s, from when the location's start-up runs (the
  subscriptions run) have ended: commit -> webhook p50/p99 and events missing once the window has drained;
- processes and total RSS of everything `dg dev` started, at the window's end;
- the delivery runs Dagster ran: group delivery runs (``pgstream_group_delivery``: one process hosting every
  member's runs) and runs of their own (``pgstream_delivery``: mode per_batch, none here);
- CPU-seconds of those processes and of the Postgres server over the window, per event delivered (a process
  started in the window counts whole; one that ended in it counts from the window's start, in its parent);
- replication slots and WAL senders in use, and pgstream's connections to the database at the window's end and
  the most at once during the window (sampled every 50 ms).

Streams that never deliver within ``--first-timeout`` are counted and named, not waited for. The
figures are printed and appended to bench/RESULTS.md; ``--goal`` exits 1 when a phase misses
issue 45's goals (first event <= 10 s, p99 <= 250 ms, none missing, one slot and one WAL sender, at most 11
processes, RSS <= 1.5 GiB, at most 20 connections of pgstream, CPU per event at most 0.2x one stream's at 100
streams). The streams name no reader group (``streams[].reader``): they share the database's ``default``
group, as a user's streams do; ``--group NAME`` names one instead. ``--hang N``: streams 1..N deliver to a webhook
that hangs, and the figures are the other streams' (with ``--reconfigure-at`` or ``--max-run-secs``: a member's sink
call under way at a hand-over).
Usage: python bench/streams.py [--streams 1,10,100] [--duration 60] [--group NAME] [--hang N] [--goal]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import yaml
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import Webhook, append_results, machine, write_many_streams

from pgstream_dagster.devdb import LocalPostgres, ensure_running
from pgstream_dagster.engine.migrations import migrate
from tests.support.dagster_dev import DagsterDev, descendants, start_dagster_dev, stop_process_group

HERE = Path(__file__).resolve().parent
GiB = 2**30


def _config(path: Path, url: str, receivers: Webhook, count: int, group: str | None,
            checks: dict[str, Any] | None = None, max_run_secs: float | None = None, hang: int = 0) -> None:
    # (streams 1..hang: a webhook that hangs, past the sink's timeout_secs, retried for its max_retry_secs)
    streams: list[dict[str, Any]] = [
        {"id": i, "sink": {"type": "http", "url": f"{receivers.base}/{'hang' if i <= hang else 'hook'}/{i}",
                           "mode": "batch"}} for i in range(1, count + 1)]
    if max_run_secs is not None:  # (the group delivery run ends after it and the next one starts: its hand-over)
        for stream in streams:
            stream["delivery"] = {"tuning": {"max_run_secs": max_run_secs}}
    if group:  # a group named (without: the database's default group)
        for stream in streams:
            stream["reader"] = group
    write_many_streams(path, url, streams)
    if checks:  # (the checks schedule's settings: --checks-cron, --checks-rate)
        path.write_text(path.read_text() + yaml.safe_dump({"checks": checks}))


RELOAD = ("mutation ($name: String!) { reloadRepositoryLocation(repositoryLocationName: $name) { __typename } }")


def _reconfigure(dev: DagsterDev, at: float, path: Path) -> Callable[[], None]:
    """At epoch ``at``: every stream's sink changed in ``path`` (its ``timeout_secs``) and the code location
    reloaded, as a deploy does. Returns what to call once the window has ended: it raises unless the reload
    was done (a phase that measured no reload must not be reported as one)."""
    answers: list[Any] = []

    def run() -> None:
        time.sleep(max(0.0, at - time.time()))
        config = yaml.safe_load(path.read_text())
        for stream in config["streams"]:
            stream["sink"]["timeout_secs"] = 11
        path.write_text(yaml.safe_dump(config))
        answers.append(dev.graphql(RELOAD, {"name": "pgstream"}))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def done() -> None:
        thread.join(60)
        entry = (answers[0].get("data") or {}).get("reloadRepositoryLocation") or {} if answers else {}
        if entry.get("__typename") != "WorkspaceLocationEntry":
            raise RuntimeError(f"the reload --reconfigure-at asked for was not done: {answers or 'no answer'}")
    return done


def _location_loaded(dev: DagsterDev) -> bool:
    try:
        data = dev.graphql("{ workspaceOrError { ... on Workspace { locationEntries { loadStatus "
                           "locationOrLoadError { __typename } } } } }", {})
    except httpx.HTTPError:
        return False
    entries = data.get("data", {}).get("workspaceOrError", {}).get("locationEntries") or []
    return bool(entries) and all(e["loadStatus"] == "LOADED" and
                                 e["locationOrLoadError"]["__typename"] == "RepositoryLocation" for e in entries)


def _cpu(pids: list[int]) -> dict[int, float]:
    """Each process's CPU-s so far: its own and its ended children's (reaped: their whole life)."""
    out: dict[int, float] = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return out


def _parents(pids: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).ppid()
        except psutil.Error:
            pass
    return out


def _spent(before: dict[int, float], after: dict[int, float], parents: dict[int, int]) -> dict[int, float]:
    """Each process's CPU-s from ``before`` to ``after``: one started meanwhile counts whole; one that ended
    meanwhile is in its parent's (its reaped children's time holds the ended one's whole life), so what it had
    spent before is taken off its parent's (``parents``: each process's parent at ``before``)."""
    spent = {pid: secs - before.get(pid, 0.0) for pid, secs in after.items()}
    for pid, secs in before.items():
        if pid not in after and parents.get(pid) in spent:
            spent[parents[pid]] -= secs
    return spent


def _by_role(spent: dict[int, float], postgres: set[int], floor: float | None = None) -> dict[str, float]:
    """The CPU-s each kind of process spent (:func:`_spent`), most first; with ``floor``, only those that spent
    at least that."""
    roles: dict[str, float] = {}
    for pid, secs in spent.items():
        role = "postgres" if pid in postgres else _role(pid)
        roles[role] = roles.get(role, 0.0) + secs
    return {k: round(v, 1) for k, v in sorted(roles.items(), key=lambda kv: -kv[1]) if floor is None or v >= floor}


def _rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


#: what each process `dg dev` starts is, told by its command line (the first match)
_ROLES = (("run worker", "execute_run"), ("run worker", "multiprocessing.spawn"), ("code server", " grpc"),
          ("code server", "code-server"), ("daemon", "daemon"), ("webserver", "webserver"), ("log tail", "tail -F"),
          ("resource tracker", "resource_tracker"), ("dg dev", "dagster"))


def _role(pid: int) -> str:
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return "gone"
    return next((role for role, mark in _ROLES if mark in cmd), f"other ({cmd[:80]})")


class _Sampler:
    """What Postgres is busy with during the window: every 50 ms, the active backends (client, and the first
    words of their statement), counted; each count is about 50 ms of a backend's time. With ``database``:
    the most client connections to it at once, the sampler's and the bench's writer's aside."""

    def __init__(self, url: str, database: str | None = None) -> None:
        self.url, self.counts, self.stop = url, collections.Counter[str](), threading.Event()
        self.database, self.peak_connections = database, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.wait(0.05):
                for app, query in conn.execute(
                        "select application_name, regexp_replace(left(query, 70), '\\s+', ' ', 'g') "
                        "from pg_stat_activity where state = 'active' and pid <> pg_backend_pid() "
                        "and backend_type = 'client backend'"):
                    client = "member run" if "/" in (app or "") else (app or "?").split(" 0")[0][:40]
                    self.counts[f"{client}: {query}"] += 1
                if self.database is not None:
                    row = conn.execute("select count(*) from pg_stat_activity where datname = %s and backend_type = "
                                       "'client backend' and application_name <> 'pgstream bench writer' "
                                       "and pid <> pg_backend_pid()",
                                       [self.database]).fetchone()
                    self.peak_connections = max(self.peak_connections, int(row[0]) if row else 0)

    def top(self, n: int = 12) -> list[tuple[str, int]]:
        self.stop.set()
        self.thread.join(5)
        return self.counts.most_common(n)


def _statements(url: str, n: int = 15) -> dict[str, Any]:
    """The window's statements by Postgres time (pg_stat_statements, nested ones too: a trigger's statements
    are counted apart from the statement that fired it, and in it), in every database (pgstream's and
    Dagster's storage): per database the top-level calls and their total ms, then the top ``n``. Times
    are wall-clock inside Postgres: on a saturated host they include the wait for a CPU."""
    with psycopg.connect(url, autocommit=True) as conn:
        dbs = {str(db): {"calls": int(c), "total_ms": round(float(t))} for db, c, t in conn.execute(
            "select d.datname, sum(s.calls), sum(s.total_exec_time) from pg_stat_statements s "
            "join pg_database d on d.oid = s.dbid where s.toplevel group by 1 order by 1")}
        rows = conn.execute(
            "select d.datname, regexp_replace(left(s.query, 90), '\\s+', ' ', 'g'), s.calls, s.total_exec_time, "
            "s.toplevel from pg_stat_statements s join pg_database d on d.oid = s.dbid "
            "order by s.total_exec_time desc limit %s", [n]).fetchall()
        by_calls = conn.execute(
            "select d.datname, regexp_replace(left(s.query, 90), '\\s+', ' ', 'g'), s.calls, s.total_exec_time "
            "from pg_stat_statements s join pg_database d on d.oid = s.dbid where s.toplevel "
            "order by s.calls desc limit %s", [n]).fetchall()
    return {"databases": dbs,
            "most_called": [{"db": db, "query": q, "calls": c, "total_ms": round(t)} for db, q, c, t in by_calls],
            "top": [{"db": db, "query": q, "calls": c, "total_ms": round(t), "mean_ms": round(t / max(c, 1), 3),
                     "toplevel": top} for db, q, c, t, top in rows]}


def _first_batches(url: str, since: float) -> dict[str, Any]:
    """Each stream's first batch in the ledger, seconds after ``since`` (the location loaded): recorded,
    handed to a run (launched), delivered; p50 and max over the streams."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "select distinct on (stream_id) extract(epoch from created_at), extract(epoch from launched_at), "
            "extract(epoch from delivered_at) from pgstream.batches order by stream_id, id").fetchall()
    out: dict[str, Any] = {}
    for i, what in enumerate(("recorded", "launched", "delivered")):
        values = sorted(float(r[i]) - since for r in rows if r[i] is not None)
        if values:
            out[what] = [round(_pct(values, 0.5), 1), round(values[-1], 1)]
    return out


def _stages(url: str, since: float) -> dict[str, list[float]]:
    """Where the window's latency went, per batch from its ledger row (ms from its last commit, p50 and p99): to
    the recording transaction's start (``recorded``: the WAL sender, the reader, its batching rule), to the hand-over
    to a run (``launched``), to the run marking it delivered after the sink confirmed it (``delivered``)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "select extract(epoch from created_at - last_commit_at), extract(epoch from launched_at - last_commit_at), "
            "extract(epoch from delivered_at - last_commit_at) from pgstream.batches "
            "where kind = 'stream' and last_commit_at >= to_timestamp(%s)", [since]).fetchall()
    out: dict[str, list[float]] = {}
    for i, what in enumerate(("recorded", "launched", "delivered")):
        values = sorted(float(r[i]) for r in rows if r[i] is not None)
        if values:
            out[what] = [round(1000 * _pct(values, 0.5), 1), round(1000 * _pct(values, 0.99), 1)]
    return out


def _settled(dagster_url: str, since: float, timeout: float) -> float:
    """Wait until the location's runs other than the group delivery runs (the subscriptions run that its sensor
    requests at the start) have all ended, at least one having run; seconds after ``since`` (the location
    loaded) when they had, or when ``timeout`` gave up on them."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dagster_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            ended, unfinished = conn.execute(
                "select count(*) filter (where status in ('SUCCESS', 'FAILURE', 'CANCELED')), "
                "count(*) filter (where status not in ('SUCCESS', 'FAILURE', 'CANCELED')) from runs "
                "where pipeline_name <> 'pgstream_group_delivery'").fetchone()  # type: ignore[misc]
            if ended and not unfinished:
                break
            time.sleep(0.5)
    return round(time.time() - since, 1)


def _timeline(dagster_url: str, since: float) -> dict[str, Any]:
    """From the Dagster instance's storage, seconds after ``since`` (the location loaded): the group sensors'
    first ticks (start and end; the first six with what they said), the group delivery runs' creation, start,
    and the first line of each saying whom it hosts; the group sensors' tick durations (median and max over
    every tick); the other jobs' runs (how many, the first created and started, the last ended)."""
    out: dict[str, Any] = {}
    with psycopg.connect(dagster_url, autocommit=True) as conn:
        ticks = [json.loads(r[0]) for r in conn.execute("select tick_body from job_ticks order by id")]
        # (TickData keeps its fields under their old names: job_name is the instigator's)
        spans = [(t["job_name"], t["timestamp"], t.get("end_timestamp")) for t in ticks
                 if str(t.get("job_name", "")).startswith("pgstream_group_")]
        if spans:
            out["first_group_tick"] = [round(spans[0][1] - since, 1),
                                       round((spans[0][2] or spans[0][1]) - since, 1)]
            group_ticks = [t for t in ticks if str(t.get("job_name", "")).startswith("pgstream_group_")]
            out["group_ticks"] = [[round(b - since, 1), round((e or b) - since, 1),
                                   str(t.get("skip_reason") or "")[:80]]
                                  for t, (_, b, e) in zip(group_ticks, spans, strict=True)][:6]
            took = sorted(e - b for _, b, e in spans if e)
            out["group_tick_secs"] = {"n": len(took), "p50": round(_pct(took, 0.5), 2), "max": round(max(took), 2)}
        for run_id, created, start in conn.execute(
                "select run_id, extract(epoch from create_timestamp), start_time from runs "
                "where pipeline_name = 'pgstream_group_delivery' order by create_timestamp"):
            hosting = conn.execute("select extract(epoch from timestamp) from event_logs where run_id = %s and "
                                   "event like %s order by id limit 1", [run_id, "%hosting streams%"]).fetchone()
            # the run's way to its process: dequeued by the daemon, launched by the code server, its
            # process's first event (the definitions loaded), the run started
            steps = {kind: round(float(at) - since, 1) for kind, at in conn.execute(
                "select dagster_event_type, extract(epoch from min(timestamp)) from event_logs where run_id = %s "
                "and dagster_event_type in ('RUN_DEQUEUED', 'PIPELINE_STARTING', 'ENGINE_EVENT', "
                "'PIPELINE_START') group by 1", [run_id])}
            out.setdefault("group_runs", []).append({
                "created": round(float(created) - since, 1),
                "dequeued": steps.get("RUN_DEQUEUED"), "launched": steps.get("PIPELINE_STARTING"),
                "first_engine_event": steps.get("ENGINE_EVENT"), "run_start": steps.get("PIPELINE_START"),
                "started": round(float(start) - since, 1) if start else None,
                "hosting": round(float(hosting[0]) - since, 1) if hosting else None})
        for job, n, created, start, end in conn.execute(  # what else ran: the subscriptions' first materializations
                "select pipeline_name, count(*), extract(epoch from min(create_timestamp)), min(start_time), "
                "max(end_time) from runs where pipeline_name <> 'pgstream_group_delivery' group by 1 order by 1"):
            out.setdefault("other_runs", {})[job] = {
                "runs": n, "created": round(float(created) - since, 1),
                "started": round(float(start) - since, 1) if start else None,
                "ended": round(float(end) - since, 1) if end else None}
    return out


def _profile(pids: list[int], out: Path, secs: float) -> list[tuple[str, Path, subprocess.Popen[bytes]]]:
    """``--profile``: py-spy samples the code server and the run workers for the window (``pip install py-spy``;
    not one of the project's dependencies)."""
    started = []
    for pid in pids:
        role = _role(pid)
        if role in ("code server", "run worker"):
            path = out / f"profile-{role.replace(' ', '-')}-{pid}.txt"
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")  # (the venv's, not on PATH)
            started.append((f"{role} {pid}", path, subprocess.Popen(
                [spy, "record", "--format", "raw", "--rate", "50", "--nonblocking", "--duration",
                 str(int(secs)), "--pid", str(pid), "--output", str(path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    return started


def _profiled(profiles: list[tuple[str, Path, subprocess.Popen[bytes]]], n: int = 12) -> dict[str, Any]:
    """Per profiled process: its samples and the functions most often on the stack (inclusive share), of
    pgstream's code and Dagster's."""
    out: dict[str, Any] = {}
    for label, path, proc in profiles:
        proc.wait(60)
        total, inclusive = 0, collections.Counter[str]()
        for line in path.read_text().splitlines() if path.exists() else []:
            stack, _, count = line.rpartition(" ")
            total += int(count)
            frames = {f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 2)[-1]
                      for f in stack.split(";") if " (" in f and ("pgstream_dagster" in f or "dagster/" in f)}
            for frame in frames:
                inclusive[frame] += int(count)
        if total:
            out[label] = {"samples": total, "top": [(f, round(c / total, 3)) for f, c in inclusive.most_common(n)]}
    return out


def _dagster_writes(dagster_url: str, since: float) -> list[tuple[str, str, int]]:
    """The window's writes to Dagster's event log: (the run's job, or the sensor's/daemon's when none; the
    event type; how many), most first. Each costs Dagster's Postgres storage a connection of its own."""
    with psycopg.connect(dagster_url, autocommit=True) as conn:
        return [(str(job), str(kind), int(n)) for job, kind, n in conn.execute(
            "select coalesce(nullif(r.pipeline_name, ''), 'no run'), coalesce(e.dagster_event_type, 'log'), count(*) "
            "from event_logs e left join runs r on r.run_id = e.run_id "
            "where e.timestamp >= to_timestamp(%s) at time zone 'UTC' group by 1, 2 order by 3 desc limit 15",
            [since])]


def _postgres_kinds(url: str) -> dict[int, str]:
    """What each Postgres process serves (walsender, the member runs' backends, the group reader's, Dagster's
    storage, a background worker ...), by pid: where Postgres' CPU goes."""
    kinds: dict[int, str] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        for pid, backend, app, db in conn.execute(
                "select pid, backend_type, coalesce(application_name, ''), coalesce(datname, '') "
                "from pg_stat_activity"):
            if backend != "client backend":
                kinds[pid] = str(backend)
            elif db.endswith("_dagster"):
                kinds[pid] = "dagster storage"
            elif "/" in app:
                kinds[pid] = "member runs"
            else:
                # (the words of its name without ids: "pgstream group reader", "pgstream-dagster" ...)
                kinds[pid] = " ".join(w for w in app.split() if not any(c.isdigit() for c in w)) or "?"
    return kinds


def _postgres_pids(pg: LocalPostgres) -> list[int]:
    with psycopg.connect(pg.url, autocommit=True) as conn:  # its backend's parent, while the backend lives
        (pid,) = conn.execute("select pg_backend_pid()").fetchone()  # type: ignore[misc]
        parent = psutil.Process(pid).ppid()
    return [parent, *(c.pid for c in psutil.Process(parent).children())]


def _insert(table: int) -> sql.Composed:
    return sql.SQL("insert into public.{} (seq) values (%s)").format(sql.Identifier(f"bench_s{table}"))


def _writer(url: str, count: int, start: float, duration: float, out: str, base: int) -> None:
    """One row a second on every table, spread over the second."""
    committed: dict[str, float] = {}
    with psycopg.connect(url, autocommit=True, application_name="pgstream bench writer") as conn:
        tick = 0
        while start + tick <= start + duration:
            for i in range(1, count + 1):
                due = start + tick + (i - 1) / count
                time.sleep(max(0.0, due - time.time()))
                seq = base + tick
                conn.execute(_insert(i), [seq])
                committed[f"{i}:{seq}"] = time.time()
            tick += 1
    Path(out).write_text(json.dumps(committed))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


#: Dagster's storage as dagster-postgres configures it: a connection per storage call (``--storage``)
_DAGSTER_POSTGRES_STORAGE = {"postgres": {"postgres_url": {"env": "DAGSTER_POSTGRES_URL"}}}


def _phase(count: int, pg: LocalPostgres, tmpdir: Path, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    name = f"streams_{count}" if storage == "pooled" else f"streams_{count}_{storage.replace('-', '_')}"
    pg.create_database(name)
    pg.create_database(f"{name}_dagster")
    url = pg.url_for(name)
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create extension if not exists pg_stat_statements")
    receivers = Webhook()
    config = tmpdir / f"{name}.yaml"
    checks = {k: v for k, v in (("cron", args.checks_cron), ("streams_per_sec", args.checks_rate)) if v is not None}
    _config(config, url, receivers, count, args.group or None, checks, args.max_run_secs, args.hang)
    healthy = set(range(args.hang + 1, count + 1))  # the streams measured (their webhook answers)
    home = tmpdir / f"{name}_home"
    home.mkdir()
    shutil.copy(HERE.parent / "dagster.yaml", home / "dagster.yaml")
    if storage == "dagster-postgres":  # the baseline: the repository's dagster.yaml with dagster-postgres' storage
        instance = yaml.safe_load((home / "dagster.yaml").read_text())
        instance["storage"] = _DAGSTER_POSTGRES_STORAGE
        (home / "dagster.yaml").write_text(yaml.safe_dump(instance))
    dagster_url = pg.url_for(f"{name}_dagster").replace("postgresql://", "postgresql+psycopg2://", 1)
    env = {"PGSTREAM_CONFIG": str(config), "DAGSTER_HOME": str(home), "DAGSTER_POSTGRES_URL": dagster_url,
           "PYTHONUNBUFFERED": "1"}
    (tmpdir / name).mkdir()
    started = time.monotonic()
    dev = start_dagster_dev(tmpdir / name, env)
    result: dict[str, Any] = {"streams": count, "storage": storage}
    try:
        while not _location_loaded(dev):
            if dev.proc.poll() is not None or time.monotonic() - started > 300:
                raise RuntimeError(f"the code location did not load:\n{dev.tail()}")
            time.sleep(0.2)
        result["location_secs"] = time.monotonic() - started
        loaded_at = time.time()
        pg_pids = _postgres_pids(pg)
        start_all = [*descendants(dev.proc.pid), *pg_pids]
        start_cpu, start_parents = _cpu(start_all), _parents(start_all)
        start_sampler = _Sampler(pg.url)
        with psycopg.connect(url, autocommit=True) as conn:  # the start's statements alone
            conn.execute("select pg_stat_statements_reset()")
        with psycopg.connect(url, autocommit=True) as conn:
            for i in range(1, count + 1):
                conn.execute(_insert(i), [0])
        firsts: dict[int, float] = {}
        deadline = time.monotonic() + args.first_timeout
        while len(firsts) < len(healthy) and time.monotonic() < deadline:
            for stream, seq, at in receivers.received_by_stream():
                if seq == 0 and stream not in firsts:
                    firsts[stream] = at - loaded_at
            time.sleep(0.5)
        result["first_event_secs"] = sorted(firsts.values())
        # what ran while the streams waited for their first event (a process started meanwhile counts whole)
        start_pids = list(descendants(dev.proc.pid))
        start_pg = set(pg_pids) | set(_postgres_pids(pg))
        result["start_postgres_busy"] = start_sampler.top(8)
        result["start_statements"] = {k: v for k, v in _statements(url, 8).items() if k != "most_called"}
        result["start_cpu_secs_by_role"] = _by_role(
            _spent(start_cpu, _cpu([*start_pids, *start_pg]), start_parents), start_pg, floor=0.05)
        result["first_batches"] = _first_batches(url, loaded_at)
        result["never_delivered"] = sorted(healthy - set(firsts))

        # the window measures the steady state: it starts once the location's start-up runs have ended (the
        # subscriptions run applies or checks every stream's subscriptions once, taking seconds of CPU per
        # stream on this host)
        result["settled_secs"] = _settled(dagster_url.replace("+psycopg2", ""), loaded_at, args.settle_timeout)
        out = tmpdir / f"{name}.json"
        pg_pids = _postgres_pids(pg)  # (the backends of now)
        dev_pids = list(descendants(dev.proc.pid))
        cpu_before, parents = _cpu([*dev_pids, *pg_pids]), _parents([*dev_pids, *pg_pids])
        sampler = _Sampler(pg.url, str(psycopg.conninfo.conninfo_to_dict(url)["dbname"]))
        with psycopg.connect(url, autocommit=True) as conn:  # the window's statements alone
            conn.execute("select pg_stat_statements_reset()")  # (of every database)
        start = time.time() + 1
        writer = multiprocessing.Process(target=_writer, args=(url, count, start, args.duration, str(out), 1))
        writer.start()
        reconfigured = _reconfigure(dev, start + args.reconfigure_at, config) \
            if args.reconfigure_at is not None else None  # every stream's sink changed: a new configuration
        profiles = _profile(dev_pids, tmpdir / name, args.duration) if args.profile else []
        writer.join()
        if reconfigured is not None:
            reconfigured()
        if profiles:
            result["profiles"] = _profiled(profiles)
        result["postgres_busy"] = sampler.top()
        result["connections_peak"] = sampler.peak_connections
        result["statements"] = _statements(url)
        result["timeline"] = _timeline(dagster_url.replace("+psycopg2", ""), loaded_at)
        result["dagster_writes"] = _dagster_writes(dagster_url.replace("+psycopg2", ""), start)
        dev_pids = list(descendants(dev.proc.pid))
        result["processes"] = len(dev_pids)
        result["processes_by_role"] = dict(collections.Counter(_role(pid) for pid in dev_pids).most_common())
        result["rss_bytes"] = _rss(dev_pids)
        # (a backend started in the window and still there counts whole; one that ended, in the postmaster's)
        pg_pids = sorted(set(pg_pids) | set(_postgres_pids(pg)))
        spent = _spent(cpu_before, _cpu([*dev_pids, *pg_pids]), parents)
        result["cpu_secs"] = sum(spent.values())
        result["cpu_secs_by_role"] = _by_role(spent, set(pg_pids))  # where the window's CPU went
        kinds, by_kind = _postgres_kinds(pg.url), dict[str, float]()
        for p in pg_pids:
            if p in spent:
                kind = kinds.get(p, "ended (the postmaster's reaped backends)")
                by_kind[kind] = by_kind.get(kind, 0.0) + spent[p]
        result["postgres_cpu_secs"] = {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
                                       if v >= 0.05}
        with psycopg.connect(url, autocommit=True) as conn:
            result["slots"] = conn.execute("select count(*) from pg_replication_slots").fetchone()[0]  # type: ignore[index]
            result["wal_senders"] = conn.execute("select count(*) from pg_stat_replication").fetchone()[0]  # type: ignore[index]
            result["connections"] = conn.execute(  # pgstream's: the runtime's sessions on the application database
                "select count(*) from pg_stat_activity where datname = current_database() and pid <> pg_backend_pid()"
            ).fetchone()[0]  # type: ignore[index]
        committed = {(int(k.split(":")[0]), int(k.split(":")[1])): v
                     for k, v in json.loads(out.read_text()).items() if int(k.split(":")[0]) in healthy}
        drain = time.monotonic() + args.drain_timeout
        while time.monotonic() < drain:
            got = {(s, q): t for s, q, t in receivers.received_by_stream() if q > 0}
            if set(committed) <= set(got):
                break
            time.sleep(1)
        lat = [got[k] - v for k, v in committed.items() if k in got]
        buckets: dict[int, list[float]] = {}  # p99 of what committed in each 5 s of the window: when it was slow
        for k, v in committed.items():
            if k in got:
                buckets.setdefault(int((v - start) // 5), []).append(got[k] - v)
        result["p99_by_5s"] = [round(_pct(buckets[b], 0.99), 2) for b in sorted(buckets)]
        result.update(events=len(committed), missing=len(committed) - len(lat), p50=_pct(lat, 0.5),
                      p99=_pct(lat, 0.99), max=max(lat, default=0.0))
        result["cpu_per_event_ms"] = 1000 * result["cpu_secs"] / max(1, len(lat))
        result["stages_ms"] = _stages(url, start)
        if args.idle:  # what the streams cost with nothing to deliver, once every event was delivered
            time.sleep(args.idle_after)
            dev_pids, pg_pids = list(descendants(dev.proc.pid)), _postgres_pids(pg)
            idle_before, idle_parents = _cpu([*dev_pids, *pg_pids]), _parents([*dev_pids, *pg_pids])
            time.sleep(args.idle)
            pg_pids = sorted(set(pg_pids) | set(_postgres_pids(pg)))
            idle = _spent(idle_before, _cpu([*list(descendants(dev.proc.pid)), *pg_pids]), idle_parents)
            result["idle_cpu_per_sec"] = sum(idle.values()) / args.idle
            result["idle_cpu_secs_by_role"] = _by_role(idle, set(pg_pids))
            with psycopg.connect(url, autocommit=True) as conn:
                result["idle_open_runs"] = conn.execute(
                    "select count(*) from pgstream.streams where open_run_key is not null").fetchone()[0]  # type: ignore[index]
        with psycopg.connect(dagster_url.replace("+psycopg2", ""), autocommit=True) as conn:
            result["runs"] = conn.execute("select count(*) from runs where pipeline_name = 'pgstream_delivery'"
                                          ).fetchone()[0]  # type: ignore[index]
            result["group_runs"] = conn.execute("select count(*) from runs where pipeline_name = "
                                                "'pgstream_group_delivery'").fetchone()[0]  # type: ignore[index]
    finally:
        stop_process_group(dev.proc)
        receivers.stop()
        with psycopg.connect(pg.url, autocommit=True) as conn:  # the next phase counts its own slots only
            conn.execute("select pg_drop_replication_slot(slot_name) from pg_replication_slots where database = %s",
                         [name])
    return result


def _misses(r: dict[str, Any], one: dict[str, Any] | None) -> list[str]:
    misses = []
    firsts = r["first_event_secs"]
    if r["never_delivered"] or (firsts and max(firsts) > 10):
        misses.append("first event > 10 s")
    if not r["p99"] <= 0.25:
        misses.append("p99 > 250 ms")
    if r["missing"]:
        misses.append(f"{r['missing']} events missing")
    if r["rss_bytes"] > 1.5 * GiB:
        misses.append("RSS > 1.5 GiB")
    if r["processes"] > 11:
        misses.append("more than 11 processes")
    if r["slots"] > 1 or r["wal_senders"] > 1:
        misses.append("more than one slot or WAL sender")
    if max(r.get("connections", 0), r.get("connections_peak", 0)) > 20:
        misses.append("more than 20 connections")
    if one is not None and r["streams"] >= 100 and r["cpu_per_event_ms"] > 0.2 * one["cpu_per_event_ms"]:
        misses.append("CPU per event > 0.2x one stream's")
    return misses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="1,10,100", help="phases: streams per phase, one after the other")
    parser.add_argument("--duration", type=float, default=60, help="seconds of one row a second on every table")
    parser.add_argument("--first-timeout", type=float, default=120, help="give up on a stream's first event after")
    parser.add_argument("--drain-timeout", type=float, default=120, help="wait this long for the window to drain")
    parser.add_argument("--settle-timeout", type=float, default=180,
                        help="the window starts once the start-up runs (subscriptions) ended, or after this long")
    parser.add_argument("--postgres-defaults", action=argparse.BooleanOptionalAction, default=True,
                        help="max_replication_slots and max_wal_senders at 10, Postgres' defaults")
    parser.add_argument("--goal", action="store_true", help="exit 1 when a phase misses issue 45's goals")
    parser.add_argument("--group", default=None,
                        help="put every stream in this reader group (streams[].reader); default: none named (the "
                             "database's default group)")
    parser.add_argument("--checks-cron", help="checks.cron of the streams' configuration ('* * * * *': a checks run "
                                              "in every minute of the window)")
    parser.add_argument("--checks-rate", type=float, help="checks.streams_per_sec (0: no pacing)")
    parser.add_argument("--max-run-secs", type=float,
                        help="every stream's delivery.tuning.max_run_secs (the group delivery run is replaced that "
                             "often)")
    parser.add_argument("--reconfigure-at", type=float,
                        help="seconds into the window: every stream's sink changed (its timeout_secs) and the code "
                             "location reloaded, as a deploy does")
    parser.add_argument("--hang", type=int, default=0,
                        help="streams 1..N deliver to a webhook that hangs (answers after two minutes: past their "
                             "timeout_secs, retried for max_retry_secs); the figures are the other streams'")
    parser.add_argument("--storage", default="pooled",
                        help="Dagster's storage, comma-separated for one phase each, in this order: pooled (the "
                             "repository's dagster.yaml), dagster-postgres (a connection per storage call)")
    parser.add_argument("--idle", type=float, default=0,
                        help="after the window has drained and --idle-after more seconds, measure the CPU of every "
                             "process for this many seconds with nothing written (0: not measured)")
    parser.add_argument("--idle-after", type=float, default=130,
                        help="seconds without events before the idle measurement starts")
    parser.add_argument("--profile", action="store_true",
                        help="sample the code server and run workers with py-spy during the window")
    args = parser.parse_args()
    header = machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE.parent).stdout.strip()
    results: list[dict[str, Any]] = []
    settings = {"fsync": "off", "max_connections": "400", "shared_preload_libraries": "pg_stat_statements",
                "pg_stat_statements.track": "all"}
    if args.postgres_defaults:
        settings.update(max_replication_slots="10", max_wal_senders="10")
    with tempfile.TemporaryDirectory(prefix="pgstream-streams-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        pg = ensure_running(tmpdir / "pg", extra_settings=settings)
        try:
            for count in (int(c) for c in args.streams.split(",")):
                for storage in args.storage.split(","):
                    results.append(_phase(count, pg, tmpdir, args, storage))
                    print(json.dumps(results[-1], default=str), flush=True)
        finally:
            pg.destroy()
    one = next((r for r in results if r["streams"] == 1 and r["storage"] == "pooled"), None)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## Many streams through `dg dev` {stamp}, commit {commit}",
             f"Machine: {header}; load average at the end {', '.join(f'{x:.1f}' for x in os.getloadavg())}. "
             f"Method: bench/streams.py; one row a second on every stream's table for {args.duration:.0f}s; "
             + (f"every stream's delivery.tuning.max_run_secs {args.max_run_secs:g}; " if args.max_run_secs else "")
             + (f"the configuration changed and the location reloaded {args.reconfigure_at:g}s into the window; "
                if args.reconfigure_at is not None else "")
             + (f"streams 1..{args.hang}'s webhook hangs (the figures are the other streams'); " if args.hang else "")
             + f"Postgres {'defaults' if args.postgres_defaults else 'devdb settings'} for slots and WAL senders; "
             + (f"every stream in reader group {args.group!r}." if args.group else "no reader: key (group default).")]
    failed = False
    for r in results:
        firsts = r["first_event_secs"]
        misses = _misses(r, one)
        failed |= bool(misses)
        ratio = f" ({r['cpu_per_event_ms'] / one['cpu_per_event_ms']:.2f}x one stream's)" if one else ""
        lines.append(
            f"- {r['streams']} streams{'' if r['storage'] == 'pooled' else ', ' + r['storage'] + ' storage'}: "
            f"location loaded {r['location_secs']:.1f}s after start; first event "
            f"{f'p50 {_pct(firsts, 0.5):.1f}s, max {max(firsts):.1f}s' if firsts else 'none'}, "
            f"{len(r['never_delivered'])} never delivered; window from {r.get('settled_secs', 0):.1f}s (start-up "
            f"runs ended); p50 {r['p50'] * 1000:.0f} ms, p99 {r['p99'] * 1000:.0f} ms, "
            f"max {r.get('max', 0) * 1000:.0f} ms "
            f"over {r['events']} events ({r['missing']} missing; p99 of each 5 s of commits: "
            f"{' '.join(f'{x:.2f}' for x in r.get('p99_by_5s', []))} s; per batch p50/p99 ms from its last commit: "
            f"{', '.join(f'{k} {v[0]:g}/{v[1]:g}' for k, v in r.get('stages_ms', {}).items())}); "
            f"{r['processes']} processes ("
            f"{', '.join(f'{k} {v}' for k, v in r.get('processes_by_role', {}).items())}), "
            f"RSS {r['rss_bytes'] / GiB:.2f} GiB; CPU {r['cpu_per_event_ms']:.1f} ms per event{ratio}; "
            f"{r['slots']} slots, {r['wal_senders']} WAL senders, {r.get('connections', '?')} connections at the end "
            f"(at most {r.get('connections_peak', '?')} at once); "
            f"{r['runs']} delivery runs, "
            f"{r.get('group_runs', 0)} group delivery runs; CPU-s by process: "
            f"{', '.join(f'{k} {v}' for k, v in r.get('cpu_secs_by_role', {}).items())}; timeline (s after the "
            f"location loaded): {json.dumps(r.get('timeline', {}))}"
            + (f"; idle ({args.idle:g}s from {args.idle_after:g}s after the window drained, "
               f"{r['idle_open_runs']} open runs): {r['idle_cpu_per_sec']:.3f} CPU-s per second, by process "
               f"{', '.join(f'{k} {v}' for k, v in r['idle_cpu_secs_by_role'].items())} CPU-s"
               if "idle_cpu_per_sec" in r else "")
            + (f"; misses: {', '.join(misses)}" if misses else "; meets the goals"))
    append_results("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.goal and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
