"""Applying the YAML subscriptions through ``pgstream.set_subscriptions``: those it manages
(``managed_by = 'yaml'``) follow the YAML, hand-made ones are never touched, unchanged ones not rewritten
(their triggers kept), all in one transaction (a bad subscription rolls the set back)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ..config import PgstreamConfig, SubscriptionConfig
from .dbconn import first_line

MANAGED_BY = "yaml"

def apply_subscriptions(conn: psycopg.Connection, config: PgstreamConfig) -> list[tuple[str, str, int]]:
    """Make the database's YAML-managed subscriptions equal to ``config.subscriptions``; ``(action, key,
    stream_id)`` for every change. An invalid one raises ``psycopg.Error`` naming it, changing nothing."""
    changes: list[tuple[str, str, int]] = []
    with conn.transaction():
        for stream in config.streams:
            subs = [s for s in config.subscriptions if s.stream_id == stream.id]
            # jsonb_populate_record, not a row(...) constructor: robust to columns added to the table
            rows = conn.execute(
                """select action, key from pgstream.set_subscriptions(%s,
                       array(select jsonb_populate_record(null::pgstream.subscriptions, x)
                             from jsonb_array_elements(%s::jsonb) with ordinality as t(x, o) order by o),
                       %s)""",
                [stream.id, Jsonb([definition(s) for s in subs]), MANAGED_BY]).fetchall()
            changes += [(a, k, stream.id) for a, k in rows]
    return changes


#: (key, schema_name, table_name, operation): a subscription's identity within its stream.
Identity = tuple[str, str, str, str]


class SubscriptionError(ValueError):
    """A YAML subscription the database refuses; the message names the file, the key and the reason."""


def identity(sub: SubscriptionConfig) -> Identity:
    return (sub.key, sub.schema_name, sub.table_name, sub.operation)


def definition(sub: SubscriptionConfig) -> dict[str, Any]:
    """The subscription as the JSON object ``jsonb_populate_record`` turns into a table row."""
    return {"key": sub.key, "stream_id": sub.stream_id, "operation": sub.operation,
            "schema_name": sub.schema_name, "table_name": sub.table_name, "when_clause": sub.when_clause,
            "column_names": list(sub.column_names), "metadata": sub.metadata,
            "payload_extensions": [e.model_dump() for e in sub.payload_extensions],
            "metadata_extensions": [e.model_dump() for e in sub.metadata_extensions],
            "trigger_mode": sub.trigger_mode, "emit_truncate": sub.emit_truncate}


#: the fields :func:`definition` gained later, with their defaults
_ADDED_LATER: dict[str, Any] = {"trigger_mode": "row", "metadata_extensions": [], "emit_truncate": False}


def code_version(sub: SubscriptionConfig) -> str:
    """A digest of everything that defines the subscription: changes iff its trigger code may change."""
    # without the fields added later when they hold their defaults: digests from before them stay valid
    d = {k: v for k, v in definition(sub).items() if _ADDED_LATER.get(k, ...) != v}
    text = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def set_code_version(subs: list[SubscriptionConfig]) -> str:
    """A digest of which subscriptions a stream's YAML declares (membership, not content)."""
    text = json.dumps(sorted(identity(s) for s in subs), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def asset_name(sub: SubscriptionConfig, siblings: list[SubscriptionConfig]) -> str:
    """``<key>_<operation>_<schema>_<table>`` made a valid Dagster name (lower case, ``[a-z0-9_]``);
    a digest of the identity is appended only when two subscriptions of a stream would collide."""

    def slug(s: SubscriptionConfig) -> str:
        raw = "_".join((s.key, s.operation, s.schema_name, s.table_name)).lower()
        return re.sub(r"_+", "_", re.sub(r"[^a-z0-9_]", "_", raw)).strip("_") or "subscription"

    name = slug(sub)
    if sum(1 for s in siblings if slug(s) == name) > 1:
        name += "_" + hashlib.sha256(json.dumps(identity(sub)).encode()).hexdigest()[:8]
    return name


def _db_error(exc: psycopg.Error) -> str:
    return exc.diag.message_primary or first_line(exc)


def validate_all(conn: psycopg.Connection, numbered: Iterable[tuple[int, SubscriptionConfig]], source: str) -> None:
    """Validate subscriptions of a file (``source``; each with its index there) against the database without writing
    anything; raises ``SubscriptionError`` naming the file, the subscription and the reason."""
    with conn.transaction(force_rollback=True):
        for i, sub in numbered:
            try:
                with conn.transaction():
                    conn.execute("select pgstream.validate_subscription("
                                 "jsonb_populate_record(null::pgstream.subscriptions, %s))", [Jsonb(definition(sub))])
            except psycopg.Error as exc:
                raise SubscriptionError(f"{source}: subscriptions[{i}] (subscription {sub.key!r}, stream "
                                        f"{sub.stream_id}): {_db_error(exc)}") from None


#: how long a file found valid as a whole is not validated again as a whole (its streams apply one by one)
FILE_VALID_SECS = 60.0
#: (file, digest of the database and the file's subscriptions) -> when it was found valid as a whole
_valid_files: dict[tuple[str, str], float] = {}


def _validate_file(conn: psycopg.Connection, subscriptions: Sequence[SubscriptionConfig], stream_id: int,
                   source: str) -> None:
    """:func:`validate_all` of the file before one of its streams is applied, at most once per ``FILE_VALID_SECS``
    for the same content; the stream's own subscriptions are validated every time."""
    info = conn.info
    digest = hashlib.sha256(json.dumps([info.host, info.port, info.dbname, [definition(s) for s in subscriptions]],
                                       sort_keys=True, default=str).encode()).hexdigest()
    now = time.monotonic()
    if now - _valid_files.get((source, digest), -FILE_VALID_SECS) < FILE_VALID_SECS:
        validate_all(conn, [(i, s) for i, s in enumerate(subscriptions) if s.stream_id == stream_id], source)
        return
    validate_all(conn, enumerate(subscriptions), source)
    _valid_files[(source, digest)] = now


@dataclass(frozen=True)
class StreamApply:
    """What one ``set_subscriptions`` call changed: action per identity (inserted/updated/deleted)."""

    changes: dict[Identity, str]
    hand_made: int  # subscriptions of the stream not managed by the YAML (left alone)


def apply_stream(conn: psycopg.Connection, subscriptions: Sequence[SubscriptionConfig], stream_id: int, source: str,
                 selected: set[Identity] | None = None, remove_absent: bool = True) -> StreamApply:
    """Apply one stream's YAML subscriptions (its file's ``subscriptions``, all validated first:
    ``SubscriptionError``, nothing changed) in one ``set_subscriptions`` transaction: ``selected`` (default all)
    written, its other YAML-managed ones kept, ``remove_absent`` deleting the undeclared, hand-made ones never
    touched. A role that may not write them (the runtime) checks the database holds what the YAML declares."""
    row = conn.execute("select pg_catalog.has_table_privilege('pgstream.subscriptions', 'INSERT')").fetchone()
    owner = bool(row and row[0])  # the owner may write them; never the runtime
    if owner:
        _validate_file(conn, subscriptions, stream_id, source)
    yaml_subs = [s for s in subscriptions if s.stream_id == stream_id]
    declared = {identity(s) for s in yaml_subs}
    written = [s for s in yaml_subs if selected is None or identity(s) in selected]
    stored = _stored_rows(conn, stream_id)
    if not owner and (problems := list(_problems(conn, stored, written, declared, remove_absent))):
        user = conn.execute("select current_user::text").fetchone()
        raise SubscriptionError(
            f"{source}: stream {stream_id}: role {user[0] if user else '?'} may not write pgstream.subscriptions "
            f"(only the owner applies them: run `pgstream-dagster init` with the owner's URL) and the database "
            f"differs from the YAML: {'; '.join(problems)}")
    if not owner or next(_problems(conn, stored, written, declared, remove_absent), None) is None:
        # set_subscriptions would change nothing (a code location starting with all applied): no write, no lock
        return StreamApply(changes={}, hand_made=_hand_made(stored))
    written_ids = {identity(s) for s in written}
    with conn.transaction():
        # set_subscriptions' own lock, taken before we read what to keep (re-entrant in this transaction)
        conn.execute("select pgstream.lock_for_transaction('regenerate')")
        stored = _stored_rows(conn, stream_id)  # (again, under the lock)
        keep = [list(c) for c, row in sorted(stored.items()) if row["managed_by"] == MANAGED_BY
                and c not in written_ids and (c in declared or not remove_absent)]
        try:
            changed = conn.execute(
                """select action, key, schema_name, table_name, operation::text
                   from pgstream.set_subscriptions(%s,
                       array(select s from pgstream.subscriptions s
                             where s.stream_id = %s and s.managed_by is not distinct from %s
                               and exists (select 1 from jsonb_array_elements(%s::jsonb) k
                                           where k ->> 0 = s.key and k ->> 1 = s.schema_name
                                             and k ->> 2 = s.table_name and k ->> 3 = s.operation::text))
                       || array(select jsonb_populate_record(null::pgstream.subscriptions, x)
                                from jsonb_array_elements(%s::jsonb) x),
                       %s)""",
                [stream_id, stream_id, MANAGED_BY, Jsonb(keep), Jsonb([definition(s) for s in written]), MANAGED_BY],
            ).fetchall()
        except psycopg.Error as exc:
            raise SubscriptionError(f"{source}: stream {stream_id}: {_db_error(exc)}") from None
    return StreamApply(changes={(r[1], r[2], r[3], r[4]): r[0] for r in changed}, hand_made=_hand_made(stored))


def _problems(conn: psycopg.Connection, stored: dict[Identity, dict[str, Any]], written: Sequence[SubscriptionConfig],
              declared: set[Identity], remove_absent: bool) -> Iterator[str]:
    """How the ``stored`` subscriptions differ from ``written`` as declared (and, ``remove_absent``, which
    undeclared YAML-managed ones they hold), one line each; none: ``set_subscriptions`` would change nothing."""
    for sub in written:
        row = stored.get(identity(sub))
        named = f"{sub.key!r} ({sub.operation} on {sub.schema_name}.{sub.table_name})"
        if row is None and not table_exists(conn, sub.schema_name, sub.table_name):
            yield f"{sub.key!r} ({sub.operation}): table {sub.schema_name}.{sub.table_name} does not exist"
        elif row is None:
            yield f"{named} is missing"
        elif row["managed_by"] != MANAGED_BY:
            yield f"{named} was created by hand"
        elif diff := differences(sub, row):
            yield f"{named}: {', '.join(diff)} differ"
    if remove_absent:
        yield from (f"{k!r} ({op} on {schema}.{table}) is no longer declared"
                    for (k, schema, table, op), row in stored.items()
                    if row["managed_by"] == MANAGED_BY and (k, schema, table, op) not in declared)


def _stored_rows(conn: psycopg.Connection, stream_id: int,
                 ident: Identity | None = None) -> dict[Identity, dict[str, Any]]:
    """The stream's stored subscriptions (``ident``'s only: one row by its key, not the whole stream): their
    :data:`_STORED_FIELDS`, as ``definition`` has them."""
    columns = ", ".join(_STORED_FIELDS)
    one = " and (key, schema_name, table_name, operation::text) = (%s, %s, %s, %s)" if ident is not None else ""
    rows = conn.execute(f"select key, schema_name, table_name, operation::text, {columns} "  # noqa: S608
                        f"from pgstream.subscriptions where stream_id = %s{one}",  # (column lists, no input)
                        [stream_id, *(ident or ())]).fetchall()
    return {(r[0], r[1], r[2], r[3]): dict(zip(_STORED_FIELDS, r[4:], strict=True)) for r in rows}


def _hand_made(stored: dict[Identity, dict[str, Any]]) -> int:
    return sum(1 for row in stored.values() if row["managed_by"] != MANAGED_BY)


def table_exists(conn: psycopg.Connection, schema: str, table: str) -> bool:
    """Whether ``schema.table`` exists (read from the catalog: whatever the role's privileges on it)."""
    row = conn.execute("select exists (select 1 from pg_catalog.pg_class c join pg_catalog.pg_namespace n "
                       "on n.oid = c.relnamespace where n.nspname = %s and c.relname = %s)", [schema, table]).fetchone()
    return bool(row and row[0])


@dataclass(frozen=True)
class TriggerState:
    """The installed trigger of one (schema, table, operation) compared with what pgstream generates."""

    trigger_name: str
    function_name: str
    expected_hash: str | None  # null: no subscription targets it
    function_body: str | None
    when_clause: str | None
    trigger_oid: int | None = None
    installed_hash: str | None = None
    installed_function: str | None = None
    installed_source: str | None = None
    enabled: str | None = None  # pg_trigger.tgenabled: O/A/R fire, D disabled
    mode: str = "row"  # 'row' or 'statement' (trigger_mode)
    #: the function is SECURITY DEFINER, owned by pgstream_writer, with search_path = pg_catalog, pg_temp
    installed_confined: bool | None = None
    #: why partitions of a partitioned table lack their copies of its generated triggers (see partition_problems)
    partition_problems: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        """Why the installed trigger does not match its definition (empty: it matches)."""
        if self.expected_hash is None:
            return ["no subscription targets this table and operation"]
        if self.trigger_oid is None:
            return [f"trigger {self.trigger_name} does not exist"]
        out: list[str] = []
        if self.installed_hash != self.expected_hash:
            out.append(f"trigger {self.trigger_name} was not generated from the current subscriptions "
                       f"(comment {self.installed_hash!r}, expected {self.expected_hash!r})")
        if self.installed_function != self.function_name:
            out.append(f"trigger calls pgstream.{self.installed_function}(), expected pgstream.{self.function_name}()")
        elif self.installed_source != self.function_body:
            out.append(f"function pgstream.{self.function_name}() was changed by hand")
        elif not self.installed_confined:
            out.append(f"function pgstream.{self.function_name}() runs as its caller or without its search_path "
                       f"(it must be SECURITY DEFINER, owned by pgstream_writer, with search_path = pg_catalog, "
                       f"pg_temp: changed by code that ran as pgstream_writer on an install without the drift "
                       f"guard?): pgstream.repair_trigger restores it")
        if self.enabled == "D":
            out.append(f"trigger {self.trigger_name} is disabled")
        return out + list(self.partition_problems)


def trigger_state(conn: psycopg.Connection, schema: str, table: str, operation: str,
                  mode: str = "row") -> TriggerState:
    """The installed ``mode`` ('row' or 'statement') trigger of a table and operation vs its definition."""
    # the owner's function (it checks the expressions, which the runtime may not); the installed trigger is
    # read from the catalog by name (the runtime has no USAGE on the table's schema for to_regclass)
    row = conn.execute(
        """select g.trigger_name, g.function_name, g.function_body, g.when_clause, g.trigger_hash
           from pgstream.expected_trigger(%(schema)s, %(table)s, %(op)s::pgstream.operation_type, %(mode)s) g""",
        {"schema": schema, "table": table, "op": operation, "mode": mode}).fetchone()
    assert row is not None
    state = TriggerState(trigger_name=row[0], function_name=row[1], function_body=row[2], when_clause=row[3],
                         expected_hash=row[4], mode=mode)
    installed = conn.execute(
        """select t.oid::bigint, obj_description(t.oid, 'pg_trigger'), p.proname::text, p.prosrc, t.tgenabled::text,
                  p.prosecdef and p.proowner = 'pgstream_writer'::regrole
                  and p.proconfig = array['search_path=pg_catalog, pg_temp']
           from pg_catalog.pg_trigger t join pg_catalog.pg_proc p on p.oid = t.tgfoid
           join pg_catalog.pg_class c on c.oid = t.tgrelid
           join pg_catalog.pg_namespace n on n.oid = c.relnamespace
           where n.nspname = %s and c.relname = %s and t.tgname = %s""",
        [schema, table, state.trigger_name]).fetchone()
    if installed is None:
        return state
    return replace(state, trigger_oid=installed[0], installed_hash=installed[1], installed_function=installed[2],
                   installed_source=installed[3], enabled=installed[4], installed_confined=installed[5],
                   partition_problems=partition_problems(conn, schema, table, operation, state.trigger_name))


def partition_problems(conn: psycopg.Connection, schema: str, table: str, operation: str,
                       trigger_name: str) -> tuple[str, ...]:
    """Why partitions of a partitioned table lack their copy of its generated trigger ``trigger_name`` (for DELETE,
    its TRUNCATE one too): same name and function, enabled, same comment, known by the function it calls."""
    rows = conn.execute(
        """select p.relid::regclass::text, r.tgname::text, c.tgfoid::regprocedure::text, c.tgfoid = r.tgfoid,
                  c.tgenabled = 'D'
           from pg_catalog.pg_trigger r
           join pg_catalog.pg_proc f on f.oid = r.tgfoid and f.pronamespace = 'pgstream'::regnamespace
           cross join lateral pg_catalog.pg_partition_tree(r.tgrelid) p
           left join pg_catalog.pg_trigger c on c.tgrelid = p.relid and c.tgname = r.tgname
           where r.tgrelid = (select c.oid from pg_catalog.pg_class c  -- by name: no right on its schema needed
                              join pg_catalog.pg_namespace n on n.oid = c.relnamespace
                              where n.nspname = %(schema)s and c.relname = %(table)s)
             and p.relid <> r.tgrelid
             and (r.tgname = %(trigger)s or (%(op)s = 'DELETE' and r.tgtype & 32 <> 0))
             and (c.oid is null or c.tgfoid <> r.tgfoid or c.tgenabled = 'D'
                  or obj_description(c.oid, 'pg_trigger') is distinct from obj_description(r.oid, 'pg_trigger'))
           order by p.level, 1, 2""",
        {"schema": schema, "table": table, "trigger": trigger_name, "op": operation}).fetchall()
    out: list[str] = []
    for partition, name, calls, same_function, disabled in rows:
        if calls is None:
            out.append(f"partition {partition} has no copy of trigger {name}")
        elif not same_function:
            out.append(f"partition {partition} has a trigger {name} of its own, calling {calls}, "
                       f"instead of the copy of the table's")
        elif disabled:
            out.append(f"trigger {name} on partition {partition} is disabled")
        else:
            out.append(f"trigger {name} on partition {partition} was not generated from the current subscriptions")
    return tuple(out)


#: the stored columns :func:`differences` compares, in its order, and ``managed_by``
_STORED_FIELDS = ("when_clause", "column_names", "metadata", "payload_extensions", "metadata_extensions",
                  "trigger_mode", "emit_truncate", "managed_by")


def stored_definition(conn: psycopg.Connection, stream_id: int, ident: Identity) -> dict[str, Any] | None:
    """The subscription row as stored (normalised like ``definition``), or None."""
    return _stored_rows(conn, stream_id, ident).get(ident)


def differences(sub: SubscriptionConfig, stored: dict[str, Any]) -> list[str]:
    """Fields where the stored subscription differs from the YAML (as ``set_subscriptions`` stores it)."""
    want = definition(sub)
    want["when_clause"] = (sub.when_clause or "").strip() or None
    return [f for f in _STORED_FIELDS[:-1] if stored[f] != want[f]]
