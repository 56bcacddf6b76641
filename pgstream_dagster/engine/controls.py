"""Operator controls of a stream for the CLI and the UI (``defs/controls.py``): pause, resume, retry now, skip
a batch, set events aside, discard dead letters; each one call of a ``pgstream.*`` function, as in psql."""

from collections.abc import Sequence
from typing import Literal

import psycopg

from . import deadletters
from .ledger import state

Action = Literal["pause", "resume", "retry_now", "skip_batch", "set_aside", "discard_dead_letters"]
#: what an operator types to confirm an action that takes events out of delivery
CONFIRM = {"skip_batch": "skip", "set_aside": "set aside", "discard_dead_letters": "discard"}


class ControlError(RuntimeError):
    """The control could not be applied; nothing changed."""


def apply_control(conn: psycopg.Connection, stream_id: int, action: Action, batch_id: int | None = None, *,
                  event_ids: Sequence[int] = (), reason: str = "", dead_letter_ids: Sequence[int] = (),
                  all_dead_letters: bool = False, by: str = "sql") -> str:
    """Apply ``action`` to the stream and say what happened (one line). ``set_aside`` takes ``event_ids`` and
    ``reason``; ``discard_dead_letters`` takes ``dead_letter_ids`` or ``all_dead_letters``, and ``by``."""
    if action == "discard_dead_letters" and all_dead_letters == bool(dead_letter_ids):
        raise ControlError("discard_dead_letters: give dead letter ids, or all of the stream's (one of them)")
    try:
        if action == "set_aside":
            n = deadletters.set_aside(conn, stream_id, event_ids, reason)
            return (f"stream {stream_id}: {n} events set aside as open dead letters; delivery goes on without them "
                    f"(redeliver or discard them: pgstream-dagster dead-letters list {stream_id})")
        if action == "discard_dead_letters":
            n = deadletters.discard(conn, stream_id, None if all_dead_letters else dead_letter_ids, by)
            return f"stream {stream_id}: {n} dead letters discarded (their events will not be delivered)"
        if action in ("pause", "resume"):
            conn.execute("select pgstream.set_paused(%s, %s)", [stream_id, action == "pause"])
            return (f"stream {stream_id} paused: the slot is still consumed (WAL released), no deliveries start"
                    if action == "pause" else f"stream {stream_id} resumed")
        if action == "retry_now":
            due = state.retry_now(conn, stream_id)
            if due is None:
                return f"stream {stream_id} has no failed batch to retry"
            return (f"stream {stream_id}: batch {due} will be retried at the next sensor tick; failover ends "
                    f"once the backlog is delivered")
        if batch_id is None:
            raise ControlError("skip_batch needs batch_id")
        skipped = state.skip_batch(conn, stream_id, batch_id)
        return (f"stream {stream_id}: batch {batch_id} skipped ({skipped} events will not be delivered; they stay in "
                f"pgstream.events and can be replayed by id range)")
    except deadletters.DeadLetterError as exc:
        raise ControlError(str(exc)) from None
    except psycopg.errors.NoDataFound as exc:
        raise ControlError(str(exc.diag.message_primary or exc)) from None
