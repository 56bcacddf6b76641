"""The HTTP (webhook) sink against a real HTTP server: order, batching, retries and Retry-After,
rejections, per-key parallelism, Standard Webhooks signatures, and secrets in headers and URLs."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import re
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from pydantic import SecretStr, ValidationError

from pgstream_dagster.config import ConfigError, load_config, parse_config
from pgstream_dagster.sinks import (
    Event,
    HttpSinkConfig,
    SinkError,
    build_sink,
    parse_sink_config,
)
from pgstream_dagster.sinks.base import dumps

from .support.http_recorder import FAST_RETRY, WEBHOOK_SECRET, HttpRecorder
from .support.sinks import BASE_TIME, free_port, make_events, run_python


def _http(**settings: Any) -> HttpSinkConfig:
    """An http sink's configuration as pgstream.yaml gives it (``url`` a plain string)."""
    return HttpSinkConfig.model_validate(settings)


def test_http_per_event_posts_payloads_in_order(http_server: HttpRecorder) -> None:
    events = make_events(15, stream_id=3)
    config = _http(url=http_server.url, headers={"Authorization": SecretStr("Bearer t0ken-abc")})
    with config.build() as sink:
        sink.publish(events[:6])
        sink.publish(events[6:])
    received = http_server.received
    assert len(received) == len(events)
    assert [r.body for r in received] == [e.payload for e in events]
    for request, event in zip(received, events, strict=True):
        assert request.path == "/hook"
        assert request.headers["webhook-id"] == str(event.id)
        assert request.headers["idempotency-key"] == str(event.id)
        assert request.headers["x-pgstream-event-id"] == str(event.id)
        assert request.headers["x-pgstream-stream-id"] == "3"
        assert abs(int(request.headers["webhook-timestamp"]) - time.time()) < 300
        assert "webhook-signature" not in request.headers  # no signing secret configured
        assert request.headers["authorization"] == "Bearer t0ken-abc"
        assert request.headers["content-type"] == "application/json"


def test_http_batch_mode_chunks_in_order_and_event_bodies(http_server: HttpRecorder) -> None:
    events = make_events(10)
    config = _http(url=http_server.url, mode="batch", max_batch_size=4)
    with config.build() as sink:
        sink.publish(events)
    received = http_server.received
    assert [len(r.body) for r in received] == [4, 4, 2]
    assert [p for r in received for p in r.body] == [e.payload for e in events]
    assert [r.headers["x-pgstream-event-ids"] for r in received] == [
        "101,102,103,104",
        "105,106,107,108",
        "109,110",
    ]
    assert [r.headers["webhook-id"] for r in received] == ["101-104", "105-108", "109-110"]

    http_server.received.clear()
    with build_sink({"type": "webhook", "url": http_server.url, "body": "event"}) as sink:
        sink.publish(events[:3])
    assert [r.body for r in http_server.received] == [json.loads(dumps(e.as_json_dict())) for e in events[:3]]


def test_http_500_is_retried_then_names_event_status_and_attempts(http_server: HttpRecorder) -> None:
    events = make_events(6)
    http_server.fail_on_event_id = 103
    with _http(url=http_server.url, max_attempts=3, **FAST_RETRY).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    message = str(err.value)
    assert "http sink" in message and "event 103" in message
    assert "500" in message and "database on fire" in message and "gave up after 3 attempts" in message
    assert len(message) < 700  # only an excerpt of the body
    assert err.value.event_ids == (103,)
    # events before the failure were delivered in order, 103 was tried 3 times, nothing after it
    assert [r.body["seq"] for r in http_server.received] == [0, 1, 2, 2, 2]


def test_http_batch_500_names_the_id_range(http_server: HttpRecorder) -> None:
    http_server.fail_on_event_id = 106
    config = _http(url=http_server.url, mode="batch", max_batch_size=4, max_attempts=1)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(10))
    assert "events 105..108" in str(err.value) and "HTTP 500" in str(err.value)
    assert err.value.event_ids == (105, 106, 107, 108)
    assert [len(r.body) for r in http_server.received] == [4, 4]


def test_http_timeout_raises(http_server: HttpRecorder) -> None:
    http_server.mode, http_server.sleep_secs = "sleep", 3
    started = time.monotonic()
    with _http(url=http_server.url, timeout_secs=0.3, max_attempts=1).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
    assert time.monotonic() - started < 2.9  # the sink gave up before the server answered
    assert "event 101" in str(err.value) and "timed out" in str(err.value)
    assert len(http_server.received) == 1
    assert not err.value.permanent


def test_http_connection_refused_is_retried_then_raises() -> None:
    url = f"http://127.0.0.1:{free_port()}/hook"
    config = _http(url=url, mode="batch", timeout_secs=2, max_attempts=3, **FAST_RETRY)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(5))
    message = str(err.value)
    assert "events 101..105" in message and "connection failed" in message.lower()
    assert "refused" in message.lower() and "gave up after 3 attempts" in message
    assert not err.value.permanent
    assert f"127.0.0.1:{urlsplit(url).port}/hook" in message  # names the target


def test_http_dead_endpoint_fails_within_the_time_budget() -> None:
    url = f"http://127.0.0.1:{free_port()}/hook"
    config = _http(url=url, max_attempts=100_000, max_retry_secs=1, **FAST_RETRY)
    started = time.monotonic()
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(50))
    assert time.monotonic() - started < 30  # bounded by max_retry_secs, not by 100k attempts
    attempts = int(re.search(r"gave up after (\d+) attempts", str(err.value)).group(1))  # type: ignore[union-attr]
    assert 1 < attempts < 100_000
    assert err.value.event_ids == (101,) and "50 events not confirmed" in str(err.value)


