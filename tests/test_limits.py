"""The limits that can stop a stream are reported before they do, one line each naming the setting
and the value to set: ``pgstream-dagster preflight`` and ``init`` exit non-zero and change nothing; a
reader group's sensor whose slot cannot be created says so in its tick's skip reason; the groups that fit deliver.
Every stream is in a reader group (``default`` unless it names one): a slot and a WAL sender per group, whatever
the number of its streams.

A private cluster with ``max_replication_slots = 2`` and ``max_wal_senders = 4`` (the session's cluster has 32)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psycopg
import pytest
import yaml

from pgstream_dagster.cli import main
from pgstream_dagster.defs.names import GROUP_TAG
from pgstream_dagster.devdb import LocalPostgres, ensure_running
from pgstream_dagster.engine.migrations import migrate

from .support.dagster_dev import repo_root
from .support.harness import (
    Driver,
    at_least,
    event_ids,
    group_tag_of,
    insert_events,
    read_jsonl,
    tick_until,
    write_config,
)

SLOTS_LINE = ("max_replication_slots is 2 and 0 are in use; reader group g3 needs one more: set "
              "max_replication_slots = 8 in postgresql.conf and restart Postgres")


@pytest.fixture(scope="module")
def small_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    server = ensure_running(tmp_path_factory.mktemp("pg-limits") / "data",
                            extra_settings={"fsync": "off", "full_page_writes": "off", "max_replication_slots": "2",
                                            "max_wal_senders": "4"})
    yield server
    server.destroy()


def _streams(tmp_path: Path, reader: bool = False,
             delivery: dict[str, object] | None = None) -> list[dict[str, object]]:
    """Streams 1, 2 and 3; ``reader``: each in a reader group of its own (g1, g2, g3), else all in the default
    group."""
    return [{"id": i, "batch": {"max_size": 100, "max_fill_secs": 0}, "delivery": delivery or {},
             "sink": {"type": "file", "path": str(tmp_path / f"out-{i}.jsonl")},
             **({"reader": f"g{i}"} if reader else {})} for i in (1, 2, 3)]


def _slots(url: str) -> int:
    with psycopg.connect(url) as c:
        row = c.execute("select count(*) from pg_replication_slots").fetchone()
    assert row is not None
    return int(row[0])


def test_more_groups_than_slots_one_line_from_preflight_init_and_the_sensor_and_the_others_deliver(
        small_pg: LocalPostgres, tmp_path: Path, instance: dg.DagsterInstance,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Three streams in the default group take one slot (they fit in max_replication_slots = 2); three streams in
    three reader groups take three: preflight and init say so in one line (init changes nothing), the third
    group's sensor says it in its skip reason (and requests no run), and the two groups that fit deliver."""
    url = small_pg.url
    migrate(url)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    capsys.readouterr()
    default = write_config(tmp_path / "default.yaml", url, _streams(tmp_path))
    assert main(["preflight", "--config", str(default)]) == 0
    assert capsys.readouterr().err.splitlines() == []
    config = write_config(tmp_path / "pgstream.yaml", url, _streams(tmp_path, reader=True))
    assert main(["preflight", "--config", str(config)]) == 1
    assert capsys.readouterr().err.splitlines() == [SLOTS_LINE]
    assert main(["init", "--config", str(config)]) == 1
    out = capsys.readouterr()
    assert out.err.splitlines() == [SLOTS_LINE] and "ready" not in out.out
    assert _slots(url) == 0  # init changed nothing

    # the Dagster instance's max_concurrent_runs (its run coordinator) against the groups' delivery runs: one per
    # group whatever the number of its streams
    home = tmp_path / "preflight_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster.core.run_coordinator\n  class: QueuedRunCoordinator\n"
        "  config:\n    max_concurrent_runs: 2\ntelemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    open_runs: dict[str, object] = {"mode": "open"}
    assert main(["preflight", "--config", str(write_config(tmp_path / "open_runs-default.yaml", url,
                                                           _streams(tmp_path, delivery=open_runs)))]) == 0
    assert capsys.readouterr().err.splitlines() == []
    assert main(["preflight", "--config", str(write_config(tmp_path / "open_runs.yaml", url,
                                                           _streams(tmp_path, reader=True, delivery=open_runs)))]) == 1
    assert capsys.readouterr().err.splitlines() == [SLOTS_LINE, (
        "max_concurrent_runs is 2 and 3 reader groups keep a group delivery run, plus one for housekeeping, checks "
        "and replays: a stream without a run waits up to delivery.tuning.max_run_secs: set max_concurrent_runs = 8 "
        f"under run_coordinator.config (or concurrency.runs) in {home / 'dagster.yaml'}")]
    monkeypatch.delenv("DAGSTER_HOME")

    # the sensors: groups g1 and g2 take the two slots (their group runs' readers create them); g3's tick says why
    # it cannot, in one line, and requests no group run (one would end at once, and another be requested)
    driver = Driver(config, instance)
    deadline = time.monotonic() + 60
    while _slots(url) < 2:
        assert time.monotonic() < deadline, "the groups' slots were not created"
        for stream_id in (1, 2):
            driver.tick(stream_id)
    for _ in range(2):
        result = driver.tick(3)
        assert not result.run_requests
        assert result.skip_message == ("max_replication_slots is 2 and 2 are in use; reader group g3 needs one "
                                      "more: set max_replication_slots = 8 in postgresql.conf and restart Postgres")
    assert "g3" not in driver.group_runs
    assert not instance.get_runs(dg.RunsFilter(tags={GROUP_TAG: group_tag_of(url, "g3")}))
    assert _slots(url) == 2
    for stream_id in (1, 2):  # the groups that fit deliver
        insert_events(url, stream_id, 5)
        sink_file = tmp_path / f"out-{stream_id}.jsonl"
        tick_until(driver, stream_id, at_least(lambda: len(read_jsonl(sink_file)), 5))  # noqa: B023
        assert [e["id"] for e in read_jsonl(tmp_path / f"out-{stream_id}.jsonl")] == event_ids(url, stream_id)


