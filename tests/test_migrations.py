"""The layout of sql/ (versioned migrations, repeatable files, one definition per object) and
upgrades from the released 0.1 schema (tests/fixtures/sql-0.1-014.tar.gz) to the current one."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import shutil
import threading
import traceback
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.engine.migrations import (
    RELEASED_CHECKSUMS,
    REPEATABLE_DIR,
    MigrationError,
    discover,
    discover_repeatables,
    migrate,
    sql_dir,
)

from .support.catalog import differences, snapshot
from .support.releases import released_files, released_sql

# --------------------------------------------------------------------------------------------
# one definition per function, view and trigger


def _code(text: str) -> str:
    """SQL without comments and single-quoted strings (dollar-quoted bodies are kept: a DO block's
    body is code; the statements functions build at run time are in quoted strings)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith("--", i):
            i = text.find("\n", i) if "\n" in text[i:] else n
        elif text.startswith("/*", i):
            i = text.index("*/", i) + 2
        elif text[i] == "'":
            i += 1
            while not (text[i] == "'" and text[i + 1:i + 2] != "'"):
                i += 2 if text[i] == "'" else 1
            i += 1
            out.append("''")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


_DEFINITION = re.compile(
    r"\bcreate\s+(?:or\s+replace\s+)?(?:constraint\s+)?(function|procedure|view|event\s+trigger|trigger)\s+"
    r"([\w.\"]+)", re.IGNORECASE)


def _arguments(code: str, start: int) -> str:
    """The text between the parenthesis at ``start`` and the one that closes it."""
    depth, i = 0, start
    while True:
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return code[start + 1:i]
        i += 1


def _input_types(arguments: str) -> str:
    """``p_a text, out x int, p_b integer default 7`` -> ``text,integer`` (every parameter is named)."""
    types: list[str] = []
    depth, part, parts = 0, "", []
    for ch in arguments:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts.append(part)
    for p in (p.strip() for p in parts if p.strip()):
        p = re.split(r"\s+default\s+|\s*=\s*", p, flags=re.IGNORECASE)[0].split()  # type: ignore[assignment]
        words: list[str] = list(p)
        if words[0].lower() == "out":
            continue
        if words[0].lower() in ("in", "inout", "variadic"):
            words = words[1:]
        types.append(" ".join(words[1:]))
    return ",".join(types)


def definitions(directory: Path) -> list[tuple[str, str, str]]:
    """Every function, view, trigger and event trigger a file of ``directory`` (or of its repeatable/)
    creates, as (kind, identity, file): a function is known by its name and input types, a trigger
    by its name and table."""
    found: list[tuple[str, str, str]] = []
    for path in sorted(directory.glob("*.sql")) + sorted((directory / REPEATABLE_DIR).glob("*.sql")):
        code = _code(path.read_text(encoding="utf-8"))
        where = str(path.relative_to(directory))
        for m in _DEFINITION.finditer(code):
            kind, name = " ".join(m.group(1).lower().split()), m.group(2).lower()
            if kind in ("function", "procedure"):
                identity = f"{name}({_input_types(_arguments(code, code.index('(', m.end(2))))})"
            elif kind == "trigger":
                table = re.match(r"[^;]*?\bon\s+([\w.\"]+)", code[m.end():], re.IGNORECASE | re.DOTALL)
                assert table is not None, f"{where}: trigger {name} without a table"
                identity = f"{name} on {table.group(1).lower()}"
            else:
                identity = name
            found.append((kind, identity, where))
    return found


