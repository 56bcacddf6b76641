"""Parquet sink: files partitioned by day, one per publish call and day, renamed into place, then the
stream's commit marker (``<path>/_pgstream/stream-<id>.json``) replaced: the marker decides what is
committed. Docs: docs/lake/parquet.md."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from .base import SinkError
from .file import fsync_path
from .lake import LakeSink, LakeSinkConfigBase, Span, arrow_schema, dataset_filter, position_of, token

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["MARKER_DIR", "STALE_TMP_SECS", "ParquetSink", "ParquetSinkConfig"]

#: the directory of the streams' commit markers, under the sink's path
MARKER_DIR = "_pgstream"

#: a temporary file untouched this long is a killed writer's (any stream's): the next recovery deletes it
STALE_TMP_SECS = 86400

#: a delivered file: stream, first and last position (batch.ord)
_FILE = re.compile(r"^stream-(\d+)-b(\d+)\.(\d+)-b(\d+)\.(\d+)\.parquet$")


class ParquetSinkConfig(LakeSinkConfigBase):
    """Write events as Parquet files under ``path``, partitioned by day, exactly once."""

    type: Literal["parquet"] = "parquet"
    path: str = Field(min_length=1, description="the directory (created on demand): day=YYYY-MM-DD/ "
                                                "subdirectories, and _pgstream/ for the commit markers")
    compression: Literal["zstd", "snappy", "gzip", "none"] = Field("zstd", description="the files' compression")


def _tmp_prefix(stream_id: int, *, delivery: bool) -> str:
    """The name a temporary file of the stream's delivery (or of a replay of it) begins with."""
    return f".tmp-stream-{stream_id}-{'b' if delivery else 'replay'}-"


def _replace(tmp: Path, final: Path) -> None:
    """Make ``tmp`` (written, closed) ``final``, durably."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


class ParquetSink(LakeSink, builds=ParquetSinkConfig):
    """Writes one Parquet file per publish call and day; a marker per stream records the last position."""

    config: ParquetSinkConfig

    def __init__(self, config: ParquetSinkConfig) -> None:
        super().__init__(config)
        self._pq: Any = self._import("pyarrow", "pyarrow.parquet")

    def where(self) -> str:
        return f"directory {self.config.path}"

    def read_token(self, stream_id: int) -> int | None:
        """The token the stream's commit marker holds, ``None`` when there is none."""
        try:
            data = json.loads((Path(self.config.path) / MARKER_DIR / f"stream-{stream_id}.json").read_text())
        except FileNotFoundError:
            return None
        return int(data["token"])

    def recover(self, stream_id: int) -> int | None:
        committed = self.read_token(stream_id)
        if committed is None:
            if self._stream_files(stream_id):
                # never delete what might be committed: the marker was removed, not never written
                raise SinkError(f"parquet sink: directory {self.config.path} holds delivered files of stream "
                                f"{stream_id} but no commit marker ({MARKER_DIR}/stream-{stream_id}.json): restore "
                                f"the marker, or move the stream's files away to write them again", sink="parquet")
            self._write_marker(stream_id, 0)  # before the first files: a write killed before its marker is undone
            committed = 0
        self._clean(stream_id, committed)
        return committed

    def _stream_files(self, stream_id: int) -> dict[Path, int]:
        """The stream's delivered files, each with the token of its first position."""
        found = [(f, _FILE.match(f.name)) for f in Path(self.config.path).glob(f"day=*/stream-{stream_id}-b*.parquet")]
        return {f: token(int(m.group(2)), int(m.group(3))) for f, m in found if m and int(m.group(1)) == stream_id}

    def _clean(self, stream_id: int, committed: int) -> None:
        """Delete the stream's files after the marker (an attempt that died before its marker), the temporary
        files its delivery left when killed, and any untouched for :data:`STALE_TMP_SECS` (a killed replay's).
        Another stream's writer, or a replay of this one, may be writing its own meanwhile: those stay."""
        for file, first in self._stream_files(stream_id).items():
            if first > committed:
                file.unlink()
        root = Path(self.config.path)
        stale = time.time() - STALE_TMP_SECS
        for tmp in [*root.glob("day=*/.tmp-*"), *root.glob(f"{MARKER_DIR}/.tmp-*")]:
            with contextlib.suppress(FileNotFoundError):
                if tmp.name.startswith(_tmp_prefix(stream_id, delivery=True)) or tmp.stat().st_mtime < stale:
                    tmp.unlink(missing_ok=True)

    def read(self, stream_id: int, columns: Sequence[str], ids: tuple[int, int] | None = None) -> pa.Table:
        import pyarrow as pa
        import pyarrow.dataset as ds

        files = sorted(Path(self.config.path).glob("day=*/stream-*.parquet"))
        if not files:
            return arrow_schema().empty_table().select(list(columns))
        # pyarrow's reader, over every file's columns (a newer file may carry a column the older ones lack)
        schema = pa.unify_schemas([self._pq.read_schema(f) for f in files])
        dataset = ds.dataset([str(f) for f in files], schema=schema, format="parquet")
        result: pa.Table = dataset.to_table(columns=list(columns), filter=dataset_filter(stream_id, ids))
        return result

    def commit(self, stream_id: int, table: pa.Table, span: Span | None) -> None:
        import pyarrow.compute as pc

        root = Path(self.config.path)
        if span is None:  # a replay: named by the event ids
            ids = table.column("id")
            name = f"stream-{stream_id}-replay-{pc.min(ids).as_py()}-{pc.max(ids).as_py()}-{uuid.uuid4().hex[:8]}"
        else:
            (b1, o1), (b2, o2) = span
            name = f"stream-{stream_id}-b{b1}.{o1}-b{b2}.{o2}"
        days = table.column("day")
        written: list[tuple[Path, Path]] = []
        try:
            for day in pc.unique(days).to_pylist():
                part = table.filter(pc.equal(days, day)).drop_columns(["day"])
                directory = root / f"day={day.isoformat()}"
                directory.mkdir(parents=True, exist_ok=True)
                tmp = directory / f"{_tmp_prefix(stream_id, delivery=span is not None)}{uuid.uuid4().hex}.parquet"
                self._pq.write_table(part, tmp, compression=self.config.compression)
                written.append((tmp, directory / f"{name}.parquet"))
            for tmp, final in written:
                _replace(tmp, final)
        finally:
            for tmp, _final in written:
                tmp.unlink(missing_ok=True)
        if span is not None:
            self._write_marker(stream_id, token(*span[1]))

    def _write_marker(self, stream_id: int, new_token: int) -> None:
        directory = Path(self.config.path) / MARKER_DIR
        directory.mkdir(parents=True, exist_ok=True)
        batch_id, ord = position_of(new_token)
        tmp = directory / f"{_tmp_prefix(stream_id, delivery=True)}{uuid.uuid4().hex}.json"
        try:
            tmp.write_text(json.dumps({"token": new_token, "batch_id": batch_id, "ord": ord}))
            _replace(tmp, directory / f"stream-{stream_id}.json")
        finally:
            tmp.unlink(missing_ok=True)
