"""The open run's slot reader: the ingest stage (:func:`~.ingest.follow`) in a thread of the run,
handing what it records to the run's delivery through the hand-off (:mod:`.handoff`). The delivery
engine (:mod:`.delivery`) never imports the ingest stage: its host gives it this class as a
:data:`~.handoff.ReaderFactory`."""

from __future__ import annotations

import threading

from ..config import StreamConfig
from . import ingest
from .handoff import Handoff, Log


class SlotReader:
    """The open run's slot reader (modes ``open`` and ``warm``; the delivery run makes one only while it
    is the stream's open run): a thread running :func:`~.ingest.follow`, so recording overlaps delivery
    and each transaction is decoded once. Stopped before the run closes, and however the run ends;
    the sensor reads the slot again once it is free."""

    def __init__(self, database_url: str, stream: StreamConfig, run_key: str, slot: str, handoff: Handoff | None,
                 run_id: str, log: Log) -> None:
        self.stream, self.run_id, self.log = stream, run_id, log
        self.stats = ingest.FollowStats()
        self.stats.slot = slot
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._reported = 0
        #: what it records, for the run's rounds read without Spark (none: every round goes to Spark)
        self.handoff = handoff
        self._thread: threading.Thread | None = threading.Thread(
            target=self._follow, args=(database_url, run_key), daemon=True, name=f"pgstream-reader-{stream.id}")

    def _follow(self, database_url: str, run_key: str) -> None:
        try:
            ingest.follow(database_url, self.stream, run_key, self._stop, self.stats,
                          application_name=f"pgstream reader {self.run_id}", handoff=self.handoff)
        except BaseException as exc:  # reported by the run's thread; the sensor reads the slot instead
            self._error = exc

    def __enter__(self) -> SlotReader:
        if self._thread is not None:
            self._thread.start()
            self.log.info(f"stream {self.stream.id}: this open run reads slot {self.stats.slot} "
                          "(replication protocol)")
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.report()
        kept = (f"; {self.handoff.taken} of the events delivered were taken as read, not read back from "
                f"pgstream.events ({self.handoff.missed} batches were)") if self.handoff is not None else ""
        self.log.info(f"stream {self.stream.id}: stopped reading slot {self.stats.slot}: "
                           f"{self.stats.events} events recorded in {self.stats.batches} batches{kept}")

    def report(self) -> None:
        """What the reader has to say, in the run log (from the run's own thread)."""
        notes = self.stats.notes
        while self._reported < len(notes):
            self.log.warning(f"stream {self.stream.id}: {notes[self._reported]}")
            self._reported += 1
        if self._error is not None:
            error, self._error = self._error, None
            self.log.error(f"stream {self.stream.id}: the slot reader stopped: {error!r}; the sensor "
                                "reads the slot instead")
