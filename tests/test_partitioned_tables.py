"""Partitioned subscribed tables and TRUNCATE, each written as the table owner's (or an application
role's) own statements from a fresh connection: the events a subscriber gets, whatever partition a
write targets or a row moves to, and partition maintenance by hand (create, attach, detach, drop)."""

# ruff: noqa: S608 -- SQL built from the test's own role and schema names
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgstream_dagster.engine.subscriptions import trigger_state

from .test_security import connect, events, is_super, roles, run, subscribe

__all__ = ["roles"]  # the fixture, imported for this module's tests

MODES = ["row", "statement"]


def owned_partitioned_table(db_url: str, roles: Callable[..., str], mode: str) -> tuple[str, str]:
    """A schema and a table ``pt`` partitioned by range on ``k`` ([0, 10) in ``p1``, [10, 20) in ``p2``),
    both owned by a role of their own (returned with the schema), subscribed on INSERT, UPDATE and
    DELETE in ``mode`` by the pgstream owner."""
    owner = roles()
    schema = f"own_{owner}"
    run(db_url, f"create schema {schema} authorization {owner}")
    run(db_url, f"create table {schema}.pt (id int, k int, note text) partition by range (k)",
        f"create table {schema}.p1 partition of {schema}.pt for values from (0) to (10)",
        f"create table {schema}.p2 partition of {schema}.pt for values from (10) to (20)", role=owner)
    for op in ("INSERT", "UPDATE", "DELETE"):
        subscribe(db_url, f"pt-{op.lower()}", "pt", schema=schema, op=op, columns=["id", "k", "note"], mode=mode)
    return owner, schema


def ops(db_url: str) -> Counter[str]:
    return Counter(e["tg_op"] for e in events(db_url))


@pytest.mark.parametrize("mode", MODES)
def test_every_write_to_a_partitioned_table_is_its_event_whatever_partition_it_targets(
        db_url: str, roles: Callable[..., str], mode: str) -> None:
    """Writes through the table and straight to a partition; a row moved to another partition by an
    UPDATE is one UPDATE event (old and new), no DELETE or INSERT event."""
    owner, schema = owned_partitioned_table(db_url, roles, mode)
    with connect(db_url, owner) as c:
        c.execute(f"insert into {schema}.pt values (1, 1, 'through the table')")
        c.execute(f"insert into {schema}.p2 values (2, 12, 'straight to p2')")
        c.execute(f"update {schema}.p1 set note = 'in place' where id = 1")
        c.execute(f"update {schema}.pt set k = 15 where id = 1")  # moves from p1 to p2
        c.execute(f"update {schema}.pt set k = k - 10")  # both back to p1
        c.execute(f"delete from {schema}.p1 where id = 2")
    assert ops(db_url) == Counter({"INSERT": 2, "UPDATE": 4, "DELETE": 1})
    updates = [(e["old"], e["new"]) for e in events(db_url) if e["tg_op"] == "UPDATE"]
    assert updates[1] == ({"id": 1, "k": 1, "note": "in place"}, {"id": 1, "k": 15, "note": "in place"})
    assert sorted(updates[2:], key=lambda u: u[0]["id"]) == [
        ({"id": 1, "k": 15, "note": "in place"}, {"id": 1, "k": 5, "note": "in place"}),
        ({"id": 2, "k": 12, "note": "straight to p2"}, {"id": 2, "k": 2, "note": "straight to p2"})]
    assert {e["tg_table_name"] for e in events(db_url)} == {"pt"}


