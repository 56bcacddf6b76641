"""Ingest, without Dagster: :mod:`.source` (a peek, or the replication protocol), :mod:`.recorder` (the one recording
loop), :mod:`.group` (``consume_group``, a reader group's reader). Import
its modules by name; the names below are the definitions'."""

from .group import GroupResult, GroupStream, consume_group, group_log, unconfigured

__all__ = ["GroupResult", "GroupStream", "consume_group", "group_log", "unconfigured"]
