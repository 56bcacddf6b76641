"""The SNS sink against moto's standalone server over HTTP, each topic read through an SQS queue
subscribed with raw message delivery; per-entry failures and outages injected by the proxy of
tests/support/aws.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pgstream_dagster.sinks import Event, SinkError, SnsSink, build_sink, parse_sink_config

from .support.aws import (
    FakeCredentials,
    FaultProxy,
    MotoServer,
    client,
    create_queue,
    message_event_id,
    queue_arn,
    receive_all,
    unique_name,
)
from .support.sinks import BASE_TIME, make_events, unique


def topic_with_queue(endpoint: str, *, fifo: bool) -> tuple[str, str]:
    """A new topic and a queue subscribed to it (raw delivery: attributes become SQS message attributes)."""
    sns = client("sns", endpoint)
    attributes = {"FifoTopic": "true"} if fifo else {}
    topic = sns.create_topic(Name=unique_name("pgstream") + (".fifo" if fifo else ""), Attributes=attributes)
    queue = create_queue(endpoint, fifo=fifo)
    sns.subscribe(TopicArn=topic["TopicArn"], Protocol="sqs", Endpoint=queue_arn(endpoint, queue),
                  Attributes={"RawMessageDelivery": "true"})
    return str(topic["TopicArn"]), queue


def ids(messages: list[dict[str, Any]]) -> list[int]:
    return [message_event_id(m) for m in messages]


def event(i: int, payload: dict[str, Any]) -> Event:
    return Event(id=i, stream_id=7, payload=payload, created_at=BASE_TIME)


def test_fifo_topic_delivers_every_event_in_order_with_group_and_deduplication_ids(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    topic, queue = topic_with_queue(moto_server.url, fifo=True)
    events = make_events(45)
    with build_sink({"type": "sns", "topic_arn": topic, "endpoint_url": fault_proxy.url}) as sink:
        assert isinstance(sink, SnsSink)
        sink.publish(events)
        sink.publish(events[40:])  # a retried batch: dropped by the topic's deduplication
    messages = receive_all(moto_server.url, queue, 45)
    assert ids(messages) == [e.id for e in events]
    assert [m["Attributes"]["MessageDeduplicationId"] for m in messages] == [str(e.id) for e in events]
    assert {m["Attributes"]["MessageGroupId"] for m in messages} == {"7"}
    assert messages[0]["Body"] == events[0].payload_json
    assert messages[0]["MessageAttributes"]["pgstream-stream-id"] == {"DataType": "Number", "StringValue": "7"}
    assert messages[0]["MessageAttributes"]["pgstream-metadata"]["StringValue"] == events[0].metadata_json
    assert [len(r.entries) for r in fault_proxy.actions("PublishBatch")] == [10, 10, 10, 10, 5, 5]


def test_groups_from_a_payload_path_and_a_standard_topic(moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    topic, queue = topic_with_queue(moto_server.url, fifo=True)
    events = [event(i, {"tenant": f"t{i % 2}"}) for i in range(1, 21)]
    with build_sink({"type": "sns", "topic_arn": topic, "endpoint_url": moto_server.url,
                     "message_group_id_from": "tenant"}) as sink:
        sink.publish(events)
    groups: dict[str, list[int]] = {}
    for m in receive_all(moto_server.url, queue, 20):
        groups.setdefault(m["Attributes"]["MessageGroupId"], []).append(message_event_id(m))
    assert groups == {"t0": list(range(2, 21, 2)), "t1": list(range(1, 21, 2))}

    topic, queue = topic_with_queue(moto_server.url, fifo=False)
    with build_sink({"type": "sns", "topic_arn": topic, "endpoint_url": moto_server.url}) as sink:
        sink.publish(events)
    messages = receive_all(moto_server.url, queue, 20)
    assert sorted(ids(messages)) == list(range(1, 21))
    assert not any("MessageGroupId" in m["Attributes"] for m in messages)


def test_an_entry_the_topic_refuses_is_rejected_after_the_ones_before(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    topic, queue = topic_with_queue(moto_server.url, fifo=False)
    events = [event(i, {"n": i, "pad": "z" * (300_000 if i == 8 else 10)}) for i in range(1, 26)]
    # the sink's own limit raised above SNS's 256 KiB: the topic refuses the entry (a Failed entry, sender fault)
    config = {"type": "sns", "topic_arn": topic, "endpoint_url": fault_proxy.url, "max_message_bytes": 1_048_576}
    with build_sink(config) as sink, pytest.raises(SinkError) as info:
        sink.publish(events)
    assert info.value.permanent and info.value.event_ids == (8,)
    assert str(info.value).startswith(f"sns sink: event 8: topic {topic} refused the message: InvalidParameter: ")
    assert "Message too long" in str(info.value)
    assert len(fault_proxy.actions("PublishBatch")) == 1  # nothing sent after the refused entry's request
    received = ids(receive_all(moto_server.url, queue, 9))
    # the entries before it are confirmed; 9 and 10 were accepted in the same request (sent again later)
    assert sorted(received) == [1, 2, 3, 4, 5, 6, 7, 9, 10]

    # within the sink's default limit (256 KiB) the same event is refused before anything is sent for it
    with build_sink({**config, "max_message_bytes": 262_144}) as sink, pytest.raises(SinkError) as info:
        sink.publish(events[5:])
    assert info.value.permanent and info.value.event_ids == (8,)
    assert "not sent to topic" in str(info.value) and "more than max_message_bytes (262144)" in str(info.value)
    assert [len(r.entries) for r in fault_proxy.actions("PublishBatch")][1:] == [2]  # events 6 and 7


def test_transient_entry_failures_are_retried_then_not_permanent(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    topic, queue = topic_with_queue(moto_server.url, fifo=True)
    marker = unique("throttled")
    fault_proxy.fail(marker, "Throttled", times=2, message="Rate exceeded")
    events = [event(i, {"n": i, "fault": marker if i == 4 else None}) for i in range(1, 13)]
    with build_sink({"type": "sns", "topic_arn": topic, "endpoint_url": fault_proxy.url}) as sink:
        sink.publish(events)  # the third attempt of the entry goes through
    assert sorted(ids(receive_all(moto_server.url, queue, 12))) == list(range(1, 13))  # each once (dedup ids)

    fault = fault_proxy.fail(marker, "InternalError")
    with build_sink({"type": "sns", "topic_arn": topic, "endpoint_url": fault_proxy.url, "max_attempts": 2}) as sink, \
            pytest.raises(SinkError) as info:
        sink.publish(events)
    assert not info.value.permanent and info.value.event_ids == tuple(range(4, 13)) and fault.hits == 2
    assert f"topic {topic} did not accept event 4 after 2 attempt(s): InternalError" in str(info.value)

    fault_proxy.outage = True
    with build_sink({"type": "sns", "topic_arn": topic, "endpoint_url": fault_proxy.url}) as sink, \
            pytest.raises(SinkError) as info:
        sink.publish(events[:3])
    assert not info.value.permanent and "(HTTP 503)" in str(info.value)
    for text in (str(info.value), repr(info.value)):
        assert not [secret for secret in aws_env.secrets if secret in text]


def test_a_missing_topic_is_not_permanent(moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    missing = f"arn:aws:sns:us-east-1:123456789012:{unique_name('absent')}"
    with build_sink({"type": "sns", "topic_arn": missing, "endpoint_url": moto_server.url}) as sink, \
            pytest.raises(SinkError) as info:
        sink.publish(make_events(3))
    assert not info.value.permanent and info.value.event_ids == (101, 102, 103)
    assert f"topic {missing} at {moto_server.url} (us-east-1) failed: NotFound" in str(info.value)


def test_invalid_topic_arns_are_refused() -> None:
    for arn in ("my-topic", "arn:aws:sqs:us-east-1:123456789012:q", "arn:aws:sns:us-east-1:12:t"):
        with pytest.raises(ValidationError, match="topic_arn"):
            parse_sink_config({"type": "sns", "topic_arn": arn})
    with pytest.raises(ValidationError, match="look like AWS credentials"):
        parse_sink_config({"type": "sns", "topic_arn": "arn:aws:sns:us-east-1:123456789012:t",
                           "aws_secret_access_key": "x"})
