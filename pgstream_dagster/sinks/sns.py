"""Amazon SNS sink (extra ``aws``, library boto3): ``PublishBatch``, each message's acceptance checked;
the batch loop and its failure rule are :mod:`.aws`'s.

Keys, FIFO topics and permanent rejections: docs/sinks.md, ``sns``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .aws import AwsMessageConfigBase, AwsMessageSink

__all__ = ["SnsSink", "SnsSinkConfig"]


class SnsSinkConfig(AwsMessageConfigBase):
    """Publish each event payload (JSON) to the SNS topic ``topic_arn`` (FIFO when it ends in ``.fifo``);
    settings shared with SQS in :class:`~.aws.AwsMessageConfigBase`, client settings in
    :class:`~.aws.AwsSinkConfigBase`."""

    type: Literal["sns"] = "sns"
    topic_arn: str = Field(pattern=r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_-]{1,256}(\.fifo)?$")


class SnsSink(AwsMessageSink[SnsSinkConfig], builds=SnsSinkConfig):
    body_key: ClassVar[str] = "Message"
    address_key: ClassVar[tuple[str, str]] = ("topic_arn", "topic")
    batch_call: ClassVar[tuple[str, str, str]] = ("publish_batch", "TopicArn", "PublishBatchRequestEntries")
    rejecting_codes: ClassVar[frozenset[str]] = frozenset({"InvalidParameter", "InvalidParameterValue"})

    def _rejects_request(self, code: str, message: str) -> bool:
        return code == "BatchRequestTooLong" or (code in self.rejecting_codes and "too long" in message.lower())