@pytest.mark.parametrize("mode", MODES)
def test_the_table_owner_maintains_partitions_by_hand(db_url: str, roles: Callable[..., str], mode: str) -> None:
    """Create, attach (pg_partman's way: a table like the parent, then ATTACH), alter, detach and drop
    partitions as the table's owner: every step passes, a new partition's writes are events, a
    detached table's are not, a partition's rows leave only with their events, and the generated
    triggers of a partition stay protected."""
    owner, schema = owned_partitioned_table(db_url, roles, mode)
    with connect(db_url, owner) as c:
        c.execute(f"create table {schema}.p3 partition of {schema}.pt for values from (20) to (30)")
        c.execute(f"create table {schema}.p4 (like {schema}.pt including all)")
        c.execute(f"alter table {schema}.pt attach partition {schema}.p4 for values from (30) to (40)")
        c.execute(f"alter table {schema}.p1 set (fillfactor = 90)")
        c.execute(f"create index on {schema}.p2 (note)")
        c.execute(f"insert into {schema}.p3 values (3, 23, 'new partition')")
        c.execute(f"insert into {schema}.p4 values (4, 34, 'attached partition')")
        c.execute(f"update {schema}.pt set k = 25 where id = 4")
        assert ops(db_url) == Counter({"INSERT": 2, "UPDATE": 1})
        c.execute(f"alter table {schema}.pt detach partition {schema}.p4")
        c.execute(f"insert into {schema}.p4 values (5, 35, 'detached')")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="take no TRUNCATE events"):
            c.execute(f"drop table {schema}.p3")  # its rows would go without an event to the DELETE subscription
        c.execute(f"delete from {schema}.p3")  # retention without emit_truncate: delete, detach, drop
        c.execute(f"alter table {schema}.pt detach partition {schema}.p3")
        c.execute(f"drop table {schema}.p3")
        c.execute(f"insert into {schema}.pt values (6, 6, 'after')")
        for attempt in (f"alter table {schema}.p1 disable trigger all",
                        f"drop trigger {'pgstream_insert' + ('_stmt' if mode == 'statement' else '')} on {schema}.p1"):
            with pytest.raises(psycopg.errors.DependentObjectsStillExist, match="pgstream: refusing"):
                c.execute(attempt)
    assert ops(db_url) == Counter({"INSERT": 3, "UPDATE": 1, "DELETE": 2})
    assert not is_super(db_url, owner)
    with connect(db_url) as c:
        detached = c.execute("select count(*) from pg_trigger where tgrelid = %s::regclass",
                             [f"{schema}.p4"]).fetchone()
    assert detached == (0,)


def test_statement_mode_update_subscription_on_a_partitioned_table(db_url: str, roles: Callable[..., str]) -> None:
    """UPDATE is statement mode's too on a partitioned table: a statement's rows are paired in order."""
    owner, schema = owned_partitioned_table(db_url, roles, "statement")
    with connect(db_url, owner) as c:
        c.execute(f"insert into {schema}.pt select g, g % 20, 'n' || g from generate_series(1, 40) g")
        c.execute(f"update {schema}.pt set k = (k + 7) % 20, note = note || '!'")
    updates: list[Any] = [e for e in events(db_url) if e["tg_op"] == "UPDATE"]
    assert len(updates) == 40
    for e in updates:
        assert e["new"] == {"id": e["old"]["id"], "k": (e["old"]["k"] + 7) % 20, "note": e["old"]["note"] + "!"}


# --------------------------------------------------------------------------------------------
# TRUNCATE


def truncating_role(db_url: str, roles: Callable[..., str], table: str) -> str:
    """An application role that may write and truncate ``table``, nothing more."""
    return roles(f"grant select, insert, delete, truncate on {table} to {{role}}")


@pytest.mark.parametrize("mode", MODES)
def test_truncate_of_a_table_with_a_delete_subscription_is_refused_without_the_opt_in(
        db_url: str, roles: Callable[..., str], mode: str) -> None:
    run(db_url, "create table public.t (id int primary key, note text)",
        "create table public.only_inserts (id int)")
    subscribe(db_url, "t-gone", "t", op="DELETE", columns=["id"], mode=mode)
    subscribe(db_url, "t-new", "t", columns=["id"])
    subscribe(db_url, "inserts", "only_inserts", columns=["id"])
    app = truncating_role(db_url, roles, "public.t")
    run(db_url, "grant truncate, insert on public.only_inserts to " + app)
    with connect(db_url, app) as c:
        c.execute("insert into public.t values (1, 'a'), (2, 'b')")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState,
                           match=r'refusing TRUNCATE of public\.t: DELETE subscriptions "t-gone" \(stream 1\) '
                                 r'of public\.t take no TRUNCATE events \(emit_truncate\)'):
            c.execute("truncate public.t")
        assert c.execute("select count(*) from public.t").fetchone() == (2,)
        c.execute("insert into public.only_inserts values (1)")
        c.execute("truncate public.only_inserts")  # no DELETE subscription: nothing to keep
    assert Counter(e["tg_name"] for e in events(db_url)) == Counter({"t-new": 2, "inserts": 1})


