"""The lake sinks (delta, iceberg, parquet) on their own: real tables on disk (Iceberg's SQL catalog in
the tests' Postgres), fed by the publisher as a delivery run feeds them, read back with each format's
own reader (and duckdb for Parquet). Exactly once across retries with other chunk boundaries,
replays by id and an attempt that died between its files and its commit marker; bad config."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pgstream_dagster.config import ConfigError, parse_stream
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine.publish import Positioned, publish
from pgstream_dagster.sinks import Event, SinkError, build_sink
from pgstream_dagster.sinks import parquet as parquet_module
from pgstream_dagster.sinks.lake import LakeSink, position_of, token

from .support.lake import LAKE_FORMATS, lake_config, lake_ids
from .support.sinks import drain

STREAM = 3
START = dt.datetime(2026, 11, 26, 22, 0, tzinfo=dt.UTC)


def events(n: int, first_id: int = 1000) -> list[Event]:
    """``n`` events of stream 3 over three UTC days (a chunk spans days), ids not in delivery order."""
    return [Event(first_id + (i * 7919) % n, STREAM,
                  {"tg_op": "INSERT", "tg_name": "orders", "tg_table_schema": "public", "tg_table_name": "orders",
                   "new": {"id": i, "note": "ünïcode ✓"}}, {"txid": i} if i % 3 == 0 else None,
                  START + dt.timedelta(minutes=90 * i // n * 20))
            for i in range(n)]


def positioned(evs: Sequence[Event], batch_size: int) -> Iterator[Positioned]:
    """``evs`` in ledger batches of ``batch_size`` (batch ids from 5), as the delivery reads them."""
    for i, event in enumerate(evs):
        yield 5 + i // batch_size, i % batch_size + 1, event


def sink_of(config: dict[str, Any]) -> LakeSink:
    sink = build_sink(config)
    assert isinstance(sink, LakeSink)
    return sink


@pytest.mark.parametrize("kind", LAKE_FORMATS)
def test_each_event_once_across_retries_other_chunks_and_replays(kind: str, tmp_path: Path,
                                                                  pg: LocalPostgres) -> None:
    config = lake_config(kind, tmp_path, pg)
    evs = events(60)
    first = [(b, o, e) for b, o, e in positioned(evs, 25)][:37]
    with sink_of(config) as sink:
        assert drain(publish(sink, iter(first), 8)) == 37
    # the run died before recording its last confirmations: the next one resumes from an earlier
    # position (batch 6 #1), with other chunk boundaries, and goes on to the end
    resumed = [(b, o, e) for b, o, e in positioned(evs, 25) if (b, o) >= (6, 1)]
    with sink_of(config) as sink:
        assert drain(publish(sink, iter(resumed), 11)) == len(resumed)
        assert position_of(sink.read_token(STREAM) or 0) == (7, 10)
    assert lake_ids(config, STREAM) == Counter({e.id: 1 for e in evs})
    # the same positions again (a delivery of batches already delivered): nothing written
    with sink_of(config) as sink:
        drain(publish(sink, positioned(evs, 25), 13))
    # a replay of every event (batch 0, positions are ids), in two overlapping pieces
    by_id = sorted(evs, key=lambda e: e.id)
    with sink_of(config) as sink:
        drain(publish(sink, ((0, e.id, e) for e in by_id[:40]), 9))
        drain(publish(sink, ((0, e.id, e) for e in by_id[20:]), 9))
        read = sink.read(STREAM, ["id", "stream_id", "created_at", "operation", "schema_name", "table_name",
                                  "subscription", "payload", "metadata"])
        per_day = sink.day_counts(STREAM)
    assert lake_ids(config, STREAM) == Counter({e.id: 1 for e in evs})
    rows = {r["id"]: r for r in read.to_pylist()}
    for event in evs:
        row = rows[event.id]
        assert (row["stream_id"], row["created_at"], row["operation"], row["schema_name"], row["table_name"],
                row["subscription"], row["payload"], row["metadata"]) == (
            STREAM, event.created_at, "INSERT", "public", "orders", "orders", event.payload_json,
            event.metadata_json)
    assert per_day == dict(Counter(e.created_at.date() for e in evs))
    assert len(per_day) == 3
    if kind == "iceberg":  # the position is also a table property (snapshot expiry cannot remove it)
        from pgstream_dagster.sinks.iceberg import IcebergSink, snapshot_property

        with sink_of(config) as sink:
            assert isinstance(sink, IcebergSink)
            table = sink.catalog().load_table(config["table"])
            assert position_of(int(table.properties[snapshot_property(STREAM)])) == (7, 10)


@pytest.mark.parametrize("kind", LAKE_FORMATS)
def test_after_a_failover_positions_handed_out_again_and_a_former_primarys_events_are_written_once(
        kind: str, tmp_path: Path, pg: LocalPostgres) -> None:
    """What a new primary's ledger gives a lake sink after a promotion with the standby behind: positions at or
    before the table's token for events the table lacks (batch ids resume from what the standby replayed), and a
    former primary's events (ids below ``ended_below``) that the table may hold already, at positions above the
    token. Each event is in the table once. Through a real promotion: tests/test_standby_failover.py."""
    config = lake_config(kind, tmp_path, pg)
    old = events(30)  # the former primary's timeline (ids 1000..1029): all delivered, token (6, 5)
    with sink_of(config) as sink:
        assert drain(publish(sink, positioned(old, 25), 10)) == 30
        assert position_of(sink.read_token(STREAM) or 0) == (6, 5)
    floor = 1 << 48  # the new primary's timeline (2)
    new = events(20, first_id=floor + 1)
    # the new ledger: batch 6 again (other events: the new primary's), then batch 7: three events of the former
    # primary (the standby had their rows, not their batch) and new ones
    again = [(6, i + 1, e) for i, e in enumerate(new[:10])]
    later = [(7, 1, old[27]), (7, 2, new[10]), (7, 3, old[28]), (7, 4, old[29])] + [
        (7, 5 + i, e) for i, e in enumerate(new[11:])]
    with sink_of(config) as sink:
        assert drain(publish(sink, iter(again + later), 7, ended_below=floor)) == len(again) + len(later)
        assert position_of(sink.read_token(STREAM) or 0) == (7, 4 + len(new[11:]))
    assert lake_ids(config, STREAM) == Counter({e.id: 1 for e in old + new})


def test_a_replay_into_an_emptied_table_fills_it(tmp_path: Path, pg: LocalPostgres) -> None:
    config = lake_config("delta", tmp_path, pg)
    evs = events(30)
    with sink_of(config) as sink:
        drain(publish(sink, ((0, e.id, e) for e in sorted(evs, key=lambda e: e.id)), 7))
        assert sink.read_token(STREAM) is None  # a replay records no ledger position
    assert lake_ids(config, STREAM) == Counter({e.id: 1 for e in evs})


def test_parquet_files_of_an_attempt_killed_before_its_marker_are_replaced(
        tmp_path: Path, pg: LocalPostgres, monkeypatch: pytest.MonkeyPatch) -> None:
    import duckdb

    config = lake_config("parquet", tmp_path, pg)
    evs = events(60)
    with sink_of(config) as sink:
        drain(publish(sink, positioned(evs[:20], 25), 20))
    # the next call spans three days: it dies after renaming its first file, before the others and the marker
    real_replace = parquet_module._replace
    renamed: list[Path] = []

    def dies_after_one(tmp: Path, final: Path) -> None:
        if renamed:
            raise OSError("killed")
        real_replace(tmp, final)
        renamed.append(final)
    monkeypatch.setattr(parquet_module, "_replace", dies_after_one)
    with sink_of(config) as sink, pytest.raises(SinkError, match="killed"):
        drain(publish(sink, ((b, o, e) for b, o, e in positioned(evs, 25) if b > 5 or o > 20), 40))
    assert renamed and renamed[0].exists()  # an uncommitted file a reader could see
    monkeypatch.setattr(parquet_module, "_replace", real_replace)
    with sink_of(config) as sink:  # the next run: from the marker on, chunked otherwise
        drain(publish(sink, ((b, o, e) for b, o, e in positioned(evs, 25) if b > 5 or o > 20), 15))
    assert renamed[0].name == "stream-3-b5.21-b7.10.parquet" and not renamed[0].exists()  # removed
    assert lake_ids(config, STREAM) == Counter({e.id: 1 for e in evs})
    files = f"{config['path']}/day=*/*.parquet"
    assert duckdb.execute("select count(*), count(distinct id) from read_parquet(?, hive_partitioning=true)",
                          [files]).fetchall() == [(60, 60)]
    assert not list(Path(config["path"]).glob("**/.tmp-*"))


def test_parquet_streams_sharing_a_directory_never_remove_each_others_writes(tmp_path: Path, pg: LocalPostgres) -> None:
    """Reading a token changes nothing; a writer's recovery (its first write) removes its own stream's
    leftovers and stale ones only, never the file another stream's writer (or a replay) is writing."""
    import os

    config = lake_config("parquet", tmp_path, pg)
    root = Path(config["path"])
    evs = events(20)
    with sink_of(config) as sink:
        drain(publish(sink, positioned(evs[:10], 5), 10))
    day = next(root.glob("day=*"))
    # as the stream's writer and another stream's are writing: their temporary files, a killed writer's of
    # this stream, and one of a writer killed long ago
    other = day / ".tmp-stream-4-b-inflight.parquet"
    replay = day / ".tmp-stream-3-replay-inflight.parquet"
    killed = day / ".tmp-stream-3-b-killed.parquet"
    old = day / ".tmp-0123456789abcdef.parquet"
    markers = root / parquet_module.MARKER_DIR  # the markers' own: a killed writer's, another stream's, an old one
    killed_marker, other_marker = markers / ".tmp-stream-3-b-killed.json", markers / ".tmp-stream-4-b-inflight.json"
    old_marker = markers / ".tmp-0123456789abcdef.json"
    for file in (other, replay, killed, old, killed_marker, other_marker, old_marker):
        file.write_bytes(b"partial")
    long_ago = time.time() - parquet_module.STALE_TMP_SECS - 60
    os.utime(old, (long_ago, long_ago))
    os.utime(old_marker, (long_ago, long_ago))
    before = sorted(p.name for p in root.rglob("*"))
    with sink_of(config) as reader:  # another process reading the token (a check, the reconcile command)
        assert reader.read_token(STREAM) is not None and reader.read_token(4) is None
    assert sorted(p.name for p in root.rglob("*")) == before  # nothing written, nothing removed
    with sink_of(config) as sink:  # the stream's next writer
        drain(publish(sink, positioned(evs, 5), 10))
    assert other.exists() and replay.exists() and not killed.exists() and not old.exists()
    assert other_marker.exists() and not killed_marker.exists() and not old_marker.exists()
    assert lake_ids(config, STREAM) == Counter({e.id: 1 for e in evs})


