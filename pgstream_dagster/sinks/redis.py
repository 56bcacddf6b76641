"""Redis Streams sink (extra ``redis``, library redis-py): XADD per event, a whole chunk in one call of a
server-side script (``EVALSHA``; a pipelined MULTI/EXEC where scripts are not allowed).

Keys, entry fields and permanent rejections: docs/sinks.md, ``redis``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

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
    route,
)

if TYPE_CHECKING:
    import redis

__all__ = ["RedisSink", "RedisSinkConfig"]


class RedisSinkConfig(SinkConfigBase):
    """XADD each event to a Redis Stream; entry fields ``id`` (event id: the idempotency key consumers dedupe
    on), ``stream_id``, ``created_at``, ``payload`` (JSON text) and, when present, ``metadata`` (JSON text)."""

    type: Literal["redis"] = "redis"
    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    stream: str | None = Field(default=None, min_length=1)
    stream_from: EventPath | None = None
    stream_prefix: str = ""
    maxlen: int | None = Field(default=None, ge=1)
    maxlen_approximate: bool = True
    max_message_bytes: int | None = Field(default=None, ge=1)
    timeout_secs: float = Field(default=10, gt=0)
    use_script: bool = True
    routed_names: ClassVar[tuple[str, ...]] = ("stream",)


#: The fields of an entry, in the order :data:`_XADD_SCRIPT` takes their values (``metadata`` last,
#: and only when the event has metadata).
FIELDS = ("id", "stream_id", "created_at", "payload", "metadata")

#: Adds the entries of one chunk: KEYS are its streams; ARGV is MAXLEN ('' for none) and its mode ('~' or
#: '='), then six values per entry: the index of its stream in KEYS and its FIELDS (metadata '' when the
#: event has none: JSON text is never empty). Returns the number of entries added. Like the pipeline, it
#: stops at nothing but an error (WRONGTYPE, OOM, READONLY), which leaves the entries before it added.
_XADD_SCRIPT = """
local fields, head, n = {'id', 'stream_id', 'created_at', 'payload', 'metadata'}, {'*'}, 0
if ARGV[1] ~= '' then
  head = {'MAXLEN', ARGV[2], ARGV[1], '*'}
