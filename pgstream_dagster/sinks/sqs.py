"""Amazon SQS sink (extra ``aws``, library boto3): ``SendMessageBatch`` of up to 10 messages and
``max_message_bytes`` (256 KiB by default) per request, each message's acceptance checked.

A queue whose URL ends in ``.fifo`` is a FIFO queue: every message gets a ``MessageGroupId`` and
``MessageDeduplicationId`` = the event id, so SQS drops an event sent again within its 5-minute
deduplication window (a retried batch; a replay within 5 minutes too). Body: the payload (JSON),
with :func:`~.aws.message_attributes`. Credentials, groups, batching and the failure rule: :mod:`.aws`.

Permanent rejections (``SinkError.permanent``), the events before it confirmed: a message larger than
``max_message_bytes`` (body and attributes) or holding characters SQS refuses (outside ``#x9 #xA #xD
#x20-#xD7FF #xE000-#xFFFD #x10000-#x10FFFF``, e.g. U+FFFF), both refused before sending; a
``MessageGroupId`` the event (payload or metadata) makes invalid; an entry the queue refused with a sender fault about
its content (``InvalidMessageContents``, ``MessageTooLong``, ``InvalidParameterValue``); a request
refused whole because a message is too long or invalid (e.g. the queue's ``MaximumMessageSize`` is
below ``max_message_bytes``): then the error names that request's events. Not permanent (retried
by the stream): a missing queue, access denied, KMS errors, throttling, internal errors (an entry
failing that way is sent again up to ``max_attempts`` times first), an unreachable endpoint,
timeouts, missing credentials or region.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field

from .aws import AwsMessageConfigBase, AwsMessageSink, EntryFailure, batch_outcomes
from .base import Event

__all__ = ["SqsSink", "SqsSinkConfig"]

#: characters SQS refuses in a message body or a String attribute value
_INVALID_CHARS = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

#: per-entry error codes (sender fault) that refuse the message itself
_REJECTING_CODES = frozenset({"InvalidMessageContents", "MessageTooLong", "InvalidParameterValue"})

#: whole-request error codes about a message's content
_REJECTING_REQUEST_CODES = frozenset({"InvalidMessageContents", "MessageTooLong", "BatchRequestTooLong"})


class SqsSinkConfig(AwsMessageConfigBase):
    """Send each event payload (JSON) to the SQS queue ``queue_url`` (FIFO when it ends in ``.fifo``);
    settings shared with SNS in :class:`~.aws.AwsMessageConfigBase`, client settings in
    :class:`~.aws.AwsSinkConfigBase`."""

    type: Literal["sqs"] = "sqs"
    queue_url: str = Field(pattern=r"^https?://[^/?#@\s]+/[0-9]{1,12}/[A-Za-z0-9_-]{1,80}(\.fifo)?$")

    def destination(self) -> str:
        return self.queue_url

    def build(self) -> SqsSink:
        return SqsSink(self)


class SqsSink(AwsMessageSink[SqsSinkConfig]):
    type_name: ClassVar[str] = "sqs"
    service: ClassVar[str] = "sqs"
    body_key: ClassVar[str] = "MessageBody"

    def _target(self) -> str:
        return f"queue {self.config.queue_url}"  # no user info or query string (validated): nothing to hide

    def _check(self, event: Event, body: str, attributes: dict[str, dict[str, str]]) -> None:
        for what, text in [("the body", body)] + [(f"attribute {name}", value["StringValue"])
                                                 for name, value in attributes.items()]:
            found = _INVALID_CHARS.search(text)
            if found is not None:
                raise self._error([event], f"not sent to {self._target()}: {what} holds U+{ord(found.group()):04X} "
                                           f"at character {found.start()}, which SQS does not accept", permanent=True)

    def _send(self, client: Any, entries: list[dict[str, Any]]) -> list[EntryFailure | None]:
        response = client.send_message_batch(QueueUrl=self.config.queue_url,
                                             Entries=[{"Id": str(i), **e} for i, e in enumerate(entries)])
        return batch_outcomes(len(entries), response, _REJECTING_CODES)

    def _rejects_request(self, code: str, message: str) -> bool:
        text = message.lower()
        return code in _REJECTING_REQUEST_CODES or (
            code == "InvalidParameterValue" and ("shorter than" in text or "too long" in text
                                                 or "invalid characters" in text))
