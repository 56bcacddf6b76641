"""pgstream.yaml validation: every error names the file, the key and the problem; secrets stay secret."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pgstream_dagster.config import ConfigError, DeliveryConfig, load_config
from pgstream_dagster.sinks import HttpSinkConfig, KafkaSinkConfig, parse_sink_config

GOOD = """
database_url: ${TEST_PG_URL}
streams:
  - id: 1
    sink: {type: http, url: http://127.0.0.1:9/hook, headers: {Authorization: "Bearer ${TEST_TOKEN}"}}
subscriptions:
  - {key: a, stream_id: 1, operation: insert, table_name: users, column_names: [id]}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pgstream.yaml"
    p.write_text(text)
    return p


def test_good_config_substitutes_env_and_hides_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://u:hunter2@db/x")
    monkeypatch.setenv("TEST_TOKEN", "s3cr3t")
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.database_url.get_secret_value() == "postgresql://u:hunter2@db/x"
    assert cfg.subscriptions[0].operation == "INSERT"
    assert cfg.stream(1).batch.max_size == 1000
    assert "hunter2" not in repr(cfg) and "s3cr3t" not in repr(cfg)
    assert cfg.stream(1).reader == "default"  # a stream that names no reader group reads with the default one


@pytest.mark.parametrize(("text", "message"), [
    ("streams: [", "invalid YAML"),
    ("- a\n- b", "expected a mapping"),
    (GOOD.replace("${TEST_PG_URL}", "${NOT_SET_ANYWHERE}"), "database_url: environment variable NOT_SET_ANYWHERE"),
    (GOOD.replace("id: 1\n", "id: 1\n    colour: blue\n"), "streams[0].colour: unknown key (allowed: id, batch, "),
    (GOOD.replace("id: 1\n", "id: 1\n    batch: {max_size: 0}\n"), "streams[0].batch.max_size"),
    (GOOD.replace("type: http", "type: carrier-pigeon"), "streams[0].sink"),
    (GOOD.replace("stream_id: 1, operation", "stream_id: 2, operation"), "uses stream_id 2"),
    (GOOD.replace("operation: insert", "operation: upsert"), "subscriptions[0].operation"),
    (GOOD.replace("operation: insert", "operation: insert, trigger_mode: rows"), "subscriptions[0].trigger_mode"),
])
def test_bad_config_names_file_key_and_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                                              message: str) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_TOKEN", "s3cr3t")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)
    assert "s3cr3t" not in str(err.value)


def test_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="cannot read the pgstream configuration"):
        load_config(tmp_path / "nope.yaml")
    # no path given: where it looked, and the two ways to name the file
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PGSTREAM_CONFIG", raising=False)
    with pytest.raises(ConfigError) as default:
        load_config()
    assert str(default.value) == ("pgstream.yaml: no such file (the default, in the current directory): pass "
                                  "--config FILE or set PGSTREAM_CONFIG")
    monkeypatch.setenv("PGSTREAM_CONFIG", str(tmp_path / "gone.yaml"))
    with pytest.raises(ConfigError, match=r"gone.yaml: no such file \(\$PGSTREAM_CONFIG\): pass --config FILE"):
        load_config()


def test_a_file_mounted_header_secret_loses_its_trailing_line_break(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://u:hunter2@db/x")
    monkeypatch.setenv("TEST_TOKEN", "s3cr3t-t0ken\r\n")  # e.g. a mounted secret file exposed as is
    cfg = load_config(write(tmp_path, GOOD))
    sink = cfg.stream(1).sink
    assert isinstance(sink, HttpSinkConfig)
    assert sink.headers["Authorization"].get_secret_value() == "Bearer s3cr3t-t0ken"
    assert "s3cr3t" not in repr(cfg) and "s3cr3t" not in str(cfg)


@pytest.mark.parametrize(("token", "message"), [
    ("s3cr3t\r\nX-Injected: yes", "header 'Authorization': the value contains a line break"),
    ("s3cr3t\nmore", "header 'Authorization': the value contains a line break"),
    ("s3cr3t\tok\x1b", "header 'Authorization': the value contains a line break or another control character"),
    ("s3cr3t-tökén", "header 'Authorization': the value contains non-ASCII characters"),
])
def test_bad_header_secret_names_the_header_never_the_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            token: str, message: str) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_TOKEN", token)
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}: streams[0].sink.headers: Value error, {message}" in str(err.value)
    for text in (str(err.value), repr(err.value)):
        assert "s3cr3t" not in text and "X-Injected" not in text and "more" not in text


