"""Install and upgrade the pgstream schema from ``sql/``, one migrator at a time (docs/development.md).
Versioned migrations (``sql/NNN_name.sql``: what has state) apply once each, in order, each in a transaction
with its row in ``pgstream.schema_migrations``, and keep their checksum (but :data:`RELEASED_CHECKSUMS`);
``000_bootstrap.sql`` runs every pass. Then each repeatable file (``sql/repeatable/NN_concern.sql``: every
function, view and trigger, idempotent) whose checksum differs from ``pgstream.schema_repeatables``, in order.
A versioned migration never creates a function, view or trigger nor calls a pgstream function (an upgrade
would run the previous release's); a data step that needs one ends the repeatable file defining it.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psycopg
from psycopg import sql

from ..config import STREAM_NAME_PREFIX
from . import dbconn

#: The NOLOGIN role that owns the generated trigger functions (sql/012_least_privilege.sql).
WRITER_ROLE = "pgstream_writer"

#: the advisory lock taken only to create the schema (``000_bootstrap.sql``); then the ledger's lock (:func:`_locked`)
BOOTSTRAP_LOCK_KEY = 0x70677374  # "pgst"

#: How long a first install waits for :data:`BOOTSTRAP_LOCK_KEY` before it names who holds it.
BOOTSTRAP_LOCK_TIMEOUT = "60s"

REPEATABLE_DIR = "repeatable"

#: The sha256 of the versioned migrations rewritten since 0.1.0 (7ed30b0) as released then: an applied version
#: is accepted with it or its current one. Never add nor change one (tests/fixtures/sql-0.1-014.tar.gz).
RELEASED_CHECKSUMS: dict[int, str] = {
    1: "ef2c8b8114b6cd70125e7c8faf9bd992c195179a38cc5f73f564b2bb1ad64093",  # 001_core.sql
    2: "9f20fc7fb1a0a47c8e80db698a6e867d58c81b07ded038f9d9c6d026732386d7",  # 002_partitions.sql
    3: "55d3642f9a06febe3b1459b0c34edc10f590067f5504b7e1603663eb43e26cc1",  # 003_subscriptions.sql
    4: "1c4bb804fc933b6713c588fb18ac54d888b7f1ec96e7252d3a3770326988b3f5",  # 004_drift_guard.sql
    5: "9a16653f6f5aa7fea286b4df43bea568700be16c4b03f6b868481832a92655d9",  # 005_privileges.sql
    6: "003ecd05656da28e4569328d0161a30d7c4416545239472a19b6444e390b4ad2",  # 006_ledger.sql
    7: "ea4d9abc4e600d0e46a5d4c2c2e5be8284915f8b69a86313f2270ac3cf2d5906",  # 007_failover.sql
    8: "c659deeab63fd79401bbd10ad797dd6c1c02a06fa65f4f83a9e57de38edfe213",  # 008_status.sql
    9: "92386fd4d3a0f9202c9cfd5bcf7d18486c5280bfad641d5d4a8e94b65f1beb7f",  # 009_statement_triggers.sql
    11: "2427dbed7a3003e7cc340cc79271637d37e482f292be801a22962f3c1de69706",  # 011_publication_columns.sql
    12: "d8d5df4462f257e2f8407fe7ec038abf28dd817762d1f8b08d27614376aaf3d9",  # 012_least_privilege.sql
    13: "4682ca18d939cd73297afdc6a8c38261d88399c3becee81a83e9bfc532e8caaa",  # 013_collisions.sql
    14: "fd6a8b10da122461b04fccad280fa4a214b405ac83e1e333bce38b0bf75f12f9",  # 014_event_integrity.sql
}

_FILE = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")
_REPEATABLE_FILE = re.compile(r"^(\d{2})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class _SqlFile:
    path: Path

    @property
    def sql(self) -> str:
        return self.path.read_text(encoding="utf-8")

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Migration(_SqlFile):
    """A versioned migration ``sql/NNN_name.sql``."""

    version: int
    name: str


@dataclass(frozen=True)
class Repeatable(_SqlFile):
    """A file of ``sql/repeatable/``, known by its name there (``04_subscriptions.sql``)."""

    name: str


class MigrationError(RuntimeError):
    """A migration could not be applied; the database is unchanged by the failing file."""


def sql_dir() -> Path:
    """The ``sql/`` directory: beside the package in a checkout, inside it when installed."""
    here = Path(__file__).resolve().parent.parent  # the package (this module is in engine/)
    for candidate in (here.parent / "sql", here / "sql"):
        if (candidate / "000_bootstrap.sql").exists():
            return candidate
    raise MigrationError(f"cannot find the pgstream sql/ directory near {here}")


def discover(directory: Path | None = None) -> list[Migration]:
    directory = directory or sql_dir()
    found = [Migration(path, int(m.group(1)), m.group(2)) for path in sorted(directory.glob("*.sql"))
             if (m := _FILE.match(path.name))]
    if len({m.version for m in found}) != len(found):
        raise MigrationError(f"duplicate migration versions in {directory}")
    return found


def discover_repeatables(directory: Path | None = None) -> list[Repeatable]:
    """The repeatable files of ``<directory>/repeatable/``, in the order they are applied (none for
    a directory without one, such as a release from before repeatable files)."""
    directory = (directory or sql_dir()) / REPEATABLE_DIR
    found = [Repeatable(p, p.name) for p in sorted(directory.glob("*.sql"))]
    if misnamed := [r.name for r in found if not _REPEATABLE_FILE.match(r.name)]:
        raise MigrationError(f"repeatable files must be named NN_name.sql: {', '.join(misnamed)}")
    if len({r.name[:2] for r in found}) != len(found):
        raise MigrationError(f"duplicate repeatable file numbers in {directory}")
    return found


def _locked(conn: psycopg.Connection) -> None:
    """Queue behind any other migrator until this transaction ends: the ledger table's own lock, which
    only its owner can take (an advisory lock could be held by any role that can connect)."""
    conn.execute("lock table pgstream.schema_migrations in exclusive mode")


def _bootstrap(conn: psycopg.Connection, bootstrap: Migration) -> None:
    """``000_bootstrap.sql``, idempotent, behind the ledger's lock, or on a database without the ledger
    behind a transaction-level advisory lock waited for :data:`BOOTSTRAP_LOCK_TIMEOUT` at most."""
    def ledger_exists() -> bool:
        row = conn.execute("select pg_catalog.to_regclass('pgstream.schema_migrations') is not null").fetchone()
        return bool(row and row[0])

    def step() -> None:
        if not ledger_exists():
            conn.execute(f"set local lock_timeout = '{BOOTSTRAP_LOCK_TIMEOUT}'")
            conn.execute("select pg_catalog.pg_advisory_xact_lock(%s)", [BOOTSTRAP_LOCK_KEY])
            conn.execute("set local lock_timeout = 0")
        # a migrator that bootstrapped meanwhile is applying files: queue behind it, not race its DDL (the look-up
        # after the wait may still miss its ledger, from this session's catalog caches: then the race is lost and
        # the transaction tried again, which sees it)
        if ledger_exists():
            _locked(conn)
        conn.execute(_SAFE_SEARCH_PATH)
        conn.execute(bootstrap.sql)

    try:
        _retried(conn, step, locked=False)
    except psycopg.errors.LockNotAvailable as exc:
        holders = conn.execute(
            "select l.pid, a.usename from pg_catalog.pg_locks l left join pg_catalog.pg_stat_activity a using (pid) "
            "where l.locktype = 'advisory' and l.granted and l.objid = %s::pg_catalog.oid and l.objsubid = 1",
            [BOOTSTRAP_LOCK_KEY]).fetchall()
        who = ", ".join(f"pid {pid} (role {user})" for pid, user in holders) or "another session"
        raise MigrationError(
            f"creating schema pgstream: {who} has held advisory lock {BOOTSTRAP_LOCK_KEY} for longer than "
            f"{BOOTSTRAP_LOCK_TIMEOUT}; a migrator holds it only for a moment, so end that session "
            "(pg_terminate_backend) and run migrate again") from exc


#: what every file runs under: a view binds the functions and operators it names when created, so the
#: migrator's own search_path could bind a role's ``||(text, bigint)`` (until the file's transaction ends)
_SAFE_SEARCH_PATH = "set local search_path = pg_catalog, pg_temp"


#: a file's transaction is pgstream's own DDL (pgstream.internal_ddl, the owner's only), which the drift guard
#: lets create, replace and drop functions in schema pgstream (no guard before the table exists)
_INTERNAL_DDL_BEGIN = """
    select pg_catalog.to_regclass('pgstream.internal_ddl') is not null
       and pg_catalog.has_table_privilege('pgstream.internal_ddl', 'INSERT')"""
_INTERNAL_DDL_MARK = ("insert into pgstream.internal_ddl (xid) values (pg_catalog.pg_current_xact_id()) "
                      "on conflict (xid) do nothing")
_INTERNAL_DDL_UNMARK = "delete from pgstream.internal_ddl where xid = pg_catalog.pg_current_xact_id()"


def _apply(conn: psycopg.Connection, file: _SqlFile, label: str, record: str, params: list[object]) -> None:
    """Runs one file and records it, in a savepoint of the caller's transaction."""
    try:
        with conn.transaction():
            conn.execute(_SAFE_SEARCH_PATH)
            row = conn.execute(_INTERNAL_DDL_BEGIN).fetchone()
            marked = bool(row and row[0])
            if marked:
                conn.execute(_INTERNAL_DDL_MARK)
            conn.execute(file.sql)
            if marked:
                conn.execute(_INTERNAL_DDL_UNMARK)
            conn.execute(record, params)
    except psycopg.Error as exc:
        raise MigrationError(f"{label} failed: {exc}") from exc