def test_the_token_follows_the_delivery_order() -> None:
    assert token(1, 1_000_000) < token(2, 1) < token(2, 2) < token(2**31, 1)
    assert position_of(token(123456, 789)) == (123456, 789)


def test_bad_config_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"table must be namespace\.table"):
        build_sink({"type": "iceberg", "catalog_url": "postgresql://u:pw@h/db", "warehouse": "file:///x",
                    "table": "events; drop"})
    with pytest.raises(ValidationError, match="catalog_url must be a postgresql://"):
        build_sink({"type": "iceberg", "catalog_url": "sqlite:///x.db", "warehouse": "file:///x", "table": "a.b"})
    with pytest.raises(ValidationError, match="path"):
        build_sink({"type": "delta"})
    with pytest.raises(ValidationError, match="compression"):
        build_sink({"type": "parquet", "path": str(tmp_path), "compression": "lz9"})
    with pytest.raises(ConfigError) as located:  # the message names the key where it is
        parse_stream({"id": 1, "sink": {"type": "iceberg", "catalog_url": "postgresql://u:Pw0rdSecret@h/db",
                                        "warehouse": "file:///x", "table": "nodots"}}, "pgstream.yaml")
    assert str(located.value) == ("pgstream.yaml: sink.table: Value error, table must be namespace.table (letters, "
                                  "digits and _ in each part)")
    with pytest.raises(ConfigError, match=r"pgstream\.yaml: sink\.path: Field required"):
        parse_stream({"id": 1, "sink": {"type": "delta"}}, "pgstream.yaml")
    with pytest.raises(ValueError, match=r"sink\.type parquet: needs delivery\.ordering global"):
        parse_stream({"id": 1, "sink": {"type": "parquet", "path": str(tmp_path)},
                      "delivery": {"ordering": "by_key", "routing_key": "table"}})