end
for i = 3, #ARGV, 6 do
  local args = {KEYS[tonumber(ARGV[i])], unpack(head)}
  for f = 1, ARGV[i + 5] == '' and 4 or 5 do  -- metadata only when the event has some
    args[#args + 1] = fields[f]
    args[#args + 1] = ARGV[i + f]
  end
  redis.call('XADD', unpack(args))
  n = n + 1
end
return n
"""

#: An entry: its stream, then the values of :data:`FIELDS` (metadata ``""`` when the event has none).
Entry = tuple[str, str, str, str, str, str]


class RedisSink(Sink, builds=RedisSinkConfig):
    """Each publish is one call of :data:`_XADD_SCRIPT` (or, without scripts, one pipelined ``MULTI;
    XADD ...; EXEC``) per ``chunk_size`` events, in order; a failed call may have added some entries."""

    config: RedisSinkConfig
    chunk_size: ClassVar[int] = 10_000

    def max_event_bytes(self) -> int | None:
        return self.config.max_message_bytes  # the entry holds the payload at least

    def __init__(self, config: RedisSinkConfig) -> None:
        super().__init__(config)
        self._redis_mod = import_extra("redis", "redis", "redis", "redis")
        self._client: redis.Redis | None = None
        self._script: redis.commands.core.Script | None = None
        self._use_script = config.use_script
        self._target = redact_url(config.url.get_secret_value())
        self._fixed_stream = config.stream if config.stream_from is None else None
        self._maxlen = "" if config.maxlen is None else str(config.maxlen)

    def _conn(self) -> redis.Redis:
        if self._client is None:
            self._client = self._redis_mod.Redis.from_url(self.config.url.get_secret_value(),
                                                          socket_timeout=self.config.timeout_secs,
                                                          socket_connect_timeout=self.config.timeout_secs)
        return self._client

    def publish(self, events: Sequence[Event]) -> None:
        publish_prepared(events, self._entry, self._send)

    def _send(self, events: Sequence[Event], entries: list[Entry]) -> None:
        for start in range(0, len(entries), self.chunk_size):
            self._publish_chunk(events[start : start + self.chunk_size], entries[start : start + self.chunk_size])

    def _entry(self, event: Event) -> Entry:
        """The stream and fields of ``event``; a permanent :class:`SinkError` when it cannot be sent."""
        config = self.config
        stream = self._fixed_stream
        if stream is None:
            stream = self._destination(event, "no stream name", config.stream, config.stream_from,
                                       config.stream_prefix)[0]
        entry = (stream, str(event.id), str(event.stream_id), event.created_at.isoformat(), event.payload_json,
                 event.metadata_json or "")
        limit = config.max_message_bytes
        if limit is not None:
            size = sum(len(name) + len(value.encode()) for name, value in zip(FIELDS, entry[1:], strict=True)
                       if value or name != "metadata")
            if size > limit:
                reason = (f"not sent to stream {stream!r}: the entry is {size} bytes, more than max_message_bytes "
                          f"({limit})")
                raise self._error([event], reason, permanent=True)
        return entry

    def _publish_chunk(self, events: Sequence[Event], entries: Sequence[Entry]) -> None:
        try:
            if self._use_script:
                try:
                    added = self._scripted(entries)
                except self._redis_mod.ResponseError as exc:
                    if not self._refuses_scripts(exc):
                        raise
                    self._use_script = False  # refused before it ran: nothing was added
                    added = self._pipelined(entries)
            else:
                added = self._pipelined(entries)
        except self._redis_mod.RedisError as exc:
            rejection = self._wrong_type(events, entries) if "WRONGTYPE" in str(exc) else None
            self.close()
            if rejection is not None:
                raise rejection from None
            names = sorted({entry[0] for entry in entries})
            where = f"stream {names[0]!r}" if len(names) == 1 else f"{len(names)} streams"
            raise self._error(events, f"XADD to {where} at {self._target} failed: {describe_exception(exc)}") from None
        if added != len(events):
            raise self._error(events, f"expected {len(events)} entries added at {self._target}, got {added}")

    def _wrong_type(self, events: Sequence[Event], entries: Sequence[Entry]) -> SinkError | None:
        """After WRONGTYPE: a permanent rejection of the first event whose stream is a key of another type,
        when that name came from the event (the entries before it were added: the script stops at the
        error, MULTI/EXEC runs every command); ``None`` otherwise (or when that cannot be told)."""
        config = self.config
        if config.stream_from is None:
            return None
        try:
            client = self._conn()
            types: dict[str, str] = {}
            for event, entry in zip(events, entries, strict=True):
                stream = entry[0]
                if stream not in types:
                    found = client.type(stream)
                    types[stream] = found.decode() if isinstance(found, bytes) else str(found)
                if types[stream] not in ("stream", "none"):
                    if not route(event, config.stream, config.stream_from, config.stream_prefix)[1]:
                        return None  # the fixed stream: the configuration's
                    return self._error([event], f"XADD to stream {stream!r} at {self._target} refused: the key "
                                                f"holds a {types[stream]}, not a stream (the name was taken from "
                                                "the event)", permanent=True)
        except self._redis_mod.RedisError:
            return None
        return None

    def _scripted(self, entries: Sequence[Entry]) -> int:
        client = self._conn()
        if self._script is None:
            self._script = client.register_script(_XADD_SCRIPT)
        keys: dict[str, int] = {}
        args: list[str | int] = [self._maxlen, "~" if self.config.maxlen_approximate else "="]
        for stream, *values in entries:
            args += [keys.setdefault(stream, len(keys) + 1), *values]  # the stream's 1-based index in KEYS
        return int(self._script(keys=list(keys), args=args, client=client))

    def _pipelined(self, entries: Sequence[Entry]) -> int:
        config = self.config
        with self._conn().pipeline(transaction=True) as pipe:
            for stream, *values in entries:
                fields = {name: value for name, value in zip(FIELDS, values, strict=True)
                          if value or name != "metadata"}
                # redis-py types fields as an (invariant) Dict of its key/value unions, which takes a dict[str, str]
                pipe.xadd(stream, fields, maxlen=config.maxlen,  # type: ignore[arg-type]
                          approximate=config.maxlen_approximate)
            return len(pipe.execute(raise_on_error=True))

    def _refuses_scripts(self, exc: Exception) -> bool:
        """Whether the server refused to run the script at all (an ACL, a renamed or disabled command), as
        opposed to an error of a command inside it."""
        text = str(exc).lower()
        return (isinstance(exc, self._redis_mod.exceptions.NoPermissionError) or text.startswith("noperm")
                or ("unknown command" in text and "eval" in text))

    def close(self) -> None:
        self._script = None
        client, self._client = self._client, None
        if client is not None:
            client.close()
