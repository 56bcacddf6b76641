"""Operator controls of a stream, shared by the CLI and the Dagster UI (job
``pgstream_stream_control``): pause, resume, retry the failover checkpoint now, skip a batch.

Each control is one call of a ``pgstream.*`` function, so psql users get the same behaviour.
"""


from typing import Literal

import dagster as dg
import psycopg
from pydantic import Field

from .resources import PgstreamResource

CONTROL_JOB = "pgstream_stream_control"
Action = Literal["pause", "resume", "retry_now", "skip_batch"]


class ControlError(RuntimeError):
    """The control could not be applied; nothing changed."""


def apply_control(conn: psycopg.Connection, stream_id: int, action: Action, batch_id: int | None = None) -> str:
    """Apply ``action`` to the stream and say what happened (one line, for the CLI and the run log)."""
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
                                       "waiting for the backoff) | skip_batch (give up on batch_id)")
    batch_id: int | None = Field(None, description="for skip_batch: the batch to give up on")
    confirm: str = Field("", description="for skip_batch: type 'skip' to confirm that its events will "
                                         "not be delivered")


@dg.op(description="Pause, resume, retry-now or skip a batch of a stream.")
def stream_control(context: dg.OpExecutionContext, config: StreamControlConfig, pgstream: PgstreamResource) -> None:
    if config.action == "skip_batch" and config.confirm != "skip":
        raise dg.Failure("skip_batch drops events from delivery: set confirm: skip")
    with pgstream.connect() as conn:
        try:
            message = apply_control(conn, config.stream_id, config.action, config.batch_id)
        except ControlError as exc:
            raise dg.Failure(str(exc)) from None
    context.log.info(message)


@dg.job(name=CONTROL_JOB, description="Operator controls of a stream: pause, resume, retry_now, skip_batch.",
        executor_def=dg.in_process_executor)
def control_job() -> None:
    stream_control()
