"""Redis Streams sink (extra ``redis``): XADD one entry per event, a whole batch in one MULTI/EXEC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, SecretStr

from .base import Event, MissingExtraError, Sink, SinkConfigBase, SinkError, describe_exception, dumps

if TYPE_CHECKING:
    import redis

__all__ = ["RedisSink", "RedisSinkConfig"]


class RedisSinkConfig(SinkConfigBase):
    """XADD to the Redis Stream ``stream``: fields ``id`` (event id), ``stream_id``, ``payload`` (JSON text).

    ``maxlen``: trim the stream to about that many entries (``MAXLEN ~``); ``None`` keeps everything.
    """

    type: Literal["redis"] = "redis"
    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    stream: str = Field(min_length=1)
    maxlen: int | None = Field(default=None, ge=1)
    timeout_secs: float = Field(default=10, gt=0)

    def build(self) -> RedisSink:
        return RedisSink(self)


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise MissingExtraError("redis", "redis", "redis") from None
    return redis


class RedisSink(Sink):
    """Each publish is one pipelined ``MULTI; XADD ...; EXEC`` round trip.

    Batches above ``chunk_size`` events are split into several transactions, in order.
    """

    type_name: ClassVar[str] = "redis"
    config: RedisSinkConfig
    chunk_size: ClassVar[int] = 10_000

    def __init__(self, config: RedisSinkConfig) -> None:
        super().__init__(config)
        self._redis_mod = _import_redis()
        self._client: redis.Redis | None = None

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

    def _publish_chunk(self, events: Sequence[Event]) -> None:
        try:
            with self._conn().pipeline(transaction=True) as pipe:
                for event in events:
                    fields = {
                        "id": str(event.id),
                        "stream_id": str(event.stream_id),
                        "payload": dumps(event.payload),
                    }
                    pipe.xadd(
                        self.config.stream,
                        fields,
                        maxlen=self.config.maxlen,
                        approximate=True,
                    )
                results = pipe.execute(raise_on_error=True)
        except self._redis_mod.RedisError as exc:
            self.close()
            raise SinkError.for_events(
                "redis",
                events,
                f"XADD to stream {self.config.stream!r} failed: {describe_exception(exc)}",
                self.config.secret_values(),
            ) from None
        if len(results) != len(events):
            raise SinkError.for_events(
                "redis", events, f"expected {len(events)} XADD replies, got {len(results)}"
            )

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
