"""Applying the YAML-declared subscriptions to the database through ``pgstream.set_subscriptions``.

The YAML is the source of truth for the subscriptions it manages (``managed_by = 'yaml'``);
subscriptions created by hand in SQL are never touched. Unchanged subscriptions are not written,
so their triggers are not recreated. Everything happens in one transaction: a bad subscription
rolls the whole set back.
"""

from __future__ import annotations

from collections import defaultdict

import psycopg
from psycopg.types.json import Jsonb

from .config import PgstreamConfig, SubscriptionConfig

MANAGED_BY = "yaml"

_ROW = ("row(null, %s, null, %s::pgstream.operation_type, %s, %s, %s, %s::text[], %s::jsonb, %s::jsonb, "
        "null, null, null)::pgstream.subscriptions")


def _params(sub: SubscriptionConfig) -> list[object]:
    return [sub.key, sub.operation, sub.schema_name, sub.table_name, sub.when_clause, sub.column_names,
            Jsonb(sub.metadata) if sub.metadata is not None else None,
            Jsonb([e.model_dump() for e in sub.payload_extensions])]


def apply_subscriptions(conn: psycopg.Connection, config: PgstreamConfig) -> list[tuple[str, str, int]]:
    """Make the database's YAML-managed subscriptions equal to ``config.subscriptions``.

    Returns ``(action, key, stream_id)`` for every change. Raises ``psycopg.Error`` naming the
    subscription on any invalid one; nothing is changed then.
    """
    from psycopg import sql

    by_stream: dict[int, list[SubscriptionConfig]] = defaultdict(list)
    for sub in config.subscriptions:
        by_stream[sub.stream_id].append(sub)
    changes: list[tuple[str, str, int]] = []
    with conn.transaction():
        for stream in config.streams:
            subs = by_stream.get(stream.id, [])
            query = sql.SQL(
                "select action, key from pgstream.set_subscriptions(%s, array[{}]::pgstream.subscriptions[], %s)"
            ).format(sql.SQL(", ").join([sql.SQL(_ROW)] * len(subs)))
            params = [stream.id, *[p for s in subs for p in _params(s)], MANAGED_BY]
            changes += [(a, k, stream.id) for a, k in conn.execute(query, params).fetchall()]
    return changes