def test_http_retries_5xx_but_not_other_4xx(http_server: HttpRecorder) -> None:
    events = make_events(4)
    http_server.script["102"] = [(500, {}), (502, {}), (503, {})]  # 503 without Retry-After: plain backoff
    with _http(url=http_server.url, max_attempts=4, **FAST_RETRY).build() as sink:
        sink.publish(events)
        ids = [r.headers["webhook-id"] for r in http_server.received]
        assert ids == ["101", "102", "102", "102", "102", "103", "104"]
        # every attempt is signed afresh with its own timestamp; the body and id stay the same
        assert len({json.dumps(r.body) for r in http_server.by_id("102")}) == 1

        http_server.received.clear()
        http_server.script["106"] = [(422, {}), (200, {})]
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(4, first_id=105))
    assert [r.headers["webhook-id"] for r in http_server.received] == ["105", "106"]  # 422 once, nothing after
    assert "event 106" in str(err.value) and "HTTP 422" in str(err.value) and "gave up" not in str(err.value)
    assert err.value.event_ids == (106,) and err.value.permanent


def test_http_honours_retry_after_seconds_and_http_date(http_server: HttpRecorder) -> None:
    def in_two_seconds() -> dict[str, str]:  # an HTTP date has whole seconds: at least 1s from now
        return {"Retry-After": format_datetime(datetime.now(UTC) + timedelta(seconds=2), usegmt=True)}

    http_server.script["101"] = [(429, {"Retry-After": "1"})]
    http_server.script["102"] = [(503, in_two_seconds)]
    with _http(url=http_server.url, **FAST_RETRY).build() as sink:
        sink.publish(make_events(3))
    assert [r.headers["webhook-id"] for r in http_server.received] == ["101", "101", "102", "102", "103"]
    # backoff alone would wait at most 0.05s: the gaps come from Retry-After
    for msg_id in ("101", "102"):
        first, second = http_server.by_id(msg_id)
        assert second.at - first.at >= 0.9, msg_id


def test_http_retry_after_beyond_budget_fails_at_once(http_server: HttpRecorder) -> None:
    http_server.script["101"] = [(503, {"Retry-After": "3600"})]
    started = time.monotonic()
    with _http(url=http_server.url, max_retry_secs=20, **FAST_RETRY).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2))
    assert time.monotonic() - started < 15
    assert "HTTP 503" in str(err.value) and "Retry-After 3600s is beyond the 20s budget" in str(err.value)
    assert len(http_server.received) == 1


@pytest.mark.parametrize("mode", ["per_event", "batch"])
def test_http_parallel_keys_keep_per_key_order(http_server: HttpRecorder, mode: str) -> None:
    groups = ["g0", "g1", "g2", "g3"]
    events = [
        Event(id=500 + i, stream_id=1, payload={"seq": i, "g": groups[i % 4], "meta": {"group": groups[i % 4]}},
              metadata=None, created_at=BASE_TIME)
        for i in range(48)
    ]
    http_server.key_field = "g"
    # the first 4 requests only get an answer once 4 are in flight at the same time
    http_server.barrier, http_server.barrier_left = threading.Barrier(4, timeout=60), 4
    config = _http(url=http_server.url, routing_key="meta.group", max_concurrency=4, mode=mode,
                            max_batch_size=5, max_attempts=1)
    with config.build() as sink:
        sink.publish(events)
    received = [p for r in http_server.received for p in (r.body if mode == "batch" else [r.body])]
    assert sorted(p["seq"] for p in received) == list(range(48))  # each event exactly once
    for group in groups:
        sent = [e.payload["seq"] for e in events if e.payload["g"] == group]
        assert [p["seq"] for p in received if p["g"] == group] == sent
    assert http_server.max_in_flight == 4  # parallel, and never above max_concurrency
    assert http_server.same_key_overlaps == 0  # one key never has two requests in flight
    if mode == "batch":
        assert all(len({p["g"] for p in r.body}) == 1 for r in http_server.received)  # a batch is one key


def test_http_one_failing_key_fails_publish_and_stops_that_key(http_server: HttpRecorder) -> None:
    events = [
        Event(id=700 + i, stream_id=1, payload={"seq": i, "g": "ab"[i % 2]}, metadata=None, created_at=BASE_TIME)
        for i in range(20)
    ]
    http_server.script["705"] = [(400, {})]  # key "b", its third event
    config = _http(url=http_server.url, routing_key="g", max_concurrency=2, **FAST_RETRY)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert "event 705" in str(err.value) and "HTTP 400" in str(err.value)
    assert 705 in err.value.event_ids
    b_ids = [int(r.headers["webhook-id"]) for r in http_server.received if r.body["g"] == "b"]
    assert b_ids == [701, 703, 705]  # in order, nothing of key b after the failure
    a_ids = [int(r.headers["webhook-id"]) for r in http_server.received if r.body["g"] == "a"]
    assert a_ids == list(range(700, 700 + 2 * len(a_ids), 2))  # key a in order (possibly stopped early)


PERMANENT_STATUSES = [400, 409, 412, 413, 422]
CONFIG_STATUSES = [301, 401, 403, 404, 405, 407, 410, 415, 421, 426, 431]


