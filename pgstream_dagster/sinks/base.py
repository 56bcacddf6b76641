"""The sink interface: an :class:`Event`, the :class:`Sink` contract and the config base model."""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import importlib
import json
import operator
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from dataclasses import FrozenInstanceError
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Self, TypeVar, overload
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "Event",
    "EventContentError",
    "EventPath",
    "MissingExtraError",
    "RoutingError",
    "Sink",
    "SinkConfigBase",
    "SinkError",
    "connect_postgres",
    "conninfo_secrets",
    "describe_events",
    "describe_exception",
    "describe_path",
    "dumps",
    "event_columns",
    "event_scalar",
    "event_stream",
    "excerpt",
    "header_value",
    "import_extra",
    "loads_event_json",
    "lookup_event",
    "parse_event_path",
    "prepare_until_rejected",
    "publish_prepared",
    "redact_url",
    "route",
    "route_name",
    "scrub",
    "scrub_conninfo",
    "url_secrets",
]

T = TypeVar("T")

_UNSET: Any = object()


class Event:
    """One change event. ``id`` is the idempotency key: delivering the same id twice is a duplicate.

    Immutable. Built either from parsed values (``payload=...``) or from the JSON text read from
    Postgres (``payload_json=...``): the text is then parsed only when ``payload`` is first read,
    and the built-in sinks send it as it is (``payload_json``) without parsing it at all.
    """

    __slots__ = ("_created_at", "_id", "_metadata", "_metadata_json", "_payload", "_payload_json", "_stream_id")
    # the slots' types (``_payload`` and ``_metadata`` hold ``_UNSET`` until parsed from their JSON text)
    _id: int
    _stream_id: int
    _created_at: dt.datetime
    _payload: dict[str, Any]
    _payload_json: str | None
    _metadata: dict[str, Any] | None
    _metadata_json: str | None

    def __init__(self, id: int, stream_id: int, payload: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None, created_at: dt.datetime | None = None, *,
                 payload_json: str | None = None, metadata_json: str | None = None) -> None:
        if created_at is None:
            raise TypeError("Event() missing required argument: 'created_at'")
        if payload is None and payload_json is None:
            raise TypeError("Event() needs payload or payload_json")
        setter = object.__setattr__
        setter(self, "_id", id)
        setter(self, "_stream_id", stream_id)
        setter(self, "_created_at", created_at)
        setter(self, "_payload", _UNSET if payload is None else payload)
        setter(self, "_payload_json", payload_json)
        setter(self, "_metadata", _UNSET if metadata is None and metadata_json is not None else metadata)
        setter(self, "_metadata_json", metadata_json)

    @property
    def id(self) -> int:
        return self._id

    @property
    def stream_id(self) -> int:
        return self._stream_id

    @property
    def created_at(self) -> dt.datetime:
        return self._created_at

    @property
    def payload(self) -> dict[str, Any]:
        """The payload as a dict (parsed from ``payload_json`` on first use, by :func:`loads_event_json`:
        raises :class:`EventContentError` when Python cannot represent it)."""
        if self._payload is _UNSET:
            assert self._payload_json is not None  # __init__ keeps the text when there is no dict
            object.__setattr__(self, "_payload", loads_event_json(self._payload_json, self._id, "payload"))
        return self._payload

    @property
    def metadata(self) -> dict[str, Any] | None:
        if self._metadata is _UNSET:
            assert self._metadata_json is not None  # __init__ unsets the dict only when there is text
            object.__setattr__(self, "_metadata", loads_event_json(self._metadata_json, self._id, "metadata"))
        return self._metadata

    @property
    def payload_json(self) -> str:
        """The payload as JSON text: as read from Postgres, else :func:`dumps` of ``payload``."""
        text = self._payload_json
        if text is None:
            text = dumps(self._payload)
            object.__setattr__(self, "_payload_json", text)
        return text

    @property
    def metadata_json(self) -> str | None:
        """The metadata as JSON text, ``None`` when there is none."""
        if self._metadata_json is None and self._metadata is not None:
            object.__setattr__(self, "_metadata_json", dumps(self._metadata))
        return self._metadata_json

    def as_json_dict(self) -> dict[str, Any]:
        """The event as a JSON-ready dict (``created_at`` as ISO 8601)."""
        return {"id": self.id, "stream_id": self.stream_id, "created_at": self.created_at.isoformat(),
                "payload": self.payload, "metadata": self.metadata}

    def to_json(self) -> str:
        """``as_json_dict()`` as compact JSON text, built around the payload text without parsing it."""
        # the slots first: the common case (text read from Postgres) needs no property call
        payload = self._payload_json or self.payload_json  # JSON text is never empty
        metadata = self._metadata_json
        if metadata is None and self._metadata is not None:
            metadata = self.metadata_json
        return (f'{{"id":{self._id},"stream_id":{self._stream_id},"created_at":"{self._created_at.isoformat()}",'
                f'"payload":{payload},"metadata":{"null" if metadata is None else metadata}}}')

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def _key(self) -> tuple[Any, ...]:
        return (self.id, self.stream_id, self.payload, self.metadata, self.created_at)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # payloads are dicts, like the former frozen dataclass

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial(Event, payload_json=self._payload_json, metadata_json=self._metadata_json),
                (self.id, self.stream_id, None if self._payload is _UNSET else self._payload,
                 None if self._metadata is _UNSET else self._metadata, self.created_at))

    def __repr__(self) -> str:
        return (f"Event(id={self.id!r}, stream_id={self.stream_id!r}, payload={self.payload!r}, "
                f"metadata={self.metadata!r}, created_at={self.created_at!r})")