def migrate(database_url: str, *, partitions_ahead: int = 7, directory: Path | None = None) -> list[str]:
    """Apply the pending versioned migrations, then the changed repeatable files, each with its ledger row behind
    the ledger's lock, and create the partitions; the files applied (``repeatable/04_subscriptions.sql``, ...)."""
    migrations = discover(directory)
    repeatables = discover_repeatables(directory)
    applied: list[str] = []
    with dbconn.connect(database_url, autocommit=True) as conn:
        _bootstrap(conn, migrations[0])
        while (m := _retried(conn, lambda: _next_migration(conn, migrations))) is not None:
            applied.append(m.path.name)
        while (r := _retried(conn, lambda: _next_repeatable(conn, repeatables))) is not None:
            applied.append(f"{REPEATABLE_DIR}/{r.name}")
        grants = repeatables[-1] if repeatables else None
        if grants is not None and applied and f"{REPEATABLE_DIR}/{grants.name}" not in applied:
            # the last file holds every grant to the runtime roles: a function re-created earlier needs them again
            _retried(conn, lambda: _apply(conn, grants, f"repeatable {REPEATABLE_DIR}/{grants.name}",
                                          "update pgstream.schema_repeatables set applied_at = now() where name = %s",
                                          [grants.name]))
        # (behind the ledger's lock: a partition clones the events table's triggers, which a migrator may replace)
        _retried(conn, lambda: conn.execute("select pgstream.create_partitions(%s)", [partitions_ahead]))
    return applied


