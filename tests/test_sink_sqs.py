"""The SQS sink against moto's standalone server over HTTP (no AWS account is reachable here), with a
fault-injecting proxy in front of it for per-entry failures and outages (tests/support/aws.py).
Counts and order (per message group), FIFO deduplication ids, the confirmed prefix of a partly
failed batch, permanent and transient failures, errors without secrets, and a real pipeline into an
SQS FIFO queue through an outage of the server."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from pydantic import ValidationError

from pgstream_dagster.sinks import Event, SinkError, SqsSink, build_sink, parse_sink_config

from .support.aws import (
    FakeCredentials,
    FaultProxy,
    MotoServer,
    create_queue,
    message_event_id,
    receive_all,
)
from .support.faults import drive, in_failover, ledger_order, sent_ids, stream_row
from .support.harness import Driver, insert_events, write_config
from .support.sinks import BASE_TIME, free_port, make_events, unique


def event(i: int, payload: dict[str, object] | None = None, *, payload_json: str | None = None) -> Event:
    return Event(id=i, stream_id=7, payload=payload, payload_json=payload_json, created_at=BASE_TIME)


def ids(messages: list[dict[str, object]]) -> list[int]:
    return [message_event_id(m) for m in messages]


def test_fifo_queue_gets_every_event_in_order_with_group_and_deduplication_ids(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    queue = create_queue(moto_server.url, fifo=True)
    events = make_events(95)
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": fault_proxy.url}) as sink:
        assert isinstance(sink, SqsSink)
        sink.publish(events[:50])
        sink.publish(events[50:])
    messages = receive_all(moto_server.url, queue, 95)
    assert ids(messages) == [e.id for e in events]  # all, once, in order
    assert [m["Attributes"]["MessageDeduplicationId"] for m in messages] == [str(e.id) for e in events]
    assert {m["Attributes"]["MessageGroupId"] for m in messages} == {"7"}  # default group: the stream id
    first = messages[0]
    assert first["Body"] == events[0].payload_json
    assert first["MessageAttributes"]["pgstream-stream-id"] == {"DataType": "Number", "StringValue": "7"}
    assert first["MessageAttributes"]["pgstream-event-id"] == {"DataType": "Number", "StringValue": "101"}
    assert first["MessageAttributes"]["pgstream-metadata"]["StringValue"] == events[0].metadata_json
    assert "pgstream-metadata" not in messages[1]["MessageAttributes"]  # event 102 has no metadata
    sizes = [len(r.entries) for r in fault_proxy.actions("SendMessageBatch")]
    assert sizes == [10] * 5 + [10] * 4 + [5]  # at most 10 entries per request


def test_a_retried_batch_is_dropped_by_fifo_deduplication(moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    queue = create_queue(moto_server.url, fifo=True)
    events = make_events(25)
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": moto_server.url}) as sink:
        sink.publish(events)
        sink.publish(events[5:])  # the stream retries a batch: same event ids, same deduplication ids
    assert ids(receive_all(moto_server.url, queue, 25)) == [e.id for e in events]


def test_message_groups_from_a_payload_path_keep_order_per_group(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    queue = create_queue(moto_server.url, fifo=True)
    events = [event(i, {"tenant": f"t{i % 3}"} if i % 7 else {"other": 1}) for i in range(1, 61)]
    config = {"type": "sqs", "queue_url": queue, "endpoint_url": moto_server.url,
              "message_group_id_from": "tenant", "message_group_id": "no-tenant"}
    with build_sink(config) as sink:
        sink.publish(events)
    messages = receive_all(moto_server.url, queue, 60)
    groups: dict[str, list[int]] = {}
    for m in messages:
        groups.setdefault(m["Attributes"]["MessageGroupId"], []).append(message_event_id(m))
    assert sorted(groups) == ["no-tenant", "t0", "t1", "t2"]
    assert groups["no-tenant"] == [7, 14, 21, 28, 35, 42, 49, 56]  # no value at the path: the fixed group
    assert all(found == sorted(found) for found in groups.values())  # order per group
    assert sum(len(found) for found in groups.values()) == 60

    # a group id the payload makes invalid is the event's fault: the events before it are sent
    bad = [event(101, {"tenant": "a"}), event(102, {"tenant": "has space"}), event(103, {"tenant": "b"})]
    with build_sink({**config, "endpoint_url": fault_proxy.url}) as sink, pytest.raises(SinkError) as info:
        sink.publish(bad)
    assert info.value.permanent and info.value.event_ids == (102,)
    assert "invalid MessageGroupId 'has space'" in str(info.value)
    assert ids(receive_all(moto_server.url, queue, 1)) == [101]


def test_standard_queue_has_no_group_or_deduplication_id(moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    queue = create_queue(moto_server.url, fifo=False)
    events = make_events(23)
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": moto_server.url}) as sink:
        sink.publish(events)
    messages = receive_all(moto_server.url, queue, 23)
    assert sorted(ids(messages)) == [e.id for e in events]
    assert not any("MessageGroupId" in m["Attributes"] or "MessageDeduplicationId" in m["Attributes"]
                   for m in messages)


def test_an_oversized_message_in_the_middle_is_rejected_after_the_ones_before(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    queue = create_queue(moto_server.url, fifo=True)
    events = make_events(25)
    big = Event(id=113, stream_id=7, payload_json='{"blob": "' + "x" * 262_144 + '"}', created_at=BASE_TIME)
    sent = [*events[:12], big, *events[13:]]
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": fault_proxy.url}) as sink:
        with pytest.raises(SinkError) as info:
            sink.publish(sent)
        assert info.value.permanent and info.value.event_ids == (113,)
        message = str(info.value)
        assert message.startswith(f"sqs sink: event 113: not sent to queue {queue}: the message is ")
        assert "more than max_message_bytes (262144)" in message
        assert [len(r.entries) for r in fault_proxy.actions("SendMessageBatch")] == [10, 2]  # nothing after it
        sink.publish(sent[13:])  # the caller set event 113 aside and goes on
    assert ids(receive_all(moto_server.url, queue, 24)) == [e.id for e in events if e.id != 113]


def test_characters_sqs_refuses_are_a_permanent_rejection(moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    queue = create_queue(moto_server.url, fifo=False)
    bad_body = event(2, payload_json='{"s": "a\uffffb"}')
    bad_metadata = Event(id=3, stream_id=7, payload={"ok": 1}, metadata_json='{"m": "\ufffe"}', created_at=BASE_TIME)
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": moto_server.url}) as sink:
        for bad, where in ((bad_body, "the body holds U+FFFF at character 8"),
                           (bad_metadata, "attribute pgstream-metadata holds U+FFFE at character 7")):
            with pytest.raises(SinkError) as info:
                sink.publish([event(1, {"ok": 0}), bad])
            assert info.value.permanent and info.value.event_ids == (bad.id,)
            assert f"{where}, which SQS does not accept" in str(info.value)
    assert ids(receive_all(moto_server.url, queue, 2)) == [1, 1]  # the event before it, both times


def test_a_request_the_queue_refuses_whole_names_its_events_and_the_caller_isolates_the_bad_one(
        moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    # the queue takes at most 1024 bytes, the sink's limit is the default 256 KiB: moto refuses the request
    queue = create_queue(moto_server.url, fifo=True, MaximumMessageSize="1024")
    events = [event(i, {"n": i, "pad": "y" * (2000 if i == 15 else 10)}) for i in range(1, 26)]
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": moto_server.url}) as sink:
        with pytest.raises(SinkError) as info:
            sink.publish(events)
        assert info.value.permanent and info.value.event_ids == tuple(range(11, 21))
        assert "refused a request of 10 messages (which one is at fault is not known)" in str(info.value)
        assert "shorter than 1024 bytes" in str(info.value)
        outcomes: dict[int, tuple[int, ...] | None] = {}
        for one in events[10:20]:  # what the publish loop does: one at a time
            try:
                sink.publish([one])
                outcomes[one.id] = None
            except SinkError as exc:
                assert exc.permanent and "refused the message" in str(exc)
                outcomes[one.id] = exc.event_ids
    assert {i: o for i, o in outcomes.items() if o is not None} == {15: (15,)}
    assert ids(receive_all(moto_server.url, queue, 19)) == [i for i in range(1, 21) if i != 15]


def marked(i: int, marker: str | None = None) -> Event:
    return event(i, {"n": i, "fault": marker} if marker else {"n": i})


def test_an_entry_failing_transiently_is_sent_again_with_the_ones_after_it(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    queue = create_queue(moto_server.url, fifo=True)
    marker = unique("internal")
    fault_proxy.fail(marker, "InternalError", times=1)
    events = [marked(i, marker if i == 14 else None) for i in range(1, 31)]
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": fault_proxy.url}) as sink:
        sink.publish(events)  # retried inside the call: it succeeds
    requests = fault_proxy.actions("SendMessageBatch")
    assert [[int(e["MessageDeduplicationId"]) for e in r.entries] for r in requests] == [
        list(range(1, 11)), list(range(11, 21)), list(range(14, 21)), list(range(21, 31))]
    # 15..20 were accepted in the first attempt, so 14 came after them; their second copies were dropped
    # (deduplication id = event id): every event once. Strict order needs max_batch_size: 1 (below)
    assert ids(receive_all(moto_server.url, queue, 30)) == [*range(1, 14), *range(15, 21), 14, *range(21, 31)]

    queue = create_queue(moto_server.url, fifo=True)
    fault_proxy.fail(marker, "InternalError", times=1)
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": fault_proxy.url,
                     "max_batch_size": 1}) as sink:
        sink.publish(events)
    assert ids(receive_all(moto_server.url, queue, 30)) == list(range(1, 31))  # one per request: strict order


def test_an_entry_that_keeps_failing_is_not_permanent_and_stops_the_prefix(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    queue = create_queue(moto_server.url, fifo=True)
    marker = unique("throttled")
    fault = fault_proxy.fail(marker, "RequestThrottled", message="Rate exceeded")
    events = [marked(i, marker if i == 14 else None) for i in range(1, 31)]
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": fault_proxy.url}) as sink:
        with pytest.raises(SinkError) as info:
            sink.publish(events)
    assert not info.value.permanent and info.value.event_ids == tuple(range(14, 31))
    assert f"queue {queue} did not accept event 14 after 3 attempt(s): RequestThrottled: Rate exceeded" \
        in str(info.value)
    assert fault.hits == 3
    assert len(fault_proxy.actions("SendMessageBatch")) == 1 + 3  # the first request, three of the second, no more
    received = ids(receive_all(moto_server.url, queue, 19))
    assert received[:13] == list(range(1, 14)) and sorted(received[13:]) == list(range(15, 21))

    # a sender fault about the entry's content is permanent, after the entries before it
    queue = create_queue(moto_server.url, fifo=True)
    fault_proxy.fail(marker, "InvalidMessageContents", sender_fault=True, message="Invalid binary character")
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": fault_proxy.url}) as sink:
        with pytest.raises(SinkError) as info:
            sink.publish(events)
    assert info.value.permanent and info.value.event_ids == (14,)
    assert "refused the message: InvalidMessageContents: Invalid binary character" in str(info.value)
    assert ids(receive_all(moto_server.url, queue, 19))[:13] == list(range(1, 14))


def test_outages_and_configuration_errors_are_not_permanent_and_show_no_secret(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    queue = create_queue(moto_server.url, fifo=True)
    events = make_events(5)
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": fault_proxy.url}) as sink:
        sink.publish(events[:2])  # botocore logs every request at DEBUG, session token header included
        fault_proxy.outage = True  # every request answered 503: botocore retries, then the publish fails
        with pytest.raises(SinkError) as unavailable:
            sink.publish(events[2:])
    assert not unavailable.value.permanent and unavailable.value.event_ids == (103, 104, 105)
    assert "(HTTP 503)" in str(unavailable.value) and f"at {fault_proxy.url} (us-east-1) failed" \
        in str(unavailable.value)
    assert len(fault_proxy.actions("SendMessageBatch")) == 1 + 3  # max_attempts: 3

    port = free_port()
    started = time.monotonic()
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": f"http://127.0.0.1:{port}",
                     "region": "eu-west-1", "max_attempts": 2}) as sink, pytest.raises(SinkError) as unreachable:
        sink.publish(events)
    assert time.monotonic() - started < 10
    message = str(unreachable.value)
    assert message.startswith(f"sqs sink: events 101..105 (5 events): cannot reach http://127.0.0.1:{port} "
                              "(eu-west-1) after 2 attempt(s): Could not connect to the endpoint URL"), message
    assert not unreachable.value.permanent

    missing = queue.rsplit("/", 1)[0] + "/no-such-queue.fifo"
    with build_sink({"type": "sqs", "queue_url": missing, "endpoint_url": moto_server.url}) as sink, \
            pytest.raises(SinkError) as no_queue:
        sink.publish(events)
    assert not no_queue.value.permanent and "The specified queue does not exist" in str(no_queue.value)

    assert "x-amz-security-token" in caplog.text.lower()  # the header was logged, masked
    for text in (str(unavailable.value), message, str(no_queue.value), repr(unavailable.value), caplog.text):
        assert not [secret for secret in aws_env.secrets if secret in text]


def test_missing_credentials_or_region_fail_clearly(moto_server: MotoServer, aws_env: FakeCredentials,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    queue = create_queue(moto_server.url, fifo=False)
    config = {"type": "sqs", "queue_url": queue, "endpoint_url": moto_server.url}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    with build_sink(config) as sink, pytest.raises(SinkError) as info:
        sink.publish(make_events(1))
    assert "no AWS credentials" in str(info.value) and not info.value.permanent
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.secret_access_key)
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    with build_sink(config) as sink, pytest.raises(SinkError) as info:
        sink.publish(make_events(1))
    assert "no AWS region: set the sink's region, or AWS_REGION" in str(info.value) and not info.value.permanent
    with build_sink({**config, "region": "us-east-1"}) as sink:
        sink.publish(make_events(1))


@pytest.mark.parametrize("key", ["aws_access_key_id", "aws_secret_access_key", "aws_session_token",
                                 "secret_key", "password", "credentials"])
def test_credentials_in_the_configuration_are_refused_without_their_value(key: str) -> None:
    value = "cr3d-" + unique("v")
    with pytest.raises(ValidationError) as info:
        parse_sink_config({"type": "sqs", "queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/q",
                           key: value})
    assert f"[{key!r}] look like AWS credentials, which are never read from the configuration" in str(info.value)
    assert value not in str(info.value) and value not in repr(info.value)


def test_invalid_settings_are_refused_when_the_configuration_is_read() -> None:
    base = {"type": "sqs", "queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/q.fifo"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"endpoint_url": "http://user:pw-" + "x" * 8 + "@127.0.0.1:4566"}, "must not carry user info"),
        ({"endpoint_url": "ftp://127.0.0.1"}, "must be an http(s) URL"),
        ({"queue_url": "not a url"}, "queue_url"),
        ({"message_group_id": "has space"}, "message_group_id"),
        ({"max_batch_size": 11}, "max_batch_size"),
        ({"max_message_bytes": 2_000_000}, "max_message_bytes"),
        ({"region": "Not A Region"}, "region"),
    ]
    for extra, expected in cases:
        with pytest.raises(ValidationError) as info:
            parse_sink_config({**base, **extra})
        assert expected in str(info.value), str(info.value)
        assert "pw-xxxxxxxx" not in str(info.value)


def test_delivery_to_an_sqs_fifo_queue_survives_an_outage_with_nothing_lost(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, aws_env: FakeCredentials) -> None:
    server = MotoServer(tmp_path / "moto.log").start()  # a server of its own, to stop and start again
    try:
        queue = create_queue(server.url, fifo=True)
        sink = {"type": "sqs", "queue_url": queue, "endpoint_url": server.url, "max_attempts": 1, "timeout_secs": 5}
        driver = Driver(write_config(tmp_path / "pgstream.yaml", db_url, [{
            "id": 1, "batch": {"max_size": 50, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.3},
            "retry": {"initial_backoff_secs": 0.5, "max_backoff_secs": 2},
            "delivery": {"chunk_size": 20, "run_grace_secs": 2}, "sink": sink}]), instance)
        driver.tick(1)
        received: list[int] = []

        def drained(expected: int) -> bool:
            received.extend(ids(receive_all(server.url, queue, 0, timeout=2)))
            return len(set(received)) >= expected and not in_failover(db_url)

        insert_events(db_url, 1, 120)
        drive(driver, lambda: drained(120))

        server.stop()  # the outage: connection refused; events keep coming
        insert_events(db_url, 1, 150, 120)
        deadline = time.monotonic() + 120
        while not in_failover(db_url):
            assert time.monotonic() < deadline
            for request in driver.tick(1).run_requests or []:
                assert not driver.execute(request).success
        assert "cannot reach" in stream_row(db_url)["failover_error"]
        insert_events(db_url, 1, 30, 270)

        server.start()  # moto keeps nothing: the queue is created again, same name and URL
        assert create_queue(server.url, fifo=True, name=queue.rsplit("/", 1)[1]) == queue
        recover_started = time.monotonic()
        drive(driver, lambda: drained(300))
        recover = time.monotonic() - recover_started
    finally:
        server.stop()
    sent = sent_ids(db_url)
    assert len(sent) == 300 and set(received) == set(sent)  # nothing lost
    first_seen = list(dict.fromkeys(received))
    assert first_seen == ledger_order(db_url)  # first deliveries in commit order
    print(f"SQS-OUTAGE sent=300 received={len(received)} duplicates={len(received) - 300} recover_secs={recover:.1f}")


def test_message_groups_from_the_event_metadata(moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    queue = create_queue(moto_server.url, fifo=True)
    events = [Event(id=i, stream_id=7, payload={"tenant": "ignored"}, metadata={"tenant": f"m{i % 2}"},
                    created_at=BASE_TIME) for i in range(1, 11)]
    events.append(Event(id=11, stream_id=7, payload={"n": 11}, created_at=BASE_TIME))  # no metadata: the fixed group
    with build_sink({"type": "sqs", "queue_url": queue, "endpoint_url": moto_server.url,
                     "message_group_id_from": "metadata:tenant", "message_group_id": "none"}) as sink:
        sink.publish(events)
    groups: dict[str, list[int]] = {}
    for m in receive_all(moto_server.url, queue, 11):
        groups.setdefault(m["Attributes"]["MessageGroupId"], []).append(message_event_id(m))
    assert groups == {"m0": [2, 4, 6, 8, 10], "m1": [1, 3, 5, 7, 9], "none": [11]}
