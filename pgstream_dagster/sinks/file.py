"""File sink: appends one JSON line per event and fsyncs before ``publish`` returns. Permanent
rejections: none (a full disk, a quota, permissions are the file system's and can be fixed)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import ClassVar, Literal

from .base import Event, Sink, SinkConfigBase, SinkError, describe_exception

__all__ = ["FileSink", "FileSinkConfig"]


class FileSinkConfig(SinkConfigBase):
    """Append JSON lines ``{"id", "stream_id", "created_at", "payload", "metadata"}`` to ``path``."""

    type: Literal["file"] = "file"
    path: str


class FileSink(Sink, builds=FileSinkConfig):
    """Appends events as JSON lines (UTF-8), creating the file and its directories on demand. A batch is
    written with unbuffered appends, then fsynced; a failed one is truncated away (best effort), so that
    the file only ever holds whole lines."""

    config: FileSinkConfig
    accepts_json_lines: ClassVar[bool] = True

    def __init__(self, config: FileSinkConfig) -> None:
        super().__init__(config)
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            path = Path(self.config.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            created = not path.exists()
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if created:
                fsync_path(path.parent)
        return self._fd

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        self._append(("\n".join(event.to_json() for event in events) + "\n").encode(),
                     lambda reason: self._error(events, reason))

    def publish_json_lines(self, lines: bytes, count: int, first_id: int, last_id: int) -> None:
        if not count:
            return
        if not lines.endswith(b"\n"):
            raise ValueError("JSON lines end with a newline")
        self._append(lines, lambda reason: SinkError(
            f"file sink: events {first_id}..{last_id} ({count} events): {reason}", sink="file"))

    def _append(self, data: bytes, error: Callable[[str], SinkError]) -> None:
        view = memoryview(data)
        start: int | None = None
        try:
            fd = self._open()
            start = os.lseek(fd, 0, os.SEEK_END)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as exc:
            if start is not None and self._fd is not None:
                with suppress(OSError):  # drop the partially written batch (best effort)
                    os.ftruncate(self._fd, start)
            self.close()
            raise error(f"cannot append to {self.config.path}: {describe_exception(exc)}") from exc

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with suppress(OSError):
                os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory to make a newly created entry in it durable (best effort: not
    supported everywhere). The file sink and the parquet sink use it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