def test_bad_header_name_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_TOKEN", "s3cr3t")
    path = write(tmp_path, GOOD.replace("{Authorization:", "{'Auth orization':"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "streams[0].sink.headers: Value error, header name 'Auth orization' is not a valid HTTP header name" \
        in str(err.value)
    assert "s3cr3t" not in str(err.value)


def test_kafka_credentials_in_options_point_to_secret_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_KAFKA_PASSWORD", "kafka-s3cr3t")
    kafka = ("database_url: ${TEST_PG_URL}\n"
             "streams:\n"
             "  - id: 1\n"
             "    sink: {type: kafka, topic: t, options: {sasl.username: alice, OPTION: '${TEST_KAFKA_PASSWORD}'}}\n")
    path = write(tmp_path, kafka.replace("OPTION", "sasl.password"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert (f"{path}: streams[0].sink: Value error, options ['sasl.password'] are credentials: "
            "put them in secret_options") in str(err.value)
    assert "kafka-s3cr3t" not in str(err.value) and "kafka-s3cr3t" not in repr(err.value)
    moved = kafka.replace("alice, OPTION:", "alice}, secret_options: {sasl.password:")
    cfg = load_config(write(tmp_path, moved))
    sink = cfg.stream(1).sink
    assert isinstance(sink, KafkaSinkConfig)
    assert sink.secret_options["sasl.password"].get_secret_value() == "kafka-s3cr3t"
    assert "kafka-s3cr3t" not in repr(cfg) and "kafka-s3cr3t" not in str(cfg)


# --------------------------------------------------------------------------------------------
# collisions and ranges (issue 12): refused when the file is read, not when the database or a
# sensor meets them


@pytest.mark.parametrize(("entry", "line"), [
    ("slot_name: orders_cdc", "streams[0]: Value error, streams[].slot_name is no longer read: every stream reads "
                              "its reader group's slot; give a stream a reader group of its own (reader: <name>) for "
                              "a slot of its own"),
    ("delivery: {tuning: {read_slot: false}}", "streams[0].delivery.tuning: Value error, delivery.tuning.read_slot is "
                                               "no longer read: every stream's events are read by its reader group"),
    ("delivery: {read_slot: true}", "streams[0].delivery: Value error, delivery.tuning.read_slot is no longer read"),
])
def test_the_keys_of_a_slot_per_stream_are_refused_in_one_line_saying_what_to_do(tmp_path: Path, entry: str,
                                                                                   line: str) -> None:
    """A stream reads its reader group's slot: ``streams[].slot_name`` (a slot of its own) and
    ``delivery.tuning.read_slot`` (an open run reading the stream's slot itself) are refused when the file is
    read, in one line naming the stream and what to write instead."""
    path = write(tmp_path, f"database_url: postgresql://x\nstreams:\n  - {{id: 1, sink: {{type: memory}}, {entry}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    (shown,) = str(err.value).splitlines()
    assert f"{path}: {line}" in shown, shown


TWO_STREAMS = """
database_url: postgresql://x
streams:
  - {id: 1, sink: {type: memory}SLOT1}
  - {id: 2, sink: {type: memory}SLOT2}
"""


BIG = 2**63  # one past the largest bigint


@pytest.mark.parametrize(("old", "new", "message"), [
    ("id: 1\n", f"id: {BIG}\n", "streams[0].id: Input should be less than or equal to 9223372036854775807"),
    ("stream_id: 1,", f"stream_id: {BIG},",
     "subscriptions[0].stream_id: Input should be less than or equal to 9223372036854775807 (subscription 'a')"),
    ("id: 1\n", "id: 1\n    retry: {initial_backoff_secs: .inf}\n",
     "streams[0].retry.initial_backoff_secs: Input should be a finite number"),
    ("id: 1\n", "id: 1\n    retry: {max_backoff_secs: .nan}\n",
     "streams[0].retry.max_backoff_secs: Input should be a finite number"),
    ("id: 1\n", "id: 1\n    retry: {max_backoff_secs: 1e300}\n",
     "streams[0].retry.max_backoff_secs: Input should be less than or equal to 604800"),
    ("id: 1\n", "id: 1\n    retry: {initial_backoff_secs: 600, max_backoff_secs: 300}\n",
     "streams[0].retry: Value error, initial_backoff_secs (600) must not exceed max_backoff_secs (300)"),
    ("id: 1\n", "id: 1\n    batch: {max_fill_secs: .nan}\n",
     "streams[0].batch.max_fill_secs: Input should be a finite"),
    ("id: 1\n", "id: 1\n    delivery: {tuning: {max_run_secs: .inf}}\n",
     "streams[0].delivery.tuning.max_run_secs: Input should be a finite"),
    ("id: 1\n", "id: 1\n    sensor: {tick_budget_secs: .nan}\n",
     "streams[0].sensor.tick_budget_secs: Input should be a finite"),
    ("id: 1\n", "id: 1\n    checks: {max_undelivered_age_secs: .inf}\n",
     "streams[0].checks.max_undelivered_age_secs: Input should be a finite number"),
    ("id: 1\n", f"id: 1\n    checks: {{max_retained_wal_bytes: {BIG}}}\n",
     "streams[0].checks.max_retained_wal_bytes: Input should be less than or equal to 9223372036854775807"),
    ("subscriptions:", f"housekeeping: {{days_ahead: {2**31}}}\nsubscriptions:",
     "housekeeping.days_ahead: Input should be less than or equal to 365"),
    ("subscriptions:", f"housekeeping: {{retention_days: {2**31}}}\nsubscriptions:",
     "housekeeping.retention_days: Input should be less than or equal to 3650"),
])
def test_numbers_the_database_or_the_clock_cannot_take_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   old: str, new: str, message: str) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_TOKEN", "s3cr3t")
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}: {message}" in str(err.value)


def test_the_largest_stream_id_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_TOKEN", "s3cr3t")
    top = 2**63 - 1
    cfg = load_config(write(tmp_path, GOOD.replace("id: 1\n", f"id: {top}\n").replace("stream_id: 1,",
                                                                                      f"stream_id: {top},")))
    assert cfg.stream(top).publication == f"pgstream_stream_{top}"


def test_failover_backoff_stays_finite_after_any_number_of_attempts(tmp_path: Path) -> None:
    from pgstream_dagster.engine.batches import backoff_secs

    cfg = load_config(write(tmp_path, TWO_STREAMS.replace("SLOT1", ", retry: {initial_backoff_secs: 5, "
                                                                   "max_backoff_secs: 604800}").replace("SLOT2", "")))
    stream = cfg.stream(1)
    assert [backoff_secs(stream, n) for n in (0, 1, 2, 3)] == [5, 5, 10, 20]
    assert backoff_secs(stream, 2000) == backoff_secs(stream, 10**9) == 604800  # 2 ** 1999 is no float


@pytest.mark.parametrize("argv", [["status", "9223372036854775808"], ["skip", "1", "0", "--yes"],
                                  ["pause", "-1"], ["dead-letters", "show", "x"], ["migrate", "--days-ahead", "366"]])
def test_cli_numbers_out_of_range_are_refused_before_any_connection(argv: list[str],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from pgstream_dagster.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*argv, "--database-url", "postgresql://nobody@127.0.0.1:1/none"])
    assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "choices"), [(["consumers"], "{list,add,token,drop,retention}"),
                                               (["dead-letters"], "{list,show,redeliver,discard,set-aside}"),
                                               (["backfill"], "{run,list,stop,cancel}")])
