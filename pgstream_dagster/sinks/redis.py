"""Redis Streams sink (extra ``redis``, library redis-py): XADD per event, a whole chunk in one pipelined MULTI/EXEC.

Permanent rejections (``SinkError.permanent``), each found before anything is sent for that event
(the events before it are sent first): an entry larger than ``max_message_bytes``, and an event
whose stream name cannot be taken from it (``stream_from`` missing from its payload or metadata,
no ``stream`` fallback). Redis itself accepts any entry: its errors (connection, authentication, OOM under
``maxmemory``, WRONGTYPE for a key that is not a stream, READONLY replica) are about the server
or its data, never about the event, and are not permanent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Literal, Self

from pydantic import Field, SecretStr, model_validator

from .base import (
    Event,
    EventPath,
    RoutingError,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_exception,
    import_extra,
    publish_prepared,
    redact_url,
    route_name,
)

if TYPE_CHECKING:
    import redis

__all__ = ["RedisSink", "RedisSinkConfig"]


class RedisSinkConfig(SinkConfigBase):
    """XADD each event to a Redis Stream; entry fields ``id`` (event id: the idempotency key consumers dedupe
    on), ``stream_id``, ``created_at``, ``payload`` (JSON text) and, when present, ``metadata`` (JSON text).

    The stream is ``stream``, or ``stream_prefix`` + the value at event path ``stream_from`` (a payload
    path such as ``table`` or ``data.tenant``, or ``metadata:region`` for the event's metadata),
    falling back to ``stream`` when the event has no such value.
    ``maxlen``: trim each stream to that many entries (``MAXLEN ~`` when ``maxlen_approximate``).
    ``max_message_bytes``: refuse (permanently, without sending) an event whose entry (field names
    and values, in bytes) is larger; Redis has no limit of its own below 512 MB per value.
    """

    type: Literal["redis"] = "redis"
    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    stream: str | None = Field(default=None, min_length=1)
    stream_from: EventPath | None = None
    stream_prefix: str = ""
    maxlen: int | None = Field(default=None, ge=1)
    maxlen_approximate: bool = True
    max_message_bytes: int | None = Field(default=None, ge=1)
    timeout_secs: float = Field(default=10, gt=0)

    @model_validator(mode="after")
    def _has_stream(self) -> Self:
        if self.stream is None and self.stream_from is None:
            raise ValueError("set stream, stream_from, or both (stream is the fallback)")
        return self

    def build(self) -> RedisSink:
        return RedisSink(self)


class RedisSink(Sink):
    """Each publish is one pipelined ``MULTI; XADD ...; EXEC`` round trip per ``chunk_size`` events, in order.

    Redis runs every command of a transaction even if one fails (e.g. WRONGTYPE), so a failed publish may
    have added some entries: the caller retries and consumers dedupe on the ``id`` field.
    """

    type_name: ClassVar[str] = "redis"
    config: RedisSinkConfig
    chunk_size: ClassVar[int] = 10_000

    def __init__(self, config: RedisSinkConfig) -> None:
        super().__init__(config)
        self._redis_mod = import_extra("redis", "redis", "redis", "redis")
        self._client: redis.Redis | None = None
        self._target = redact_url(config.url.get_secret_value())

    def _conn(self) -> redis.Redis:
        if self._client is None:
            self._client = self._redis_mod.Redis.from_url(
                self.config.url.get_secret_value(),
                socket_timeout=self.config.timeout_secs,
                socket_connect_timeout=self.config.timeout_secs,
            )
        return self._client

    def publish(self, events: Sequence[Event]) -> None:
        # every entry first: the events before a rejected one are sent, then it is rejected
        publish_prepared(events, self._entry, self._send)

    def _send(self, events: Sequence[Event], entries: list[tuple[str, dict[str, str]]]) -> None:
        for start in range(0, len(entries), self.chunk_size):
            end = min(start + self.chunk_size, len(entries))
            self._publish_chunk(events[start:end], entries[start:end])

    def _entry(self, event: Event) -> tuple[str, dict[str, str]]:
        """The stream and fields of ``event``; a permanent :class:`SinkError` when it cannot be sent."""
        config = self.config
        try:
            stream = route_name(event, config.stream, config.stream_from, config.stream_prefix)
        except RoutingError as exc:
            raise self._error([event], f"no stream name: {exc}", permanent=True) from None
        fields = {
            "id": str(event.id),
            "stream_id": str(event.stream_id),
            "created_at": event.created_at.isoformat(),
            "payload": event.payload_json,
        }
        metadata = event.metadata_json
        if metadata is not None:
            fields["metadata"] = metadata
        limit = config.max_message_bytes
        if limit is not None:
            size = sum(len(name) + len(value.encode()) for name, value in fields.items())
            if size > limit:
                reason = (f"not sent to stream {stream!r}: the entry is {size} bytes, more than max_message_bytes "
                          f"({limit})")
                raise self._error([event], reason, permanent=True)
        return stream, fields

    def _publish_chunk(self, events: Sequence[Event], entries: Sequence[tuple[str, dict[str, str]]]) -> None:
        streams = [stream for stream, _fields in entries]
        try:
            with self._conn().pipeline(transaction=True) as pipe:
                for stream, fields in entries:
                    # redis-py types fields as an (invariant) Dict of its key/value unions, which takes a dict[str, str]
                    pipe.xadd(stream, fields, maxlen=self.config.maxlen,  # type: ignore[arg-type]
                              approximate=self.config.maxlen_approximate)
                results = pipe.execute(raise_on_error=True)
        except self._redis_mod.RedisError as exc:
            self.close()
            names = sorted(set(streams))
            where = f"stream {names[0]!r}" if len(names) == 1 else f"{len(names)} streams"
            raise self._error(events, f"XADD to {where} at {self._target} failed: {describe_exception(exc)}") from None
        if len(results) != len(events):
            raise self._error(events, f"expected {len(events)} XADD replies from {self._target}, got {len(results)}")

    def _error(self, events: Sequence[Event], reason: str, *, permanent: bool = False) -> SinkError:
        return SinkError.for_events("redis", events, reason, self.config.secret_values(), permanent=permanent)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