def test_preflight_and_init_name_a_run_queue_without_room_for_a_group_runs_successor(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The run queue's limit on the group delivery runs (run tag pgstream/group) against a hand-over, which has a
    group's run and its successor at once: a limit of 1 per group, or one for every group together that leaves no
    room beside the groups' runs, is one line from preflight and from init (which then changes nothing), naming the
    setting; 2 per group (the repository's dagster.yaml) fits, and so does a limit on one group's value alone."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    where = home / "dagster.yaml"

    def queue(*limits: dict[str, object]) -> None:
        where.write_text(yaml.safe_dump({
            "run_coordinator": {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator",
                                "config": {"tag_concurrency_limits": list(limits)}},
            "telemetry": {"enabled": False}}))

    def preflight(config: Path) -> tuple[int, list[str]]:
        code = main(["preflight", "--config", str(config)])
        return code, capsys.readouterr().err.splitlines()

    per_group = {"key": GROUP_TAG, "value": {"applyLimitPerUniqueValue": True}}
    one = write_config(tmp_path / "one.yaml", db_url, _streams(tmp_path))
    three = write_config(tmp_path / "three.yaml", db_url, _streams(tmp_path, reader=True))
    capsys.readouterr()
    queue(*(entry for entry in yaml.safe_load((repo_root() / "dagster.yaml").read_text())["run_coordinator"]["config"]
            ["tag_concurrency_limits"] if entry["key"] == GROUP_TAG))
    assert preflight(three) == (0, [])
    queue({**per_group, "limit": 1})
    line = (f"the run queue allows 1 run at once per reader group (run tag {GROUP_TAG}): a group delivery run's "
            f"successor cannot start beside it, so the group's members pause for a run's process start at each "
            f"hand-over (every delivery.tuning.max_run_secs and each configuration change): set limit: 2 for key "
            f"{GROUP_TAG} under run_coordinator.config.tag_concurrency_limits in {where}")
    assert preflight(one) == (1, [line])
    with psycopg.connect(db_url) as c:
        groups = c.execute("select count(*) from pgstream.reader_groups").fetchone()
    assert main(["init", "--config", str(one)]) == 1
    assert capsys.readouterr().err.splitlines() == [line]
    with psycopg.connect(db_url) as c:  # init changed nothing
        assert c.execute("select count(*) from pgstream.reader_groups").fetchone() == groups
    queue({"key": GROUP_TAG, "limit": 3}, {"key": GROUP_TAG, "value": "g1@elsewhere", "limit": 1})
    assert preflight(one) == (0, [])  # (one group's run and its successor fit in 3, as a value of its own)
    assert preflight(three) == (1, [
        f"the run queue allows 3 runs at once with run tag {GROUP_TAG}, for the delivery runs of 3 reader group(s) "
        f"together: a group delivery run's successor cannot start beside it, so the group's members pause for a "
        f"run's process start at each hand-over (every delivery.tuning.max_run_secs and each configuration change): "
        f"set limit: 2 and value: {{applyLimitPerUniqueValue: true}} for key {GROUP_TAG} under "
        f"run_coordinator.config.tag_concurrency_limits in {where}"])
    queue({"key": GROUP_TAG, "limit": 4})
    assert preflight(three) == (0, [])


def test_preflight_counts_one_wal_sender_per_reader_group(
        small_pg: LocalPostgres, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader group's delivery run reads the group's slot over replication (one WAL sender per group, however
    many streams it has): with max_wal_senders = 4, five groups do not fit and preflight says so in one line;
    four groups of three streams each do."""
    url = small_pg.url
    migrate(url)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)

    def senders_line(groups: int, per_group: int) -> list[str]:
        streams = [{"id": 100 + i, "reader": f"g{i % groups}", "batch": {"max_size": 100, "max_fill_secs": 0},
                    "sink": {"type": "file", "path": str(tmp_path / f"out-g{i}.jsonl")}}
                   for i in range(groups * per_group)]
        config = write_config(tmp_path / f"groups-{groups}.yaml", url, streams)
        capsys.readouterr()
        main(["preflight", "--config", str(config)])
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("max_wal_senders")]

    (line,) = senders_line(5, 1)
    assert line.startswith("max_wal_senders is 4 and ") and line.endswith(
        "; 5 reader groups' delivery runs read their group's slot over replication, one WAL sender each: set "
        "max_wal_senders = 8 in postgresql.conf and restart Postgres"), line
    assert senders_line(4, 3) == []
    # streams that name no group: one (the default group), however many
    streams = [{"id": 200 + i, "batch": {"max_size": 100, "max_fill_secs": 0},
                "sink": {"type": "file", "path": str(tmp_path / f"out-d{i}.jsonl")}} for i in range(20)]
    capsys.readouterr()
    main(["preflight", "--config", str(write_config(tmp_path / "default.yaml", url, streams))])
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("max_wal_senders")] == []


def test_preflight_counts_the_connections_dagsters_storage_keeps_on_the_same_server(
        small_pg: LocalPostgres, pg: LocalPostgres, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The repository's storage keeps three idle connections per Dagster process (its webserver, daemon and code
    server, and each run at once): on the streams' server they count against max_connections (200 here)."""
    url = small_pg.url
    migrate(url)
    config = write_config(tmp_path / "pgstream.yaml", url, _streams(tmp_path)[:2])

    def connections_line(server: LocalPostgres, runs: int) -> list[str]:
        """preflight's max_connections line with Dagster's storage on ``server`` (the other lines are the other
        tests' slots on this cluster)."""
        name = f"dagster_limits_{server.port}_{runs}"
        server.create_database(name)
        home = tmp_path / name
        home.mkdir()
        instance = yaml.safe_load((repo_root() / "dagster.yaml").read_text())
        instance["run_coordinator"]["config"] = {"max_concurrent_runs": runs}
        (home / "dagster.yaml").write_text(yaml.safe_dump(instance))
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        monkeypatch.setenv("DAGSTER_POSTGRES_URL",
                           server.url_for(name).replace("postgresql://", "postgresql+psycopg2://"))
        capsys.readouterr()
        main(["preflight", "--config", str(config)])
        return [line for line in capsys.readouterr().err.splitlines() if "max_connections" in line]

    # 2 streams in the default group: a connection each while delivering, the group's sensor, run, lease, reader
    # and members' lease session, housekeeping 4; Dagster: 3 per process, 3 processes and 60 runs
    assert connections_line(small_pg, 60) == [
        "max_connections is 200 (197 usable by the streams); 2 streams in 1 reader group(s) need up to 200 (a "
        "connection per stream delivering at once, 8 at most per group, the groups' sensors, readers and leases, "
        "housekeeping, "
        "Dagster's storage on this server 189): set max_connections = 208 in postgresql.conf and restart Postgres"]
    assert connections_line(small_pg, 59) == []  # 186 + 11 fit
    assert connections_line(pg, 60) == []  # on another server: not this one's


def test_a_connection_refused_for_a_limit_is_named_in_one_line_and_is_no_outage(db_url: str) -> None:
    """A role's CONNECTION LIMIT reached: the runtime's connection fails in one line naming the limit and the
    setting to change, never the password; not taken for the server going away (a group run's member fails
    over with backoff instead of being hosted again every second, the group run does not ride an outage out)."""
    from pgstream_dagster.engine import dbconn
    from pgstream_dagster.engine.delivery.group import _database_gone

    role = f"limited_{time.monotonic_ns() % 10**9}"
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(f"create role {role} login password 'Pw-{role}' connection limit 0")
    try:
        url = db_url.replace("postgres@", f"{role}:Pw-{role}@", 1)
        with pytest.raises(dbconn.ConnectionLimit) as refused:
            dbconn.connect(url)
        line = str(refused.value)
        assert line.startswith(f"Postgres refused a connection of role {role} at "), line
        assert f'too many connections for role "{role}": raise the role\'s limit (ALTER ROLE ... CONNECTION LIMIT n)' \
            in line, line
        assert "\n" not in line and f"Pw-{role}" not in line
        assert dbconn.server_gone(refused.value) is None and not _database_gone(refused.value)
    finally:
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute(f"drop role {role}")
