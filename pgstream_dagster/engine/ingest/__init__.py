"""Ingest: move what commits on a reader group's slot into its members' ledgers, without Dagster.

* :mod:`.source`: where transactions come from (:class:`~.source.SlotSource`: a peek, or the
  replication protocol);
* :mod:`.recorder`: the one recording loop (read -> batch -> record -> confirm) and its one batching
  rule; :func:`consume` reads a joining member's own slot until its group takes it over;
* :mod:`.group`: a reader group's reader (:func:`consume_group`): one slot decoded once for its
  streams, the slot kept usable (recovering from the table what a lost slot took with it), and the
  hand-over of a stream that had its own slot.
"""

from .group import GroupResult, GroupStream, consume_group, ensure_group, group_log, unconfigured
from .recorder import (
    FOLLOW_CHECK_SECS,
    RECORD_EVERY_SECS,
    Batching,
    Recorder,
    StreamLedger,
    consume,
    record_pass,
    unrecorded,
)
from .results import ConsumeResult
from .source import PeekSource, SlotSource, StreamSource

__all__ = [
    "FOLLOW_CHECK_SECS",
    "RECORD_EVERY_SECS",
    "Batching",
    "ConsumeResult",
    "GroupResult",
    "GroupStream",
    "PeekSource",
    "Recorder",
    "SlotSource",
    "StreamLedger",
    "StreamSource",
    "consume",
    "consume_group",
    "ensure_group",
    "group_log",
    "record_pass",
    "unconfigured",
    "unrecorded",
]
