"""The Kinesis sink against moto's standalone server over HTTP; per-record failures (throughput
exceeded) and outages injected by the proxy of tests/support/aws.py. Counts, order per shard and
per partition key, the event id in every record, the confirmed prefix of a partly failed
``PutRecords``, record-by-record publishing with ``SequenceNumberForOrdering``."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from pydantic import ValidationError

from pgstream_dagster.sinks import Event, KinesisSink, SinkError, build_sink, parse_sink_config

from .support.aws import FakeCredentials, FaultProxy, MotoServer, create_stream, read_stream, unique_name
from .support.sinks import BASE_TIME, make_events, unique


def event(i: int, payload: dict[str, Any]) -> Event:
    return Event(id=i, stream_id=7, payload=payload, created_at=BASE_TIME)


def record_ids(shards: dict[str, list[dict[str, Any]]]) -> dict[str, list[int]]:
    return {shard: [json.loads(r["Data"])["id"] for r in records] for shard, records in shards.items() if records}


def test_records_are_put_in_order_per_shard_with_the_event_as_data(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    stream = create_stream(moto_server.url, shards=4)
    events = [Event(id=e.id, stream_id=7, payload={**e.payload, "tenant": f"t{i % 6}"}, metadata=e.metadata,
                    created_at=e.created_at) for i, e in enumerate(make_events(1200))]
    with build_sink({"type": "kinesis", "stream_name": stream, "endpoint_url": fault_proxy.url,
                     "partition_key_from": "tenant"}) as sink:
        assert isinstance(sink, KinesisSink)
        sink.publish(events)
    assert [len(r.entries) for r in fault_proxy.actions("PutRecords")] == [500, 500, 200]
    shards = read_stream(moto_server.url, stream)
    found = record_ids(shards)
    assert sorted(i for ids in found.values() for i in ids) == [e.id for e in events]  # each once
    assert all(ids == sorted(ids) for ids in found.values())  # order per shard
    keys = {r["PartitionKey"] for records in shards.values() for r in records}
    assert keys == {f"t{i}" for i in range(6)}
    first = next(r for records in shards.values() for r in records if json.loads(r["Data"])["id"] == 101)
    assert json.loads(first["Data"]) == events[0].as_json_dict() and first["PartitionKey"] == "t0"

    # no key path: the event id spreads the records; a fixed key keeps a stream in one shard
    stream = create_stream(moto_server.url, shards=2)
    with build_sink({"type": "kinesis", "stream_name": stream, "endpoint_url": moto_server.url}) as sink:
        sink.publish(events[:50])
    assert {r["PartitionKey"] for records in read_stream(moto_server.url, stream).values() for r in records} == \
        {str(e.id) for e in events[:50]}
    stream = create_stream(moto_server.url, shards=3)
    with build_sink({"type": "kinesis", "stream_name": stream, "endpoint_url": moto_server.url,
                     "partition_key": "orders"}) as sink:
        sink.publish(events[:50])
    assert list(record_ids(read_stream(moto_server.url, stream)).values()) == [[e.id for e in events[:50]]]


def test_partition_keys_from_the_event_metadata(moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    stream = create_stream(moto_server.url, shards=2)
    events = [Event(id=i, stream_id=7, payload={"k": "ignored"}, metadata={"k": f"m{i % 3}"}, created_at=BASE_TIME)
              for i in range(1, 13)]
    with build_sink({"type": "kinesis", "stream_name": stream, "endpoint_url": moto_server.url,
                     "partition_key_from": "metadata:k"}) as sink:
        sink.publish(events)
    records = [r for shard in read_stream(moto_server.url, stream).values() for r in shard]
    assert {json.loads(r["Data"])["id"]: r["PartitionKey"] for r in records} == {i: f"m{i % 3}" for i in range(1, 13)}


def test_record_by_record_chains_sequence_numbers_per_partition_key(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    stream = create_stream(moto_server.url, shards=2)
    events = [event(i, {"k": "a" if i % 2 else "b"}) for i in range(1, 9)]
    marker = unique("throttled")
    fault_proxy.fail(marker, "ProvisionedThroughputExceededException", times=2, message="Rate exceeded for shard")
    events[4] = event(5, {"k": "a", "fault": marker})
    with build_sink({"type": "kinesis", "stream_name": stream, "endpoint_url": fault_proxy.url,
                     "partition_key_from": "k", "max_batch_size": 1}) as sink:
        sink.publish(events)  # event 5 is throttled twice: botocore retries it (max_attempts 3)
    puts = fault_proxy.actions("PutRecord")
    assert not fault_proxy.actions("PutRecords") and len(puts) == 8 + 2
    shards = read_stream(moto_server.url, stream)
    sequence = {json.loads(r["Data"])["id"]: r["SequenceNumber"] for records in shards.values() for r in records}
    ordering = [(json.loads(base64.b64decode(p.params["Data"]))["id"],
                 p.params.get("SequenceNumberForOrdering")) for p in puts]
    accepted = list(dict(ordering).items())  # the last attempt of each record
    assert [i for i, _ in accepted] == list(range(1, 9))  # one at a time, in order
    assert dict(accepted) == {1: None, 2: None, 3: sequence[1], 4: sequence[2], 5: sequence[3], 6: sequence[4],
                              7: sequence[5], 8: sequence[6]}  # chained per key
    assert all(ids == sorted(ids) for ids in record_ids(shards).values())


def test_a_failed_record_stops_the_prefix_and_is_retried_not_rejected(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    stream = create_stream(moto_server.url, shards=1)
    marker = unique("throughput")
    fault = fault_proxy.fail(marker, "ProvisionedThroughputExceededException", times=1,
                             message="Rate exceeded for shard shardId-000000000000")
    events = [event(i, {"n": i, "fault": marker if i == 30 else None}) for i in range(1, 61)]
    config = {"type": "kinesis", "stream_name": stream, "endpoint_url": fault_proxy.url, "max_batch_size": 25}
    with build_sink(config) as sink:
        sink.publish(events)
    sent = [[json.loads(base64.b64decode(r["Data"]))["id"] for r in request.entries]
            for request in fault_proxy.actions("PutRecords")]
    assert sent == [list(range(1, 26)), list(range(26, 51)), list(range(30, 51)), list(range(51, 61))]
    (shard,) = record_ids(read_stream(moto_server.url, stream)).values()
    # 31..50 were written by the first attempt too: written again after 30 (consumers dedupe on the id)
    assert shard == [*range(1, 30), *range(31, 51), *range(30, 51), *range(51, 61)]
    assert fault.hits == 1

    fault_proxy.fail(marker, "ProvisionedThroughputExceededException")
    with build_sink({**config, "max_attempts": 2}) as sink, pytest.raises(SinkError) as info:
        sink.publish(events)
    assert not info.value.permanent and info.value.event_ids == tuple(range(30, 61))
    assert f"stream {stream} did not accept event 30 after 2 attempt(s): ProvisionedThroughputExceededException" \
        in str(info.value)
    assert len(fault_proxy.actions("PutRecords")) == 4 + 3  # 1..25, 26..50, 30..50; nothing after
    for text in (str(info.value), repr(info.value)):
        assert not [secret for secret in aws_env.secrets if secret in text]


def test_oversized_records_and_long_keys_are_permanent_rejections(
        moto_server: MotoServer, aws_env: FakeCredentials, fault_proxy: FaultProxy) -> None:
    stream = create_stream(moto_server.url, shards=1)
    events = [event(i, {"n": i, "k": "x" * (300 if i == 4 else 3), "pad": "p" * (1_100_000 if i == 7 else 1)})
              for i in range(1, 11)]
    config = {"type": "kinesis", "stream_name": stream, "endpoint_url": fault_proxy.url, "partition_key_from": "k"}
    with build_sink(config) as sink:
        with pytest.raises(SinkError) as info:
            sink.publish(events)
        assert info.value.permanent and info.value.event_ids == (4,)
        assert "partition key 'xxxx" in str(info.value) and "is 300 characters, more than 256" in str(info.value)
        with pytest.raises(SinkError) as info:
            sink.publish(events[4:])
        assert info.value.permanent and info.value.event_ids == (7,)
        assert "more than max_record_bytes (1048576)" in str(info.value)
    assert [len(r.entries) for r in fault_proxy.actions("PutRecords")] == [3, 2]

    # above the service's 1 MiB: moto refuses the whole request, naming no event: every event of it is named
    with build_sink({**config, "max_record_bytes": 2_097_152}) as sink, pytest.raises(SinkError) as info:
        sink.publish(events[4:])
    assert info.value.permanent and info.value.event_ids == (5, 6, 7, 8, 9, 10)
    assert "refused a request of 6 records (which one is at fault is not known): ValidationException" \
        in str(info.value)
    assert list(record_ids(read_stream(moto_server.url, stream)).values()) == [[1, 2, 3, 5, 6]]


def test_a_missing_stream_is_not_permanent_and_settings_are_checked(
        moto_server: MotoServer, aws_env: FakeCredentials) -> None:
    missing = unique_name("absent")
    with build_sink({"type": "kinesis", "stream_name": missing, "endpoint_url": moto_server.url}) as sink, \
            pytest.raises(SinkError) as info:
        sink.publish(make_events(2))
    assert not info.value.permanent and "ResourceNotFoundException" in str(info.value)
    assert f"stream {missing} at {moto_server.url} (us-east-1) failed" in str(info.value)
    for bad, expected in (({}, "set either stream_name or stream_arn"),
                          ({"stream_name": "a", "stream_arn": "arn:aws:kinesis:us-east-1:123456789012:stream/a"},
                           "set either stream_name or stream_arn"),
                          ({"stream_name": "a", "partition_key": "k" * 257}, "partition_key"),
                          ({"stream_name": "a", "max_batch_size": 501}, "max_batch_size"),
                          ({"stream_name": "a", "aws_session_token": "t0k3n"}, "look like AWS credentials")):
        with pytest.raises(ValidationError) as error:
            parse_sink_config({"type": "kinesis", **bad})
        assert expected in str(error.value) and "t0k3n" not in str(error.value)