_new_object = object.__new__
# the slots' setters (C descriptors): the Python-level __setattr__ of a frozen Event is bypassed
_set_id, _set_stream_id, _set_created_at, _set_payload, _set_payload_json, _set_metadata, _set_metadata_json = (
    Event.__dict__[name].__set__
    for name in ("_id", "_stream_id", "_created_at", "_payload", "_payload_json", "_metadata", "_metadata_json"))


def event_from_text(id: int, stream_id: int, created_at: dt.datetime, payload_json: str,
                    metadata_json: str | None) -> Event:
    """``Event(..., payload_json=..., metadata_json=...)`` without ``__init__``'s checks (the caller passes
    text read from Postgres): what the delivery path builds for every event, at less than half the cost."""
    event = _new_object(Event)
    _set_id(event, id)
    _set_stream_id(event, stream_id)
    _set_created_at(event, created_at)
    _set_payload(event, _UNSET)
    _set_payload_json(event, payload_json)
    _set_metadata(event, None if metadata_json is None else _UNSET)
    _set_metadata_json(event, metadata_json)
    return event


_slot_getters = tuple(operator.attrgetter(name)
                      for name in ("_id", "_stream_id", "_created_at", "_payload_json", "_metadata", "_metadata_json"))


def event_columns(events: Sequence[Event]) -> tuple[list[int], list[int], list[dt.datetime], list[str],
                                                    list[str | None]]:
    """The events' ids, stream ids, creation times, payload and metadata texts (``None``: no metadata),
    a list each, read from the slots without a Python call per event (the lake sinks' Arrow columns)."""
    get_id, get_stream, get_created, get_payload_json, get_metadata, get_metadata_json = _slot_getters
    payloads: list[Any] = list(map(get_payload_json, events))
    if None in payloads:  # built from a dict
        payloads = [e.payload_json for e in events]
    metadata: list[Any] = list(map(get_metadata_json, events))
    # an event without metadata text has either none (None) or a dict without its text yet
    if None in metadata and metadata.count(None) != list(map(get_metadata, events)).count(None):
        metadata = [e.metadata_json for e in events]
    return (list(map(get_id, events)), list(map(get_stream, events)), list(map(get_created, events)), payloads,
            metadata)


def event_stream(events: Sequence[Event]) -> int:
    """The one stream of ``events`` (not empty); ``ValueError`` when they belong to several."""
    streams = list(map(_slot_getters[1], events))
    if streams.count(streams[0]) != len(streams):
        raise ValueError("the events of one publish call belong to several streams")
    return int(streams[0])


