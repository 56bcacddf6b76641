"""RabbitMQ sink (extra ``rabbitmq``, library pika): persistent messages with publisher confirms.

Keys, message properties and permanent rejections: docs/sinks.md, ``rabbitmq``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, SecretStr

from .base import Event, EventPath, Sink, SinkConfigBase, describe_exception, import_extra, publish_prepared, redact_url

if TYPE_CHECKING:
    from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

__all__ = ["RabbitMqSink", "RabbitMqSinkConfig"]

#: one message: (exchange, routing key), body, (exchange from the event, exchange or routing key from it)
_Message = tuple[tuple[str, str], bytes, tuple[bool, bool]]

#: AMQP short strings (exchange names, routing keys) hold at most this many bytes
_SHORT_STRING_BYTES = 255

#: the reply text of the channel error (406) for a message over the broker's max_message_size
_TOO_LARGE = re.compile(r"message size \d+ is larger than configured max size")


class RabbitMqSinkConfig(SinkConfigBase):
    """Publish each event payload (JSON) to an exchange with a routing key."""

    type: Literal["rabbitmq"] = "rabbitmq"
    url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/%2F")
    exchange: str = ""
    exchange_from: EventPath | None = None
    routing_key: str | None = None
    routing_key_from: EventPath | None = None
    routing_key_prefix: str = ""
    declare_queue: str | None = None
    max_message_bytes: int | None = Field(default=None, ge=1)
    timeout_secs: float = Field(default=10, gt=0)
    routed_names: ClassVar[tuple[str, ...]] = ("routing_key",)


class RabbitMqSink(Sink, builds=RabbitMqSinkConfig):
    """Uses a pika ``BlockingConnection`` (opened on first publish, reopened after a failure)."""

    config: RabbitMqSinkConfig

    def max_event_bytes(self) -> int | None:
        return self.config.max_message_bytes  # the body is the payload

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
        params.socket_timeout = params.stack_timeout = params.blocked_connection_timeout = self.config.timeout_secs
        self._connection = self._pika.BlockingConnection(params)
        channel = self._connection.channel()
        channel.confirm_delivery()
        if self.config.declare_queue is not None:
            channel.queue_declare(queue=self.config.declare_queue, durable=True)
        self._channel = channel
        return channel

    def _message(self, event: Event) -> _Message:
        """The route and body of ``event``; a permanent :class:`SinkError` when it cannot be sent."""
        config = self.config
        exchange, exchange_from_event = self._destination(event, "no destination", config.exchange,
                                                          config.exchange_from)
        routing_key, key_from_event = self._destination(event, "no destination", config.routing_key,
                                                        config.routing_key_from, config.routing_key_prefix)
        for what, name, from_event in (("exchange", exchange, exchange_from_event),
                                       ("routing key", routing_key, key_from_event)):
            if from_event and len(name.encode()) > _SHORT_STRING_BYTES:
                reason = f"{what} {name[:100]!r}... from the event is longer than {_SHORT_STRING_BYTES} bytes"
                raise self._error([event], reason, permanent=True)
        body = event.payload_json.encode()
        limit = config.max_message_bytes
        if limit is not None and len(body) > limit:
            reason = (f"not sent ({_describe((exchange, routing_key))}): the body is {len(body)} bytes, more than "
                      f"max_message_bytes ({limit})")
            raise self._error([event], reason, permanent=True)
        return (exchange, routing_key), body, (exchange_from_event, exchange_from_event or key_from_event)

    def publish(self, events: Sequence[Event]) -> None:
        publish_prepared(events, self._message, self._publish)

    def _publish(self, events: Sequence[Event], messages: Sequence[_Message]) -> None:
        exceptions = self._pika.exceptions
        failing: Sequence[Event] = events  # until connected, the whole batch is at stake
        destination = messages[0][0]
        exchange_derived = route_derived = False  # the failing message's exchange / route came from its event
        publishing = False
        try:
            channel = self._ensure_channel()
            publishing = True
            for index, event in enumerate(events):
                failing, (destination, body, (exchange_derived, route_derived)) = (events[index : index + 1],
                                                                                    messages[index])
                headers: dict[str, Any] = {"x-pgstream-stream-id": event.stream_id}
                if event.metadata_json is not None:
                    headers["x-pgstream-metadata"] = event.metadata_json
                properties = self._pika.BasicProperties(content_type="application/json", delivery_mode=2,
                                                        message_id=str(event.id), headers=headers,
                                                        timestamp=int(event.created_at.timestamp()))
                channel.basic_publish(exchange=destination[0], routing_key=destination[1], body=body,
                                      properties=properties, mandatory=True)
        except exceptions.UnroutableError:
            # a routing key or exchange taken from the event that no queue is bound for: the event's route
            reason = f"unroutable: no queue bound for {_describe(destination)}"
            if route_derived:
                reason += " (taken from the event)"
            raise self._error(failing, reason, permanent=route_derived) from None
        except exceptions.NackError:
            raise self._error(failing, f"nacked by the broker ({_describe(destination)})") from None
        except (exceptions.AMQPError, OSError) as exc:
            self.close()
            # the broker refused this message for its size: only then is it the event's fault
            code = exc.reply_code if publishing and isinstance(exc, exceptions.ChannelClosedByBroker) else None
            too_large = code == 406 and _TOO_LARGE.search(str(getattr(exc, "reply_text", ""))) is not None
            # an exchange taken from the event that does not exist: the event's route
            no_exchange = code == 404 and exchange_derived
            reason = f"{self._target} {_describe(destination)}: {describe_exception(exc)}"
            if no_exchange:
                reason += " (the exchange was taken from the event)"
            raise self._error(failing, reason, permanent=too_large or no_exchange) from None

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with suppress(Exception):  # closing a broken connection must not mask the original error
                connection.close()


def _describe(route: tuple[str, str]) -> str:
    return f"exchange {route[0]!r} routing key {route[1]!r}"
