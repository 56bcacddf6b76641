"""Ingest: move what commits on a stream's slot into the ledger, without Dagster.

* :mod:`.source`: where transactions come from (:class:`~.source.SlotSource`: a peek, or the
  replication protocol);
* :mod:`.recorder`: the one recording loop (read -> batch -> record -> confirm) and its one batching
  rule, run by the sensor (:func:`consume`, each tick) and by an open run's reader thread
  (:func:`follow`); each reads only while it is the slot's declared reader (``streams.slot_reader``);
* :mod:`.group`: a reader group's reader (:func:`consume_group`): one slot decoded once for several
  streams, and the hand-over of a stream that had its own slot;
* :mod:`.slot`: the slot exists and is usable (:func:`ensure_slot`), recovering from the table what a
  lost slot took with it.
"""

from .group import GroupResult, GroupStream, check_members, consume_group, ensure_group, group_log, unconfigured
from .recorder import (
    FOLLOW_CHECK_SECS,
    FOLLOW_RECORD_EVERY_SECS,
    RECORD_EVERY_SECS,
    Batching,
    Recorder,
    StreamLedger,
    consume,
    follow,
    record_pass,
    unrecorded,
)
from .results import ConsumeResult, FollowStats
from .slot import ensure_slot
from .source import PeekSource, SlotSource, StreamSource

__all__ = [
    "FOLLOW_CHECK_SECS",
    "FOLLOW_RECORD_EVERY_SECS",
    "RECORD_EVERY_SECS",
    "Batching",
    "ConsumeResult",
    "FollowStats",
    "GroupResult",
    "GroupStream",
    "PeekSource",
    "Recorder",
    "SlotSource",
    "StreamLedger",
    "StreamSource",
    "check_members",
    "consume",
    "consume_group",
    "ensure_group",
    "ensure_slot",
    "follow",
    "group_log",
    "record_pass",
    "unconfigured",
    "unrecorded",
]
