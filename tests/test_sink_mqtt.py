"""The MQTT sink against Mosquitto: the shared broker on 127.0.0.1:1883 and brokers of the tests' own
(users and ACL, a size limit, TLS, stopped, frozen and restarted)."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import dagster as dg
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from pydantic import SecretStr, ValidationError

from pgstream_dagster.sinks import Event, MqttSinkConfig, SinkError, build_sink

from .support.faults import STREAM, drive, fail_into_failover, in_failover, ledger_order, sent_ids, stream_config
from .support.harness import Driver, insert_events, write_config
from .support.mosquitto import Mosquitto, Subscriber, Tls, event_id
from .support.sinks import BASE_TIME, free_port, make_events, unique


@pytest.fixture
def topic() -> str:
    return unique("pgstream-test")


@pytest.fixture
def subscriber(topic: str) -> Iterator[Subscriber]:
    sub = Subscriber(topic + "/#")
    yield sub
    sub.close()


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Mosquitto]:
    """A broker with one user, who may publish to ``ok/#`` only, and a 400-byte message size limit."""
    broker = Mosquitto(tmp_path / "mosquitto", users={"pub": "mqtt-pw-s3cr3t"},
                       acl=["user pub", "topic readwrite ok/#"], message_size_limit=400).start()
    yield broker
    broker.stop()


def test_publish_is_acknowledged_in_order_and_carries_the_event_id(topic: str, subscriber: Subscriber) -> None:
    events = make_events(60)
    with MqttSinkConfig(topic=topic + "/a").build() as sink:
        sink.publish(events[:25])
        sink.publish(events[25:])
    messages = subscriber.wait_for(len(events))
    assert len(messages) == len(events)  # what went in came out, once each, in order
    assert [event_id(m) for m in messages] == [e.id for e in events]
    assert [json.loads(m.payload) for m in messages] == [e.payload for e in events]
    for message, event in zip(messages, events, strict=True):
        props = dict(message.properties.UserProperty)  # type: ignore[union-attr]
        assert props["pgstream-stream-id"] == "7"
        assert json.loads(props.get("pgstream-metadata", "null")) == event.metadata
        assert message.properties.ContentType == "application/json"  # type: ignore[union-attr]
        assert message.topic == topic + "/a" and message.qos == 1 and not message.retain


def test_a_retried_call_is_delivered_again_and_consumers_dedupe_on_the_event_id(
        topic: str, subscriber: Subscriber) -> None:
    events = make_events(20)
    with MqttSinkConfig(topic=topic + "/a").build() as sink:
        sink.publish(events[:8])
        sink.publish(events)  # a retry of a call partly delivered: QoS 1 has no broker-side dedup
    messages = subscriber.wait_for(28)
    ids = [event_id(m) for m in messages]
    assert len(ids) == 28 and ids == [e.id for e in events[:8]] + [e.id for e in events]
    assert list(dict.fromkeys(ids)) == [e.id for e in events]  # deduplicated on the key: each event once, in order


def test_mqtt_3_1_1_carries_the_event_in_the_body(topic: str) -> None:
    sub = Subscriber(topic + "/#", protocol=mqtt.MQTTv311)
    try:
        events = make_events(10)
        with build_sink({"type": "mqtt", "topic": topic + "/v3", "protocol": "3.1.1", "body": "event"}) as sink:
            sink.publish(events)
        bodies = [json.loads(m.payload) for m in sub.wait_for(len(events))]
    finally:
        sub.close()
    assert [b["id"] for b in bodies] == [e.id for e in events]
    assert [(b["payload"], b["metadata"], b["stream_id"]) for b in bodies] == [
        (e.payload, e.metadata, e.stream_id) for e in events]
    assert [datetime.fromisoformat(b["created_at"]) for b in bodies] == [e.created_at for e in events]
    with pytest.raises(ValidationError, match="set body: event"):
        MqttSinkConfig(topic="t", protocol="3.1.1")
    assert MqttSinkConfig(topic="t", protocol=5).protocol == "5"  # type: ignore[arg-type]  # YAML's 5 is a number


