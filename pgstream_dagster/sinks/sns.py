"""Amazon SNS sink (extra ``aws``, library boto3): ``PublishBatch`` of up to 10 messages and
``max_message_bytes`` (256 KiB, SNS's limit, by default) per request, each message's acceptance checked.

A topic whose ARN ends in ``.fifo`` is a FIFO topic: every message gets a ``MessageGroupId`` and
``MessageDeduplicationId`` = the event id (SNS drops an event sent again within 5 minutes). Body:
the payload (JSON), with :func:`~.aws.message_attributes` (a subscription's filter policy can match
them; an SQS subscription with raw message delivery receives them as message attributes).
Credentials, groups, batching and the failure rule: :mod:`.aws`.

Permanent rejections (``SinkError.permanent``), the events before it confirmed: a message larger
than ``max_message_bytes`` (body and attributes), refused before sending; a ``MessageGroupId`` the
event (payload or metadata) makes invalid; an entry the topic refused with a sender fault about its content
(``InvalidParameter``, ``InvalidParameterValue``: e.g. "Message too long"); a request refused
whole because its messages are too long (the error names that request's events). Not permanent: a
missing topic, authorization and KMS errors, throttling, internal errors (an entry failing that
way is sent again up to ``max_attempts`` times first), an unreachable endpoint, timeouts, missing
credentials or region.
"""

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

    def build(self) -> SnsSink:
        return SnsSink(self)


class SnsSink(AwsMessageSink[SnsSinkConfig]):
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