@pytest.mark.parametrize("mode", MODES)
def test_truncate_is_an_event_for_the_delete_subscriptions_that_opt_in(
        db_url: str, roles: Callable[..., str], mode: str) -> None:
    """One event per opted-in DELETE subscription: tg_op TRUNCATE, new and old null, the static metadata;
    there is no row, so the extensions (expressions over rows) are not evaluated."""
    run(db_url, "create table public.t (id int primary key, note text)")
    subscribe(db_url, "t-gone", "t", op="DELETE", columns=["id"], mode=mode, metadata={"team": "growth"},
              extensions=[{"json_path": "queue", "expression": "'deletes'"},
                          {"json_path": "group_id", "expression": "old.id::text"}])
    run(db_url, "insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names, "
                "emit_truncate) values ('mirror', 2, 'DELETE', 't', '{id, note}', true)",
        "update pgstream.subscriptions set emit_truncate = true where key = 't-gone'")
    app = truncating_role(db_url, roles, "public.t")
    with connect(db_url, app) as c:
        c.execute("insert into public.t values (1, 'a'), (2, 'b')")
        c.execute("delete from public.t where id = 1")
        c.execute("truncate public.t")
        assert c.execute("select count(*) from public.t").fetchone() == (0,)
    with connect(db_url) as c:
        rows = c.execute("select stream_id, payload, metadata from pgstream.events order by id").fetchall()
    deletes, truncates = rows[:2], rows[2:]
    assert [(s, p["tg_op"], p["old"]["id"]) for s, p, _ in deletes] == [(1, "DELETE", 1), (2, "DELETE", 1)]
    assert [s for s, _, _ in truncates] == [1, 2]
    for _, payload, _ in truncates:
        assert payload.pop("timestamp") > 0
    assert [(p, m) for _, p, m in truncates] == [
        ({"tg_name": "t-gone", "tg_op": "TRUNCATE", "tg_table_name": "t", "tg_table_schema": "public",
          "new": None, "old": None}, {"team": "growth"}),
        ({"tg_name": "mirror", "tg_op": "TRUNCATE", "tg_table_name": "t", "tg_table_schema": "public",
          "new": None, "old": None}, None)]
    # the option belongs to DELETE subscriptions; older clients that do not name it keep working
    with pytest.raises(psycopg.errors.InvalidParameterValue,
                       match=r'subscription "t-new" .*emit_truncate: only a DELETE subscription takes TRUNCATE events'):
        run(db_url, "insert into pgstream.subscriptions (key, stream_id, operation, table_name, emit_truncate) "
                    "values ('t-new', 1, 'INSERT', 't', true)")
    with connect(db_url) as c:
        c.execute("select pgstream.set_subscriptions(3, array[jsonb_populate_record(null::pgstream.subscriptions, "
                  "'{\"key\": \"old-client\", \"operation\": \"INSERT\", \"table_name\": \"t\"}')])")
        assert c.execute("select emit_truncate from pgstream.subscriptions where key = 'old-client'").fetchone() == (
            False,)


@pytest.mark.parametrize("mode", MODES)
def test_truncate_of_a_partitioned_table_or_of_a_partition(db_url: str, roles: Callable[..., str], mode: str) -> None:
    """Refused without the opt-in whichever table of the tree is truncated; with it, each table truncated
    (the partitioned table and each of its partitions, or the one partition) is an event naming it."""
    owner, schema = owned_partitioned_table(db_url, roles, mode)
    with connect(db_url, owner) as c:
        c.execute(f"insert into {schema}.pt values (1, 1, 'a'), (2, 12, 'b')")
        for table in ("p1", "pt"):
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match=r'"pt-delete" \(stream 1\)'):
                c.execute(f"truncate {schema}.{table}")
    run(db_url, "update pgstream.subscriptions set emit_truncate = true where operation = 'DELETE'")
    with connect(db_url, owner) as c:
        c.execute(f"truncate {schema}.p1")
        c.execute(f"create table {schema}.p3 partition of {schema}.pt for values from (20) to (30)")
        c.execute(f"truncate {schema}.pt")
    truncated = [e["tg_table_name"] for e in events(db_url) if e["tg_op"] == "TRUNCATE"]
    assert truncated[0] == "p1"
    assert sorted(truncated[1:]) == ["p1", "p2", "p3", "pt"]
    assert ops(db_url) == Counter({"INSERT": 2, "TRUNCATE": 5})


