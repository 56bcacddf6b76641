"""NATS sink (extra ``nats``, library nats-py): JetStream publish with acks, or core NATS + flush.

Keys, headers and permanent rejections: docs/sinks.md, ``nats``."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import Field, SecretStr

from .base import (
    Event,
    EventPath,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_exception,
    import_extra,
    publish_prepared,
    redact_url,
    scrub,
    url_secrets,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient
    from nats.js import JetStreamContext

__all__ = ["NatsSink", "NatsSinkConfig"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class NatsSinkConfig(SinkConfigBase):
    """Publish each event payload (JSON) to ``subject``, or to ``subject_prefix`` + the value at event path
    ``subject_from`` (falling back to ``subject``): a payload path, or ``metadata:<path>`` for the
    event's metadata (:data:`~.base.EventPath`)."""

    type: Literal["nats"] = "nats"
    servers: list[str] = Field(default_factory=lambda: ["nats://127.0.0.1:4222"], min_length=1)
    subject: str | None = Field(default=None, min_length=1)
    subject_from: EventPath | None = None
    subject_prefix: str = ""
    jetstream: bool = True
    timeout_secs: float = Field(default=10, gt=0)
    user: str | None = None
    password: SecretStr | None = None
    token: SecretStr | None = None
    routed_names: ClassVar[tuple[str, ...]] = ("subject",)

    def secret_values(self) -> list[str]:
        return super().secret_values() + [s for server in self.servers for s in url_secrets(server)]


_BAD_SUBJECT_CHARS = frozenset(" \t\r\n*>")

#: the longest subject sent: the server's protocol line (``HPUB <subject> <reply> <sizes>``) is at most
#: ``max_control_line`` bytes (4 KiB by default) and a longer one closes the connection
_MAX_SUBJECT_BYTES = 3840

#: JetStream publish errors that refuse the message itself: message size exceeds the stream's
#: max_msg_size (10054), headers exceed 64 KiB (10097)
_REJECTING_ERR_CODES = frozenset({10054, 10097})

#: "NATS/1.0\r\n" before the header lines and "\r\n" after them (nats-py's encoding)
_HEADER_FRAMING_BYTES = 12


def _message_bytes(data: bytes, headers: dict[str, str]) -> int:
    """The size the server compares with its ``max_payload``: payload and encoded headers."""
    lines = sum(len(key.encode()) + len(value.strip().encode()) + 4 for key, value in headers.items())  # ": ", CRLF
    return len(data) + _HEADER_FRAMING_BYTES + lines


