"""An open run's slot reader (``ingest.follow``) in a process of its own, for the tests that kill it with
SIGKILL mid-stream (tests/test_ingest.py, tests/test_slot_reader.py). Started with multiprocessing's spawn
context: the child imports this module only (the configuration and the reader, not Dagster nor a test
module), so it reads within a second or two of its start."""

from __future__ import annotations

import threading
from pathlib import Path

from pgstream_dagster.config import load_config
from pgstream_dagster.engine import ingest


def follow(url: str, config_path: str, run_key: str) -> None:
    """Read the slot of the first stream of ``config_path`` for open run ``run_key`` (application name
    "pgstream reader child") until killed."""
    stream = load_config(Path(config_path)).streams[0]
    ingest.follow(url, stream, run_key, threading.Event(), ingest.FollowStats(),
                  application_name="pgstream reader child")
