"""End to end: subscriptions compute each event's region into its metadata (metadata_extensions), and
two streams route every event by it: one to a Redis stream per region, one to a NATS subject per
region. The YAML subscriptions are applied by materializing their assets, the streams are driven by
their sensors and delivered by real runs (Dagster instance on Postgres, Spark). Counts events in =
events out per destination, in commit order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
import redis
from psycopg.types.json import Jsonb

from pgstream_dagster.config import load_config
from pgstream_dagster.defs.assets import subscription_keys, subscription_set_key
from pgstream_dagster.engine.batches import BatchStatus

from .support.dagster_instance import materialize
from .support.harness import Driver, write_config
from .support.sinks import NATS_URL, REDIS_URL, nats_admin, stream_entries, unique

REGION = "case when new.country in ('DE', 'FR', 'IT') then 'eu' else 'us' end"
COUNTRIES = ["DE", "US", "FR", "BR", "IT", "CA", "US"]


@pytest.fixture
def redis_prefix() -> Iterator[tuple[redis.Redis, str]]:
    client = redis.Redis.from_url(REDIS_URL)
    prefix = unique("pgstream-e2e") + ":"
    yield client, prefix
    for key in client.keys(prefix + "*"):
        client.delete(key)
    client.close()


def _workload(url: str) -> int:
    """Orders in transactions of 1, 7 and 40 rows (multi-row statements: statement mode writes them with
    one trigger call); returns how many rows were inserted."""
    rows = 0
    with psycopg.connect(url, autocommit=True) as c:
        for size in (1, 7, 40, 1, 40, 7, 1, 3):
            c.execute("insert into public.orders (country, amount) "
                      "select (%s::text[])[1 + (g + %s) %% %s], g from generate_series(1, %s) g",
                      [COUNTRIES, rows, len(COUNTRIES), size])
            rows += size
        with c.transaction():  # several statements in one transaction
            for _ in range(3):
                c.execute("insert into public.orders (country, amount) values ('IT', 1), ('CA', 2)")
                rows += 2
    return rows


def _ledger(url: str, stream_id: int) -> list[tuple[int, Any]]:
    """(event id, metadata) of the stream's events in commit order (the ledger's)."""
    with psycopg.connect(url) as c:
        return c.execute(
            "select e.id, e.metadata from pgstream.batches b cross join unnest(b.event_ids) with ordinality o(id, ord) "
            "join pgstream.events e on e.id = o.id and e.stream_id = b.stream_id "
            "where b.stream_id = %s order by b.id, o.ord", [stream_id]).fetchall()


def _delivered(url: str, stream_id: int, expected: int) -> bool:
    with psycopg.connect(url) as c:
        row = c.execute("select count(*) filter (where status <> %s), coalesce(sum(event_count), 0) "
                        "from pgstream.batches where stream_id = %s", [BatchStatus.DELIVERED, stream_id]).fetchone()
    return row == (0, expected)


def test_events_are_routed_by_computed_metadata_to_redis_streams_and_nats_subjects(
        db_url: str, tmp_path: Path, instance: dg.DagsterInstance, nats_stream: tuple[str, str],
        redis_prefix: tuple[redis.Redis, str]) -> None:
    stream_name, subject = nats_stream
    client, prefix = redis_prefix
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create table public.orders (id bigserial primary key, country text not null, amount int)")
    fast = {"batch": {"max_size": 25, "max_fill_secs": 0}, "sensor": {"tick_budget_secs": 0.5},
            "delivery": {"chunk_size": 10}}
    cfg = write_config(tmp_path / "pgstream.yaml", db_url, [
        {"id": 1, **fast, "sink": {"type": "redis", "url": REDIS_URL, "stream_from": "metadata:region",
                                   "stream_prefix": prefix}},
        {"id": 2, **fast, "sink": {"type": "nats", "servers": [NATS_URL], "subject_from": "metadata:route.region",
                                   "subject_prefix": subject + "."}},
    ], [
        {"key": "orders-to-redis", "stream_id": 1, "operation": "INSERT", "table_name": "orders",
         "column_names": ["id", "country"], "metadata": {"team": "sales"},
         "metadata_extensions": [{"json_path": "region", "expression": REGION}]},
        {"key": "orders-to-nats", "stream_id": 2, "operation": "INSERT", "table_name": "orders",
         "column_names": ["id", "country"], "trigger_mode": "statement", "metadata": {"route": {"kind": "order"}},
         "metadata_extensions": [{"json_path": "route.region", "expression": REGION},
                                 {"json_path": "amount", "expression": "new.amount"}]},
    ])
    driver = Driver(cfg, instance)
    # the subscription assets apply the YAML, as the subscriptions sensor would have them do
    config = load_config(cfg)
    keys = [k for s in (1, 2) for k in [*subscription_keys(config, s).values(), subscription_set_key(s)]]
    assert materialize(driver.defs, instance, keys).success
    for stream_id in (1, 2):
        driver.tick(stream_id)  # creates the slot

    rows = _workload(db_url)
    for stream_id in (1, 2):
        driver.run_until(stream_id, lambda s=stream_id: _delivered(db_url, s, rows))  # type: ignore[misc]

    with psycopg.connect(db_url) as c:
        countries: dict[Any, Any] = dict(c.execute("select id, country from public.orders").fetchall())
        assert len(countries) == rows
    for stream_id in (1, 2):
        ledger = _ledger(db_url, stream_id)
        assert len(ledger) == rows and len({i for i, _ in ledger}) == rows  # every order, once

    # Redis: one stream per region, each in commit order, nothing else under the prefix
    ledger = _ledger(db_url, 1)
    regions = {m["region"] for _, m in ledger}
    assert regions == {"eu", "us"} and {m["team"] for _, m in ledger} == {"sales"}
    assert sorted(client.keys(prefix + "*")) == [f"{prefix}eu".encode(), f"{prefix}us".encode()]
    for region in ("eu", "us"):
        entries = stream_entries(client, prefix + region)
        expected = [i for i, m in ledger if m["region"] == region]
        assert [int(f[b"id"]) for _, f in entries] == expected
        for _, fields in entries:
            payload, metadata = json.loads(fields[b"payload"]), json.loads(fields[b"metadata"])
            assert metadata == {"team": "sales", "region": region}
            assert (payload["new"]["country"] in ("DE", "FR", "IT")) == (region == "eu")
    assert sum(client.xlen(prefix + r) for r in ("eu", "us")) == rows

    # NATS: one subject per region, each in commit order
    ledger = _ledger(db_url, 2)
    count, messages = asyncio.run(nats_admin("read", stream_name, ">", expected=rows))
    assert count == len(messages) == rows
    for region in ("eu", "us"):
        got = [int(m.headers["Nats-Msg-Id"]) for m in messages if m.subject == f"{subject}.{region}"]
        assert got == [i for i, m in ledger if m["route"]["region"] == region]
    for m in messages:
        metadata = json.loads(m.headers["Pgstream-Metadata"])
        country = countries[json.loads(m.data)["new"]["id"]]
        region = "eu" if country in ("DE", "FR", "IT") else "us"
        assert m.subject == f"{subject}.{region}"
        assert metadata == {"route": {"kind": "order", "region": region}, "amount": metadata["amount"]}
    assert {m.subject for m in messages} == {f"{subject}.eu", f"{subject}.us"}


def test_by_key_routing_key_may_come_from_the_metadata(db_url: str) -> None:
    """``delivery.routing_key: metadata:<path>`` partitions by the metadata (ordering: by_key), a bare
    path by the payload, as the Spark readers select it."""
    from pyspark.sql.datasource import InputPartition

    from pgstream_dagster.engine.spark import URL_OPTION, EventsReader

    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id) values (1)")
        c.execute("insert into pgstream.events (payload, metadata, stream_id) values (%s, %s, 1), (%s, null, 1)",
                  [Jsonb({"group_id": "g1", "metadata": {"t": "p"}}), Jsonb({"t": "eu"}), Jsonb({"group_id": "g2"})])
        (lo, hi) = c.execute("select min(id), max(id) from pgstream.events").fetchone()  # type: ignore[misc]

    def keys(routing_key: str) -> list[str | None]:
        reader = EventsReader({URL_OPTION: db_url, "ranges": json.dumps([[lo, hi]]), "stream_id": "1",
                               "routing_key": routing_key})
        return [row[-1] for row in reader.read(InputPartition((lo, hi)))]

    assert keys("metadata:t") == ["eu", None]
    assert keys("metadata.t") == ["p", None]  # a bare path: the payload's "metadata" object
    assert keys("group_id") == keys("payload:group_id") == ["g1", "g2"]
