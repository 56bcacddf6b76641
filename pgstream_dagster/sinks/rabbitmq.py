"""RabbitMQ sink (extra ``rabbitmq``, library pika): persistent messages with publisher confirms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, SecretStr

from .base import Event, MissingExtraError, Sink, SinkConfigBase, SinkError, describe_exception, dumps

if TYPE_CHECKING:
    from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

__all__ = ["RabbitMqSink", "RabbitMqSinkConfig"]


class RabbitMqSinkConfig(SinkConfigBase):
    """Publish each event payload (JSON) to ``exchange`` with ``routing_key``.

    Messages are persistent (``delivery_mode=2``) with ``message_id`` = event id and
    ``content_type=application/json``; each publish waits for the broker's confirm and is ``mandatory``,
    so a nack or an unroutable message raises :class:`SinkError`. ``declare_queue``: declare a durable
    queue of that name on connect (with the default exchange ``""`` the routing key is the queue name).
    """

    type: Literal["rabbitmq"] = "rabbitmq"
    url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/%2F")
    exchange: str = ""
    routing_key: str
    declare_queue: str | None = None
    timeout_secs: float = Field(default=10, gt=0)

    def build(self) -> RabbitMqSink:
        return RabbitMqSink(self)


def _import_pika() -> Any:
    try:
        import pika
        import pika.exceptions
    except ImportError:
        raise MissingExtraError("rabbitmq", "rabbitmq", "pika") from None
    return pika


class RabbitMqSink(Sink):
    """Uses a pika ``BlockingConnection`` (opened on first publish, reopened after a failure)."""

    type_name: ClassVar[str] = "rabbitmq"
    config: RabbitMqSinkConfig

    def __init__(self, config: RabbitMqSinkConfig) -> None:
        super().__init__(config)
        self._pika = _import_pika()
        self._connection: BlockingConnection | None = None
        self._channel: BlockingChannel | None = None

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

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        exceptions = self._pika.exceptions
        failing: Sequence[Event] = events  # until connected, the whole batch is at stake
        try:
            channel = self._ensure_channel()
            for index, event in enumerate(events):
                failing = events[index : index + 1]
                properties = self._pika.BasicProperties(
                    content_type="application/json",
                    delivery_mode=2,
                    message_id=str(event.id),
                    timestamp=int(event.created_at.timestamp()),
                    headers={"x-pgstream-stream-id": event.stream_id},
                )
                channel.basic_publish(
                    exchange=self.config.exchange,
                    routing_key=self.config.routing_key,
                    body=dumps(event.payload).encode(),
                    properties=properties,
                    mandatory=True,
                )
        except exceptions.UnroutableError:
            raise self._error(failing, f"unroutable: no queue bound for {self._destination()}") from None
        except exceptions.NackError:
            raise self._error(failing, f"nacked by the broker ({self._destination()})") from None
        except (exceptions.AMQPError, OSError) as exc:
            self.close()
            raise self._error(failing, f"{self._destination()}: {describe_exception(exc)}") from None

    def _destination(self) -> str:
        return f"exchange {self.config.exchange!r} routing key {self.config.routing_key!r}"

    def _error(self, events: Sequence[Event], reason: str) -> SinkError:
        return SinkError.for_events("rabbitmq", events, reason, self.config.secret_values())

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # closing a broken connection must not mask the original error
                pass
