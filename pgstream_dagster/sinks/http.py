"""HTTP sink: POSTs event payloads as JSON with httpx, one request per event or per batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import Field, SecretStr

from .base import Event, Sink, SinkConfigBase, SinkError, describe_exception, dumps, excerpt, redact_url

__all__ = ["HttpSink", "HttpSinkConfig"]


class HttpSinkConfig(SinkConfigBase):
    """POST to ``url``.

    ``per_event``: the body is the event payload; headers ``Idempotency-Key: <stream_id>-<event id>``,
    ``X-Pgstream-Event-Id`` and ``X-Pgstream-Stream-Id``.
    ``batch``: the body is a JSON array of up to ``max_batch_size`` payloads; header
    ``X-Pgstream-Event-Ids: <comma separated ids>``.
    Any 2xx answer confirms. ``headers`` values are secrets (e.g. ``Authorization``).
    """

    type: Literal["http"] = "http"
    url: str
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    timeout_secs: float = Field(default=10, gt=0)
    mode: Literal["per_event", "batch"] = "per_event"
    max_batch_size: int = Field(default=500, ge=1)

    def build(self) -> HttpSink:
        return HttpSink(self)


class HttpSink(Sink):
    """Delivers with a synchronous ``httpx.Client`` kept open (keep-alive) across publish calls."""

    type_name: ClassVar[str] = "http"
    config: HttpSinkConfig

    def __init__(self, config: HttpSinkConfig) -> None:
        super().__init__(config)
        self._client: httpx.Client | None = None
        self._secrets = config.secret_values() + _url_secrets(config.url)
        self._target = redact_url(config.url)

    def _http(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(timeout=self.config.timeout_secs, follow_redirects=False)
        return self._client

    def publish(self, events: Sequence[Event]) -> None:
        if self.config.mode == "per_event":
            for event in events:
                self._post(
                    [event],
                    dumps(event.payload),
                    {
                        "Idempotency-Key": f"{event.stream_id}-{event.id}",
                        "X-Pgstream-Event-Id": str(event.id),
                        "X-Pgstream-Stream-Id": str(event.stream_id),
                    },
                )
        else:
            size = self.config.max_batch_size
            for start in range(0, len(events), size):
                chunk = events[start : start + size]
                self._post(
                    chunk,
                    dumps([event.payload for event in chunk]),
                    {"X-Pgstream-Event-Ids": ",".join(str(event.id) for event in chunk)},
                )

    def _post(self, events: Sequence[Event], body: str, extra_headers: dict[str, str]) -> None:
        headers = {name: value.get_secret_value() for name, value in self.config.headers.items()}
        headers["Content-Type"] = "application/json"
        headers.update(extra_headers)
        target = f"POST {self._target}"
        try:
            response = self._http().post(self.config.url, content=body.encode(), headers=headers)
        except httpx.TimeoutException as exc:
            reason = f"{target} timed out after {self.config.timeout_secs:g}s ({type(exc).__name__})"
            raise self._error(events, reason) from None
        except httpx.ConnectError as exc:
            raise self._error(events, f"{target} connection failed: {describe_exception(exc)}") from None
        except httpx.HTTPError as exc:
            raise self._error(events, f"{target} failed: {describe_exception(exc)}") from None
        if not response.is_success:
            reason = f"{target} answered HTTP {response.status_code} {response.reason_phrase}"
            body_excerpt = excerpt(response.text)
            raise self._error(events, f"{reason}: {body_excerpt}" if body_excerpt else reason)

    def _error(self, events: Sequence[Event], reason: str) -> SinkError:
        return SinkError.for_events("http", events, reason, self._secrets)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _url_secrets(url: str) -> list[str]:
    """Password and query string of ``url`` (kept out of messages)."""
    try:
        parts = urlsplit(url)
        return [s for s in (parts.password, parts.query) if s]
    except ValueError:
        return []