@pytest.mark.parametrize("status", PERMANENT_STATUSES + CONFIG_STATUSES + [500, 503])
def test_http_rejection_classes(http_server: HttpRecorder, status: int) -> None:
    """A 4xx about the request's content is a permanent rejection of that event, after the events
    before it were confirmed; a 4xx about the configuration (credentials, URL...), a 3xx or a 5xx
    is not. The message stays scrubbed either way."""
    token = "hook-t0ken-" + uuid.uuid4().hex[:8]
    http_server.fail_on_event_id, http_server.fail_status = 103, status
    config = _http(url=http_server.url, headers={"Authorization": SecretStr(token)}, max_attempts=1)
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(5))
    assert err.value.permanent is (status in PERMANENT_STATUSES)
    assert err.value.event_ids == (103,) and f"HTTP {status}" in str(err.value)
    assert [r.headers["webhook-id"] for r in http_server.received] == ["101", "102", "103"]  # 101, 102 confirmed
    assert http_server.received[-1].headers["authorization"] == token  # echoed by the server...
    assert token not in str(err.value) and "database on fire" in str(err.value)  # ...and masked


@pytest.mark.parametrize("status", [408, 429])
def test_http_408_and_429_are_retried_not_rejected(http_server: HttpRecorder, status: int) -> None:
    http_server.script["102"] = [(status, {})]
    with _http(url=http_server.url, **FAST_RETRY).build() as sink:
        sink.publish(make_events(3))
    assert [r.headers["webhook-id"] for r in http_server.received] == ["101", "102", "102", "103"]

    http_server.received.clear()
    http_server.script["104"] = [(status, {}), (status, {})]
    with _http(url=http_server.url, max_attempts=2, **FAST_RETRY).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(2, first_id=104))
    assert not err.value.permanent and "gave up after 2 attempts" in str(err.value)


def test_http_batch_rejected_as_a_whole_names_its_events_then_one_at_a_time_isolates_the_bad_one(
        http_server: HttpRecorder) -> None:
    http_server.fail_on_event_id, http_server.fail_status = 106, 400
    events = make_events(10)
    config = _http(url=http_server.url, mode="batch", max_batch_size=4, max_attempts=1)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
        assert err.value.permanent and err.value.event_ids == (105, 106, 107, 108)  # the rejected request
        assert "events 105..108" in str(err.value) and "HTTP 400" in str(err.value)
        assert [r.headers["webhook-id"] for r in http_server.received] == ["101-104", "105-108"]
        outcomes: dict[int, tuple[int, ...] | None] = {}
        for event in events[4:8]:  # what the caller does: one at a time
            try:
                sink.publish([event])
                outcomes[event.id] = None
            except SinkError as exc:
                assert exc.permanent
                outcomes[event.id] = exc.event_ids
    assert outcomes == {105: None, 106: (106,), 107: None, 108: None}


def test_http_max_body_bytes_refuses_an_oversized_event_without_sending_it(http_server: HttpRecorder) -> None:
    events = make_events(6)
    big = Event(id=104, stream_id=7, payload={"blob": "x" * 2000}, created_at=BASE_TIME)
    events[3] = big
    with _http(url=http_server.url, max_body_bytes=1000).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert err.value.permanent and err.value.event_ids == (104,)
    assert f"not sent: the body is {len(big.payload_json)} bytes, more than max_body_bytes (1000)" in str(err.value)
    assert [r.headers["webhook-id"] for r in http_server.received] == ["101", "102", "103"]  # 104 never sent


def test_http_batch_is_cut_to_max_body_bytes_and_only_an_event_too_large_alone_is_refused(
        http_server: HttpRecorder) -> None:
    events = [Event(id=200 + i, stream_id=1, payload={"pad": "y" * 80}, created_at=BASE_TIME) for i in range(10)]
    size = len(events[0].payload_json)  # every payload has this size
    limit = 2 + 3 * size + 2  # three payloads in a JSON array, and no more
    config = _http(url=http_server.url, mode="batch", max_batch_size=5, max_body_bytes=limit)
    with config.build() as sink:
        sink.publish(events)
        bodies = [r.body for r in http_server.received]
        assert [len(b) for b in bodies] == [3, 3, 3, 1]
        assert [p for b in bodies for p in b] == [e.payload for e in events]

        http_server.received.clear()
        big = Event(id=300, stream_id=1, payload={"pad": "z" * (limit)}, created_at=BASE_TIME)
        with pytest.raises(SinkError) as err:
            sink.publish([*events[:4], big, *events[4:6]])
    assert err.value.permanent and err.value.event_ids == (300,)  # alone in its request: exactly that event
    assert [r.headers["x-pgstream-event-ids"] for r in http_server.received] == ["200,201,202", "203"]


def test_http_permanent_rejection_lets_the_other_keys_send_what_comes_before_it(http_server: HttpRecorder) -> None:
    events = [
        Event(id=700 + i, stream_id=1, payload={"seq": i, "g": "ab"[i % 2]}, metadata=None, created_at=BASE_TIME)
        for i in range(12)
    ]
    http_server.script["703"] = [(422, {})]  # key "b", its second event
    # key "a" waits a second before its first retry: "b" is rejected meanwhile, yet "a" goes on up to 702
    http_server.script["700"] = [(503, {"Retry-After": "1"})]
    config = _http(url=http_server.url, routing_key="g", max_concurrency=2, **FAST_RETRY)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert err.value.permanent and err.value.event_ids == (703,) and "HTTP 422" in str(err.value)
    sent = [int(r.headers["webhook-id"]) for r in http_server.received]
    assert {700, 701, 702} <= set(sent)  # every event before the rejected one was confirmed
    assert [i for i in sent if i % 2] == [701, 703]  # nothing of key b after it
    assert sent.count(703) == 1  # a permanent rejection is not retried


