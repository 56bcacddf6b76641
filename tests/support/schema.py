"""The database-core tests' user table (``public.users``), subscriptions written straight into
``pgstream.subscriptions``, and readers of the events and of everything pgstream generated."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.types.json import Jsonb

USERS = """
create table public.users (
    id serial primary key,
    name text,
    email text,
    email_verified boolean not null default false,
    age integer,
    created_at timestamptz not null default '2024-12-12T10:30:00Z'
)
"""


def subscribe(conn: psycopg.Connection, key: str, *, op: str = "INSERT", table: str = "users",
              schema: str = "public", when: str | None = None, columns: list[str] | None = None,
              extensions: list[dict[str, str]] | None = None, stream_id: int = 1,
              metadata: Any = None, mode: str = "row",
              metadata_extensions: list[dict[str, str]] | None = None) -> None:
    conn.execute(
        """insert into pgstream.subscriptions
           (key, stream_id, operation, schema_name, table_name, when_clause, column_names,
            payload_extensions, metadata, trigger_mode, metadata_extensions)
           values (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
        [key, stream_id, op, schema, table, when, columns if columns is not None else ["id", "email"],
         Jsonb(extensions or []), Jsonb(metadata) if metadata is not None else None, mode,
         Jsonb(metadata_extensions or [])],
    )


def events(conn: psycopg.Connection) -> list[tuple[int, int, dict[str, Any], Any]]:
    return conn.execute("select id, stream_id, payload, metadata from pgstream.events order by id").fetchall()


def trigger_state(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """Everything generated: triggers (oid, table, definition) and trigger functions (source)."""
    return conn.execute(
        """
        select 'trigger', t.oid::bigint, t.tgrelid::regclass::text, pg_get_triggerdef(t.oid)
        from pg_trigger t join pg_proc p on p.oid = t.tgfoid join pg_class c on c.oid = t.tgrelid
        where p.pronamespace = 'pgstream'::regnamespace and not t.tgisinternal
          and c.relnamespace <> 'pgstream'::regnamespace
        union all
        select 'function', p.oid::bigint, p.proname::text, p.prosrc
        from pg_proc p where p.pronamespace = 'pgstream'::regnamespace and p.proname like '\\_publish\\_%'
        order by 1, 3, 2
        """
    ).fetchall()


def set_subscriptions(conn: psycopg.Connection, stream_id: int, subs: list[dict[str, Any]],
         managed_by: str | None = None) -> list[tuple[Any, ...]]:
    """``pgstream.set_subscriptions`` with rows built from ``subs`` (defaults for what they omit)."""
    rows = [{"key": s["key"], "operation": s.get("operation", "INSERT"), "schema_name": s.get("schema_name", "public"),
             "table_name": s["table_name"], "when_clause": s.get("when_clause"),
             "column_names": s.get("column_names", ["id"]), "metadata": s.get("metadata") or None,
             "payload_extensions": s.get("payload_extensions", []), "trigger_mode": s.get("trigger_mode"),
             "metadata_extensions": s.get("metadata_extensions", [])}
            for s in subs]
    return conn.execute(
        "select action, key from pgstream.set_subscriptions(%s, array(select jsonb_populate_record("
        "null::pgstream.subscriptions, x) from jsonb_array_elements(%s::jsonb) with ordinality as t(x, o) "
        "order by o), %s)", [stream_id, Jsonb(rows), managed_by]).fetchall()
