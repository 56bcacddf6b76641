"""The sink interface against real destinations where it has one: the config union, the memory
sink (unit tests only), the file sink, and what survives pickling into another process.

Every test counts events end to end: what went in equals what came out, in order."""

from __future__ import annotations

import decimal
import pickle
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pgstream_dagster.sinks import (
    Event,
    FileSink,
    FileSinkConfig,
    HttpSink,
    KafkaSink,
    KinesisSink,
    MemorySink,
    MemorySinkConfig,
    MqttSink,
    NatsSink,
    PostgresSink,
    RabbitMqSink,
    RedisSink,
    Sink,
    SinkError,
    SnsSink,
    SqsSink,
    build_sink,
    parse_sink_config,
)
from pgstream_dagster.sinks.base import EventContentError, RoutingError, event_from_text, route

from .support.harness import read_jsonl
from .support.sinks import make_events, run_python, unique

# -- config union -------------------------------------------------------------------------------------


def test_config_union_parses_every_type_and_rejects_unknown_keys(tmp_path: Path) -> None:
    cases: dict[str, tuple[dict[str, Any], type[Sink]]] = {
        "memory": ({"type": "memory", "name": "x"}, MemorySink),
        "file": ({"type": "file", "path": str(tmp_path / "f.jsonl")}, FileSink),
        "http": ({"type": "http", "url": "http://127.0.0.1:1/", "headers": {"A": "b"}}, HttpSink),
        "redis": ({"type": "redis", "stream": "s"}, RedisSink),
        "rabbitmq": ({"type": "rabbitmq", "routing_key": "q"}, RabbitMqSink),
        "nats": ({"type": "nats", "subject": "s"}, NatsSink),
        "kafka": ({"type": "kafka", "topic": "t"}, KafkaSink),
        "sqs": ({"type": "sqs", "queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/q.fifo"}, SqsSink),
        "sns": ({"type": "sns", "topic_arn": "arn:aws:sns:eu-west-1:123456789012:t"}, SnsSink),
        "kinesis": ({"type": "kinesis", "stream_name": "s"}, KinesisSink),
        "mqtt": ({"type": "mqtt", "topic": "t", "tls": {"ca_certs": "ca.pem"}}, MqttSink),
        "postgres": ({"type": "postgres", "url": "postgresql://u:p@127.0.0.1:1/db", "table": "s.t"}, PostgresSink),
    }
    for type_name, (data, sink_class) in cases.items():
        config = parse_sink_config(data)
        assert config.type == type_name  # type: ignore[attr-defined]
        assert pickle.loads(pickle.dumps(config)) == config
        with build_sink(data) as sink:
            assert type(sink) is sink_class
            assert sink.type_name == type_name
            assert pickle.loads(pickle.dumps(sink)).config == config
    with pytest.raises(ValidationError):
        parse_sink_config({"type": "file", "path": "x", "unexpected": 1})
    with pytest.raises(ValidationError):
        parse_sink_config({"type": "carrier-pigeon"})
    with pytest.raises(ValidationError):
        parse_sink_config({"type": "http", "url": "http://x", "mode": "sometimes"})


