"""What a read of a slot reports: :class:`ConsumeResult` (the sensor's), :class:`FollowStats` (an open
run's reader's)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ConsumeResult:
    batches: list[int] = field(default_factory=list)
    events: int = 0
    last_event_id: int | None = None
    last_lsn: str | None = None
    slot_created: bool = False
    slot_lost: bool = False
    recovered: list[int] = field(default_factory=list)
    unreadable: int = 0  # events set aside as dead letters (stage 'read')
    #: the sensor is not the slot's declared reader (an open run's reader is), or another connection still
    #: held the slot: nothing read
    slot_busy: bool = False
    publications_created: list[str] = field(default_factory=list)  # were missing (dropped by hand)
    slot: str | None = None  # the slot read (pgstream.streams.slot)

    def add(self, other: ConsumeResult) -> None:
        self.batches += other.batches
        self.events += other.events
        self.last_event_id = other.last_event_id if other.last_event_id is not None else self.last_event_id
        self.last_lsn = other.last_lsn or self.last_lsn
        self.slot_created |= other.slot_created
        self.slot_lost |= other.slot_lost
        self.recovered += other.recovered
        self.unreadable += other.unreadable
        self.slot_busy = other.slot_busy
        self.publications_created += other.publications_created
        self.slot = other.slot or self.slot


@dataclass
class FollowStats:
    """What a run's reader did; ``notes``: what the run log should say (appended by the reader thread)."""

    batches: int = 0
    events: int = 0
    unreadable: int = 0
    notes: list[str] = field(default_factory=list)
    slot: str | None = None  # the slot read, once the reader knows it