def test_topic_from_a_payload_path_and_its_permanent_rejections(topic: str, subscriber: Subscriber) -> None:
    tables = ["orders", "users", None]  # None: no table in the payload -> the fixed topic
    events = [Event(id=400 + i, stream_id=1, payload={"seq": i, "table": tables[i % 3]} if tables[i % 3] else {},
                    created_at=BASE_TIME) for i in range(12)]
    config = MqttSinkConfig(topic=topic + "/other", topic_from="table", topic_prefix=topic + "/t/")
    with config.build() as sink:
        sink.publish(events)
        expected = [f"{topic}/t/{e.payload['table']}" if "table" in e.payload else f"{topic}/other" for e in events]
        assert [m.topic for m in subscriber.wait_for(12)] == expected

        fresh = make_events(4, first_id=450)
        for bad_table, problem in (("a/+", "contains a wildcard"), ("x#", "contains a wildcard"),
                                   ("nul\x00", "contains a NUL character")):
            bad = Event(id=1, stream_id=1, payload={"table": bad_table}, created_at=BASE_TIME)
            with pytest.raises(SinkError) as err:
                sink.publish([*fresh[:2], bad, *fresh[2:]])
            assert err.value.permanent and err.value.event_ids == (1,)  # from the payload: the event's fault
            assert str(err.value).startswith("mqtt sink: event 1: invalid topic ") and problem in str(err.value)
        # each time the events before it were acknowledged and nothing after it was sent
        assert [event_id(m) for m in subscriber.wait_for(18)[12:]] == [450, 451] * 3

    with MqttSinkConfig(topic_from="table").build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(1))
    assert "'table' is missing" in str(err.value) and err.value.permanent and err.value.event_ids == (101,)
    dollar = Event(id=2, stream_id=1, payload={"table": "$SYS/x"}, created_at=BASE_TIME)
    with MqttSinkConfig(topic_from="table").build() as sink, pytest.raises(SinkError) as err:
        sink.publish([dollar])
    assert "starts with $" in str(err.value) and err.value.permanent
    # a fixed topic is the configuration's: refused when the configuration is loaded
    for bad_fixed in ("a/#", "", "$SYS/x"):
        with pytest.raises(ValidationError, match="topic"):
            MqttSinkConfig(topic=bad_fixed)
    with pytest.raises(ValidationError, match="topic_prefix"):
        MqttSinkConfig(topic_from="table", topic_prefix="a/+/")
    with pytest.raises(ValidationError, match="set topic, topic_from"):
        MqttSinkConfig()


def test_max_message_bytes_rejects_an_event_before_sending_it(topic: str, subscriber: Subscriber) -> None:
    events = make_events(5)
    events[2] = Event(id=103, stream_id=7, payload={"blob": "x" * 3000}, created_at=BASE_TIME)
    with MqttSinkConfig(topic=topic + "/a", max_message_bytes=1000).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
        assert err.value.permanent and err.value.event_ids == (103,)
        assert str(err.value) == (f"mqtt sink: event 103: not sent to topic '{topic}/a': the message is 3011 bytes, "
                                  "more than max_message_bytes (1000)")
        assert [event_id(m) for m in subscriber.wait_for(2)] == [101, 102]
        sink.publish(events[3:])  # the caller set 103 aside; the connection is still there
    assert [event_id(m) for m in subscriber.wait_for(4)] == [101, 102, 104, 105]


def test_broker_refusals_are_permanent_only_when_the_topic_comes_from_the_payload(secured: Mosquitto) -> None:
    sub = Subscriber("ok/#", port=secured.port, username="pub", password="mqtt-pw-s3cr3t")
    base = {"type": "mqtt", "port": secured.port, "username": "pub", "password": "mqtt-pw-s3cr3t", "timeout_secs": 5}
    try:
        events = make_events(4)
        with build_sink({**base, "topic": "denied/a"}) as sink, pytest.raises(SinkError) as err:
            sink.publish(events)
        # the fixed topic: every event would be refused; fixing the ACL makes them deliverable
        assert not err.value.permanent and err.value.event_ids == (101, 102, 103, 104)
        assert "refused the message to topic 'denied/a': Not authorized (reason code 0x87)" in str(err.value)

        routed = [Event(id=i, stream_id=1, payload={"area": "ok/in" if i != 3 else "denied/out"},
                        created_at=BASE_TIME) for i in range(1, 6)]
        with build_sink({**base, "topic_from": "area"}) as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(routed)
            assert err.value.permanent and err.value.event_ids == (3,)
            assert str(err.value).startswith("mqtt sink: event 3: the broker at 127.0.0.1:")
            assert "'denied/out': Not authorized (reason code 0x87)" in str(err.value)
            # the events before it were acknowledged; those after it were sent too (the stream sends them again)
            assert [event_id(m) for m in sub.wait_for(4)] == [1, 2, 4, 5]
            sink.publish(routed[3:])  # the same connection goes on
        assert [event_id(m) for m in sub.wait_for(6)] == [1, 2, 4, 5, 4, 5]
    finally:
        sub.close()


