"""A snapshot of what pgstream put in a database's catalog, to compare two installs.

Everything in schema ``pgstream`` (functions with their full definition, owner, privileges and
settings; relations with their columns, defaults, constraints, indexes, owner and privileges,
column privileges included; views' definitions; types), every trigger on a pgstream table or
calling a pgstream function (definition, enabled state, comment), the event triggers, the schema's
privileges and default privileges, and the stream publications. Object ids are left out, and the
daily partitions ``events_YYYYMMDD`` are one entry (``events_<day>``), so two installs made on
different days or in a different order compare equal when they hold the same definitions.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

_DAY = re.compile(r"events_[0-9]{8}")

_QUERIES: dict[str, str] = {
    "schema": """
        select n.nspname, n.nspowner::regrole::text, array(select a::text from unnest(n.nspacl) a order by 1)
        from pg_namespace n where n.nspname = 'pgstream'""",
    "default privileges": """
        select d.defaclrole::regrole::text, d.defaclobjtype::text,
               array(select a::text from unnest(d.defaclacl) a order by 1)
        from pg_default_acl d where d.defaclnamespace = 'pgstream'::regnamespace""",
    "functions": """
        select p.oid::regprocedure::text, pg_get_functiondef(p.oid), p.proowner::regrole::text,
               array(select a::text from unnest(p.proacl) a order by 1), p.proconfig,
               obj_description(p.oid, 'pg_proc')
        from pg_proc p where p.pronamespace = 'pgstream'::regnamespace""",
    "relations": """
        select c.relname::text, c.relkind::text, c.relowner::regrole::text,
               array(select a::text from unnest(c.relacl) a order by 1), c.reloptions, c.relpersistence::text,
               obj_description(c.oid, 'pg_class')
        from pg_class c where c.relnamespace = 'pgstream'::regnamespace""",
    "columns": """
        select c.relname::text, a.attnum, a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               a.attidentity::text, a.attgenerated::text, pg_get_expr(d.adbin, d.adrelid),
               array(select x::text from unnest(a.attacl) x order by 1)
        from pg_attribute a
        join pg_class c on c.oid = a.attrelid
        left join pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum
        where c.relnamespace = 'pgstream'::regnamespace and c.relkind in ('r', 'p', 'v', 'S')
          and a.attnum > 0 and not a.attisdropped""",
    "constraints": """
        select c.relname::text, k.conname::text, pg_get_constraintdef(k.oid)
        from pg_constraint k join pg_class c on c.oid = k.conrelid
        where c.relnamespace = 'pgstream'::regnamespace""",
    "indexes": """
        select c.relname::text, pg_get_indexdef(i.indexrelid)
        from pg_index i join pg_class c on c.oid = i.indexrelid
        where c.relnamespace = 'pgstream'::regnamespace""",
    "views": """
        select c.relname::text, pg_get_viewdef(c.oid)
        from pg_class c where c.relnamespace = 'pgstream'::regnamespace and c.relkind in ('v', 'm')""",
    "types": """
        select t.typname::text, t.typtype::text, t.typowner::regrole::text,
               array(select e.enumlabel::text from pg_enum e where e.enumtypid = t.oid order by e.enumsortorder)
        from pg_type t
        where t.typnamespace = 'pgstream'::regnamespace and t.typtype in ('e', 'd', 'c')
          and (t.typtype <> 'c' or exists (select 1 from pg_class c where c.oid = t.typrelid and c.relkind = 'c'))""",
    "triggers": """
        select t.tgrelid::regclass::text, t.tgname::text, pg_get_triggerdef(t.oid), t.tgenabled::text,
               obj_description(t.oid, 'pg_trigger')
        from pg_trigger t
        join pg_class c on c.oid = t.tgrelid
        join pg_proc p on p.oid = t.tgfoid
        where not t.tgisinternal
          and (c.relnamespace = 'pgstream'::regnamespace or p.pronamespace = 'pgstream'::regnamespace)""",
    "event triggers": """
        select e.evtname::text, e.evtevent::text, e.evtfoid::regprocedure::text, e.evtenabled::text,
               e.evttags, e.evtowner::regrole::text
        from pg_event_trigger e where e.evtname like 'pgstream%'""",
    "publications": """
        select p.pubname::text, p.pubinsert, p.pubupdate, p.pubdelete, p.pubtruncate, p.pubviaroot,
               t.schemaname::text || '.' || t.tablename::text, t.attnames, t.rowfilter
        from pg_publication p left join pg_publication_tables t on t.pubname = p.pubname
        where p.pubname like 'pgstream%'""",
}


def _normalise(value: Any) -> Any:
    if isinstance(value, str):
        return _DAY.sub("events_<day>", value)
    if isinstance(value, (list, tuple)):
        return tuple(_normalise(v) for v in value)
    return value


def snapshot(conn: psycopg.Connection) -> dict[str, list[tuple[Any, ...]]]:
    """The catalog pgstream owns, per kind of object: sorted rows, duplicates (the daily partitions,
    once named ``events_<day>``) removed."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for kind, query in _QUERIES.items():
        rows = {_normalise(tuple(row)) for row in conn.execute(query).fetchall()}
        out[kind] = sorted(rows, key=repr)
    return out


def differences(a: dict[str, list[tuple[Any, ...]]], b: dict[str, list[tuple[Any, ...]]]) -> list[str]:
    """What one snapshot has that the other has not, one line per row ("-" only in a, "+" only in b)."""
    lines: list[str] = []
    for kind in sorted(set(a) | set(b)):
        left, right = set(a.get(kind, [])), set(b.get(kind, []))
        lines += [f"{kind} - {row!r}" for row in sorted(left - right, key=repr)]
        lines += [f"{kind} + {row!r}" for row in sorted(right - left, key=repr)]
    return lines
