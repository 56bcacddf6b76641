"""Operator controls of a stream, shared by the CLI and the Dagster UI (job
``pgstream_stream_control``): pause, resume, retry the failover checkpoint now, skip a batch, set
events aside as dead letters, discard dead letters.

Each control is one call of a ``pgstream.*`` function, so psql users get the same behaviour.
"""


from collections.abc import Sequence
from typing import Literal

import dagster as dg
import psycopg
from pydantic import Field

from . import deadletters
from .resources import PgstreamResource

CONTROL_JOB = "pgstream_stream_control"
Action = Literal["pause", "resume", "retry_now", "skip_batch", "set_aside", "discard_dead_letters"]
#: what an operator types to confirm an action that takes events out of delivery
CONFIRM = {"skip_batch": "skip", "set_aside": "set aside", "discard_dead_letters": "discard"}


class ControlError(RuntimeError):
    """The control could not be applied; nothing changed."""


def apply_control(conn: psycopg.Connection, stream_id: int, action: Action, batch_id: int | None = None, *,
                  event_ids: Sequence[int] = (), reason: str = "", dead_letter_ids: Sequence[int] = (),
                  all_dead_letters: bool = False, by: str = "sql") -> str:
    """Apply ``action`` to the stream and say what happened (one line, for the CLI and the run log).

    ``set_aside`` takes ``event_ids`` and ``reason``; ``discard_dead_letters`` takes ``dead_letter_ids``
    or ``all_dead_letters`` (every open dead letter of the stream), and ``by`` (who, kept with them)."""
    if action == "set_aside":
        try:
            n = deadletters.set_aside(conn, stream_id, event_ids, reason)
        except deadletters.DeadLetterError as exc:
            raise ControlError(str(exc)) from None
        return (f"stream {stream_id}: {n} events set aside as open dead letters; delivery goes on without them "
                f"(redeliver or discard them: pgstream-dagster dead-letters list {stream_id})")
    if action == "discard_dead_letters":
        if all_dead_letters == bool(dead_letter_ids):
            raise ControlError("discard_dead_letters: give dead letter ids, or all of the stream's (one of them)")
        try:
            n = deadletters.discard(conn, stream_id, None if all_dead_letters else dead_letter_ids, by)
        except deadletters.DeadLetterError as exc:
            raise ControlError(str(exc)) from None
        return f"stream {stream_id}: {n} dead letters discarded (their events will not be delivered)"
    try:
        if action in ("pause", "resume"):
            conn.execute("select pgstream.set_paused(%s, %s)", [stream_id, action == "pause"])
            return (f"stream {stream_id} paused: the slot is still consumed (WAL released), no deliveries start"
                    if action == "pause" else f"stream {stream_id} resumed")
        if action == "retry_now":
            row = conn.execute("select pgstream.retry_now(%s)", [stream_id]).fetchone()
            if row is None or row[0] is None:
                return f"stream {stream_id} has no failed batch to retry"
            return (f"stream {stream_id}: batch {row[0]} will be retried at the next sensor tick; failover ends "
                    f"once the backlog is delivered")
        if batch_id is None:
            raise ControlError("skip_batch needs batch_id")
        row = conn.execute("select pgstream.skip_batch(%s, %s)", [stream_id, batch_id]).fetchone()
        assert row is not None
        return (f"stream {stream_id}: batch {batch_id} skipped ({row[0]} events will not be delivered; they stay in "
                f"pgstream.events and can be replayed by id range)")
    except psycopg.errors.NoDataFound as exc:
        raise ControlError(str(exc.diag.message_primary or exc)) from None


class StreamControlConfig(dg.Config):
    stream_id: int = Field(description="the stream to act on")
    action: Action = Field(description="pause | resume | retry_now (retry the failover checkpoint without "
                                       "waiting for the backoff) | skip_batch (give up on batch_id) | set_aside "
                                       "(event_ids become dead letters, delivery goes on without them) | "
                                       "discard_dead_letters (give up on dead_letter_ids, or all_dead_letters)")
    batch_id: int | None = Field(None, description="for skip_batch: the batch to give up on")
    event_ids: list[int] = Field(default_factory=list, description="for set_aside: undelivered events of the "
                                                                   "stream's open batches to set aside")
    reason: str = Field("", description="for set_aside: why (kept with the dead letters)")
    dead_letter_ids: list[int] = Field(default_factory=list, description="for discard_dead_letters: the open "
                                                                         "dead letters to discard")
    all_dead_letters: bool = Field(False, description="for discard_dead_letters: discard every open dead letter "
                                                      "of the stream instead of dead_letter_ids")
    confirm: str = Field("", description="type 'skip' (skip_batch), 'set aside' (set_aside) or 'discard' "
                                         "(discard_dead_letters) to confirm that events will not be delivered")


@dg.op(description="Pause, resume, retry-now or skip a batch of a stream; set events aside as dead letters, "
                   "discard dead letters.")
def stream_control(context: dg.OpExecutionContext, config: StreamControlConfig, pgstream: PgstreamResource) -> None:
    expected = CONFIRM.get(config.action)
    if expected is not None and config.confirm != expected:
        raise dg.Failure(f"{config.action} takes events out of delivery: set confirm: {expected}")
    with pgstream.connect() as conn:
        try:
            message = apply_control(conn, config.stream_id, config.action, config.batch_id,
                                    event_ids=config.event_ids, reason=config.reason,
                                    dead_letter_ids=config.dead_letter_ids, all_dead_letters=config.all_dead_letters,
                                    by=f"dagster run {context.run_id}")
        except ControlError as exc:
            raise dg.Failure(str(exc)) from None
    context.log.info(message)


@dg.job(name=CONTROL_JOB, description="Operator controls of a stream: pause, resume, retry_now, skip_batch, "
                                      "set_aside, discard_dead_letters.",
        executor_def=dg.in_process_executor)
def control_job() -> None:
    stream_control()