def test_a_catalog_that_cannot_be_reached_fails_without_its_password(tmp_path: Path) -> None:
    from pgstream_dagster.devdb import free_port

    url = f"postgresql://lake:S3cretPassw0rd@127.0.0.1:{free_port()}/catalog"
    with sink_of({"type": "iceberg", "catalog_url": url, "warehouse": f"file://{tmp_path}",
                  "table": "ns.events"}) as sink:
        with pytest.raises(SinkError) as raised:
            sink.publish_at(events(2), [(1, 1), (1, 2)])
    message = str(raised.value)
    assert "iceberg sink: events" in message and "ns.events" in message and "127.0.0.1" in message
    assert "S3cretPassw0rd" not in message and not raised.value.permanent
    assert "S3cretPassw0rd" not in repr(sink.config)


def test_a_sink_in_a_table_a_file_is_in_the_way_of_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "blocked").write_text("not a directory")
    with sink_of({"type": "parquet", "path": str(tmp_path / "blocked")}) as sink:
        with pytest.raises(SinkError, match=r"parquet sink: events .*: directory .*blocked"):
            sink.publish_at(events(2), [(1, 1), (1, 2)])


def order_event(event_id: int, op: str, row: dict[str, Any]) -> Event:
    return Event(event_id, STREAM, {"tg_op": op, "tg_name": "orders", "tg_table_schema": "public",
                                    "tg_table_name": "orders", "new": None if op == "DELETE" else row,
                                    "old": row if op == "DELETE" else None}, None, START)