class NatsSink(Sink, builds=NatsSinkConfig):
    """Connects on first publish. nats-py is asyncio-only while sinks are called synchronously (also from a
    thread that runs an event loop): a private loop in a daemon thread keeps the connection's pings and
    reconnects alive between calls, and stops on :meth:`close`."""

    config: NatsSinkConfig

    def __init__(self, config: NatsSinkConfig) -> None:
        super().__init__(config)
        self._nats = import_extra("nats", "nats", "nats-py", "nats", "nats.errors", "nats.js.errors")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._connecting = False
        self._last_error: Exception | None = None
        self._target = ", ".join(redact_url(server) for server in config.servers)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name=f"pgstream-nats-sink-{id(self):x}",
                                            daemon=True)
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def publish(self, events: Sequence[Event]) -> None:
        publish_prepared(events, self._subject_of, lambda sent, subjects: self._run(self._publish(sent, subjects)))

    def _subject_of(self, event: Event) -> tuple[str, bool]:
        """The subject of ``event`` and whether it came from the event."""
        config = self.config
        subject, from_event = self._destination(event, "no subject", config.subject, config.subject_from,
                                                config.subject_prefix)
        if (_BAD_SUBJECT_CHARS.intersection(subject) or subject.startswith(".") or subject.endswith(".")
                or ".." in subject):
            # from the event: the event's fault; the fixed subject: the configuration's
            raise self._error([event], f"invalid subject {subject[:200]!r} (whitespace, wildcard or empty token)",
                              permanent=from_event)
        if len(subject.encode()) > _MAX_SUBJECT_BYTES:
            raise self._error([event], f"subject {subject[:100]!r}... is {len(subject.encode())} bytes, more than "
                                       f"{_MAX_SUBJECT_BYTES}", permanent=from_event)
        return subject, from_event

    async def _publish(self, events: Sequence[Event], subjects: Sequence[tuple[str, bool]]) -> None:
        errors = (self._nats.errors.Error, self._nats.js.errors.Error, OSError, asyncio.TimeoutError)
        try:
            nc = await self._connected()
        except errors as exc:
            if isinstance(exc, asyncio.TimeoutError):
                last = f"; last error: {describe_exception(self._last_error)}" if self._last_error else ""
                reason = f"cannot connect to NATS ({self._target}) within {self.config.timeout_secs:g}s{last}"
            else:
                reason = f"cannot connect to NATS ({self._target}): {describe_exception(exc)}"
            raise self._error(events, reason) from None
        timeout = self.config.timeout_secs
        rejection: SinkError | None = None
        sent = 0
        for event, (subject, from_event) in zip(events, subjects, strict=True):
            headers = {"Nats-Msg-Id": str(event.id), "Pgstream-Event-Id": str(event.id),
                       "Pgstream-Stream-Id": str(event.stream_id), "Content-Type": "application/json"}
            if event.metadata_json is not None:
                headers["Pgstream-Metadata"] = event.metadata_json
            data = event.payload_json.encode()
            size, max_payload = _message_bytes(data, headers), nc.max_payload
            if size > max_payload:  # the server would close the connection: refuse it here
                reason = (f"not sent to {subject!r}: the message is {size} bytes with its headers, more than the "
                          f"server's max_payload ({max_payload}) at {self._target}")
                rejection = self._error([event], reason, permanent=True)
                break
            try:
                if self._js is not None:
                    await self._js.publish(subject, data, timeout=timeout, headers=headers)
                else:
                    await nc.publish(subject, data, headers=headers)
            except self._nats.js.errors.NoStreamResponseError:
                # a subject from the event (the events before it were acknowledged): the event's route
                reason = f"no JetStream stream captures subject {subject!r}" + (
                    " (taken from the event)" if from_event else "")
                raise self._error([event], reason, permanent=from_event) from None
            except self._nats.errors.MaxPayloadError:
                reason = f"not sent to {subject!r}: larger than the server's max_payload at {self._target}"
                rejection = self._error([event], reason, permanent=True)
                break
            except errors as exc:
                reason = f"publish to {subject!r} at {self._target} failed: {describe_exception(exc)}"
                permanent = isinstance(exc, self._nats.js.errors.APIError) and exc.err_code in _REJECTING_ERR_CODES
                raise self._error([event], reason, permanent=permanent) from None
            sent += 1
        if self._js is None and sent:
            try:
                await nc.flush(timeout=timeout)  # type: ignore[arg-type]  # annotated int, a float works (wait_for)
            except errors as exc:
                reason = f"flush after publish at {self._target} failed: {describe_exception(exc)}"
                raise self._error(events[:sent], reason) from None
        if rejection is not None:
            raise rejection

    async def _connected(self) -> NatsClient:
        if self._nc is not None and not self._nc.is_closed:
            return self._nc
        self._nc = self._js = None
        config = self.config
        options: dict[str, Any] = {"servers": list(config.servers), "name": "pgstream-dagster",
                                   "connect_timeout": config.timeout_secs, "error_cb": self._on_error,
                                   "disconnected_cb": _log_disconnected}
        if config.user is not None:
            options["user"] = config.user
        options.update({key: secret.get_secret_value() for key, secret in
                        (("password", config.password), ("token", config.token)) if secret is not None})
        # nats-py keeps retrying the initial connection; bound it by the configured timeout.
        self._connecting, self._last_error = True, None
        try:
            nc: NatsClient = await asyncio.wait_for(self._nats.connect(**options), timeout=self.config.timeout_secs)
        finally:
            self._connecting = False
        self._nc = nc
        if self.config.jetstream:
            self._js = nc.jetstream(timeout=self.config.timeout_secs)
        return nc

    async def _on_error(self, exc: Exception) -> None:
        self._last_error = exc
        # failed attempts of the initial connect end up in the SinkError; later errors are worth a warning
        log.log(logging.DEBUG if self._connecting else logging.WARNING, "NATS client error: %s",
                scrub(describe_exception(exc), self.config.secret_values()))

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if self._nc is not None:
                self._run(self._close_connection())
        finally:
            self._loop = self._thread = None
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=self.config.timeout_secs)
            if not loop.is_running():
                loop.close()

    async def _close_connection(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), timeout=self.config.timeout_secs)
            except Exception as exc:  # best effort: the connection may already be broken
                log.debug("closing NATS connection failed: %s", describe_exception(exc))


async def _log_disconnected() -> None:
    log.info("NATS client disconnected")
