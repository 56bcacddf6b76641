"""The NATS sink against the server on 127.0.0.1:4222 (JetStream and core NATS)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from pydantic import SecretStr, ValidationError

from pgstream_dagster.sinks import (
    Event,
    NatsSink,
    NatsSinkConfig,
    SinkError,
    build_sink,
)

from .support.sinks import BASE_TIME, NATS_URL, free_port, make_events, nats_admin, unique


def test_nats_jetstream_publish_acked_in_order_and_deduplicated(nats_stream: tuple[str, str]) -> None:
    stream, subject = nats_stream
    events = make_events(30)
    with NatsSinkConfig(servers=[NATS_URL], subject=subject).build() as sink:
        sink.publish(events[:10])
        sink.publish(events)  # a retry of a batch partly delivered: Nats-Msg-Id drops the duplicates
    count, messages = asyncio.run(nats_admin("read", stream, subject, expected=len(events)))
    assert count == len(events)
    assert [json.loads(m.data) for m in messages] == [e.payload for e in events]
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [str(e.id) for e in events]
    assert [json.loads(m.headers.get("Pgstream-Metadata", "null")) for m in messages] == [e.metadata for e in events]
    assert [m.metadata.sequence.stream for m in messages] == list(range(1, len(events) + 1))


def test_nats_core_publish_with_flush(nats_stream: tuple[str, str]) -> None:
    stream, subject = nats_stream
    events = make_events(8)
    with build_sink({"type": "nats", "subject": subject, "jetstream": False}) as sink:
        sink.publish(events)
    count, messages = asyncio.run(nats_admin("read", stream, subject, expected=len(events)))
    assert count == len(events)
    assert [json.loads(m.data) for m in messages] == [e.payload for e in events]


def test_nats_subject_from_payload_path(nats_stream: tuple[str, str]) -> None:
    stream, subject = nats_stream
    tables = ["orders", "users", None]  # None: no table in the payload -> the fallback subject
    events = [
        Event(id=400 + i, stream_id=1, payload={"seq": i, "table": tables[i % 3]} if tables[i % 3] else {"seq": i},
              metadata=None, created_at=BASE_TIME)
        for i in range(21)
    ]
    config = NatsSinkConfig(subject=subject, subject_from="table", subject_prefix=subject + ".")
    with config.build() as sink:
        sink.publish(events)
    count, messages = asyncio.run(nats_admin("read", stream, ">", expected=len(events)))
    assert count == len(events)
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [str(e.id) for e in events]
    expected = [f"{subject}.{e.payload['table']}" if "table" in e.payload else subject for e in events]
    assert [m.subject for m in messages] == expected

    bad = [Event(id=1, stream_id=1, payload={"table": "has space"}, metadata=None, created_at=BASE_TIME)]
    fresh = make_events(3, first_id=450)
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(fresh[:2] + bad + fresh[2:])
    assert "event 1:" in str(err.value) and "invalid subject" in str(err.value)
    assert err.value.permanent and err.value.event_ids == (1,)  # a subject from the payload: the event's fault
    # the events before it were acknowledged, nothing after it was sent
    assert asyncio.run(nats_admin("read", stream, ">", expected=0))[0] == len(events) + 2
    with pytest.raises(ValidationError):
        NatsSinkConfig()


def test_nats_subject_without_stream_raises() -> None:
    subject = f"pgstream.nostream.{uuid.uuid4().hex}"
    with NatsSinkConfig(subject=subject, timeout_secs=3).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
    assert "nats sink" in str(err.value) and "event 101" in str(err.value)
    assert "no JetStream stream" in str(err.value)
    assert not err.value.permanent  # creating or extending a stream makes it deliverable: configuration


def test_nats_a_subject_from_the_event_that_no_stream_captures_is_the_events_rejection(
        nats_stream: tuple[str, str]) -> None:
    stream, subject = nats_stream
    events = [Event(id=470 + i, stream_id=1, payload={"to": to}, created_at=BASE_TIME)
              for i, to in enumerate([subject + ".a", f"pgstream.nostream.{uuid.uuid4().hex}", subject + ".b",
                                      subject + "." + "x" * 5000])]
    with NatsSinkConfig(subject_from="to", timeout_secs=3).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
        assert err.value.permanent and err.value.event_ids == (471,)
        assert "no JetStream stream captures subject" in str(err.value) and "taken from the event" in str(err.value)
        with pytest.raises(SinkError) as err:  # the caller set 471 aside and goes on
            sink.publish(events[2:])
        assert err.value.permanent and err.value.event_ids == (473,) and "more than 3840" in str(err.value)
    _count, messages = asyncio.run(nats_admin("read", stream, ">", expected=2))
    assert [m.headers["Nats-Msg-Id"] for m in messages] == ["470", "472"]


def test_nats_connection_refused_raises(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = NatsSinkConfig(
        servers=[f"nats://127.0.0.1:{free_port()}"],
        subject="x",
        timeout_secs=1,
        password=SecretStr("natspw-9"),
        user="u",
    )
    assert "natspw-9" not in repr(config)
    started = time.monotonic()
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert time.monotonic() - started < 30
    assert "events 101..102" in str(err.value) and "natspw-9" not in str(err.value)
    assert "nats://127.0.0.1:" in str(err.value)
    assert "natspw-9" not in caplog.text
    assert not err.value.permanent


@pytest.fixture
def small_nats_stream() -> Iterator[tuple[str, str]]:
    """A JetStream stream whose max_msg_size is 400 bytes (payload and headers)."""
    name = unique("PGSTREAM_TEST").replace("-", "_")
    subject = f"pgstream.test.{name}"
    asyncio.run(nats_admin("create", name, subject, max_msg_size=400))
    yield name, subject
    asyncio.run(nats_admin("delete", name))


def test_nats_jetstream_max_msg_size_is_a_permanent_rejection(small_nats_stream: tuple[str, str]) -> None:
    stream, subject = small_nats_stream
    events = make_events(4)
    events[1] = Event(id=102, stream_id=7, payload={"blob": "x" * 500}, created_at=BASE_TIME)
    config = NatsSinkConfig(subject=subject, user="u", password=SecretStr("natspw-rej"))
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
        message = str(err.value)
        assert err.value.permanent and err.value.event_ids == (102,)
        assert message.startswith(f"nats sink: event 102: publish to {subject!r} at nats://127.0.0.1:4222 failed: ")
        assert "message size exceeds maximum allowed" in message and "natspw-rej" not in message
        sink.publish(events[2:])  # the caller set 102 aside
    count, messages = asyncio.run(nats_admin("read", stream, subject, expected=3))
    assert count == 3 and [m.headers["Nats-Msg-Id"] for m in messages] == ["101", "103", "104"]


@pytest.mark.parametrize("jetstream", [True, False])
def test_nats_message_over_the_servers_max_payload_is_refused_before_sending(
        nats_stream: tuple[str, str], jetstream: bool) -> None:
    stream, subject = nats_stream
    events = make_events(5)
    with NatsSink(NatsSinkConfig(subject=subject, jetstream=jetstream)) as sink:
        sink.publish(events[:1])
        assert sink._nc is not None
        max_payload = sink._nc.max_payload  # the server's (1 MiB default)
        # too large on its own, and too large only with its headers (nats-py checks the payload alone: the server
        # would close the connection, losing what was not flushed yet)
        blob = Event(id=102, stream_id=7, payload_json=f'"{"x" * max_payload}"', created_at=BASE_TIME)
        padded = Event(id=104, stream_id=7, payload_json=f'"{"y" * (max_payload - 20)}"', metadata={"op": "insert"},
                       created_at=BASE_TIME)
        rejected = []
        for bad, before in ((blob, events[1:1]), (padded, events[1:3])):
            with pytest.raises(SinkError) as err:
                sink.publish([*before, bad, events[4]])
            assert err.value.permanent and err.value.event_ids == (bad.id,)
            assert f"the server's max_payload ({max_payload})" in str(err.value)
            rejected.append(bad.id)
        sink.publish(events[4:])  # the connection survived
    assert rejected == [102, 104]
    count, messages = asyncio.run(nats_admin("read", stream, subject, expected=4))
    assert count == 4 and [m.headers["Nats-Msg-Id"] for m in messages] == ["101", "102", "103", "105"]



def test_nats_subject_problems_are_permanent_only_when_the_subject_comes_from_the_payload() -> None:
    event = make_events(1)
    with NatsSinkConfig(subject="has space").build() as sink, pytest.raises(SinkError) as err:
        sink.publish(event)
    assert "invalid subject 'has space'" in str(err.value) and not err.value.permanent  # the configuration's
    with NatsSinkConfig(subject_from="table").build() as sink, pytest.raises(SinkError) as err:
        sink.publish(event)
    assert "'table' is missing" in str(err.value) and err.value.permanent and err.value.event_ids == (101,)
    empty_token = Event(id=5, stream_id=1, payload={"table": "a..b"}, created_at=BASE_TIME)
    with NatsSinkConfig(subject_from="table").build() as sink, pytest.raises(SinkError) as err:
        sink.publish([empty_token])
    assert "invalid subject 'a..b'" in str(err.value) and err.value.permanent


def test_nats_subject_from_metadata(nats_stream: tuple[str, str]) -> None:
    stream, subject = nats_stream
    regions = ["eu", "us", "eu", "has space"]
    events = [Event(id=470 + i, stream_id=1, payload={"seq": i}, metadata={"route": {"region": r}},
                    created_at=BASE_TIME) for i, r in enumerate(regions)]
    config = NatsSinkConfig(subject_from="metadata:route.region", subject_prefix=subject + ".")
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(events)
    assert err.value.permanent and err.value.event_ids == (473,)  # a subject from the metadata: the event's fault
    count, messages = asyncio.run(nats_admin("read", stream, ">", expected=3))
    assert count == 3
    assert [(m.subject, m.headers["Nats-Msg-Id"]) for m in messages] == [
        (f"{subject}.eu", "470"), (f"{subject}.us", "471"), (f"{subject}.eu", "472")]
    assert [json.loads(m.headers["Pgstream-Metadata"]) for m in messages] == [e.metadata for e in events[:3]]