#: what a race with another database's migrator makes a file fail with once: rolled back, tried again
_RACES = (psycopg.errors.InternalError_, psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject)
_RACE_ATTEMPTS = 5
_T = TypeVar("_T")


def _retried(conn: psycopg.Connection, step: Callable[[], _T], *, locked: bool = True) -> _T:
    """``step`` in a transaction behind the ledger's lock (:func:`_locked`; ``locked=False``: ``step`` takes its
    own), tried again a few times when it lost a race on the catalogs (two databases migrated at once both create
    or grant the same role: "tuple concurrently updated")."""
    for attempt in range(_RACE_ATTEMPTS):
        try:
            with conn.transaction():
                if locked:
                    _locked(conn)
                return step()
        except (MigrationError, *_RACES) as exc:
            cause = exc.__cause__ if isinstance(exc, MigrationError) else exc  # (_apply names the file)
            lost = isinstance(cause, _RACES) and (not isinstance(cause, psycopg.errors.InternalError_)
                                                  or "concurrently" in str(cause))
            if not lost or attempt == _RACE_ATTEMPTS - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def _next_migration(conn: psycopg.Connection, migrations: list[Migration]) -> Migration | None:
    """The first versioned migration not applied yet, applied with its ledger row (None: none), refusing one changed
    after it was applied."""
    applied: dict[int, str] = dict(conn.execute("select version, checksum from pgstream.schema_migrations").fetchall())
    for m in migrations[1:]:  # (000_bootstrap.sql: _bootstrap)
        if m.version not in applied:
            _apply(conn, m, f"migration {m.path.name}",
                   "insert into pgstream.schema_migrations (version, name, checksum) values (%s, %s, %s)",
                   [m.version, m.name, m.checksum])
            return m
        if applied[m.version] not in (m.checksum, RELEASED_CHECKSUMS.get(m.version)):
            raise MigrationError(f"migration {m.path.name} was changed after it was applied "
                                 f"(checksum {applied[m.version][:12]} in the database, {m.checksum[:12]} on disk)")
    return None


