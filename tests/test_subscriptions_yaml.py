"""`pgstream-dagster init` applies the YAML subscriptions through set_subscriptions."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from pgstream_dagster.cli import init

from .harness import write_config

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
    assert any(line.startswith("created slot pgstream_stream_1") for line in out)
    assert init(cfg) == []  # unchanged: nothing written, nothing recreated
    with psycopg.connect(db_url) as c:
        oids = c.execute("select oid from pg_trigger where tgname like 'pgstream_%' order by 1").fetchall()
    bad = write_config(tmp_path / "bad.yaml", db_url, streams,
                       [{**SUB, "key": "signup"}, {**SUB, "key": "broken", "column_names": ["nope"]}])
    with pytest.raises(psycopg.Error, match=r'subscription "broken".*column_names'):
        init(bad)
    removed = write_config(tmp_path / "removed.yaml", db_url, streams, [])
    assert init(removed) == ["deleted subscription 'signup' (stream 1)"]
    with psycopg.connect(db_url) as c:
        keys = c.execute("select key from pgstream.subscriptions").fetchall()
        assert keys == [("by-hand",)]  # hand-made subscriptions are left alone
        assert len(oids) == 2