@pytest.mark.parametrize("kind", LAKE_FORMATS)
def test_typed_columns_from_the_catalog_and_a_column_the_subscription_gains(
        kind: str, tmp_path: Path, pg: LocalPostgres, db_url: str) -> None:
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("create table public.orders (id bigint primary key, qty integer, amount numeric(12, 2), "
                     "placed_at timestamptz, note text, paid boolean, tags text[], \"unit price\" real)")
        conn.execute("select pgstream.ensure_stream(%s)", [STREAM])
        conn.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                     "values ('orders', %s, 'INSERT', 'orders', "
                     "'{id,qty,amount,placed_at,note,paid,tags,unit price}'), "
                     "('orders', %s, 'DELETE', 'orders', '{id}')", [STREAM, STREAM])
    # the catalog is read as the runtime role (what a delivery run connects as)
    runtime_url = db_url + ("&" if "?" in db_url else "?") + "options=-c%20role%3Dpgstream_runtime"
    config = {**lake_config(kind, tmp_path, pg), "typed_columns": True, "database_url": runtime_url}
    first = [order_event(1, "INSERT", {"id": 1, "qty": 3, "amount": 12.5, "placed_at": "2026-11-26T22:00:01.5+00:00",
                                       "note": "ünïcode", "paid": True, "tags": ["a", "b"], "unit price": 2.5}),
             order_event(2, "DELETE", {"id": 1})]
    with sink_of(config) as sink:
        sink.publish_at(first, [(1, 1), (1, 2)])
    # the table gains a column and the subscription publishes it
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("alter table public.orders add column shipped_on date")
        conn.execute("update pgstream.subscriptions set column_names = column_names || '{shipped_on}'::text[] "
                     "where operation = 'INSERT'")
    with sink_of(config) as sink:
        sink.publish_at([order_event(3, "INSERT", {"id": 2, "qty": 1, "shipped_on": "2026-11-27"})], [(2, 1)])
        sink.publish_at(first, [(1, 1), (1, 2)])  # a retry of the first commit: nothing
        rows = {r["id"]: r for r in sink.read(STREAM, ["id", "row_id", "row_qty", "row_amount", "row_placed_at",
                                                        "row_note", "row_paid", "row_tags", "row_shipped_on",
                                                        "row_unit_price"])
                .to_pylist()}
        types = {f.name: str(f.type) for f in sink.read(STREAM, ["row_qty", "row_amount", "row_placed_at",
                                                                 "row_shipped_on", "row_tags"]).schema}
    assert types == {"row_qty": "int32", "row_amount": "string", "row_placed_at": "timestamp[us, tz=UTC]",
                     "row_shipped_on": "date32[day]", "row_tags": "string"}
    assert rows[1] == {"id": 1, "row_id": 1, "row_qty": 3, "row_amount": "12.5",
                       "row_placed_at": dt.datetime(2026, 11, 26, 22, 0, 1, 500000, tzinfo=dt.UTC),
                       "row_note": "ünïcode", "row_paid": True, "row_tags": '["a","b"]', "row_shipped_on": None,
                       "row_unit_price": 2.5}
    assert rows[2]["row_id"] == 1 and rows[2]["row_qty"] is None  # a DELETE: its old row
    assert rows[3]["row_shipped_on"] == dt.date(2026, 11, 27) and rows[3]["row_qty"] == 1
    assert lake_ids(config, STREAM) == Counter({1: 1, 2: 1, 3: 1})


