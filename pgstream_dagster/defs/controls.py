"""The operator control job of the Dagster UI (``pgstream_stream_control``): the controls of
``engine/controls.py`` (shared with the CLI), with a typed confirmation for the ones that take
events out of delivery."""

import dagster as dg
from pydantic import Field

from ..engine.controls import CONFIRM, Action, ControlError, apply_control
from .names import CONTROL_JOB
from .resources import PgstreamResource


class StreamControlConfig(dg.Config):
    """Every field has a default, so the Launchpad's template (the fields with a default) shows them all; the
    default stream, 0, is none: a run launched without choosing one fails, naming ``stream_id``."""

    stream_id: int = Field(0, ge=0, description="the stream to act on (required: the default, 0, is none)")
    action: Action = Field("pause", description="pause | resume | retry_now (retry the failover checkpoint without "
                                                "waiting for the backoff) | skip_batch (give up on batch_id) | "
                                                "set_aside (event_ids become dead letters, delivery goes on without "
                                                "them) | discard_dead_letters (give up on dead_letter_ids, or "
                                                "all_dead_letters)")
    batch_id: int = Field(0, ge=0, description="for skip_batch: the batch to give up on (0: none)")
    # a list default is copied for each config (pydantic), and unlike default_factory Dagster shows it
    event_ids: list[int] = Field([], description="for set_aside: undelivered events of the stream's open batches "
                                                 "to set aside")
    reason: str = Field("", description="for set_aside: why (kept with the dead letters)")
    dead_letter_ids: list[int] = Field([], description="for discard_dead_letters: the open dead letters to discard")
    all_dead_letters: bool = Field(False, description="for discard_dead_letters: discard every open dead letter "
                                                      "of the stream instead of dead_letter_ids")
    confirm: str = Field("", description="type 'skip' (skip_batch), 'set aside' (set_aside) or 'discard' "
                                         "(discard_dead_letters) to confirm that events will not be delivered")


@dg.op(description="Pause, resume, retry-now or skip a batch of a stream; set events aside as dead letters, "
                   "discard dead letters.")
def stream_control(context: dg.OpExecutionContext, config: StreamControlConfig,
                   pgstream: dg.ResourceParam[PgstreamResource]) -> None:
    if config.stream_id == 0:
        raise dg.Failure("stream_id: set the stream to act on (the template's 0 is none)")
    expected = CONFIRM.get(config.action)
    if expected is not None and config.confirm != expected:
        raise dg.Failure(f"{config.action} takes events out of delivery: set confirm: {expected}")
    with pgstream.connect() as conn:
        try:
            message = apply_control(conn, config.stream_id, config.action, config.batch_id or None,
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
