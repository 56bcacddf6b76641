"""Subscriptions of pgstream.yaml as Dagster assets: materializing applies them through
set_subscriptions, the pgstream_subscriptions sensor requests exactly the new/edited ones (a run of the
pgstream_subscriptions job), removal and
hand-made subscriptions behave, a bad YAML changes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.config import ConfigError
from pgstream_dagster.defs.assets import subscription_keys, subscription_set_key
from pgstream_dagster.defs.location import build_definitions
from pgstream_dagster.defs.names import SUBSCRIPTIONS_JOB, SUBSCRIPTIONS_SENSOR, deliveries_asset_key
from pgstream_dagster.defs.schedules import RETRY_SECS
from pgstream_dagster.devdb import LocalPostgres

from .support.dagster_instance import materializations, postgres_instance, step_failure
from .support.harness import write_config

STREAMS = [{"id": 1, "sink": {"type": "memory"}}, {"id": 2, "sink": {"type": "memory"}}]
SIGNUP = {"key": "user-signup", "stream_id": 1, "operation": "INSERT", "schema_name": "public",
          "table_name": "users", "when_clause": "new.verified", "column_names": ["id", "email"],
          "payload_extensions": [{"json_path": "group_id", "expression": "new.id::text"}]}
EMAIL = {"key": "email-changed", "stream_id": 1, "operation": "UPDATE", "schema_name": "public",
         "table_name": "users", "when_clause": "new.email is distinct from old.email", "column_names": ["id", "email"]}
ORDER = {"key": "order-placed", "stream_id": 1, "operation": "INSERT", "schema_name": "shop",
         "table_name": "orders", "column_names": ["id", "total"], "metadata": {"team": "billing"}}
AUDIT = {"key": "audit", "stream_id": 2, "operation": "DELETE", "schema_name": "public", "table_name": "users",
         "column_names": ["id"]}


@pytest.fixture
def instance(pg: LocalPostgres, tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with postgres_instance(pg, tmp_path) as inst:
        yield inst


@pytest.fixture
def app(db_url: str) -> str:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table public.users (id serial primary key, email text, verified bool default false)")
        c.execute("create schema shop")
        c.execute("create table shop.orders (id serial primary key, total numeric)")
        # created by hand in SQL: the YAML must leave it alone
        c.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                  "values ('by-hand', 1, 'DELETE', 'users', '{id}')")
    return db_url


def triggers(url: str) -> dict[str, int]:
    """Generated triggers: "schema.table pgstream_op" -> trigger oid."""
    with psycopg.connect(url) as c:
        rows = c.execute("select n.nspname || '.' || c.relname || ' ' || t.tgname, t.oid::bigint from pg_trigger t "
                         "join pg_class c on c.oid = t.tgrelid join pg_namespace n on n.oid = c.relnamespace "
                         "where t.tgname like 'pgstream\\_%' and not t.tgisinternal").fetchall()
    return dict(rows)


def subscriptions(url: str) -> dict[tuple[int, str, str], tuple[Any, ...]]:
    with psycopg.connect(url) as c:
        rows = c.execute("select stream_id, key, operation::text, when_clause, column_names, managed_by "
                         "from pgstream.subscriptions").fetchall()
    return {(r[0], r[1], r[2]): r[3:] for r in rows}


def requested(defs: dg.Definitions, instance: dg.DagsterInstance, cursor: str | None = None, *,
              aged_secs: float = 0.0) -> tuple[set[dg.AssetKey], str | None]:
    """What the ``pgstream_subscriptions`` sensor requests now (``aged_secs``: with its cursor's requests that much
    older), and its cursor after the tick."""
    if cursor and aged_secs:
        cursor = json.dumps({k: [version, at - aged_secs] for k, (version, at) in json.loads(cursor).items()})
    repo = defs.get_repository_def()
    sensor = repo.get_sensor_def(SUBSCRIPTIONS_SENSOR)
    assert sensor.job_name == SUBSCRIPTIONS_JOB  # its runs are of the named job, not Dagster's __ASSET_JOB
    with dg.build_sensor_context(instance=instance, cursor=cursor, repository_def=repo) as context:
        tick = sensor.evaluate_tick(context)
    return {k for r in tick.run_requests or [] for k in r.asset_selection or []}, tick.cursor or cursor


def apply(defs: dg.Definitions, instance: dg.DagsterInstance, keys: list[dg.AssetKey]) -> dg.ExecuteInProcessResult:
    """A run of the ``pgstream_subscriptions`` job for ``keys``, as the sensor requests it (with their checks)."""
    return defs.resolve_job_def(SUBSCRIPTIONS_JOB).execute_in_process(instance=instance, asset_selection=keys,
                                                                       raise_on_error=False)


def keys(cfg: Path) -> dict[str, dg.AssetKey]:
    from pgstream_dagster.config import load_config

    config = load_config(cfg)
    out = {ident[0]: key for s in config.streams for ident, key in subscription_keys(config, s.id).items()}
    return out | {f"set{s.id}": subscription_set_key(s.id) for s in config.streams}


def test_subscription_assets_apply_edit_and_remove(app: str, tmp_path: Path, instance: dg.DagsterInstance) -> None:
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS, [SIGNUP, EMAIL, ORDER, AUDIT])
    defs = build_definitions(cfg)
    k = keys(cfg)
    assert k["user-signup"] == dg.AssetKey(["pgstream", "stream_1", "subscriptions", "user_signup_insert_public_users"])
    graph = defs.get_repository_def().asset_graph
    # lineage: source table -> subscription -> the stream's deliveries
    assert graph.get(k["order-placed"]).parent_keys == {dg.AssetKey(["postgres", "shop", "orders"])}
    assert graph.get(deliveries_asset_key(1)).parent_keys == {k["user-signup"], k["email-changed"], k["order-placed"]}
    assert graph.get(deliveries_asset_key(2)).parent_keys == {k["audit"]}

    # 1. a fresh location: the sensor asks for every subscription (missing)
    wanted, cursor = requested(defs, instance)
    assert wanted == set(k.values())
    result = apply(defs, instance, sorted(wanted, key=str))
    assert result.success, step_failure(result)
    installed = triggers(app)
    assert set(installed) == {"public.users pgstream_insert", "public.users pgstream_update",
                              "public.users pgstream_delete", "public.users pgstream_truncate",
                              "shop.orders pgstream_insert"}
    mats = materializations(result)
    assert mats[k["user-signup"]]["action"] == "inserted"
    assert mats[k["user-signup"]]["trigger_oid"] == installed["public.users pgstream_insert"]
    assert "pgstream.events" in mats[k["user-signup"]]["trigger_definition"]
    assert mats[k["set1"]]["created_in_sql"] == 1
    assert subscriptions(app)[(1, "by-hand", "DELETE")][-1] is None
    assert subscriptions(app)[(1, "user-signup", "INSERT")][-1] == "yaml"
    # blocking trigger checks ran with the materialization and passed
    checks = {(c.asset_key, c.check_name): c.passed for c in result.get_asset_check_evaluations()}
    assert checks[(k["order-placed"], "trigger_matches")] is True

    # 2. nothing changed: nothing requested; materializing anyway recreates no trigger
    wanted, cursor = requested(defs, instance, cursor)
    assert wanted == set()
    again = apply(defs, instance, sorted(k.values(), key=str))
    assert again.success, step_failure(again)
    assert triggers(app) == installed
    assert {m["action"] for key, m in materializations(again).items() if key not in (k["set1"], k["set2"])} \
        == {"unchanged"}

    # 3. edit one subscription: exactly it is requested, exactly one trigger is recreated
    edited = {**EMAIL, "when_clause": "new.email is distinct from old.email and new.verified"}
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS, [SIGNUP, edited, ORDER, AUDIT])
    defs = build_definitions(cfg)
    wanted, cursor = requested(defs, instance, cursor)
    assert wanted == {k["email-changed"]}
    result = apply(defs, instance, [k["email-changed"]])
    assert result.success, step_failure(result)
    assert materializations(result)[k["email-changed"]]["action"] == "updated"
    after = triggers(app)
    changed = {name for name in installed if after.get(name) != installed[name]}
    assert changed == {"public.users pgstream_update"}
    assert subscriptions(app)[(1, "email-changed", "UPDATE")][0] == edited["when_clause"]

    # 4. a subset materialization never drops the unselected subscriptions, even ones the YAML changed
    renamed_cols = {**SIGNUP, "column_names": ["id"]}
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS, [renamed_cols, edited, ORDER, AUDIT])
    defs = build_definitions(cfg)
    result = apply(defs, instance, [k["order-placed"]])
    assert result.success, step_failure(result)
    assert triggers(app) == after
    assert subscriptions(app)[(1, "user-signup", "INSERT")][1] == ["id", "email"]  # not applied: not selected
    wanted, cursor = requested(defs, instance, cursor)
    assert wanted == {k["user-signup"]}
    assert apply(defs, instance, [k["user-signup"]]).success
    assert subscriptions(app)[(1, "user-signup", "INSERT")][1] == ["id"]
    after = triggers(app)

    # 5. remove one from the YAML: the stream's subscription set is requested and drops it (and
    #    its trigger); the other stream and the hand-made subscription are untouched
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS, [renamed_cols, edited, AUDIT])
    defs = build_definitions(cfg)
    wanted, cursor = requested(defs, instance, cursor)
    assert wanted == {k["set1"]}
    result = apply(defs, instance, [k["set1"]])
    assert result.success, step_failure(result)
    assert materializations(result)[k["set1"]]["deleted"] == ["order-placed (INSERT on shop.orders)"]
    assert set(subscriptions(app)) == {(1, "user-signup", "INSERT"), (1, "email-changed", "UPDATE"),
                                       (2, "audit", "DELETE"), (1, "by-hand", "DELETE")}
    assert triggers(app) == {name: oid for name, oid in after.items() if name != "shop.orders pgstream_insert"}
    wanted, cursor = requested(defs, instance, cursor)
    assert wanted == set()

    # 6. switch one subscription to statement mode: exactly it is requested; it moves to a statement
    #    trigger, the row trigger is regenerated for the hand-made DELETE subscription, nothing else changes
    before = triggers(app)
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS,
                       [renamed_cols, edited, {**AUDIT, "trigger_mode": "statement"}])
    defs = build_definitions(cfg)
    wanted, cursor = requested(defs, instance, cursor)
    assert wanted == {k["audit"]}
    result = apply(defs, instance, [k["audit"]])
    assert result.success, step_failure(result)
    mats = materializations(result)
    assert (mats[k["audit"]]["action"], mats[k["audit"]]["trigger"], mats[k["audit"]]["trigger_mode"]) == (
        "updated", "pgstream_delete_stmt", "statement")
    now = triggers(app)
    assert set(now) == set(before) | {"public.users pgstream_delete_stmt"}
    assert now["public.users pgstream_delete_stmt"] == mats[k["audit"]]["trigger_oid"]
    assert {name for name in before if now[name] != before[name]} == {"public.users pgstream_delete"}
    checks = {(c.asset_key, c.check_name): c.passed for c in result.get_asset_check_evaluations()}
    assert checks[(k["audit"], "trigger_matches")] is True


@pytest.mark.parametrize(("bad", "reason"), [
    ({**ORDER, "colour": "blue"}, "colour: unknown key (allowed: key, stream_id, operation, "),
    ({**ORDER, "column_names": "id"}, "Input should be a valid list"),
])
def test_bad_yaml_fails_to_load_naming_file_key_and_reason(app: str, tmp_path: Path, bad: dict[str, Any],
                                                           reason: str) -> None:
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS, [SIGNUP, bad])
    with pytest.raises(ConfigError) as err:
        build_definitions(cfg)
    message = str(err.value)
    assert str(cfg) in message and "subscriptions[1]" in message and "'order-placed'" in message
    assert reason in message


@pytest.mark.parametrize(("bad", "reason"), [
    ({**ORDER, "column_names": ["id", "nope"]}, "column_names: column nope does not exist on shop.orders"),
    ({**ORDER, "when_clause": "new.total > 'x"}, "when_clause: unterminated quoted string"),
    ({**ORDER, "when_clause": "new.total + 1"}, "when_clause: must be a boolean expression, got type numeric"),
    ({**ORDER, "payload_extensions": [{"json_path": "a", "expression": "new.missing"}]},
     "payload_extensions"),
    ({**ORDER, "operation": "UPDATE", "trigger_mode": "statement"},
     "trigger_mode: statement mode supports INSERT and DELETE only"),
])
def test_bad_subscription_changes_nothing(app: str, tmp_path: Path, instance: dg.DagsterInstance,
                                          bad: dict[str, Any], reason: str) -> None:
    good = write_config(tmp_path / "good.yaml", app, STREAMS, [SIGNUP, AUDIT])
    assert apply(build_definitions(good), instance, sorted(keys(good).values(), key=str)).success
    before_triggers, before_subs = triggers(app), subscriptions(app)

    # an edit of a good one plus a broken new one in the same file: neither is applied, not even
    # the good stream-2 change in another run
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS,
                       [{**SIGNUP, "when_clause": "not new.verified"}, {**AUDIT, "column_names": ["id", "email"]}, bad])
    defs = build_definitions(cfg)
    k = keys(cfg)
    wanted, cursor = requested(defs, instance)
    assert wanted == {k["user-signup"], k["order-placed"], k["set1"], k["audit"]}
    for selection in ([k["user-signup"], k["order-placed"], k["set1"]], [k["audit"]]):
        result = apply(defs, instance, selection)
        assert not result.success
        message = step_failure(result)
        assert str(cfg) in message and "subscriptions[2]" in message and "'order-placed'" in message, message
        assert reason in message, message
    assert triggers(app) == before_triggers
    assert subscriptions(app) == before_subs
    # the failed applies are not retried in a loop...
    wanted, cursor = requested(defs, instance, cursor)
    assert wanted == set()
    # ...but an edit is requested at once
    signup = {**SIGNUP, "when_clause": "new.verified is not true"}
    audit = {**AUDIT, "column_names": ["id", "email"]}
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS, [signup, audit, bad])
    wanted, cursor = requested(build_definitions(cfg), instance, cursor)
    assert wanted == {k["user-signup"]}

    # once the file is fixed, the next retry applies what failed because of it
    fixed = write_config(tmp_path / "pgstream.yaml", app, STREAMS, [signup, audit])
    defs = build_definitions(fixed)
    wanted, cursor = requested(defs, instance, cursor)
    assert wanted == set()  # the failed edits wait for the retry; set1 is back to its applied membership
    wanted, cursor = requested(defs, instance, cursor, aged_secs=RETRY_SECS)
    assert wanted == {k["user-signup"], k["audit"]}
    assert apply(defs, instance, sorted(wanted, key=str)).success
    assert subscriptions(app)[(1, "user-signup", "INSERT")][0] == "new.verified is not true"
    assert requested(defs, instance, cursor, aged_secs=RETRY_SECS)[0] == set()


def test_the_subscriptions_sensor_waits_for_a_run_in_progress(app: str, tmp_path: Path,
                                                              instance: dg.DagsterInstance) -> None:
    """A run of the job not finished yet (applying, or queued behind others): the sensor requests nothing more."""
    cfg = write_config(tmp_path / "pgstream.yaml", app, STREAMS, [SIGNUP, AUDIT])
    defs = build_definitions(cfg)
    job = defs.resolve_job_def(SUBSCRIPTIONS_JOB)
    run = instance.create_run_for_job(job, status=dg.DagsterRunStatus.STARTED)
    assert requested(defs, instance) == (set(), None)
    instance.report_run_failed(run)
    assert requested(defs, instance)[0] == set(keys(cfg).values())


def test_demo_location_loads_with_assets_checks_and_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    from .support.dagster_dev import repo_root

    monkeypatch.setenv("PGSTREAM_DATABASE_URL", "postgresql://demo:s3cr3t@127.0.0.1:1/demo")
    defs = build_definitions(repo_root() / "pgstream.yaml")
    dg.Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    signup = dg.AssetKey(["pgstream", "stream_1", "subscriptions", "user_signup_insert_demo_users"])
    changed = dg.AssetKey(["pgstream", "stream_1", "subscriptions", "user_email_changed_update_demo_users"])
    assert {signup, changed, subscription_set_key(1), deliveries_asset_key(1),
            dg.AssetKey(["postgres", "demo", "users"]),
            dg.AssetKey(["pgstream", "events_partitions"])} <= set(graph.get_all_asset_keys())
    assert graph.get(deliveries_asset_key(1)).parent_keys == {signup, changed}
    node = graph.get(signup)
    assert node.code_version
    assert set(defs.resolve_job_def(SUBSCRIPTIONS_JOB).asset_layer.selected_asset_keys) == {
        signup, changed, subscription_set_key(1)}
    assert node.group_name == "stream_1_subscriptions"
    assert node.metadata["table"] == "demo.users" and node.metadata["filter"] == "new.email_verified = true"
    assert {(c.asset_key, c.name) for c in graph.asset_check_keys} == {
        (signup, "trigger_matches"), (changed, "trigger_matches"), (deliveries_asset_key(1), "undelivered_age"),
        (deliveries_asset_key(1), "not_in_failover"), (deliveries_asset_key(1), "no_dead_letters"),
        # stream 1 reads with its reader group (default): the group's slot has the slot check, once for the group
        (dg.AssetKey(["pgstream", "events_partitions"]), "group_default_slot_retained_wal"),
        (dg.AssetKey(["pgstream", "events_partitions"]), "no_orphaned_slots"),
        (dg.AssetKey(["pgstream", "events_partitions"]), "consumers_within_retention")}
    assert {s.name for s in repo.schedule_defs} == {"pgstream_housekeeping", "pgstream_checks"}
    assert {s.name for s in repo.sensor_defs} == {"pgstream_group_default", "pgstream_subscriptions"}
    assert "s3cr3t" not in str([graph.get(k).metadata for k in graph.get_all_asset_keys()])


def test_the_subscriptions_sensor_evaluates_less_often_as_subscription_assets_grow(tmp_path: Path) -> None:
    """One evaluation reads Dagster's storage about a dozen times per asset: every 15 s for a few
    streams, every 0.3 s per subscription asset beyond that (100 streams, 200 assets: every 60 s)."""
    from pgstream_dagster.defs.names import SUBSCRIPTIONS_SENSOR

    def interval(count: int) -> int | None:
        cfg = write_config(tmp_path / f"s{count}.yaml", "postgresql://nobody@127.0.0.1:1/none",
                           [{"id": i, "sink": {"type": "memory"}} for i in range(1, count + 1)],
                           [{"key": f"k{i}", "stream_id": i, "operation": "INSERT", "table_name": f"t{i}",
                             "column_names": ["id"]} for i in range(1, count + 1)])
        return build_definitions(cfg).resolve_sensor_def(SUBSCRIPTIONS_SENSOR).minimum_interval_seconds

    assert (interval(1), interval(25), interval(100)) == (15, 15, 60)
