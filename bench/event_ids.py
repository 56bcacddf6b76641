"""What an event id that carries the WAL timeline costs a write (run by hand: `python bench/event_ids.py [ROUNDS]`).

``pgstream.events.id`` defaults to the sequence's value plus the timeline in the high bits
(sql/031_event_ids_per_timeline.sql), evaluated for every event a generated trigger writes. Baseline in
the same run: the sequence's value alone (the default before 031). One private Postgres (fsync off,
synchronous_commit off, so that commit latency does not hide the CPU cost), a table with one row-mode
INSERT subscription; per round and default (order alternated): ``BULK_REPS`` x INSERT ... SELECT of
``BULK_ROWS`` rows (median ms per statement) and ``SINGLE`` single-row INSERT transactions (mean us
per transaction over the round), and the default alone, evaluated ``EVALS`` times in one SELECT (ns per
evaluation). Medians over rounds, with their spread; results appended to bench/RESULTS.md.
"""

from __future__ import annotations

import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from bench.common import append_results, load_after, machine, spread
from pgstream_dagster.devdb import ensure_running
from pgstream_dagster.engine.migrations import migrate

HERE = Path(__file__).resolve().parent
BULK_ROWS = 10_000
BULK_REPS = 3
SINGLE = 2_000
EVALS = 200_000
BASELINE = "pg_catalog.nextval('pgstream.events_id_seq'::pg_catalog.regclass)"


def _setup(conn: psycopg.Connection) -> str:
    """The table and its subscription; returns the product's default of events.id (031's)."""
    conn.execute("create table public.orders (id bigserial primary key, customer text not null, amount numeric)")
    conn.execute("insert into pgstream.streams (id) values (1)")
    conn.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                 "values ('orders', 1, 'INSERT', 'orders', '{id,customer,amount}')")
    row = conn.execute("select pg_catalog.pg_get_expr(d.adbin, d.adrelid) from pg_catalog.pg_attrdef d "
                       "join pg_catalog.pg_attribute a on a.attrelid = d.adrelid and a.attnum = d.adnum "
                       "where d.adrelid = 'pgstream.events'::regclass and a.attname = 'id'").fetchone()
    assert row is not None and "pg_walfile_name" in row[0], row
    return str(row[0])


def _measure(conn: psycopg.Connection, default: str) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    conn.execute(f"select count({default}) from generate_series(1, {EVALS})")  # noqa: S608 - this file's and the catalog's
    eval_ns = (time.perf_counter() - t0) / EVALS * 1e9
    conn.execute(f"alter table pgstream.events alter column id set default {default}")
    bulk = []
    for _ in range(BULK_REPS):
        t0 = time.perf_counter()
        conn.execute("insert into public.orders (customer, amount) select 'c' || g, g from generate_series(1, %s) g",
                     [BULK_ROWS])
        bulk.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    for n in range(SINGLE):
        conn.execute("insert into public.orders (customer, amount) values (%s, %s)", ["one", n], prepare=True)
    single_us = (time.perf_counter() - t0) / SINGLE * 1e6
    conn.execute("truncate public.orders, pgstream.events")
    return statistics.median(bulk), single_us, eval_ns


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    header = machine()
    with tempfile.TemporaryDirectory(prefix="pgstream-ids-") as tmp:
        Path(tmp).chmod(0o755)
        pg = ensure_running(Path(tmp) / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off",
                                                              "full_page_writes": "off"})
        try:
            pg.create_database("bench")
            url = pg.url_for("bench")
            migrate(url)
            with psycopg.connect(url, autocommit=True) as conn:
                version = conn.execute("show server_version").fetchone()[0]  # type: ignore[index]
                defaults = {"sequence only (before 031)": BASELINE, "sequence + timeline (031)": _setup(conn)}
                bulk: dict[str, list[float]] = {k: [] for k in defaults}
                single: dict[str, list[float]] = {k: [] for k in defaults}
                evals: dict[str, list[float]] = {k: [] for k in defaults}
                for r in range(rounds):
                    for name in (list(defaults) if r % 2 == 0 else list(defaults)[::-1]):
                        b, s, e = _measure(conn, defaults[name])
                        bulk[name].append(b)
                        single[name].append(s)
                        evals[name].append(e)
                    print(f"round {r + 1}/{rounds}: bulk ms {[round(v[-1], 1) for v in bulk.values()]}, "
                          f"single us {[round(v[-1], 1) for v in single.values()]}", flush=True)
        finally:
            pg.destroy()
    base, new = list(defaults)
    lines = [f"## Event ids with the timeline (bench/event_ids.py) {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
             f"{rounds} rounds",
             f"{header}; PostgreSQL {version} (fsync off, synchronous_commit off). A table with one row-mode "
             f"INSERT subscription; per round and default of pgstream.events.id (order alternated): "
             f"{BULK_REPS}x INSERT ... SELECT of {BULK_ROWS:,} rows (median per round) and {SINGLE:,} single-row "
             f"INSERT transactions (mean per round), and the default alone evaluated {EVALS:,} times in a SELECT; "
             f"medians over rounds.", load_after()]
    for name in defaults:
        lines.append(f"- {name}: bulk {spread(bulk[name], '{:,.1f}')} ms, single-row {spread(single[name], '{:,.1f}')} "
                     f"us, the default alone {spread(evals[name], '{:,.0f}')} ns")
    med = {name: (statistics.median(bulk[name]), statistics.median(single[name]), statistics.median(evals[name]))
           for name in defaults}
    lines.append(f"- ratio 031 / before: bulk {med[new][0] / med[base][0]:.3f}x, single-row "
                 f"{med[new][1] / med[base][1]:.3f}x; the default alone +{med[new][2] - med[base][2]:,.0f} ns an event")
    text = "\n".join(lines) + "\n"
    print(text)
    append_results("\n" + text)


if __name__ == "__main__":
    main()