def _next_repeatable(conn: psycopg.Connection, repeatables: list[Repeatable]) -> Repeatable | None:
    """The first repeatable file whose checksum differs from the one it was last applied with, applied with its
    ledger row (None: none)."""
    if not repeatables:  # a directory of released files, from before repeatable files
        return None
    applied: dict[str, str] = dict(conn.execute("select name, checksum from pgstream.schema_repeatables").fetchall())
    r = next((r for r in repeatables if applied.get(r.name) != r.checksum), None)
    if r is not None:
        _apply(conn, r, f"repeatable {REPEATABLE_DIR}/{r.name}",
               "insert into pgstream.schema_repeatables (name, checksum) values (%s, %s) "
               "on conflict (name) do update set checksum = excluded.checksum, applied_at = now()",
               [r.name, r.checksum])
    return r


#: the drift guard's event triggers, which only a superuser (on Amazon RDS, its master user) can create
DRIFT_GUARD_TRIGGERS = ("pgstream_drift_guard_alter", "pgstream_drift_guard_drop", "pgstream_drift_guard_start")


def drift_guard_installed(conn: psycopg.Connection) -> bool:
    """Whether every event trigger of the schema-drift guard exists and is enabled."""
    row = conn.execute("select count(*) from pg_catalog.pg_event_trigger where evtname = any(%s) and evtenabled <> 'D'",
                       [list(DRIFT_GUARD_TRIGGERS)]).fetchone()
    return bool(row and row[0] == len(DRIFT_GUARD_TRIGGERS))


#: what ``migrate`` and ``init`` say when a non-superuser owner installed pgstream: the guard is not active
DRIFT_GUARD_MISSING = ("warning: the schema-drift guard is NOT active (its event triggers need a superuser): a table "
                       "owner can drop, rename, disable or retype what a subscription depends on (docs/security.md, "
                       "Without the drift guard). A superuser installs it with: pgstream-dagster install-drift-guard "
                       "--database-url <superuser URL>")


