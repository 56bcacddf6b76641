"""The lake sinks' test helpers: a sink config per format under a test's directory (Iceberg's SQL
catalog in a database of its own on the tests' Postgres), and what the table holds, read with the
format's own reader."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.sinks import build_sink
from pgstream_dagster.sinks.lake import LakeSink

from .sinks import unique

LAKE_FORMATS = ("delta", "iceberg", "parquet")


def lake_config(kind: str, tmp: Path, pg: LocalPostgres) -> dict[str, Any]:
    """A sink config of format ``kind`` writing under ``tmp`` (a new table each call)."""
    name = unique(kind).replace("-", "_")
    if kind == "iceberg":
        pg.create_database(name)
        return {"type": "iceberg", "catalog_url": pg.url_for(name), "warehouse": f"file://{tmp / name}",
                "table": "pgstream.events"}
    return {"type": kind, "path": str(tmp / name)}


def lake_ids(config: dict[str, Any], stream_id: int) -> Counter[int]:
    """How often each event id of the stream is in the table (read by the format's own reader)."""
    sink = build_sink(config)
    assert isinstance(sink, LakeSink)
    with sink:
        return Counter(sink.ids(stream_id))