def test_a_column_cannot_break_the_pairing_of_a_partitioned_tables_updates(db_url: str,
                                                                         roles: Callable[..., str]) -> None:
    """The UPDATE trigger numbers rows in a column named pgstream_pos: the table's owner cannot add a column
    of that name while an UPDATE subscription exists (its UPDATEs would fail), nor subscribe a table with one."""
    owner, schema = owned_partitioned_table(db_url, roles, "row")
    with connect(db_url, owner) as c:
        with pytest.raises(psycopg.errors.DependentObjectsStillExist, match="pgstream_pos is reserved"):
            c.execute(f"alter table {schema}.pt add column pgstream_pos int")
        c.execute(f"insert into {schema}.pt values (1, 1, 'a')")
        c.execute(f"update {schema}.pt set k = 11")
    assert ops(db_url) == Counter({"INSERT": 1, "UPDATE": 1})
    run(db_url, f"create table {schema}.other (id int, pgstream_pos int, k int) partition by range (k)")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="pgstream_pos is reserved"):
        subscribe(db_url, "other", "other", schema=schema, op="UPDATE", columns=["id"])


def test_without_the_guard_regeneration_brings_the_partitions_in_step(db_url: str, roles: Callable[..., str]) -> None:
    """With the drift guard off (a non-superuser install has none), a partition created or detached by hand
    gets or loses its triggers' copies at the next regeneration of the table's triggers."""
    owner, schema = owned_partitioned_table(db_url, roles, "statement")
    run(db_url, "alter event trigger pgstream_drift_guard_alter disable")
    try:
        with connect(db_url, owner) as c:
            c.execute(f"create table {schema}.p3 partition of {schema}.pt for values from (20) to (30)")
            c.execute(f"alter table {schema}.pt detach partition {schema}.p2")
        with connect(db_url) as c:
            def copies(table: str) -> list[str]:
                return [r[0] for r in c.execute("select tgname from pg_trigger where tgrelid = %s::regclass order by 1",
                                                [f"{schema}.{table}"]).fetchall()]
            assert copies("p3") == [] and "pgstream_insert_stmt" in copies("p2")
            c.execute("select pgstream.regenerate_trigger(%s, 'pt', 'INSERT')", [schema])
            assert copies("p3") == ["pgstream_insert_stmt"] and "pgstream_insert_stmt" not in copies("p2")
    finally:
        run(db_url, "alter event trigger pgstream_drift_guard_alter enable")
    with connect(db_url, owner) as c:
        c.execute(f"insert into {schema}.p3 values (1, 21, 'a')")
        c.execute(f"insert into {schema}.p2 values (2, 12, 'detached')")
    assert [(e["tg_op"], e["new"]["id"]) for e in events(db_url)] == [("INSERT", 1)]


# --------------------------------------------------------------------------------------------
# Issue 43: the table owner's partitions as an attack on the generated triggers and their events

#: (mode, the no-op trigger the owner names like a generated one, the event it fires on)
FAKE_TRIGGERS = [("statement", "pgstream_insert_stmt", "insert"), ("row", "pgstream_insert", "insert"),
                 ("row", "pgstream_truncate", "truncate")]


def trigger_problems(db_url: str, schema: str, op: str, mode: str) -> list[str]:
    """What the ``trigger_matches`` asset check reports for the table's subscription (as the runtime would)."""
    with connect(db_url) as c:
        return trigger_state(c, schema, "pt", op, mode).problems()


def partition_with_its_own_trigger(schema: str, fake: str, fires_on: str) -> list[str]:
    """The owner's statements: a table p_us like pt, with a no-op statement trigger named ``fake``."""
    return [f"create table {schema}.p_us (like {schema}.pt including all)",
            f"create function {schema}.noop() returns trigger language plpgsql as $$ begin return null; end $$",
            f"create trigger {fake} after {fires_on} on {schema}.p_us for each statement "
            f"execute function {schema}.noop()"]