class SinkError(Exception):
    """A destination did not confirm delivery. The message names the sink, the event id(s) and the reason,
    never a secret (sinks scrub them before raising).

    ``permanent``: the destination rejected the event(s) in ``event_ids`` for what they are: the first
    rejected event in publish order (every event before it confirmed), or the events of the first
    rejected request when the destination cannot say which; never a failure of the destination or the
    configuration. The rule: docs/sinks.md, "What is retried and what is rejected".
    """

    def __init__(self, message: str, *, sink: str | None = None, event_ids: Sequence[int] = (),
                 permanent: bool = False) -> None:
        super().__init__(message)
        self.sink = sink
        self.event_ids: tuple[int, ...] = tuple(event_ids)
        self.permanent = permanent

    @classmethod
    def for_events(cls, sink: str, events: Sequence[Event], reason: str, secrets: Iterable[str] = (), *,
                   permanent: bool = False) -> Self:
        """Build ``"<sink> sink: <event id(s)>: <reason>"`` with every secret value masked."""
        message = f"{sink} sink: {describe_events(events)}: {reason}"
        return cls(scrub(message, secrets), sink=sink, event_ids=[e.id for e in events], permanent=permanent)


class RoutingError(ValueError):
    """An event's destination name (stream, subject, routing key) cannot be derived from its payload or metadata."""


class EventContentError(RoutingError):
    """An event's payload or metadata text cannot be parsed in Python (too deeply nested, invalid JSON): a
    :class:`RoutingError`, which every sink routing the event turns into a permanent rejection of it."""


def _number(text: str) -> int | decimal.Decimal:
    """A JSON integer: an ``int``, or an exact :class:`decimal.Decimal` past ``sys.get_int_max_str_digits()``."""
    try:
        return int(text)
    except ValueError:
        return decimal.Decimal(text)


def loads_event_json(text: str, event_id: int, what: str = "payload") -> Any:
    """Parse an event's JSON text (as read from Postgres, which accepts what Python may not): an integer
    longer than Python converts to ``int`` stays exact (:func:`_number`); text that still cannot be parsed
    raises :class:`EventContentError` naming the event, never the content."""
    try:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise
        except ValueError:  # an integer over the int conversion limit: parse again, keeping it exact
            return json.loads(text, parse_int=_number)
    except (ValueError, RecursionError) as exc:
        reason = ("is nested deeper than Python can parse" if isinstance(exc, RecursionError)
                  else f"is not JSON Python can parse ({type(exc).__name__})")
        raise EventContentError(f"event {event_id}'s {what} {reason}") from None


EventPath = Annotated[str, Field(
    pattern=r"^(?:(?:payload|metadata):)?[A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z_][A-Za-z0-9_-]*)*$")]
"""A dotted path into an event's payload (``data.tenant``, ``payload:data.tenant``, and a bare
``metadata.region`` too) or, prefixed ``metadata:``, its metadata. docs/sinks.md, "Routing by payload or metadata"."""


@functools.lru_cache(maxsize=1024)
def parse_event_path(path: str) -> tuple[str, str]:
    """``(source, dotted path)`` of an :data:`EventPath`: ``"metadata:a.b"`` -> ``("metadata", "a.b")``,
    ``"a.b"`` and ``"payload:a.b"`` -> ``("payload", "a.b")``."""
    source, colon, rest = path.partition(":")
    if not colon:
        return "payload", path
    if source not in ("payload", "metadata") or not rest:
        raise ValueError(f"event path {path!r}: write <path> or payload:<path> for the payload, "
                         "metadata:<path> for the metadata")
    return source, rest


def describe_path(path: str) -> str:
    """``payload path 'a.b'`` or ``metadata path 'region'``, for messages."""
    source, dotted = parse_event_path(path)
    return f"{source} path {dotted!r}"