def test_a_message_over_the_brokers_size_limit_fails_without_being_permanent(secured: Mosquitto) -> None:
    """Mosquitto answers a message over its message_size_limit with PUBACK reason code 0x95, which
    paho-mqtt refuses as a protocol error: the connection closes and the call fails, retried.
    ``max_message_bytes`` (test above) is how an oversized event becomes a permanent rejection."""
    events = make_events(3)
    events[1] = Event(id=102, stream_id=7, payload={"blob": "x" * 500}, created_at=BASE_TIME)
    config = {"type": "mqtt", "port": secured.port, "username": "pub", "password": "mqtt-pw-s3cr3t", "topic": "ok/a"}
    with build_sink(config) as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
        assert not err.value.permanent and err.value.event_ids == (102, 103)
        assert "2 of 3 messages to topic 'ok/a' at 127.0.0.1:" in str(err.value)
        assert "not acknowledged: connection lost" in str(err.value)
        sink.publish(events[2:])  # a new connection


def test_an_unreachable_broker_is_a_clear_error_without_secrets(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()
    config = MqttSinkConfig(port=port, topic="t", username="u", password=SecretStr("mqtt-unreach-pw"), timeout_secs=2)
    assert "mqtt-unreach-pw" not in repr(config) and "mqtt-unreach-pw" not in str(config.model_dump())
    started = time.monotonic()
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(2))
    assert time.monotonic() - started < 10
    assert str(err.value).startswith(f"mqtt sink: events 101..102 (2 events): cannot connect to the MQTT broker at "
                                     f"127.0.0.1:{port}: ConnectionRefusedError")
    assert err.value.sink == "mqtt" and not err.value.permanent
    for text in (str(err.value), repr(err.value), caplog.text):
        assert "mqtt-unreach-pw" not in text


def test_a_wrong_password_is_refused_without_leaking_it(secured: Mosquitto, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = MqttSinkConfig(port=secured.port, topic="ok/a", username="pub", password=SecretStr("wr0ng-mqtt-pw"))
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(3))
    assert str(err.value).startswith(f"mqtt sink: events 101..103 (3 events): cannot connect to the MQTT broker at "
                                     f"127.0.0.1:{secured.port}: the broker refused the connection: ")
    assert not err.value.permanent
    for text in (str(err.value), repr(err.value), caplog.text):
        assert "wr0ng-mqtt-pw" not in text and "mqtt-pw-s3cr3t" not in text


def test_a_connection_the_broker_dropped_meanwhile_is_replaced(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "mosquitto").start()
    sub_port = broker.port
    try:
        config = MqttSinkConfig(port=broker.port, topic="a/b", client_id=unique("pgstream-fixed"), clean_session=False,
                                session_expiry_secs=60)
        with config.build() as sink:
            sub = Subscriber("a/#", port=sub_port)
            sink.publish(make_events(2))
            # another client takes the session over (same client id): the broker closes the sink's connection
            intruder = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=config.client_id or "",
                                   protocol=mqtt.MQTTv5)
            intruder.connect("127.0.0.1", broker.port)
            intruder.loop_start()
            time.sleep(0.5)
            intruder.disconnect()
            intruder.loop_stop()
            sink.publish(make_events(2, first_id=201))  # noticed: a new connection
            assert [event_id(m) for m in sub.wait_for(4)] == [101, 102, 201, 202]
            sub.close()

            broker.stop()  # the broker goes away while the sink is idle...
            with pytest.raises(SinkError) as err:
                sink.publish(make_events(1, first_id=301))
            # (whether the client's network thread saw the connection close before the call: one line either way)
            assert re.search(r"cannot connect to the MQTT broker|not acknowledged: connection lost", str(err.value))
            assert f"127.0.0.1:{broker.port}" in str(err.value) and not err.value.permanent
            broker.start()  # ... and comes back: the next call connects again
            sub = Subscriber("a/#", port=sub_port)
            sink.publish(make_events(2, first_id=301))
            assert [event_id(m) for m in sub.wait_for(2)] == [301, 302]
            sub.close()
    finally:
        broker.stop()