@pytest.mark.parametrize(("mode", "fake", "fires_on"), FAKE_TRIGGERS)
def test_a_partition_that_brings_a_trigger_named_like_a_generated_one_is_refused(
        db_url: str, roles: Callable[..., str], mode: str, fake: str, fires_on: str) -> None:
    """The owner attaches a partition carrying its own no-op trigger under a generated trigger's name:
    the ATTACH is refused, naming it (it would have kept pgstream's copy off the partition: rows written
    to it no event, its TRUNCATE neither refused nor told). Its own trigger is its own to drop, and the
    partition attached without it is a partition like the others."""
    owner, schema = owned_partitioned_table(db_url, roles, mode)
    attach = f"alter table {schema}.pt attach partition {schema}.p_us for values from (20) to (30)"
    with connect(db_url, owner) as c:
        for statement in partition_with_its_own_trigger(schema, fake, fires_on):
            c.execute(statement)
        with pytest.raises(psycopg.errors.DuplicateObject,
                           match=rf"refusing ALTER TABLE on {schema}\.pt: the trigger {fake} on {schema}\.p_us "
                                 rf"calls {schema}\.noop\(\), not pgstream's generated function"):
            c.execute(attach)
        assert c.execute("select count(*) from pg_inherits where inhrelid = %s::regclass",
                         [f"{schema}.p_us"]).fetchone() == (0,)
        c.execute(f"drop trigger {fake} on {schema}.p_us")
        c.execute(attach)
        c.execute(f"insert into {schema}.p_us values (1, 21, 'straight to the partition')")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match=rf"refusing TRUNCATE of {schema}\.p_us"):
            c.execute(f"truncate {schema}.p_us")
    assert ops(db_url) == Counter({"INSERT": 1})
    assert trigger_problems(db_url, schema, "INSERT", mode) == []
    assert trigger_problems(db_url, schema, "DELETE", mode) == []
    assert not is_super(db_url, owner)


@pytest.mark.parametrize(("mode", "fake", "fires_on"), FAKE_TRIGGERS)
def test_the_asset_check_sees_a_partitions_own_trigger_under_a_generated_name_and_repair_replaces_it(
        db_url: str, roles: Callable[..., str], mode: str, fake: str, fires_on: str) -> None:
    """Attached while the drift guard was off (an install without superuser has none): trigger_matches
    reports the partition, and regenerating the table's triggers replaces the owner's trigger."""
    owner, schema = owned_partitioned_table(db_url, roles, mode)
    run(db_url, "alter event trigger pgstream_drift_guard_alter disable")
    try:
        run(db_url, *partition_with_its_own_trigger(schema, fake, fires_on),
            f"alter table {schema}.pt attach partition {schema}.p_us for values from (20) to (30)", role=owner)
    finally:
        run(db_url, "alter event trigger pgstream_drift_guard_alter enable")
    op = "DELETE" if fires_on == "truncate" else "INSERT"
    assert (f"partition {schema}.p_us has a trigger {fake} of its own, calling {schema}.noop(), "
            f"instead of the copy of the table's") in trigger_problems(db_url, schema, op, mode)
    with connect(db_url) as c:
        for each in ("INSERT", "UPDATE", "DELETE"):
            c.execute("select pgstream.repair_trigger(%s, 'pt', %s)", [schema, each])
    assert trigger_problems(db_url, schema, op, mode) == []
    with connect(db_url, owner) as c:
        c.execute(f"insert into {schema}.p_us values (1, 21, 'straight to the partition')")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match=rf"refusing TRUNCATE of {schema}\.p_us"):
            c.execute(f"truncate {schema}.p_us")
    assert ops(db_url) == Counter({"INSERT": 1})


