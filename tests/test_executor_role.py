"""The Spark executors' role (``pgstream_executor``) as the attacker: every executor host holds its
credentials, so each test connects afresh as a login member of it and tries what one compromised host
could: forge or suppress another stream's event through a dead letter, move another consumer's
position, hold a lock that stalls every ``by_key`` run. What it may do (read, and write through the
owner's functions with a token it was given) is shown beside each attack."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest

from pgstream_dagster.engine.ledger import deadletters, keyprogress, locks
from pgstream_dagster.engine.publish import TooLarge
from pgstream_dagster.engine.spark_source import Position, SourceError, commit_consumer
from pgstream_dagster.sinks import Event

from .support.harness import insert_events
from .support.spark_source import consumer_row, executor_role, record_batches

#: table lock modes stronger than ACCESS SHARE (the one SELECT allows: it blocks only ACCESS EXCLUSIVE)
STRONG_LOCKS = ["row share", "row exclusive", "share update exclusive", "share", "share row exclusive",
                "exclusive", "access exclusive"]


@pytest.fixture
def streams(conn: psycopg.Connection, db_url: str) -> dict[int, list[tuple[int, list[int]]]]:
    """Streams 1 and 2, each with 10 events in two open ledger batches of 5."""
    made = {}
    for stream_id in (1, 2):
        conn.execute("select pgstream.ensure_stream(%s)", [stream_id])
        insert_events(db_url, stream_id, 10, 100 * stream_id)
        made[stream_id] = record_batches(db_url, stream_id, 5)
    return made


def _dead_letters(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    return conn.execute("select stream_id, event_id, batch_id, ord, payload from pgstream.dead_letters "
                        "order by id").fetchall()


def test_the_executor_cannot_forge_or_suppress_another_streams_event_through_a_dead_letter(
        db_url: str, conn: psycopg.Connection, streams: dict[int, list[tuple[int, list[int]]]]) -> None:
    """Finding 7: a dead letter makes delivery skip the event at its position, and a redelivery sends
    its payload. The executor cannot write one itself; a by_key task sets an event aside through
    set_aside_rejected with its round's delivery token: only an event of that stream's open batches,
    with the payload pgstream.events holds, never the caller's."""
    (b1, ids1), _ = streams[1]
    (b2, ids2), _ = streams[2]
    with executor_role(db_url) as url:
        for statement in [
            # a forged payload at stream 2's position: delivery would skip the real event, a redelivery send this
            ("insert into pgstream.dead_letters (stream_id, event_id, stage, batch_id, ord, event_created_at, payload,"
             " error, attempts) values (2, %s, 'deliver', %s, 1, now(), '{\"forged\": true}', 'x', 1)", [ids2[0], b2]),
            ("update pgstream.dead_letters set payload = '{\"forged\": true}'", []),
            ("delete from pgstream.dead_letters", []),
        ]:
            with psycopg.connect(url, autocommit=True) as ex, pytest.raises(psycopg.errors.InsufficientPrivilege):
                ex.execute(*statement)
        # a run of stream 1 holds its lease and gives its round's tasks the token; stream 2 has none
        lease = locks.acquire_lease(db_url, 1, "run-1")
        try:
            token = keyprogress.issue_delivery_token(lease, 1, "run-1")
            with psycopg.connect(url, autocommit=True) as ex:
                set_aside = "select pgstream.set_aside_rejected(%s, %s, %s, 'http', 'rejected: 422', 3)"
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not the delivery token of a run"):
                    ex.execute(set_aside, ["not-the-token", b1, 1])
                for batch_id, ord_ in [(b2, 1), (b1, 6)]:  # another stream's batch; past the batch's 5 events
                    with pytest.raises(psycopg.errors.InvalidParameterValue, match="no event of an open batch of "
                                                                                   "stream 1"):
                        ex.execute(set_aside, [token, batch_id, ord_])
                assert ex.execute(set_aside, [token, b1, 2]).fetchone() == (True,)  # its own round's event
                assert ex.execute(set_aside, [token, b1, 2]).fetchone() == (False,)  # set aside already
                with pytest.raises(psycopg.errors.InsufficientPrivilege):  # only the runtime issues tokens
                    ex.execute("select pgstream.issue_delivery_token(2, 'run-1')")
            # what a by_key task runs: the event it hands over is not what is written, pgstream.events is
            writer = deadletters.DeadLetterWriter(url, 1, "http", resumes=False, token=token)
            forged = Event(ids1[0], 1, {"forged": True}, created_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
            writer(b1, 1, forged, "rejected: 422", 2)
            writer.too_large(b1, 3, TooLarge(ids2[0], 10_000, 100))  # (the id is not what names the event)
            assert token not in repr(writer)
            locks.give_up_lease(lease, 1)  # the run ended: its token writes nothing more
            with psycopg.connect(url, autocommit=True) as ex, pytest.raises(psycopg.errors.InsufficientPrivilege):
                ex.execute(set_aside, [token, b1, 4])
        finally:
            lease.close()
    real: dict[int, Any] = dict(conn.execute("select id, payload from pgstream.events where stream_id = 1").fetchall())
    # the events at those positions, with their own payloads; stream 2 delivers all its events
    assert _dead_letters(conn) == [(1, ids1[1], b1, 2, real[ids1[1]]), (1, ids1[0], b1, 1, real[ids1[0]]),
                                   (1, ids1[2], b1, 3, real[ids1[2]])]


def test_the_executor_cannot_move_another_consumers_position(
        db_url: str, conn: psycopg.Connection, streams: dict[int, list[tuple[int, list[int]]]]) -> None:
    """Finding 8: a consumer's position holds events back from housekeeping; moving it releases what
    the consumer never read. consumer_commit takes the consumer's token (issued by the runtime,
    stored hashed, given to the query's options): with another consumer's token, or none, nothing moves."""
    (b1, _), (b1b, _) = streams[1]
    for name in ("victim", "mine"):
        assert conn.execute("select pgstream.register_consumer(%s, 1, true)", [name]).fetchone() == (True,)
    with executor_role(db_url) as url:
        with psycopg.connect(url, autocommit=True) as ex, pytest.raises(psycopg.Error):
            ex.execute("select pgstream.consumer_commit('victim', 1, %s, 5)", [b1b])
        assert consumer_row(db_url, "victim") == (0, 0, 10)
        victim_token = conn.execute("select pgstream.consumer_token('victim')").fetchone()
        mine_token = conn.execute("select pgstream.consumer_token('mine')").fetchone()
        assert victim_token and mine_token and victim_token[0] != mine_token[0]
        for statement, params in [("select pgstream.consumer_commit('victim', 1, %s, 5, %s)", [b1b, mine_token[0]]),
                                  ("select pgstream.consumer_commit('victim', 1, %s, 5, %s)", [b1b, None]),
                                  ("select pgstream.consumer_token('victim')", []),
                                  ("select token_hash from pgstream.consumers", [])]:
            with psycopg.connect(url, autocommit=True) as ex, pytest.raises(psycopg.Error):
                ex.execute(statement, params)
        with psycopg.connect(url, autocommit=True) as ex:
            with pytest.raises(SourceError, match=r"consumer victim: the token \(option consumerToken\) is not "
                                                  r"this consumer's"):
                commit_consumer(ex, "victim", 1, Position(b1b, 5), mine_token[0])
            commit_consumer(ex, "mine", 1, Position(b1, 5), mine_token[0])  # its own position
    assert consumer_row(db_url, "victim") == (0, 0, 10)  # still holds back everything it has not read
    assert consumer_row(db_url, "mine") == (b1, 5, 5)
    # a consumer registered before tokens: a one-line message saying what the operator does
    conn.execute("update pgstream.consumers set token_hash = null where name = 'mine'")
    with executor_role(db_url) as url, psycopg.connect(url, autocommit=True) as ex:
        with pytest.raises(SourceError, match=r"consumer mine has no token yet: an operator issues one with "
                                              r"`pgstream-dagster consumers token mine`"):
            commit_consumer(ex, "mine", 1, Position(b1, 5), mine_token[0])


def test_the_executor_cannot_lock_what_a_run_writes(
        db_url: str, conn: psycopg.Connection, streams: dict[int, list[tuple[int, list[int]]]]) -> None:
    """Finding 9: a table privilege beyond SELECT (INSERT, UPDATE, DELETE, TRUNCATE, MAINTAIN) lets its
    holder LOCK the table in modes that stall every writer, e.g. ACCESS EXCLUSIVE on key_progress
    holds every by_key run's resume points. The executor holds SELECT only on pgstream's tables, so it
    can take none of those locks nor lock rows; a by_key task records its resume points through
    record_key_progress with its round's token."""
    with psycopg.connect(db_url) as c:
        tables = [r[0] for r in c.execute(
            "select c.oid::regclass::text from pg_class c where c.relnamespace = 'pgstream'::regnamespace "
            "and c.relkind in ('r', 'p') and has_any_column_privilege('pgstream_executor', c.oid, 'SELECT')")]
        # (consumers and backfills: SELECT on some columns only)
        assert {"pgstream.key_progress", "pgstream.batches", "pgstream.consumers", "pgstream.backfills"} <= set(tables)
    with executor_role(db_url) as url:
        for table in ["pgstream.key_progress", *[t for t in tables if t != "pgstream.key_progress"]]:
            for mode in STRONG_LOCKS:
                with psycopg.connect(url) as ex, pytest.raises(psycopg.errors.InsufficientPrivilege):
                    ex.execute(f"lock table {table} in {mode} mode nowait")
            with psycopg.connect(url) as ex, pytest.raises(psycopg.errors.InsufficientPrivilege):
                ex.execute(f"select 1 from {table} for key share")  # noqa: S608 (pgstream's own table names)
        with psycopg.connect(url) as ex:
            for privilege in ("INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER", "MAINTAIN"):
                held = ex.execute(
                    "select array_agg(c.oid::regclass::text order by 1) from pg_class c "
                    "where c.relnamespace = 'pgstream'::regnamespace and c.relkind in ('r', 'p', 'v') "
                    "and has_table_privilege(current_user, c.oid, %s)", [privilege]).fetchone()
                assert held == (None,), f"the executor holds {privilege} on {held}"
                if privilege in ("INSERT", "UPDATE", "REFERENCES"):  # (nor on any column)
                    held = ex.execute(
                        "select array_agg(c.oid::regclass::text order by 1) from pg_class c "
                        "where c.relnamespace = 'pgstream'::regnamespace and c.relkind in ('r', 'p', 'v') "
                        "and has_any_column_privilege(current_user, c.oid, %s)", [privilege]).fetchone()
                    assert held == (None,), f"the executor holds {privilege} on columns of {held}"
        # the by_key task's write, through the owner's function, for the stream its token names
        progress = keyprogress.KeyProgress(url, 2, 3, token="not-a-token")
        (b1, _), _ = streams[1]
        with progress.connect() as task:
            with pytest.raises(keyprogress.RunGone):
                progress.record(task, [0], b1, 4)
            lease = locks.acquire_lease(db_url, 1, "run-1")
            try:
                progress.token = keyprogress.issue_delivery_token(lease, 1, "run-1")
                progress.record(task, [0, 2], b1, 4)  # (its stream_id says 2: the token's stream is written)
            finally:
                lease.close()
    assert conn.execute("select stream_id, partitions, bucket, batch_id, ord from pgstream.key_progress "
                        "order by bucket").fetchall() == [(1, 3, 0, b1, 4), (1, 3, 2, b1, 4)]
