"""The ``pgstream`` Spark source (engine/spark_source.py): a streaming query into Parquet killed with
SIGKILL mid-stream and restarted on its checkpoint ends with each event exactly once at its ledger
position; positions and micro-batch caps; the registered consumer's position and what the executor
role may do with it; the batch reader's filters pushed down to Postgres (the statements the
executor role ran, from the server's log) and its delivery-state columns; the values both readers parse from
CSV into Arrow against a plain query's."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine import spark_source
from pgstream_dagster.engine.spark_source import BEFORE_ALL, Position, SourceError, SpanRead

from .support.harness import backdated, insert_events
from .support.spark_source import consumer_row, executor_role, record_batches, stream_exactly_once


@pytest.fixture
def stream(conn: psycopg.Connection) -> psycopg.Connection:
    conn.execute("select pgstream.ensure_stream(1)")
    conn.execute("select pgstream.ensure_stream(2)")
    return conn


def test_positions_caps_and_partitions(db_url: str, stream: psycopg.Connection) -> None:
    insert_events(db_url, 1, 25)
    insert_events(db_url, 2, 5)  # another stream's events and batches are never read
    record_batches(db_url, 2, 5)
    batches = record_batches(db_url, 1, 10)  # 10, 10, 5
    (b1, ids1), (b2, ids2), (b3, _ids3) = batches
    c = stream
    assert spark_source.start_position(c, 1, "earliest") == BEFORE_ALL
    assert spark_source.start_position(c, 1, "latest") == Position(b3, 5)
    # an event id: just before it, in its batch's commit order
    assert spark_source.start_position(c, 1, str(ids2[3])) == Position(b2, 3)
    assert spark_source.start_position(c, 1, "2000-01-01T00:00:00Z") == Position(b1, 0)
    assert spark_source.start_position(c, 1, "2999-01-01") == Position(b3, 5)
    with pytest.raises(SourceError, match="no recorded batch of stream 1 holds event"):
        spark_source.start_position(c, 1, "999999")
    with pytest.raises(SourceError, match="startingPosition must be"):
        spark_source.start_position(c, 1, "yesterday")

    # caps cut batches where they must; no cap: the ledger's end
    assert spark_source.next_position(c, 1, BEFORE_ALL, 7) == Position(b1, 7)
    assert spark_source.next_position(c, 1, Position(b1, 7), 7) == Position(b2, 4)
    assert spark_source.next_position(c, 1, Position(b2, 4), 100) == Position(b3, 5)
    assert spark_source.next_position(c, 1, Position(b1, 10), None) == Position(b3, 5)
    assert spark_source.next_position(c, 1, Position(b3, 5), 3) == Position(b3, 5)  # nothing new

    spans = spark_source.spans_between(c, 1, Position(b1, 7), Position(b3, 2))
    assert spans == [SpanRead(b1, 8, 10), SpanRead(b2, 1, 10), SpanRead(b3, 1, 2)]
    groups = spark_source.split_spans(spans, 3, 1000)
    assert [sum(s.events for s in g) for g in groups] == [5, 5, 5]
    assert [s for g in groups for s in g] == [SpanRead(b1, 8, 10), SpanRead(b2, 1, 2), SpanRead(b2, 3, 7),
                                              SpanRead(b2, 8, 10), SpanRead(b3, 1, 2)]
    assert spark_source.split_spans(spans, 1, 4)[0] == [SpanRead(b1, 8, 10), SpanRead(b2, 1, 1)]
    assert spark_source.spans_between(c, 1, Position(b3, 2), Position(b3, 2)) == []
    assert ids1


def test_bad_options_are_named_and_the_url_is_never_shown(db_url: str, stream: psycopg.Connection) -> None:
    from pgstream_dagster.engine.spark_source import EventsReader, StreamReader

    base = {"url": db_url, "stream": "1", "consumer": "c1", "consumerToken": "t"}
    for options, message in [({**base, "stream": "one"}, "option 'stream' must be an integer, got 'one'"),
                             ({**base, "stream": "0"}, "option 'stream' must be >= 1, got 0"),
                             ({k: v for k, v in base.items() if k != "consumer"}, "option 'consumer' is required"),
                             ({k: v for k, v in base.items() if k != "url"}, "option 'url' is required"),
                             ({**base, "maxEventsPerTrigger": "-3"}, "'maxEventsPerTrigger' must be >= 0"),
                             ({**base, "failOnDataLoss": "maybe"}, "'failOnDataLoss' must be true or false")]:
        with pytest.raises(SourceError, match=message):
            StreamReader(options)
    with pytest.raises(SourceError, match="option 'fromTime' must be an ISO time, got 'monday'"):
        EventsReader({**base, "fromTime": "monday"})
    # a blank option is an absent one, whatever its kind: its default
    assert StreamReader({**base, "failOnDataLoss": " ", "maxEventsPerTrigger": ""}).fail_on_data_loss is True
    reader = spark_source.PgstreamDataSource({**base, "pushFilters": " "}).reader(None)
    assert not isinstance(reader, spark_source.PushdownEventsReader)
    # a wrong password: the message names the failure, never the URL or its password
    secret = "s3cret-Pa55word"
    bad = db_url.replace("postgres@", f"nobody:{secret}@")
    with pytest.raises(SourceError) as info:
        StreamReader({**base, "url": bad}).initialOffset()
    assert "cannot connect to the database of option 'url'" in str(info.value)
    assert secret not in str(info.value) and bad not in str(info.value)
    with pytest.raises(SourceError, match="not a valid database URL") as info:
        StreamReader({**base, "url": f"host=x password={secret} ==="}).initialOffset()
    assert secret not in str(info.value)


def test_consumer_position_and_what_the_executor_may_do(db_url: str, stream: psycopg.Connection,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Only an operator registers a consumer (it holds events back) and issues its token: the executor role
    records the position of a registered consumer of its stream with that consumer's token, and can
    neither register one nor change or drop one (moving another's: tests/test_executor_role.py)."""
    from pgstream_dagster.cli import main as cli_main

    insert_events(db_url, 1, 12)
    (b1, _), (b2, _) = record_batches(db_url, 1, 6)
    with executor_role(db_url) as url, psycopg.connect(url, autocommit=True) as ex:
        with pytest.raises(SourceError, match=r"consumer lake\.orders is not registered \(An operator registers it: "
                                              r"pgstream-dagster consumers add lake\.orders 1\)"):
            spark_source.commit_consumer(ex, "lake.orders", 1, Position(b1, 4), "no token")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            ex.execute("select pgstream.register_consumer('mine', 1, true, 3650)")
        assert stream.execute("select count(*) from pgstream.consumers").fetchone() == (0,)
        # the operator registers it (the runtime role may): before every batch, or at the ledger's end
        assert cli_main(["consumers", "add", "lake.orders", "1", "--from-start", "--database-url", db_url]) == 0
        token = capsys.readouterr().out.splitlines()[-1]
        assert consumer_row(db_url, "lake.orders") == (0, 0, 12)
        assert cli_main(["consumers", "add", "lake.audit", "1", "--retention-days", "7", "--database-url", db_url]) == 0
        audit_token = capsys.readouterr().out.splitlines()[-1]
        assert consumer_row(db_url, "lake.audit") == (b2, 6, 0)
        assert len(token) == len(audit_token) == 64 and token != audit_token
        assert cli_main(["consumers", "add", "lake.orders", "1", "--database-url", db_url]) == 0
        out = capsys.readouterr().out
        assert "registered already: nothing changed" in out and token not in out
        assert cli_main(["consumers", "add", "lake.orders", "2", "--database-url", db_url]) == 2
        assert cli_main(["consumers", "add", "bad name!", "1", "--database-url", db_url]) == 2
        assert cli_main(["consumers", "add", "x", "1", "--retention-days", "0", "--database-url", db_url]) == 2
        err = capsys.readouterr().err
        assert "consumer lake.orders reads stream 1, not stream 2" in err and "a consumer name is" in err
        assert "days must be 1-3650, got 0" in err
        spark_source.commit_consumer(ex, "lake.orders", 1, Position(b1, 4), token)
        assert consumer_row(db_url, "lake.orders") == (b1, 4, 8)
        spark_source.commit_consumer(ex, "lake.orders", 1, Position(b2, 6), token)
        assert consumer_row(db_url, "lake.orders") == (b2, 6, 0)
        bad: list[tuple[Any, ...]] = [
            ("bad name!", 1, b1, 1, "a consumer name is"),
            ("lake.orders", 99, 0, 0, "no stream 99"),
            ("lake.orders", 1, b1, 7, "is no position of stream 1"),  # past the batch's 6 events
            ("lake.orders", 1, 0, 3, "batch 0"),
            ("lake.orders", 2, b1, 1, "reads stream 1, not stream 2"),
            ("nobody", 1, 0, 0, "consumer nobody is not registered"),
        ]
        for name, stream_id, batch_id, ord_, message in bad:
            with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
                ex.execute("select pgstream.consumer_commit(%s, %s, %s, %s, %s)", [name, stream_id, batch_id, ord_,
                                                                                  token])
        # a new token: the last one no longer moves the position
        assert cli_main(["consumers", "token", "lake.orders", "--database-url", db_url]) == 0
        new_token = capsys.readouterr().out.splitlines()[-1]
        assert len(new_token) == 64 and new_token != token
        with pytest.raises(SourceError, match=r"the token \(option consumerToken\) is not this consumer's") as info:
            spark_source.commit_consumer(ex, "lake.orders", 1, Position(b1, 1), token)
        assert token not in str(info.value)
        spark_source.commit_consumer(ex, "lake.orders", 1, Position(b2, 6), new_token)
        assert cli_main(["consumers", "token", "nobody", "--database-url", db_url]) == 1
        # least privilege: positions through consumer_commit only
        for statement in ["update pgstream.consumers set max_retention_days = 3650",
                          "insert into pgstream.consumers (name, stream_id, batch_id, ord) values ('y', 1, 0, 0)",
                          "delete from pgstream.consumers",
                          "select pgstream.set_consumer_retention('lake.orders', 3650)",
                          "select pgstream.drop_consumer('lake.orders')",
                          "select pgstream.consumer_token('lake.orders')",
                          "select * from pgstream.consumer_status",
                          "update pgstream.batches set status = 'delivered'"]:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                ex.execute(statement)
    rows = stream.execute("select name, stream_id, batch_id, ord, max_retention_days from pgstream.consumers"
                          " order by name").fetchall()
    assert rows == [("lake.audit", 1, b2, 6, 7), ("lake.orders", 1, b2, 6, 30)]
    # the source's own options: without the token, a message saying where it comes from
    with pytest.raises(SourceError, match=r"option 'consumerToken' is required \(consumer c1's token: "):
        spark_source.StreamReader({"url": db_url, "stream": "1", "consumer": "c1"})


