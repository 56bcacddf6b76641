"""RabbitMQ sink (extra ``rabbitmq``, library pika): persistent messages with publisher confirms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import Field, SecretStr, model_validator

from .base import (
    Event,
    PayloadPath,
    RoutingError,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_exception,
    import_extra,
    redact_url,
    route_name,
)

if TYPE_CHECKING:
    from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

__all__ = ["RabbitMqSink", "RabbitMqSinkConfig"]


class RabbitMqSinkConfig(SinkConfigBase):
    """Publish each event payload (JSON) to an exchange with a routing key.

    Messages are persistent (``delivery_mode=2``) with ``message_id`` = event id (the idempotency key),
    ``content_type=application/json``, ``timestamp`` = event time and headers ``x-pgstream-stream-id``
    (and ``x-pgstream-metadata`` when present). Each publish waits for the broker's confirm and is
    ``mandatory``, so a nack or an unroutable message raises :class:`SinkError`.

    Routing key: ``routing_key``, or ``routing_key_prefix`` + the value at payload path ``routing_key_from``
    (falling back to ``routing_key``). Exchange: ``exchange`` (default: the default exchange ``""``, where
    the routing key is the queue name), or the value at payload path ``exchange_from`` (falling back to
    ``exchange``). ``declare_queue``: declare a durable queue of that name on connect.
    """

    type: Literal["rabbitmq"] = "rabbitmq"
    url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/%2F")
    exchange: str = ""
    exchange_from: PayloadPath | None = None
    routing_key: str | None = None
    routing_key_from: PayloadPath | None = None
    routing_key_prefix: str = ""
    declare_queue: str | None = None
    timeout_secs: float = Field(default=10, gt=0)

    @model_validator(mode="after")
    def _has_routing_key(self) -> Self:
        if self.routing_key is None and self.routing_key_from is None:
            raise ValueError("set routing_key, routing_key_from, or both (routing_key is the fallback)")
        return self

    def build(self) -> RabbitMqSink:
        return RabbitMqSink(self)


class RabbitMqSink(Sink):
    """Uses a pika ``BlockingConnection`` (opened on first publish, reopened after a failure)."""

    type_name: ClassVar[str] = "rabbitmq"
    config: RabbitMqSinkConfig

    def __init__(self, config: RabbitMqSinkConfig) -> None:
        super().__init__(config)
        self._pika = import_extra("rabbitmq", "rabbitmq", "pika", "pika", "pika.exceptions")
        self._connection: BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._target = redact_url(config.url.get_secret_value())

    def _ensure_channel(self) -> BlockingChannel:
        if self._connection is not None and self._channel is not None:
            try:
                # Services heartbeats and notices a connection the broker closed while we were idle.
                self._connection.process_data_events(time_limit=0)
            except self._pika.exceptions.AMQPError:
                self.close()
            else:
                if self._connection.is_open and self._channel.is_open:
                    return self._channel
                self.close()
        params = self._pika.URLParameters(self.config.url.get_secret_value())
        params.socket_timeout = self.config.timeout_secs
        params.stack_timeout = self.config.timeout_secs
        params.blocked_connection_timeout = self.config.timeout_secs
        self._connection = self._pika.BlockingConnection(params)
        channel = self._connection.channel()
        channel.confirm_delivery()
        if self.config.declare_queue is not None:
            channel.queue_declare(queue=self.config.declare_queue, durable=True)
        self._channel = channel
        return channel

    def _route(self, event: Event) -> tuple[str, str]:
        config = self.config
        try:
            exchange = route_name(event, config.exchange, config.exchange_from)
            routing_key = route_name(event, config.routing_key, config.routing_key_from, config.routing_key_prefix)
        except RoutingError as exc:
            raise self._error([event], f"no destination: {exc}") from None
        return exchange, routing_key

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        routes = [self._route(event) for event in events]  # all first: nothing sent on a bad one
        exceptions = self._pika.exceptions
        failing: Sequence[Event] = events  # until connected, the whole batch is at stake
        route = routes[0]
        try:
            channel = self._ensure_channel()
            for index, event in enumerate(events):
                failing, route = events[index : index + 1], routes[index]
                headers: dict[str, Any] = {"x-pgstream-stream-id": event.stream_id}
                if event.metadata_json is not None:
                    headers["x-pgstream-metadata"] = event.metadata_json
                properties = self._pika.BasicProperties(
                    content_type="application/json",
                    delivery_mode=2,
                    message_id=str(event.id),
                    timestamp=int(event.created_at.timestamp()),
                    headers=headers,
                )
                channel.basic_publish(
                    exchange=route[0],
                    routing_key=route[1],
                    body=event.payload_json.encode(),
                    properties=properties,
                    mandatory=True,
                )
        except exceptions.UnroutableError:
            raise self._error(failing, f"unroutable: no queue bound for {_describe(route)}") from None
        except exceptions.NackError:
            raise self._error(failing, f"nacked by the broker ({_describe(route)})") from None
        except (exceptions.AMQPError, OSError) as exc:
            self.close()
            reason = f"{self._target} {_describe(route)}: {describe_exception(exc)}"
            raise self._error(failing, reason) from None

    def _error(self, events: Sequence[Event], reason: str) -> SinkError:
        return SinkError.for_events("rabbitmq", events, reason, self.config.secret_values())

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # closing a broken connection must not mask the original error
                pass


def _describe(route: tuple[str, str]) -> str:
    return f"exchange {route[0]!r} routing key {route[1]!r}"
