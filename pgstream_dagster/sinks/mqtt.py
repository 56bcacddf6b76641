"""MQTT sink (extra ``mqtt``, library paho-mqtt 2.x): QoS 1 publishes, each acknowledged (PUBACK).

Keys, the connection's life, refusals and permanent rejections: docs/sinks.md, ``mqtt``."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from .base import Event, EventPath, Sink, SinkConfigBase, describe_exception, import_extra, publish_prepared

if TYPE_CHECKING:
    from paho.mqtt.client import Client, MQTTMessageInfo

__all__ = ["MqttSink", "MqttSinkConfig", "MqttTlsConfig"]

log = logging.getLogger(__name__)

#: an MQTT topic name is a UTF-8 string of at most this many bytes
_MAX_TOPIC_BYTES = 65_535

#: the largest MQTT packet (its remaining length), and room for the rest of a PUBLISH but topic, body
#: and metadata (packet id, lengths, the other properties)
_MAX_PACKET_BYTES = 268_435_455
_PACKET_OVERHEAD_BYTES = 256

#: PUBACK reason codes (MQTT 5) that refuse the payload itself, whatever the topic
_PAYLOAD_REFUSALS = frozenset({0x99})  # payload format invalid

#: PUBACK reason codes that concern the broker's state or the client, never the event
_TRANSIENT_REFUSALS = frozenset({0x91, 0x97})  # packet identifier in use, quota exceeded


def topic_problem(topic: str) -> str | None:
    """Why ``topic`` cannot be published to (``None``: it can): MQTT forbids wildcards and NUL in a topic
    name, and names starting with ``$`` are the broker's (``$SYS``)."""
    if not topic:
        return "is empty"
    if "+" in topic or "#" in topic:
        return "contains a wildcard (+ or #)"
    if "\x00" in topic:
        return "contains a NUL character"
    if topic.startswith("$"):
        return "starts with $ (reserved for the broker's topics)"
    if len(topic.encode()) > _MAX_TOPIC_BYTES:
        return f"is longer than {_MAX_TOPIC_BYTES} bytes"
    return None


class MqttTlsConfig(BaseModel):
    """TLS for the broker connection: ``tls: {}`` (or ``tls: true``) verifies the broker against the
    system's CAs; ``ca_certs`` a CA bundle of your own; ``certfile``/``keyfile`` a client certificate."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    keyfile_password: SecretStr | None = None
    check_hostname: bool = True

    @model_validator(mode="after")
    def _key_with_cert(self) -> Self:
        if self.keyfile is not None and self.certfile is None:
            raise ValueError("keyfile needs certfile (the client certificate)")
        return self


class MqttSinkConfig(SinkConfigBase):
    """Publish each event (QoS 1, not retained) to ``topic``, or to ``topic_prefix`` + the value at
    payload path ``topic_from`` (falling back to ``topic``)."""

    type: Literal["mqtt"] = "mqtt"
    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=1883, ge=1, le=65_535)
    protocol: Literal["5", "3.1.1"] = "5"
    topic: str | None = None
    topic_from: EventPath | None = None
    topic_prefix: str = ""
    body: Literal["payload", "event"] = "payload"
    client_id: str | None = Field(default=None, min_length=1, max_length=65_535)
    clean_session: bool = True
    session_expiry_secs: int = Field(default=0, ge=0, le=4_294_967_295)
    keepalive_secs: int = Field(default=60, ge=1, le=65_535)
    username: str | None = None
    password: SecretStr | None = None
    tls: MqttTlsConfig | None = None
    max_message_bytes: int | None = Field(default=None, ge=1)
    timeout_secs: float = Field(default=10, gt=0)
    routed_names: ClassVar[tuple[str, ...]] = ("topic",)

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value

    @field_validator("tls", mode="before")
    @classmethod
    def _tls_flag(cls, value: Any) -> Any:
        return ({} if value else None) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.topic is not None and (problem := topic_problem(self.topic)) is not None:
            raise ValueError(f"topic {self.topic[:100]!r} {problem}")
        if self.topic_prefix and (problem := topic_problem(self.topic_prefix + "x")) is not None:
            raise ValueError(f"topic_prefix {self.topic_prefix[:100]!r} {problem}")
        if self.protocol == "3.1.1":
            if self.body != "event":
                raise ValueError("protocol 3.1.1 has no user properties to carry the event id (the idempotency "
                                 "key): set body: event, or use protocol 5")
            if self.session_expiry_secs:
                raise ValueError("session_expiry_secs is an MQTT 5 setting (with 3.1.1 a session that is not "
                                 "clean lasts until the broker drops it)")
        if not self.clean_session and self.client_id is None:
            raise ValueError("clean_session: false needs a client_id (the session belongs to it)")
        if self.password is not None and self.username is None:
            raise ValueError("password needs username")
        return self


@dataclass(frozen=True)
class _Message:
    topic: str
    body: bytes
    from_payload: bool


class _Connection:
    """One paho client, connected, with its network thread (which never reconnects) and the PUBACKs it saw."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.cond = threading.Condition()
        self.connack: Any = None  # the CONNACK's reason code, once received
        self.lost: str | None = None  # why the connection ended, once it did
        self.acks: dict[int, Any] = {}  # mid -> PUBACK reason code

    def on_connect(self, _client: Any, _userdata: Any, _flags: Any, reason: Any, _properties: Any) -> None:
        with self.cond:
            self.connack = reason
            self.cond.notify_all()

    def on_disconnect(self, _client: Any, _userdata: Any, _flags: Any, reason: Any, _properties: Any) -> None:
        with self.cond:
            self.lost = str(reason)
            self.cond.notify_all()

    def on_publish(self, _client: Any, _userdata: Any, mid: int, reason: Any, _properties: Any) -> None:
        with self.cond:
            self.acks[mid] = reason
            self.cond.notify_all()


