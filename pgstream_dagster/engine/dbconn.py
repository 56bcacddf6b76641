"""The runtime's connections, with ``search_path = pg_catalog, pg_temp`` (the URL's options kept): a role
that may create functions on the login role's path could otherwise shadow a built-in called with an untyped
argument and run its code as the runtime. libpq echoes what it cannot parse of a connection string, password
included: :func:`conninfo_problem` says what is wrong without it, :func:`connect` masks it in the error.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..sinks.base import connect_postgres, scrub_conninfo


def conninfo_problem(database_url: str) -> str | None:
    """Why libpq cannot parse ``database_url`` (its message, one line, the password masked), or None."""
    try:
        conninfo_to_dict(database_url)
    except psycopg.Error as exc:
        return scrubbed_error(exc, database_url)
    return None


def scrubbed_error(error: BaseException | str, *database_urls: str | None) -> str:
    """``error``'s message in one line, the passwords of ``database_urls`` (and any other it shows) masked."""
    return scrub_conninfo(" ".join(str(error).split()), *database_urls)


class Connection(psycopg.Connection[Any]):
    """A runtime connection (:func:`connect`) that knows which database its URL names (:func:`database_key`)."""

    #: ``host:port/database`` of the URL it was opened with: every host of a multi-host URL, whichever it reached
    database: str = ""


def url_database(database_url: str) -> str:
    """The database ``database_url`` names as ``host:port/database``: every host and port of a multi-host URL
    (the same before and after a failover moved the primary between them), never the role or password."""
    info = conninfo_to_dict(database_url)
    host = info.get("host") or info.get("hostaddr") or "(the local socket)"
    return f"{host}:{info.get('port') or 5432}/{info.get('dbname') or info.get('user') or ''}"


def database_key(conn: psycopg.Connection) -> str:
    """The database ``conn`` is connected to as ``host:port/database`` (:func:`url_database` of the URL it was
    opened with): tells one database's reader groups from another's in a shared Dagster instance."""
    if isinstance(conn, Connection) and conn.database:
        return conn.database
    return url_database(conn.info.dsn)  # (a connection not of :func:`connect`: the host it reached)


class ConnectionLimit(psycopg.OperationalError):
    """Postgres refused a connection for a connection limit (:func:`connect`): one line naming the limit and the
    setting to change. Not the server going away (:func:`server_gone`): what asked waits for no failover."""


_MAX_CONNECTIONS = ("raise max_connections in postgresql.conf and restart Postgres (`pgstream-dagster preflight` "
                    "counts what pgstream needs)")
#: what Postgres says when it refuses a connection for a limit (libpq gives no SQLSTATE then), and what to change
_CONNECTION_LIMITS = (
    ("too many connections for role", "raise the role's limit (ALTER ROLE ... CONNECTION LIMIT n)"),
    ("too many connections for database", "raise the database's limit (ALTER DATABASE ... CONNECTION LIMIT n)"),
    ("too many clients already", _MAX_CONNECTIONS),
    ("remaining connection slots are reserved", _MAX_CONNECTIONS),
)


def connect(database_url: str, *, options: str = "", **kwargs: Any) -> Connection:
    """``psycopg.connect`` with the pinned search path (``options``: more ``-c`` settings); a failure
    raises psycopg's error with the URL's password masked (``sinks.base.connect_postgres``), a refusal for a
    connection limit :class:`ConnectionLimit`."""
    try:
        conn = connect_postgres(database_url, options, connection_class=Connection, **kwargs)
    except psycopg.OperationalError as exc:
        said = scrubbed_error(exc, database_url)
        for text, change in _CONNECTION_LIMITS:
            if text in said:
                detail = said[said.index("FATAL:") + 6:].strip() if "FATAL:" in said else said
                raise ConnectionLimit(f"Postgres refused a connection of {describe_url(database_url)}: {detail}: "
                                      f"{change}") from None
        raise
    conn.database = url_database(database_url)
    return conn


def describe_url(database_url: str) -> str:
    """Whom and where ``database_url`` connects, for a message: ``role R at host:port/database``, never its
    password (nor anything else of it)."""
    try:
        info = conninfo_to_dict(database_url)
    except psycopg.Error:
        return "a URL that does not parse"
    port = f":{info['port']}" if info.get("port") else ""
    return (f"role {info.get('user') or '(the default user)'} at {info.get('host') or '(the local socket)'}{port}/"
            f"{info.get('dbname') or '(the default database)'}")


def error_line(exc: BaseException) -> str:
    """A database error in one line: Postgres' message and its hint, without the CONTEXT lines (the
    PL/pgSQL call stack); another error's first line."""
    diag = exc.diag if isinstance(exc, psycopg.Error) else None
    if diag is not None and diag.message_primary:
        return diag.message_primary + (f" ({diag.message_hint.strip()})" if diag.message_hint else "")
    return first_line(exc)


def first_line(exc: BaseException) -> str:
    """``exc``'s message's first line (its type's name when it has none)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def server_gone(exc: BaseException) -> str | None:
    """What a tick or a run says, in one line, when its server went away mid-way (crash, restart, failover,
    shutdown) or is read-only (a standby reached without ``target_session_attrs=read-write``); else None."""
    if isinstance(exc, ConnectionLimit):
        return None
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return f"the server is read-only (a standby?), waiting for the primary: {error_line(exc)}"
    if isinstance(exc, psycopg.OperationalError) and (exc.sqlstate is None or exc.sqlstate.startswith(("08", "57P"))):
        return f"the primary is gone (a crash, a restart or a failover), waiting for it: {error_line(exc)}"
    return None
