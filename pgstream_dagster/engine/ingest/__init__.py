"""Ingest: move what commits on a reader group's slot into its members' ledgers, without Dagster:
:mod:`.source` (where transactions come from: a peek, or the replication protocol), :mod:`.recorder` (the
one recording loop and batching rule; ``consume``, a joining member's own slot until its group takes it
over) and :mod:`.group` (a reader group's reader, ``consume_group``). Import its modules by name; the names
below are what the definitions use."""

from .group import GroupResult, GroupStream, consume_group, group_log, unconfigured
from .recorder import consume

__all__ = ["GroupResult", "GroupStream", "consume", "consume_group", "group_log", "unconfigured"]