def install_drift_guard(superuser_url: str) -> None:
    """Create the drift guard's event triggers as a superuser (RDS: its master user), the event-trigger step of
    ``repeatable/05_drift_guard.sql`` again; :class:`MigrationError` when it may not, or pgstream is not installed."""
    guard = next((r for r in discover_repeatables() if r.name.endswith("_drift_guard.sql")), None)
    if guard is None:
        raise MigrationError("cannot find the drift guard's repeatable file")
    marker = "-- The event triggers"
    text = guard.sql
    if marker not in text:
        raise MigrationError(f"{guard.name}: cannot find the event-trigger step ({marker!r})")
    step = text[text.index(marker):]
    with dbconn.connect(superuser_url, autocommit=True) as conn:
        if not _schema_exists(conn):
            raise MigrationError("install-drift-guard: pgstream is not installed in this database: run "
                                 "`pgstream-dagster migrate` first")
        # tried, not checked (RDS's master user may); a role that may not changes nothing (its block catches it)
        with conn.transaction():
            conn.execute(_SAFE_SEARCH_PATH)
            conn.execute(step)
        if not drift_guard_installed(conn):
            raise MigrationError("install-drift-guard: the role of --database-url may not create event triggers: it "
                                 "must be a superuser (on Amazon RDS: the master user); nothing was changed")


class TearDownRefused(RuntimeError):
    """Objects outside schema ``pgstream`` depend on it: dropping the schema would drop them too."""

    def __init__(self, objects: list[str]) -> None:
        self.objects = objects
        super().__init__(
            "tear-down would also drop these objects outside schema pgstream, which depend on it "
            "(nothing was changed):\n" + "\n".join(f"  {o}" for o in objects)
            + "\nremove them (or their dependency on pgstream) first, or pass --cascade to drop them too")


#: what pgstream puts outside its schema, which tear-down drops by name: the generated triggers
#: (pgstream_<op>[_stmt] calling pgstream._publish_*), the drift guard's event triggers, the publications
_GENERATED_TRIGGER = """
    t.tgname like 'pgstream\\_%' and p.pronamespace = 'pgstream'::pg_catalog.regnamespace
    and p.proname like '\\_publish\\_%' and not t.tgisinternal"""
_OLD_DEFAULT_SLOT = rf"^{STREAM_NAME_PREFIX}[0-9]+$"  # a default slot name before pgstream.default_slot_pattern()
#: a stream's publications (the sensor's, the reader's) and a reader group's
_OWN_PUBLICATION = rf"^({STREAM_NAME_PREFIX}[0-9]+(_rows)?|pgstream_group_[a-z][a-z0-9_]{{0,30}})$"

