"""HTTP / webhook sink (httpx + tenacity): signed, retried, concurrent per routing key, order kept per key.

Requests carry the Standard Webhooks headers (``webhook-id``, ``webhook-timestamp`` and, with a signing
secret, ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``). Each request is
retried with exponential backoff and jitter on connection errors, timeouts, 5xx and 429, honouring
``Retry-After`` on 429/503, within a bounded budget (attempts and seconds); other 4xx fail at once.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import Field, SecretStr, field_validator
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential_jitter,
)

from .base import (
    Event,
    PayloadPath,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_events,
    describe_exception,
    dumps,
    excerpt,
    header_value,
    lookup_path,
    redact_url,
    scrub,
)

__all__ = ["HttpSink", "HttpSinkConfig", "decode_signing_secret", "sign"]

log = logging.getLogger(__name__)

_RETRY_AFTER_STATUSES = frozenset({429, 503})


class _RedactUrls(logging.Filter):
    """httpx logs each request's full URL at INFO; show it as :func:`redact_url` does (no user info, query
    string or fragment, path tokens masked)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_url(str(a)) if isinstance(a, httpx.URL) else a for a in record.args)
        return True


_httpx_log = logging.getLogger("httpx")
if not any(isinstance(f, _RedactUrls) for f in _httpx_log.filters):
    _httpx_log.addFilter(_RedactUrls())
_SECRET_PREFIX = "whsec_"


