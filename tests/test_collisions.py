"""Operator slips and configuration collisions (issue 12): slot names shared by two streams, a
tear-down that would drop the user's own objects or leave a slot behind, concurrent partition
maintenance. Against a real Postgres."""

from __future__ import annotations

import datetime as dt
import threading
from collections import Counter

import psycopg

# --------------------------------------------------------------------------------------------
# partition maintenance is serialised


def _concurrently(db_url: str, calls: list[tuple[str, list[object]]]) -> list[list[str] | BaseException]:
    """Run each (query, params) on its own connection, all released at once by a barrier."""
    barrier = threading.Barrier(len(calls))
    results: list[list[str] | BaseException] = [[] for _ in calls]

    def work(i: int, query: str, params: list[object]) -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                barrier.wait()
                results[i] = [r[0] for r in c.execute(query, params).fetchall()]
        except BaseException as exc:  # reported by the test
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i, q, p)) for i, (q, p) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_create_partitions_never_deadlock(db_url: str) -> None:
    base = dt.date(2040, 1, 1)
    for rep in range(8):
        start = base + dt.timedelta(days=40 * rep)
        # four callers, overlapping ranges: start .. start+9, start+2 .. start+11, ...
        calls = [("select * from pgstream.create_partitions(%s, %s)", [9, start + dt.timedelta(days=2 * i)])
                 for i in range(4)]
        results = _concurrently(db_url, calls)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        created = Counter(name for r in results for name in r)  # type: ignore[union-attr]
        expected = {f"events_{start + dt.timedelta(days=d):%Y%m%d}" for d in range(16)}
        assert set(created) == expected
        assert all(n == 1 for n in created.values()), created


def test_concurrent_drop_and_create_partitions_drop_each_partition_once(db_url: str) -> None:
    old = dt.date(2001, 1, 1)
    for rep in range(4):
        start = old + dt.timedelta(days=100 * rep)
        with psycopg.connect(db_url, autocommit=True) as c:
            made = [r[0] for r in c.execute("select * from pgstream.create_partitions(9, %s)", [start])]
        assert len(made) == 10
        today = start + dt.timedelta(days=30)  # retention 1: all ten expired
        ahead = dt.date(2060, 1, 1) + dt.timedelta(days=100 * rep)  # never expires here
        calls = [("select * from pgstream.drop_partitions(1, %s)", [today]) for _ in range(2)]
        calls += [("select * from pgstream.create_partitions(4, %s)", [ahead + dt.timedelta(days=i)]) for i in range(2)]
        results = _concurrently(db_url, calls)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        dropped = Counter(name for r in results[:2] for name in r)  # type: ignore[union-attr]
        assert dropped == Counter(made)  # each dropped exactly once
        created = Counter(name for r in results[2:] for name in r)  # type: ignore[union-attr]
        assert created == Counter(f"events_{ahead + dt.timedelta(days=d):%Y%m%d}" for d in range(6))
