"""Amazon SQS sink (extra ``aws``, library boto3): ``SendMessageBatch``, each message's acceptance checked;
the batch loop and its failure rule are :mod:`.aws`'s.

Keys, FIFO queues and permanent rejections: docs/sinks.md, ``sqs``."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field

from .aws import AwsMessageConfigBase, AwsMessageSink
from .base import Event

__all__ = ["SqsSink", "SqsSinkConfig"]

#: characters SQS refuses in a message body or a String attribute value
_INVALID_CHARS = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

#: whole-request error codes about a message's content
_REJECTING_REQUEST_CODES = frozenset({"InvalidMessageContents", "MessageTooLong", "BatchRequestTooLong"})


class SqsSinkConfig(AwsMessageConfigBase):
    """Send each event payload (JSON) to the SQS queue ``queue_url`` (FIFO when it ends in ``.fifo``);
    settings shared with SNS in :class:`~.aws.AwsMessageConfigBase`, client settings in
    :class:`~.aws.AwsSinkConfigBase`."""

    type: Literal["sqs"] = "sqs"
    queue_url: str = Field(pattern=r"^https?://[^/?#@\s]+/[0-9]{1,12}/[A-Za-z0-9_-]{1,80}(\.fifo)?$")


class SqsSink(AwsMessageSink[SqsSinkConfig], builds=SqsSinkConfig):
    body_key: ClassVar[str] = "MessageBody"
    address_key: ClassVar[tuple[str, str]] = ("queue_url", "queue")
    batch_call: ClassVar[tuple[str, str, str]] = ("send_message_batch", "QueueUrl", "Entries")
    rejecting_codes: ClassVar[frozenset[str]] = frozenset({"InvalidMessageContents", "MessageTooLong",
                                                           "InvalidParameterValue"})

    def _check(self, event: Event, body: str, attributes: dict[str, dict[str, str]]) -> None:
        for what, text in [("the body", body)] + [(f"attribute {name}", value["StringValue"])
                                                 for name, value in attributes.items()]:
            found = _INVALID_CHARS.search(text)
            if found is not None:
                raise self._error([event], f"not sent to {self._target()}: {what} holds U+{ord(found.group()):04X} "
                                           f"at character {found.start()}, which SQS does not accept", permanent=True)

    def _rejects_request(self, code: str, message: str) -> bool:
        text = message.lower()
        return code in _REJECTING_REQUEST_CODES or (
            code == "InvalidParameterValue" and ("shorter than" in text or "too long" in text
                                                 or "invalid characters" in text))
