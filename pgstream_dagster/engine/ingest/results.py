"""What a read of a joining member's own slot reports (:class:`ConsumeResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ConsumeResult:
    batches: list[int] = field(default_factory=list)
    events: int = 0
    last_event_id: int | None = None
    last_lsn: str | None = None
    slot_lost: bool = False
    unreadable: int = 0  # events set aside as dead letters (stage 'read')
    #: nothing read: the group's reader reads for the stream, it has no usable slot of its own, or another
    #: connection held it
    slot_busy: bool = False
    slot: str | None = None  # the slot read (pgstream.streams.slot), or the group's
