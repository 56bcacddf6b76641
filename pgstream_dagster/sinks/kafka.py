"""Kafka sink (extra ``kafka``, library confluent-kafka): an idempotent producer, each publish
confirmed by the broker before it returns.

Order: Kafka keeps order within a partition. The message key picks the partition: by default the
stream id (every event of a stream in one partition: commit order, end to end), or the value at
payload path ``key_from`` (order per key, keys spread over partitions). The idempotent producer
(``enable.idempotence``, ``acks=all``) keeps that order through its own retries, and the broker
drops the duplicates those retries would cause.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, SecretStr, model_validator

from .base import (
    Event,
    PayloadPath,
    RoutingError,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_events,
    import_extra,
    route_name,
    scrub,
)

__all__ = ["KafkaSink", "KafkaSinkConfig"]

log = logging.getLogger(__name__)

#: settings the sink owns (and their librdkafka aliases): changing them would break ordering or the
#: confirmation guarantee; the sink produces without transactions
_OWNED = {"enable.idempotence", "acks", "request.required.acks", "bootstrap.servers", "metadata.broker.list",
          "message.timeout.ms", "delivery.timeout.ms", "transactional.id", "on_delivery", "error_cb", "logger"}

#: librdkafka settings that hold credentials or key material: refused in ``options`` (shown in repr and
#: the UI), accepted in ``secret_options``; so is every key naming a password, secret or passphrase
#: (``_is_credential``). Key *locations* (``ssl.key.location``) are paths, not secrets.
_CREDENTIALS = {"sasl.password", "sasl.oauthbearer.config", "sasl.oauthbearer.client.secret", "ssl.key.pem",
                "ssl_key", "ssl.key.password", "ssl.keystore.password", "sasl.oauthbearer.assertion.private.key.pem"}
_CREDENTIAL_WORDS = ("password", "secret", "passphrase")

#: client errors after which waiting for the timeout is pointless: the publish fails at once
_FAIL_FAST = {"_AUTHENTICATION"}

#: how often a publish that waits for delivery reports checks for a fatal client error
_FLUSH_SLICE_SECS = 0.25

#: a legal Kafka topic name
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


class KafkaSinkConfig(SinkConfigBase):
    """Produce each event payload (JSON) to ``topic``, or to ``topic_prefix`` + the value at payload
    path ``topic_from`` (falling back to ``topic``). Key: the stream id, or the value at payload path
    ``key_from`` (falling back to the stream id). Headers ``pgstream-event-id`` (the idempotency
    key), ``pgstream-stream-id``, ``content-type`` and, when present, ``pgstream-metadata``.

    ``options``: more librdkafka producer settings (``compression.type``, ``linger.ms``,
    ``security.protocol``, ``sasl.mechanism``, ``sasl.username``, ``ssl.ca.location``...);
    ``secret_options``: the ones that are secrets (``sasl.password``, ``ssl.key.password``), kept out
    of logs, messages and the UI; ``options`` refuses them (every key naming a password, secret or
    passphrase, and ``sasl.oauthbearer.config``, ``ssl.key.pem``, the private key PEMs).
    ``timeout_secs``: a publish call fails unless the broker confirmed every message within this
    time. ``reuse_producer``: :meth:`KafkaSink.close` hands a producer that ended cleanly to the
    next sink of this process with the same producer settings (a new idempotent producer needs
    0.5-1 s before its first message is sent; delivery builds a sink per round).
    """

    type: Literal["kafka"] = "kafka"
    bootstrap_servers: str = Field(default="127.0.0.1:9092", min_length=1)
    topic: str | None = Field(default=None, min_length=1)
    topic_from: PayloadPath | None = None
    topic_prefix: str = ""
    key_from: PayloadPath | None = None
    timeout_secs: float = Field(default=30, gt=0)
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    secret_options: dict[str, SecretStr] = Field(default_factory=dict)
    reuse_producer: bool = True

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if self.topic is None and self.topic_from is None:
            raise ValueError("set topic, topic_from, or both (topic is the fallback)")
        owned = sorted(_OWNED & (set(self.options) | set(self.secret_options)))
        if owned:
            raise ValueError(f"options {owned} are set by the sink (idempotent producer, acks=all, timeout_secs, "
                             "bootstrap_servers)")
        credentials = sorted(key for key in self.options if _is_credential(key))
        if credentials:
            raise ValueError(f"options {credentials} are credentials: put them in secret_options (masked in "
                             "logs, messages and the UI), e.g. secret_options: {sasl.password: \"${KAFKA_PASSWORD}\"}")
        return self

    def build(self) -> KafkaSink:
        return KafkaSink(self)


class _LibrdkafkaLog:
    """librdkafka's own log lines (a refused connection is logged on every retry) at DEBUG, secrets
    masked: the failure that matters reaches the caller as a :class:`SinkError`."""

    def __init__(self, secrets: list[str]) -> None:
        self._secrets = secrets

    def log(self, level: int, msg: str, *args: Any) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("librdkafka: %s", scrub(msg % args if args else msg, self._secrets))


class _Relay:
    """The producer's ``error_cb``: forwards client errors to the sink using the producer, if any
    (a pooled producer outlives the sink that created it)."""

    def __init__(self) -> None:
        self.target: KafkaSink | None = None

    def __call__(self, error: Any) -> None:
        target = self.target
        if target is not None:
            target._on_client_error(error)
        else:
            log.debug("kafka client error of an idle producer: %s", error)


class _ProducerPool:
    """Idle producers of this process, at most one per set of producer settings.

    Kafka producers are meant to be long-lived; delivery builds a sink per round (every batch an
    open run is handed), and a new idempotent producer waits 0.5-1 s for its producer id before it
    sends anything. A producer enters the pool only from :meth:`KafkaSink.close` after a clean flush
    (nothing pending, no fatal error): a failed producer is purged and dropped, never reused. Keyed
    by process id too: a forked child never uses its parent's producers (librdkafka's threads do
    not survive a fork), and keeps them referenced rather than destroying them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, str], tuple[Any, _Relay]] = {}
        self._abandoned: list[Any] = []

    def take(self, key: str) -> tuple[Any, _Relay] | None:
        with self._lock:
            return self._idle.pop((os.getpid(), key), None)

    def give(self, key: str, producer: Any, relay: _Relay) -> bool:
        with self._lock:
            slot = (os.getpid(), key)
            if slot in self._idle:
                return False
            self._idle[slot] = (producer, relay)
            return True

    def clear(self) -> None:
        """Drop this process's idle producers (they hold nothing: each was flushed before it was pooled)."""
        with self._lock:
            mine = [k for k in self._idle if k[0] == os.getpid()]
            for k in mine:
                del self._idle[k]

    def after_fork_in_child(self) -> None:
        with self._lock:
            self._abandoned += [producer for producer, _relay in self._idle.values()]
            self._idle.clear()


