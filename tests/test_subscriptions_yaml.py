"""`pgstream-dagster init` applies the YAML subscriptions through set_subscriptions."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.config import SubscriptionConfig, load_config
from pgstream_dagster.defs.checks import check_subscription
from pgstream_dagster.engine.bootstrap import InitError, init
from pgstream_dagster.engine.subscriptions import SubscriptionError, apply_stream, code_version, definition

from .support.harness import write_config

SUB = {"key": "signup", "stream_id": 1, "operation": "INSERT", "schema_name": "public", "table_name": "users",
       "when_clause": "new.verified", "column_names": ["id", "email"]}


def test_init_applies_yaml_and_a_bad_yaml_changes_nothing(db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table public.users (id serial primary key, email text, verified bool)")
        c.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                  "values ('by-hand', 1, 'DELETE', 'users', '{id}')")
    streams = [{"id": 1, "sink": {"type": "memory"}}]
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, streams, [SUB])
    out = init(cfg)
    assert "inserted subscription 'signup' (stream 1)" in out
    assert any(line.startswith("created slot pgstream_g_default_")
               and line.endswith("for reader group default (streams 1)") for line in out), out
    assert init(cfg) == []  # unchanged: nothing written, nothing recreated
    with psycopg.connect(db_url) as c:
        oids = c.execute("select oid from pg_trigger where tgname like 'pgstream_%' order by 1").fetchall()
    bad = write_config(tmp_path / "bad.yaml", db_url, streams,
                       [{**SUB, "key": "signup"}, {**SUB, "key": "broken", "column_names": ["nope"]}])
    with pytest.raises(InitError, match=r'subscription "broken".*column_names'):
        init(bad)
    removed = write_config(tmp_path / "removed.yaml", db_url, streams, [])
    assert init(removed) == ["deleted subscription 'signup' (stream 1)"]
    with psycopg.connect(db_url) as c:
        keys = c.execute("select key from pgstream.subscriptions").fetchall()
        assert keys == [("by-hand",)]  # hand-made subscriptions are left alone
        assert len(oids) == 3  # the by-hand DELETE subscription's pgstream_delete and pgstream_truncate


def test_a_missing_table_is_one_line_naming_the_url_role_and_the_table(db_url: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`init` with a subscription of a table that does not exist: one line on stderr naming the URL it used (its
    role, host and database; no password, no URL) and the table, none of Postgres' PL/pgSQL CONTEXT lines; the
    subscription check as the runtime says the table does not exist (not that the subscription is missing)."""
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [{"id": 1, "sink": {"type": "memory"}}],
                       [{**SUB, "table_name": "nosuch"}])
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    owner = db_url.replace("postgres@", "postgres:s3cret-pw@")  # (trust authentication: any password)
    for env, source in ((None, "from database_url (no owner URL given)"),
                        (owner, "from --owner-database-url / PGSTREAM_OWNER_DATABASE_URL")):
        if env is None:
            monkeypatch.delenv("PGSTREAM_OWNER_DATABASE_URL", raising=False)
        else:
            monkeypatch.setenv("PGSTREAM_OWNER_DATABASE_URL", env)
        assert cli_main(["init", "--config", str(cfg)]) == 1
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: init as the owner (role postgres at {db_url.split('@')[1]}, {source}): "), line
        assert "table public.nosuch does not exist" in line and "s3cret" not in line, line
    role = f"checker_{uuid.uuid4().hex[:8]}"
    runtime_url = db_url.replace("postgres@", f"{role}@")
    runtime = write_config(tmp_path / "runtime.yaml", runtime_url,
                           [{"id": 1, "sink": {"type": "memory"}}], [{**SUB, "table_name": "nosuch"}])
    assert cli_main(["init", "--config", str(runtime)]) == 1  # the runtime's URL is used first: its role named
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: init as the runtime (role {role} at "), line
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(f"create role {role} login in role pgstream_runtime")
    with psycopg.connect(runtime_url, autocommit=True) as c, \
            pytest.raises(SubscriptionError, match=r"'signup' \(INSERT\): table public.nosuch does not exist$"):
        apply_stream(c, [SubscriptionConfig.model_validate({**SUB, "table_name": "nosuch"})], 1, "pgstream.yaml")


def test_yaml_trigger_mode_statement_round_trip(db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table public.users (id serial primary key, email text, verified bool)")
    streams = [{"id": 1, "sink": {"type": "memory"}}]
    stmt = {**SUB, "trigger_mode": "statement"}
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, streams, [stmt])
    assert "inserted subscription 'signup' (stream 1)" in init(cfg)
    sub = load_config(cfg).subscriptions[0]
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select tgname from pg_trigger where tgrelid = 'users'::regclass").fetchall() == [
            ("pgstream_insert_stmt",)]
        assert c.execute("select trigger_mode from pgstream.subscriptions").fetchone() == ("statement",)
        check = check_subscription(c, sub, dg.AssetKey("x"))
        assert check.passed, check.description
        assert "pgstream_insert_stmt" in (check.description or "")
        c.execute("insert into users (email, verified) values ('a', true), ('b', false), ('c', true)")
        assert [r[0] for r in c.execute("select payload->'new'->>'email' from pgstream.events order by id")] == [
            "a", "c"]
        # the check notices a subscription whose mode differs from the YAML
        c.execute("update pgstream.subscriptions set trigger_mode = 'row'")
        check = check_subscription(c, sub, dg.AssetKey("x"))
        assert not check.passed and "trigger_mode differs from pgstream.yaml" in (check.description or "")
    assert init(cfg) == ["updated subscription 'signup' (stream 1)"]
    assert init(cfg) == []
    bad = write_config(tmp_path / "bad.yaml", db_url, streams,
                       [stmt, {**SUB, "key": "upd", "operation": "UPDATE", "trigger_mode": "statement"}])
    with pytest.raises(InitError, match=r'subscription "upd".*statement mode supports INSERT and DELETE only'):
        init(bad)
    with psycopg.connect(db_url) as c:
        assert c.execute("select key, trigger_mode from pgstream.subscriptions").fetchall() == [("signup", "statement")]