def test_typed_columns_need_the_database(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"typed_columns: true needs database_url") as raised:
        build_sink({"type": "delta", "path": str(tmp_path), "typed_columns": True})
    assert "database_url" in str(raised.value)


@pytest.mark.parametrize("kind", LAKE_FORMATS)
def test_payloads_of_any_shape_are_written_as_they_are(kind: str, tmp_path: Path, pg: LocalPostgres) -> None:
    """Whoever writes events decides their payload: an array, a number where tg_op belongs, nesting
    deeper than Python parses. The row holds the payload text; the columns it lacks are null."""
    deep = "[" * 5000 + "]" * 5000
    texts = ['[1, 2]', '{"tg_op": 5, "tg_name": {"x": 1}, "new": "not a row"}', deep,
             '{"tg_op": "UPDATE", "tg_name": "s", "tg_table_schema": "public", "tg_table_name": "t", "new": {"a": 1}}']
    evs = [Event(i, STREAM, None, None, START, payload_json=text) for i, text in enumerate(texts, start=1)]
    config = {**lake_config(kind, tmp_path, pg)}
    with sink_of(config) as sink:
        sink.publish_at(evs, [(1, i) for i in range(1, 5)])
        rows = {r["id"]: r for r in sink.read(STREAM, ["id", "operation", "subscription", "payload"]).to_pylist()}
    assert {i: (r["operation"], r["subscription"], r["payload"]) for i, r in rows.items()} == {
        1: (None, None, texts[0]), 2: (None, None, texts[1]), 3: (None, None, deep), 4: ("UPDATE", "s", texts[3])}


def test_parquet_files_without_their_marker_stop_the_sink_and_stay(tmp_path: Path, pg: LocalPostgres) -> None:
    config = lake_config("parquet", tmp_path, pg)
    with sink_of(config) as sink:
        drain(publish(sink, positioned(events(10), 25), 5))
    marker = Path(config["path"]) / "_pgstream" / f"stream-{STREAM}.json"
    marker.unlink()
    files = sorted(Path(config["path"]).glob("day=*/*.parquet"))
    with sink_of(config) as sink, pytest.raises(SinkError, match=r"holds delivered files of stream 3 but no commit "
                                                                 r"marker \(_pgstream/stream-3\.json\)"):
        drain(publish(sink, positioned(events(10), 25), 5))
    assert sorted(Path(config["path"]).glob("day=*/*.parquet")) == files
    assert lake_ids(config, STREAM) == Counter({e.id: 1 for e in events(10)})


def test_closing_an_iceberg_sink_closes_its_catalog_connections(tmp_path: Path, pg: LocalPostgres) -> None:
    import psycopg

    config = lake_config("iceberg", tmp_path, pg)
    database = config["catalog_url"].rsplit("/", 1)[1]

    def connections() -> int:
        with psycopg.connect(pg.url) as conn:
            row = conn.execute("select count(*) from pg_stat_activity where datname = %s", [database]).fetchone()
        assert row is not None
        return int(row[0])
    for _ in range(3):
        with sink_of(config) as sink:
            sink.publish_at(events(3), [(1, 1), (1, 2), (1, 3)])
            assert connections() >= 1
    assert connections() == 0
    assert lake_ids(config, STREAM) == Counter({e.id: 1 for e in events(3)})


