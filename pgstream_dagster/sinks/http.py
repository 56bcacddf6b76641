"""HTTP / webhook sink (httpx + tenacity): signed, retried, concurrent per routing key, order kept per key.

Keys, headers, retries and permanent rejections: docs/sinks.md, ``http``."""

from __future__ import annotations

import base64
import binascii
import email.utils
import functools
import hashlib
import hmac
import logging
import random
import re
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, stop_before_delay

from .base import (
    Event,
    EventPath,
    RoutingError,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_events,
    describe_exception,
    describe_path,
    dumps,
    event_scalar,
    excerpt,
    header_value,
    lookup_event,
    publish_prepared,
    redact_url,
    scrub,
)

if TYPE_CHECKING:
    # imported where a request is made (HttpSink._http): loading a code location or a run does not import it
    import httpx

__all__ = ["HttpSink", "HttpSinkConfig", "decode_signing_secret", "sign"]

log = logging.getLogger(__name__)

_RETRY_AFTER_STATUSES = frozenset({429, 503})

#: 4xx answers that are retried: the request took too long (408), too many requests (429)
_RETRY_4XX = frozenset({408, 429})

#: 4xx answers about the configuration, not about the request's content (they would reject every event):
#: not permanent rejections (docs/sinks.md says which is which)
_CONFIG_4XX = frozenset({401, 403, 404, 405, 407, 410, 415, 421, 426, 431})

#: of those, the ones about a part of the request taken from the event when there is one (a ``path_from``
#: segment: 404, 410; ``headers_from`` headers: 431): then they are the event's, a permanent rejection
_SEGMENT_4XX = frozenset({404, 410})
_HEADERS_4XX = frozenset({431})

#: a URL path segment taken from an event (``path_from``): RFC 3986 unreserved characters only, so it
#: needs no escaping and can neither add a segment ("/"), a query ("?") or a fragment ("#"), nor be
#: "." or ".." (a step up the path)
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9._~-]{1,255}")

#: headers the sink sets itself or that frame the request: ``headers_from`` may not set them
_OWN_HEADERS = frozenset({
    "content-type", "content-length", "transfer-encoding", "content-encoding", "host", "connection",
    "keep-alive", "te", "trailer", "upgrade", "expect", "proxy-authorization", "proxy-connection",
    "idempotency-key", "webhook-id", "webhook-timestamp", "webhook-signature", "x-pgstream-event-id",
    "x-pgstream-event-ids", "x-pgstream-stream-id",
})

#: request URLs (and their redacted form) kept per path segment, the most recent ones (a segment per tenant
#: must not grow it without bound)
_URL_CACHE = 1024


def _valid_segment(segment: str) -> bool:
    return _PATH_SEGMENT.fullmatch(segment) is not None and segment not in (".", "..")


class _RedactUrls(logging.Filter):
    """httpx logs each request's full URL at INFO; show it as :func:`redact_url` does (no user info, query
    string or fragment, path tokens masked)."""

    def filter(self, record: logging.LogRecord) -> bool:
        import httpx  # a record of httpx's logger: httpx is loaded

        if isinstance(record.args, tuple):
            record.args = tuple(redact_url(str(a)) if isinstance(a, httpx.URL) else a for a in record.args)
        return True


_httpx_log = logging.getLogger("httpx")
if not any(isinstance(f, _RedactUrls) for f in _httpx_log.filters):
    _httpx_log.addFilter(_RedactUrls())