@pytest.mark.parametrize("mode", MODES)
def test_a_partition_with_rows_leaves_its_table_only_as_its_truncate(
        db_url: str, roles: Callable[..., str], mode: str) -> None:
    """DETACH PARTITION of a partition holding rows and DROP TABLE of a partition are, for the DELETE
    subscribers, its TRUNCATE: refused without their opt-in (emit_truncate), like the TRUNCATE, with the
    way out named; with it, one TRUNCATE event naming the partition. An empty partition detaches
    freely, and a detached table drops freely: retention by delete, detach and drop stays possible."""
    owner, schema = owned_partitioned_table(db_url, roles, mode)
    with connect(db_url, owner) as c:
        c.execute(f"create table {schema}.p3 partition of {schema}.pt for values from (20) to (30)")
        # a partition whose own partition key calls the owner's function: DROP FUNCTION ... CASCADE drops it
        c.execute(f"create function {schema}.kf(int) returns int language sql immutable as $$ select $1 $$")
        c.execute(f"create table {schema}.p4 partition of {schema}.pt for values from (30) to (40) "
                  f"partition by range ({schema}.kf(k))")
        c.execute(f"create table {schema}.p4a partition of {schema}.p4 for values from (30) to (40)")
        c.execute(f"insert into {schema}.pt values (1, 1, 'a'), (2, 12, 'b'), (3, 23, 'c')")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState,
                           match=rf"refusing DROP FUNCTION of {schema}\.p4: {schema}\.p4 is a partition"):
            c.execute(f"drop function {schema}.kf(int) cascade")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState,
                           match=rf"refusing ALTER TABLE on {schema}\.pt: {schema}\.p1 is a partition of {schema}\.pt "
                                 r'that holds rows, and DELETE subscriptions "pt-delete" \(stream 1\)'):
            c.execute(f"alter table {schema}.pt detach partition {schema}.p1")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState,
                           match=rf"refusing DROP TABLE of {schema}\.p2: {schema}\.p2 is a partition of {schema}\.pt "
                                 r"\(its rows go with it\)") as refused:
            c.execute(f"drop table {schema}.p2")
        assert refused.value.diag.message_hint is not None
        assert f"DETACH PARTITION {schema}.p2" in refused.value.diag.message_hint
        assert c.execute(f"select count(*) from {schema}.pt").fetchone() == (3,)
        c.execute(f"delete from {schema}.p3")  # retention without the opt-in: delete, detach, drop
        c.execute(f"alter table {schema}.pt detach partition {schema}.p3")
        c.execute(f"drop table {schema}.p3")
    assert ops(db_url) == Counter({"INSERT": 3, "DELETE": 1})
    run(db_url, "update pgstream.subscriptions set emit_truncate = true where operation = 'DELETE'")
    with connect(db_url, owner) as c:
        c.execute(f"alter table {schema}.pt detach partition {schema}.p1")
        c.execute(f"drop table {schema}.p2")
        c.execute(f"insert into {schema}.p1 values (4, 4, 'detached')")
    truncated = [(e["tg_name"], e["tg_table_schema"], e["tg_table_name"]) for e in events(db_url)
                 if e["tg_op"] == "TRUNCATE"]
    assert truncated == [("pt-delete", schema, "p1"), ("pt-delete", schema, "p2")]
    assert ops(db_url) == Counter({"INSERT": 3, "DELETE": 1, "TRUNCATE": 2})
    assert not is_super(db_url, owner)


def test_a_renamed_partition_trigger_never_blocks_subscription_changes(db_url: str, roles: Callable[..., str]) -> None:
    """Renaming pgstream's copy of a trigger on a partition is refused like renaming the table's own; one
    renamed while the drift guard was off neither blocks deleting or changing the table's subscriptions
    (also in a set_subscriptions of other tables) nor, once they are gone, dropping the schema."""
    owner, schema = owned_partitioned_table(db_url, roles, "statement")
    rename = f"alter trigger pgstream_insert_stmt on {schema}.p1 rename to mine"
    with connect(db_url, owner) as c:
        with pytest.raises(psycopg.errors.DependentObjectsStillExist,
                           match=rf"refusing ALTER TRIGGER on mine on {schema}\.p1: the generated trigger "
                                 rf"pgstream_insert_stmt of INSERT on {schema}\.p1 would be missing"):
            c.execute(rename)
    run(db_url, "alter event trigger pgstream_drift_guard_alter disable")
    try:
        run(db_url, rename, role=owner)
    finally:
        run(db_url, "alter event trigger pgstream_drift_guard_alter enable")
    run(db_url, "create table public.other (id int)")
    with connect(db_url) as c:
        c.execute("update pgstream.subscriptions set column_names = '{id}' where key = 'pt-insert'")
        changes = c.execute(
            "select action from pgstream.set_subscriptions(1, array[jsonb_populate_record("
            "null::pgstream.subscriptions, '{\"key\": \"other\", \"operation\": \"INSERT\", "
            "\"table_name\": \"other\"}')])").fetchall()
        assert sorted(a for (a,) in changes) == ["deleted", "deleted", "deleted", "inserted"]
        assert c.execute("select count(*) from pg_trigger where tgname = 'mine'").fetchone() == (0,)
    run(db_url, f"drop schema {schema} cascade", role=owner)
    run(db_url, "insert into public.other values (1)")
    assert ops(db_url) == Counter({"INSERT": 1})
