"""Postgres table sink (psycopg, a core dependency: no extra): each publish call writes its events
into a table of another database (or another schema) in one transaction.

Keys, the table, the SQL it runs and permanent rejections: docs/sinks.md, ``postgres``."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

import psycopg
from psycopg import sql
from pydantic import Field, SecretStr, field_validator

from .base import Event, Sink, SinkConfigBase, SinkError, describe_exception, event_columns, excerpt, redact_url, scrub

__all__ = ["TABLE_COLUMNS", "PostgresSink", "PostgresSinkConfig"]

log = logging.getLogger(__name__)

#: an unquoted Postgres identifier (quoted as written, so use the name as the catalog spells it)
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_$]{0,62}"
_QUALIFIED = re.compile(rf"({_IDENTIFIER})\.({_IDENTIFIER})")

#: schemas the sink never writes to: pgstream's own, and the system's
_RESERVED_SCHEMAS = frozenset({"pgstream", "information_schema"})

#: the target table's columns, as ``create_table`` creates them (README, ``postgres`` sink)
TABLE_COLUMNS = (
    ("id", "pg_catalog.int8 primary key"),
    ("stream_id", "pg_catalog.int8 not null"),
    ("created_at", "pg_catalog.timestamptz not null"),
    ("payload", "pg_catalog.jsonb not null"),
    ("metadata", "pg_catalog.jsonb"),
    ("received_at", "pg_catalog.timestamptz not null default pg_catalog.now()"),
)

#: SQLSTATE classes of errors that concern a row: data exceptions, integrity constraint violations
_ROW_ERROR_CLASSES = ("22", "23")


class PostgresSinkConfig(SinkConfigBase):
    """Write each event as a row ``(id, stream_id, created_at, payload, metadata, received_at)`` of
    ``table`` (``schema.table``) in the database at ``url``, one transaction per publish call."""

    type: Literal["postgres"] = "postgres"
    url: SecretStr
    table: str
    mode: Literal["insert", "upsert"] = "insert"
    create_table: bool = False
    timeout_secs: float = Field(default=30, gt=0)

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, value: SecretStr) -> SecretStr:
        text = value.get_secret_value().strip()
        if not text.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (postgresql://user:password@host:port/database)")
        return SecretStr(text)

    @field_validator("table")
    @classmethod
    def _qualified_table(cls, value: str) -> str:
        match = _QUALIFIED.fullmatch(value)
        if match is None:
            raise ValueError(f"{value[:100]!r} is not schema.table (two identifiers of letters, digits, _ and $, "
                             "each starting with a letter or _, at most 63 characters; used as written, quoted)")
        schema = match.group(1)
        if schema in _RESERVED_SCHEMAS or schema.lower().startswith("pg_"):
            raise ValueError(f"schema {schema!r} is reserved (pgstream's own tables or the system's): "
                             "write to a schema of your own")
        return value


class PostgresSink(Sink, builds=PostgresSinkConfig):
    """One connection for the sink's life, opened by the first publish; each call is one transaction."""

    config: PostgresSinkConfig

    def __init__(self, config: PostgresSinkConfig) -> None:
        super().__init__(config)
        self._conn: psycopg.Connection[Any] | None = None
        self._target = f"table {config.table} at {redact_url(config.url.get_secret_value())}"
        self._table = sql.Identifier(*config.table.split("."))  # schema.table: one dot (validated)
        self._insert = self._statement()

    def _statement(self) -> sql.Composed:
        names = ("id", "stream_id", "created_at", "payload", "metadata")
        columns = sql.SQL(", ").join(sql.Identifier(name) for name in names)
        conflict: sql.Composable
        if self.config.mode == "insert":
            conflict = sql.SQL("do nothing")
        else:
            updates = [sql.SQL("{0} = excluded.{0}").format(sql.Identifier(name)) for name in names[1:]]
            updates.append(sql.SQL("{} = pg_catalog.now()").format(sql.Identifier("received_at")))
            conflict = sql.SQL("do update set {}").format(sql.SQL(", ").join(updates))
        return sql.SQL(
            "insert into {table} ({columns}) "
            "select i, s, c, p::pg_catalog.jsonb, m::pg_catalog.jsonb "
            "from rows from (pg_catalog.unnest(%s::pg_catalog.int8[]), pg_catalog.unnest(%s::pg_catalog.int8[]), "
            "pg_catalog.unnest(%s::pg_catalog.timestamptz[]), pg_catalog.unnest(%s::pg_catalog.text[]), "
            "pg_catalog.unnest(%s::pg_catalog.text[])) with ordinality as t(i, s, c, p, m, n) order by n "
            "on conflict ({id}) {conflict}"
        ).format(table=self._table, columns=columns, id=sql.Identifier("id"), conflict=conflict)

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        if self.config.mode == "upsert":  # one row may not be updated twice by one statement: the last wins
            events = list({event.id: event for event in events}.values())
        for attempt in (1, 2):
            reused = self._conn is not None
            conn = self._connected(events)
            try:
                self._write(conn, events)
                return
            except psycopg.OperationalError as exc:
                broken = conn.broken or conn.closed
                self.close()
                if broken and reused and attempt == 1:  # closed by the server while idle: once more, afresh
                    log.info("postgres sink: the connection to %s was closed (%s); reconnecting", self._target,
                             describe_exception(exc, self.config.secret_values()))
                    continue
                raise self._failed(events, exc) from None
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    self.close()
                raise self._failed(events, exc) from None

    def _write(self, conn: psycopg.Connection[Any], events: Sequence[Event]) -> None:
        try:
            with conn.transaction():
                conn.execute(self._insert, event_columns(events))
        except psycopg.Error as exc:
            if not _about_a_row(exc):
                raise
            self._write_one_by_one(conn, events)

    def _write_one_by_one(self, conn: psycopg.Connection[Any], events: Sequence[Event]) -> None:
        """Find the first event whose row the target refuses: the rows before it are committed, then it is
        rejected (permanently). When every row goes in alone, they are all committed and nothing is raised."""
        rejection: SinkError | None = None
        with conn.transaction():
            for event in events:
                try:
                    with conn.transaction():  # a savepoint: a refused row leaves the rows before it
                        conn.execute(self._insert, event_columns([event]))
                except psycopg.Error as exc:
                    if not _about_a_row(exc):
                        raise
                    reason = f"{self._target} refused the row: {_describe_sql_error(exc, self.config.secret_values())}"
                    rejection = self._error([event], reason, permanent=True)
                    break
        if rejection is not None:
            raise rejection

    def _connected(self, events: Sequence[Event]) -> psycopg.Connection[Any]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        self._conn = None
        timeout = self.config.timeout_secs
        try:
            conn = psycopg.connect(self.config.url.get_secret_value(), autocommit=True,
                                   connect_timeout=max(2, math.ceil(timeout)), application_name="pgstream-dagster")
        except psycopg.Error as exc:
            reason = f"cannot connect to {self._target}: {describe_exception(exc, self.config.secret_values())}"
            raise self._error(events, reason) from None
        try:
            # every name the sink writes is qualified; set after connecting, not as startup options, which a
            # pooler in front of the target may refuse
            conn.execute("select pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false), "
                         "pg_catalog.set_config('statement_timeout', %s, false)", [f"{math.ceil(timeout * 1000)}ms"])
            if self.config.create_table:
                columns = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(definition))
                                             for name, definition in TABLE_COLUMNS)
                conn.execute(sql.SQL("create table if not exists {} ({})").format(self._table, columns))
        except psycopg.Error as exc:
            conn.close()
            raise self._failed(events, exc) from None
        self._conn = conn
        return conn

    def _failed(self, events: Sequence[Event], exc: psycopg.Error) -> SinkError:
        reason = f"writing to {self._target} failed: {_describe_sql_error(exc, self.config.secret_values())}"
        if exc.sqlstate == "42P01":  # undefined_table
            reason += " (create the table, docs/sinks.md 'postgres', or set create_table: true)"
        elif exc.sqlstate == "42P10":  # invalid_column_reference: on conflict (id) without a unique index
            reason += " (the table needs a primary key or unique index on id)"
        return self._error(events, reason)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _about_a_row(exc: psycopg.Error) -> bool:
    return (exc.sqlstate or "")[:2] in _ROW_ERROR_CLASSES


def _describe_sql_error(exc: psycopg.Error, secrets: list[str]) -> str:
    """The error's class, SQLSTATE and primary message (never its DETAIL, which may quote a whole row),
    ``secrets`` masked before it is shortened."""
    primary = exc.diag.message_primary or str(exc)
    state = f" ({exc.sqlstate})" if exc.sqlstate else ""
    return excerpt(scrub(f"{type(exc).__name__}{state}: {primary}", secrets), 300)