def test_every_function_view_and_trigger_is_defined_once_in_a_repeatable_file(db_url: str) -> None:
    found = definitions(sql_dir())
    seen: dict[tuple[str, str], list[str]] = {}
    for kind, identity, where in found:
        seen.setdefault((kind, identity), []).append(where)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
    assert [(k, i, w) for k, i, w in found if not w.startswith(f"{REPEATABLE_DIR}/")] == []

    # and what the files define is what a fresh install has, no more, no less (this also checks the
    # parsing above: each signature must resolve to an installed function)
    with psycopg.connect(db_url) as c:
        defined: dict[Any, Any] = {}
        for (kind, identity), _ in seen.items():
            if kind == "function":
                (resolved,) = c.execute("select to_regprocedure(%s)::text", [identity]).fetchone()  # type: ignore[misc]
                assert resolved is not None, f"{identity} is not installed"
                defined.setdefault("function", set()).add(resolved)
            else:
                defined.setdefault(kind, set()).add(identity)
        installed = {
            "function": {r[0] for r in c.execute(
                "select p.oid::regprocedure::text from pg_proc p where p.pronamespace = 'pgstream'::regnamespace")},
            "view": {r[0] for r in c.execute(
                "select 'pgstream.' || c.relname from pg_class c "
                "where c.relnamespace = 'pgstream'::regnamespace and c.relkind in ('v', 'm')")},
            "trigger": {r[0] for r in c.execute(
                "select t.tgname || ' on ' || t.tgrelid::regclass::text from pg_trigger t "
                "where not t.tgisinternal and t.tgparentid = 0")},
            "event trigger": {r[0] for r in c.execute("select evtname::text from pg_event_trigger")},
        }
    assert defined == installed
    assert len(installed["function"]) >= 60 and installed["view"] == {"pgstream.stream_status", "pgstream.metrics",
                                                                  "pgstream.backfill_progress",
                                                                  "pgstream.orphaned_slots",
                                                                  "pgstream.consumer_status"}


def test_definitions_are_found_in_code_not_in_strings_or_comments(tmp_path: Path) -> None:
    (tmp_path / REPEATABLE_DIR).mkdir()
    (tmp_path / REPEATABLE_DIR / "01_x.sql").write_text(
        "-- create function pgstream.commented(p int)\n"
        "create or replace function pgstream.f(p_a text, p_b integer default 7, out x int, out y text)\n"
        "language plpgsql as $$ begin execute 'create function pgstream.quoted() ...'; end $$;\n"
        "create function pgstream.f(p_op pgstream.operation_type, p_mode text) returns text return 'x';\n"
        "do $$ begin create event trigger g on sql_drop execute function pgstream.f(); end $$;\n"
        "create or replace trigger t\nafter insert on pgstream.streams for each row execute function pgstream.h();\n"
        "create or replace view pgstream.v as select 'create view pgstream.w' as x;\n")
    assert definitions(tmp_path) == [
        ("function", "pgstream.f(text,integer)", "repeatable/01_x.sql"),
        ("function", "pgstream.f(pgstream.operation_type,text)", "repeatable/01_x.sql"),
        ("event trigger", "g", "repeatable/01_x.sql"),
        ("trigger", "t on pgstream.streams", "repeatable/01_x.sql"),
        ("view", "pgstream.v", "repeatable/01_x.sql"),
    ]


# --------------------------------------------------------------------------------------------
# released checksums


def test_released_checksums_are_those_of_the_release() -> None:
    """RELEASED_CHECKSUMS holds exactly the versions whose file changed since release 0.1, with the
    checksum of the released file (the one installs recorded)."""
    changed = {}
    for name, content in released_files().items():
        current = (sql_dir() / name).read_bytes()
        if content != current and int(name[:3]) > 0:
            changed[int(name[:3])] = hashlib.sha256(content).hexdigest()
    assert RELEASED_CHECKSUMS == changed
    assert set(changed) == set(range(1, 15)) - {10}  # every version that defined a function, view or trigger


