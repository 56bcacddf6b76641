"""The Redis Streams sink against the Redis on 127.0.0.1:6379."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime

import pytest
import redis
from pydantic import SecretStr, ValidationError

from pgstream_dagster.sinks import (
    Event,
    RedisSink,
    RedisSinkConfig,
    SinkError,
)

from .support.sinks import BASE_TIME, REDIS_URL, free_port, make_events, stream_entries, unique


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


def test_redis_sink_xadds_in_order(redis_client: redis.Redis) -> None:
    key = unique("pgstream-test")
    events = make_events(40)
    try:
        with RedisSinkConfig(stream=key).build() as sink:
            sink.publish(events[:25])
            sink.publish(events[25:])
        entries = stream_entries(redis_client, key)
        assert len(entries) == len(events)
        assert redis_client.xlen(key) == len(events)
        for (_entry_id, fields), event in zip(entries, events, strict=True):
            assert fields[b"id"] == str(event.id).encode()
            assert fields[b"stream_id"] == b"7"
            assert json.loads(fields[b"payload"]) == event.payload
            assert datetime.fromisoformat(fields[b"created_at"].decode()) == event.created_at
            assert json.loads(fields.get(b"metadata", b"null")) == event.metadata
    finally:
        redis_client.delete(key)


def test_redis_stream_from_payload_path_and_maxlen(redis_client: redis.Redis) -> None:
    prefix = unique("pgstream-test") + ":"
    fallback = prefix + "fallback"
    tenants = ["acme", "globex", None]  # None: no tenant in the payload -> the fallback stream
    events = [
        Event(id=900 + i, stream_id=2, payload={"seq": i, "data": {"tenant": tenants[i % 3]} if tenants[i % 3] else {}},
              metadata=None, created_at=BASE_TIME)
        for i in range(30)
    ]
    config = RedisSinkConfig(stream=fallback, stream_from="data.tenant", stream_prefix=prefix)
    try:
        with config.build() as sink:
            sink.publish(events)
        for tenant, name in (("acme", prefix + "acme"), ("globex", prefix + "globex"), (None, fallback)):
            expected = [str(e.id).encode() for e in events if e.payload["data"].get("tenant") == tenant]
            assert [f[b"id"] for _, f in stream_entries(redis_client, name)] == expected, name

        capped = prefix + "capped"
        with RedisSinkConfig(stream=capped, maxlen=7, maxlen_approximate=False).build() as sink:
            sink.publish(events)
        assert [f[b"id"] for _, f in stream_entries(redis_client, capped)] == [str(e.id).encode() for e in events[-7:]]

        # no tenant and no fallback: a permanent rejection of that event, after the events before it
        strict = RedisSinkConfig(stream_from="data.tenant", stream_prefix=prefix + "strict:")
        with strict.build() as sink, pytest.raises(SinkError) as err:
            sink.publish(events[:6])
        assert "event 902" in str(err.value) and "'data.tenant' is missing" in str(err.value)
        assert err.value.permanent and err.value.event_ids == (902,)
        assert sorted(redis_client.keys(prefix + "strict:*")) == [f"{prefix}strict:{t}".encode() for t in tenants[:2]]
        assert [f[b"id"] for _, f in stream_entries(redis_client, prefix + "strict:acme")] == [b"900"]  # 903: not sent
    finally:
        for entry_key in redis_client.keys(prefix + "*"):
            redis_client.delete(entry_key)
    with pytest.raises(ValidationError):
        RedisSinkConfig()


def test_redis_sink_errors_are_sink_errors(redis_client: redis.Redis) -> None:
    key = unique("pgstream-test")
    redis_client.set(key, "not a stream")
    try:
        with RedisSinkConfig(stream=key).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(make_events(3))
        assert "redis sink" in str(err.value) and "events 101..103" in str(err.value)
        assert "WRONGTYPE" in str(err.value) and not err.value.permanent  # the key's fault, not the events'
    finally:
        redis_client.delete(key)

    port = free_port()
    url = SecretStr(f"redis://:hunter2pw@127.0.0.1:{port}/0")
    config = RedisSinkConfig(url=url, stream=key, timeout_secs=2)
    assert "hunter2pw" not in repr(config)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(1))
    assert "event 101" in str(err.value) and "hunter2pw" not in str(err.value)
    assert f"redis://127.0.0.1:{port}/0" in str(err.value) and "refused" in str(err.value).lower()
    assert not err.value.permanent
    assert redis_client.exists(key) == 0  # nothing was written anywhere


@pytest.mark.parametrize("use_script", [True, False])
def test_redis_a_stream_name_from_the_event_that_is_not_a_stream_is_the_events_rejection(
        redis_client: redis.Redis, use_script: bool) -> None:
    prefix = unique("pgstream-test") + "."
    redis_client.set(prefix + "taken", "a string an application wrote")
    events = [Event(id=300 + i, stream_id=1, payload={"to": to}, created_at=BASE_TIME)
              for i, to in enumerate(["a", "taken", "a"])]
    config = RedisSinkConfig(stream=prefix + "all", stream_from="to", stream_prefix=prefix, use_script=use_script)
    try:
        with config.build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(events)
            assert err.value.permanent and err.value.event_ids == (301,)
            assert "holds a string, not a stream (the name was taken from the event)" in str(err.value)
            sink.publish(events[2:])  # the caller set 301 aside and goes on
        added = [int(fields[b"id"]) for _id, fields in stream_entries(redis_client, prefix + "a")]
        assert added[0] == 300 and added[-1] == 302 and set(added) <= {300, 302}  # the pipeline may add 302 twice
    finally:
        for name in redis_client.keys(prefix + "*"):
            redis_client.delete(name)


def test_redis_max_message_bytes_rejects_a_large_entry_after_sending_the_ones_before(
        redis_client: redis.Redis) -> None:
    key = unique("pgstream-test")
    events = make_events(5)
    events[2] = Event(id=103, stream_id=7, payload={"blob": "x" * 3000}, created_at=BASE_TIME)
    try:
        with RedisSinkConfig(stream=key, max_message_bytes=1000).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(events)
            assert err.value.permanent and err.value.event_ids == (103,)
            assert f"event 103: not sent to stream {key!r}: the entry is " in str(err.value)
            assert "more than max_message_bytes (1000)" in str(err.value)
            # confirmed; 104: not sent
            assert [f[b"id"] for _, f in stream_entries(redis_client, key)] == [b"101", b"102"]
            sink.publish(events[3:])  # the caller set 103 aside
        assert [f[b"id"] for _, f in stream_entries(redis_client, key)] == [b"101", b"102", b"104", b"105"]

        redis_client.delete(key)
        chunked = RedisSink(RedisSinkConfig(stream=key, max_message_bytes=1000))
        chunked.chunk_size = 3  # type: ignore[misc]  # the 4 events before the rejected one: two transactions
        more = make_events(7, first_id=201)
        more[4] = events[2]
        with chunked, pytest.raises(SinkError) as err:
            chunked.publish(more)
        assert err.value.permanent and err.value.event_ids == (103,)
        assert [f[b"id"] for _, f in stream_entries(redis_client, key)] == [b"201", b"202", b"203", b"204"]

        # rejected before anything is sent: no connection, and the URL's password stays out of the message
        url = SecretStr("redis://:r3dis-pw-9@127.0.0.1:6379/0")
        with RedisSinkConfig(url=url, stream=key, max_message_bytes=1000).build() as sink:
            with pytest.raises(SinkError) as err:
                sink.publish(events[2:])
        assert err.value.permanent and err.value.event_ids == (103,) and "r3dis-pw-9" not in str(err.value)
    finally:
        redis_client.delete(key)


def test_redis_wrong_password_does_not_leak(redis_client: redis.Redis) -> None:
    key = unique("pgstream-test")
    config = RedisSinkConfig(url=SecretStr("redis://pgstream-no-such-user:wr0ng-redis-pw@127.0.0.1:6379/0"), stream=key)
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(2))
    assert "events 101..102" in str(err.value) and "redis://127.0.0.1:6379/0" in str(err.value)
    assert "wr0ng-redis-pw" not in str(err.value) and "wr0ng-redis-pw" not in repr(err.value)
    assert redis_client.exists(key) == 0




def test_redis_stream_from_metadata(redis_client: redis.Redis) -> None:
    """``metadata:<path>`` reads the event's metadata; a bare path still reads the payload, also
    one named ``metadata.<key>``."""
    prefix = unique("pgstream-test") + ":"
    regions = ["eu", "us", None, "eu"]
    events = [Event(id=950 + i, stream_id=2, payload={"seq": i, "metadata": {"region": "payload-" + str(i)}},
                    metadata={"region": regions[i % 4]} if regions[i % 4] else None, created_at=BASE_TIME)
              for i in range(20)]
    try:
        config = RedisSinkConfig(stream=prefix + "none", stream_from="metadata:region", stream_prefix=prefix)
        with config.build() as sink:
            sink.publish(events)
        for region in ("eu", "us", None):
            expected = [str(e.id).encode() for e in events if (e.metadata or {}).get("region") == region]
            assert [f[b"id"] for _, f in stream_entries(redis_client, prefix + (region or "none"))] == expected
        with RedisSinkConfig(stream_from="metadata.region", stream_prefix=prefix + "p:").build() as sink:
            sink.publish(events[:2])
        assert [f[b"id"] for _, f in stream_entries(redis_client, prefix + "p:payload-1")] == [b"951"]
        with RedisSinkConfig(stream_from="metadata:region", stream_prefix=prefix).build() as sink, \
                pytest.raises(SinkError) as err:
            sink.publish(events[:4])  # 952 has no metadata and there is no fixed stream
        assert err.value.permanent and err.value.event_ids == (952,)
        assert "metadata path 'region' is missing (the event has no metadata)" in str(err.value)
    finally:
        for name in redis_client.keys(prefix + "*"):
            redis_client.delete(name)


@pytest.mark.parametrize("use_script", [True, False])
def test_redis_script_and_pipeline_add_the_same_entries(redis_client: redis.Redis, use_script: bool) -> None:
    """One chunk across three streams, with and without metadata, MAXLEN exact: the script and the
    pipeline leave the same entries, in order, in each stream."""
    prefix = unique("pgstream-test") + ":"
    events = [Event(id=500 + i, stream_id=3, payload={"seq": i, "t": ["a", "b", "c"][i % 3], "s": "é\n\"x\u2028"},
                    metadata={"n": i} if i % 2 else None, created_at=BASE_TIME) for i in range(60)]
    config = RedisSinkConfig(stream_from="t", stream_prefix=prefix, maxlen=15, maxlen_approximate=False,
                             use_script=use_script)
    try:
        with config.build() as sink:
            sink.publish(events)
        for name in "abc":
            mine = [e for e in events if e.payload["t"] == name][-15:]
            entries = stream_entries(redis_client, prefix + name)
            assert [f[b"id"] for _, f in entries] == [str(e.id).encode() for e in mine]
            for (_id, fields), event in zip(entries, mine, strict=True):
                assert json.loads(fields[b"payload"]) == event.payload
                assert (json.loads(fields[b"metadata"]) if b"metadata" in fields else None) == event.metadata
                assert set(fields) == {b"id", b"stream_id", b"created_at", b"payload"} | (
                    {b"metadata"} if event.metadata is not None else set())
    finally:
        redis_client.delete(*(prefix + name for name in "abc"))


def test_a_server_that_refuses_scripts_gets_the_pipeline(redis_client: redis.Redis) -> None:
    """A user whose ACL leaves scripting out: the first call is refused before it runs anything, the
    sink adds the chunk with the pipeline instead and keeps to it; every entry once, in order."""
    key = unique("pgstream-test")
    user = unique("pgstream-noscript")
    redis_client.acl_setuser(user, enabled=True, passwords=["+n0script-pw"], keys=["*"],
                             commands=["+@all", "-@scripting"])
    url = SecretStr(f"redis://{user}:n0script-pw@127.0.0.1:6379/0")
    try:
        with RedisSink(RedisSinkConfig(url=url, stream=key)) as sink:
            sink.publish(make_events(5))
            sink.publish(make_events(5, first_id=201))
            assert sink._use_script is False
        assert [f[b"id"] for _, f in stream_entries(redis_client, key)] == [
            str(i).encode() for i in [*range(101, 106), *range(201, 206)]]
    finally:
        redis_client.acl_deluser(user)
        redis_client.delete(key)