def test_a_checkpoint_past_what_a_failover_kept_goes_on_from_the_consumers_position(
        db_url: str, stream: psycopg.Connection, caplog: pytest.LogCaptureFixture) -> None:
    """After a failover of the primary with the standby behind, the new primary's ledger lacks the batches the old
    one recorded last and hands their ids out again for other events (its batches sequence resumes from what the
    standby replayed). A query restarted on its checkpoint names such a position: the reader sees that the ledger no
    longer holds the offset's event there and goes on from its consumer's position recorded in the database (the
    standby's, replicated with the ledger): every event the new primary holds is read, some twice, none skipped.
    The state a lagging promotion leaves is made here in one database (tests/test_standby_failover.py promotes
    real standbys); the reader is driven as Spark's micro-batch loop calls it."""
    insert_events(db_url, 1, 30)
    batches = record_batches(db_url, 1, 5)  # six batches of five
    stream.execute("select pgstream.register_consumer('lake.c', 1, true, 30)")
    (token,) = stream.execute("select pgstream.consumer_token('lake.c')").fetchone()  # type: ignore[misc]
    read: list[int] = []

    def micro_batch(reader: spark_source.StreamReader, start: dict[str, int]) -> dict[str, int]:
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        for part in reader.partitions(start, end):
            for got in reader.read(part):
                read.extend(got.column("id").to_pylist())
        return end

    with executor_role(db_url) as url:
        options = {"url": url, "stream": "1", "consumer": "lake.c", "consumerToken": token,
                   "maxEventsPerTrigger": "10"}
        reader = spark_source.StreamReader(options)
        offsets = [reader.initialOffset()]
        for _ in range(3):
            offsets.append(micro_batch(reader, offsets[-1]))
        reader.commit(offsets[-1])
        reader.stop()
        assert sorted(read) == sorted(i for _b, ids in batches for i in ids)
        assert offsets[-1]["event_id"] == batches[-1][1][-1]  # the offset names the event at its position
        # the promoted standby had replayed the ledger through batch 4 and the consumer at the third micro-batch's
        # start; the old primary's batches 5 and 6 are gone and their ids are handed out again, four events each
        b4 = batches[3][0]
        stream.execute("update pgstream.consumers set batch_id = %s, ord = 5 where name = 'lake.c'", [b4])
        stream.execute("delete from pgstream.batches where id > %s", [b4])
        stream.execute("select setval(pg_get_serial_sequence('pgstream.batches', 'id'), %s)", [b4])
        insert_events(db_url, 1, 7)  # written on the new primary
        again = record_batches(db_url, 1, 4, seed=11)
        assert again[1][0] == batches[5][0]  # the old sixth batch's id, now four other events
        before = set(read)
        read.clear()
        restarted = spark_source.StreamReader(options)  # the query restarted on its checkpoint
        start = offsets[-1]
        while (end := micro_batch(restarted, start)) != start:
            restarted.commit(end)
            start = end
        restarted.stop()
    with psycopg.connect(db_url) as c:
        held = {int(r[0]) for r in c.execute("select id from pgstream.events where stream_id = 1")}
    assert held - before - set(read) == set(), "events skipped"
    assert set(read) == {i for _b, ids in again for i in ids}  # from batch 5 on: what the standby lacked, and more
    assert "the ledger no longer holds event" in caplog.text
    assert "going on from consumer lake.c's position" in caplog.text


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    from pgstream_dagster.engine.spark import spark_conf
    from pgstream_dagster.engine.spark_source import register

    builder = SparkSession.builder
    for key, value in spark_conf("local[2]", None, {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.conf.set("spark.sql.python.filterPushdown.enabled", "true")  # for pushFilters=true
    register(session)
    yield session


def test_stream_killed_mid_stream_and_restarted_reads_each_event_once(
        db_url: str, stream: psycopg.Connection, tmp_path: Path) -> None:
    # restarted with Trigger.AvailableNow: it reads to the ledger's end and stops by itself
    stream_exactly_once(db_url, tmp_path, {"spark.master": "local[2]"}, restart="available_now")


def test_batch_read_pushes_filters_down_and_reports_delivery_state(
        db_url: str, stream: psycopg.Connection, spark: Any, pg: LocalPostgres) -> None:
    c = stream
    yesterday = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    # 40 events of stream 1 yesterday (subscriptions a/b, INSERT/UPDATE), 40 today, 10 of stream 2
    backdated(c, "insert into pgstream.events (payload, stream_id, created_at) select jsonb_build_object("
              "'tg_name', case when g %% 2 = 0 then 'a' else 'b' end, 'tg_op', case when g %% 4 < 2 then 'INSERT' "
              "else 'UPDATE' end, 'tg_table_schema', 'public', 'tg_table_name', 't', 'n', g), 1, %s "
              "from generate_series(0, 39) g", [yesterday])
    c.execute("insert into pgstream.events (payload, stream_id) select jsonb_build_object("
              "'tg_name', case when g % 2 = 0 then 'a' else 'b' end, 'tg_op', case when g % 4 < 2 then 'INSERT' "
              "else 'UPDATE' end, 'tg_table_schema', 'public', 'tg_table_name', 't', 'n', g), 1 "
              "from generate_series(40, 79) g")
    insert_events(db_url, 2, 10)
    record_batches(db_url, 2, 10)
    batches = record_batches(db_url, 1, 30)[:2]  # the last 20 events are in the third batch: dropped
    c.execute("delete from pgstream.batches where stream_id = 1 and id not in (%s, %s)",
              [batches[0][0], batches[1][0]])
    delivered, pending = batches
    c.execute("update pgstream.batches set status = 'delivered', delivered_at = now(), attempts = 2 where id = %s",
              [delivered[0]])
    dead = pending[1][4]
    c.execute("insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, error) "
              "values (1, %s, 'deliver', %s, 5, 'rejected: 422')", [dead, pending[0]])

    with executor_role(db_url) as url:
        role = url.split("://", 1)[1].split("@", 1)[0]
        c.execute(f"alter role {role} set log_statement = 'all'")
        log = pg.datadir / "server.log"
        since = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)

        def load(**options: str) -> Any:
            reader = spark.read.format("pgstream").option("url", url).option("stream", "1")
            for key, value in options.items():
                reader = reader.option(key, value)
            return reader.load()

        # the options: conditions of the query Postgres runs
        seen = log.stat().st_size
        got = load(subscription="a", operation="update,delete", fromTime=since.isoformat()).collect()
        by_options = log.read_text(errors="replace")[seen:]
        # Spark's filters, pushed down (pushFilters)
        seen = log.stat().st_size
        pushed_df = load(pushFilters="true", numPartitions="3")
        pushed = pushed_df.where((pushed_df.subscription == "a") & (pushed_df.operation.isin("UPDATE", "DELETE"))
                                 & (pushed_df.created_at >= since)).collect()
        by_filters = log.read_text(errors="replace")[seen:]
        # why pushFilters is opt-in: Spark 4.3 reads the same DataFrame's later unfiltered query with
        # the reader its filtered query pushed filters into (if this starts failing, Spark fixed it)
        assert pushed_df.count() == len(pushed) != 80
        everything = load(numPartitions="3").collect()

    want = [r[0] for r in c.execute(
        "select id from pgstream.events where stream_id = 1 and payload->>'tg_name' = 'a' and payload->>'tg_op' = "
        "'UPDATE' and created_at >= %s order by id", [since])]
    assert len(want) == 10
    assert sorted(r.id for r in got) == want and sorted(r.id for r in pushed) == want
    # the selections ran in Postgres: the statements the executor role issued hold them (their values
    # quoted into the COPY by psycopg)
    for issued in (by_options, by_filters):
        assert "/* pgstream source: events */" in issued
        for condition in ["(e.payload ->> 'tg_name') = ", "(e.payload ->> 'tg_op') = any('{", "e.created_at >= '"]:
            assert condition in issued, issued[-3000:]

    # delivery state: each event's batch and ordinal, the batch's status, time and attempts, dead letters
    by_id = {r.id: r for r in everything}
    assert len(by_id) == 80
    for batch_id, ids in batches:
        for i, event_id in enumerate(ids, start=1):
            row = by_id[event_id]
            assert (row.batch_id, row.ord) == (batch_id, i)
            assert row.batch_status == ("delivered" if batch_id == delivered[0] else "pending")
            assert (row.delivered_at is not None) == (batch_id == delivered[0])
            assert row.attempts == (2 if batch_id == delivered[0] else 0)
            assert row.dead_letter == (event_id == dead)
    assert by_id[dead].dead_letter_status == "open" and by_id[dead].dead_letter_error == "rejected: 422"
    unbatched = set(by_id) - {e for _b, ids in batches for e in ids}
    assert len(unbatched) == 20 and all(by_id[e].batch_id is None and by_id[e].batch_status is None
                                        for e in unbatched)
    assert {r.subscription for r in everything} == {"a", "b"} and {r.table_name for r in everything} == {"t"}


def test_arrow_reads_give_the_values_of_a_plain_query(db_url: str, stream: psycopg.Connection, spark: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Both readers parse a COPY in CSV into Arrow record batches: odd JSON (quotes, commas, backslashes,
    newlines, unicode, empty strings, no tg_* keys), NULL and empty text, a payload larger than a
    record batch's byte budget, and dead-letter errors over several lines come out as a plain query of
    the same columns returns them, in PySpark's Arrow schema; a span whose events are gone fails the
    stream read (failOnDataLoss) naming its batch, or is read without them."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType, _parse_datatype_string

    from pgstream_dagster.engine.spark_source import EventsGone, EventsReader, StreamReader, arrow_schema

    schema = _parse_datatype_string(spark_source.SCHEMA)
    assert isinstance(schema, StructType) and arrow_schema().equals(to_arrow_schema(schema, timezone="UTC"))
    monkeypatch.setattr(spark_source, "ARROW_BATCH_ROWS", 4)  # several record batches a partition
    monkeypatch.setattr(spark_source, "ARROW_BATCH_BYTES", 1 << 20)
    payloads = [
        {"tg_name": "orders_insert", "tg_op": "INSERT", "tg_table_schema": "public", "tg_table_name": "orders",
         "new": {"note": 'a "quoted", comma\nline\\ back\\slash', "uni": "é ü 漢字 🚀", "empty": "", "nul": None}},
        {"tg_name": "", "tg_op": "UPDATE", "tg_table_schema": "s p", "tg_table_name": "t,\"x\""},
        {"n": 1},  # no tg_* keys: NULL columns
        {"tg_name": "big", "blob": "x" * (3 << 20)},  # one event larger than a record batch's byte budget
        [1, "two", {"three": 3.5}],
        "just a string",
        {"tg_name": "NULL", "tg_op": "\\N"},
    ] * 2
    c = stream
    for i, payload in enumerate(payloads):
        c.execute("insert into pgstream.events (payload, metadata, stream_id) values (%s, %s, 1)",
                  [Jsonb(payload), None if i % 3 == 0 else Jsonb({"i": i, "m": "ü\n" if i % 2 else ""}), ])
    (b1, ids1), (b2, ids2) = record_batches(db_url, 1, 8)
    for event_id, batch_id, error in [(ids1[2], b1, 'line one\nline "two", three'), (ids2[0], b2, "")]:
        c.execute("insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, error) "
                  "values (1, %s, 'deliver', %s, 1, %s)", [event_id, batch_id, error])
    columns = ("e.id, e.stream_id, e.created_at, e.payload ->> 'tg_name', e.payload ->> 'tg_op', "
               "e.payload ->> 'tg_table_schema', e.payload ->> 'tg_table_name', e.payload::text, e.metadata::text")
    c.execute("set timezone = 'UTC'")
    plain = {r[0]: r for r in c.execute(
        f"select {columns}, d.id is not null, d.status, d.error from pgstream.events e left join "  # noqa: S608
        "pgstream.dead_letters d on d.event_id = e.id where e.stream_id = 1")}
    order = [(b1, i + 1, e) for i, e in enumerate(ids1)] + [(b2, i + 1, e) for i, e in enumerate(ids2)]

    def read(reader: Any, start: dict[str, int], end: dict[str, int] | None = None) -> list[dict[str, Any]]:
        parts = reader.partitions(start, end) if end is not None else reader.partitions()
        batches = [batch for part in parts for batch in reader.read(part)]
        assert all(batch.schema.equals(arrow_schema()) for batch in batches) and len(batches) > len(parts)
        return [row for batch in batches for row in batch.to_pylist()]

    def as_plain(row: dict[str, Any], n: int) -> tuple[Any, ...]:
        return tuple(row.values())[:9] + tuple(row.values())[14:17][:n]

    base = {"url": db_url, "stream": "1", "consumer": "c", "consumerToken": "t", "numPartitions": "3"}
    end = {"batch_id": b2, "ord": len(ids2)}
    streamed = read(StreamReader(base), BEFORE_ALL.as_offset(), end)
    assert [(r["batch_id"], r["ord"], r["id"]) for r in streamed] == order  # the ledger's order
    assert [as_plain(r, 0) for r in streamed] == [plain[e][:9] for _b, _o, e in order]
    assert all(r["batch_status"] is r["dead_letter"] is None for r in streamed)
    batch_read = read(EventsReader({**base, "numPartitions": "2"}), {})
    assert [r["id"] for r in batch_read] == sorted(plain)
    assert [as_plain(r, 3) for r in batch_read] == [plain[e] for e in sorted(plain)]
    assert {(r["id"], r["batch_id"], r["ord"]) for r in batch_read} == {(e, b, o) for b, o, e in order}

    # events of the ledger gone from pgstream.events
    c.execute("delete from pgstream.events where id = any(%s)", [ids2[1:3]])
    with pytest.raises(EventsGone, match=rf"2 of the events of ledger batch {b2} \(ordinals 1\.\.{len(ids2)}\) are "
                                         r"gone .*set failOnDataLoss=false"):
        read(StreamReader({**base, "numPartitions": "1"}), BEFORE_ALL.as_offset(), end)
    rest = read(StreamReader({**base, "failOnDataLoss": "false"}), BEFORE_ALL.as_offset(), end)
    assert [r["id"] for r in rest] == [e for _b, _o, e in order if e not in ids2[1:3]]


def test_the_pyspark_resource_registers_the_source_on_its_session(spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The code location's ``pyspark`` resource registers ``format("pgstream")`` once, when it creates
    its session (ops then use the format name directly)."""
    from pgstream_dagster.defs import resources
    from pgstream_dagster.engine.spark import spark_conf

    registered: list[Any] = []
    monkeypatch.setattr(resources, "register", registered.append)
    resource = resources.PgstreamSparkResource(spark_config=spark_conf("local[2]", None, {}))
    session = resource.spark_session
    assert resource.spark_session is session and registered == [session]


def test_a_local_session_without_pyspark_python_runs_the_source_in_this_interpreter(
        db_url: str, stream: psycopg.Connection, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session of a user's script (docs/spark-source.md): PYSPARK_PYTHON unset, so PySpark gives its Python
    workers the ``python3`` of PATH, which may lack pyarrow and this package (the source then fails with "Python
    worker failed to connect back"). ``register`` gives a local master's workers this interpreter; an explicit
    PYSPARK_PYTHON is left as set."""
    import sys

    from pyspark import SparkConf

    from pgstream_dagster.engine.spark_source import register

    context = spark.sparkContext
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.setattr(context, "pythonExec", "python3")  # what PySpark gives a context without PYSPARK_PYTHON
    monkeypatch.setattr(context, "getConf", lambda: SparkConf(loadDefaults=False))  # nor spark.pyspark.python
    register(spark)
    assert context.pythonExec == sys.executable
    insert_events(db_url, 1, 5)
    assert spark.read.format("pgstream").option("url", db_url).option("stream", 1).load().count() == 5

    monkeypatch.setenv("PYSPARK_PYTHON", "python3")  # the user's choice: theirs
    monkeypatch.setattr(context, "pythonExec", "python3")
    register(spark)
    assert context.pythonExec == "python3"


def test_an_executors_python_missing_or_without_pyarrow_fails_in_one_line_naming_it(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48: a by_key round (a lake sink on the executors) whose executors' Python is not where they
    run, or lacks pyarrow, fails in one line naming that Python and PYSPARK_PYTHON, not with Spark's
    Python traceback or Java stack trace."""
    import sys

    from pgstream_dagster.engine.spark import ExecutorPythonError, deliver_by_key
    from pgstream_dagster.sinks.parquet import ParquetSinkConfig

    blocked = tmp_path / "blocked" / "pyarrow"  # this interpreter, pyarrow hidden from it
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pyarrow'\", name='pyarrow')\n")
    without_pyarrow = tmp_path / "python-without-pyarrow"
    without_pyarrow.write_text(f'#!/bin/sh\nPYTHONPATH="{blocked.parent}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')
    without_pyarrow.chmod(0o755)
    frame = spark.createDataFrame([(1, 1, "k")], "batch_id long, ord long, routing_key string")
    sink = ParquetSinkConfig(path=str(tmp_path / "lake"))
    for python, says in ((without_pyarrow, "cannot import 'pyarrow'"),
                         (tmp_path / "no-such-python", "is not where the executors run")):
        monkeypatch.setattr(spark.sparkContext, "pythonExec", str(python))
        with pytest.raises(ExecutorPythonError) as failed:
            deliver_by_key(frame, sink, 100, 1)
        message = str(failed.value)
        assert says in message and str(python) in message and "PYSPARK_PYTHON" in message, message
        assert "\n" not in message and failed.value.__cause__ is None and failed.value.__suppress_context__
