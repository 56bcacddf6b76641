"""What the Amazon sinks (``sqs``, ``sns``, ``kinesis``; extra ``aws``, library boto3) share: the AWS
client settings, the boto3 client, and the batch loop with its per-entry failure rule.

Credentials, shared keys, batches and per-entry failures: docs/sinks.md, "Amazon"."""

from __future__ import annotations

import logging
import random
import re
import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from .base import (
    Event,
    EventPath,
    Sink,
    SinkConfigBase,
    SinkError,
    describe_events,
    excerpt,
    import_extra,
    publish_prepared,
    redact_url,
    scrub,
    url_secrets,
)

__all__ = [
    "AwsBatchSink",
    "AwsMessageConfigBase",
    "AwsMessageSink",
    "AwsSinkConfigBase",
    "EntryFailure",
    "Prepared",
]

log = logging.getLogger(__name__)

#: words of a configuration key that would hold a credential: AWS credentials come from the standard chain
_CREDENTIAL_WORDS = ("access_key", "accesskey", "secret", "session_token", "sessiontoken", "password",
                     "credential", "token")

#: backoff before an entry that failed for a transient reason is sent again (doubles, with jitter)
_ENTRY_BACKOFF_SECS = 0.2
_ENTRY_BACKOFF_MAX_SECS = 5.0

#: a MessageGroupId: 1-128 printable ASCII characters, no space (SQS and SNS FIFO)
_GROUP_ID = re.compile(r"[!-~]{1,128}")

#: botocore loggers whose DEBUG lines show request headers or the canonical request (session token)
_HEADER_LOGGERS = ("botocore.endpoint", "botocore.auth", "botocore.awsrequest", "botocore.httpsession",
                   "botocore.parsers", "botocore.hooks", "botocore.retryhandler", "botocore.retries.standard")

#: the session token in botocore's logs: a header (``'X-Amz-Security-Token': b'...'``) or a canonical
#: request line (``x-amz-security-token:...``)
_TOKEN_IN_LOG = re.compile(r"(?i)(x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,}]+")


class _MaskSessionToken(logging.Filter):
    """Masks the session token in botocore's DEBUG lines (request headers, canonical requests)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler
            return True
        masked = _TOKEN_IN_LOG.sub(r"\1***", text)
        if masked != text:
            record.msg, record.args = masked, None
        return True


_TOKEN_FILTER = _MaskSessionToken()


def _mask_botocore_logs() -> None:
    for name in _HEADER_LOGGERS:
        logger = logging.getLogger(name)
        if _TOKEN_FILTER not in logger.filters:
            logger.addFilter(_TOKEN_FILTER)


class AwsSinkConfigBase(SinkConfigBase):
    """Client settings of every AWS sink; credentials come only from boto3's standard chain."""

    region: str | None = Field(default=None, pattern=r"^[a-z0-9-]{1,50}$")
    endpoint_url: str | None = None
    timeout_secs: float = Field(default=10, gt=0, le=3600)
    max_attempts: int = Field(default=3, ge=1, le=20)

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keys = sorted(str(key) for key in data if any(word in str(key).lower() for word in _CREDENTIAL_WORDS))
            if keys:
                raise ValueError(f"{keys} look like AWS credentials, which are never read from the configuration: "
                                 "use the standard AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
                                 "AWS_SESSION_TOKEN in the environment, AWS_PROFILE, an instance or container role)")
        return data

    @model_validator(mode="after")
    def _valid_endpoint(self) -> Self:
        if self.endpoint_url is not None:
            try:
                parts = urlsplit(self.endpoint_url)
                parts.port  # noqa: B018 - raises for an invalid port
            except ValueError:
                raise ValueError("endpoint_url is not a valid URL") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("endpoint_url must be an http(s) URL with a host, e.g. http://127.0.0.1:4566")
            if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
                raise ValueError("endpoint_url must not carry user info, a query string or a fragment "
                                 "(credentials come from the standard AWS chain)")
        return self

    def secret_values(self) -> list[str]:
        return super().secret_values() + (url_secrets(self.endpoint_url) if self.endpoint_url else [])