#: every object ``drop schema pgstream cascade`` would drop (pg_depend from the schema on, a part taking its
#: whole), less the schema's and pgstream's own, one "<type> <identity>" row each ("view public.v")
_DEPENDENTS = f"""
with recursive closure(classid, objid, objsubid) as (
    select 'pg_catalog.pg_namespace'::pg_catalog.regclass::pg_catalog.oid, n.oid, 0
    from pg_catalog.pg_namespace n where n.nspname = 'pgstream'
  union
    select x.classid, x.objid, x.objsubid
    from closure c
    join pg_catalog.pg_depend d
      on d.refclassid = c.classid and d.refobjid = c.objid and (c.objsubid = 0 or d.refobjsubid = c.objsubid)
    cross join lateral (
        select d.classid, d.objid, d.objsubid
        union all
        select o.refclassid, o.refobjid, 0 from pg_catalog.pg_depend o
        where o.classid = d.classid and o.objid = d.objid and o.objsubid = d.objsubid and o.deptype in ('i', 'P')
    ) x
    where d.deptype <> 'e'
), described as (
    select c.classid, c.objid, c.objsubid, i.type, i.identity,
           coalesce(i.schema, (select r.relnamespace::pg_catalog.regnamespace::text from pg_catalog.pg_class r
                               where r.oid = case c.classid  -- a trigger, rule, default or policy: its table's
               when 'pg_catalog.pg_trigger'::pg_catalog.regclass then
                   (select t.tgrelid from pg_catalog.pg_trigger t where t.oid = c.objid)
               when 'pg_catalog.pg_rewrite'::pg_catalog.regclass then
                   (select w.ev_class from pg_catalog.pg_rewrite w where w.oid = c.objid)
               when 'pg_catalog.pg_attrdef'::pg_catalog.regclass then
                   (select a.adrelid from pg_catalog.pg_attrdef a where a.oid = c.objid)
               when 'pg_catalog.pg_policy'::pg_catalog.regclass then
                   (select p.polrelid from pg_catalog.pg_policy p where p.oid = c.objid)
           end), case c.classid
               when 'pg_catalog.pg_default_acl'::pg_catalog.regclass then
                   (select a.defaclnamespace::pg_catalog.regnamespace::text from pg_catalog.pg_default_acl a
                    where a.oid = c.objid)
               when 'pg_catalog.pg_namespace'::pg_catalog.regclass then
                   (select n.nspname::text from pg_catalog.pg_namespace n where n.oid = c.objid)
           end) as schema
    from closure c
    cross join lateral pg_catalog.pg_identify_object(c.classid, c.objid, c.objsubid) i
)
select distinct d.type || ' ' || d.identity
from described d
where d.schema is distinct from 'pgstream' and d.schema is distinct from 'pg_toast'
  and not exists (select 1 from pg_catalog.pg_depend o  -- a part: its whole is listed
                  where o.classid = d.classid and o.objid = d.objid and o.objsubid = d.objsubid
                    and o.deptype in ('i', 'P'))
  and not (d.classid = 'pg_catalog.pg_event_trigger'::pg_catalog.regclass and exists (
           select 1 from pg_catalog.pg_event_trigger e where e.oid = d.objid and e.evtname like 'pgstream\\_%'))
  and not (d.classid = 'pg_catalog.pg_trigger'::pg_catalog.regclass and exists (
           select 1 from pg_catalog.pg_trigger t join pg_catalog.pg_proc p on p.oid = t.tgfoid
           where t.oid = d.objid and {_GENERATED_TRIGGER}))
  and not (d.classid = 'pg_catalog.pg_publication_rel'::pg_catalog.regclass and exists (
           select 1 from pg_catalog.pg_publication_rel r join pg_catalog.pg_publication p on p.oid = r.prpubid
           where r.oid = d.objid and p.pubname ~ '{_OWN_PUBLICATION}'))
order by 1
"""  # noqa: S608 - constants only


def _wait_slot_released(conn: psycopg.Connection, slot: str) -> None:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        row = conn.execute("select active_pid from pg_replication_slots where slot_name = %s", [slot]).fetchone()
        if row is None or row[0] is None:
            return
        time.sleep(0.05)


