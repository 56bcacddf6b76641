"""Ingest, without Dagster: :mod:`.source` (a peek, or the replication protocol), :mod:`.recorder` (the one recording
loop; ``consume``, a joining member's own slot), :mod:`.group` (``consume_group``, a reader group's reader). Import
its modules by name; the names below are the definitions'."""

from .group import GroupResult, GroupStream, consume_group, group_log, unconfigured
from .recorder import consume

__all__ = ["GroupResult", "GroupStream", "consume", "consume_group", "group_log", "unconfigured"]