class MqttSink(Sink, builds=MqttSinkConfig):
    """Connects on first publish; the connection (and its network thread) lives until :meth:`close` or a failure."""

    config: MqttSinkConfig
    #: messages published before waiting for their acknowledgements (packet ids are 16-bit: a window
    #: must stay far below 65,535 so that no id is reused while its acknowledgement is remembered)
    window: ClassVar[int] = 1_000

    def max_event_bytes(self) -> int | None:
        return _MAX_PACKET_BYTES  # the protocol's limit of a packet (the message holds the payload at least)

    def __init__(self, config: MqttSinkConfig) -> None:
        super().__init__(config)
        self._mqtt = import_extra("mqtt", "mqtt", "paho-mqtt", "paho.mqtt.client")
        self._conn: _Connection | None = None
        self._target = f"{config.host}:{config.port}"

    def publish(self, events: Sequence[Event]) -> None:
        publish_prepared(events, self._message, self._send)

    def _message(self, event: Event) -> _Message:
        config = self.config
        topic, from_payload = self._destination(event, "no topic", config.topic, config.topic_from, config.topic_prefix)
        problem = topic_problem(topic)
        if problem is not None:
            # from the payload: the event's fault; the fixed topic: the configuration's
            raise self._error([event], f"invalid topic {topic[:200]!r}: it {problem}", permanent=from_payload)
        body = (event.payload_json if config.body == "payload" else event.to_json()).encode()
        limit = config.max_message_bytes
        if limit is not None and len(body) > limit:
            reason = (f"not sent to topic {topic!r}: the message is {len(body)} bytes, more than "
                      f"max_message_bytes ({limit})")
            raise self._error([event], reason, permanent=True)
        metadata = event.metadata_json or ""
        if len(body) + len(topic.encode()) + len(metadata.encode()) + _PACKET_OVERHEAD_BYTES > _MAX_PACKET_BYTES:
            reason = f"not sent to topic {topic!r}: the message is {len(body)} bytes, more than an MQTT packet holds"
            raise self._error([event], reason, permanent=True)
        return _Message(topic, body, from_payload)

    def _properties(self, event: Event) -> Any:
        if self.config.protocol != "5":
            return None
        props = self._mqtt.Properties(self._mqtt.PacketTypes.PUBLISH)
        user = [("pgstream-event-id", str(event.id)), ("pgstream-stream-id", str(event.stream_id))]
        if event.metadata_json is not None:
            user.append(("pgstream-metadata", event.metadata_json))
        props.UserProperty = user
        props.ContentType = "application/json"
        return props

    def _send(self, events: Sequence[Event], messages: list[_Message]) -> None:
        for start in range(0, len(events), self.window):
            self._send_window(events[start : start + self.window], messages[start : start + self.window])

    def _send_window(self, events: Sequence[Event], messages: Sequence[_Message]) -> None:
        conn = self._connected(events)
        client = conn.client
        with conn.cond:
            conn.acks.clear()  # every earlier call was acknowledged, or its connection discarded
        infos: list[MQTTMessageInfo] = []
        for event, message in zip(events, messages, strict=True):
            try:
                info = client.publish(message.topic, message.body, qos=1, retain=False,
                                      properties=self._properties(event))
            except ValueError as exc:  # paho's own checks of topic and size: _message made them first
                self._discard()
                reason = f"not sent to topic {message.topic!r}: {describe_exception(exc)}"
                raise self._error(events[len(infos):], reason) from None
            if info.rc not in (self._mqtt.MQTT_ERR_SUCCESS, self._mqtt.MQTT_ERR_NO_CONN):
                self._discard()
                reason = f"publish to {message.topic!r} at {self._target} failed: {self._mqtt.error_string(info.rc)}"
                raise self._error(events[len(infos):], reason) from None
            infos.append(info)  # NO_CONN: kept queued; the lost connection is reported below
        self._await_acks(conn, events, messages, infos)

    def _await_acks(self, conn: _Connection, events: Sequence[Event], messages: Sequence[_Message],
                    infos: Sequence[MQTTMessageInfo]) -> None:
        """Wait until every message is acknowledged, the connection is lost, or no acknowledgement came
        for ``timeout_secs``; then check the acknowledgements in publish order."""
        timeout = self.config.timeout_secs
        mids = [info.mid for info in infos]
        with conn.cond:
            seen, deadline = len(conn.acks), time.monotonic() + timeout
            while len(conn.acks) < len(mids) and conn.lost is None:
                if len(conn.acks) > seen:  # progress: the wait restarts
                    seen, deadline = len(conn.acks), time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                conn.cond.wait(left)
            acks, lost = dict(conn.acks), conn.lost
        for i, (event, message, mid) in enumerate(zip(events, messages, mids, strict=True)):
            reason = acks.get(mid)
            if reason is None:
                self._discard()
                why = f"connection lost ({lost})" if lost is not None else f"no acknowledgement within {timeout:g}s"
                missing = len(events) - i
                raise self._error(events[i:], f"{missing} of {len(events)} messages to topic {message.topic!r} at "
                                              f"{self._target} not acknowledged: {why}")
            if reason.is_failure:
                code = reason.value
                permanent = code in _PAYLOAD_REFUSALS or (message.from_payload and code not in _TRANSIENT_REFUSALS)
                text = f"the broker at {self._target} refused the message to topic {message.topic!r}: {reason} " \
                       f"(reason code 0x{code:02X})"
                if lost is not None:
                    self._discard()
                raise self._error([event] if permanent else events[i:], text, permanent=permanent)

    def _connected(self, events: Sequence[Event]) -> _Connection:
        conn = self._conn
        if conn is not None:
            if conn.lost is None and conn.client.is_connected():
                return conn
            log.info("mqtt sink: the connection to %s was closed (%s); reconnecting", self._target, conn.lost)
            self._discard()
        self._conn = self._connect(events)
        return self._conn

    def _connect(self, events: Sequence[Event]) -> _Connection:
        mqtt, config = self._mqtt, self.config
        v5 = config.protocol == "5"
        client_id = config.client_id if config.client_id is not None else f"pgstream-{uuid.uuid4().hex[:16]}"
        options: dict[str, Any] = {"client_id": client_id, "reconnect_on_failure": False,
                                   "protocol": mqtt.MQTTv5 if v5 else mqtt.MQTTv311}
        if not v5:
            options["clean_session"] = config.clean_session
        client: Client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, **options)
        conn = _Connection(client)
        client.on_connect = conn.on_connect
        client.on_disconnect = conn.on_disconnect
        client.on_publish = conn.on_publish
        client.connect_timeout = config.timeout_secs
        if config.username is not None:
            password = config.password.get_secret_value() if config.password is not None else None
            client.username_pw_set(config.username, password)
        connect: dict[str, Any] = {"keepalive": config.keepalive_secs}
        if v5:
            props = mqtt.Properties(mqtt.PacketTypes.CONNECT)
            props.SessionExpiryInterval = config.session_expiry_secs
            connect.update(clean_start=config.clean_session, properties=props)
        try:
            if (tls := config.tls) is not None:
                secret = tls.keyfile_password
                client.tls_set(ca_certs=tls.ca_certs, certfile=tls.certfile, keyfile=tls.keyfile,
                               keyfile_password=secret.get_secret_value() if secret is not None else None)
                client.tls_insecure_set(not tls.check_hostname)
            client.connect(config.host, config.port, **connect)
        except (OSError, ValueError) as exc:  # refused, unreachable, TLS handshake, bad certificate files
            self._stop(client)
            why = describe_exception(exc, self.config.secret_values())
            reason = f"cannot connect to the MQTT broker at {self._target}: {why}"
            raise self._error(events, reason) from None
        client.loop_start()
        with conn.cond:
            conn.cond.wait_for(lambda: conn.connack is not None or conn.lost is not None, config.timeout_secs)
            connack, lost = conn.connack, conn.lost
        if connack is None or connack.is_failure:
            self._stop(client)
            if connack is not None:
                why = f"the broker refused the connection: {connack}"
            elif lost is not None:
                why = f"the connection closed before the broker answered ({lost})"
            else:
                why = f"no answer (CONNACK) within {config.timeout_secs:g}s"
            raise self._error(events, f"cannot connect to the MQTT broker at {self._target}: {why}")
        log.info("mqtt sink: connected to %s as client %r (MQTT %s)", self._target, client_id, config.protocol)
        return conn

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._stop(conn.client)

    def _stop(self, client: Client) -> None:
        try:
            client.disconnect()
        except Exception as exc:  # best effort: the connection may already be broken
            log.debug("mqtt sink: disconnecting from %s failed: %s", self._target, describe_exception(exc))
        client.loop_stop()

    def close(self) -> None:
        self._discard()