class AwsMessageConfigBase(AwsSinkConfigBase):
    """What SQS and SNS share: FIFO message groups, the message size limit, the batch size."""

    message_group_id: str | None = Field(default=None, pattern=f"^{_GROUP_ID.pattern}$")
    message_group_id_from: EventPath | None = None
    max_message_bytes: int = Field(default=262_144, ge=1024, le=1_048_576)
    max_batch_size: int = Field(default=10, ge=1, le=10)


@dataclass(frozen=True)
class Prepared:
    """An event checked and turned into a request entry; ``size`` counts toward the request's limit."""

    entry: dict[str, Any]
    size: int


@dataclass(frozen=True)
class EntryFailure:
    """The service's answer about one entry it did not accept."""

    code: str
    message: str
    permanent: bool


C = TypeVar("C", bound=AwsSinkConfigBase)


class AwsBatchSink(Sink, Generic[C]):
    """An AWS sink sending batch requests (the failure rule: docs/sinks.md, "Amazon"). The boto3 client of
    the sink's type (its service) is created on first publish and kept for the sink's life."""

    #: what an entry is called in messages
    entry_noun: ClassVar[str] = "message"
    config: C

    def __init__(self, config: C) -> None:
        super().__init__(config)
        self._boto3 = import_extra(self.type_name, "aws", "boto3", "boto3", "boto3.session")
        self._botocore = import_extra(self.type_name, "aws", "boto3", "botocore", "botocore.config",
                                      "botocore.exceptions")
        self._client: Any = None

    @abstractmethod
    def _prepare(self, event: Event) -> Prepared:
        """The request entry of ``event``, or a permanent :class:`SinkError` (routing, size)."""

    @abstractmethod
    def _send(self, client: Any, entries: list[dict[str, Any]]) -> list[EntryFailure | None]:
        """Send one request; the answer per entry, in order (``None``: accepted)."""

    @abstractmethod
    def _target(self) -> str:
        """The destination for messages: ``queue https://...``, ``topic arn:...``, ``stream name``."""

    @abstractmethod
    def _rejects_request(self, code: str, message: str) -> bool:
        """Whether a request refused as a whole was refused for its content (too long, invalid characters)."""

    @abstractmethod
    def _limits(self) -> tuple[int, int]:
        """Entries per request at most, and the limit of a request's ``Prepared.size`` summed."""

    def publish(self, events: Sequence[Event]) -> None:
        publish_prepared(events, self._prepare, self._send_all)

    def _send_all(self, events: Sequence[Event], prepared: list[Prepared]) -> None:
        batch_size, request_bytes = self._limits()
        start = 0
        while start < len(events):
            end, total = start, 0
            while end < len(events) and end - start < batch_size and \
                    (end == start or total + prepared[end].size <= request_bytes):
                total += prepared[end].size
                end += 1
            self._send_request(events, prepared, start, end)
            start = end

    def _send_request(self, events: Sequence[Event], prepared: list[Prepared], start: int, end: int) -> None:
        """Send ``events[start:end]`` as one request until every entry is accepted, else raise."""
        client = self._client_for(events[start:])
        attempt, lo = 1, start
        while True:
            try:
                outcomes = self._send(client, [p.entry for p in prepared[lo:end]])
            except self._botocore.exceptions.ClientError as exc:
                raise self._request_error(events, lo, end, exc) from None
            except self._botocore.exceptions.BotoCoreError as exc:
                raise self._error(events[lo:], self._client_problem(exc)) from None
            failed = next(((i, outcome) for i, outcome in enumerate(outcomes) if outcome is not None), None)
            if failed is None:
                return
            first, failure = lo + failed[0], failed[1]  # the entries before it are confirmed
            answer = f"{failure.code}: {excerpt(failure.message)}"
            if failure.permanent:
                raise self._error([events[first]], f"{self._target()} refused the {self.entry_noun}: {answer}",
                                  permanent=True)
            tries = attempt if first == lo else 1  # how often this entry was sent
            if tries >= self.config.max_attempts:
                raise self._error(events[first:], f"{self._target()} did not accept {describe_events([events[first]])} "
                                                  f"after {tries} attempt(s): {answer}")
            log.info("%s sink: %s not accepted (%s), sending it again with the %d after it", self.type_name,
                     describe_events([events[first]]), failure.code, end - first - 1)
            time.sleep(min(_ENTRY_BACKOFF_SECS * 2 ** (tries - 1), _ENTRY_BACKOFF_MAX_SECS) * random.uniform(0.5, 1))
            attempt, lo = tries + 1, first

    def _request_error(self, events: Sequence[Event], lo: int, end: int, exc: Any) -> SinkError:
        error = exc.response.get("Error", {})
        code, message = str(error.get("Code", "")), str(error.get("Message", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        answer = f"{code}: {excerpt(message)}" + (f" (HTTP {status})" if status else "")
        if self._rejects_request(code, message):
            what = f"the {self.entry_noun}" if end - lo == 1 else \
                f"a request of {end - lo} {self.entry_noun}s (which one is at fault is not known)"
            return self._error(events[lo:end], f"{self._target()} refused {what}: {answer}", permanent=True)
        return self._error(events[lo:], f"{self._target()} at {self._where()} failed: {answer}")

    def _client_problem(self, exc: Any) -> str:
        """A client-side failure (no connection, timeout, no credentials or region) as a reason."""
        exceptions = self._botocore.exceptions
        text = excerpt(scrub(str(exc), self.config.secret_values()))
        if isinstance(exc, exceptions.NoCredentialsError | exceptions.PartialCredentialsError):
            return (f"no AWS credentials ({text}): set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
                    "give the process a role")
        if isinstance(exc, exceptions.NoRegionError):
            return "no AWS region: set the sink's region, or AWS_REGION"
        if isinstance(exc, exceptions.ConnectionError | exceptions.HTTPClientError):
            return f"cannot reach {self._where()} after {self.config.max_attempts} attempt(s): {text}"
        return f"{self._target()} at {self._where()}: {type(exc).__name__}: {text}"

    def _where(self) -> str:
        """The endpoint for messages: ``endpoint_url`` (redacted) or ``AWS``, and the region."""
        region = self.config.region or (self._client.meta.region_name if self._client is not None else None)
        endpoint = redact_url(self.config.endpoint_url) if self.config.endpoint_url else "AWS"
        return f"{endpoint} ({region or 'no region'})"

    def _client_for(self, events: Sequence[Event]) -> Any:
        if self._client is None:
            config = self.config
            _mask_botocore_logs()
            settings = self._botocore.config.Config(
                connect_timeout=config.timeout_secs, read_timeout=config.timeout_secs,
                retries={"total_max_attempts": config.max_attempts, "mode": "standard"},
                user_agent_extra="pgstream-dagster")
            try:
                session = self._boto3.session.Session(region_name=config.region)
                self._client = session.client(self.type_name, endpoint_url=config.endpoint_url, config=settings)
            except self._botocore.exceptions.BotoCoreError as exc:
                raise self._error(events, self._client_problem(exc)) from None
        return self._client

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # best effort
                log.debug("closing the %s client failed: %s", self.type_name, exc)


M = TypeVar("M", bound=AwsMessageConfigBase)


class AwsMessageSink(AwsBatchSink[M]):
    """What the SQS and SNS sinks share: the payload as the body, the pgstream attributes, FIFO group and
    deduplication ids, the size limit of a message and of a batch, the batch call and its answer."""

    #: the entry key of the body (``MessageBody``, ``Message``)
    body_key: ClassVar[str]
    #: the config key of the queue URL or topic ARN, and what it is called in messages (``queue``, ``topic``)
    address_key: ClassVar[tuple[str, str]]
    #: the batch call: the client's method, its address argument and its entries argument
    batch_call: ClassVar[tuple[str, str, str]]
    #: per-entry error codes (sender fault) that refuse the message itself
    rejecting_codes: ClassVar[frozenset[str]]

    def __init__(self, config: M) -> None:
        super().__init__(config)
        self._address: str = getattr(config, self.address_key[0])
        self._fifo = self._address.endswith(".fifo")  # a FIFO queue or topic (AWS requires the suffix)

    def max_event_bytes(self) -> int | None:
        return self.config.max_message_bytes  # the body is the payload (attributes come on top)

    def _limits(self) -> tuple[int, int]:
        return self.config.max_batch_size, self.config.max_message_bytes  # a message's limit is a whole batch's

    def _target(self) -> str:
        return f"{self.address_key[1]} {self._address}"  # no user info or query string (validated): nothing to hide

    def _check(self, event: Event, body: str, attributes: dict[str, dict[str, str]]) -> None:
        """More checks of a message before it is sent (a permanent :class:`SinkError`); none by default."""

    def _prepare(self, event: Event) -> Prepared:
        config = self.config
        body = event.payload_json
        # pgstream-event-id (the idempotency key) and pgstream-stream-id are Numbers: filter policies can match ranges
        attributes = {"pgstream-event-id": {"DataType": "Number", "StringValue": str(event.id)},
                      "pgstream-stream-id": {"DataType": "Number", "StringValue": str(event.stream_id)}}
        if event.metadata_json is not None:
            attributes["pgstream-metadata"] = {"DataType": "String", "StringValue": event.metadata_json}
        entry: dict[str, Any] = {self.body_key: body, "MessageAttributes": attributes}
        group = self._group_id(event)
        if group is not None:
            entry["MessageGroupId"] = group
        if self._fifo:
            entry["MessageDeduplicationId"] = str(event.id)
        # what SQS and SNS compare with their limit: the body and every attribute's name, type and value
        size = len(body.encode()) + sum(len(name.encode()) + len(value["DataType"].encode())
                                        + len(value["StringValue"].encode()) for name, value in attributes.items())
        if size > config.max_message_bytes:
            raise self._error([event], f"not sent to {self._target()}: the message is {size} bytes with its "
                                       f"attributes, more than max_message_bytes ({config.max_message_bytes})",
                              permanent=True)
        self._check(event, body, attributes)
        return Prepared(entry, size)

    def _group_id(self, event: Event) -> str | None:
        """The ``MessageGroupId`` of ``event`` (``None``: a standard destination without group settings)."""
        config = self.config
        if not self._fifo and config.message_group_id is None and config.message_group_id_from is None:
            return None
        # a RoutingError here: the event's content cannot be read (EventContentError)
        group, from_event = self._destination(event, f"not sent to {self._target()}",
                                              config.message_group_id or str(event.stream_id),
                                              config.message_group_id_from)
        if not _GROUP_ID.fullmatch(group):
            # from the event (payload or metadata): the event's fault (the fixed one is validated at load)
            raise self._error([event], f"invalid MessageGroupId {group[:200]!r} (1-128 printable ASCII characters, "
                                       "no space)", permanent=from_event)
        return group

    def _send(self, client: Any, entries: list[dict[str, Any]]) -> list[EntryFailure | None]:
        """One batch call (entries ``Id`` ``0..n-1``): ``Successful`` entries are accepted, ``Failed`` ones
        failed (permanently for a sender fault in :attr:`rejecting_codes`), one in neither list failed."""
        method, address_arg, entries_arg = self.batch_call
        response = getattr(client, method)(**{address_arg: self._address,
                                               entries_arg: [{"Id": str(i), **e} for i, e in enumerate(entries)]})
        outcomes: list[EntryFailure | None] = [EntryFailure("NoResult", "the answer does not mention this entry",
                                                            False)] * len(entries)
        for ok in response.get("Successful") or []:
            outcomes[int(ok["Id"])] = None
        for failed in response.get("Failed") or []:
            code = str(failed.get("Code", ""))
            outcomes[int(failed["Id"])] = EntryFailure(code, str(failed.get("Message", "")),
                                                       bool(failed.get("SenderFault")) and code in self.rejecting_codes)
        return outcomes
