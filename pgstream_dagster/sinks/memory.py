"""In-memory sink. FOR UNIT TESTS ONLY: events live in a dict of the current process and vanish with it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from .base import Event, Sink, SinkConfigBase

__all__ = ["MemorySink", "MemorySinkConfig"]

_lock = threading.Lock()
_delivered: dict[str, list[Event]] = {}
_failed_calls: dict[str, int] = {}
_rejections: dict[str, dict[int, int]] = {}
_injected: dict[str, int] = {}
_opened: dict[str, int] = {}
_closed: dict[str, int] = {}


class MemorySinkConfig(SinkConfigBase):
    """Deliver into a process-global list named ``name`` (unit tests only)."""

    type: Literal["memory"] = "memory"
    name: str = "default"
    fail_times: int = Field(default=0, ge=0)
    reject_ids: list[int] = Field(default_factory=list)
    reject_times: int = Field(default=0, ge=0)
    reject_whole_call: bool = False


class MemorySink(Sink, builds=MemorySinkConfig):
    """Appends events to a process-global list; read it back with :meth:`delivered`. Unit tests only."""

    config: MemorySinkConfig

    def __init__(self, config: MemorySinkConfig) -> None:
        super().__init__(config)
        self._closed = False
        with _lock:
            _opened[config.name] = _opened.get(config.name, 0) + 1

    def publish(self, events: Sequence[Event]) -> None:
        name = self.config.name
        with _lock:
            if self._closed:
                raise self._error(events, f"the sink {name!r} is closed")
            failed = _failed_calls.get(name, 0)
            if failed < self.config.fail_times:
                _failed_calls[name] = failed + 1
                raise self._error(events, f"injected failure {failed + 1} of {self.config.fail_times} (fail_times) "
                                          f"for {name!r}")
            if _injected.get(name, 0) > 0:
                _injected[name] -= 1
                raise self._error(events, f"injected failure (fail_next) for {name!r}")
            rejected = self._first_rejected(events)
            if rejected is None:
                _delivered.setdefault(name, []).extend(events)
                return
            index, count = rejected
            event = events[index]
            times = self.config.reject_times
            what = f"injected permanent rejection {count}" + (f" of {times} (reject_times)" if times else "")
            if self.config.reject_whole_call and len(events) > 1:
                reason = f"{what} of event {event.id} for {name!r}; the whole call is rejected (reject_whole_call)"
                raise self._error(events, reason, permanent=True)
            _delivered.setdefault(name, []).extend(events[:index])
            raise self._error([event], f"{what} for {name!r} (reject_ids)", permanent=True)

    def _first_rejected(self, events: Sequence[Event]) -> tuple[int, int] | None:
        """(index, rejection number) of the first event rejected this time, counting the rejection."""
        reject = set(self.config.reject_ids)
        if not reject:
            return None
        counts = _rejections.setdefault(self.config.name, {})
        times = self.config.reject_times
        for index, event in enumerate(events):
            if event.id in reject and (times == 0 or counts.get(event.id, 0) < times):
                counts[event.id] = counts.get(event.id, 0) + 1
                return index, counts[event.id]
        return None

    def close(self) -> None:
        with _lock:
            if not self._closed:
                self._closed = True
                _closed[self.config.name] = _closed.get(self.config.name, 0) + 1

    @staticmethod
    def fail_next(name: str = "default", times: int = 1) -> None:
        """The next ``times`` publish calls on ``name`` (any sink of it) raise :class:`SinkError`
        without delivering anything (not permanent)."""
        with _lock:
            _injected[name] = times

    @staticmethod
    def opened(name: str = "default") -> int:
        """How many sinks of ``name`` were built (unpickled ones included)."""
        with _lock:
            return _opened.get(name, 0)

    @staticmethod
    def closed(name: str = "default") -> int:
        """How many sinks of ``name`` were closed (each counted once)."""
        with _lock:
            return _closed.get(name, 0)

    @staticmethod
    def delivered(name: str = "default") -> list[Event]:
        """A copy of everything delivered so far under ``name``, in delivery order."""
        with _lock:
            return list(_delivered.get(name, ()))

    @staticmethod
    def rejections(name: str = "default") -> dict[int, int]:
        """How many times each event id was rejected so far under ``name`` (``reject_ids``)."""
        with _lock:
            return dict(_rejections.get(name, {}))

    @staticmethod
    def reset(name: str = "default") -> None:
        """Forget the events delivered under ``name``, its injected failures, rejection and sink counts."""
        with _lock:
            for state in (_delivered, _failed_calls, _rejections, _injected, _opened, _closed):
                state.pop(name, None)
