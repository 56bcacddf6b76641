"""In-memory sink. FOR UNIT TESTS ONLY: events live in a dict of the current process and vanish with it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar, Literal

from pydantic import Field

from .base import Event, Sink, SinkConfigBase, SinkError

__all__ = ["MemorySink", "MemorySinkConfig"]

_lock = threading.Lock()
_delivered: dict[str, list[Event]] = {}
_failed_calls: dict[str, int] = {}


class MemorySinkConfig(SinkConfigBase):
    """Deliver into a process-global list named ``name`` (unit tests only).

    ``fail_times``: the first N publish calls on this ``name`` (counted per process, across sink
    instances, until :meth:`MemorySink.reset`) raise :class:`SinkError` without delivering anything.
    """

    type: Literal["memory"] = "memory"
    name: str = "default"
    fail_times: int = Field(default=0, ge=0)

    def build(self) -> MemorySink:
        return MemorySink(self)


class MemorySink(Sink):
    """Appends events to a process-global list; read it back with :meth:`delivered`. Unit tests only."""

    type_name: ClassVar[str] = "memory"
    config: MemorySinkConfig

    def __init__(self, config: MemorySinkConfig) -> None:
        super().__init__(config)

    def publish(self, events: Sequence[Event]) -> None:
        name = self.config.name
        with _lock:
            failed = _failed_calls.get(name, 0)
            if failed < self.config.fail_times:
                _failed_calls[name] = failed + 1
                raise SinkError.for_events(
                    "memory",
                    events,
                    f"injected failure {failed + 1} of {self.config.fail_times} (fail_times) for {name!r}",
                )
            _delivered.setdefault(name, []).extend(events)

    @staticmethod
    def delivered(name: str = "default") -> list[Event]:
        """A copy of everything delivered so far under ``name``, in delivery order."""
        with _lock:
            return list(_delivered.get(name, ()))

    @staticmethod
    def reset(name: str = "default") -> None:
        """Forget the events delivered under ``name`` and its injected-failure count."""
        with _lock:
            _delivered.pop(name, None)
            _failed_calls.pop(name, None)
