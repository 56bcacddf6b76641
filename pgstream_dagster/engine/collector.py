"""The garbage collector's thresholds while pgstream moves events in bulk: a delivery run delivering
(``defs/jobs.py``) and a sensor tick recording (``defs/sensors.py``).

Python collects its youngest generation every 700 new tracked objects (thresholds 700, 10, 10). A
round's decoded rows and events are tracked objects that all live until the round is delivered or
recorded, so at those thresholds the collector re-walked them every few hundred events and
re-scanned the old generation every few seconds, freeing next to nothing: 9.0 of a run's 39.6
CPU-seconds in a 60 s sustained run, 4.2 of 38.8 in the sensor's ticks when the runs do not stay open
(bench/RESULTS.md, session 10). Objects without reference cycles are freed by their reference counts
either way."""

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: while events move in bulk (Python's own: 700, 10, 10)
BULK_THRESHOLDS = (50_000, 20, 20)


class _FewerCollections:
    """:data:`BULK_THRESHOLDS` while a run delivers or a tick records, then the process's own again
    once the last of them in the process ends (a code server evaluates several sensors at once; tests
    and ``execute_in_process`` run several runs in one process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._before = gc.get_threshold()

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if not self._holders:
                self._before = gc.get_threshold()
                gc.set_threshold(*BULK_THRESHOLDS)
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if not self._holders:
                    gc.set_threshold(*self._before)


#: ``with fewer_collections(): ...``
fewer_collections = _FewerCollections()