def test_http_a_failure_before_a_permanent_rejection_makes_the_publish_not_permanent(
        http_server: HttpRecorder) -> None:
    events = [
        Event(id=700 + i, stream_id=1, payload={"seq": i, "g": "ab"[i % 2]}, metadata=None, created_at=BASE_TIME)
        for i in range(6)
    ]
    http_server.script["700"] = [(500, {})]  # key a, the first event: not confirmed
    http_server.script["701"] = [(422, {})]  # key b: rejected
    config = _http(url=http_server.url, routing_key="g", max_concurrency=2, max_attempts=1)
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert not err.value.permanent and 700 in err.value.event_ids


def test_http_standard_webhooks_signatures_verify(http_server: HttpRecorder) -> None:
    http_server.signing_secret = WEBHOOK_SECRET
    events = make_events(6)
    with _http(url=http_server.url, signing_secret=SecretStr(WEBHOOK_SECRET)).build() as sink:
        sink.publish(events)
    with _http(url=http_server.url, signing_secret=SecretStr(WEBHOOK_SECRET), mode="batch").build() as sink:
        sink.publish(events)
    assert len(http_server.received) == 7
    assert all(r.signature_ok for r in http_server.received)
    assert all(r.headers["webhook-signature"].startswith("v1,") for r in http_server.received)

    # a sink with another secret is refused (401 is not retried): the verification really checks
    http_server.received.clear()
    other = "whsec_" + base64.b64encode(b"another-signing-key-abcdefghijkl").decode()
    with _http(url=http_server.url, signing_secret=SecretStr(other), **FAST_RETRY).build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(events)
    assert "HTTP 401" in str(err.value) and len(http_server.received) == 1
    assert not err.value.permanent  # a wrong secret would reject every event: not the event's fault
    assert http_server.received[0].signature_ok is False


def test_http_signing_secret_from_environment(
    http_server: HttpRecorder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_WEBHOOK_SECRET", WEBHOOK_SECRET)
    path = tmp_path / "pgstream.yaml"
    path.write_text(
        "database_url: ${TEST_PG_URL}\n"
        "streams:\n"
        f"  - {{id: 1, sink: {{type: webhook, url: '{http_server.url}',\n"
        "                     signing_secret: '${TEST_WEBHOOK_SECRET}'}}\n"
    )
    config = load_config(path)
    sink_config = config.stream(1).sink
    assert WEBHOOK_SECRET not in repr(config) and WEBHOOK_SECRET not in repr(sink_config)
    http_server.signing_secret = WEBHOOK_SECRET
    with sink_config.build() as sink:
        sink.publish(make_events(3))
    assert [r.signature_ok for r in http_server.received] == [True, True, True]


def test_http_signing_secret_is_validated_without_echo() -> None:
    bad = "whsec_this is not base64 at all!"
    with pytest.raises(ValidationError) as err:
        parse_sink_config({"type": "webhook", "url": "http://127.0.0.1:1/", "signing_secret": bad})
    assert "signing_secret" in str(err.value) and bad not in str(err.value)
    with pytest.raises(ValidationError) as err:
        _http(url="http://127.0.0.1:1/", signing_secret=SecretStr("whsec_c2hvcnQ="))
    assert "too short" in str(err.value)
    with pytest.raises(ValidationError):
        _http(url="ftp://127.0.0.1/")
    # the prefix is optional, the key is the base64-decoded bytes
    raw = base64.b64encode(b"k" * 32).decode()
    assert _http(url="http://x/", signing_secret=SecretStr(raw)).signing_secret is not None


def test_http_secrets_never_leak(http_server: HttpRecorder, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "Bearer s3cr3t-" + uuid.uuid4().hex
    query_token = "qt0ken" + uuid.uuid4().hex[:8]
    http_server.mode = "fail"
    config = _http(
        url=f"{http_server.url}?token={query_token}",
        headers={"Authorization": SecretStr(secret), "X-Api-Key": SecretStr("k3y-42")},
        signing_secret=SecretStr(WEBHOOK_SECRET),
        max_attempts=2,
        **FAST_RETRY,
    )
    raw_key = WEBHOOK_SECRET.removeprefix("whsec_")
    secrets = [secret, "s3cr3t", "k3y-42", query_token, raw_key]
    for text in (repr(config), str(config), config.model_dump_json(), repr(config.build())):
        assert not [s for s in secrets if s in text]
    with config.build() as sink:
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(1))
    # the server really got (and echoed) the secret; the error message and the logs mask it
    assert http_server.received[0].headers["authorization"] == secret
    assert len(http_server.received) == 2 and "attempt 1 failed" in caplog.text  # the retry was logged
    for text in (str(err.value), repr(err.value), caplog.text):
        assert not [s for s in secrets if s in text], text
    assert "***" in str(err.value) and "event 101" in str(err.value)

    refused_url = f"http://127.0.0.1:{free_port()}/?token={query_token}"
    auth = {"Authorization": SecretStr(secret)}
    refused = _http(url=refused_url, headers=auth, max_attempts=2, **FAST_RETRY)
    with refused.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(1))
    for text in (str(err.value), caplog.text):
        assert not [s for s in secrets if s in text], text