def decode_signing_secret(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret ``whsec_<base64>`` (the prefix is optional)."""
    text = secret.strip()
    if text.startswith(_SECRET_PREFIX):
        text = text[len(_SECRET_PREFIX) :]
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("signing_secret must be 'whsec_' followed by base64 (Standard Webhooks)") from None
    if len(key) < 16:
        raise ValueError("signing_secret is too short: use at least 16 random bytes (24 to 64 recommended)")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks signature header value: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


class HttpSinkConfig(SinkConfigBase):
    """POST events to ``url`` (``type: http``, alias ``webhook``).

    ``per_event``: one request per event; the body is the payload (``body: event``: the whole event with
    id, stream_id, created_at, payload, metadata). ``batch``: a JSON array of up to ``max_batch_size``
    of those, header ``X-Pgstream-Event-Ids``. The event id is the idempotency key: headers
    ``webhook-id``, ``Idempotency-Key`` and ``X-Pgstream-Event-Id`` (a batch uses ``<first>-<last>``).
    Any 2xx confirms. ``url`` (tokens in query strings or the path), ``headers`` values and
    ``signing_secret`` are secrets; messages show the URL without user info and query string, and with
    its path masked from the first segment that is not a short lower-case word (:func:`redact_url`).
    Header names must be HTTP tokens; header values (and the URL) lose trailing whitespace such as
    the line break of a file-mounted secret, and are refused when a control character (CR, LF...)
    or, for header values, a non-ASCII character remains: the error names the header, never the value.

    ``routing_key``: a payload path; events with the same key are sent one after another in order,
    different keys in parallel up to ``max_concurrency``. Without it every event is sent in order.
    Each request: at most ``max_attempts`` attempts within ``max_retry_secs`` (plus one request
    timeout); ``timeout_secs`` bounds each network operation (connect, write, read).
    """

    type: Literal["http", "webhook"] = "http"
    url: SecretStr
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    signing_secret: SecretStr | None = None
    mode: Literal["per_event", "batch"] = "per_event"
    max_batch_size: int = Field(default=500, ge=1)
    body: Literal["payload", "event"] = "payload"
    routing_key: PayloadPath | None = None
    max_concurrency: int = Field(default=4, ge=1, le=256)
    timeout_secs: float = Field(default=10, gt=0)
    max_attempts: int = Field(default=6, ge=1)
    max_retry_secs: float = Field(default=60, ge=0)
    initial_backoff_secs: float = Field(default=0.5, ge=0)
    max_backoff_secs: float = Field(default=30, ge=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: SecretStr) -> SecretStr:
        text = url.get_secret_value().strip()  # a file-mounted secret often ends in a line break
        if any(char < " " or char == "\x7f" for char in text):
            raise ValueError("url contains a line break or another control character")
        if urlsplit(text).scheme not in ("http", "https"):
            raise ValueError("url must start with http:// or https://")
        return SecretStr(text)

    @field_validator("headers")
    @classmethod
    def _valid_headers(cls, headers: dict[str, SecretStr]) -> dict[str, SecretStr]:
        return {name: SecretStr(header_value(name, value.get_secret_value())) for name, value in headers.items()}

    @field_validator("signing_secret")
    @classmethod
    def _valid_secret(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None:
            decode_signing_secret(secret.get_secret_value())
        return secret

    def build(self) -> HttpSink:
        return HttpSink(self)


class _Failure(Exception):
    """One attempt failed: ``reason`` is safe to show; ``retryable`` decides whether tenacity retries."""

    def __init__(self, reason: str, *, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.retry_after = retry_after


@dataclass
class _Request:
    events: Sequence[Event]
    msg_id: str
    body: bytes
    headers: dict[str, str]


@dataclass
class _LaneResult:
    confirmed: int = 0
    failed: Sequence[Event] = ()
    reason: str = ""
    secondary: bool = False  # failed only because another lane's failure aborted it


class HttpSink(Sink):
    """A shared ``httpx.Client`` (keep-alive, one connection per lane) and a thread pool for the lanes."""

    type_name: ClassVar[str] = "http"
    config: HttpSinkConfig

    def __init__(self, config: HttpSinkConfig) -> None:
        super().__init__(config)
        self._client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        url = config.url.get_secret_value()
        self._secrets = config.secret_values()
        self._target = f"POST {redact_url(url)}"
        secret = config.signing_secret
        self._key = decode_signing_secret(secret.get_secret_value()) if secret is not None else None
        self._backoff = wait_exponential_jitter(
            initial=config.initial_backoff_secs, max=config.max_backoff_secs, jitter=config.initial_backoff_secs
        )

    # -- publishing --------------------------------------------------------------------------------------

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        lanes = self._lanes(events)
        abort = threading.Event()
        if len(lanes) == 1 or self.config.max_concurrency == 1:
            results = [self._send_lane(lane, abort) for lane in lanes]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="pgstream-http")
            futures = [self._pool.submit(self._send_lane, lane, abort) for lane in lanes]
            results = [future.result() for future in futures]
        failures = [r for r in results if r.failed]
        if failures:
            raise self._summarize(events, failures, sum(r.confirmed for r in results))

    def _lanes(self, events: Sequence[Event]) -> list[list[_Request]]:
        """Requests grouped by routing key (first-seen key order), each group in event order."""
        path = self.config.routing_key
        groups: dict[str, list[Event]] = {}
        if path is None or self.config.max_concurrency == 1:
            groups[""] = list(events)
        else:
            for event in events:
                groups.setdefault(dumps(lookup_path(event.payload, path)), []).append(event)
        size = 1 if self.config.mode == "per_event" else self.config.max_batch_size
        return [
            [self._request(group[start : start + size]) for start in range(0, len(group), size)]
            for group in groups.values()
        ]

    def _request(self, events: Sequence[Event]) -> _Request:
        def body_of(event: Event) -> str:  # JSON text, the payload as read from Postgres
            return event.payload_json if self.config.body == "payload" else event.to_json()

        headers = {name: value.get_secret_value() for name, value in self.config.headers.items()}
        headers["Content-Type"] = "application/json"
        if self.config.mode == "per_event":
            event = events[0]
            msg_id = str(event.id)
            body = body_of(event)
            headers["X-Pgstream-Event-Id"] = msg_id
            headers["X-Pgstream-Stream-Id"] = str(event.stream_id)
        else:
            msg_id = str(events[0].id) if len(events) == 1 else f"{events[0].id}-{events[-1].id}"
            body = "[" + ",".join(body_of(event) for event in events) + "]"
            headers["X-Pgstream-Event-Ids"] = ",".join(str(event.id) for event in events)
            headers["X-Pgstream-Stream-Id"] = str(events[0].stream_id)
        headers["Idempotency-Key"] = msg_id
        headers["webhook-id"] = msg_id
        return _Request(events, msg_id, body.encode(), headers)

    def _send_lane(self, lane: list[_Request], abort: threading.Event) -> _LaneResult:
        """Send a lane's requests in order; stop at the first failure (or when another lane failed)."""
        result = _LaneResult()
        for request in lane:
            if abort.is_set():
                break
            try:
                self._send(request, abort)
            except _Failure as exc:
                result.secondary = abort.is_set()
                abort.set()
                result.failed, result.reason = request.events, exc.reason
                break
            result.confirmed += len(request.events)
        return result

    def _send(self, request: _Request, abort: threading.Event) -> None:
        """One request with retries; raises :class:`_Failure` (with a full reason) when it is not confirmed."""
        config = self.config
        started = time.monotonic()
        attempts = 0
        retrying = Retrying(
            stop=(
                stop_after_attempt(config.max_attempts)
                | stop_before_delay(config.max_retry_secs)
                | (lambda _state: abort.is_set())
            ),
            wait=self._wait,
            retry=retry_if_exception(lambda exc: isinstance(exc, _Failure) and exc.retryable),
            sleep=abort.wait,
            before_sleep=self._log_retry(request),
            reraise=True,
        )
        last: _Failure | None = None
        try:
            for attempt in retrying:
                with attempt:
                    if last is not None and abort.is_set():
                        raise last  # woken from the backoff sleep because another lane failed: stop now
                    attempts += 1
                    try:
                        self._attempt(request)
                    except _Failure as exc:
                        last = exc
                        raise
        except _Failure as exc:
            elapsed = time.monotonic() - started
            reason = exc.reason
            if exc.retryable:
                reason += f" (gave up after {attempts} attempt{'s' if attempts > 1 else ''} in {elapsed:.1f}s"
                if exc.retry_after is not None and elapsed + exc.retry_after >= config.max_retry_secs:
                    reason += f"; Retry-After {exc.retry_after:g}s is beyond the {config.max_retry_secs:g}s budget"
                elif abort.is_set() and attempts < config.max_attempts:
                    reason += "; another routing key failed"
                reason += ")"
            raise _Failure(reason, retryable=False) from None

    def _attempt(self, request: _Request) -> None:
        headers = dict(request.headers)
        timestamp = int(time.time())
        headers["webhook-timestamp"] = str(timestamp)
        if self._key is not None:
            headers["webhook-signature"] = sign(self._key, request.msg_id, timestamp, request.body)
        secrets = self._secrets
        try:
            response = self._http().post(self.config.url.get_secret_value(), content=request.body, headers=headers)
        except httpx.TimeoutException as exc:
            reason = f"{self._target} timed out after {self.config.timeout_secs:g}s ({type(exc).__name__})"
            raise _Failure(reason, retryable=True) from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            reason = f"{self._target} connection failed: {describe_exception(exc, secrets)}"
            raise _Failure(reason, retryable=True) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise _Failure(f"{self._target} failed: {describe_exception(exc, secrets)}", retryable=False) from None
        except UnicodeEncodeError:
            # httpx encodes header values as ASCII; the config refuses others, this guards unvalidated ones
            # (model_construct): the exception carries the whole value, so none of it is shown
            names = [name for name, value in headers.items() if not value.isascii()]
            what = f"header {names[0]!r} has a non-ASCII value" if names else "a non-ASCII header or URL"
            raise _Failure(f"{self._target} not sent: {what}", retryable=False) from None
        status = response.status_code
        if response.is_success:
            return
        reason = f"{self._target} answered HTTP {status} {response.reason_phrase}"
        body_excerpt = excerpt(scrub(response.text, self._secrets))  # scrub first: never cut a secret in half
        if body_excerpt:
            reason += f": {body_excerpt}"
        retry_after = _retry_after(response.headers.get("Retry-After")) if status in _RETRY_AFTER_STATUSES else None
        raise _Failure(reason, retryable=status >= 500 or status == 429, retry_after=retry_after)

    def _wait(self, state: RetryCallState) -> float:
        """``Retry-After`` when the server sent one, else exponential backoff with jitter."""
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, _Failure) and exc.retry_after is not None:
            return exc.retry_after
        return self._backoff(state)

    def _log_retry(self, request: _Request) -> Callable[[RetryCallState], None]:
        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            reason = exc.reason if isinstance(exc, _Failure) else describe_exception(exc, self._secrets) if exc else "?"
            log.warning(
                "%s",
                scrub(
                    f"http sink: {describe_events(request.events)}: attempt {state.attempt_number} failed: "
                    f"{reason}; retrying in {state.upcoming_sleep:.2f}s",
                    self._secrets,
                ),
            )

        return before_sleep

    def _summarize(self, events: Sequence[Event], failures: list[_LaneResult], confirmed: int) -> SinkError:
        failures = sorted(failures, key=lambda r: r.secondary)  # stable: root causes first, in lane order
        failed = [e for r in failures for e in r.failed]
        first = failures[0]
        unconfirmed = len(events) - confirmed
        reason = first.reason
        others = sum(1 for r in failures[1:] if not r.secondary)
        if others:
            reason += f"; {others} more routing key(s) failed"
        if unconfirmed > len(first.failed):
            reason += f"; {unconfirmed} of {len(events)} events not confirmed"
        message = scrub(f"http sink: {describe_events(first.failed)}: {reason}", self._secrets)
        return SinkError(message, sink="http", event_ids=[e.id for e in failed])

    def _http(self) -> httpx.Client:
        if self._client is None:
            size = self.config.max_concurrency
            self._client = httpx.Client(
                timeout=self.config.timeout_secs,
                follow_redirects=False,
                limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
            )
        return self._client

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delay seconds or an HTTP date); ``None`` if absent/bad."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())