def test_a_command_group_without_its_command_names_the_ones_it_takes(argv: list[str], choices: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from pgstream_dagster.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"pgstream-dagster {argv[0]}: error: the following "
                                                         f"arguments are required: {choices}")


@pytest.mark.parametrize(("argv", "line"), [
    (["status", "--config", "pgstream.yaml"],
     "pgstream-dagster status: error: unknown option --config: this command takes --database-url, --batches "
     "(--help describes them)"),
    (["dead-letters", "show", "1", "7", "--confg=x.yaml"],
     "pgstream-dagster dead-letters show: error: unknown option --confg: this command takes --database-url "
     "(--help describes them)"),
    (["executor-requirements", "--database-url", "postgresql://app:S3cretPw@db/app"],
     "pgstream-dagster executor-requirements: error: unknown option --database-url: this command takes --sink, "
     "--config, --defs-folder (--help describes them)")])
def test_an_option_the_command_does_not_take_is_named(argv: list[str], line: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Not the value after it, which argparse read as the command's next argument (``status --config x.yaml``
    was told ``id must be an integer, got 'x.yaml'``); an option's prefix still works (``--data`` for
    ``--database-url``), and so does a value after ``--``."""
    from pgstream_dagster.cli import build_parser, main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == line
    assert build_parser().parse_args(["status", "--data", "postgresql://db/app", "3"]).stream == 3
    assert build_parser().parse_args(["backfill", "run", "1", "k", "--", "--a-key"]).keys == ["k", "--a-key"]


@pytest.mark.parametrize("url", ["postgresql://app:S3cretPw@db.internal/app", "host=db password=S3cretPw"])
def test_a_refused_argument_is_echoed_without_its_password(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse echoes what it refuses: a URL given where a command was expected keeps its password masked."""
    from pgstream_dagster.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["consumers", url])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "invalid choice" in err and "S3cretPw" not in err, err


