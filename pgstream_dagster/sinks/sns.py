"""Amazon SNS sink (extra ``aws``, library boto3): ``PublishBatch``, each message's acceptance checked;
the batch loop and its failure rule are :mod:`.aws`'s.

Keys, FIFO topics and permanent rejections: docs/sinks.md, ``sns``."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from .aws import AwsMessageConfigBase, AwsMessageSink, EntryFailure, batch_outcomes

__all__ = ["SnsSink", "SnsSinkConfig"]

#: per-entry error codes (sender fault) that refuse the message itself
_REJECTING_CODES = frozenset({"InvalidParameter", "InvalidParameterValue"})


class SnsSinkConfig(AwsMessageConfigBase):
    """Publish each event payload (JSON) to the SNS topic ``topic_arn`` (FIFO when it ends in ``.fifo``);
    settings shared with SQS in :class:`~.aws.AwsMessageConfigBase`, client settings in
    :class:`~.aws.AwsSinkConfigBase`."""

    type: Literal["sns"] = "sns"
    topic_arn: str = Field(pattern=r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_-]{1,256}(\.fifo)?$")

    def destination(self) -> str:
        return self.topic_arn


class SnsSink(AwsMessageSink[SnsSinkConfig], builds=SnsSinkConfig):
    type_name: ClassVar[str] = "sns"
    service: ClassVar[str] = "sns"
    body_key: ClassVar[str] = "Message"

    def _target(self) -> str:
        return f"topic {self.config.topic_arn}"

    def _send(self, client: Any, entries: list[dict[str, Any]]) -> list[EntryFailure | None]:
        response = client.publish_batch(TopicArn=self.config.topic_arn,
                                        PublishBatchRequestEntries=[{"Id": str(i), **e} for i, e in enumerate(entries)])
        return batch_outcomes(len(entries), response, _REJECTING_CODES)

    def _rejects_request(self, code: str, message: str) -> bool:
        text = message.lower()
        return code == "BatchRequestTooLong" or (code in _REJECTING_CODES and "too long" in text)
