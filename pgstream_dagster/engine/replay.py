"""Replay planning: validate a replay request (``ReplayConfig`` of ``defs/replay.py``, the
``pgstream_replay_stream_<id>`` job) and split the selected events of ``pgstream.events`` into id
ranges. No Dagster here: the job runs the plan."""


import datetime as dt
from typing import Any, Protocol

import psycopg
from psycopg import sql

from . import spark


class ReplaySelection(Protocol):
    """What to replay (``defs.replay.ReplayConfig`` has these fields)."""

    @property
    def from_event_id(self) -> int | None: ...
    @property
    def to_event_id(self) -> int | None: ...
    @property
    def from_time(self) -> str | None: ...
    @property
    def to_time(self) -> str | None: ...
    @property
    def subscription_keys(self) -> list[str]: ...
    @property
    def all_events(self) -> bool: ...
    @property
    def dead_letters(self) -> bool: ...
    @property
    def dead_letter_ids(self) -> list[int]: ...


class ReplayError(ValueError):
    """The replay request is invalid; nothing was delivered."""


def _timestamp(name: str, value: str | None) -> dt.datetime | None:
    if value is None:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError as exc:
        raise ReplayError(f"{name}: {value!r} is not an ISO 8601 timestamp ({exc})") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


_FILTER = sql.SQL(spark.EVENTS_WHERE)


def dead_letter_selection(config: ReplaySelection) -> list[int] | None:
    """The dead letters ``config`` selects (``None``: all open ones of the stream)."""
    others = [name for name, value in (("from_event_id", config.from_event_id), ("to_event_id", config.to_event_id),
                                       ("from_time", config.from_time), ("to_time", config.to_time),
                                       ("subscription_keys", config.subscription_keys),
                                       ("all_events", config.all_events)) if value not in (None, [], False)]
    if others:
        raise ReplayError(f"dead_letters/dead_letter_ids redeliver dead letters and take no event filter: "
                          f"remove {', '.join(others)}")
    if config.dead_letters and config.dead_letter_ids:
        raise ReplayError("give dead_letters: true (every open dead letter) or dead_letter_ids, not both")
    return None if config.dead_letters else list(config.dead_letter_ids)


def plan(conn: psycopg.Connection, stream_id: int, config: ReplaySelection,
         rows_per_partition: int = spark.ROWS_PER_PARTITION) -> tuple[int, list[tuple[int, int]], dict[str, Any]]:
    """Validate ``config`` and count the events: ``(count, id ranges of at most
    rows_per_partition events each, in order, query parameters)``."""
    if not (config.all_events or config.subscription_keys or any(
            v is not None for v in (config.from_event_id, config.to_event_id, config.from_time, config.to_time))):
        raise ReplayError("give an event-id range, a time range or subscription keys "
                          "(or all_events: true to replay the whole table)")
    from_time = _timestamp("from_time", config.from_time)
    to_time = _timestamp("to_time", config.to_time)
    if from_time and to_time and from_time >= to_time:
        raise ReplayError(f"from_time {from_time.isoformat()} is not before to_time {to_time.isoformat()}")
    lo = config.from_event_id if config.from_event_id is not None else 0
    hi = config.to_event_id if config.to_event_id is not None else 2**63 - 1
    if lo > hi:
        raise ReplayError(f"from_event_id {lo} is after to_event_id {hi}")
    params: dict[str, Any] = {"stream_id": stream_id, "lo": lo, "hi": hi, "from_time": from_time,
                                 "to_time": to_time, "keys": config.subscription_keys or None,
                                 "size": rows_per_partition}
    # every rows_per_partition-th id starts a partition: balanced ranges whatever the id gaps
    query = sql.SQL("""
        select id, n from (
            select e.id, row_number() over (order by e.id) - 1 as rn, count(*) over () as n
            from pgstream.events e where {}) t
        where rn %% %(size)s = 0 order by id""").format(_FILTER)
    starts = conn.execute(query, params).fetchall()
    if not starts:
        return 0, [], params
    count = int(starts[0][1])
    bounds = [int(r[0]) for r in starts]
    ranges = [(bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1)] + [(bounds[-1], hi)]
    return count, ranges, params
