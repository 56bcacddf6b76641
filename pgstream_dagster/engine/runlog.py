"""Where the engine writes what an operator should read (a run's log, a reader's notes): :class:`Log`."""

from __future__ import annotations

from typing import Any, Protocol


class Log(Protocol):
    """Where a run writes its log lines (a Dagster op's ``context.log``, a ``logging.Logger``)."""

    def info(self, msg: str) -> Any: ...
    def warning(self, msg: str) -> Any: ...
    def error(self, msg: str) -> Any: ...
