"""Child process of tests/test_memory_bytes.py: a delivery run (or a replay) of events that are
large as text, in a process of its own, so that its peak resident memory is what the run used.

After a warm-up round (a small event delivered, so Dagster, the sink and the connections are
loaded), the peak is reset (``/proc/self/clear_refs``) and the big events are written by Postgres
(``repeat``: they are small stored, large as text; nothing of them passes through this process
before delivery); the run delivers them to a file sink. Reported: the resident memory when the peak
was reset and the peak after (kB), and the ids of the lines written, in order.

Usage: python -m tests.support.memory_child SPEC_JSON   (keys: tmp, db_url, dagster_storage_url,
events, mib, mode: "run" (a delivery run of its own: mode per_batch) | "open" (hosted by the reader group's
delivery run) | "replay", delivery: extra delivery settings)
Writes SPEC_JSON.out.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import re
import sys
from pathlib import Path
from typing import Any

import psycopg

from pgstream_dagster.config import DIRECT_MAX_EVENTS
from pgstream_dagster.defs.names import REPLAY_JOB, REPLAY_OP

from .dagster_instance import child_instance
from .harness import Driver, tick_until, write_config

STREAM = 1


def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(key + r":\s+(\d+)", text).group(1))  # type: ignore[union-attr]
            for key in ("VmHWM", "VmRSS")}


def _reset_peak() -> int:
    """Start measuring the peak from now; the resident memory now (kB)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status()["VmRSS"]


def _lines(path: Path) -> int:
    if not path.exists():
        return 0
    count = 0
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
    return count


def _ids(path: Path) -> list[int]:
    """The id of every line (read a MiB at a time: the lines are long)."""
    ids: list[int] = []
    with path.open("rb") as f:
        start = True
        while block := f.read(1 << 20):
            pos = 0
            while pos < len(block):
                if start:
                    match = re.match(rb'\{"id":(\d+),', block[pos:pos + 40])
                    assert match is not None, block[pos:pos + 40]
                    ids.append(int(match.group(1)))
                    start = False
                newline = block.find(b"\n", pos)
                if newline < 0:
                    break
                pos, start = newline + 1, True
    return ids


#: the child's own deadline (seconds): past it, every thread's stack goes to SPEC_JSON.stacks and the child exits,
#: before the test's timeout, so a child that hangs says where
HANG_SECS = 480


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    stacks = Path(sys.argv[1] + ".stacks").open("w")  # (open until the process ends)
    faulthandler.dump_traceback_later(HANG_SECS, exit=True, file=stacks)
    tmp, db_url, mode = Path(spec["tmp"]), spec["db_url"], spec["mode"]
    out = tmp / "out.jsonl"
    delivery: dict[str, Any] = {"chunk_size": 500, **spec.get("delivery", {})}
    if mode == "open":  # hosted by the reader group's delivery run (in a thread of this process)
        delivery["mode"] = "open"  # (the product's max_run_secs: the run stays open through the measurement)
    elif mode == "run":  # a Dagster run of its own (mode per_batch), reading without Spark as an open run does
        delivery.update(mode="per_batch", tuning={"direct_max_events": DIRECT_MAX_EVENTS})
    cfg = write_config(tmp / "pgstream.yaml", db_url, [
        {"id": STREAM, "batch": {"max_size": 1000, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
         "delivery": delivery, "sink": {"type": "file", "path": str(out)}}])
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select pgstream.ensure_stream(%s)", [STREAM])
    result: dict[str, Any] = {}
    with child_instance(spec["dagster_storage_url"], tmp) as instance:
        driver = Driver(cfg, instance)
        driver.tick(STREAM)

        def insert(n: int, chars: int) -> None:
            with psycopg.connect(db_url, autocommit=True) as c:
                c.execute("insert into pgstream.events (payload, stream_id) "
                          "select jsonb_build_object('n', g, 'pad', repeat('x', %s)), %s "
                          "from generate_series(1, %s) g", [chars, STREAM, n])

        insert(2, 10)  # warm-up: everything a run loads is loaded before the peak is reset
        if mode == "open":  # the group's delivery run, launched by the first tick, delivers in the background
            tick_until(driver, STREAM, lambda: _lines(out) >= 2, timeout=120)
        else:
            driver.run_until(STREAM, lambda: _lines(out) >= 2, timeout=120)
        result["rss_kb"] = _reset_peak()
        insert(spec["events"], spec["mib"] * 2**20)
        total = 2 + spec["events"]
        if mode == "replay":
            driver.run_until(STREAM, lambda: _lines(out) >= total, timeout=300)
            out.unlink()
            result["rss_kb"] = _reset_peak()
            job = driver.defs.resolve_job_def(REPLAY_JOB)
            replayed = job.execute_in_process(run_config={"ops": {REPLAY_OP: {"config": {
                "stream_id": STREAM, "all_events": True}}}}, instance=instance, raise_on_error=False)
            result["replay_success"] = replayed.success
        elif mode == "open":
            tick_until(driver, STREAM, lambda: _lines(out) >= total, timeout=300)
        else:
            driver.run_until(STREAM, lambda: _lines(out) >= total, timeout=300)
        result["peak_kb"] = _status()["VmHWM"]
        driver.close()  # the group's delivery run ends (asked to, as its sensor asks)
        result["runs"] = [r.success for r in driver.results]
        with psycopg.connect(db_url) as c:
            result["expected"] = [r[0] for r in c.execute(
                "select id from pgstream.events where stream_id = %s order by id", [STREAM])]
            result["dead_letters"] = [list(r) for r in c.execute(
                "select event_id, error from pgstream.dead_letters order by id")]
    result["ids"] = _ids(out) if out.exists() else []
    Path(sys.argv[1] + ".out").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
