"""Apply the versioned SQL in ``sql/`` in order, once, under an advisory lock.

Each file ``NNN_name.sql`` is a migration with version ``NNN``; ``000_bootstrap.sql`` creates the
schema and the ``pgstream.schema_migrations`` ledger and runs on every pass. Files are idempotent,
so re-running is harmless; the ledger makes it a no-op. A checksum mismatch for an applied
version is an error: released migrations are never edited, new behaviour gets a new file.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg

#: The NOLOGIN role that owns the generated trigger functions (sql/012_least_privilege.sql).
WRITER_ROLE = "pgstream_writer"

#: Key of the session-independent advisory lock that serialises concurrent migrators.
MIGRATION_LOCK_KEY = 0x70677374  # "pgst"

#: Key of the transaction-level advisory lock that serialises ``pgstream.create_partitions`` and
#: ``pgstream.drop_partitions`` (sql/013_collisions.sql): concurrent callers deadlocked attaching.
PARTITION_LOCK_KEY = 0x70677370  # "pgsp" = 1885827952

_FILE = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path

    @property
    def sql(self) -> str:
        return self.path.read_text(encoding="utf-8")

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


class MigrationError(RuntimeError):
    """A migration could not be applied; the database is unchanged by the failing file."""


def sql_dir() -> Path:
    """The ``sql/`` directory: beside the package in a checkout, inside it when installed."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "sql", here / "sql"):
        if (candidate / "000_bootstrap.sql").exists():
            return candidate
    raise MigrationError(f"cannot find the pgstream sql/ directory near {here}")


def discover(directory: Path | None = None) -> list[Migration]:
    found: list[Migration] = []
    for path in sorted((directory or sql_dir()).glob("*.sql")):
        m = _FILE.match(path.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), path))
    versions = [m.version for m in found]
    if len(versions) != len(set(versions)):
        raise MigrationError(f"duplicate migration versions in {directory or sql_dir()}")
    return found


def _iter_pending(conn: psycopg.Connection, migrations: list[Migration]) -> Iterator[Migration]:
    applied = dict(conn.execute("select version, checksum from pgstream.schema_migrations").fetchall())
    for m in migrations:
        if m.version == 0:
            continue
        if m.version in applied:
            if applied[m.version] != m.checksum:
                raise MigrationError(
                    f"migration {m.path.name} was changed after it was applied "
                    f"(checksum {applied[m.version][:12]} in the database, {m.checksum[:12]} on disk)"
                )
            continue
        yield m


def migrate(database_url: str, *, partitions_ahead: int = 7, directory: Path | None = None) -> list[str]:
    """Apply pending migrations and create today's and the next partitions.

    Returns the names of the migrations applied (empty when already up to date). Each migration
    runs in its own transaction together with its ledger row.
    """
    migrations = discover(directory)
    applied: list[str] = []
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("select pg_advisory_lock(%s)", [MIGRATION_LOCK_KEY])
        try:
            with conn.transaction():
                conn.execute(migrations[0].sql)
            for m in list(_iter_pending(conn, migrations)):
                try:
                    with conn.transaction():
                        conn.execute(m.sql)
                        conn.execute(
                            "insert into pgstream.schema_migrations (version, name, checksum) "
                            "values (%s, %s, %s)",
                            [m.version, m.name, m.checksum],
                        )
                except psycopg.Error as exc:
                    raise MigrationError(f"migration {m.path.name} failed: {exc}") from exc
                applied.append(m.path.name)
            conn.execute("select pgstream.create_partitions(%s)", [partitions_ahead])
        finally:
            conn.execute("select pg_advisory_unlock(%s)", [MIGRATION_LOCK_KEY])
    return applied


def tear_down(database_url: str) -> list[str]:
    """Remove every trace of pgstream from the database and return what was removed.

    Drops the drift-guard event triggers, the generated triggers on user tables, the stream
    publications, the ``pgstream`` schema (events included) and the stream replication slots.
    """
    from psycopg import sql

    removed: list[str] = []
    with psycopg.connect(database_url, autocommit=True) as conn:
        had_schema = _schema_exists(conn)
        with conn.transaction():
            # the drift guard goes first (dropping an event trigger fires none), so nothing below meets it
            for (name,) in conn.execute(
                "select evtname from pg_event_trigger where evtname like 'pgstream\\_%' order by 1"
            ).fetchall():
                conn.execute(sql.SQL("drop event trigger {}").format(sql.Identifier(name)))
                removed.append(f"event trigger {name}")
            rows = conn.execute(
                """
                select t.tgname, n.nspname, c.relname
                from pg_trigger t
                join pg_class c on c.oid = t.tgrelid
                join pg_namespace n on n.oid = c.relnamespace
                join pg_proc p on p.oid = t.tgfoid
                where p.pronamespace = 'pgstream'::regnamespace and not t.tgisinternal
                  and n.nspname <> 'pgstream'
                order by 2, 3, 1
                """
            ).fetchall() if had_schema else []
            for tgname, schema, table in rows:
                conn.execute(
                    sql.SQL("drop trigger {} on {}.{}").format(
                        sql.Identifier(tgname), sql.Identifier(schema), sql.Identifier(table)
                    )
                )
                removed.append(f"trigger {tgname} on {schema}.{table}")
            for (pub,) in conn.execute(
                "select pubname from pg_publication where pubname like 'pgstream\\_stream\\_%' order by 1"
            ).fetchall():
                conn.execute(sql.SQL("drop publication {}").format(sql.Identifier(pub)))
                removed.append(f"publication {pub}")
            if had_schema:
                conn.execute("drop schema pgstream cascade")
                removed.append("schema pgstream (events, streams, subscriptions, functions)")
        for slot, pid in conn.execute(
            "select slot_name, active_pid from pg_replication_slots "
            "where slot_name like 'pgstream\\_%' and database = current_database() order by 1"
        ).fetchall():
            if pid is not None:
                conn.execute("select pg_terminate_backend(%s)", [pid])
            conn.execute("select pg_drop_replication_slot(%s)", [slot])
            removed.append(f"replication slot {slot}")
        # the role is the cluster's: it stays while pgstream in another database uses it
        if had_schema and conn.execute("select 1 from pg_roles where rolname = %s", [WRITER_ROLE]).fetchone():
            try:
                with conn.transaction():
                    conn.execute(sql.SQL("drop role {}").format(sql.Identifier(WRITER_ROLE)))
                removed.append(f"role {WRITER_ROLE}")
            except (psycopg.errors.DependentObjectsStillExist, psycopg.errors.InsufficientPrivilege):
                pass
    return removed


def _schema_exists(conn: psycopg.Connection) -> bool:
    return conn.execute("select to_regnamespace('pgstream') is not null").fetchone() == (True,)