def test_sink_numbers_must_be_finite() -> None:
    from pgstream_dagster.config import ConfigError, parse_config

    for value in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"streams\[0\]\.sink\.timeout_secs"):
            parse_config({"database_url": "postgresql://x", "streams": [
                {"id": 1, "sink": {"type": "http", "url": "http://127.0.0.1/hook", "timeout_secs": value}}]})


@pytest.mark.parametrize("path", ["group_id", "data.tenant-id", "a.b_c.d", "metadata.region", "payload:a.b",
                                  "metadata:region", "metadata:route.topic-name"])
def test_routing_key_accepts_what_a_sink_payload_path_accepts(path: str) -> None:
    """delivery.routing_key and the sinks' event paths are one definition (sinks.base.EventPath)."""
    assert DeliveryConfig(routing_key=path).routing_key == path
    assert parse_sink_config({"type": "redis", "stream_from": path}) is not None


@pytest.mark.parametrize("path", ["", "a..b", ".a", "a.", "1a", "a b", "a/b", "metadata:", "meta:a", ":a",
                                  "metadata:a:b", "payload:", "Metadata:a", "metadata: a"])
def test_routing_key_refuses_what_a_sink_payload_path_refuses(path: str) -> None:
    with pytest.raises(ValidationError):
        DeliveryConfig(routing_key=path)
    with pytest.raises(ValidationError):
        parse_sink_config({"type": "redis", "stream_from": path})