def test_typed_columns_keep_the_options_of_the_database_url(tmp_path: Path, db_url: str) -> None:
    """The URL's options (a role to set) reach the catalog's session: a role that does not exist fails it."""
    url = db_url + ("&" if "?" in db_url else "?") + "options=-c%20role%3Dno_such_role"
    with sink_of({"type": "parquet", "path": str(tmp_path / "t"), "typed_columns": True,
                  "database_url": url}) as sink:
        with pytest.raises(SinkError, match="no_such_role"):
            sink.publish_at([order_event(1, "INSERT", {"id": 1})], [(1, 1)])


def gauge_event(event_id: int, row: dict[str, Any]) -> Event:
    return Event(event_id, STREAM, {"tg_op": "INSERT", "tg_name": "gauges", "tg_table_schema": "public",
                                    "tg_table_name": "gauges", "new": row}, None, START)


def gauges_table(db_url: str, stream_id: int = STREAM) -> None:
    """``public.gauges`` (a smallint, a date, a real, a boolean, a timestamptz), subscribed on ``stream_id``."""
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("create table public.gauges (id bigint primary key, n smallint, on_day date, ratio real, "
                     "ok boolean, at timestamptz)")
        conn.execute("select pgstream.ensure_stream(%s)", [stream_id])
        conn.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                     "values ('gauges', %s, 'INSERT', 'gauges', '{id,n,on_day,ratio,ok,at}')", [stream_id])


#: rows a typed column cannot hold (issue 43, finding 5), and why
UNFIT: list[tuple[dict[str, Any], str]] = [
    ({"id": 2, "n": 70000}, "'n' (smallint) cannot hold the row's value: out of range"),
    ({"id": 3, "on_day": "2026-13-45"}, "'on_day' (date) cannot hold the row's value: not a date"),
    ({"id": 4, "n": "seven"}, "'n' (smallint) cannot hold the row's value: not an integer"),
    ({"id": 5, "ratio": 1e39}, "'ratio' (real) cannot hold the row's value: out of range"),
    ({"id": 6, "ok": "yes"}, "'ok' (boolean) cannot hold the row's value: not true or false"),
    ({"id": 7, "at": {"x": 1}}, "'at' (timestamp with time zone) cannot hold the row's value: not a timestamp"),
]


@pytest.mark.parametrize("kind", LAKE_FORMATS)
def test_a_value_a_typed_column_cannot_hold_is_that_events_rejection(kind: str, tmp_path: Path, pg: LocalPostgres,
                                                                     db_url: str) -> None:
    """Issue 43, finding 5: a manual event whose row value the typed column cannot hold (70000 for a
    smallint, a date that is none...) is a permanent rejection of that event alone, after the events
    before it in the call were committed; retried, it is rejected again and nothing is written twice.
    A value Postgres holds and the lake cannot (a date of infinity) is null, the payload keeps it."""
    gauges_table(db_url)
    config = {**lake_config(kind, tmp_path, pg), "typed_columns": True, "database_url": db_url}
    ok = gauge_event(1, {"id": 1, "n": 7, "on_day": "infinity", "ratio": 0.5, "ok": True,
                         "at": "2026-12-01T10:00:00+00:00"})
    unfit = [gauge_event(10 + i, row) for i, (row, _why) in enumerate(UNFIT)]
    last = gauge_event(99, {"id": 9, "n": -32768})
    with sink_of(config) as sink:
        for attempt in range(2):  # the call, then its retry
            with pytest.raises(SinkError) as rejected:
                sink.publish_at([ok, *unfit, last], [(1, i) for i in range(1, len(unfit) + 3)])
            assert rejected.value.permanent and rejected.value.event_ids == (unfit[0].id,), attempt
            assert UNFIT[0][1] in str(rejected.value) and "70000" not in str(rejected.value)
        # the publisher goes on with the events after it, one rejection at a time
        for i, event in enumerate(unfit[1:], start=2):
            with pytest.raises(SinkError) as rejected:
                sink.publish_at([event, last], [(1, i + 1), (1, len(unfit) + 2)])
            assert rejected.value.permanent and rejected.value.event_ids == (event.id,)
            assert UNFIT[i - 1][1] in str(rejected.value)
        sink.publish_at([last], [(1, len(unfit) + 2)])
        with pytest.raises(SinkError) as rejected:  # a replay (by id) rejects it the same way
            sink.publish([ok, unfit[0], last])
        assert rejected.value.permanent and rejected.value.event_ids == (unfit[0].id,)
        rows = {r["id"]: r for r in sink.read(STREAM, ["id", "row_n", "row_on_day", "payload"]).to_pylist()}
    assert lake_ids(config, STREAM) == Counter({ok.id: 1, last.id: 1})
    assert rows[ok.id]["row_on_day"] is None and '"on_day":"infinity"' in rows[ok.id]["payload"]
    assert rows[last.id]["row_n"] == -32768