_POOL = _ProducerPool()
atexit.register(_POOL.clear)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.after_fork_in_child)


class KafkaSink(Sink):
    """One producer per sink, created on first publish (or taken from the process's pool of idle
    producers), flushed on :meth:`close` and then pooled (``reuse_producer``) or dropped."""

    type_name: ClassVar[str] = "kafka"
    config: KafkaSinkConfig

    def __init__(self, config: KafkaSinkConfig) -> None:
        super().__init__(config)
        self._kafka = import_extra("kafka", "kafka", "confluent-kafka", "confluent_kafka")
        self._producer: Any = None
        self._relay: _Relay | None = None
        self._client_error: str | None = None
        self._fatal_error: str | None = None

    def _settings(self) -> dict[str, Any]:
        """The producer settings (with secret values), callbacks excepted."""
        config = self.config
        return {
            "client.id": "pgstream-dagster",
            "linger.ms": 5,
            **config.options,
            **{k: v.get_secret_value() for k, v in config.secret_options.items()},
            "bootstrap.servers": config.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": int(config.timeout_secs * 1000),
        }

    def _pool_key(self) -> str:
        return json.dumps(self._settings(), sort_keys=True, default=str)

    def _producer_for(self) -> Any:
        if self._producer is None:
            config = self.config
            self._client_error = self._fatal_error = None
            pooled = _POOL.take(self._pool_key()) if config.reuse_producer else None
            if pooled is not None:
                producer, relay = pooled
                producer.poll(0)  # what happened while it was idle is no news for this sink
                relay.target = self
                self._producer, self._relay = producer, relay
                return producer
            relay = _Relay()
            settings: dict[str, Any] = {
                **self._settings(),
                "error_cb": relay,
                "logger": _LibrdkafkaLog(config.secret_values()),
            }
            try:
                self._producer = self._kafka.Producer(settings)
                relay.target, self._relay = self, relay
            except (self._kafka.KafkaException, TypeError, ValueError) as exc:
                # e.g. an unknown setting, max.in.flight > 5 (idempotence), an unsupported SASL mechanism
                raise SinkError(scrub(f"kafka sink: invalid producer settings: {_describe_kafka_error(exc)}",
                                      config.secret_values()), sink="kafka") from None
        return self._producer

    def _on_client_error(self, error: Any) -> None:
        self._client_error = scrub(str(error), self.config.secret_values())
        log.debug("kafka client error: %s", self._client_error)
        if _is_fatal(error):
            self._fatal_error = self._client_error

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        routes = [self._route(event) for event in events]  # all first: nothing sent on a bad one
        producer = self._producer_for()
        failures: list[tuple[Event, str, str, bool]] = []  # event, topic, error, timed out
        confirmed = 0

        def delivered(event: Event, topic: str) -> Any:
            def callback(error: Any, _message: Any) -> None:
                nonlocal confirmed
                if error is None:
                    confirmed += 1
                else:
                    failures.append((event, topic, str(error), _timed_out(error)))
            return callback

        for event, (topic, key) in zip(events, routes, strict=True):
            headers = [("pgstream-event-id", str(event.id).encode()),
                       ("pgstream-stream-id", str(event.stream_id).encode()),
                       ("content-type", b"application/json")]
            if event.metadata_json is not None:
                headers.append(("pgstream-metadata", event.metadata_json.encode()))
            while True:
                try:
                    producer.produce(topic, value=event.payload_json.encode(), key=key.encode(), headers=headers,
                                     on_delivery=delivered(event, topic))
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    producer.poll(0.1)
                except self._kafka.KafkaException as exc:
                    self._reset()
                    raise self._error(events, f"produce to {topic!r} failed: {exc}") from None
        remaining = self._flush(producer)
        if failures or remaining or confirmed != len(events):
            fatal, failed = self._fatal_error, list(failures)  # before the purge adds "Purged" reports
            self._reset()
            first = ""
            if failed:
                event, topic, reason, _ = failed[0]
                first = f" (first: {describe_events([event])} on topic {topic!r}: {reason})"
            topics = sorted({topic for topic, _key in routes})
            where = f"topic {topics[0]!r}" if len(topics) == 1 else f"{len(topics)} topics"
            if fatal is not None:
                detail, within = f"; gave up on client error: {fatal}", ""
            else:
                detail = f"; last client error: {self._client_error}" if self._client_error else ""
                timed_out = remaining or any(f[3] for f in failed)
                within = f" within {self.config.timeout_secs:g}s" if timed_out else ""
            raise self._error(events, f"{len(events) - confirmed} of {len(events)} messages to {where} were not "
                                      f"confirmed by {self.config.bootstrap_servers}{within}{first}{detail}")

    def _flush(self, producer: Any) -> int:
        """Wait up to ``timeout_secs`` for every delivery report, in slices so that a fatal client error
        (an authentication failure, a fenced idempotent producer) fails the publish at once."""
        deadline = time.monotonic() + self.config.timeout_secs
        while True:
            remaining = int(producer.flush(min(_FLUSH_SLICE_SECS, max(0.0, deadline - time.monotonic()))))
            if not remaining or self._fatal_error is not None or time.monotonic() >= deadline:
                return remaining

    def _route(self, event: Event) -> tuple[str, str]:
        config = self.config
        try:
            topic = route_name(event, config.topic, config.topic_from, config.topic_prefix)
            key = route_name(event, str(event.stream_id), config.key_from) if config.key_from else str(event.stream_id)
        except RoutingError as exc:
            raise self._error([event], f"no topic: {exc}") from None
        if not _TOPIC.fullmatch(topic) or topic in (".", ".."):
            raise self._error([event], f"invalid topic {topic[:300]!r} (1-249 of a-z A-Z 0-9 . _ -)")
        return topic, key

    def _reset(self) -> None:
        """Drop a producer after a failure: what it still holds is not delivered later, behind the
        failover's back (the retry sends it again, in order)."""
        producer, self._producer = self._producer, None
        self._fatal_error = None
        if self._relay is not None:
            self._relay.target, self._relay = None, None
        if producer is not None:
            try:
                producer.purge(in_queue=True, in_flight=True)
                producer.flush(0)
            except Exception as exc:  # best effort: the producer may be broken
                log.debug("purging the kafka producer failed: %s", exc)

    def _error(self, events: Sequence[Event], reason: str) -> SinkError:
        return SinkError.for_events("kafka", events, reason, self.config.secret_values())

    def close(self) -> None:
        """Flush; then pool the producer (``reuse_producer``, nothing pending, no fatal error) or drop it."""
        producer, relay = self._producer, self._relay
        if producer is None or relay is None:
            return
        remaining = producer.flush(self.config.timeout_secs)
        if remaining or self._fatal_error is not None:
            if remaining:
                log.warning("kafka sink: %d message(s) not confirmed by %s when closing; dropped", remaining,
                            self.config.bootstrap_servers)
            self._reset()
            return
        self._producer = self._relay = None
        relay.target = None
        if not (self.config.reuse_producer and _POOL.give(self._pool_key(), producer, relay)):
            producer.flush(0)  # dropped: librdkafka destroys it with the last reference


def _is_credential(key: str) -> bool:
    """A librdkafka setting holding a credential or key material (it belongs in ``secret_options``)."""
    name = key.strip().lower()
    return name in _CREDENTIALS or any(word in name for word in _CREDENTIAL_WORDS)


def _is_fatal(error: Any) -> bool:
    """A client error after which this producer cannot deliver: fatal for librdkafka, or an
    authentication failure (retrying with the same credentials fails the same way)."""
    try:
        return bool(error.fatal()) or error.name() in _FAIL_FAST
    except AttributeError:  # not a KafkaError
        return False


def _timed_out(error: Any) -> bool:
    try:
        return bool(error.name() == "_MSG_TIMED_OUT")
    except AttributeError:
        return False


def _describe_kafka_error(exc: BaseException) -> str:
    """The librdkafka message of a ``KafkaException`` (``str()`` of its ``KafkaError``), else the exception."""
    args = getattr(exc, "args", ())
    if args and hasattr(args[0], "str") and callable(args[0].str):
        return str(args[0].str())
    return f"{type(exc).__name__}: {exc}"
