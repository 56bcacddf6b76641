"""Amazon Kinesis Data Streams sink (extra ``aws``, library boto3): ``PutRecords``, each record's acceptance
checked (``max_batch_size: 1``: ``PutRecord`` chained by ``SequenceNumberForOrdering``).

Keys, the record, order and permanent rejections: docs/sinks.md, ``kinesis``."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from .aws import AwsBatchSink, AwsSinkConfigBase, EntryFailure, Prepared
from .base import Event, EventPath

__all__ = ["KinesisSink", "KinesisSinkConfig"]

#: PutRecords: the limit of one request (data and partition keys)
_REQUEST_BYTES = 5 * 1024 * 1024

#: a partition key: 1-256 Unicode characters
_MAX_KEY_CHARS = 256

#: ``max_batch_size: 1``: partition keys whose last sequence number is kept (the oldest are forgotten)
_MAX_CHAINED_KEYS = 10_000


class KinesisSinkConfig(AwsSinkConfigBase):
    """Put each event (JSON) as a record in the Kinesis stream ``stream_name`` (or ``stream_arn``); the
    partition key is the value at event path ``partition_key_from`` (payload, or ``metadata:<path>``),
    else ``partition_key``, else the event id. Client settings in :class:`~.aws.AwsSinkConfigBase`."""

    type: Literal["kinesis"] = "kinesis"
    stream_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    stream_arn: str | None = Field(default=None, pattern=r"^arn:aws[a-z-]*:kinesis:[a-z0-9-]+:[0-9]{12}:stream/"
                                                         r"[A-Za-z0-9_.-]{1,128}$")
    partition_key_from: EventPath | None = None
    partition_key: str | None = Field(default=None, min_length=1, max_length=_MAX_KEY_CHARS)
    max_record_bytes: int = Field(default=1_048_576, ge=1024, le=10_485_760)
    max_batch_size: int = Field(default=500, ge=1, le=500)

    @model_validator(mode="after")
    def _one_stream(self) -> Self:
        if (self.stream_name is None) == (self.stream_arn is None):
            raise ValueError("set either stream_name or stream_arn")
        return self


class KinesisSink(AwsBatchSink[KinesisSinkConfig], builds=KinesisSinkConfig):
    entry_noun: ClassVar[str] = "record"

    def max_event_bytes(self) -> int | None:
        return self.config.max_record_bytes  # the record is the whole event

    def __init__(self, config: KinesisSinkConfig) -> None:
        super().__init__(config)
        #: ``max_batch_size: 1``: the sequence number of the last record written per partition key
        self._last_sequence: dict[str, str] = {}

    def _limits(self) -> tuple[int, int]:
        return self.config.max_batch_size, _REQUEST_BYTES

    def _stream(self) -> dict[str, str]:
        config = self.config
        return {"StreamARN": config.stream_arn} if config.stream_arn else {"StreamName": config.stream_name or ""}

    def _target(self) -> str:
        return f"stream {self.config.stream_arn or self.config.stream_name}"

    def _prepare(self, event: Event) -> Prepared:
        config = self.config
        # a RoutingError here: the event's content cannot be read (EventContentError)
        key, from_event = self._destination(event, f"not sent to {self._target()}",
                                            config.partition_key or str(event.id), config.partition_key_from)
        if len(key) > _MAX_KEY_CHARS:  # only a key from the event can be that long
            raise self._error([event], f"partition key {key[:100]!r}... is {len(key)} characters, more than "
                                       f"{_MAX_KEY_CHARS}", permanent=from_event)
        data = event.to_json().encode()
        size = len(data) + len(key.encode())
        if size > config.max_record_bytes:
            raise self._error([event], f"not sent to {self._target()}: the record is {size} bytes with its partition "
                                       f"key, more than max_record_bytes ({config.max_record_bytes})", permanent=True)
        return Prepared({"Data": data, "PartitionKey": key}, size)

    def _send(self, client: Any, entries: list[dict[str, Any]]) -> list[EntryFailure | None]:
        if self.config.max_batch_size == 1:
            for entry in entries:  # one: a failure raises (ClientError), nothing after it is sent
                self._put_one(client, entry)
            return [None] * len(entries)
        records = (client.put_records(Records=entries, **self._stream()).get("Records") or [])[: len(entries)]
        records += [{"ErrorCode": "NoResult", "ErrorMessage": "the answer does not mention this record"}] * (
            len(entries) - len(records))
        # every per-record error is about the stream, not the record (throughput, internal, KMS)
        return [EntryFailure(str(r["ErrorCode"]), str(r.get("ErrorMessage", "")), False)
                if r.get("ErrorCode") is not None else None for r in records]

    def _put_one(self, client: Any, entry: dict[str, Any]) -> None:
        key = entry["PartitionKey"]
        ordering = {"SequenceNumberForOrdering": self._last_sequence[key]} if key in self._last_sequence else {}
        response = client.put_record(**entry, **ordering, **self._stream())
        self._last_sequence.pop(key, None)
        self._last_sequence[key] = str(response["SequenceNumber"])  # the most recent key last
        if len(self._last_sequence) > _MAX_CHAINED_KEYS:
            del self._last_sequence[next(iter(self._last_sequence))]

    def _rejects_request(self, code: str, message: str) -> bool:
        text = message.lower()
        return code == "ValidationException" and "data" in text and "length" in text
