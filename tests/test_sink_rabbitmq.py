"""The RabbitMQ sink against the broker on 127.0.0.1:5672 (publisher confirms)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from pydantic import SecretStr, ValidationError

from pgstream_dagster.sinks import (
    Event,
    RabbitMqSinkConfig,
    SinkError,
)

from .support.sinks import AMQP_URL, BASE_TIME, free_port, make_events, unique


@pytest.fixture
def amqp_channel() -> Iterator[Any]:
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    yield connection.channel()
    connection.close()


def drain_queue(channel: Any, queue: str) -> list[tuple[Any, bytes]]:
    messages: list[Any] = []
    while True:
        method, properties, body = channel.basic_get(queue=queue, auto_ack=True)
        if method is None:
            return messages
        messages.append((properties, body))


def test_rabbitmq_sink_publishes_confirmed_persistent_messages(amqp_channel: Any) -> None:
    queue = unique("pgstream-test")
    events = make_events(30)
    try:
        config = RabbitMqSinkConfig(routing_key=queue, declare_queue=queue)
        with config.build() as sink:
            sink.publish(events[:12])
            sink.publish(events[12:])
        assert amqp_channel.queue_declare(queue=queue, passive=True).method.message_count == len(events)
        messages = drain_queue(amqp_channel, queue)
        assert [p.message_id for p, _ in messages] == [str(e.id) for e in events]
        assert [json.loads(body) for _, body in messages] == [e.payload for e in events]
        assert {p.delivery_mode for p, _ in messages} == {2}
        assert {p.content_type for p, _ in messages} == {"application/json"}
        assert {p.headers["x-pgstream-stream-id"] for p, _ in messages} == {7}
    finally:
        amqp_channel.queue_delete(queue=queue)


def test_rabbitmq_exchange_and_routing_key_from_payload(amqp_channel: Any) -> None:
    prefix = unique("pgstream-test") + "."
    exchange = prefix + "exchange"
    queues = {tenant: prefix + tenant for tenant in ("acme", "globex", "fallback")}
    amqp_channel.exchange_declare(exchange=exchange, exchange_type="direct", auto_delete=True)
    for queue in queues.values():
        amqp_channel.queue_declare(queue=queue)
        amqp_channel.queue_bind(queue=queue, exchange=exchange, routing_key=queue)
    tenants = ["acme", "globex", None]
    events = [
        Event(id=300 + i, stream_id=1, payload={"seq": i, "route": {"ex": exchange}, "tenant": tenants[i % 3]},
              metadata={"i": i}, created_at=BASE_TIME)
        for i in range(24)
    ]
    config = RabbitMqSinkConfig(
        exchange_from="route.ex", routing_key_from="tenant", routing_key_prefix=prefix, routing_key=queues["fallback"]
    )
    try:
        with config.build() as sink:
            sink.publish(events)
        for tenant, queue in (("acme", queues["acme"]), ("globex", queues["globex"]), (None, queues["fallback"])):
            messages = drain_queue(amqp_channel, queue)
            expected = [e for e in events if e.payload["tenant"] == tenant]
            assert [p.message_id for p, _ in messages] == [str(e.id) for e in expected], tenant
            assert [json.loads(p.headers["x-pgstream-metadata"]) for p, _ in messages] == [e.metadata for e in expected]
    finally:
        for queue in queues.values():
            amqp_channel.queue_delete(queue=queue)
        amqp_channel.exchange_delete(exchange=exchange)
    with pytest.raises(ValidationError):
        RabbitMqSinkConfig()


def test_rabbitmq_missing_exchange_and_refused_connection_raise(amqp_channel: Any) -> None:
    queue = unique("pgstream-test")
    amqp_channel.queue_declare(queue=queue)
    try:
        missing = unique("no-such-exchange")
        with RabbitMqSinkConfig(exchange=missing, routing_key=queue).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(make_events(3))
        assert "rabbitmq sink" in str(err.value) and "event 101" in str(err.value)
        assert missing in str(err.value) and "NOT_FOUND" in str(err.value)
        assert not err.value.permanent  # a missing exchange is configuration
        assert amqp_channel.queue_declare(queue=queue, passive=True).method.message_count == 0
        # an exchange taken from the event that does not exist: the event's route, after those before it
        events = [Event(id=660 + i, stream_id=1, payload={"x": x}, created_at=BASE_TIME)
                  for i, x in enumerate(["", missing, ""])]
        with RabbitMqSinkConfig(exchange_from="x", routing_key=queue).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(events)
            assert err.value.permanent and err.value.event_ids == (661,)
            assert "NOT_FOUND" in str(err.value) and "the exchange was taken from the event" in str(err.value)
            sink.publish(events[2:])  # the caller set 661 aside: the sink reconnects
        assert [p.message_id for p, _ in drain_queue(amqp_channel, queue)] == ["660", "662"]
    finally:
        amqp_channel.queue_delete(queue=queue)

    port = free_port()
    url = SecretStr(f"amqp://guest:refusedpw@127.0.0.1:{port}/%2F")
    with RabbitMqSinkConfig(url=url, routing_key=queue, timeout_secs=3).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert "events 101..102" in str(err.value) and f"amqp://127.0.0.1:{port}/%2F" in str(err.value)
    assert "refusedpw" not in str(err.value) and not err.value.permanent


def test_rabbitmq_unroutable_and_nacked_raise(amqp_channel: Any) -> None:
    with RabbitMqSinkConfig(routing_key=unique("no-such-queue")).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert "event 101" in str(err.value) and "unroutable" in str(err.value)
    assert not err.value.permanent  # binding a queue makes it routable: configuration

    # a full queue with overflow=reject-publish makes the broker nack the third message
    queue = unique("pgstream-test")
    amqp_channel.queue_declare(queue=queue, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    try:
        with RabbitMqSinkConfig(routing_key=queue).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(make_events(4))
        assert "event 103" in str(err.value) and "nack" in str(err.value)
        assert err.value.event_ids == (103,) and not err.value.permanent  # a full queue: capacity
        assert [p.message_id for p, _ in drain_queue(amqp_channel, queue)] == ["101", "102"]
    finally:
        amqp_channel.queue_delete(queue=queue)


#: RabbitMQ's default max_message_size since 3.8 (4.x: 16 MiB); a message one byte larger is refused by any default
RABBITMQ_MAX_MESSAGE_SIZE = 128 * 1024 * 1024


def test_rabbitmq_message_over_the_brokers_max_size_is_a_permanent_rejection(amqp_channel: Any) -> None:
    queue = unique("pgstream-test")
    amqp_channel.queue_declare(queue=queue)
    events = make_events(3)
    filler = RABBITMQ_MAX_MESSAGE_SIZE + 1 - len('{"blob":""}')
    huge = Event(id=102, stream_id=7, payload_json='{"blob":"' + "x" * filler + '"}', created_at=BASE_TIME)
    assert len(huge.payload_json) == RABBITMQ_MAX_MESSAGE_SIZE + 1
    try:
        with RabbitMqSinkConfig(routing_key=queue).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish([events[0], huge, events[2]])
            message = str(err.value)
            assert err.value.permanent and err.value.event_ids == (102,)
            assert "PRECONDITION_FAILED" in message and "is larger than configured max size" in message
            assert message.startswith("rabbitmq sink: event 102: amqp://127.0.0.1:5672/%2F ") and "guest" not in message
            assert len(message) < 700
            assert [p.message_id for p, _ in drain_queue(amqp_channel, queue)] == ["101"]  # confirmed; 103: not sent
            sink.publish(events[2:])  # the caller set 102 aside; the sink reconnects (the broker closed the channel)
        assert [p.message_id for p, _ in drain_queue(amqp_channel, queue)] == ["103"]
    finally:
        amqp_channel.queue_delete(queue=queue)


def test_rabbitmq_max_message_bytes_and_payload_routes_are_permanent_rejections(amqp_channel: Any) -> None:
    prefix = unique("pgstream-test") + "."
    queue = prefix + "acme"
    amqp_channel.queue_declare(queue=queue)
    events = [Event(id=600 + i, stream_id=1, payload={"tenant": "acme", "i": i}, created_at=BASE_TIME)
              for i in range(2)]
    big = Event(id=650, stream_id=1, payload={"tenant": "acme", "blob": "x" * 2000}, created_at=BASE_TIME)
    long_key = Event(id=651, stream_id=1, payload={"tenant": "t" * 300}, created_at=BASE_TIME)
    no_key = Event(id=652, stream_id=1, payload={"other": 1}, created_at=BASE_TIME)
    unbound = Event(id=653, stream_id=1, payload={"tenant": "nobody"}, created_at=BASE_TIME)
    config = RabbitMqSinkConfig(routing_key_from="tenant", routing_key_prefix=prefix, max_message_bytes=1000)
    try:
        with config.build() as sink:
            outcomes = []
            for bad in (big, long_key, no_key, unbound):
                with pytest.raises(SinkError) as err:
                    sink.publish([events[0], bad, events[1]])
                assert err.value.event_ids == (bad.id,)
                outcomes.append((err.value.permanent, str(err.value)))
            assert [m.message_id for m, _ in drain_queue(amqp_channel, queue)] == ["600"] * 4  # each time: 600 first
        expected = [
            (True, f"event 650: not sent (exchange '' routing key '{prefix}acme'): the body is "),
            (True, f"event 651: routing key '{prefix}ttt"),
            (True, "event 652: no destination: payload path 'tenant' is missing and no fixed name"),
            (True, f"event 653: unroutable: no queue bound for exchange '' routing key '{prefix}nobody' (taken from "),
        ]  # 653: the routing key is the event's (a wrong prefix rejecting all is the reject-storm guard's)
        for (permanent, message), (expected_permanent, text) in zip(outcomes, expected, strict=True):
            assert permanent is expected_permanent and text in message, message
        assert "more than max_message_bytes (1000)" in outcomes[0][1]
        assert "from the event is longer than 255 bytes" in outcomes[1][1]
    finally:
        amqp_channel.queue_delete(queue=queue)


def test_rabbitmq_bad_credentials_do_not_leak(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = RabbitMqSinkConfig(url=SecretStr("amqp://guest:wr0ngpass@127.0.0.1:5672/%2F"), routing_key="q")
    assert "wr0ngpass" not in repr(config)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert "events 101..102" in str(err.value) and "wr0ngpass" not in str(err.value)
    assert "ACCESS_REFUSED" in str(err.value) and "amqp://127.0.0.1:5672/%2F" in str(err.value)
    assert caplog.records and "wr0ngpass" not in caplog.text  # pika logs a lot; never the password




def test_rabbitmq_exchange_and_routing_key_from_metadata(amqp_channel: Any) -> None:
    prefix = unique("pgstream-test") + "."
    exchange = prefix + "exchange"
    queues = {region: prefix + region for region in ("eu", "us")}
    amqp_channel.exchange_declare(exchange=exchange, exchange_type="direct", auto_delete=True)
    for queue in queues.values():
        amqp_channel.queue_declare(queue=queue)
        amqp_channel.queue_bind(queue=queue, exchange=exchange, routing_key=queue)
    events = [Event(id=370 + i, stream_id=1, payload={"seq": i, "region": "payload"},
                    metadata={"ex": exchange, "region": ("eu", "us", "eu")[i % 3]}, created_at=BASE_TIME)
              for i in range(12)]
    config = RabbitMqSinkConfig(exchange_from="metadata:ex", routing_key_from="metadata:region",
                                routing_key_prefix=prefix)
    try:
        with config.build() as sink:
            sink.publish(events)
            no_route = Event(id=399, stream_id=1, payload={"region": "eu"}, metadata={"ex": exchange},
                             created_at=BASE_TIME)
            with pytest.raises(SinkError) as err:
                sink.publish([no_route])
        assert err.value.permanent and "metadata path 'region' is missing and no fixed name" in str(err.value)
        for region, queue in queues.items():
            expected = [str(e.id) for e in events if e.metadata and e.metadata["region"] == region]
            assert [p.message_id for p, _ in drain_queue(amqp_channel, queue)] == expected, region
    finally:
        for queue in queues.values():
            amqp_channel.queue_delete(queue=queue)
        amqp_channel.exchange_delete(exchange=exchange)
