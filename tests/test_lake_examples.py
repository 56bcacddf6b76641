"""The worked example of each lake page (docs/lake/*.md) as a user follows it: its `pgstream.yaml` applied by
`init` (the `orders` table subscribed), orders inserted, their events published by the page's sink as a
delivery round publishes them, then the page's reading snippet run as written in a Python of its own. Only
the page's placeholders are filled in: `/data/lake/` is a test directory, and the Iceberg catalog's
`postgresql+psycopg2://lake:…@db:5432/lake_catalog` (and `LAKE_CATALOG_URL`) a catalog database here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pgstream_dagster.config import load_config
from pgstream_dagster.devdb import LocalPostgres
from pgstream_dagster.engine.bootstrap import init
from pgstream_dagster.engine.publish import publish
from pgstream_dagster.sinks import Event, build_sink
from pgstream_dagster.sinks.base import psycopg2_url
from pgstream_dagster.sinks.lake import token

from .support.dagster_dev import repo_root
from .support.sinks import drain, unique

PAGES = sorted(p.stem for p in (repo_root() / "docs" / "lake").glob("*.md"))
CATALOG_PLACEHOLDER = "postgresql+psycopg2://lake:…@db:5432/lake_catalog"
ORDERS = 3


def _block(text: str, language: str) -> str:
    found: list[str] = re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)
    assert len(found) == 1, f"one {language} block in the worked example, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("page", PAGES)
def test_a_lake_pages_worked_example_lands_the_orders_and_its_snippet_reads_them(
        page: str, db_url: str, pg: LocalPostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert PAGES == ["delta", "iceberg", "parquet"]
    text = (repo_root() / "docs" / "lake" / f"{page}.md").read_text()
    lake = tmp_path / "lake"
    catalog = unique("lake_catalog").replace("-", "_")
    pg.create_database(catalog)
    monkeypatch.setenv("PGSTREAM_DATABASE_URL", db_url)
    monkeypatch.setenv("LAKE_CATALOG_URL", pg.url_for(catalog))
    config = tmp_path / "pgstream.yaml"
    config.write_text(_block(text, "yaml").replace("/data/lake/", f"{lake}/"))

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("create table public.orders (id bigint primary key, customer_id bigint not null, "
                     "amount numeric(10, 2) not null, placed_at timestamptz not null default now())")
    init(config)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("insert into public.orders (id, customer_id, amount) "
                     "select i, 100 + i, i * 9.99 from generate_series(1, %s) i", [ORDERS])
        rows = conn.execute("select id, stream_id, payload::text, metadata::text, created_at from pgstream.events "
                            "where stream_id = 1 order by id").fetchall()
    assert len(rows) == ORDERS
    events = [Event(i, s, payload_json=p, metadata_json=m, created_at=c) for i, s, p, m, c in rows]
    stream = load_config(config).streams[0]
    with build_sink(stream.sink) as sink:  # one round of batch 1, as a delivery run publishes it
        assert drain(publish(sink, ((1, n, e) for n, e in enumerate(events, 1)), stream.delivery.chunk_size)) \
            == ORDERS

    snippet = _block(text, "python").replace("/data/lake/", f"{lake}/")
    snippet = snippet.replace(CATALOG_PLACEHOLDER, psycopg2_url(pg.url_for(catalog)))
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = done.stdout.split()
    last = str(token(1, ORDERS))  # the stream's last position: batch 1, its third event
    if page == "parquet":  # duckdb's table of days and counts: today's, three orders
        assert re.search(rf"│\s+{ORDERS}\s+│", done.stdout), done.stdout
    elif page == "iceberg":  # the INSERT rows, then the position
        assert printed[-2:] == [str(ORDERS), last], done.stdout
    else:  # the table's counts per day, then the position
        assert str(ORDERS) in done.stdout and printed[-1] == last, done.stdout