def tear_down(database_url: str, *, cascade: bool = False) -> list[str]:
    """Remove every trace of pgstream (triggers, publications, the schema, the streams' slots); what was removed.
    Dependent objects outside it refuse it (:class:`TearDownRefused`) unless ``cascade`` (dropped too, listed)."""
    removed: list[str] = []
    with dbconn.connect(database_url, autocommit=True) as conn:
        had_schema = _schema_exists(conn)
        with conn.transaction():
            dependents = [r[0] for r in conn.execute(_DEPENDENTS).fetchall()] if had_schema else []
            if dependents and not cascade:
                raise TearDownRefused(dependents)
            slots = _stream_slots(conn) if had_schema else set()
            default_slot = _default_slot_pattern(conn) if had_schema else _OLD_DEFAULT_SLOT
            # the drift guard goes first (dropping an event trigger fires none), so nothing below meets it
            for (name,) in conn.execute("select evtname from pg_event_trigger where evtname like 'pgstream\\_%' "
                                        "order by 1").fetchall():
                conn.execute(sql.SQL("drop event trigger {}").format(sql.Identifier(name)))
                removed.append(f"event trigger {name}")
            rows = conn.execute(f"""
                select t.tgname, n.nspname, c.relname
                from pg_trigger t
                join pg_class c on c.oid = t.tgrelid
                join pg_namespace n on n.oid = c.relnamespace
                join pg_proc p on p.oid = t.tgfoid
                where n.nspname <> 'pgstream' and {_GENERATED_TRIGGER}
                order by 2, 3, 1""").fetchall() if had_schema else []  # noqa: S608 - a constant
            for tgname, schema, table in rows:
                conn.execute(sql.SQL("drop trigger {} on {}.{}").format(
                    sql.Identifier(tgname), sql.Identifier(schema), sql.Identifier(table)))
                removed.append(f"trigger {tgname} on {schema}.{table}")
            for (pub,) in conn.execute("select pubname from pg_publication where pubname ~ %s order by 1",
                                       [_OWN_PUBLICATION]).fetchall():
                conn.execute(sql.SQL("drop publication {}").format(sql.Identifier(pub)))
                removed.append(f"publication {pub}")
            if had_schema:
                conn.execute("drop schema pgstream cascade")
                removed.append("schema pgstream (events, streams, subscriptions, functions)")
                removed += [f"{obj} (it depended on schema pgstream)" for obj in dependents]
        for slot, pid in conn.execute("select slot_name, active_pid from pg_replication_slots "
                                      "where (slot_name = any(%s) or slot_name ~ %s) "
                                      "and database = current_database() order by 1",
                                      [sorted(slots), default_slot]).fetchall():
            if pid is not None:
                # a group delivery run's reader (a walsender) holds it: ended, it lets go of the slot within moments
                conn.execute("select pg_terminate_backend(%s, 10000)", [pid])
                _wait_slot_released(conn, slot)
            conn.execute("select pg_drop_replication_slot(%s)", [slot])
            removed.append(f"replication slot {slot}")
        # the role is the cluster's: it stays while pgstream in another database uses it
        if had_schema and conn.execute("select 1 from pg_roles where rolname = %s", [WRITER_ROLE]).fetchone():
            with contextlib.suppress(psycopg.errors.DependentObjectsStillExist, psycopg.errors.InsufficientPrivilege):
                with conn.transaction():
                    conn.execute(sql.SQL("drop role {}").format(sql.Identifier(WRITER_ROLE)))
                removed.append(f"role {WRITER_ROLE}")
    return removed


def _stream_slots(conn: psycopg.Connection) -> set[str]:
    """The slot of every stream row (``slot``, from migration 022 on; ``slot_name`` or the old default name before)."""
    if conn.execute("select to_regclass('pgstream.streams') is null").fetchone() == (True,):
        return set()
    columns = {r[0] for r in conn.execute(
        "select attname::text from pg_attribute where attrelid = 'pgstream.streams'::regclass "
        "and attname in ('slot', 'slot_name') and not attisdropped")}
    column = ("slot" if "slot" in columns else
              "coalesce(slot_name, %(prefix)s || id)" if "slot_name" in columns else "%(prefix)s || id")
    return {r[0] for r in conn.execute(f"select {column} from pgstream.streams",  # noqa: S608
                                       {"prefix": STREAM_NAME_PREFIX}).fetchall() if r[0] is not None}


def _default_slot_pattern(conn: psycopg.Connection) -> str:
    """What every default slot name matches (``pgstream.default_slot_pattern()``; the old form before 022)."""
    row = conn.execute("select to_regprocedure('pgstream.default_slot_pattern()') is not null").fetchone()
    if row != (True,):
        return _OLD_DEFAULT_SLOT
    found = conn.execute("select pgstream.default_slot_pattern()").fetchone()
    assert found is not None
    return str(found[0])


def _schema_exists(conn: psycopg.Connection) -> bool:
    return conn.execute("select to_regnamespace('pgstream') is not null").fetchone() == (True,)
