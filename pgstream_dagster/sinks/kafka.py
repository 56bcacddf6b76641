"""Kafka sink (extra ``kafka``, library confluent-kafka): an idempotent producer, each publish
confirmed by the broker before it returns.

Keys, order, producer settings and permanent rejections: docs/sinks.md, ``kafka``."""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, SecretStr, model_validator

from .base import (
    Event,
    EventPath,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_events,
    import_extra,
    publish_prepared,
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

#: per-record errors: the client or the broker refused the message itself (retrying it fails again)
_REJECTING = frozenset({"MSG_SIZE_TOO_LARGE", "RECORD_LIST_TOO_LARGE", "INVALID_RECORD"})

#: librdkafka's default message.max.bytes
_DEFAULT_MESSAGE_MAX_BYTES = 1_000_000


class KafkaSinkConfig(SinkConfigBase):
    """Produce each event payload (JSON) to ``topic``, or to ``topic_prefix`` + the value at event path
    ``topic_from`` (falling back to ``topic``), keyed by the value at event path ``key_from``, else the
    stream id. Event paths read the payload (``table``) or, with ``metadata:``, the metadata
    (``metadata:region``). Headers ``pgstream-event-id`` (the idempotency key), ``pgstream-stream-id``,
    ``content-type`` and, when present, ``pgstream-metadata``."""

    type: Literal["kafka"] = "kafka"
    bootstrap_servers: str = Field(default="127.0.0.1:9092", min_length=1)
    topic: str | None = Field(default=None, min_length=1)
    topic_from: EventPath | None = None
    topic_prefix: str = ""
    key_from: EventPath | None = None
    timeout_secs: float = Field(default=30, gt=0)
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    secret_options: dict[str, SecretStr] = Field(default_factory=dict)
    routed_names: ClassVar[tuple[str, ...]] = ("topic",)

    @model_validator(mode="before")
    @classmethod
    def _gone(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reuse_producer" in data:  # (0.1's producer pool)
            raise ValueError("reuse_producer is no longer read: a delivery run keeps one sink, and its producer, "
                             "for its whole life; remove it")
        return data

    @model_validator(mode="after")
    def _valid(self) -> Self:
        owned = sorted(_OWNED & (set(self.options) | set(self.secret_options)))
        if owned:
            raise ValueError(f"options {owned} are set by the sink (idempotent producer, acks=all, timeout_secs, "
                             "bootstrap_servers)")
        credentials = sorted(key for key in self.options if _is_credential(key))
        if credentials:
            raise ValueError(f"options {credentials} are credentials: put them in secret_options (masked in "
                             "logs, messages and the UI), e.g. secret_options: {sasl.password: \"${KAFKA_PASSWORD}\"}")
        return self


class _LibrdkafkaLog:
    """librdkafka's own log lines (a refused connection is logged on every retry) at DEBUG, secrets
    masked: the failure that matters reaches the caller as a :class:`SinkError`."""

    def __init__(self, secrets: list[str]) -> None:
        self._secrets = secrets

    def log(self, level: int, msg: str, *args: Any) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("librdkafka: %s", scrub(msg % args if args else msg, self._secrets))


class KafkaSink(Sink, builds=KafkaSinkConfig):
    """One producer per sink, created on first publish and kept for the sink's life (a new idempotent
    producer waits 0.5-1 s for its producer id); purged and dropped after a failure, flushed on :meth:`close`."""

    config: KafkaSinkConfig

    def max_event_bytes(self) -> int | None:
        return int(self._settings().get("message.max.bytes", _DEFAULT_MESSAGE_MAX_BYTES))  # the value is the payload

    def __init__(self, config: KafkaSinkConfig) -> None:
        super().__init__(config)
        self._kafka = import_extra("kafka", "kafka", "confluent-kafka", "confluent_kafka")
        self._producer: Any = None
        self._client_error: str | None = None
        self._fatal_error: str | None = None

    def _settings(self) -> dict[str, Any]:
        """The producer settings (with secret values), callbacks excepted."""
        config = self.config
        return {"client.id": "pgstream-dagster", "linger.ms": 5, **config.options,
                **{k: v.get_secret_value() for k, v in config.secret_options.items()},
                "bootstrap.servers": config.bootstrap_servers, "enable.idempotence": True, "acks": "all",
                "message.timeout.ms": int(config.timeout_secs * 1000)}

    def _producer_for(self) -> Any:
        if self._producer is None:
            config = self.config
            self._client_error = self._fatal_error = None
            settings: dict[str, Any] = {**self._settings(), "error_cb": self._on_client_error,
                                        "logger": _LibrdkafkaLog(config.secret_values())}
            try:
                self._producer = self._kafka.Producer(settings)
            except (self._kafka.KafkaException, TypeError, ValueError) as exc:
                # e.g. an unknown setting, max.in.flight > 5 (idempotence), an unsupported SASL mechanism
                raise SinkError(scrub(f"kafka sink: invalid producer settings: {_describe_kafka_error(exc)}",
                                      config.secret_values()), sink="kafka") from None
        return self._producer

    def _on_client_error(self, error: Any) -> None:
        """The producer's ``error_cb`` (served from its ``poll``/``flush``)."""
        if self._producer is None:  # the last words of a producer being dropped (:meth:`_reset`)
            log.debug("kafka client error of a dropped producer: %s", scrub(str(error), self.config.secret_values()))
            return
        self._client_error = scrub(str(error), self.config.secret_values())
        log.debug("kafka client error: %s", self._client_error)
        if _is_fatal(error):
            self._fatal_error = self._client_error

    def publish(self, events: Sequence[Event]) -> None:
        publish_prepared(events, self._route, self._produce)

    def _produce(self, events: Sequence[Event], routes: Sequence[tuple[str, str]]) -> None:
        """Produce ``events`` in order and wait until every one is confirmed, else raise."""
        producer = self._producer_for()
        failures: list[tuple[int, Event, str, Any]] = []  # position, event, topic, error
        confirmed: set[int] = set()

        def delivered(position: int, event: Event, topic: str, error: Any, _message: Any) -> None:
            if error is None:
                confirmed.add(position)
            else:
                failures.append((position, event, topic, error))

        refused: SinkError | None = None  # produce() refused a message for what it is (too large)
        for position, (event, (topic, key)) in enumerate(zip(events, routes, strict=True)):
            headers = [("pgstream-event-id", str(event.id).encode()),
                       ("pgstream-stream-id", str(event.stream_id).encode()),
                       ("content-type", b"application/json")]
            if event.metadata_json is not None:
                headers.append(("pgstream-metadata", event.metadata_json.encode()))
            while True:
                try:
                    producer.produce(topic, value=event.payload_json.encode(), key=key.encode(), headers=headers,
                                     on_delivery=functools.partial(delivered, position, event, topic))
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    producer.poll(0.1)
                except self._kafka.KafkaException as exc:
                    if _rejects(exc.args[0] if exc.args else None):
                        limit = self.max_event_bytes()
                        refused = self._error([event], f"not sent to topic {topic!r}: {_describe_kafka_error(exc)} "
                                                       f"(the producer's message.max.bytes is {limit})", permanent=True)
                        break
                    self._reset()
                    raise self._error(events, f"produce to {topic!r} failed: {exc}") from None
            if refused is not None:
                events, routes = events[:position], routes[:position]  # what was produced before it
                break
        remaining = self._flush(producer)
        if failures or remaining or len(confirmed) != len(events):
            fatal, failed = self._fatal_error, sorted(failures, key=lambda f: f[0])  # before the purge's reports
            self._reset()
            raise self._delivery_error(events, routes, failed, confirmed, remaining, fatal)
        if refused is not None:
            raise refused

    def _delivery_error(self, events: Sequence[Event], routes: Sequence[tuple[str, str]],
                        failed: list[tuple[int, Event, str, Any]], confirmed: set[int], remaining: int,
                        fatal: str | None) -> SinkError:
        """The error of a publish whose messages were not all confirmed: a permanent rejection when the first
        failed message (in publish order) was refused for what it is and every message before it was
        confirmed, naming the consecutive refused events from it; else every event of the call."""
        # a fatal client error or an unconfirmed message after it does not change what the broker said about it
        # (a broker may fence an idempotent producer after a rejection; this producer is dropped anyway)
        if failed and _rejects(failed[0][3]) and set(range(failed[0][0])) <= confirmed:
            position, event, topic, error = failed[0]
            by_position = {f[0]: f for f in failed}
            rejected = [event]
            while position + len(rejected) in by_position and _rejects(by_position[position + len(rejected)][3]):
                rejected.append(by_position[position + len(rejected)][1])
            what = "the message" if len(rejected) == 1 else \
                f"{len(rejected)} messages (a record batch is refused whole: which message is at fault is not known)"
            return self._error(rejected, f"topic {topic!r} at {self.config.bootstrap_servers} refused {what}: "
                                         f"{error}", permanent=True)
        first = ""
        if failed:
            _position, event, topic, error = failed[0]
            first = f" (first: {describe_events([event])} on topic {topic!r}: {error})"
        topics = sorted({topic for topic, _key in routes})
        where = f"topic {topics[0]!r}" if len(topics) == 1 else f"{len(topics)} topics"
        if fatal is not None:
            detail, within = f"; gave up on client error: {fatal}", ""
        else:
            detail = f"; last client error: {self._client_error}" if self._client_error else ""
            timed_out = remaining or any(_name(f[3]) == "_MSG_TIMED_OUT" for f in failed)
            within = f" within {self.config.timeout_secs:g}s" if timed_out else ""
        return self._error(events, f"{len(events) - len(confirmed)} of {len(events)} messages to {where} were not "
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
        config, key = self.config, str(event.stream_id)
        topic, from_event = self._destination(event, "no topic", config.topic, config.topic_from, config.topic_prefix)
        if config.key_from:
            key = self._destination(event, "no topic", key, config.key_from)[0]
        if not _TOPIC.fullmatch(topic) or topic in (".", ".."):
            # from the event: the event's fault; the fixed topic: the configuration's
            raise self._error([event], f"invalid topic {topic[:300]!r} (1-249 of a-z A-Z 0-9 . _ -)",
                              permanent=from_event)
        return topic, key

    def _reset(self) -> None:
        """Drop a producer after a failure: what it still holds is not delivered later, behind the
        failover's back (the retry sends it again, in order)."""
        producer, self._producer = self._producer, None
        self._fatal_error = None
        if producer is not None:
            try:
                producer.purge(in_queue=True, in_flight=True)
                producer.flush(0)
            except Exception as exc:  # best effort: the producer may be broken
                log.debug("purging the kafka producer failed: %s", exc)

    def close(self) -> None:
        """Flush, then drop the producer (librdkafka destroys it with the last reference); what it
        could not deliver in ``timeout_secs`` is purged."""
        producer = self._producer
        if producer is None:
            return
        remaining = producer.flush(self.config.timeout_secs)
        if remaining:
            log.warning("kafka sink: %d message(s) not confirmed by %s when closing; dropped", remaining,
                        self.config.bootstrap_servers)
        self._reset()


def _is_credential(key: str) -> bool:
    """A librdkafka setting holding a credential or key material (it belongs in ``secret_options``)."""
    name = key.strip().lower()
    return name in _CREDENTIALS or any(word in name for word in _CREDENTIAL_WORDS)


def _name(error: Any) -> str | None:
    """The name of a ``KafkaError`` (``None`` for anything else)."""
    try:
        return str(error.name())
    except AttributeError:
        return None


def _is_fatal(error: Any) -> bool:
    """A client error after which this producer cannot deliver: fatal for librdkafka, or an
    authentication failure (retrying with the same credentials fails the same way)."""
    name = _name(error)  # None: not a KafkaError
    return name is not None and (name in _FAIL_FAST or bool(error.fatal()))


def _rejects(error: Any) -> bool:
    """A per-record error: the client or the broker refused the message itself."""
    return _name(error) in _REJECTING


def _describe_kafka_error(exc: BaseException) -> str:
    """The librdkafka message of a ``KafkaException`` (``str()`` of its ``KafkaError``), else the exception."""
    if exc.args and callable(getattr(exc.args[0], "str", None)):
        return str(exc.args[0].str())
    return f"{type(exc).__name__}: {exc}"
