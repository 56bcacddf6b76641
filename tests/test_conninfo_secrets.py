"""Issue 43, finding 11: a database URL libpq cannot parse, with a password in it. libpq echoes what
it cannot parse (``missing "=" after "postgresql//app:TopSecret@..."``, ``invalid percent-encoded
token: "Top%zzSecret"``); whatever prints or logs such a message (the CLI, the exporter, the
configuration read by the code location and its sensors, the runtime's connections) masks the
password and still says what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pgstream_dagster.config import ConfigError, load_config, load_metrics_settings
from pgstream_dagster.engine import dbconn
from pgstream_dagster.engine.metrics import PgstreamCollector
from pgstream_dagster.sinks.base import connect_postgres, scrub_conninfo

PASSWORD = "TopSecret"
#: (URL, what libpq says is wrong with it)
BAD_URLS = [(f"postgresql//app:{PASSWORD}@db.example/pgstream", 'missing "=" after "postgresql//app:***@'),
            (f"postgresql://app:{PASSWORD}%zz@db.example/pgstream", 'invalid percent-encoded token: "***"')]


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("PGSTREAM_")}
    return subprocess.run([sys.executable, "-m", "pgstream_dagster.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**run_env, **(env or {})}, cwd=cwd)


@pytest.mark.parametrize(("url", "wrong"), BAD_URLS)
def test_the_cli_never_prints_the_password_of_a_url_libpq_refuses(url: str, wrong: str, tmp_path: Path) -> None:
    for args, env in ((["status", "--database-url", url], {}),
                      (["dead-letters", "list"], {"PGSTREAM_DATABASE_URL": url}),
                      (["metrics", "--database-url", url, "--port", "0"], {})):  # the exporter: refused at start
        result = cli(*args, env=env, cwd=tmp_path)
        out = result.stdout + result.stderr
        assert result.returncode == 1, out
        assert PASSWORD not in out and wrong in result.stderr, out
        assert len(result.stderr.splitlines()) == 1, out


@pytest.mark.parametrize(("url", "wrong"), BAD_URLS)
def test_the_exporter_never_logs_the_password(url: str, wrong: str) -> None:
    lines: list[str] = []
    collector = PgstreamCollector(url, 1.0, log=lines.append)
    metrics = {m.name: m.samples[0].value for m in collector.collect() if m.samples}
    assert metrics["pgstream_up"] == 0
    assert len(lines) == 1 and wrong in lines[0] and "cannot read the database" in lines[0], lines
    assert PASSWORD not in lines[0] and PASSWORD not in (collector.last_error or "")


@pytest.mark.parametrize(("url", "wrong"), BAD_URLS)
def test_a_configuration_whose_url_libpq_refuses_is_refused_without_its_password(url: str, wrong: str,
                                                                                 tmp_path: Path) -> None:
    """What the code location, its sensors and runs, and the CLI read: refused at load, in one line."""
    path = tmp_path / "pgstream.yaml"
    path.write_text(f"database_url: '{url}'\nstreams: [{{id: 1, sink: {{type: memory}}}}]\n"
                    f"metrics: {{database_url: '{url}'}}\n")
    for load in (load_config, load_metrics_settings):
        with pytest.raises(ConfigError) as refused:
            load(path)
        message = str(refused.value)
        assert PASSWORD not in message and wrong in message, message
        assert f"{path}: database_url: Value error, not a connection string libpq can parse: " in message


@pytest.mark.parametrize(("url", "wrong"), BAD_URLS)
def test_the_runtimes_connections_never_raise_the_password(url: str, wrong: str) -> None:
    with pytest.raises(psycopg.Error) as refused:
        dbconn.connect(url, autocommit=True)
    assert PASSWORD not in str(refused.value) and wrong in str(refused.value)
    with pytest.raises(psycopg.Error) as refused:  # the sinks' own connections (postgres, lake typed_columns)
        connect_postgres(url)
    assert PASSWORD not in str(refused.value) and wrong in str(refused.value)
    assert dbconn.conninfo_problem(url) is not None and PASSWORD not in (dbconn.conninfo_problem(url) or "")


@pytest.mark.parametrize(("url", "wrong"), BAD_URLS)
def test_a_lake_sinks_database_url_libpq_refuses_fails_without_its_password(url: str, wrong: str,
                                                                           tmp_path: Path) -> None:
    import datetime as dt

    from pgstream_dagster.sinks import Event, SinkError, build_sink

    event = Event(1, 1, {"tg_op": "INSERT", "new": {"id": 1}}, None, dt.datetime(2026, 12, 1, tzinfo=dt.UTC))
    with build_sink({"type": "parquet", "path": str(tmp_path / "t"), "typed_columns": True,
                     "database_url": url}) as sink, pytest.raises(SinkError) as failed:
        sink.publish_at([event], [(1, 1)])
    assert PASSWORD not in str(failed.value) and not failed.value.permanent
    assert wrong.split('"')[0] in str(failed.value)  # what libpq says is wrong


@pytest.mark.parametrize(("text", "conninfo", "shown"), [
    (f"x postgresql://app:{PASSWORD}@h/db", f"postgresql://app:{PASSWORD}@h/db", "x postgresql://app:***@h/db"),
    (f"x postgresql://app:{PASSWORD}@h/db", None, "x postgresql://app:***@h/db"),
    ('"postgres://app:Top:Secret@h:5432/db" y', None, '"postgres://app:***@h:5432/db" y'),
    (f"missing \"=\" after \"postgresql//app:{PASSWORD}@h/db\"", None, 'missing "=" after "postgresql//app:***@h/db"'),
])
def test_a_masked_url_keeps_its_scheme_and_role(text: str, conninfo: str | None, shown: str) -> None:
    """What is wrong stays readable: the scheme and the role name of a URL survive its password's masking,
    whether the password was known (the configured URL) or found by its place (``user:password@``)."""
    assert scrub_conninfo(text, conninfo) == shown
