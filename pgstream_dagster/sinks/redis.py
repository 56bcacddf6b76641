"""Redis Streams sink (extra ``redis``, library redis-py): XADD per event, a whole chunk in one pipelined MULTI/EXEC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import Field, SecretStr, model_validator

from .base import (
    Event,
    MissingExtraError,
    PayloadPath,
    RoutingError,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_exception,
    redact_url,
    route_name,
)

if TYPE_CHECKING:
    import redis

__all__ = ["RedisSink", "RedisSinkConfig"]


class RedisSinkConfig(SinkConfigBase):
    """XADD each event to a Redis Stream; entry fields ``id`` (event id: the idempotency key consumers dedupe
    on), ``stream_id``, ``created_at``, ``payload`` (JSON text) and, when present, ``metadata`` (JSON text).

    The stream is ``stream``, or ``stream_prefix`` + the value at payload path ``stream_from`` (e.g.
    ``table`` or ``data.tenant``), falling back to ``stream`` when the payload has no such value.
    ``maxlen``: trim each stream to that many entries (``MAXLEN ~`` when ``maxlen_approximate``).
    """

    type: Literal["redis"] = "redis"
    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    stream: str | None = Field(default=None, min_length=1)
    stream_from: PayloadPath | None = None
    stream_prefix: str = ""
    maxlen: int | None = Field(default=None, ge=1)
    maxlen_approximate: bool = True
    timeout_secs: float = Field(default=10, gt=0)

    @model_validator(mode="after")
    def _has_stream(self) -> Self:
        if self.stream is None and self.stream_from is None:
            raise ValueError("set stream, stream_from, or both (stream is the fallback)")
        return self

    def build(self) -> RedisSink:
        return RedisSink(self)


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise MissingExtraError("redis", "redis", "redis") from None
    return redis


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
        self._redis_mod = _import_redis()
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
        for start in range(0, len(events), self.chunk_size):
            self._publish_chunk(events[start : start + self.chunk_size])

    def _stream_of(self, event: Event) -> str:
        config = self.config
        try:
            return route_name(event, config.stream, config.stream_from, config.stream_prefix)
        except RoutingError as exc:
            raise self._error([event], f"no stream name: {exc}") from None

    def _publish_chunk(self, events: Sequence[Event]) -> None:
        streams = [self._stream_of(event) for event in events]  # all names first: nothing sent on a bad one
        redis_mod = self._redis_mod
        trim: list[bytes] = []
        if self.config.maxlen is not None:
            trim = [b"MAXLEN", b"~", str(self.config.maxlen).encode()] if self.config.maxlen_approximate else \
                [b"MAXLEN", str(self.config.maxlen).encode()]
        # MULTI; XADD...; EXEC packed into one buffer by hand: redis-py's pipeline spends more time
        # building and parsing per-command objects than Redis spends appending the entries
        parts = [_command([b"MULTI"])]
        heads: dict[str, bytes] = {}  # per stream: the constant start of its XADD
        for event, stream in zip(events, streams, strict=True):
            metadata = event.metadata_json
            key = stream if metadata is None else stream + "\0m"
            head = heads.get(key)
            if head is None:
                count = 2 + len(trim) + 1 + 8 + (2 if metadata is not None else 0)
                head = heads[key] = _command([b"XADD", stream.encode(), *trim, b"*"], count=count)
            created = event.created_at.isoformat().encode()
            payload = event.payload_json.encode()
            parts += [head, _ID, _bulk(str(event.id).encode()), _STREAM_ID, _bulk(str(event.stream_id).encode()),
                      _CREATED_AT, _bulk(created), _PAYLOAD, _bulk(payload)]
            if metadata is not None:
                parts += [_METADATA, _bulk(metadata.encode())]
        parts.append(_command([b"EXEC"]))
        pool = self._conn().connection_pool
        conn = None
        try:
            conn = pool.get_connection()
            conn.send_packed_command([b"".join(parts)])
            for _ in range(len(events) + 1):  # OK, then QUEUED per XADD
                conn.read_response()
            results = conn.read_response()  # EXEC: the entry ids, or an error per failed XADD
        except (redis_mod.RedisError, OSError) as exc:
            if conn is not None:
                conn.disconnect()  # replies may be left unread: never reuse this connection
            self.close()
            raise self._error(events, f"XADD to {_where(streams)} at {self._target} failed: "
                                      f"{describe_exception(exc)}") from None
        finally:
            if conn is not None:
                pool.release(conn)
        failed = [r for r in results or [] if isinstance(r, redis_mod.ResponseError)]
        if failed:
            self.close()
            raise self._error(events, f"XADD to {_where(streams)} at {self._target} failed: "
                                      f"{describe_exception(failed[0])}")
        if results is None or len(results) != len(events):
            raise self._error(events, f"expected {len(events)} XADD replies from {self._target}, "
                                      f"got {0 if results is None else len(results)}")

    def _error(self, events: Sequence[Event], reason: str) -> SinkError:
        return SinkError.for_events("redis", events, reason, self.config.secret_values())

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _command(args: list[bytes], count: int | None = None) -> bytes:
    """A command in the Redis protocol (RESP); with ``count``, the start of one with that many arguments."""
    return b"*%d\r\n" % (len(args) if count is None else count) + b"".join(_bulk(arg) for arg in args)


_ID, _STREAM_ID, _CREATED_AT, _PAYLOAD, _METADATA = (
    _bulk(b"id"), _bulk(b"stream_id"), _bulk(b"created_at"), _bulk(b"payload"), _bulk(b"metadata"))


def _where(streams: list[str]) -> str:
    names = sorted(set(streams))
    return f"stream {names[0]!r}" if len(names) == 1 else f"{len(names)} streams"