def lookup_event(event: Event, path: str) -> Any:
    """The value at :data:`EventPath` ``path`` of ``event``, or ``None`` when any step is missing or not an
    object (or there is no metadata)."""
    source, dotted = parse_event_path(path)
    value = event.payload if source == "payload" else event.metadata
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def event_scalar(event: Event, path: str) -> str | None:
    """The scalar at :data:`EventPath` ``path`` of ``event`` as text (strings as they are, other scalars
    as JSON text: ``42``, ``true``, like Postgres ``#>>``), or ``None`` when it is missing, null or
    empty. Raises :class:`RoutingError` when the value is an object or an array."""
    value = lookup_event(event, path)
    text = _scalar_text(value)
    if text is None and value is not None:
        raise RoutingError(f"{describe_path(path)} is {type(value).__name__}, not a scalar")
    return text or None


def _scalar_text(value: Any) -> str | None:
    """A JSON scalar as text: a string as it is, others as JSON text; ``None`` for null, an object or an array."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return dumps(value)
    return str(value) if isinstance(value, decimal.Decimal) else None  # an integer too long for int


def route_name(event: Event, fixed: str | None, path: str | None, prefix: str = "") -> str:
    """``prefix`` + the scalar at ``path`` (as :func:`event_scalar` gives it) if present, else ``fixed``;
    :class:`RoutingError` when neither gives a name."""
    return route(event, fixed, path, prefix)[0]


def route(event: Event, fixed: str | None, path: str | None, prefix: str = "") -> tuple[str, bool]:
    """:func:`route_name` and whether the name came from the event (``False``: the fixed name).

    A name taken from the event that the destination cannot accept is the event's fault (a permanent
    rejection), the fixed name's the configuration's. Metadata counts as the event's: it is stored with
    the event, so sending it again fails the same way.
    """
    if path is not None:
        value = lookup_event(event, path)
        text = _scalar_text(value)
        if text:
            return prefix + text, True
        if fixed is None:
            if text is not None or value is None:
                found = "is missing" if value is None else "is empty"
                if value is None and parse_event_path(path)[0] == "metadata" and event.metadata is None:
                    found += " (the event has no metadata)"
            else:
                found = f"is {type(value).__name__}, not a scalar"
            raise RoutingError(f"{describe_path(path)} {found} and no fixed name is configured")
    if fixed is None:
        raise RoutingError("no destination name configured")
    return fixed, False


def prepare_until_rejected(events: Sequence[Event], prepare: Callable[[Event], T]) -> tuple[list[T], SinkError | None]:
    """``prepare(event)`` for each event in order until one raises a permanent :class:`SinkError`: the
    prepared values of the events before it, and that error (``None``: none); other exceptions propagate."""
    prepared: list[T] = []
    for event in events:
        try:
            prepared.append(prepare(event))
        except SinkError as exc:
            if not exc.permanent:
                raise
            return prepared, exc
    return prepared, None


def publish_prepared(events: Sequence[Event], prepare: Callable[[Event], T],
                     send: Callable[[Sequence[Event], list[T]], None]) -> None:
    """A sink's ``publish``: :func:`prepare_until_rejected`, ``send`` the events before the first
    permanently rejected one with their prepared values, then raise that rejection."""
    prepared, rejection = prepare_until_rejected(events, prepare)
    if prepared:
        send(events[: len(prepared)], prepared)
    if rejection is not None:
        raise rejection


class MissingExtraError(SinkError, ImportError):
    """The client library of a sink is not installed (install the matching ``pgstream-dagster[extra]``)."""

    def __init__(self, sink: str, extra: str, library: str) -> None:
        super().__init__(f"{sink} sink: the {library!r} package is not installed; "
                         f"run `pip install pgstream-dagster[{extra}]`", sink=sink)


def import_extra(sink: str, extra: str, library: str, *modules: str) -> Any:
    """Import the client library of a sink: ``modules[0]`` (returned) and the submodules after it;
    a missing one raises :class:`MissingExtraError` naming the extra to install."""
    try:
        for name in reversed(modules):
            found = importlib.import_module(name)
    except ImportError:
        raise MissingExtraError(sink, extra, library) from None
    return found


def describe_events(events: Sequence[Event]) -> str:
    """``"event 7"`` or ``"events 7..42 (36 events)"``."""
    if not events:
        return "no events"
    if len(events) == 1:
        return f"event {events[0].id}"
    return f"events {events[0].id}..{events[-1].id} ({len(events)} events)"


def scrub(text: str, secrets: Iterable[str]) -> str:
    """Replace every non-empty secret value occurring in ``text`` with ``***``, also in the escaped forms
    a library's message may show it in (``repr`` of the text or of its UTF-8 bytes: ``b'tok\\n'``)."""
    forms = {form for s in secrets if s for form in _escaped_forms(s)}
    for secret in sorted(forms, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _escaped_forms(secret: str) -> set[str]:
    forms = {secret, repr(secret)[1:-1]}
    with suppress(UnicodeEncodeError):  # lone surrogates
        forms.add(repr(secret.encode())[2:-1])
    return {form for form in forms if form}


def excerpt(text: str, limit: int = 200) -> str:
    """A one-line, length-limited excerpt of ``text`` for error messages."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def describe_exception(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """``"ExceptionType: message"`` (or its repr/type when the message is empty), shortened; ``secrets``
    are masked before shortening (an excerpt never shows half a secret, even one holding whitespace)."""
    text = str(exc)
    if text:
        return excerpt(scrub(f"{type(exc).__name__}: {text}", secrets))
    # some libraries (pika) put the details in args/repr only
    return excerpt(scrub(repr(exc), secrets)) if exc.args else type(exc).__name__


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def dumps(value: Any) -> str:
    """Compact JSON text; datetimes, decimals and UUIDs are written as strings."""
    return json.dumps(value, default=_json_default, ensure_ascii=False, separators=(",", ":"))


#: schemes whose URL path may carry a token (webhooks): their path is masked from the first segment
#: that does not look like a plain word; other schemes keep their path (a Redis database number, an
#: AMQP virtual host)
_TOKEN_PATH_SCHEMES = frozenset({"http", "https", "ws", "wss"})

#: a path segment shown in messages: a short lower-case word (``services``, ``api``, ``hook``, ``index.php``)
#: or a version (``v1``); anything with digits, upper case, other characters or 16+ characters is masked
_PLAIN_SEGMENT = re.compile(r"[a-z][a-z._-]{0,14}|v[0-9]{1,3}")

#: masked path segments at least this long are also masked on their own wherever they occur (shorter
#: ones would mask unrelated text such as event ids; they are masked as part of the masked path)
_MIN_SEGMENT_SECRET = 8
#: the masked part of a path (as a whole) is masked wherever it occurs from this length on: a shorter one
#: (``/hook/5``) would turn every ``5`` of a log line into ``***``; the whole URL is masked still
_MIN_MASKED_SECRET = 4


def _split_path(path: str) -> tuple[str, str]:
    """``path`` as (shown part, masked rest): the rest starts at the first segment that is not a plain word."""
    segments = path.split("/")
    for i, segment in enumerate(segments):
        if segment and not _PLAIN_SEGMENT.fullmatch(segment):
            return "/".join(segments[:i]) + "/", "/".join(segments[i:])
    return path, ""


def redact_url(url: str) -> str:
    """``url`` for messages: ``scheme://host:port/path`` without user info, query string and fragment.
    An http(s) or ws(s) path is shown up to its first segment that is not a plain word, the rest is
    ``***``: webhook tokens live in the path (``https://hooks.slack.com/services/***``)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{host}:{parts.port}" if parts.port else host
        path = parts.path
        if parts.scheme in _TOKEN_PATH_SCHEMES:
            shown, masked = _split_path(path)
            path = shown + "***" if masked else path
        return urlunsplit((parts.scheme, netloc, path, "", ""))
    except ValueError:
        return "<invalid url>"


#: the URL schemes of Postgres that SQLAlchemy may be given here: all run on psycopg2 (:func:`psycopg2_url`)
POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg2")


def psycopg2_url(url: str) -> str:
    """``url`` for SQLAlchemy on psycopg2: a ``postgresql://`` or ``postgres://`` URL becomes
    ``postgresql+psycopg2://`` (SQLAlchemy 2.1 would pick psycopg 3 for it). Any other scheme raises
    ``ValueError`` in one line naming the scheme (when it is one), never the rest of the URL."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme in POSTGRES_SCHEMES:
        return f"postgresql+psycopg2://{rest}"
    named = f"{scheme}://" if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,40}", scheme) else "not a URL"
    raise ValueError(f"must be a postgresql+psycopg2:// URL (or postgresql://, the same here), not {named}")


def url_secrets(url: str) -> list[str]:
    """The secret parts of a URL for :func:`scrub`: the whole URL when :func:`redact_url` hides anything of
    it, its password, query string and fragment, and the masked part of an http(s) path (as a whole and
    each segment of 8+ characters), each also percent-decoded."""
    try:
        parts = urlsplit(url)
        password, query, fragment = parts.password, parts.query, parts.fragment
    except ValueError:
        return [url]
    secrets = [url] if redact_url(url) != url else []
    for part in (password, query, fragment):
        if part:
            secrets += [part, unquote(part)]
    if parts.scheme in _TOKEN_PATH_SCHEMES:
        _shown, masked = _split_path(parts.path)
        if len(masked) >= _MIN_MASKED_SECRET:
            secrets += [masked, unquote(masked)]
            for segment in masked.split("/"):
                if len(segment) >= _MIN_SEGMENT_SECRET:
                    secrets += [segment, unquote(segment)]
    return list(dict.fromkeys(secrets))


#: a ``user:password@`` in text (a connection URL, well-formed or not: ``postgresql//app:pw@host``)
_USERINFO = re.compile(r"(?P<user>(?:^|[\s\"'(/])[^\s:/@\"'()]*):(?P<password>[^\s@\"'/]*)@")
#: a ``password=...`` (``sslpassword``) of a key=value connection string or a URL's query
_PASSWORD_PARAM = re.compile(r"(?P<key>\b(?:ssl)?password\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|[^\s&'\"]+)",
                             re.IGNORECASE)


def conninfo_secrets(conninfo: str) -> list[str]:
    """The passwords of a libpq connection string for :func:`scrub`, as written and percent-decoded: a
    URL's (also a malformed one, which libpq echoes: ``postgresql//app:pw@host``, a raw ``%`` in the
    password) and ``password=``/``sslpassword=`` values. The host, user and database are not secrets."""
    found: list[str] = []
    with suppress(ValueError):
        found.append(urlsplit(conninfo).password or "")
    before, at, _after = conninfo.rpartition("@")
    if at:
        # the user info of a URL however malformed: after its last "/" (or "//"), password after the first ":"
        found += [before.rsplit("/", 1)[-1].partition(":")[2], before.split("//", 1)[-1].partition(":")[2]]
    found += [m.group("password") for m in _USERINFO.finditer(conninfo)]
    for m in _PASSWORD_PARAM.finditer(conninfo):
        value = m.group("value")
        found += [value, value[1:-1]] if value.startswith("'") else [value]
    return list(dict.fromkeys(form for secret in found if secret for form in (secret, unquote(secret))))


def scrub_conninfo(text: str, *conninfos: str | None) -> str:
    """``text`` (a libpq message, which echoes what it cannot parse of a connection string) with the
    passwords of ``conninfos`` and any other ``user:password@`` or ``password=...`` masked: what is wrong
    stays readable (``missing "=" after "postgresql//app:***@host/db"``)."""
    text = scrub(text, [s for conninfo in conninfos if conninfo for s in conninfo_secrets(conninfo)])
    text = _USERINFO.sub(lambda m: f"{m.group('user')}:***@" if m.group("password") != "***" else m.group(0), text)
    return _PASSWORD_PARAM.sub(lambda m: f"{m.group('key')}***", text)


#: the session setting every connection pgstream opens to a pgstream database gets (last: it wins over the URL's)
PINNED_SEARCH_PATH = "-c search_path=pg_catalog,pg_temp"

_C = TypeVar("_C", bound="psycopg.Connection[Any]")


@overload
def connect_postgres(url: str, settings: str = "", *, connection_class: None = None,
                     **kwargs: Any) -> psycopg.Connection[Any]: ...
@overload
def connect_postgres(url: str, settings: str = "", *, connection_class: type[_C], **kwargs: Any) -> _C: ...
def connect_postgres(url: str, settings: str = "", *, connection_class: type[_C] | None = None,
                     **kwargs: Any) -> Any:
    """``psycopg.connect(url, **kwargs)`` (of ``connection_class``) whose session has ``search_path =
    pg_catalog, pg_temp`` (nothing on the role's path can redirect a name) and ``settings`` (more ``-c``),
    after the URL's own ``options``; a failure raises psycopg's error with the URL's password masked."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    cls: Any = connection_class or psycopg.Connection
    try:
        given = conninfo_to_dict(url).get("options") or ""
        options = " ".join(part for part in (str(given), settings, PINNED_SEARCH_PATH) if part)
        return cls.connect(url, options=options, **kwargs)
    except psycopg.Error as exc:
        message = scrub_conninfo(str(exc), url)
        if message == str(exc):
            raise
        raise type(exc)(message) from None


#: an HTTP header name (RFC 9110 token)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def header_value(name: str, value: str) -> str:
    """A configured header ``value`` ready to send, or :class:`ValueError` naming the header, never the value.

    Trailing whitespace (a file-mounted secret's ``\\n``) and leading spaces and tabs are stripped (RFC
    9110: not part of a field value). What remains must be printable ASCII, spaces and tabs: a CR, LF or
    other control character would split or break the request, and the HTTP client sends ASCII only.
    ``name`` must be an HTTP token.
    """
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"header name {name[:100]!r} is not a valid HTTP header name "
                         "(letters, digits and !#$%&'*+-.^_`|~ only)")
    cleaned = value.rstrip(" \t\r\n").lstrip(" \t")
    if any((char < " " and char != "\t") or char == "\x7f" for char in cleaned):
        raise ValueError(f"header {name!r}: the value contains a line break or another control character "
                         "(only a trailing line break is allowed: it is stripped)")
    if not cleaned.isascii():
        raise ValueError(f"header {name!r}: the value contains non-ASCII characters (header values are sent "
                         "as ASCII)")
    return cleaned


#: the sink class each config class builds: ``class XSink(Sink, builds=XSinkConfig)``
_BUILT_BY: dict[type, type[Sink]] = {}


class Sink(ABC):
    """Delivers events to a destination. A sink names the config class it is built from (``builds=``).

    ``publish`` returns only once the destination confirmed every event, in the given order, else raises
    :class:`SinkError` (callers retry the whole batch: the event id is the idempotency key). A sink is
    used from one thread; a delivery run keeps one for its whole life, idle between calls (it must
    notice a connection the server closed meanwhile); a pickled sink unpickles as a fresh one built
    from its config. The contract: docs/sinks.md, "Writing a custom sink".
    """

    #: the sink's name in messages: its config's ``type`` unless the class sets it
    type_name: ClassVar[str]
    config: SinkConfigBase
    #: the sink takes events as the JSON lines of :meth:`Event.to_json` (:meth:`publish_json_lines`): a
    #: replay then has Postgres render them, without building an :class:`Event` per row
    accepts_json_lines: ClassVar[bool] = False

    #: set by a caller that records what the sink confirms (a delivery run: its ledger connection still
    #: answers): a sink that sends several requests in one publish call asks it before each one and,
    #: once it is false, sends nothing more and raises a (not permanent) :class:`SinkError`: what it
    #: sent then could not be recorded and would be sent again by the next run (the HTTP sink does)
    go_on: Callable[[], bool] | None = None

    def __init_subclass__(cls, builds: type[SinkConfigBase] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if builds is not None:
            _BUILT_BY[builds] = cls
            if "type_name" not in cls.__dict__:
                cls.type_name = builds.model_fields["type"].default

    def __init__(self, config: SinkConfigBase) -> None:
        self.config = config

    @abstractmethod
    def publish(self, events: Sequence[Event]) -> None:
        """Deliver ``events`` in order; return once all are confirmed, else raise :class:`SinkError`
        (a permanent one after every event before the rejected one(s) was confirmed)."""

    #: the sink takes each publish call's ledger positions (:meth:`publish_at`): the lake sinks, whose
    #: commits carry the last position as their idempotency token
    accepts_positions: ClassVar[bool] = False

    def publish_at(self, events: Sequence[Event], positions: Sequence[tuple[int, int]]) -> None:
        """:meth:`publish` with each event's ledger position ``(batch_id, ord)`` (1-based ordinal),
        strictly increasing; a replay's events come with batch ``0``. Called instead of :meth:`publish`
        for a sink with :attr:`accepts_positions`; the default ignores the positions."""
        self.publish(events)

    def max_event_bytes(self) -> int | None:
        """The largest payload (JSON text, UTF-8 bytes) this sink can ever send, None for no limit of its
        own: the delivery sets a larger event aside as a dead letter before anything is sent."""
        return None

    def publish_json_lines(self, lines: bytes, count: int, first_id: int, last_id: int) -> None:
        """:meth:`publish` of ``count`` events (ids ``first_id``..``last_id``) given as their
        :meth:`Event.to_json` lines in UTF-8; only sinks with :attr:`accepts_json_lines` implement it."""
        raise NotImplementedError(f"the {self.type_name} sink does not take JSON lines")

    def _error(self, events: Sequence[Event], reason: str, *, permanent: bool = False) -> SinkError:
        """:meth:`SinkError.for_events` of this sink, the config's secret values masked."""
        return SinkError.for_events(self.type_name, events, reason, self.config.secret_values(), permanent=permanent)

    def _destination(self, event: Event, what: str, fixed: str | None, path: str | None,
                     prefix: str = "") -> tuple[str, bool]:
        """:func:`route` of ``event``; a permanent rejection ``"<what>: <why>"`` when it has no name."""
        try:
            return route(event, fixed, path, prefix)
        except RoutingError as exc:
            raise self._error([event], f"{what}: {exc}", permanent=True) from None

    def close(self) -> None:
        """Release connections/files. Idempotent. The default does nothing."""
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.config,))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


