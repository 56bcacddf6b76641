"""The definitions layer the Dagster way: the defs folder loads with ``dg check defs`` / ``dg list
defs``; a stream declared as a ``pgstream_dagster.StreamComponent`` in a ``defs.yaml`` gives the
same definitions as the same stream in ``pgstream.yaml``, is validated by the same models (same
messages) and may collide with no pgstream.yaml stream; the resource holds every stream."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

import pgstream_dagster
from pgstream_dagster.component import StreamComponent
from pgstream_dagster.config import ConfigError, HousekeepingConfig, load_config
from pgstream_dagster.defs.assets import subscription_keys
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.resources import PgstreamResource

from .support.dagster_dev import repo_root

DG = Path(sys.executable).with_name("dg")
URL = "postgresql://app:hunter2@127.0.0.1:1/pgstream"
SECRET = "s3cr3t-token"
#: what Dagster adds to the assets of any component (where it was declared), not pgstream's
COMPONENT_METADATA = {"dagster/code_references", "dagster/component_origin"}

STREAM_1: dict[str, Any] = {"id": 1, "sink": {"type": "memory", "name": "one"}}
STREAM_2: dict[str, Any] = {
    "id": 2, "reader": "orders", "batch": {"max_size": 50, "max_fill_secs": 0.2},
    "sink": {"type": "http", "url": "http://127.0.0.1:9/hook", "headers": {"Authorization": "Bearer ${HOOK_TOKEN}"}},
    "delivery": {"mode": "open", "on_reject": "dead_letter"}, "sensor": {"interval_secs": 2},
    "checks": {"max_undelivered_age_secs": 60},
}
SUBS_1 = [{"key": "signup", "stream_id": 1, "operation": "INSERT", "table_name": "users", "column_names": ["id"]}]
SUBS_2: list[dict[str, Any]] = [
    {"key": "order-paid", "operation": "UPDATE", "schema_name": "shop", "table_name": "orders",
     "when_clause": "new.paid and not old.paid", "column_names": ["id", "total"],
     "payload_extensions": [{"json_path": "group_id", "expression": "new.customer_id::text"}]},
    {"key": "signup", "operation": "INSERT", "table_name": "users", "trigger_mode": "statement"}]


def _project(root: Path, component: dict[str, Any] | str | None, streams: list[dict[str, Any]] | None = None,
             subscriptions: list[dict[str, Any]] | None = None) -> str:
    """A dg project of a user of pgstream-dagster: pgstream.yaml, a defs folder with pgstream's
    shared definitions and (``component``) ``defs/orders/defs.yaml`` declaring a StreamComponent
    (attributes, or the file's text). Returns its root module (unique: it is imported)."""
    module = f"pgstream_user_{uuid.uuid4().hex[:8]}"
    (root / "pyproject.toml").write_text(f'[tool.dg]\ndirectory_type = "project"\n\n[tool.dg.project]\n'
                                         f'root_module = "{module}"\nregistry_modules = ["pgstream_dagster"]\n')
    defs = root / module / "defs"
    defs.mkdir(parents=True)
    (root / module / "__init__.py").write_text("")
    (root / module / "definitions.py").write_text(
        "from pathlib import Path\n\nimport dagster as dg\n\n\n@dg.definitions\ndef defs() -> dg.Definitions:\n"
        "    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)\n")
    (defs / "__init__.py").write_text("")
    (defs / "pgstream.py").write_text("from pgstream_dagster.defs.location import pgstream_location  # noqa: F401\n")
    (root / "pgstream.yaml").write_text(yaml.safe_dump({
        "database_url": "${TEST_PG_URL}", "streams": streams or [STREAM_1],
        "subscriptions": SUBS_1 if subscriptions is None else subscriptions, "spark": {"master": "local[1]"}}))
    if component is not None:
        (defs / "orders").mkdir()
        text = component if isinstance(component, str) else yaml.safe_dump(
            {"type": "pgstream_dagster.StreamComponent", "attributes": component})
        (defs / "orders" / "defs.yaml").write_text(text)
    return module


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    monkeypatch.setenv("TEST_PG_URL", URL)
    monkeypatch.setenv("HOOK_TOKEN", SECRET)
    monkeypatch.setenv("PGSTREAM_CONFIG", str(tmp_path / "pgstream.yaml"))
    return {"TEST_PG_URL": URL, "HOOK_TOKEN": SECRET, "PGSTREAM_CONFIG": str(tmp_path / "pgstream.yaml")}


def _load(root: Path, module: str, monkeypatch: pytest.MonkeyPatch) -> dg.Definitions:
    monkeypatch.syspath_prepend(str(root))
    return dg.load_from_defs_folder(project_root=root)


def _dg(args: list[str], cwd: Path, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``dg`` as a user runs it in a project; this checkout's package first on the path, a
    throw-away Dagster instance (the repo's dagster.yaml wants a Postgres)."""
    home = tmp_path / f"dagster_home_{uuid.uuid4().hex[:6]}"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    path = os.pathsep.join([str(repo_root()), str(cwd)])
    run_env = {**os.environ, **env, "DAGSTER_HOME": str(home), "PYTHONPATH": path, "NO_COLOR": "1",
               "COLUMNS": "250"}
    return subprocess.run([str(DG), *args], cwd=cwd, env=run_env, capture_output=True, text=True, timeout=600)


# --------------------------------------------------------------------------------------------


def test_dg_check_and_list_defs_of_this_project(tmp_path: Path) -> None:
    env = {"PGSTREAM_DATABASE_URL": URL}
    checked = _dg(["check", "defs"], repo_root(), env, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "All definitions loaded successfully" in checked.stdout + checked.stderr
    listed = _dg(["list", "defs"], repo_root(), env, tmp_path)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    for name in ("pgstream_group_default", "pgstream_delivery", "pgstream_stream_control", "pgstream_replay",
                 "pgstream_housekeeping", "pgstream_checks", "pgstream_subscriptions",
                 "pgstream/stream_1/deliveries", "pgstream/events_partitions"):
        assert name in listed.stdout, (name, listed.stdout)
    assert "hunter2" not in listed.stdout + listed.stderr


def test_dg_scaffold_check_and_a_bad_defs_yaml_in_a_users_project(tmp_path: Path, env: dict[str, str]) -> None:
    _project(tmp_path, None)
    scaffolded = _dg(["scaffold", "defs", "pgstream_dagster.StreamComponent", "orders", "--id", "7",
                      "--table-name", "orders"], tmp_path, env, tmp_path)
    assert scaffolded.returncode == 0, scaffolded.stdout + scaffolded.stderr
    (written,) = tmp_path.glob("*/defs/orders/defs.yaml")
    text = written.read_text()
    assert text.startswith("# A pgstream stream and its subscriptions")
    attributes = yaml.safe_load(text)["attributes"]
    assert attributes["id"] == 7 and attributes["subscriptions"][0]["table_name"] == "orders"
    checked = _dg(["check", "defs"], tmp_path, env, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    listed = _dg(["list", "defs"], tmp_path, env, tmp_path)
    # both streams' definitions, read by the sensor of their reader group (default: they name none)
    assert all(name in listed.stdout for name in ("pgstream/stream_7/deliveries", "pgstream/stream_1/deliveries",
                                                  "pgstream_group_default")), listed.stdout

    written.write_text(text.replace("max_size: 1000", "max_size: 0").replace("operation: INSERT", "operation: UPSERT"))
    broken = _dg(["check", "defs"], tmp_path, env, tmp_path)
    out = broken.stdout + broken.stderr
    assert broken.returncode != 0
    assert f"{written}: attributes.batch.max_size: Input should be greater than or equal to 1" in out, out
    assert (f"{written}: attributes.subscriptions[0].operation: Input should be 'INSERT', 'UPDATE' or 'DELETE' "
            f"(subscription 'orders-insert')") in out, out


def _spec_view(spec: dg.AssetSpec) -> dict[str, Any]:
    return {"group": spec.group_name, "kinds": spec.kinds,
            "deps": sorted(d.asset_key.to_user_string() for d in spec.deps),
            "code_version": spec.code_version, "skippable": spec.skippable,
            "condition": spec.automation_condition.get_label() if spec.automation_condition else None,
            "metadata": {k: v for k, v in spec.metadata.items() if k not in COMPONENT_METADATA}}


def _view(defs: dg.Definitions) -> dict[str, Any]:
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    return {
        "assets": {spec.key.to_user_string(): _spec_view(spec) for spec in defs.resolve_all_asset_specs()},
        "checks": sorted((k.asset_key.to_user_string(), k.name, graph.get_check_spec(k).blocking)
                         for k in graph.asset_check_keys),
        "jobs": sorted(j.name for j in repo.get_all_jobs()),
        "replay_tags": {j.name: dict(j.tags) for j in repo.get_all_jobs() if j.name.startswith("pgstream_replay")},
        "schedules": sorted((s.name, str(s.cron_schedule)) for s in repo.schedule_defs),
        "sensors": sorted((s.name, s.minimum_interval_seconds, s.description, s.default_status)
                          for s in repo.sensor_defs),
        "subscriptions_target": sorted(k.to_user_string() for k in repo.get_job("pgstream_subscriptions")
                                       .asset_layer.selected_asset_keys),
        "resources": sorted(defs.resources or {}),
    }


def test_stream_component_gives_the_definitions_of_the_same_stream_in_pgstream_yaml(
        tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    project, single = tmp_path / "project", tmp_path / "single"
    project.mkdir()
    single.mkdir()
    module = _project(project, {**STREAM_2, "subscriptions": SUBS_2})
    monkeypatch.setenv("PGSTREAM_CONFIG", str(project / "pgstream.yaml"))
    from_component = _load(project, module, monkeypatch)

    # the same two streams, both in one pgstream.yaml
    _project(single, None, streams=[STREAM_1, STREAM_2],
             subscriptions=[*SUBS_1, *({**s, "stream_id": 2} for s in SUBS_2)])
    from_yaml = build_definitions(single / "pgstream.yaml")

    component_view, yaml_view = _view(from_component), _view(from_yaml)
    assert component_view == yaml_view
    assert "pgstream_group_default" in {s[0] for s in yaml_view["sensors"]}  # the streams' group's (no reader:)
    assert {"pgstream/stream_2/deliveries", "pgstream/stream_2/status", "pgstream/stream_2/subscription_set",
            "pgstream/stream_2/subscriptions/order_paid_update_shop_orders", "postgres/shop/orders",
            "postgres/public/users"} <= set(yaml_view["assets"])

    # one resource, read once, holding every stream: the shared delivery job finds the component's
    resource = from_component.resources["pgstream"]  # type: ignore[index]
    assert isinstance(resource, PgstreamResource)
    assert resource.config == from_yaml.resources["pgstream"].config  # type: ignore[index]
    assert resource.stream(2).sink.type == "http" and resource.stream(2).reader == "orders"
    assert [s.key for s in resource.config.subscriptions if s.stream_id == 2] == ["order-paid", "signup"]
    # the one backfill job finds a component stream's subscription assets (it reports its progress there)
    assert {k.to_user_string() for k in subscription_keys(resource.config, 2).values()} == {
        a for a in component_view["assets"] if a.startswith("pgstream/stream_2/subscriptions/")}
    # nothing secret in what Dagster shows
    assert "hunter2" not in repr(resource) and SECRET not in repr(resource)
    meta = str([spec.metadata for spec in from_component.resolve_all_asset_specs()])
    assert SECRET not in meta and "hunter2" not in meta
    component = dg.ComponentTree.for_project(project).load_component("orders")
    assert isinstance(component, pgstream_dagster.StreamComponent) and SECRET not in repr(component)


def test_a_bad_defs_yaml_gives_the_pgstream_yaml_error(tmp_path: Path, env: dict[str, str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    bad = {**STREAM_2, "batch": {"max_size": 0}, "delivery": {"ordering": "sideways"},
           "subscriptions": [{"key": "x", "operation": "INSERT", "table_name": "t", "trigger_mode": "sometimes"}]}
    module = _project(tmp_path, bad)
    with pytest.raises(Exception) as raised:
        _load(tmp_path, module, monkeypatch)
    error = raised.value.__cause__
    assert isinstance(error, ConfigError), raised.value
    defs_yaml = tmp_path / module / "defs" / "orders" / "defs.yaml"
    assert str(error).splitlines() == [
        f"{defs_yaml}: attributes.batch.max_size: Input should be greater than or equal to 1",
        f"{defs_yaml}: attributes.delivery.ordering: Input should be 'global' or 'by_key'",
        f"{defs_yaml}: attributes.subscriptions[0].trigger_mode: Input should be 'row' or 'statement' "
        f"(subscription 'x')",
    ]
    assert SECRET not in str(raised.value)

    # the same mistakes in pgstream.yaml: the same messages
    in_yaml = tmp_path / "in_yaml.yaml"
    in_yaml.write_text(yaml.safe_dump({"database_url": URL, "streams": [{k: v for k, v in bad.items()
                                                                          if k != "subscriptions"}],
                                       "subscriptions": [{**bad["subscriptions"][0], "stream_id": 2}]}))
    with pytest.raises(ConfigError) as from_yaml:
        load_config(in_yaml)
    assert [line.split(": ", 2)[2] for line in str(from_yaml.value).splitlines()] == \
        [line.split(": ", 2)[2] for line in str(error).splitlines()]


@pytest.mark.parametrize(("component", "message"), [
    ({"id": 1, "sink": {"type": "memory"}}, "stream ids must be unique, duplicated: [1]"),
    ({"id": 3, "sink": {"type": "memory"}, "subscriptions": [{"key": "k", "stream_id": 4, "operation": "INSERT",
                                                              "table_name": "t"}]},
     "subscriptions[0] ('k') uses stream_id 4, which is not this stream's id 3 (leave stream_id out)"),
])
def test_component_streams_collide_with_nothing(tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                                component: dict[str, Any], message: str) -> None:
    module = _project(tmp_path, component, streams=[STREAM_1])
    with pytest.raises(Exception) as raised:
        _load(tmp_path, module, monkeypatch)
    assert isinstance(raised.value.__cause__, ConfigError), raised.value
    assert message in str(raised.value.__cause__)
    if "subscriptions" not in component:  # the collision names both sources
        assert f"{tmp_path / 'pgstream.yaml'} + {tmp_path / module / 'defs' / 'orders' / 'defs.yaml'}" in \
            str(raised.value.__cause__)


def test_stream_component_is_exported_without_importing_dagster_for_the_engine() -> None:
    assert pgstream_dagster.StreamComponent is StreamComponent
    assert "StreamComponent" in dir(pgstream_dagster)
    code = "import sys, pgstream_dagster.engine.spark, pgstream_dagster.sinks; print('dagster' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(repo_root())})
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("cron", ["0 3 * * *", "*/5 * * * *", "@daily", "0 0 1-7 * mon", "15 2 L * *"])
def test_cron_accepted(cron: str) -> None:
    assert HousekeepingConfig(cron=cron).cron == cron
    dg.ScheduleDefinition(name="s", cron_schedule=cron, target=dg.AssetSelection.all())  # Dagster agrees


@pytest.mark.parametrize("cron", ["daily", "61 * * * *", "* * * * * *", "0 0 30 2 *", "0 0 31 feb *", ""])
def test_cron_refused(cron: str) -> None:
    with pytest.raises(ValueError, match="not a valid cron expression"):
        HousekeepingConfig(cron=cron)


def test_the_code_location_loads_from_an_installed_package_without_pyproject(tmp_path: Path) -> None:
    """As a wheel installs it: the package (with sql/ inside, as [tool.hatch...force-include] puts
    it) in a site directory with no pyproject.toml or dg.toml above it."""
    site = tmp_path / "site"
    shutil.copytree(repo_root() / "pgstream_dagster", site / "pgstream_dagster",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo_root() / "sql", site / "pgstream_dagster" / "sql")
    config = tmp_path / "pgstream.yaml"
    config.write_text(yaml.safe_dump({"database_url": "postgresql://127.0.0.1:1/none",
                                      "streams": [{"id": 3, "sink": {"type": "memory"}}]}))
    code = ("import pgstream_dagster, pgstream_dagster.engine.migrations as m\n"
            "from pgstream_dagster.definitions import defs\n"
            "d = defs()\n"
            "print(pgstream_dagster.__file__, m.sql_dir())\n"
            "print(sorted({j.name for j in d.jobs}), sorted(s.name for s in d.sensors))\n")
    env = {**os.environ, "PYTHONPATH": str(site), "PGSTREAM_CONFIG": str(config)}
    env.pop("DAGSTER_HOME", None)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    where, names = result.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(site / "pgstream_dagster")) and str(site / "pgstream_dagster" / "sql") in where
    assert "'pgstream_delivery'" in names and "'pgstream_replay'" in names and "'pgstream_group_default'" in names


def test_the_cli_reads_the_streams_of_the_defs_folder(tmp_path: Path, env: dict[str, str], db_url: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The commands that need a stream's configuration (dead-letters redeliver, backfill run,
    executor-requirements) see the streams of the project's StreamComponents with ``--defs-folder``
    (or ``$PGSTREAM_DEFS_FOLDER``): the same streams the code location's resource holds, checked the
    same way, and only the defs.yaml files of StreamComponents count."""
    from pgstream_dagster.cli import main as cli_main
    from pgstream_dagster.config import load_component_streams

    module = _project(tmp_path, {**STREAM_2, "subscriptions": SUBS_2})
    defs = tmp_path / module / "defs"
    (defs / "other").mkdir()
    (defs / "other" / "defs.yaml").write_text(  # another component type, and a second document of ours
        "type: dagster.DefsFolderComponent\nattributes: {}\n---\n" + yaml.safe_dump(
            {"type": "pgstream_dagster.component.stream.StreamComponent",
             "attributes": {"id": 3, "sink": {"type": "redis", "url": "redis://127.0.0.1:6379/0", "stream": "s3"},
                            "delivery": {"ordering": "by_key", "routing_key": "record.id"}}}))
    cfg = tmp_path / "pgstream.yaml"
    declared, sources = load_component_streams(defs)
    assert sorted(d.id for d in declared) == [2, 3]
    assert sorted(sources) == [str(defs / "orders" / "defs.yaml"), str(defs / "other" / "defs.yaml")]

    merged = load_config(cfg, defs)
    assert [s.id for s in merged.streams] == [1, 2, 3]
    assert {(s.key, s.stream_id) for s in merged.subscriptions} >= {("order-paid", 2), ("signup", 2), ("signup", 1)}
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = dg.load_from_defs_folder(project_root=tmp_path).resources["pgstream"]  # type: ignore[index]
    assert isinstance(loaded, PgstreamResource)
    assert sorted(s.id for s in loaded.config.streams) == [1, 2, 3]
    assert loaded.config.stream(2) == merged.stream(2) and loaded.config.stream(3) == merged.stream(3)

    # a collision or a bad attribute: the code location's messages, naming the files, never a value
    (defs / "clash").mkdir()
    (defs / "clash" / "defs.yaml").write_text(yaml.safe_dump(
        {"type": "pgstream_dagster.StreamComponent", "attributes": {"id": 1, "sink": {"type": "memory"}}}))
    with pytest.raises(ConfigError) as clash:
        load_config(cfg, defs)
    assert "stream ids must be unique, duplicated: [1]" in str(clash.value)
    assert f"{cfg} + {defs / 'clash' / 'defs.yaml'}, {defs / 'orders' / 'defs.yaml'}" in str(clash.value)
    (defs / "clash" / "defs.yaml").write_text(yaml.safe_dump(
        {"type": "pgstream_dagster.StreamComponent", "attributes": {"id": 4, "batch": {"max_size": 0},
                                                                    "sink": {"type": "memory"}}}))
    with pytest.raises(ConfigError) as bad:
        load_config(cfg, defs)
    assert str(bad.value) == (f"{defs / 'clash' / 'defs.yaml'}: attributes.batch.max_size: Input should be greater "
                              "than or equal to 1")
    shutil.rmtree(defs / "clash")
    with pytest.raises(ConfigError, match="not a directory"):
        load_config(cfg, tmp_path / "nowhere")

    def cli(*argv: str) -> tuple[int, str, str]:
        code = cli_main(list(argv))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    # executor-requirements: the by_key component stream's sink client is added
    code, without, _ = cli("executor-requirements", "--config", str(cfg))
    assert code == 0 and not any(line.startswith("redis") for line in without.splitlines())
    code, text, _ = cli("executor-requirements", "--config", str(cfg), "--defs-folder", str(defs))
    assert code == 0 and any(line.startswith("redis") for line in text.splitlines())

    # dead-letters redeliver: stream 2 is unknown to pgstream.yaml alone
    args = ("dead-letters", "redeliver", "2", "--config", str(cfg), "--database-url", db_url, "--dry-run")
    assert cli(*args) == (1, "", "error: stream 2 is not configured\n")
    code, text, err = cli(*args, "--defs-folder", str(defs))
    assert (code, text, err) == (0, "stream 2: no open dead letters to redeliver\n", "")
    monkeypatch.setenv("PGSTREAM_DEFS_FOLDER", str(defs))
    assert cli(*args) == (code, text, err)
    assert SECRET not in text + err


def test_the_component_has_a_package_of_its_own() -> None:
    """``StreamComponent`` lives in ``pgstream_dagster.component``, above the definitions: the location
    finds the components by their base class and imports no module that imports it back (no cycle)."""
    import grimp

    from pgstream_dagster.defs.location import StreamDeclaringComponent

    assert StreamComponent is pgstream_dagster.StreamComponent
    assert issubclass(StreamComponent, StreamDeclaringComponent)
    graph = grimp.build_graph("pgstream_dagster")
    for module in ("pgstream_dagster.component", "pgstream_dagster.component.stream"):
        assert not graph.chain_exists(importer="pgstream_dagster.defs.location", imported=module)
    assert graph.chain_exists(importer="pgstream_dagster.component.stream", imported="pgstream_dagster.defs.location")



def test_an_alias_bomb_in_a_teams_defs_yaml_is_refused_at_once(tmp_path: Path, env: dict[str, str]) -> None:
    """Issue 43, finding 10: about 600 bytes of aliases nesting aliases (9 levels of 9) in a defs.yaml.
    The code location (this package's definitions, as installed) and the CLI's reading of the defs
    folder refuse it in one line naming the file, instead of expanding it for minutes."""
    from .test_config import alias_bomb

    text = ("type: pgstream_dagster.StreamComponent\nattributes:\n  id: 2\n  sink: {type: memory}\n  x:\n"
            + alias_bomb("    "))
    assert len(text) < 700
    site = tmp_path / "site"
    shutil.copytree(repo_root() / "pgstream_dagster", site / "pgstream_dagster",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo_root() / "sql", site / "pgstream_dagster" / "sql")
    defs_yaml = site / "pgstream_dagster" / "defs" / "team_orders" / "defs.yaml"
    defs_yaml.parent.mkdir()
    defs_yaml.write_text(text)
    (tmp_path / "pgstream.yaml").write_text(yaml.safe_dump({"database_url": URL, "streams": [STREAM_1]}))
    message = (f"{defs_yaml}: refused: its aliases expand to more than 1,000,000 values (an alias bomb?): write "
               "the values out or use fewer aliases")
    code = ("import time\nfrom pgstream_dagster.config import ConfigError\n"
            "from pgstream_dagster.definitions import defs\nstarted = time.monotonic()\n"
            "try:\n    defs()\nexcept ConfigError as exc:\n    print(f'{time.monotonic() - started:.3f}')\n"
            "    print(exc)\n")
    run_env = {**os.environ, "PYTHONPATH": str(site), "PGSTREAM_CONFIG": str(tmp_path / "pgstream.yaml")}
    run_env.pop("DAGSTER_HOME", None)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=run_env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    took, refused = result.stdout.strip().splitlines()[-2:]
    assert refused == message and float(took) < 5
    # what reads the defs folder without loading it (the CLI)
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "pgstream.yaml", defs_folder=site / "pgstream_dagster" / "defs")
    assert str(raised.value) == message
