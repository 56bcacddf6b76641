"""Failover of the Postgres primary (issue 46): a real primary and a streaming standby made by
``pg_basebackup`` (tests/support/standby.py), the streams reading through a libpq multi-host URL with
``target_session_attrs=read-write``, a trickle of rows on two streams (one through a subscription's
generated trigger, one of events inserted directly) to an HTTP sink sending one event per request,
kill -9 of the primary mid-trickle, the standby promoted, the application writing on.

Counted end to end against what the new primary holds: none of its events lost, its ledger holds each
once, first deliveries in its commit order, and no event id delivered for two different rows (the
sink's ``webhook-id``, which docs/sinks.md tells consumers to deduplicate by). Events the sink got that
the new primary lacks (phantoms) are inherent to asynchronous replication: counted, and with
synchronous replication there are none. Each test prints an ``HA {...}`` line.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from pgstream_dagster.cli import main as cli_main
from pgstream_dagster.config import HousekeepingConfig
from pgstream_dagster.engine import housekeeping, spark_source, status
from pgstream_dagster.engine.ledger import state as ledger_state
from pgstream_dagster.engine.migrations import migrate
from pgstream_dagster.sinks import build_sink
from pgstream_dagster.sinks import parquet as parquet_module
from pgstream_dagster.sinks.lake import LakeSink

from .support.faults import start, stream_config
from .support.harness import Driver, write_config
from .support.http_recorder import HttpRecorder
from .support.lake import lake_ids
from .support.standby import StandbyPair

STREAMS = (1, 2)  # 1: rows of public.items through the generated trigger; 2: events inserted directly
LAKE_STREAM = 3  # events inserted directly, to a lake sink
SLOTS = 1  # the two streams' slot: their reader group's (default)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandbyPair]:
    """One primary for the module; each test adds a standby and promotes it (the pair rolls)."""
    servers = StandbyPair(tmp_path_factory.mktemp("ha"))
    yield servers
    servers.destroy()


def _database(pair: StandbyPair, name: str) -> str:
    """A migrated database on the primary with the two streams, replicated; its multi-host URL."""
    pair.primary.create_database(name)
    url = pair.primary.url_for(name)
    migrate(url)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("create table public.items (id bigserial primary key, tag text not null)")
        c.execute("insert into pgstream.streams (id) values (1), (2), (3) on conflict do nothing")
        c.execute("insert into pgstream.subscriptions (key, stream_id, operation, table_name, column_names) "
                  "values ('items', 1, 'INSERT', 'items', '{tag}')")
    pair.catch_up()
    return pair.url_for(name)


class SourceQuery:
    """A streaming query of the Spark source on a stream, driven as Spark's micro-batch loop drives its reader
    (latestOffset, partitions, read, commit), in a thread, through the multi-host URL: a micro-batch that fails
    (the server gone) is run again by a new reader from the last committed offset, as a query restarted on its
    checkpoint is. ``read``: every event id read, in order, repeats included."""

    def __init__(self, url: str, stream: int) -> None:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("select pgstream.register_consumer('ha.query', %s, true, 30)", [stream])
            (token,) = c.execute("select pgstream.consumer_token('ha.query')").fetchone()  # type: ignore[misc]
        self.options = {"url": url, "stream": str(stream), "consumer": "ha.query", "consumerToken": token,
                        "maxEventsPerTrigger": "50"}
        self.read: list[int] = []
        self.restarts = 0
        self.warnings: list[str] = []  # what the source logged (that it went on from the consumer's position)
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.warnings.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger(spark_source.__name__).addHandler(self.handler)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        reader: spark_source.StreamReader | None = None
        committed: dict[str, int] | None = None
        while not self.stop.is_set():
            try:
                if reader is None:
                    reader = spark_source.StreamReader(self.options)
                    committed = committed or reader.initialOffset()
                assert committed is not None
                end = reader.latestOffset(committed, reader.getDefaultReadLimit())
                got = [i for part in reader.partitions(committed, end) for batch in reader.read(part)
                       for i in batch.column("id").to_pylist()]
                self.read.extend(got)
                reader.commit(end)
                committed = end
                time.sleep(0.05)
            except (psycopg.Error, spark_source.SourceError):
                if reader is not None:
                    reader.stop()
                reader = None
                self.restarts += 1
                time.sleep(0.2)
        if reader is not None:
            reader.stop()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)
        logging.getLogger(spark_source.__name__).removeHandler(self.handler)
        assert not self.thread.is_alive()


class Writer:
    """The application: one row at a time, each stream of ``streams`` in turn (stream 1: a row of items, the
    others an event inserted directly), each in its own transaction, through the multi-host URL; reconnects when
    the server goes away. ``committed``: the tags whose commit the server acknowledged."""

    def __init__(self, url: str, streams: tuple[int, ...] = STREAMS) -> None:
        self.url = url
        self.streams = streams
        self.committed: list[str] = []
        self.committed_at: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        conn: psycopg.Connection | None = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.url, autocommit=True)
                tag = f"r{n}"
                stream = self.streams[n % len(self.streams)]
                if stream == 1:
                    conn.execute("insert into public.items (tag) values (%s)", [tag])
                else:
                    conn.execute("insert into pgstream.events (payload, stream_id) "
                                 "values (jsonb_build_object('tag', %s::text), %s)", [tag, stream])
                self.committed.append(tag)
                self.committed_at[tag] = time.monotonic()
                n += 1
                time.sleep(0.01)
            except psycopg.OperationalError:
                conn = None
                n += 1  # the fate of that row is unknown: its tag is not used again
                time.sleep(0.1)
        if conn is not None:
            conn.close()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def _delivered(recorder: HttpRecorder) -> list[tuple[int, str, float]]:
    """(event id, the row's tag, arrival) of every request the sink got, in arrival order."""
    with recorder.lock:
        received = list(recorder.received)
    return [(int(r.headers["webhook-id"]), _tag(r.body.get("payload", r.body)), r.at) for r in received]


def _tag(payload: dict[str, Any]) -> str:
    """The row's tag: in the row of a subscription's event (``new``), or in an event inserted directly."""
    return str((payload.get("new") or payload)["tag"])


def _held(url: str) -> dict[int, tuple[int, str]]:
    """The new primary's events: id -> (stream, tag)."""
    with psycopg.connect(url) as c:
        return {i: (s, _tag(p)) for i, s, p in c.execute("select id, stream_id, payload from pgstream.events")}


def _received(recorder: HttpRecorder, stream: int) -> list[int]:
    """The event ids of ``stream`` the webhook received (its X-Pgstream-Stream-Id header)."""
    with recorder.lock:
        return [int(r.headers["webhook-id"]) for r in recorder.received
                if r.headers.get("x-pgstream-stream-id") == str(stream)]


def _reconcile(tmp_path: Path, stream: int, received: list[int] | None = None) -> list[int]:
    """The phantoms ``pgstream-dagster reconcile`` lists for ``stream`` (from ``received``, else its lake table)."""
    args = ["reconcile", str(stream), "--config", str(tmp_path / "pgstream.yaml")]
    if received is not None:
        (tmp_path / "received.txt").write_text("\n".join(map(str, received)))
        args += ["--received", str(tmp_path / "received.txt")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(args) == 0
    said = [line for line in out.getvalue().splitlines() if "missing from this database" in line]
    assert len(said) == 1, out.getvalue()
    listed = said[0].partition("(phantoms of the failover)")[2].lstrip(": ")
    return sorted(int(i) for i in listed.split(", ") if i)


def _lake_token(lake: dict[str, Any]) -> int | None:
    sink = build_sink(lake)
    assert isinstance(sink, LakeSink)
    with sink:
        return sink.read_token(LAKE_STREAM)


def _lake_checks(url: str, lake: dict[str, Any], token: int | None, promoted: float) -> dict[str, Any]:
    """Every event of the lake stream the new primary holds is in the table once; what else the table has of
    the stream (phantoms) counted, and the new primary's batches at positions up to the table's token as the old
    primary died (ledger positions handed out again: the sink must not take them for committed)."""
    with psycopg.connect(url) as c:
        ids = {int(r[0]) for r in c.execute("select id from pgstream.events where stream_id = %s", [LAKE_STREAM])}
        again = c.execute("select count(*) from pgstream.batches where stream_id = %s and id <= %s "
                          "and created_at > now() - make_interval(secs => %s)",
                          [LAKE_STREAM, (token or 0) >> 32, time.monotonic() - promoted]).fetchone()
    counted = lake_ids(lake, LAKE_STREAM)
    assert ids <= set(counted), f"missing from the lake: {sorted(ids - set(counted))[:20]}"
    assert all(counted[i] == 1 for i in ids), "an event twice in the lake"
    assert again is not None
    return {"lake_events": len(ids), "lake_phantoms": len(set(counted) - ids),
            "lake_positions_handed_out_again": int(again[0])}


def _run_keys(url: str, since: float | None = None) -> set[str]:
    """The run keys in the ledger (with ``since``, a ``time.monotonic()``: those first launched after it, not the
    open runs that went on across it)."""
    with psycopg.connect(url) as c:
        ago = None if since is None else time.monotonic() - since
        return {r[0] for r in c.execute("select run_key from pgstream.batches where run_key is not null group by "
                                        "run_key having %s::float8 is null "
                                        "or min(launched_at) > now() - make_interval(secs => %s)", [ago, ago])}


def _ledger(url: str, stream: int) -> list[int]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("select unnest(event_ids) from pgstream.batches where stream_id = %s "
                                        "order by id", [stream])]


def _drive(driver: Driver, done: Any, timeout: float = 240, lacking: Any = None) -> list[str]:
    """Tick both streams and execute what they ask for until ``done()``, as the daemon would through the
    failover; returns the skip reasons of the ticks that waited for the database. ``lacking()`` says, should
    they not catch up, what they lack."""
    deadline = time.monotonic() + timeout
    waited: list[str] = []
    while not done():
        assert time.monotonic() < deadline, f"the streams did not catch up in time: {lacking and lacking()}"
        for stream in STREAMS:
            tick = driver.tick(stream)  # a tick that loses its server says so in one line, raises nothing
            said = tick.skip_message or ""
            if "waiting for" in said or "cannot connect" in said:
                waited.append(said)
                time.sleep(0.2)
            for request in tick.run_requests:
                driver.execute(request)
        time.sleep(0.02)
    return waited


def _failures(driver: Driver) -> list[str]:
    """The failure messages of the runs that failed."""
    return [f"{error.cls_name}: {error.message.strip()}" for result in driver.results if not result.success
            for event in result.all_events if event.event_type_value == "STEP_FAILURE"
            if (error := event.step_failure_data.error) is not None]


def _fail_over_under_trickle(pair: StandbyPair, name: str, tmp_path: Path, instance: dg.DagsterInstance,
                             recorder: HttpRecorder, lagging: bool, held_back: bool = False,
                             before_kill: Any = None, lake: dict[str, Any] | None = None,
                             spark_read: bool = False) -> dict[str, Any]:
    """The trickle, kill -9 of the primary once 150 events went out (with ``lagging``: the standby cut off
    after 100, and 20 events written after that delivered, which it never gets; with ``held_back`` as well,
    the primary's decoding waits for the standby: 1 s of writes it never gets), promotion, 2 s of writes
    on the new primary; every check that holds in each mode. With ``lake`` (a lake sink's config), stream 3
    (events inserted directly) writes to it: every event the new primary holds in the table once. With
    ``spark_read``, a streaming query of the Spark source reads stream 2 throughout (:class:`SourceQuery`): it
    reads every event the new primary holds. Returns what was counted."""
    url = _database(pair, name)
    configs = [stream_config({"type": "http", "url": recorder.url, "mode": "per_event", "max_attempts": 1,
                              "timeout_secs": 10}, id=stream) for stream in STREAMS]
    streams = STREAMS + ((LAKE_STREAM,) if lake is not None else ())
    if lake is not None:
        configs.append(stream_config(lake, id=LAKE_STREAM))
    driver = Driver(write_config(tmp_path / "pgstream.yaml", url, configs), instance)
    start(driver, streams)  # the group's slot
    writer = Writer(url, streams)
    query = SourceQuery(url, 2) if spark_read else None
    promoted: list[float] = []
    lake_token: list[int | None] = []  # the lake's token (a ledger position) as the primary is killed
    old_keys: set[str] = set()  # the run keys of the old primary's ledger as it is killed

    phase = ["the first 100 deliveries"]  # where the fault's thread is (said should the streams not catch up)

    def fault() -> None:
        def sent(n: int, since: float = 0) -> bool:
            return sum(writer.committed_at.get(t, 0) > since for _i, t, _a in _delivered(recorder)) >= n
        while not sent(100):
            time.sleep(0.02)
        if before_kill is not None:
            before_kill()  # (the standby has synchronized the slots)
        if lagging:
            pair.cut_off_standby()
            cut_off = time.monotonic()
            phase.append("40 deliveries after the standby's cut-off")
            # rows the standby never got, delivered: more than the 32 values a sequence logs ahead, so the
            # new primary's sequence resumes below some of their ids
            while not held_back and not sent(40, since=cut_off):
                time.sleep(0.02)
            if lake is not None:  # and a lake position the standby's ledger lacks, written to the table
                assert pair.standby is not None
                with psycopg.connect(pair.standby.url_for(name)) as s:
                    kept = s.execute("select coalesce(max(id), 0) from pgstream.batches where stream_id = %s",
                                     [LAKE_STREAM]).fetchone()
                assert kept is not None
                phase.append("the lake's token past the standby's ledger")
                # past the batch ids the new primary's sequence hands out first (it logs 32 values ahead): it
                # names again positions the table's token passed
                _wait_for(lambda: ((_lake_token(lake) or 0) >> 32) > kept[0] + 64, timeout=60)
        if held_back:
            time.sleep(1)  # rows the standby never gets: held back from the sink
        phase.append("150 deliveries")
        while not held_back and not sent(150):
            time.sleep(0.02)
        if lake is not None:
            lake_token.append(_lake_token(lake))
        old_keys.update(_run_keys(pair.primary.url_for(name)))
        phase.append("the promotion")
        promoted.append(pair.fail_over())
        phase.append("2 s of writes on the new primary")
        time.sleep(2)
        writer.finish()
        phase.append("done")

    failed: list[BaseException] = []  # what the fault's thread raised (raised here)

    def faulting_thread() -> None:
        try:
            fault()
        except BaseException as exc:
            failed.append(exc)
    faulting = threading.Thread(target=faulting_thread, daemon=True)
    faulting.start()
    try:
        def caught_up() -> bool:
            if failed:
                raise failed[0]
            if faulting.is_alive():
                return False
            held = _held(pair.url_for(name))
            in_lake = {i for i, (s, _t) in held.items() if s == LAKE_STREAM}
            return {i for i, (s, _t) in held.items() if s in STREAMS} <= {i for i, _t, _a in _delivered(recorder)} \
                and (lake is None or in_lake <= set(lake_ids(lake, LAKE_STREAM))) \
                and (query is None or {i for i, (s, _t) in held.items() if s == 2} <= set(query.read))
        def lacking() -> dict[str, Any]:
            try:
                held = _held(pair.url_for(name))
            except psycopg.Error as exc:
                return {"fault at": phase[-1], "held": str(exc)}
            got = {i for i, _t, _a in _delivered(recorder)}
            said = {f"stream {s}": sorted(i for i, (t, _g) in held.items() if t == s and i not in got)[:10]
                    for s in STREAMS}
            if lake is not None:
                said["lake"] = sorted(set(i for i, (s, _t) in held.items() if s == LAKE_STREAM)
                                      - set(lake_ids(lake, LAKE_STREAM)))[:10]
            if query is not None:
                said["spark query"] = sorted({i for i, (s, _t) in held.items() if s == 2} - set(query.read))[:10]
            return {"fault at": phase[-1], **said}
        waited = _drive(driver, caught_up, lacking=lacking)
    finally:
        writer.stop.set()
        if query is not None:
            query.finish()
    faulting.join(5)
    new = pair.url_for(name)
    held = {i: row for i, row in _held(new).items() if row[0] in STREAMS}
    delivered = _delivered(recorder)
    lake_counts: dict[str, Any] = {}
    if lake is not None:
        lake_counts = _lake_checks(new, lake, lake_token[0], promoted[0])
    if query is not None:  # every event of the new primary read; some twice (at least once across the failover)
        assert {i for i, (s, _t) in held.items() if s == 2} <= set(query.read)
        lake_counts.update({"spark_read": len(set(query.read)), "spark_restarts": query.restarts,
                            "spark_read_again": len(query.read) - len(set(query.read)),
                            "spark_warnings": [w[:80] for w in query.warnings]})
    rows_of: dict[int, set[str]] = {}
    for event_id, tag, _at in delivered:
        rows_of.setdefault(event_id, set()).add(tag)
    # no id delivered for two different rows: a consumer deduplicating by webhook-id drops nothing
    assert {i: t for i, t in rows_of.items() if len(t) > 1} == {}
    # none of the new primary's events lost, and each delivered as the row it is
    assert set(held) <= set(rows_of), f"lost: {sorted(set(held) - set(rows_of))[:20]}"
    assert all(rows_of[i] == {tag} for i, (_s, tag) in held.items())
    for stream in STREAMS:
        order = _ledger(new, stream)
        assert len(order) == len(set(order)), "an event twice in the ledger"
        assert set(order) == {i for i, (s, _t) in held.items() if s == stream}
        recorded = set(order)
        first = list(dict.fromkeys(i for i, _t, _a in delivered if i in recorded))
        assert first == order, f"stream {stream}: first deliveries out of commit order"
    # no run key of the old primary named again: the new primary's ledger hands out again batch ids the old one
    # used, and Dagster launches a run key once and finds runs by it (a key named again stood for the old run)
    assert old_keys and not old_keys & _run_keys(new, since=promoted[0])
    with psycopg.connect(new) as c:
        prefixes = {f"pgstream-s{s}-{ledger_state.stream_state(c, s, 1).incarnation}-" for s in streams}
    assert not [k for k in old_keys if k.startswith(tuple(prefixes))], prefixes
    # the outage in one line: a tick that lost its server said so (it raised nothing: _drive); the group's delivery
    # run rode it out (said in one line, its lease taken again on the new primary, its members hosted again): no
    # run failed, no fresh one was needed
    failures = _failures(driver)
    assert failures == [] and len(driver.group_runs["default"]) == 1, (failures, driver.group_runs)
    phantoms = sorted(set(rows_of) - set(held))
    # reconciliation: `pgstream-dagster reconcile` lists each stream's phantoms from the ids its webhook received,
    # and reads a lake table's itself
    for stream in STREAMS:
        got = _received(recorder, stream)
        assert _reconcile(tmp_path, stream, got) == sorted(set(got) - set(held))
    if lake is not None:
        assert len(_reconcile(tmp_path, LAKE_STREAM)) == lake_counts["lake_phantoms"]
    new_ids = [i for i, (_s, t) in held.items() if writer.committed_at.get(t, 0) > promoted[0]]
    assert new_ids, "nothing was written on the new primary"
    # the new primary's ids lie above every id delivered before it was promoted
    assert min(new_ids) > max(i for i, _t, at in delivered if at < promoted[0])
    # ...though its sequence resumed from what the standby had replayed: the ids the old primary delivered
    # that the sequence's part of a new id (sql/031_event_ids_per_timeline.sql) would have named again
    sequence_part = (1 << 48) - 1
    reused_without_timeline = [i for i in phantoms if i & sequence_part >= min(new_ids) & sequence_part]
    # the first row written on the new primary, from its promotion to its delivery (reported, not asserted)
    written_after = {t for t, at in writer.committed_at.items() if at >= promoted[0]}
    first_after_promotion = min((at for _i, t, at in delivered if t in written_after), default=None)
    mode = ("async, standby lagging" if lagging else "sync") + (", failover slots" if held_back else "")
    counts = {"mode": mode, "committed": len(writer.committed),
              "held": len(held), "delivered": len(rows_of), "phantoms": len(phantoms),
              "acknowledged_but_lost": len(set(writer.committed) - {t for _s, t in held.values()}),
              "duplicates": len(delivered) - len(rows_of),
              "ids_a_plain_sequence_would_reuse": len(reused_without_timeline),
              "first_new_event_secs": None if first_after_promotion is None
              else round(first_after_promotion - promoted[0], 1), "runs_failed": len(failures),
              "ticks_waiting": len(waited), **lake_counts}
    print("HA " + json.dumps(counts))
    return counts


def test_async_standby_lagging_at_the_kill_reuses_no_delivered_id(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Also a Parquet sink (stream 3): its exactly-once token is a ledger position, and the new primary's ledger
    hands out again positions the old one had (batch ids resume from what the standby replayed): the sink writes
    what the table lacks of them by id, so none of the new primary's events is missing from the table. And a
    streaming query of the Spark source on stream 2, whose checkpoint offset the new primary's ledger does not
    hold: it goes on from its consumer's recorded position and reads every event of the new primary.
    The lake stream's first write after the standby is cut off fails once: its member run's retry (another run
    key) is one the new primary never hears of, which wants the earlier run again: the group run hosts it."""
    pair.add_standby(synchronous=False)
    failing = threading.Event()
    real_replace, real_cut_off = parquet_module._replace, pair.cut_off_standby

    def replace(tmp: Path, final: Path) -> None:
        if failing.is_set():
            failing.clear()
            raise OSError(f"injected after the cut-off: {final.name}")
        real_replace(tmp, final)

    def cut_off() -> None:
        real_cut_off()
        failing.set()
    monkeypatch.setattr(parquet_module, "_replace", replace)
    monkeypatch.setattr(pair, "cut_off_standby", cut_off)
    counts = _fail_over_under_trickle(pair, "ha_async", tmp_path, instance, http_server, lagging=True,
                                      lake={"type": "parquet", "path": str(tmp_path / "lake")}, spark_read=True)
    assert not failing.is_set(), "no lake write failed after the cut-off"
    # the standby was cut off before the last deliveries: the sink got events the new primary lacks, and
    # the new primary's sequence resumed below their ids
    assert counts["phantoms"] > 0 and counts["ids_a_plain_sequence_would_reuse"] > 0
    # the new primary's ledger named again, for its own events, positions the table's token had passed
    assert counts["lake_positions_handed_out_again"] > 0
    # and the query's offset named a position the new primary's ledger does not hold: it went on from its consumer's
    assert any("the ledger no longer holds event" in w for w in counts["spark_warnings"]), counts["spark_warnings"]


def test_async_standby_with_failover_slots_lagging_at_the_kill_delivers_no_phantom(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder) -> None:
    """Failover slots (Postgres 17+): pgstream's slots are created with failover => true, the standby
    synchronizes them, and the primary's decoding of them waits for the standby (synchronized_standby_slots):
    cut off, the standby holds the primary's deliveries back; nothing went out that the new primary lacks.
    After the promotion the group's reader takes the synchronized slot (the ledger the standby holds was recorded
    through its position: migration 034) and reads nothing back from the table."""
    standby = pair.add_standby(synchronous=False, failover_slots=True)
    with psycopg.connect(standby.url, autocommit=True) as s, psycopg.connect(pair.primary.url, autocommit=True) as p:
        def synchronized() -> bool:
            # a standby's copy is temporary (dropped at a promotion) until the primary's slot has moved its
            # restart_lsn past where the copy began: a running-transactions record lets the decoding move it
            p.execute("select pg_log_standby_snapshot()")
            return s.execute("select count(*) from pg_replication_slots where synced and not temporary and "
                             "database = 'ha_slots'").fetchone() == (SLOTS,)
        counts = _fail_over_under_trickle(pair, "ha_slots", tmp_path, instance, http_server, lagging=True,
                                          held_back=True, before_kill=lambda: _wait_for(synchronized, timeout=60))
    assert counts["phantoms"] == 0
    with psycopg.connect(pair.url_for("ha_slots")) as c:
        # the synchronized copy, taken (still marked synced on the new primary), and no recovery from the table
        assert c.execute("select count(*) from pg_replication_slots where database = 'ha_slots' and failover "
                         "and synced").fetchone() == (SLOTS,)
        assert c.execute("select count(*) from pgstream.batches where kind = 'recovery'").fetchone() == (0,)


def test_sync_standby_loses_no_acknowledged_row_and_delivers_no_phantom(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder) -> None:
    pair.add_standby(synchronous=True)
    counts = _fail_over_under_trickle(pair, "ha_sync", tmp_path, instance, http_server, lagging=False)
    assert counts["phantoms"] == 0
    assert counts["acknowledged_but_lost"] == 0



def test_an_event_committed_but_not_yet_visible_during_a_recovery_is_recorded_from_the_slot(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder) -> None:
    """A recovery from the table (after a promotion, a slot lost or created) reads the events no batch covers
    with a snapshot, while the slot decodes what commits. A transaction whose commit is in the WAL before that
    snapshot but not yet visible to it (its backend has not left the proc array; with synchronous replication
    it waits for the standby in between) is not in the recovery: the slot's batch must keep it. Held there by
    a synchronous standby that never answers (for that session only: the others commit locally)."""
    pair.primary.create_database("ha_visible")
    url = pair.primary.url_for("ha_visible")
    migrate(url)
    driver = Driver(write_config(tmp_path / "pgstream.yaml", url, [stream_config(
        {"type": "http", "url": http_server.url, "mode": "per_event", "max_attempts": 1}, id=2)]), instance)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("insert into pgstream.streams (id) values (2) on conflict do nothing")
        c.execute("alter database ha_visible set synchronous_commit = local")
    start(driver, (2,))  # the group's slot
    _synchronous_standby(pair, "nobody")
    held = psycopg.connect(url, autocommit=True)
    try:
        held.execute("set synchronous_commit = on")
        pid = held.info.backend_pid
        writing = threading.Thread(target=lambda: held.execute(
            "insert into pgstream.events (payload, stream_id) values ('{\"tag\": \"held\"}', 2)"), daemon=True)
        writing.start()
        with psycopg.connect(url, autocommit=True) as c:
            _wait_for(lambda: c.execute("select wait_event from pg_stat_activity where pid = %s", [pid]).fetchone()
                      == ("SyncRep",))
            # an event committed after it, visible: the recovery records it, at a WAL position past the held one
            c.execute("insert into pgstream.events (payload, stream_id) values ('{\"tag\": \"visible\"}', 2)")
            # as after a promotion (the group's slot replaced): the group's members recover from the table
            c.execute("update pgstream.reader_groups set recovery_pending = true where name = 'default'")

            def recovered() -> bool:  # the recovery (the held event not visible to it), then the slot (both decoded)
                driver.tick(2)  # (the group delivery run's reader recovers, at its next read, or this tick)
                return c.execute("select count(*) from pgstream.batches where kind = 'recovery'").fetchone() == (1,)
            _wait_for(recovered, timeout=30)
            c.execute("select pg_cancel_backend(%s)", [pid])  # the wait ends: committed locally, visible now
            writing.join(10)

            def recorded() -> bool:
                driver.tick(2)
                return c.execute("select count(*) from pgstream.batches b join pgstream.events e "
                                 "on e.id = any(b.event_ids) where b.stream_id = 2").fetchone() == (2,)
            _wait_for(recorded, timeout=20)  # each event once in the ledger
    finally:
        held.close()
        _synchronous_standby(pair, "")


def test_switchover_and_back_twice_loses_nothing_and_leaves_no_slot_holding_wal(
        pair: StandbyPair, tmp_path: Path, instance: dg.DagsterInstance, http_server: HttpRecorder) -> None:
    """Planned switchovers under the trickle, there and back twice: the primary shut down cleanly, the standby
    promoted, the old primary rewound (pg_rewind) into the new one's standby. pg_rewind keeps a server's slots, so
    the standby holds the group's slot as it was when it stopped being the primary: promoted again (the first
    time back), that slot is behind the one the ledger was recorded through (reader_groups.slot_lsn) and is
    replaced and the gap recovered from the table; before the second time back, housekeeping drops it on the
    standby (status.standby_slots, through the multi-host URL). Every event delivered once in the ledger, in
    commit order, none lost, no phantom, and no slot of pgstream's left on the standby or extra on the primary."""
    pair.add_standby(synchronous=False)
    url = _database(pair, "ha_switch")
    configs = [stream_config({"type": "http", "url": http_server.url, "mode": "per_event", "max_attempts": 1,
                              "timeout_secs": 10}, id=stream) for stream in STREAMS]
    driver = Driver(write_config(tmp_path / "pgstream.yaml", url, configs), instance)
    start(driver, STREAMS)
    writer = Writer(url)
    try:
        for n in range(4):
            if n == 2:  # the standby holds the group's slot of its time as the primary: housekeeping drops it there
                left = status.standby_slots(url)
                assert [(s["slot_name"], s["dropped"]) for s in left] == [(_group_slot(url), False)], left
                report = _housekeeping(url)
                assert report.standby_slots_dropped == [f"{_group_slot(url)} on {left[0]['server']}"]
                assert status.standby_slots(url) == []
            replayed = pair.switch_over()
            before = len(_delivered(http_server))
            _drive(driver, lambda b=before: len(_delivered(http_server)) >= b + 40)  # the new primary delivers
            # the group reads a slot created on the new primary: not the one it had as a standby (n = 1, 3)
            assert _slot_lsn(url) > replayed, f"switchover {n + 1}: the group's slot is the former primary's"
    finally:
        writer.finish()
    _drive(driver, lambda: set(_held(url)) <= {i for i, _t, _a in _delivered(http_server)})
    held, delivered = _held(url), _delivered(http_server)
    rows_of: dict[int, set[str]] = {}
    for event_id, tag, _at in delivered:
        rows_of.setdefault(event_id, set()).add(tag)
    assert all(rows_of.get(i) == {tag} for i, (_s, tag) in held.items())
    assert set(rows_of) == set(held), "phantoms: delivered, not on the primary"
    assert set(writer.committed) <= {t for _s, t in held.values()}, "an acknowledged row lost"
    for stream in STREAMS:
        order = _ledger(url, stream)
        assert len(order) == len(set(order)), "an event twice in the ledger"
        assert list(dict.fromkeys(i for i, _t, _a in delivered if i in set(order))) == order
    failures = _failures(driver)
    # the group's delivery run rode each switchover out (its lease taken again on the new primary, its members
    # hosted again): no run failed, no fresh one was needed
    assert failures == [] and len(driver.group_runs["default"]) == 1, (failures, driver.group_runs)
    _housekeeping(url)
    assert status.standby_slots(url) == []
    with psycopg.connect(url) as c:
        assert c.execute("select slot_name from pg_replication_slots where database = 'ha_switch'").fetchall() == [
            (_group_slot(url),)]
    print("HA " + json.dumps({"mode": "switchover and back, twice", "committed": len(writer.committed),
                              "held": len(held), "duplicates": len(delivered) - len(rows_of),
                              "runs_failed": len(failures)}))
    pair.remove_standby()


def _housekeeping(url: str) -> housekeeping.HousekeepingReport:
    with psycopg.connect(url, autocommit=True) as c:
        return housekeeping.run_housekeeping(c, HousekeepingConfig(), database_url=url)


def _group_slot(url: str) -> str:
    with psycopg.connect(url) as c:
        return str(c.execute("select slot from pgstream.reader_groups where name = 'default'").fetchone()[0])  # type: ignore[index]


def _slot_lsn(url: str) -> int:
    with psycopg.connect(url) as c:
        row = c.execute("select slot_lsn - '0/0' from pgstream.reader_groups where name = 'default'").fetchone()
    assert row is not None and row[0] is not None
    return int(row[0])


def _synchronous_standby(pair: StandbyPair, names: str) -> None:
    with psycopg.connect(pair.primary.url, autocommit=True) as admin:
        admin.execute(f"alter system set synchronous_standby_names = '{names}'")
        admin.execute("select pg_reload_conf()")


def _wait_for(done: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