def test_package_imports_without_optional_client_libraries() -> None:
    code = """
import sys
for name in ("redis", "pika", "nats", "confluent_kafka", "paho", "boto3", "botocore"):
    sys.modules[name] = None  # makes `import name` raise ImportError
from pgstream_dagster.sinks import SinkError, build_sink, parse_sink_config
assert build_sink({"type": "memory"}).type_name == "memory"
for data, extra in [({"type": "redis", "stream": "s"}, "redis"),
                    ({"type": "rabbitmq", "routing_key": "q"}, "rabbitmq"),
                    ({"type": "nats", "subject": "s"}, "nats"),
                    ({"type": "kafka", "topic": "t"}, "kafka"),
                    ({"type": "sqs", "queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/q"}, "aws"),
                    ({"type": "sns", "topic_arn": "arn:aws:sns:eu-west-1:123456789012:t"}, "aws"),
                    ({"type": "kinesis", "stream_name": "s"}, "aws"),
                    ({"type": "mqtt", "topic": "t"}, "mqtt")]:
    config = parse_sink_config(data)
    try:
        config.build()
    except ImportError as exc:
        assert isinstance(exc, SinkError), exc
        assert f"pip install pgstream-dagster[{extra}]" in str(exc), exc
    else:
        raise AssertionError(f"{extra}: no ImportError")
print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == "ok"


# -- memory -------------------------------------------------------------------------------------------


def test_memory_sink_delivers_in_order() -> None:
    name = unique("mem")
    events = make_events(25)
    try:
        with MemorySinkConfig(name=name).build() as sink:
            sink.publish(events[:10])
            sink.publish([])
            sink.publish(events[10:])
        assert MemorySink.delivered(name) == events
        assert MemorySink.delivered(unique("other")) == []
    finally:
        MemorySink.reset(name)
    assert MemorySink.delivered(name) == []


def test_memory_sink_fail_times_raises_then_succeeds() -> None:
    name = unique("mem")
    events = make_events(3)
    sink = build_sink({"type": "memory", "name": name, "fail_times": 2})
    try:
        for attempt in (1, 2):
            with pytest.raises(SinkError) as err:
                sink.publish(events)
            assert "memory" in str(err.value) and "101..103" in str(err.value), attempt
            assert err.value.event_ids == (101, 102, 103)
            assert MemorySink.delivered(name) == []
        sink.publish(events)
        assert MemorySink.delivered(name) == events
        # the failure budget is per name, so a rebuilt sink (a retry) does not fail again
        MemorySinkConfig(name=name, fail_times=2).build().publish(events)
        assert MemorySink.delivered(name) == events + events
    finally:
        MemorySink.reset(name)


def test_memory_sink_reject_ids_rejects_permanently_after_delivering_the_events_before() -> None:
    name = unique("mem")
    events = make_events(5)
    config = MemorySinkConfig(name=name, reject_ids=[103])
    try:
        with config.build() as sink:
            for attempt in (1, 2, 3):  # reject_times 0: every time
                with pytest.raises(SinkError) as err:
                    sink.publish(events if attempt == 1 else events[2:])
                assert err.value.permanent and err.value.event_ids == (103,) and err.value.sink == "memory"
                assert str(err.value).startswith(f"memory sink: event 103: injected permanent rejection {attempt} ")
            assert MemorySink.rejections(name) == {103: 3}
            assert MemorySink.delivered(name) == events[:2]  # the events before it, once; nothing after it
            sink.publish(events[3:])  # the caller set 103 aside and goes on
        assert MemorySink.delivered(name) == events[:2] + events[3:]
    finally:
        MemorySink.reset(name)
    assert MemorySink.rejections(name) == {}


def test_memory_sink_reject_times_rejects_only_the_first_n_times_across_instances() -> None:
    name = unique("mem")
    events = make_events(4)
    config = {"type": "memory", "name": name, "reject_ids": [102, 104], "reject_times": 2, "fail_times": 1}
    try:
        with pytest.raises(SinkError) as err:
            build_sink(config).publish(events)
        assert not err.value.permanent and err.value.event_ids == (101, 102, 103, 104)  # fail_times comes first
        rejected: list[Any] = []
        for _ in range(4):  # a fresh sink each time, like a retried delivery
            with build_sink(config) as sink, pytest.raises(SinkError) as err:
                sink.publish(events[1:])
            assert err.value.permanent
            rejected += err.value.event_ids
        assert rejected == [102, 102, 104, 104]  # 102 twice, then accepted; then 104 twice
        assert MemorySink.rejections(name) == {102: 2, 104: 2}
        build_sink(config).publish(events[1:])
        assert [e.id for e in MemorySink.delivered(name)] == [102, 103, 102, 103, 102, 103, 104]
    finally:
        MemorySink.reset(name)


def test_memory_sink_reject_whole_call_names_every_event_until_published_alone() -> None:
    name = unique("mem")
    events = make_events(3)
    try:
        with MemorySinkConfig(name=name, reject_ids=[102], reject_whole_call=True).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(events)
            assert err.value.permanent and err.value.event_ids == (101, 102, 103)
            assert "events 101..103" in str(err.value) and "event 102" in str(err.value)
            assert MemorySink.delivered(name) == []  # a rejected request delivers nothing
            outcomes: list[str | tuple[int, ...]] = []
            for event in events:  # the caller isolates the bad one
                try:
                    sink.publish([event])
                    outcomes.append("ok")
                except SinkError as exc:
                    outcomes.append(exc.event_ids)
                    assert exc.permanent
        assert outcomes == ["ok", (102,), "ok"]
        assert MemorySink.delivered(name) == [events[0], events[2]]
        assert MemorySink.rejections(name) == {102: 2}
    finally:
        MemorySink.reset(name)


def test_sink_error_permanent_defaults_to_false_and_survives_pickling() -> None:
    events = make_events(2)
    plain = SinkError.for_events("x", events, "down")
    assert plain.permanent is False and plain.event_ids == (101, 102)
    rejected = SinkError.for_events("x", events[1:], "too large: tok3n", ["tok3n"], permanent=True)
    assert str(rejected) == "x sink: event 102: too large: ***"
    copy = pickle.loads(pickle.dumps(rejected))  # a Spark task's error reaches the driver pickled
    assert (type(copy), str(copy), copy.sink, copy.event_ids, copy.permanent) == (
        SinkError, "x sink: event 102: too large: ***", "x", (102,), True)
    assert SinkError("m", permanent=True).permanent


# -- file ---------------------------------------------------------------------------------------------


def test_file_sink_appends_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "events.jsonl"
    events = make_events(12)
    with FileSinkConfig(path=str(path)).build() as sink:
        sink.publish(events[:7])
    rows = read_jsonl(path)
    assert len(rows) == 7
    assert rows == [e.as_json_dict() for e in events[:7]]
    assert list(rows[0]) == ["id", "stream_id", "created_at", "payload", "metadata"]
    assert [datetime.fromisoformat(r["created_at"]) for r in rows] == [e.created_at for e in events[:7]]
    assert rows[0]["payload"]["nested"]["ünïcode"] == "✓"

    # a second sink on the same file appends; publishing nothing writes nothing
    with build_sink({"type": "file", "path": str(path)}) as sink:
        sink.publish([])
        sink.publish(events[7:])
    rows = read_jsonl(path)
    assert [r["id"] for r in rows] == [e.id for e in events]
    assert rows == [e.as_json_dict() for e in events]


def test_file_sink_unwritable_path_raises(tmp_path: Path) -> None:
    with FileSinkConfig(path=str(tmp_path)).build() as sink:  # a directory, not a file
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert "file sink" in str(err.value) and "events 101..102" in str(err.value)
    assert not err.value.permanent


def test_file_sink_disk_full_is_not_a_permanent_rejection() -> None:
    with FileSinkConfig(path="/dev/full").build() as sink:  # every write fails with ENOSPC
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
    assert "No space left on device" in str(err.value) and err.value.event_ids == (101, 102, 103)
    assert not err.value.permanent  # the file system's problem: the same events succeed once there is room


def test_configs_and_sinks_work_in_another_process(tmp_path: Path) -> None:
    path = tmp_path / "child.jsonl"
    events = make_events(9)
    config = FileSinkConfig(path=str(path))
    payload = pickle.dumps((config, FileSink(config), events))
    code = """