#: per Postgres type, lists of row values (as the payload's JSON gives them) and whether Arrow converts the
#: list at once (else one value at a time): fitting ones, and ones with a value the column cannot hold
TYPED_LISTS: list[tuple[str, list[Any], bool]] = [
    ("smallint", [1, None, -32768, 32767], True),
    ("smallint", [1, 70000, 2], False),  # out of range: found one by one
    ("smallint", [1, True], False),  # a boolean is no integer
    ("bigint", ["5", 2], False),  # a numeric string is taken
    ("bigint", [2**63, 1], False),
    ("real", [0.5, None, 1e30, -2.25], True),
    ("real", [0.5, 3.5e38], False),
    ("double precision", [1.5, None, 1e300], True),
    ("double precision", [1.5, float("inf")], False),  # a number past float64 (Python's parser gives inf)
    ("double precision", [1, 2.5, float("nan")], True),  # Postgres prints 1.0 as 1
    ("double precision", [float("nan"), float("inf")], False),
    ("double precision", [2**53 + 1, 2.5], False),  # an integer a float64 rounds: one by one, as float() does
    ("real", [1, -2.5, 3.4028234663852886e38], True),
    ("real", [3.5e38, float("nan")], False),
    ("boolean", [True, None, False], True),
    ("boolean", [True, 1], False),
    ("text", ["a", None, "ü"], True),
    ("text", ["a", 1, {"k": 1}], False),  # as JSON text
    ("date", ["2026-01-01", None, "0001-01-01", "9999-12-31"], True),
    ("date", ["2026-01-01", "infinity"], False),  # null: Postgres holds it, Arrow cannot
    ("date", ["2026-02-28", "2026-02-30"], False),
    ("date", ["0000-01-01"], False),
    ("timestamp with time zone", ["2026-12-01T10:00:00+01:00", None], False),
]


@pytest.mark.parametrize(("pg_type", "values", "at_once"), TYPED_LISTS)
def test_a_typed_column_converted_at_once_holds_what_one_value_at_a_time_gives(
        pg_type: str, values: list[Any], at_once: bool) -> None:
    """Issue 48: a typed column's values are converted a column at a time (Arrow) where Arrow reads them as
    TypedColumn.convert does, else one by one; either way the same values, the same first unfit one."""
    import pyarrow as pa

    from pgstream_dagster.sinks.lake import TypedColumn, UnfitValue

    column = TypedColumn("c", pg_type)
    expected: list[Any] = []
    unfit, why = None, ""
    for index, value in enumerate(values):
        try:
            expected.append(column.convert(value))
        except UnfitValue as exc:
            unfit, why = index, str(exc)
            break
    array, got_unfit, got_why = column.array(values)
    def held(a: pa.Array) -> list[Any]:  # NaN as a string: equal to itself
        return ["NaN" if isinstance(v, float) and v != v else v for v in a.to_pylist()]

    assert (held(array), got_unfit, got_why) == (held(pa.array(expected, type=column.arrow_type())), unfit, why)
    assert (column._at_once(values) is not None) == at_once


def test_typed_values_stop_at_the_first_event_with_an_unfit_value_whichever_its_column() -> None:
    from pgstream_dagster.sinks.lake import TypedColumn, typed_values

    columns = [TypedColumn("n", "smallint"), TypedColumn("ok", "boolean")]
    rows: list[dict[str, Any]] = [{"n": 1, "ok": True}, {"n": 2, "ok": False}, {"n": 3, "ok": "yes"},
                                  {"n": 70000, "ok": True}]
    arrays, unfit, why = typed_values([gauge_event(i, row) for i, row in enumerate(rows)], columns)
    assert unfit == 2 and "'ok' (boolean)" in why and [a.to_pylist() for a in arrays] == [[1, 2], [True, False]]