def test_http_config_secret_survives_pickling_into_another_process(http_server: HttpRecorder) -> None:
    config = _http(url=http_server.url, headers={"Authorization": SecretStr("Bearer pickled")})
    events = make_events(4)
    code = """
import pickle, sys
config, events = pickle.loads(sys.stdin.buffer.read())
with config.build() as sink:
    sink.publish(events)
"""
    result = run_python(code, pickle.dumps((config, events)))
    assert result.returncode == 0, result.stderr.decode()
    assert [r.body for r in http_server.received] == [e.payload for e in events]
    assert {r.headers["authorization"] for r in http_server.received} == {"Bearer pickled"}


# -- http: secrets in headers and URL paths ---------------------------------------------------------


def escaped(value: str) -> list[str]:
    """``value`` and the escaped forms a library message may show it in (``'tok\\n'``, ``b'tok\\n'``)."""
    return [value, repr(value)[1:-1], repr(value.encode())[2:-1]]


def assert_nowhere(secrets: list[str], *texts: str) -> None:
    for text in texts:
        found = [s for secret in secrets for s in escaped(secret) if s in text]
        assert not found, (found, text)


@pytest.mark.parametrize("ending", ["\n", "\r\n", " \r\n\n"])
def test_http_header_secret_loses_its_trailing_newline_and_never_leaks(
    http_server: HttpRecorder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    ending: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    token = "t0k-" + uuid.uuid4().hex
    raw = f"Bearer {token}{ending}"  # as read from a file-mounted secret
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_HOOK_TOKEN", raw)
    monkeypatch.setenv("TEST_HOOK_URL", http_server.url + ending)  # the URL may come from a file too
    path = tmp_path / "pgstream.yaml"
    path.write_text(
        "database_url: ${TEST_PG_URL}\n"
        "streams:\n"
        "  - {id: 1, sink: {type: http, url: '${TEST_HOOK_URL}', max_attempts: 2, initial_backoff_secs: 0.01,\n"
        "                   headers: {Authorization: '${TEST_HOOK_TOKEN}', X-Plain: '  spaced\tvalue  '}}}\n"
    )
    config = load_config(path)
    sink_config = config.stream(1).sink
    assert isinstance(sink_config, HttpSinkConfig)
    assert sink_config.headers["Authorization"].get_secret_value() == f"Bearer {token}"
    assert sink_config.headers["X-Plain"].get_secret_value() == "spaced\tvalue"  # a tab inside is legal HTTP
    assert sink_config.url.get_secret_value() == http_server.url
    with sink_config.build() as sink:
        sink.publish(make_events(2))
        http_server.mode = "fail"  # the server echoes the Authorization header in its error body
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(1, first_id=200))
        sink_repr = repr(sink)
    assert [r.headers["authorization"] for r in http_server.received] == [f"Bearer {token}"] * 4
    assert "event 200" in str(err.value) and "HTTP 500" in str(err.value) and "***" in str(err.value)
    assert "attempt 1 failed" in caplog.text  # the retry was logged
    assert_nowhere([raw, raw.strip(), token], str(err.value), repr(err.value), repr(config), str(config),
                   repr(sink_config), str(sink_config), sink_config.model_dump_json(), sink_repr, caplog.text)


@pytest.mark.parametrize("value", [
    "Bearer abc\r\nX-Injected: 1", "abc\ndef", "abc\rdef", "abc\x00def", "abc\x7fdef", "\nabc", "abc\x1b[31m",
])
def test_http_header_with_a_control_character_inside_is_refused_naming_the_header(value: str) -> None:
    with pytest.raises(ValidationError) as err:
        _http(url="http://127.0.0.1:1/", headers={"X-Api-Key": SecretStr(value)})
    message = str(err.value)
    assert "header 'X-Api-Key'" in message and "control character" in message
    assert_nowhere([value, "abc", "def", "X-Injected"], message, repr(err.value))

    data = {"database_url": "postgresql://x",
            "streams": [{"id": 1, "sink": {"type": "http", "url": "http://127.0.0.1:1/",
                                           "headers": {"X-Api-Key": value}}}]}
    with pytest.raises(ConfigError) as config_err:
        parse_config(data, "pgstream.yaml")
    message = str(config_err.value)
    assert "pgstream.yaml: streams[0].sink.headers: " in message and "header 'X-Api-Key'" in message
    assert_nowhere([value, "abc", "def", "X-Injected"], message, repr(config_err.value))