@pytest.mark.parametrize(("old", "where"), [
    *[(f"{key}: 1", f"delivery.tuning.{key}") for key in (
        "direct_max_events", "max_read_bytes", "rows_per_partition", "prefetch_partitions",
        "report_every_secs", "max_run_secs")],
])
def test_a_delivery_key_that_moved_is_refused_in_one_line_naming_where_it_goes(
        tmp_path: Path, old: str, where: str) -> None:
    """A key of delivery.tuning written under delivery is not read: loading fails in one line naming the
    stream, the key and what to write instead."""
    path = tmp_path / "pgstream.yaml"
    path.write_text("database_url: postgresql://x@h/db\nstreams:\n  - id: 1\n    sink: {type: file, path: /tmp/x}\n"
                    f"    delivery: {{mode: open, {old}}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    key = old.split(":")[0]
    (line,) = str(info.value).splitlines()
    assert line.endswith(f"pgstream.yaml: streams[0].delivery: Value error, delivery.{key} is no longer read: "
                         f"write {where}"), line


@pytest.mark.parametrize(("delivery", "told"), [
    ("{mode: warm}", "delivery.mode warm is no longer read: in mode open (the default) a stream always has a run "
                     "open; write delivery.mode: open or leave it out"),
    ("{keep_warm: true}", "delivery.keep_warm is no longer read: in mode open (the default) a stream always has a run "
                          "open; remove the key"),
    ("{linger_secs: 5}", "delivery.tuning.linger_secs is no longer read: in mode open a stream always has a run open "
                         "(until tuning.max_run_secs, then a fresh one); remove the key (a run per batch: "
                         "delivery.mode: per_batch)"),
    ("{tuning: {linger_secs: 5}}", "delivery.tuning.linger_secs is no longer read"),
    ("{tuning: {read_slot: true}}", "delivery.tuning.read_slot is no longer read"),
])
def test_a_delivery_key_no_longer_read_is_refused_in_one_line_saying_what_to_write(
        tmp_path: Path, delivery: str, told: str) -> None:
    """``mode: warm``, ``linger_secs`` and ``keep_warm`` (every open run is kept ready now) fail the load in one
    line naming the stream and what to write instead, not a list of the modes."""
    path = tmp_path / "pgstream.yaml"
    path.write_text("database_url: postgresql://x@h/db\nstreams:\n  - id: 1\n    sink: {type: file, path: /tmp/x}\n"
                    f"    delivery: {delivery}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (line,) = str(info.value).splitlines()
    assert "pgstream.yaml: streams[0].delivery" in line and f"Value error, {told}" in line, line


def test_the_default_mode_is_an_open_run() -> None:
    delivery = DeliveryConfig()
    assert (delivery.mode, delivery.keeps_open) == ("open", True)
    per_batch = DeliveryConfig(mode="per_batch")
    assert not per_batch.keeps_open
    # per_batch reads through PySpark (the design card) unless direct_max_events is given
    assert (delivery.direct_max_events, per_batch.direct_max_events) == (100_000, 0)
    assert DeliveryConfig.model_validate({"mode": "per_batch", "tuning": {"direct_max_events": 500}}
                                         ).direct_max_events == 500


# --------------------------------------------------------------------------------------------
# issue 43, finding 10: a YAML alias bomb


def alias_bomb(indent: str = "") -> str:
    """About 500 bytes: 9 levels of aliases, each a list of 9 of the level below (9**9 values expanded)."""
    lines = [f"{indent}l0: &l0 [boom]"]
    lines += [f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


def bombed(tmp_path: Path) -> Path:
    """pgstream.yaml: a valid configuration plus the bomb (about 600 bytes in all)."""
    path = write(tmp_path, "database_url: postgresql://x@127.0.0.1:1/db\nstreams: []\nbomb:\n" + alias_bomb("  "))
    assert len(path.read_bytes()) < 700
    return path


def test_an_alias_bomb_in_pgstream_yaml_is_refused_at_once(tmp_path: Path) -> None:
    import time

    from pgstream_dagster.config import load_metrics_settings

    path = bombed(tmp_path)
    for load in (load_config, load_metrics_settings):
        started = time.monotonic()
        with pytest.raises(ConfigError) as refused:
            load(path)
        assert time.monotonic() - started < 5  # expanding it takes minutes
        assert str(refused.value) == (f"{path}: refused: its aliases expand to more than 1,000,000 values (an alias "
                                      "bomb?): write the values out or use fewer aliases")
    # an alias inside the node it names (a structure that contains itself) is refused too
    write(tmp_path, "database_url: postgresql://x@127.0.0.1:1/db\nstreams: &s [*s]\n")
    with pytest.raises(ConfigError, match=r"pgstream.yaml: refused: an alias refers to a node that holds it"):
        load_config(path)


def test_the_cli_refuses_an_alias_bomb_in_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    path = bombed(tmp_path)
    result = subprocess.run([sys.executable, "-m", "pgstream_dagster.cli", "executor-requirements", "--config",
                             str(path)], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [f"error: {path}: refused: its aliases expand to more than 1,000,000 "
                                          "values (an alias bomb?): write the values out or use fewer aliases"]


def test_anchors_and_aliases_of_a_normal_configuration_still_work(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_PG_URL", "postgresql://u:hunter2@db/x")
    # anchors on values of keys the configuration has: the first stream's, used by the second
    path = write(tmp_path, """
database_url: ${TEST_PG_URL}
streams:
  - id: 1
    sink: &sink {type: http, url: http://127.0.0.1:9/hook, headers: {Authorization: "Bearer x"}}
    batch: &batch {max_size: 10, max_fill_secs: 0}
  - {id: 2, sink: {<<: *sink, url: http://127.0.0.1:9/other}, batch: *batch}
subscriptions: []
""")
    cfg = load_config(path)
    assert [s.batch.max_size for s in cfg.streams] == [10, 10]
    urls = [s.sink.url.get_secret_value() for s in cfg.streams]  # type: ignore[union-attr]
    assert urls == ["http://127.0.0.1:9/hook", "http://127.0.0.1:9/other"]


def test_a_typo_stops_the_code_location_with_one_error_naming_file_key_and_what_is_allowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The code location's entry point (what `dg dev` and the UI load): a mistake in pgstream.yaml that leaves no
    stream valid (here its only stream's) is the error itself, one line naming the file, the key and the keys
    allowed there, not a cause under Dagster's dump of the component tree (with other streams valid, only that
    stream is left out: below)."""
    from pgstream_dagster import definitions

    monkeypatch.setenv("TEST_PG_URL", "postgresql://x")
    monkeypatch.setenv("TEST_TOKEN", "s3cr3t")
    path = write(tmp_path, GOOD.replace("id: 1\n", "id: 1\n    delivery: {mdoe: warm}\n"))
    monkeypatch.setenv("PGSTREAM_CONFIG", str(path))
    with pytest.raises(ConfigError) as err:
        definitions.defs()
    assert str(err.value) == (f"{path}: streams[0].delivery.mdoe: unknown key (allowed: mode, tuning, ordering, "
                              "routing_key, parallelism, chunk_size, max_events_per_run, on_reject, max_attempts, "
                              "max_consecutive_rejects, run_grace_secs)")
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_the_code_location_leaves_an_invalid_stream_out_and_keeps_the_others_while_the_cli_refuses_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One stream's mistake stops no other: read as the code location reads it, an entry invalid on its own is
    left out with its problems in one line (naming the file and the key, never the value) and its subscriptions
    are kept (its events go on being written); the CLI, which applies the file, refuses it whole. A file with
    no valid stream, or a problem outside the streams, is refused either way."""
    from pgstream_dagster.defs.location import build_definitions

    path = tmp_path / "pgstream.yaml"
    path.write_text("""
database_url: postgresql://u:secretpw@127.0.0.1/db
streams:
  - {id: 1, sink: {type: file, path: /tmp/a.jsonl}}
  - {id: 2, sink: {type: http, url: "http://x.example/hook", timeout_secs: -1, colour: red}}
  - {id: 3, reader: g, sink: {type: file, path: /tmp/c.jsonl}}
subscriptions:
  - {key: orders, stream_id: 2, table_name: orders, operation: INSERT}
""")
    config = load_config(path, leave_out_invalid=True)
    assert [s.id for s in config.streams] == [1, 3]
    assert list(config.left_out) == [2]
    line = config.left_out[2]
    assert line.startswith(f"{path}: streams[1].sink.timeout_secs: ") and "streams[1].sink.colour: unknown key" in line
    assert "\n" not in line and "secretpw" not in line and "x.example" not in line
    assert [s.key for s in config.subscriptions] == ["orders"]
    with pytest.raises(ConfigError, match=r"streams\[1\]\.sink\.colour"):
        load_config(path)  # the CLI: the whole file
    from pgstream_dagster.cli import main

    assert main(["check", "--config", str(path)]) == 1  # what a CI runs: every problem, one line each
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith(f"error: {path}: streams[1].sink.") for line in err), err
    assert any("streams[1].sink.colour: unknown key" in line for line in err)
    assert any("streams[1].sink.timeout_secs: " in line for line in err)
    assert "secretpw" not in "".join(err)
    defs = build_definitions(path)
    sensors = sorted(str(s.name) for s in defs.sensors or [])
    # the valid streams are read by their groups' sensors (stream 1 by the default group's), the entry left out
    # has a sensor of its own that tells what is wrong
    assert sensors == ["pgstream_group_default", "pgstream_group_g", "pgstream_stream_2", "pgstream_subscriptions"]
    assert defs.resolve_sensor_def("pgstream_stream_2").description == (
        f"stream 2 is left out: its streams[] entry is invalid: {line}. Fix the entry and reload the code location.")
    path.write_text(path.read_text().replace("id: 1, sink", "id: 1, snk").replace("id: 3, reader: g, sink",
                                                                                 "id: 3, reader: g, snk"))
    with pytest.raises(ConfigError, match=r"streams\[1\]\.sink"):  # nothing valid is left: the file is refused
        load_config(path, leave_out_invalid=True)
    path.write_text("database_url: nope\nstreams:\n  - {id: 1, sink: {type: file, path: /tmp/a.jsonl}}\n"
                    "  - {id: 2, snk: {}}\n")
    with pytest.raises(ConfigError, match="database_url"):  # a problem outside the streams refuses the file
        load_config(path, leave_out_invalid=True)


def test_check_validates_the_file_without_connecting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pgstream-dagster check` reads and validates the file (no server is running at the URL) and says what
    it holds."""
    from pgstream_dagster.cli import main

    path = tmp_path / "pgstream.yaml"
    path.write_text("database_url: postgresql://u@127.0.0.1:1/db\nstreams:\n"
                    "  - {id: 1, sink: {type: file, path: /tmp/a.jsonl}}\n"
                    "  - {id: 2, reader: g, sink: {type: file, path: /tmp/b.jsonl}}\n")
    assert main(["check", "--config", str(path)]) == 0
    assert capsys.readouterr().out.strip() == "2 streams and 0 subscriptions are valid (reader groups: default, g)"