def decode_signing_secret(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret ``whsec_<base64>`` (the prefix is optional)."""
    text = secret.strip().removeprefix("whsec_")
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
    """POST events to ``url`` (``type: http``, alias ``webhook``)."""

    type: Literal["http", "webhook"] = "http"
    url: SecretStr
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    signing_secret: SecretStr | None = None
    mode: Literal["per_event", "batch"] = "per_event"
    max_batch_size: int = Field(default=500, ge=1)
    body: Literal["payload", "event"] = "payload"
    routing_key: EventPath | None = None
    path_from: EventPath | None = None
    path_default: str | None = None
    headers_from: dict[str, EventPath] = Field(default_factory=dict)
    max_concurrency: int = Field(default=4, ge=1, le=256)
    timeout_secs: float = Field(default=10, gt=0)
    max_attempts: int = Field(default=6, ge=1)
    max_retry_secs: float = Field(default=60, ge=0)
    first_retry_secs: float = Field(default=0, ge=0)
    initial_backoff_secs: float = Field(default=0.1, ge=0)
    max_backoff_secs: float = Field(default=30, ge=0)
    max_body_bytes: int | None = Field(default=None, ge=1)
    max_header_value_bytes: int = Field(default=4096, ge=1, le=65536)

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

    @field_validator("path_default")
    @classmethod
    def _valid_path_default(cls, segment: str | None) -> str | None:
        if segment is not None and not _valid_segment(segment):
            raise ValueError("path_default must be one URL path segment: letters, digits and . _ ~ - "
                             "(not . or ..)")
        return segment

    @model_validator(mode="after")
    def _valid_headers_from(self) -> HttpSinkConfig:
        static = {name.lower() for name in self.headers}
        for name in self.headers_from:
            header_value(name, "")  # the name must be an HTTP token
            if name.lower() in _OWN_HEADERS:
                raise ValueError(f"headers_from: header {name!r} is set by the sink or frames the request")
            if name.lower() in static:
                raise ValueError(f"headers_from: header {name!r} is also in headers")
        if self.path_default is not None and self.path_from is None:
            raise ValueError("path_default needs path_from (it is the segment for events without one)")
        return self

    @field_validator("signing_secret")
    @classmethod
    def _valid_secret(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None:
            decode_signing_secret(secret.get_secret_value())
        return secret


#: one event of a publish call: its position in the call, the event, its route
_Item = tuple[int, Event, "_Route"]


class _Failure(Exception):
    """One attempt failed: ``reason`` is safe to show; ``retryable`` decides whether tenacity retries;
    ``permanent``: the receiver refused this request's content (never retried)."""

    def __init__(self, reason: str, *, retryable: bool, retry_after: float | None = None,
                 permanent: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.retry_after = retry_after
        self.permanent = permanent


@dataclass(frozen=True)
class _Route:
    """Where one event goes: the URL's extra path segment and the headers taken from the event, and
    its lane (the JSON text of its ``routing_key`` value)."""

    segment: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    segment_from_event: bool = False  # the segment is the event's (not ``path_default``)
    lane: str = ""


@dataclass
class _Request:
    events: Sequence[Event]
    msg_id: str
    body: bytes
    headers: dict[str, str]
    start: int  # position in the publish call of the request's first event
    url: str  # secret: the configured URL, plus the event's path segment
    target: str  # "POST <url>" for messages (redact_url)
    event_statuses: frozenset[int] = frozenset()  # config-class statuses that are about the event's own route


@dataclass
class _LaneResult:
    confirmed: list[int] = field(default_factory=list)  # positions in the call of the confirmed events
    failed: Sequence[Event] = ()
    start: int = 0  # position of the failed request
    reason: str = ""
    permanent: bool = False  # the failed request was refused for its content
    secondary: bool = False  # failed only because another lane's failure stopped it


class _Control:
    """Shared by the lanes of one publish call. A failure that is not a permanent rejection stops every
    lane; a permanent rejection at position ``p`` stops only the requests that start after ``p``, so
    that every event before the rejected one is still sent (and confirmed, or the publish is not a
    permanent rejection)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._aborted = False
        self._limit: int | None = None

    def stops(self, start: int) -> bool:
        """Whether a request starting at ``start`` must not be sent (or retried)."""
        return self._aborted or (self._limit is not None and start > self._limit)

    def failed(self, start: int, permanent: bool) -> None:
        with self._cond:
            if permanent:
                self._limit = start if self._limit is None else min(self._limit, start)
            else:
                self._aborted = True
            self._cond.notify_all()

    def sleep(self, start: int, secs: float) -> None:
        """tenacity's sleep for a request at ``start``: wakes early when the request must stop."""
        with self._cond:
            self._cond.wait_for(lambda: self.stops(start), timeout=secs)


class HttpSink(Sink, builds=HttpSinkConfig):
    """A shared ``httpx.Client`` (keep-alive, one connection per lane) and a thread pool for the lanes."""

    config: HttpSinkConfig

    def max_event_bytes(self) -> int | None:
        return self.config.max_body_bytes  # a body holds the payload at least

    def __init__(self, config: HttpSinkConfig) -> None:
        super().__init__(config)
        self._client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._secrets = config.secret_values()
        self._routed = config.path_from is not None or bool(config.headers_from)
        # events are read before sending (their route, their lane): a content Python cannot parse is then
        # a permanent rejection of that event, found before anything after it is sent
        self._prepared = self._routed or (config.routing_key is not None and config.max_concurrency > 1)
        self._url = functools.lru_cache(maxsize=_URL_CACHE)(self._url_of)
        secret = config.signing_secret
        self._key = decode_signing_secret(secret.get_secret_value()) if secret is not None else None

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        if self._prepared:  # every event's route first: a rejected one is sent after those before it
            publish_prepared(events, self._route, self._publish)
        else:
            self._publish(events, [_Route()] * len(events))

    def _route(self, event: Event) -> _Route:
        """The path segment and headers ``event`` is sent with; a permanent :class:`SinkError` when they
        cannot be sent. Messages name the event path and the header, never the value."""
        config = self.config
        try:
            segment: str | None = None
            from_event = False
            if config.path_from is not None:
                segment = event_scalar(event, config.path_from)
                from_event = segment is not None
                if segment is None:
                    if config.path_default is None:
                        raise RoutingError(f"{describe_path(config.path_from)} is missing or empty and there is "
                                           "no path_default")
                    segment = config.path_default
                elif not _valid_segment(segment):
                    raise RoutingError(f"path_from: the value at {describe_path(config.path_from)} is not one URL "
                                       "path segment (letters, digits and . _ ~ - only, not . or .., at most 255)")
            headers: list[tuple[str, str]] = []
            limit = config.max_header_value_bytes
            for name, path in config.headers_from.items():
                value = event_scalar(event, path)
                if value is not None:
                    try:
                        cleaned = header_value(name, value)
                    except ValueError as exc:
                        raise RoutingError(f"headers_from: {exc} (from {describe_path(path)})") from None
                    if len(cleaned) > limit:  # ASCII: characters are bytes
                        raise RoutingError(f"headers_from: header {name!r} would be {len(cleaned)} bytes, more "
                                           f"than max_header_value_bytes ({limit}) (from {describe_path(path)})")
                    headers.append((name, cleaned))
            lane = ""
            if config.routing_key is not None and config.max_concurrency > 1:
                lane = dumps(lookup_event(event, config.routing_key))
        except RoutingError as exc:
            raise self._error([event], f"{self._url(None)[1]} not sent: {exc}", permanent=True) from None
        return _Route(segment, tuple(headers), from_event, lane)

    def _url_of(self, segment: str | None) -> tuple[str, str]:
        """(URL, ``POST <redacted URL>``) of a request to the configured URL plus ``segment`` (cached: ``_url``)."""
        url = self.config.url.get_secret_value()
        if segment is not None:
            parts = urlsplit(url)
            url = urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + segment))
        return url, f"POST {redact_url(url)}"

    def _publish(self, events: Sequence[Event], routes: Sequence[_Route]) -> None:
        lanes = self._lanes(events, routes)
        control = _Control()
        if len(lanes) == 1:
            results = [self._send_lane(lane, control) for lane in lanes]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="pgstream-http")
            futures = [self._pool.submit(self._send_lane, lane, control) for lane in lanes]
            results = [future.result() for future in futures]
        failures = [r for r in results if r.failed]
        if failures:
            raise self._summarize(events, failures, [p for r in results for p in r.confirmed])

    def _lanes(self, events: Sequence[Event], routes: Sequence[_Route]) -> list[list[_Request]]:
        """Requests grouped by routing key (first-seen key order), each group in event order."""
        groups: dict[str, list[_Item]] = {}
        for item in zip(range(len(events)), events, routes, strict=True):
            groups.setdefault(item[2].lane, []).append(item)  # every lane "" without routing_key
        return [[self._request(chunk) for chunk in self._chunks(group)] for group in groups.values()]

    def _body_of(self, event: Event) -> str:
        """The JSON text of one event in a body: the payload as read from Postgres, or the whole event."""
        return event.payload_json if self.config.body == "payload" else event.to_json()

    def _chunks(self, group: list[_Item]) -> list[list[_Item]]:
        """A lane's events cut into requests: one event each (``per_event``), else up to ``max_batch_size``
        consecutive events with the same route whose JSON array stays within ``max_body_bytes`` (an event
        too large alone is a request of its own, refused when it is sent)."""
        if self.config.mode == "per_event":
            return [[item] for item in group]
        size, limit = self.config.max_batch_size, self.config.max_body_bytes
        if limit is None and not self._routed:
            return [group[start : start + size] for start in range(0, len(group), size)]
        chunks: list[list[_Item]] = []
        chunk: list[_Item] = []
        used = 2  # "[" and "]"
        for item in group:
            length = len(self._body_of(item[1]).encode()) + (1 if chunk else 0) if limit is not None else 0
            if chunk and (len(chunk) >= size or (limit is not None and used + length > limit)
                          or item[2] != chunk[-1][2]):
                chunks.append(chunk)
                chunk, used, length = [], 2, max(length - 1, 0)
            chunk.append(item)
            used += length
        if chunk:
            chunks.append(chunk)
        return chunks

    def _request(self, items: Sequence[_Item]) -> _Request:
        events = [event for _position, event, _route in items]
        route = items[0][2]
        headers = {name: value.get_secret_value() for name, value in self.config.headers.items()}
        headers.update(route.headers)
        headers["Content-Type"] = "application/json"
        msg_id = str(events[0].id) if len(events) == 1 else f"{events[0].id}-{events[-1].id}"
        if self.config.mode == "per_event":
            body = self._body_of(events[0])
            headers["X-Pgstream-Event-Id"] = msg_id
        else:
            body = "[" + ",".join(map(self._body_of, events)) + "]"
            headers["X-Pgstream-Event-Ids"] = ",".join(str(event.id) for event in events)
        headers["X-Pgstream-Stream-Id"] = str(events[0].stream_id)
        headers["Idempotency-Key"] = msg_id
        headers["webhook-id"] = msg_id
        url, target = self._url(route.segment)
        # a 404/410 on the event's own path segment, a 431 on headers carrying the event's values: the event's
        statuses = (_SEGMENT_4XX if route.segment_from_event else frozenset()) | (
            _HEADERS_4XX if route.headers else frozenset())
        return _Request(events, msg_id, body.encode(), headers, items[0][0], url, target, statuses)

    def _send_lane(self, lane: list[_Request], control: _Control) -> _LaneResult:
        """Send a lane's requests in order; stop at the first failure (or when another lane's failure
        stops this lane: see :class:`_Control`)."""
        result = _LaneResult()
        for request in lane:
            if control.stops(request.start):
                break
            try:
                if self.go_on is not None and not self.go_on():
                    raise _Failure(f"{request.target} not sent: the caller can no longer record what the sink "
                                   "confirms", retryable=False)
                self._send(request, control)
            except _Failure as exc:
                result.secondary = control.stops(request.start)
                if not result.secondary:  # a lane stopped by another's failure does not stop the others
                    control.failed(request.start, exc.permanent)
                result.failed, result.start, result.reason = request.events, request.start, exc.reason
                result.permanent = exc.permanent
                break
            result.confirmed += range(request.start, request.start + len(request.events))
        return result

    def _send(self, request: _Request, control: _Control) -> None:
        """One request with retries; raises :class:`_Failure` (with a full reason) when it is not confirmed."""
        config = self.config
        limit = config.max_body_bytes
        if limit is not None and len(request.body) > limit:
            reason = (f"{request.target} not sent: the body is {len(request.body)} bytes, more than max_body_bytes "
                      f"({limit})")
            raise _Failure(reason, retryable=False, permanent=True)
        started = time.monotonic()
        attempts = 0
        retrying = Retrying(
            # tenacity types | for stop_base only; stop_any calls any callable (StopBaseT) alike
            stop=(stop_after_attempt(config.max_attempts) | stop_before_delay(config.max_retry_secs)
                  | (lambda _state: control.stops(request.start))),  # type: ignore[operator]
            wait=self._wait, retry=retry_if_exception(lambda exc: isinstance(exc, _Failure) and exc.retryable),
            sleep=functools.partial(control.sleep, request.start),
            before_sleep=functools.partial(self._log_retry, request), reraise=True)
        last: _Failure | None = None
        try:
            for attempt in retrying:
                with attempt:
                    if last is not None and control.stops(request.start):
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
                elif control.stops(request.start) and attempts < config.max_attempts:
                    reason += "; another routing key failed"
                reason += ")"
            raise _Failure(reason, retryable=False, permanent=exc.permanent) from None

    def _attempt(self, request: _Request) -> None:
        import httpx  # loaded by _http() already

        headers = dict(request.headers)
        timestamp = int(time.time())
        headers["webhook-timestamp"] = str(timestamp)
        if self._key is not None:
            headers["webhook-signature"] = sign(self._key, request.msg_id, timestamp, request.body)
        try:
            response = self._http().post(request.url, content=request.body, headers=headers)
        except httpx.TimeoutException as exc:
            reason = f"{request.target} timed out after {self.config.timeout_secs:g}s ({type(exc).__name__})"
            raise _Failure(reason, retryable=True) from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            reason = f"{request.target} connection failed: {describe_exception(exc, self._secrets)}"
            raise _Failure(reason, retryable=True) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise _Failure(f"{request.target} failed: {describe_exception(exc, self._secrets)}",
                           retryable=False) from None
        except UnicodeEncodeError:
            # httpx encodes header values as ASCII; the config refuses others, this guards unvalidated ones
            # (model_construct): the exception carries the whole value, so none of it is shown
            names = [name for name, value in headers.items() if not value.isascii()]
            what = f"header {names[0]!r} has a non-ASCII value" if names else "a non-ASCII header or URL"
            raise _Failure(f"{request.target} not sent: {what}", retryable=False) from None
        status = response.status_code
        if response.is_success:
            return
        reason = f"{request.target} answered HTTP {status} {response.reason_phrase}"
        body_excerpt = excerpt(scrub(response.text, self._secrets))  # scrub first: never cut a secret in half
        if body_excerpt:
            reason += f": {body_excerpt}"
        retry_after = _retry_after(response.headers.get("Retry-After")) if status in _RETRY_AFTER_STATUSES else None
        retryable = status >= 500 or status in _RETRY_4XX
        permanent = 400 <= status < 500 and status not in _RETRY_4XX and (
            status not in _CONFIG_4XX or status in request.event_statuses)
        if permanent and status in _CONFIG_4XX:
            reason += " (the request's path segment or headers came from the event)"
        raise _Failure(reason, retryable=retryable, retry_after=retry_after, permanent=permanent)

    def _wait(self, state: RetryCallState) -> float:
        """``Retry-After`` when the server sent one; else ``first_retry_secs`` (0: at once) before the
        first retry, so that a single transient failure costs one more request and not a backoff window
        (an ordered lane sends nothing else meanwhile); then exponential backoff with jitter from
        ``initial_backoff_secs`` (doubling, up to ``max_backoff_secs``)."""
        config = self.config
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, _Failure) and exc.retry_after is not None:
            return exc.retry_after
        if state.attempt_number <= 1:
            return min(config.first_retry_secs, config.max_backoff_secs)
        backoff: float = config.initial_backoff_secs * 2.0 ** (state.attempt_number - 2)
        return min(config.max_backoff_secs, backoff + random.uniform(0, config.initial_backoff_secs))

    def _log_retry(self, request: _Request, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        reason = exc.reason if isinstance(exc, _Failure) else describe_exception(exc, self._secrets) if exc else "?"
        log.warning("%s", scrub(f"http sink: {describe_events(request.events)}: attempt {state.attempt_number} "
                                f"failed: {reason}; retrying in {state.upcoming_sleep:.2f}s", self._secrets))

    def _summarize(self, events: Sequence[Event], failures: list[_LaneResult], confirmed: list[int]) -> SinkError:
        """The publish call's error: a permanent rejection when the earliest failed request (in call order)
        was refused for its content and every event before it was confirmed; else the root causes, in
        lane order, naming every unconfirmed request."""
        roots = [r for r in failures if not r.secondary]
        earliest = min(roots or failures, key=lambda r: r.start)
        if earliest.permanent and set(range(earliest.start)) <= set(confirmed):
            failures = [earliest] + [r for r in failures if r is not earliest]
            permanent = True
        else:
            failures = sorted(failures, key=lambda r: r.secondary)  # stable: root causes first, in lane order
            permanent = False
        first = failures[0]
        unconfirmed = len(events) - len(confirmed)
        reason = first.reason
        others = sum(1 for r in failures[1:] if not r.secondary)
        if others:
            reason += f"; {others} more routing key(s) failed"
        if unconfirmed > len(first.failed):
            reason += f"; {unconfirmed} of {len(events)} events not confirmed"
        message = scrub(f"http sink: {describe_events(first.failed)}: {reason}", self._secrets)
        failed = first.failed if permanent else [e for r in failures for e in r.failed]
        return SinkError(message, sink="http", event_ids=[e.id for e in failed], permanent=permanent)

    def _http(self) -> httpx.Client:
        import httpx

        if self._client is None:
            size = self.config.max_concurrency
            self._client = httpx.Client(timeout=self.config.timeout_secs, follow_redirects=False, verify=_tls_context(),
                                        limits=httpx.Limits(max_connections=size, max_keepalive_connections=size))
        return self._client

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        client, self._client = self._client, None
        if client is not None:
            client.close()


_tls_lock = threading.Lock()
_tls: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    """The process's TLS context for the sinks' clients (httpx's default: certifi's CAs, or ``SSL_CERT_FILE``
    / ``SSL_CERT_DIR``), built once: building one loads the CA bundle, 25 ms of CPU per sink of a reader
    group's run. An ``SSLContext`` is safe to share between threads."""
    global _tls
    with _tls_lock:
        if _tls is None:
            import httpx

            _tls = httpx.create_ssl_context()
        return _tls


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
    return max(0.0, when.timestamp() - time.time()) if when.tzinfo is not None else None