@pytest.mark.parametrize("name", ["Bad Name", "X-Colon:", "Ümlaut", "", "X-A\r\nX-B", "(comment)", 'Say"hi"'])
def test_http_header_names_must_be_http_tokens(name: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_sink_config({"type": "http", "url": "http://127.0.0.1:1/", "headers": {name: "v4lue-s3cret"}})
    assert f"header name {name!r} is not a valid HTTP header name" in str(err.value)
    assert "v4lue-s3cret" not in str(err.value)
    token_chars = "!#$%&'*+-.^_`|~09azAZ"
    assert _http(url="http://x/", headers={token_chars: SecretStr("v")}).headers[token_chars]


def test_http_non_ascii_header_value_is_refused_at_config_time_without_echo() -> None:
    value = "Bearer tök-" + uuid.uuid4().hex
    with pytest.raises(ValidationError) as err:
        _http(url="http://127.0.0.1:1/", headers={"Authorization": SecretStr(value)})
    assert "header 'Authorization'" in str(err.value) and "non-ASCII" in str(err.value)
    assert_nowhere([value, value[-32:]], str(err.value), repr(err.value))


def test_http_unvalidated_non_ascii_header_gives_a_sink_error_not_a_unicode_error(
    http_server: HttpRecorder, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    value = "Bearer tök-" + uuid.uuid4().hex
    # model_construct skips validation: the send-time guard must still hold
    config = HttpSinkConfig.model_construct(url=SecretStr(http_server.url), headers={"X-Token": SecretStr(value)})
    for concurrency in (1, 4):  # inline, and inside the thread pool of parallel routing keys
        sink = config.model_copy(update={"max_concurrency": concurrency, "routing_key": "name"}).build()
        with sink, pytest.raises(SinkError) as err:
            sink.publish(make_events(3))
        assert type(err.value) is SinkError
        assert "header 'X-Token' has a non-ASCII value" in str(err.value)
        assert re.search(r"http sink: event 10[123]: POST ", str(err.value)), str(err.value)
        assert err.value.__cause__ is None and err.value.__context__ is None
        assert_nowhere([value, value[-32:]], str(err.value), repr(err.value), caplog.text)
    assert http_server.received == []  # nothing was sent


SLACK_PATH = "/services/T0PGSTREAM/B0PGSTREAM/" + "Xk9" * 8
DISCORD_PATH = "/api/webhooks/123456789012345678/" + "aB3-_" * 13


@pytest.mark.parametrize(("path", "shown"), [(SLACK_PATH, "/services/***"), (DISCORD_PATH, "/api/webhooks/***")])
def test_http_url_path_tokens_are_masked_in_messages_reprs_and_logs(
    http_server: HttpRecorder, caplog: pytest.LogCaptureFixture, path: str, shown: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    base = http_server.url.removesuffix("/hook")
    url = base + path
    config = _http(url=url, max_attempts=2, **FAST_RETRY)
    tokens = [segment for segment in path.split("/") if len(segment) >= 8 and segment not in ("services", "webhooks")]
    secrets = [url, path, *tokens]
    with config.build() as sink:
        sink.publish(make_events(1))
        http_server.mode = "fail"  # the error body echoes the request path
        with pytest.raises(SinkError) as err:
            sink.publish(make_events(1, first_id=300))
        sink_repr = repr(sink)
    assert [r.path for r in http_server.received] == [path] * 3  # the real URL was used
    message = str(err.value)
    assert f"POST {base}{shown} answered HTTP 500" in message and f"at {shown.removesuffix('***')}***)" in message
    assert f"{base}{shown}" in caplog.text  # httpx's request log line, redacted
    assert_nowhere(secrets, message, repr(err.value), repr(config), str(config), config.model_dump_json(),
                   sink_repr, caplog.text)

    refused = base.rsplit(":", 1)[0] + f":{free_port()}" + path  # httpx's own errors
    with _http(url=refused, max_attempts=1).build() as sink, pytest.raises(SinkError) as err:
        sink.publish(make_events(1))
    assert "connection failed" in str(err.value) and shown in str(err.value)
    assert_nowhere([refused, *tokens], str(err.value), repr(err.value), caplog.text)


@pytest.mark.parametrize(("url", "redacted", "secrets"), [
    ("https://hooks.slack.com/services/T0ABCDEFG/B0ABCDEFG/xoxb1234567890abcdefghij",
     "https://hooks.slack.com/services/***",
     ["T0ABCDEFG/B0ABCDEFG/xoxb1234567890abcdefghij", "T0ABCDEFG", "B0ABCDEFG", "xoxb1234567890abcdefghij"]),
    ("https://discord.com/api/webhooks/123456789012345678/abcDEF-ghi_jkl",
     "https://discord.com/api/webhooks/***", ["123456789012345678/abcDEF-ghi_jkl", "123456789012345678"]),
    ("https://api.telegram.org/bot123456:ABC-DEF1234/sendMessage", "https://api.telegram.org/***",
     ["bot123456:ABC-DEF1234/sendMessage", "bot123456:ABC-DEF1234", "sendMessage"]),
    ("https://u:pw%40x@h.example:8443/v1/events/ingest?key=q%20s#frag", "https://h.example:8443/v1/events/ingest",
     ["pw%40x", "pw@x", "key=q%20s", "key=q s", "frag"]),
    ("https://example.com/hooks/abcdefghijklmnopqrstuvwxyz", "https://example.com/hooks/***",
     ["abcdefghijklmnopqrstuvwxyz"]),  # 16+ characters: masked even when lower case
    ("https://example.com/Hook/x", "https://example.com/***", ["Hook/x"]),
    ("http://[::1]:8080/hook/", "http://[::1]:8080/hook/", []),
    # a masked part too short to be masked on its own: log lines keep their 5s (127.0.0.1:5432, event 5)
    ("http://127.0.0.1:8080/hook/5", "http://127.0.0.1:8080/hook/***", ["http://127.0.0.1:8080/hook/5"]),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080", []),
    ("redis://:pw@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", ["pw"]),  # other schemes keep their path
    ("amqp://guest:guest@127.0.0.1:5672/%2F", "amqp://127.0.0.1:5672/%2F", ["guest"]),
])
def test_redact_url_masks_path_tokens_and_url_secrets_lists_them(url: str, redacted: str, secrets: list[str]) -> None:
    from pgstream_dagster.sinks.base import redact_url, scrub, url_secrets

    assert redact_url(url) == redacted
    listed = url_secrets(url)
    assert [s for s in secrets if s not in listed] == []
    assert (url in listed) == (redacted != url)
    text = f"GET {url} failed; path {urlsplit(url).path}; " + "; ".join(secrets)
    assert_nowhere(secrets, scrub(text, listed))
    if redacted != url:
        assert url not in scrub(text, listed)


def test_a_short_masked_path_part_leaves_the_rest_of_a_log_line_alone() -> None:
    from pgstream_dagster.sinks.base import scrub, url_secrets

    url = "http://127.0.0.1:8080/hook/5"
    line = f"POST {url} failed; event 5 to 127.0.0.1:5432"
    assert scrub(line, url_secrets(url)) == "POST *** failed; event 5 to 127.0.0.1:5432"


def test_scrub_masks_escaped_forms_and_describe_exception_never_cuts_a_secret() -> None:
    from pgstream_dagster.sinks.base import describe_exception, scrub

    secret = "tök\r\nen"
    text = f"Illegal header value {secret.encode()!r}; also {secret!r} and {secret}"
    assert scrub(text, [secret]) == "Illegal header value b'***'; also '***' and ***"
    spaced = "two  spaces  " + uuid.uuid4().hex  # excerpt() collapses whitespace: scrub must come first
    described = describe_exception(RuntimeError("x" * 180 + spaced), [spaced])
    assert described.endswith("***") and "two spaces" not in described and spaced[-8:] not in described




# --------------------------------------------------------------------------------------------
# path segment and headers from the event (path_from, headers_from): payload or metadata


def _routed_events() -> list[Event]:
    regions: list[str | None] = ["eu", "eu", "us", None, "eu", "us", "us"]
    return [Event(id=500 + i, stream_id=4, payload={"seq": i, "table": "orders", "metadata": {"region": "payload"}},
                  metadata={"region": r, "tenant": f"t{i % 2}"} if r else {"tenant": "t0"},
                  created_at=BASE_TIME + timedelta(seconds=i))
            for i, r in enumerate(regions)]


@pytest.mark.parametrize("mode", ["per_event", "batch"])
def test_http_path_and_headers_from_metadata_and_payload(http_server: HttpRecorder, mode: str) -> None:
    events = _routed_events()
    config = _http(url=http_server.url + "?token=s3cret-q", mode=mode, path_from="metadata:region",
                            path_default="unrouted",
                            headers_from={"X-Tenant": "metadata:tenant", "X-Table": "table",
                                          "X-Payload-Region": "metadata.region"})  # a payload path, as before
    with config.build() as sink:
        sink.publish(events[:2])
        sink.publish(events[2:])
    received = http_server.received
    sent = [(r.path, r.headers["x-tenant"], r.headers["x-table"], r.headers["x-payload-region"],
             r.body if isinstance(r.body, list) else [r.body]) for r in received]
    by_request = [(path, tenant, [b["seq"] for b in bodies]) for path, tenant, table, region, bodies in sent
                  if table == "orders" and region == "payload"]
    assert len(by_request) == len(sent)
    path = "/hook/{}?token=s3cret-q".format  # the segment goes into the path, the query string stays
    # (batch mode too: no two consecutive events have the same path and headers)
    assert by_request == [(path("eu"), "t0", [0]), (path("eu"), "t1", [1]), (path("us"), "t0", [2]),
                          (path("unrouted"), "t0", [3]), (path("eu"), "t0", [4]), (path("us"), "t1", [5]),
                          (path("us"), "t0", [6])]
    if mode == "batch":  # consecutive events with the same path and headers share a request
        http_server.received.clear()
        same = [Event(id=600 + i, stream_id=4, payload={"seq": i, "table": "t", "metadata": {"region": "p"}},
                      metadata={"region": "eu", "tenant": "a"}, created_at=BASE_TIME) for i in range(5)]
        with config.build() as sink:
            sink.publish([*same[:3], events[2], *same[3:]])
        assert [(r.path, [b["seq"] for b in r.body]) for r in http_server.received] == [
            (path("eu"), [0, 1, 2]), (path("us"), [2]), (path("eu"), [3, 4])]


BAD_ROUTES = [
    ({"region": "../admin"}, "path_from: the value at metadata path 'region' is not one URL path segment"),
    ({"region": "a/b"}, "is not one URL path segment"),
    ({"region": "eu?x=1"}, "is not one URL path segment"),
    ({"region": ["eu"]}, "metadata path 'region' is list, not a scalar"),
    ({}, "metadata path 'region' is missing or empty and there is no path_default"),
    ({"region": "eu", "tenant": "evil\r\nX-Injected: yes"},
     "headers_from: header 'X-Tenant': the value contains a line break or another control character"),
    ({"region": "eu", "tenant": "n\u00e4me"}, "headers_from: header 'X-Tenant': the value contains non-ASCII"),
]


@pytest.mark.parametrize(("metadata", "reason"), BAD_ROUTES, ids=[f"bad{i}" for i in range(len(BAD_ROUTES))])
def test_http_an_event_whose_path_or_header_cannot_be_sent_is_a_permanent_rejection(
        http_server: HttpRecorder, metadata: dict[str, object], reason: str) -> None:
    good = [Event(id=700 + i, stream_id=4, payload={"seq": i}, metadata={"region": "eu", "tenant": "t"},
                  created_at=BASE_TIME) for i in range(3)]
    bad = Event(id=750, stream_id=4, payload={"seq": 50}, metadata=metadata, created_at=BASE_TIME)
    config = _http(url=http_server.url, path_from="metadata:region",
                            headers_from={"X-Tenant": "metadata:tenant"})
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish([good[0], good[1], bad, good[2]])
    assert err.value.permanent and err.value.event_ids == (750,)
    message = str(err.value)
    assert message.startswith(f"http sink: event 750: POST {http_server.url} not sent: ") and reason in message
    for value in ("admin", "Injected", "n\u00e4me", "X-Injected"):
        assert value not in message  # the value is never shown
    assert [(r.path, r.body["seq"]) for r in http_server.received] == [("/hook/eu", 0), ("/hook/eu", 1)]


ROUTE_STATUSES = [(404, "path"), (410, "path"), (431, "headers")]


@pytest.mark.parametrize(("status", "part"), ROUTE_STATUSES, ids=[str(s) for s, _ in ROUTE_STATUSES])
def test_http_a_refused_route_taken_from_the_event_is_the_events_rejection(
        http_server: HttpRecorder, status: int, part: str) -> None:
    """A 404/410 on the event's own path segment, a 431 on a request carrying the event's header values:
    the part the receiver refused came from the event, so it is a permanent rejection of that event,
    after the events before it were confirmed. The same answer on ``path_default`` (the configuration's
    segment) or without headers from the event is the configuration's: not permanent."""
    config = _http(url=http_server.url, max_attempts=1, path_from="metadata:region", path_default="all",
                            headers_from={"X-Tenant": "metadata:tenant"})
    routed = {"path": {"region": "eu"}, "headers": {"tenant": "t1"}}[part]
    events = [Event(id=800 + i, stream_id=4, payload={"seq": i}, metadata=routed, created_at=BASE_TIME)
              for i in range(3)]
    http_server.fail_on_event_id, http_server.fail_status = 801, status
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(events)
    assert err.value.permanent and err.value.event_ids == (801,)
    assert f"HTTP {status}" in str(err.value) and "came from the event" in str(err.value)
    # the configuration's own route: path_default and no header from the event
    unrouted = [Event(id=900 + i, stream_id=4, payload={"seq": i}, metadata={}, created_at=BASE_TIME)
                for i in range(3)]
    http_server.fail_on_event_id = 901
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(unrouted)
    assert not err.value.permanent and f"HTTP {status}" in str(err.value)


def test_http_a_header_value_from_the_event_over_max_header_value_bytes_is_refused_before_sending(
        http_server: HttpRecorder) -> None:
    config = _http(url=http_server.url, headers_from={"X-Note": "note"}, max_header_value_bytes=100)
    events = [Event(id=950 + i, stream_id=4, payload={"note": "n" * size}, created_at=BASE_TIME)
              for i, size in enumerate([100, 101, 5])]
    with config.build() as sink, pytest.raises(SinkError) as err:
        sink.publish(events)
    assert err.value.permanent and err.value.event_ids == (951,)
    assert "header 'X-Note' would be 101 bytes, more than max_header_value_bytes (100)" in str(err.value)
    assert "n" * 50 not in str(err.value)
    assert [r.headers["webhook-id"] for r in http_server.received] == ["950"]


def test_http_routing_options_are_checked_when_the_configuration_is_loaded() -> None:
    url = "http://127.0.0.1:9/hook"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"path_from": "metadata:r", "path_default": "a/b"}, "path_default must be one URL path segment"),
        ({"path_from": "metadata:r", "path_default": ".."}, "path_default must be one URL path segment"),
        ({"path_default": "eu"}, "path_default needs path_from"),
        ({"headers_from": {"Content-Type": "metadata:t"}}, "header 'Content-Type' is set by the sink"),
        ({"headers_from": {"webhook-id": "metadata:t"}}, "header 'webhook-id' is set by the sink"),
        ({"headers_from": {"Host": "metadata:t"}}, "frames the request"),
        ({"headers_from": {"authorization": "metadata:t"}, "headers": {"Authorization": "Bearer x"}},
         "header 'authorization' is also in headers"),
        ({"headers_from": {"Bad Name": "metadata:t"}}, "is not a valid HTTP header name"),
        ({"headers_from": {"X-T": "meta:t"}}, "String should match pattern"),
        ({"path_from": "metadata:"}, "String should match pattern"),
    ]
    for options, message in cases:
        with pytest.raises(ValidationError, match=re.escape(message)):
            HttpSinkConfig.model_validate({"url": url, **options})
    config = HttpSinkConfig.model_validate({"url": url, "path_from": "payload:table", "routing_key": "metadata:t",
                                            "headers_from": {"X-T": "metadata:a.b"}})
    assert config.path_from == "payload:table"


def test_http_routing_key_from_metadata_orders_per_key(http_server: HttpRecorder) -> None:
    events = [Event(id=800 + i, stream_id=4, payload={"seq": i}, metadata={"k": f"k{i % 3}"}, created_at=BASE_TIME)
              for i in range(30)]
    with _http(url=http_server.url, routing_key="metadata:k", max_concurrency=3).build() as sink:
        sink.publish(events)
    seqs = [r.body["seq"] for r in http_server.received]
    assert sorted(seqs) == list(range(30))
    for k in range(3):
        assert [s for s in seqs if s % 3 == k] == list(range(k, 30, 3))  # in order per key
