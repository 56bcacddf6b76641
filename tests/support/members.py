"""What became of a stream's member runs (its delivery runs, hosted by its reader group's delivery run in the
background: ``Driver.group_runs``), for the child processes that drive a stream and report each run's outcome:
the group runs' member tags (``pgstream/member_<id>``: run key, state running/ended/failed, error), looked at
before each tick (a group run's tag holds its latest member run of the stream; only a tick requests the next)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pgstream_dagster.defs.names import member_tag

from .harness import Driver


@dataclass
class MemberRuns:
    """Stream ``stream_id``'s member runs seen so far (run key -> its member tag), in the order they started."""

    driver: Driver
    stream_id: int
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)

    def look(self) -> None:
        for background in self.driver.group_runs.get(self.driver.group_of(self.stream_id), []):  # launch order
            run = self.driver.instance.get_run_by_id(background.run_id or "")
            raw = run.tags.get(member_tag(self.stream_id)) if run is not None else None
            if raw:
                member = json.loads(raw)
                self.seen[member["run_key"]] = member

    def outcomes(self) -> list[bool]:
        """Whether each member run succeeded (ended, not failed), in order; one still running: False."""
        return [m["state"] == "ended" for m in self.seen.values()]

    def finished(self) -> list[dict[str, Any]]:
        """The member runs that ended or failed, in order."""
        return [m for m in self.seen.values() if m["state"] in ("ended", "failed")]


def drive(driver: Driver, members: MemberRuns, done: Callable[[], bool], timeout: float = 300) -> None:
    """Tick the stream's group until ``done()`` (the runs of its own a tick requests executed), looking at its
    member runs before each tick."""
    deadline = time.monotonic() + timeout
    while True:
        members.look()
        if done():
            return
        assert time.monotonic() < deadline, f"not done in {timeout:g}s; member runs {list(members.seen.values())}"
        for request in driver.tick(members.stream_id).run_requests or []:
            driver.execute(request)
        time.sleep(0.05)


def end(driver: Driver, *members: MemberRuns) -> None:
    """End the live group runs (their member runs end: each one's state is its last) and look once more."""
    driver.stop_group_runs("the child is done")
    for m in members:
        m.look()