def test_no_acknowledgement_within_the_timeout_fails_the_call(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "mosquitto").start()
    try:
        with MqttSinkConfig(port=broker.port, topic="a/b", timeout_secs=1, keepalive_secs=30).build() as sink:
            sink.publish(make_events(1))
            broker.pause()  # the connection stays open, nothing is answered
            started = time.monotonic()
            with pytest.raises(SinkError) as err:
                sink.publish(make_events(3, first_id=201))
            assert 0.9 < time.monotonic() - started < 5
            assert not err.value.permanent and err.value.event_ids == (201, 202, 203)
            assert "3 of 3 messages to topic 'a/b' at 127.0.0.1:" in str(err.value)
            assert "no acknowledgement within 1s" in str(err.value)
            broker.resume()
            sink.publish(make_events(2, first_id=301))  # the stalled connection was discarded: a new one
    finally:
        broker.stop()


def test_tls_with_the_brokers_ca(tmp_path: Path) -> None:
    tls = Tls.make(tmp_path / "tls")
    broker = Mosquitto(tmp_path / "mosquitto", tls=tls).start()
    try:
        with build_sink({"type": "mqtt", "port": broker.port, "topic": "secure/a",
                         "tls": {"ca_certs": str(tls.ca)}}) as sink:
            sink.publish(make_events(3))
        with build_sink({"type": "mqtt", "port": broker.port, "topic": "secure/a", "tls": True,  # system CAs
                         "timeout_secs": 3}) as sink, pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
        assert "cannot connect to the MQTT broker" in str(err.value) and "CERTIFICATE_VERIFY_FAILED" in str(err.value)
        assert not err.value.permanent
        with build_sink({"type": "mqtt", "port": broker.port, "topic": "secure/a",
                         "timeout_secs": 3}) as sink, pytest.raises(SinkError) as err:  # plain MQTT to a TLS port
            sink.publish(make_events(1))
        assert "cannot connect to the MQTT broker" in str(err.value) and not err.value.permanent
    finally:
        broker.stop()
    secret = MqttSinkConfig(topic="t", tls={"keyfile_password": "tls-key-pw", "certfile": "c.pem",  # type: ignore[arg-type]
                                            "keyfile": "k.pem"})
    assert "tls-key-pw" in secret.secret_values() and "tls-key-pw" not in repr(secret)
    with pytest.raises(ValidationError, match="keyfile needs certfile"):
        MqttSinkConfig(topic="t", tls={"keyfile": "k.pem"})  # type: ignore[arg-type]


def test_configuration_errors_name_the_setting() -> None:
    with pytest.raises(ValidationError, match="clean_session: false needs a client_id"):
        MqttSinkConfig(topic="t", clean_session=False)
    with pytest.raises(ValidationError, match="password needs username"):
        MqttSinkConfig(topic="t", password=SecretStr("x"))
    with pytest.raises(ValidationError, match="session_expiry_secs is an MQTT 5 setting"):
        MqttSinkConfig(topic="t", protocol="3.1.1", body="event", session_expiry_secs=60)
    with pytest.raises(ValidationError) as err:
        build_sink({"type": "mqtt", "topic": "t", "password": "pw-in-error?", "port": 0})
    assert "pw-in-error?" not in str(err.value) and "port" in str(err.value)


def test_delivery_runs_to_mqtt_survive_a_broker_outage(db_url: str, tmp_path: Path,
                                                       instance: dg.DagsterInstance) -> None:
    """A real pipeline (sensor ticks, runs on Spark, a real Dagster instance) publishing to a broker
    that goes down: the stream enters failover, keeps recording, and once the broker is back drains
    the backlog; every event arrives, first deliveries in commit order."""
    broker = Mosquitto(tmp_path / "mosquitto").start()
    sub = Subscriber("pg/#", port=broker.port)
    try:
        sink = {"type": "mqtt", "port": broker.port, "topic": "pg/events", "timeout_secs": 2}
        driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [stream_config(sink)]), instance)
        driver.tick(STREAM)
        insert_events(db_url, STREAM, 100)
        drive(driver, lambda: len({event_id(m) for m in sub.received()}) >= 100)

        broker.stop()
        insert_events(db_url, STREAM, 150, 100)
        error = fail_into_failover(driver, db_url)
        assert "mqtt sink" in error and "cannot connect to the MQTT broker at 127.0.0.1:" in error

        broker.start()
        assert sub.ready.wait(15), "the subscriber did not come back"
        sent = set(sent_ids(db_url))
        drive(driver, lambda: {event_id(m) for m in sub.received()} >= sent and not in_failover(db_url))
        received = [event_id(m) for m in sub.received()]
        assert set(received) == sent and len(sent) == 250  # nothing lost
        assert list(dict.fromkeys(received)) == ledger_order(db_url)  # first deliveries in commit order
    finally:
        sub.close()
        broker.stop()