def test_code_version_of_row_mode_subscriptions_is_unchanged_by_the_new_fields() -> None:
    """trigger_mode, metadata_extensions and emit_truncate at their defaults leave the digest of before they
    existed."""
    sub = SubscriptionConfig.model_validate(SUB)
    old = {k: v for k, v in definition(sub).items()
           if k not in ("trigger_mode", "metadata_extensions", "emit_truncate")}
    text = json.dumps(old, sort_keys=True, separators=(",", ":"))
    assert code_version(sub) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert code_version(sub.model_copy(update={"trigger_mode": "statement"})) != code_version(sub)
    computed = SubscriptionConfig.model_validate(
        {**SUB, "metadata_extensions": [{"json_path": "region", "expression": "'eu'"}]})
    assert code_version(computed) != code_version(sub)
    assert code_version(sub.model_copy(update={"emit_truncate": True})) != code_version(sub)


def test_yaml_metadata_extensions_round_trip(db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table public.users (id serial primary key, email text, verified bool)")
    streams = [{"id": 1, "sink": {"type": "memory"}}]
    computed = {**SUB, "metadata": {"team": "growth", "route": {"kind": "user"}},
                "metadata_extensions": [{"json_path": "route.region",
                                         "expression": "case when new.email like '%.de' then 'eu' else 'us' end"}]}
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, streams, [computed])
    assert "inserted subscription 'signup' (stream 1)" in init(cfg)
    assert init(cfg) == []  # unchanged: nothing written
    sub = load_config(cfg).subscriptions[0]
    assert [e.model_dump() for e in sub.metadata_extensions] == computed["metadata_extensions"]
    with psycopg.connect(db_url, autocommit=True) as c:
        check = check_subscription(c, sub, dg.AssetKey("x"))
        assert check.passed, check.description
        c.execute("insert into users (email, verified) values ('a@x.de', true), ('b@x.com', true)")
        assert [r[0] for r in c.execute("select metadata from pgstream.events order by id")] == [
            {"team": "growth", "route": {"kind": "user", "region": "eu"}},
            {"team": "growth", "route": {"kind": "user", "region": "us"}}]
        # the check notices metadata extensions that differ from the YAML
        c.execute("update pgstream.subscriptions set metadata_extensions = '[]'")
        check = check_subscription(c, sub, dg.AssetKey("x"))
        assert not check.passed and "metadata_extensions differs from pgstream.yaml" in (check.description or "")
    assert init(cfg) == ["updated subscription 'signup' (stream 1)"]
    bad = write_config(tmp_path / "bad.yaml", db_url, streams,
                       [{**computed, "metadata_extensions": [{"json_path": "region", "expression": "new.nope"}]}])
    with pytest.raises(InitError, match=r'subscription "signup".*metadata_extensions\[1\]\.expression: '
                                            r"column new\.nope does not exist"):
        init(bad)
    with psycopg.connect(db_url) as c:
        assert c.execute("select metadata_extensions from pgstream.subscriptions").fetchone() == (
            computed["metadata_extensions"],)


def test_yaml_emit_truncate_round_trip(db_url: str, tmp_path: Path) -> None:
    """`emit_truncate: true` on a DELETE subscription: a TRUNCATE is its event; without it the TRUNCATE is
    refused; on an INSERT subscription the YAML is refused, naming it, and nothing changes."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table public.users (id serial primary key, email text, verified bool)")
    streams = [{"id": 1, "sink": {"type": "memory"}}]
    gone = {**SUB, "key": "gone", "operation": "DELETE", "when_clause": None}
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, streams, [gone])
    init(cfg)
    with psycopg.connect(db_url, autocommit=True) as c, pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState,
                                                                      match=r'"gone" \(stream 1\).*emit_truncate'):
        c.execute("truncate public.users")
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, streams, [{**gone, "emit_truncate": True}])
    sub = load_config(cfg).subscriptions[0]
    assert sub.emit_truncate and definition(sub)["emit_truncate"] is True
    assert init(cfg) == ["updated subscription 'gone' (stream 1)"]
    assert init(cfg) == []
    with psycopg.connect(db_url, autocommit=True) as c:
        assert check_subscription(c, sub, dg.AssetKey("x")).passed
        c.execute("truncate public.users")
        assert c.execute("select payload->>'tg_op', payload->>'tg_name' from pgstream.events").fetchall() == [
            ("TRUNCATE", "gone")]
    bad = write_config(tmp_path / "bad.yaml", db_url, streams, [{**gone, "emit_truncate": True},
                                                                {**SUB, "emit_truncate": True}])
    with pytest.raises(InitError, match=r'subscription "signup".*emit_truncate: only a DELETE subscription'):
        init(bad)
    with psycopg.connect(db_url) as c:
        assert c.execute("select key, emit_truncate from pgstream.subscriptions").fetchall() == [("gone", True)]