def test_an_applied_version_is_accepted_with_its_released_or_current_checksum_only(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("update pgstream.schema_migrations set checksum = %s where version = 3", [RELEASED_CHECKSUMS[3]])
        assert migrate(db_url) == []
        c.execute("update pgstream.schema_migrations set checksum = 'something else' where version = 3")
        with pytest.raises(MigrationError, match=r"003_subscriptions\.sql was changed after it was applied"):
            migrate(db_url)
        c.execute("update pgstream.schema_migrations set checksum = %s where version = 10",
                  [hashlib.sha256(b"another 010").hexdigest()])
        c.execute("update pgstream.schema_migrations set checksum = %s where version = 3", [RELEASED_CHECKSUMS[3]])
        with pytest.raises(MigrationError, match=r"010_open_runs\.sql was changed after it was applied"):
            migrate(db_url)


# --------------------------------------------------------------------------------------------
# repeatable files


def _copy_of_sql(tmp_path: Path) -> Path:
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    return copy


def test_a_changed_repeatable_file_is_applied_again_alone(db_url: str, tmp_path: Path) -> None:
    copy = _copy_of_sql(tmp_path)
    status = copy / REPEATABLE_DIR / "08_status.sql"
    status.write_text(status.read_text() + "\ncomment on view pgstream.stream_status is 'one row per stream';\n")
    assert migrate(db_url, directory=copy) == [f"{REPEATABLE_DIR}/08_status.sql"]
    assert migrate(db_url, directory=copy) == []
    with psycopg.connect(db_url) as c:
        assert c.execute("select obj_description('pgstream.stream_status'::regclass, 'pg_class')").fetchone() == (
            "one row per stream",)
        assert c.execute("select checksum from pgstream.schema_repeatables where name = '08_status.sql'"
                         ).fetchone() == (hashlib.sha256(status.read_bytes()).hexdigest(),)
        assert c.execute("select count(*) from pgstream.schema_repeatables").fetchone() == (
            len(discover_repeatables()),)


def test_a_failing_repeatable_file_changes_nothing_and_is_retried(db_url: str, tmp_path: Path) -> None:
    copy = _copy_of_sql(tmp_path)
    ledger, status = copy / REPEATABLE_DIR / "02_ledger.sql", copy / REPEATABLE_DIR / "08_status.sql"
    ledger.write_text(ledger.read_text() + "\ncomment on function pgstream.retry_now(bigint) is 'now';\n")
    good = status.read_text()
    status.write_text("comment on view pgstream.stream_status is 'x';\nselect pgstream.no_such_function();\n")
    with pytest.raises(MigrationError, match=r"repeatable/08_status\.sql failed: .*no_such_function"):
        migrate(db_url, directory=copy)
    with psycopg.connect(db_url) as c:  # the file before it stays applied; the failing one left no trace
        assert c.execute("select obj_description('pgstream.retry_now(bigint)'::regprocedure, 'pg_proc'), "
                         "obj_description('pgstream.stream_status'::regclass, 'pg_class')").fetchone() == ("now", None)
    status.write_text(good)
    assert migrate(db_url, directory=copy) == []  # 08 is as recorded again: nothing to do


def test_repeatable_files_are_named_and_numbered_once(tmp_path: Path) -> None:
    copy = _copy_of_sql(tmp_path)
    (copy / REPEATABLE_DIR / "08_other.sql").write_text("select 1;\n")
    with pytest.raises(MigrationError, match="duplicate repeatable file numbers"):
        discover_repeatables(copy)
    (copy / REPEATABLE_DIR / "08_other.sql").rename(copy / REPEATABLE_DIR / "9_other.sql")
    with pytest.raises(MigrationError, match=r"must be named NN_name\.sql: 9_other\.sql"):
        discover_repeatables(copy)


# --------------------------------------------------------------------------------------------
# pgstream.batch_is_open


def test_batch_is_open_is_the_spelled_out_predicate_and_queries_with_it_use_the_open_index(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute(
            "select s, pgstream.batch_is_open(s) from unnest(array['pending', 'launched', 'failed', 'delivered', "
            "'skipped']) s").fetchall() == [("pending", True), ("launched", True), ("failed", True),
                                            ("delivered", False), ("skipped", False)]
        c.execute("insert into pgstream.streams (id) values (1), (2)")
        c.execute(
            "insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
            "min_created_at, max_created_at, status) "
            "select 1 + g % 2, array[g], 1, g, g, now(), now(), "
            "       case when g % 997 = 0 then 'pending' when g % 991 = 0 then 'failed' else 'delivered' end "
            "from generate_series(1, 20000) g")
        c.execute("analyze pgstream.batches")

        def plan(query: str) -> str:
            return "\n".join(r[0] for r in c.execute(f"explain (verbose, costs off) {query}").fetchall())

        queries = [  # the shapes of the ledger's queries (engine/ledger/) and of the functions above
            "select * from pgstream.batches b where b.stream_id = 1 and pgstream.batch_is_open(b.status) "
            "order by b.id limit 1",
            "select id, event_count from pgstream.batches where stream_id = 2 and id >= 500 "
            "and pgstream.batch_is_open(status) order by id limit 10000",
            "select min(id) from pgstream.batches where stream_id = 1 and id < 9000 and pgstream.batch_is_open(status)",
            "select min(min_created_at) from pgstream.batches where pgstream.batch_is_open(status)",
            "select count(*) from pgstream.batches b where b.stream_id = 2 and pgstream.batch_is_open(b.status)",
        ]
        for query in queries:
            spelled_out = query.replace("pgstream.batch_is_open(status)", "status not in ('delivered', 'skipped')")
            spelled_out = spelled_out.replace("pgstream.batch_is_open(b.status)",
                                              "b.status not in ('delivered', 'skipped')")
            assert "batches_open_idx" in plan(query), plan(query)
            assert "batch_is_open" not in plan(query)  # inlined
            assert plan(query) == plan(spelled_out)
        # and so do the functions and the view that use it
        for query in ("select * from pgstream.stream_status", "select pgstream.oldest_protected_day()"):
            c.execute(query)


# --------------------------------------------------------------------------------------------
# upgrade from release 0.1


USERS = "create table public.users (id serial primary key, email text, note text, tenant text)"

SUBSCRIPTIONS: list[dict[str, Any]] = [
    {"key": "signup", "stream_id": 1, "operation": "INSERT", "table_name": "users", "column_names": ["id", "email"],
     "when_clause": "new.email is not null",
     "payload_extensions": [{"json_path": "group_id", "expression": "new.id::text"},
                            {"json_path": "meta.tenant", "expression": "upper(new.tenant)"}],
     "metadata": {"team": "growth"}},
    {"key": "changed", "stream_id": 1, "operation": "UPDATE", "table_name": "users", "column_names": ["id", "note"]},
    {"key": "gone", "stream_id": 2, "operation": "DELETE", "table_name": "users", "column_names": ["id"],
     "trigger_mode": "statement"},
    {"key": "bulk", "stream_id": 2, "operation": "INSERT", "table_name": "users", "column_names": ["id", "tenant"],
     "trigger_mode": "statement", "when_clause": "new.tenant = 'acme'"},
]

_DATA = {
    # the slot a stream reads is checked on its own (022 added it; tests/test_collisions.py), and so is
    # who reads it (025: 'sensor' for every stream; tests/test_ingest.py), and its reader group (027: none
    # until a stream is configured with one; tests/test_reader_groups.py)
    "streams": "select to_jsonb(s) - 'default_slot' - 'slot' - 'slot_reader' - 'reader_group' - 'join_lsn' "
               "from pgstream.streams s order by id",
    # the columns of release 0.1 (later versions add columns, with defaults: checked on their own)
    "subscriptions": "select id, key, stream_id, operation, schema_name, table_name, when_clause, column_names, "
                     "metadata, payload_extensions, created_at, updated_at, managed_by, trigger_mode "
                     "from pgstream.subscriptions order by id",
    "events": "select id, payload, metadata, stream_id, created_at, lsn from pgstream.events order by id",
    "batches": "select * from pgstream.batches order by id",
    "failovers": "select * from pgstream.failovers order by id",
    "dead_letters": "select * from pgstream.dead_letters order by id",
    "subscribed_columns": "select * from pgstream.subscribed_columns order by 1, 2, 3",
    "schema_migrations": "select * from pgstream.schema_migrations order by version",
    "users": "select * from public.users order by id",
}


def _install_subscriptions(c: psycopg.Connection) -> None:
    c.execute(USERS)
    columns = ("key, stream_id, operation, schema_name, table_name, when_clause, column_names, payload_extensions, "
               "metadata, trigger_mode")
    for sub in SUBSCRIPTIONS:
        defaults = {"schema_name": "public", "trigger_mode": "row", "payload_extensions": []}
        c.execute(f"insert into pgstream.subscriptions ({columns}) select {columns} "  # noqa: S608 - constants
                  "from jsonb_populate_record(null::pgstream.subscriptions, %s)", [Jsonb({**defaults, **sub})])


def _data(c: psycopg.Connection) -> dict[str, list[tuple[Any, ...]]]:
    return {name: c.execute(query).fetchall() for name, query in _DATA.items()}


def _payloads(c: psycopg.Connection, after: int) -> list[tuple[int, dict[str, Any], Any]]:
    rows = c.execute("select stream_id, payload, metadata from pgstream.events where id > %s order by id",
                     [after]).fetchall()
    return [(s, {k: v for k, v in p.items() if k != "timestamp"}, m) for s, p, m in rows]


def _write_through_the_triggers(c: psycopg.Connection, first_id: int) -> None:
    with c.transaction():
        c.execute("insert into public.users (id, email, note, tenant) values (%s, 'a@x', 'n', 'acme'), "
                  "(%s, null, 'n', 'other')", [first_id, first_id + 1])
        c.execute("update public.users set note = 'changed' where id = %s", [first_id])
        c.execute("delete from public.users where id = %s", [first_id + 1])


def test_upgrade_from_release_0_1_ends_as_a_fresh_install(empty_db_url: str, db_url: str, tmp_path: Path) -> None:
    # the released schema, in use
    assert migrate(empty_db_url, directory=released_sql(tmp_path / "released")) == [
        name for name in sorted(released_files()) if name != "000_bootstrap.sql"]
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        _install_subscriptions(c)
        _write_through_the_triggers(c, 1)
        before_upgrade = _payloads(c, 0)
        # statement mode writes at the statement's end (bulk, gone), row mode at commit (signup, changed)
        assert [(s, p["tg_name"]) for s, p, _ in before_upgrade] == [
            (2, "bulk"), (2, "gone"), (1, "signup"), (1, "changed")]
        ids = [r[0] for r in c.execute("select id from pgstream.events order by id").fetchall()]
        batch = ("insert into pgstream.batches (stream_id, event_ids, event_count, first_event_id, last_event_id, "
                 "min_created_at, max_created_at, status, delivered_at, error) "
                 "select %s, array[%s::bigint], 1, %s, %s, now(), now(), %s, "
                 "case when %s = 'delivered' then now() end, case when %s = 'failed' then 'sink down' end")
        for event_id, stream, status in zip(ids, [2, 2, 1, 1], ["delivered", "pending", "failed", "delivered"],
                                            strict=True):
            c.execute(batch, [stream, event_id, event_id, event_id, status, status, status])
        (failed,) = c.execute("select id from pgstream.batches where status = 'failed'").fetchone()  # type: ignore[misc]
        c.execute("select pgstream.enter_failover(1, %s, 'sink down', now())", [failed])
        set_aside = c.execute("select pgstream.set_aside_events(2, array[%s::bigint], 'poison')", [ids[1]])
        assert set_aside.fetchone() == (1,)
        before = _data(c)
        assert [len(before[t]) for t in ("events", "batches", "failovers", "dead_letters")] == [4, 4, 1, 1]

    # the upgrade: no released version runs again, the versions since the release run once, every
    # repeatable file is applied
    released = {int(name[:3]) for name in released_files()}
    assert migrate(empty_db_url) == ([m.path.name for m in discover() if m.version not in released]
                                     + [f"{REPEATABLE_DIR}/{r.name}" for r in discover_repeatables()])
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        after = _data(c)
        added = [r for r in after["schema_migrations"] if r[0] not in released]
        assert {k: v for k, v in after.items() if k != "schema_migrations"} == {
            k: v for k, v in before.items() if k != "schema_migrations"}
        assert [r for r in after["schema_migrations"] if r[0] in released] == before["schema_migrations"]
        assert {v: s for v, _, s, _ in before["schema_migrations"]} == {
            m.version: RELEASED_CHECKSUMS.get(m.version, m.checksum) for m in discover() if m.version in released - {0}}
        assert {v: s for v, _, s, _ in added} == {
            m.version: m.checksum for m in discover() if m.version not in released}
        # 016: every subscription of the release computes no metadata
        assert c.execute("select count(*) from pgstream.subscriptions where metadata_extensions = '[]'"
                         ).fetchone() == (len(SUBSCRIPTIONS),)
        # the metrics' counters start from the ledger as it was (repeatable/09_metrics.sql)
        metrics = {(m, s): v for m, s, v in c.execute(
            "select metric, stream_id, value from pgstream.metrics where label = '' and metric = any(%s)",
            [["events_recorded", "events_delivered", "backlog_events", "failovers_entered", "dead_letters_opened",
              "dead_letters_open", "delivery_attempts_failed"]]).fetchall()}
        assert metrics == {("events_recorded", 1): 2, ("events_recorded", 2): 2, ("events_delivered", 1): 1,
                           ("events_delivered", 2): 1, ("backlog_events", 1): 1, ("backlog_events", 2): 1,
                           ("failovers_entered", 1): 1, ("delivery_attempts_failed", 1): 1,
                           ("dead_letters_opened", 2): 1, ("dead_letters_open", 1): 0, ("dead_letters_open", 2): 1}
        # 025: every stream starts with the sensor as its slot's reader
        assert c.execute("select distinct slot_reader from pgstream.streams").fetchall() == [("sensor",)]
        upgraded = snapshot(c)

    # a fresh install with the same streams, table and subscriptions has the same catalog
    with psycopg.connect(db_url, autocommit=True) as c:
        _install_subscriptions(c)
        fresh = snapshot(c)
    assert differences(upgraded, fresh) == []
    assert len(fresh["functions"]) > 60 and len(fresh["triggers"]) > 10 and fresh["event triggers"]
    assert {r[0] for r in fresh["functions"] if "_publish_" in r[0]} and fresh["publications"]

    # the generated triggers write the same events as before
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        (last,) = c.execute("select max(id) from pgstream.events").fetchone()  # type: ignore[misc]
        _write_through_the_triggers(c, 10)
        rewritten = _payloads(c, last)
    assert rewritten == [(s, {**p, "new": p["new"] and {**p["new"], "id": p["new"]["id"] + 9},
                          "old": p["old"] and {**p["old"], "id": p["old"]["id"] + 9},
                          **({"group_id": str(int(p["group_id"]) + 9)} if "group_id" in p else {})}, m)
                     for s, p, m in before_upgrade]

    # up to date: nothing to do
    assert migrate(empty_db_url) == []
    # the released functions' behaviour on the ledger is kept (batch_is_open: same open batches)
    with psycopg.connect(empty_db_url) as c:
        assert c.execute("select undelivered_batches, open_dead_letters, state from pgstream.stream_status "
                         "order by id").fetchall() == [(1, 0, "failover"), (1, 1, "healthy")]


# -- applying, concurrency, changed files, partitions, the CLI ------------------------------------


def test_migrate_is_idempotent_and_recorded(db_url: str) -> None:
    assert migrate(db_url) == []
    with psycopg.connect(db_url) as c:
        versions = [r[0] for r in c.execute("select version from pgstream.schema_migrations order by 1")]
    assert versions == sorted(int(p.name[:3]) for p in sql_dir().glob("[0-9]*.sql") if p.name[:3] != "000")


def test_concurrent_migrators_apply_each_migration_once(empty_db_url: str) -> None:
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(migrate(empty_db_url))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, ["".join(traceback.format_exception(e)) for e in errors]
    applied = [name for r in results for name in r]
    assert len(applied) == len(set(applied)) == (len([m for m in discover() if m.version > 0])
                                                 + len(discover_repeatables()))


def test_changed_migration_is_refused(db_url: str, tmp_path: Path) -> None:
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    (copy / "001_core.sql").write_text((copy / "001_core.sql").read_text() + "\n-- edited\n")
    with pytest.raises(MigrationError, match=r"001_core\.sql was changed after it was applied"):
        migrate(db_url, directory=copy)


def test_migrate_creates_today_and_the_week_ahead(conn: psycopg.Connection) -> None:
    today = dt.datetime.now(dt.UTC).date()
    names = {r[0] for r in conn.execute(
        "select c.relname from pg_inherits i join pg_class c on c.oid = i.inhrelid "
        "where i.inhparent = 'pgstream.events'::regclass")}
    for d in range(8):
        assert f"events_{(today + dt.timedelta(days=d)):%Y%m%d}" in names
    assert "events_default" in names


def test_cli_migrate_and_missing_url(db_url: str, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_main(["migrate", "--database-url", db_url]) == 0
    assert "up to date" in capsys.readouterr().out
    monkeypatch.delenv("PGSTREAM_DATABASE_URL", raising=False)
    with pytest.raises(SystemExit, match="PGSTREAM_DATABASE_URL"):
        cli_main(["migrate"])
