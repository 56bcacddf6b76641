"""The garbage collector's thresholds while pgstream moves events in bulk (a delivery run delivering, a
sensor tick recording): a round's rows all live until it is done, so the default thresholds (700, 10, 10)
re-walked them every few hundred events for nothing (9.0 of a run's 39.6 CPU-seconds: bench/RESULTS.md,
session 10). Objects without reference cycles are freed by their reference counts either way.
"""

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: while events move in bulk (Python's own: 700, 10, 10)
BULK_THRESHOLDS = (50_000, 20, 20)


_lock = threading.Lock()
_holders = 0  # the blocks in the process inside fewer_collections()
_before = gc.get_threshold()  # the process's own thresholds


@contextmanager
def fewer_collections() -> Iterator[None]:
    """:data:`BULK_THRESHOLDS` while a run delivers or a tick records, then the process's own once the last
    of them in the process ends (a code server evaluates several sensors at once)."""
    global _holders, _before
    with _lock:
        if not _holders:
            _before = gc.get_threshold()
            gc.set_threshold(*BULK_THRESHOLDS)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if not _holders:
                gc.set_threshold(*_before)