import pickle, sys
config, sink, events = pickle.loads(sys.stdin.buffer.read())
with config.build() as built:
    built.publish(events[:4])
with sink:
    sink.publish(events[4:])
"""
    result = run_python(code, payload)
    assert result.returncode == 0, result.stderr.decode()
    assert read_jsonl(path) == [e.as_json_dict() for e in events]




# -- event paths: payload or metadata (sinks.base.EventPath, route) -----------------------------------


def test_route_reads_the_payload_or_with_metadata_prefix_the_metadata() -> None:
    event = Event(1, 2, {"table": "orders", "metadata": {"region": "from-payload"}, "n": 7, "obj": {"a": 1}},
                  {"region": "eu", "route": {"topic": "t1"}, "flag": True}, created_at=datetime(2024, 1, 1))
    assert route(event, None, "table") == ("orders", True)
    assert route(event, None, "payload:table") == ("orders", True)
    # a bare path keeps meaning the payload, even one starting with "metadata."
    assert route(event, None, "metadata.region") == ("from-payload", True)
    assert route(event, None, "metadata:region", "p.") == ("p.eu", True)
    assert route(event, None, "metadata:route.topic") == ("t1", True)
    assert route(event, None, "metadata:flag") == ("true", True)
    assert route(event, None, "n") == ("7", True)
    assert route(event, "fixed", "metadata:missing") == ("fixed", False)
    assert route(event, "fixed", "metadata:route") == ("fixed", False)  # not a scalar: the fallback
    for path, message in [("metadata:missing", "metadata path 'missing' is missing and no fixed name is configured"),
                          ("metadata:route", "metadata path 'route' is dict, not a scalar"),
                          ("missing", "payload path 'missing' is missing"),
                          ("metadata.route", "payload path 'metadata.route' is missing")]:
        with pytest.raises(RoutingError, match=message.replace(".", r"\.")):
            route(event, None, path)
    bare = Event(3, 2, {"x": 1}, None, created_at=datetime(2024, 1, 1))
    with pytest.raises(RoutingError, match=r"metadata path 'region' is missing \(the event has no metadata\)"):
        route(bare, None, "metadata:region")


EVENT_PATH_OPTIONS: list[dict[str, Any]] = [
    {"type": "redis", "stream_from": "metadata:region"},
    {"type": "nats", "subject_from": "metadata:region"},
    {"type": "rabbitmq", "exchange_from": "metadata:exchange", "routing_key_from": "metadata:region"},
    {"type": "kafka", "topic_from": "metadata:region", "key_from": "metadata:tenant"},
    {"type": "http", "url": "http://127.0.0.1:9/hook", "routing_key": "metadata:tenant",
     "path_from": "metadata:region", "headers_from": {"X-Region": "metadata:region"}},
]


@pytest.mark.parametrize("options", EVENT_PATH_OPTIONS, ids=[o["type"] for o in EVENT_PATH_OPTIONS])
def test_every_sink_takes_event_paths_where_it_took_payload_paths(options: dict[str, Any]) -> None:
    """One syntax for every destination option: ``metadata:<path>`` is accepted, a malformed one refused."""
    config = parse_sink_config(options)
    for key, value in options.items():
        if key != "type" and key != "url":
            assert getattr(config, key) == value
            bad = {k: "meta:x" for k in value} if isinstance(value, dict) else "meta:x"
            with pytest.raises(ValidationError, match="String should match pattern"):
                parse_sink_config({**options, key: bad})


#: every option that reads the event to route it, per sink: nothing here connects before the event is read
ROUTED: list[dict[str, Any]] = [
    {"type": "http", "url": "http://127.0.0.1:9/hook", "path_from": "metadata:t"},
    {"type": "http", "url": "http://127.0.0.1:9/hook", "routing_key": "t"},
    {"type": "http", "url": "http://127.0.0.1:9/hook", "headers_from": {"X-T": "t"}},
    {"type": "redis", "stream_from": "t"},
    {"type": "rabbitmq", "exchange_from": "t", "routing_key": "k"},
    {"type": "rabbitmq", "routing_key_from": "t"},
    {"type": "nats", "subject_from": "t", "subject": "fallback"},
    {"type": "kafka", "topic_from": "t", "topic": "fallback"},
    {"type": "kafka", "key_from": "t", "topic": "fallback"},
    {"type": "mqtt", "topic_from": "t", "topic": "fallback"},
    {"type": "sqs", "queue_url": "http://127.0.0.1:9/123456789012/q.fifo", "message_group_id_from": "t",
     "region": "us-east-1"},
    {"type": "sns", "topic_arn": "arn:aws:sns:us-east-1:123456789012:t.fifo", "message_group_id_from": "t",
     "region": "us-east-1"},
    {"type": "kinesis", "stream_name": "s", "partition_key_from": "t", "region": "us-east-1"},
]


@pytest.mark.parametrize("options", ROUTED, ids=[f"{o['type']}-{sorted(o)[0]}" for o in ROUTED])
def test_content_python_cannot_parse_is_a_permanent_rejection_of_that_event(options: dict[str, Any]) -> None:
    """Postgres stores JSON Python cannot parse (nesting deeper than the recursion limit): a sink that
    reads the event to route it rejects that one event for good (a dead letter), never crashes."""
    deep = "[" * 3000 + "]" * 3000
    event = event_from_text(7, 1, datetime(2024, 1, 1), '{"t": "a", "deep": ' + deep + "}", '{"t": ' + deep + "}")
    sink = build_sink(options)
    try:
        with pytest.raises(SinkError, match=r"event 7's (payload|metadata) is nested deeper than Python") as raised:
            sink.publish([event])
    finally:
        sink.close()
    assert raised.value.permanent and raised.value.event_ids == (7,)


def test_an_integer_python_does_not_convert_stays_an_exact_number() -> None:
    digits = "1" + "0" * 5000
    event = event_from_text(7, 1, datetime(2024, 1, 1), f'{{"n": {digits}, "m": [{digits}]}}', f'{{"r": {digits}}}')
    assert route(event, None, "n") == (digits, True)
    assert route(event, None, "metadata:r", "p.") == ("p." + digits, True)
    assert event.payload["m"][0] == decimal.Decimal(digits)
    assert event.payload_json.count(digits) == 2  # what sinks send: the text as stored
    with pytest.raises(EventContentError, match="event 7's payload is not JSON"):
        _ = event_from_text(7, 1, datetime(2024, 1, 1), '{"n": ', None).payload