class SinkConfigBase(BaseModel):
    """Base of every sink config: immutable, strict about unknown keys, picklable. Subclasses declare a
    ``type: Literal[...]`` discriminator and keep secrets in ``SecretStr`` fields."""

    # validation errors never echo input values (they may be secrets)
    # numbers are finite (a timeout of inf/nan would never end or never start)
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True, allow_inf_nan=False)

    #: destination names of the sink, each fixed (``<name>``), taken from the event (``<name>_from``,
    #: falling back to ``<name>``) or both: at least one of the two is required
    routed_names: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _has_routed_names(self) -> Self:
        for name in self.routed_names:
            if getattr(self, name) is None and getattr(self, f"{name}_from") is None:
                raise ValueError(f"set {name}, {name}_from, or both ({name} is the fallback)")
        return self

    def build(self) -> Sink:
        """The sink class naming this config (or its nearest base config) in ``builds=``, built."""
        for model in type(self).__mro__:
            if model in _BUILT_BY:
                return _BUILT_BY[model](self)
        raise NotImplementedError(f"{type(self).__name__} does not implement build()")

    def secret_values(self) -> list[str]:
        """Plain-text secret values of this config (its nested models' too), masked out of error messages."""
        return _secret_strings(self)


def _secret_strings(value: Any) -> list[str]:
    if isinstance(value, BaseModel):
        return [s for name in type(value).model_fields for s in _secret_strings(getattr(value, name))]
    if isinstance(value, SecretStr):
        text = value.get_secret_value()
        # a connection URL's password also when libpq refuses the URL and echoes it (conninfo_secrets)
        return [*url_secrets(text), *conninfo_secrets(text)] if "://" in text else [text]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _secret_strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _secret_strings(v)]
    return []
