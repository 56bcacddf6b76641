"""The publisher (pgstream_dagster/engine/publish.py) on its own: order, vanished events, set-aside
positions and permanent rejections, against an in-process sink that rejects chosen events; what it
yields (what the delivery run writes to the ledger), and when."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from pgstream_dagster.engine.publish import (
    BatchDone,
    Confirmed,
    Finished,
    MissingEventsError,
    OrderError,
    Positioned,
    Progress,
    RejectPolicy,
    RejectStormError,
    Span,
    owed_spans,
    publish,
)
from pgstream_dagster.sinks import Event, Sink, SinkError

from .support.sinks import drain

NOW = dt.datetime(2026, 11, 23, tzinfo=dt.UTC)


@dataclass
class Rejecting:
    """A sink config for these tests: rejects ``permanent`` ids for good, ``transient`` ids once; with
    ``whole``, a call is rejected as a whole (like an HTTP batch request answered 400)."""

    permanent: set[int] = field(default_factory=set)
    transient: set[int] = field(default_factory=set)
    whole: bool = False
    delivered: list[int] = field(default_factory=list)
    calls: list[list[int]] = field(default_factory=list)

    def build(self) -> Rejecting.Sink:
        return Rejecting.Sink(self)

    class Sink:
        def __init__(self, config: Rejecting) -> None:
            self.config = config

        def publish(self, events: Sequence[Event]) -> None:
            cfg = self.config
            cfg.calls.append([e.id for e in events])
            if cfg.whole and any(e.id in cfg.permanent for e in events):
                error = SinkError("test sink: request rejected (400)", sink="test", event_ids=[e.id for e in events])
                error.permanent = True
                raise error
            for e in events:
                if e.id in cfg.transient:
                    cfg.transient.discard(e.id)
                    raise SinkError(f"test sink: event {e.id}: timed out", sink="test", event_ids=[e.id])
                if e.id in cfg.permanent:
                    error = SinkError(f"test sink: event {e.id}: 422 invalid", sink="test", event_ids=[e.id])
                    error.permanent = True
                    raise error
                cfg.delivered.append(e.id)

        def close(self) -> None:
            pass


def rows(batches: Mapping[int, Sequence[int | None]]) -> Iterator[Positioned]:
    """Rows of ``batches`` {batch_id: [event id, or None for a vanished event]} in delivery order."""
    for batch_id, ids in batches.items():
        for ord, event_id in enumerate(ids, start=1):
            if event_id is not None:
                yield batch_id, ord, Event(event_id, 1, {"n": event_id}, None, NOW)


@dataclass
class Recorder:
    done: list[tuple[int, int]] = field(default_factory=list)
    confirmed: list[tuple[int, int]] = field(default_factory=list)
    aside: list[tuple[int, int, int, str, int]] = field(default_factory=list)

    def set_aside(self, batch_id: int, ord: int, event: Event, error: str, attempts: int) -> None:
        self.aside.append((batch_id, ord, event.id, error, attempts))

    def run(self, config: Rejecting, rows: Iterator[Positioned], chunk_size: int, **options: Any) -> int:
        """Publish through a sink of ``config``, consuming the deliveries as the delivery run does;
        returns the events handled."""
        handled = None
        for delivery in publish(_sink(config.build()), rows, chunk_size, **options):
            assert handled is None, "Finished is the last delivery"
            match delivery:
                case Confirmed(batch_id, ord):
                    self.confirmed.append((batch_id, ord))
                case BatchDone(batch_id, events):
                    self.done.append((batch_id, events))
                case Finished(count):
                    handled = count
        assert handled is not None
        return handled


def policy(rec: Recorder, **over: Any) -> RejectPolicy:
    return RejectPolicy(rec.set_aside, **{"max_attempts": 2, "max_consecutive": 5, "backoff_secs": 0, **over})


def test_in_order_with_batches_done_after_their_last_event() -> None:
    sink, rec = Rejecting(), Recorder()
    owed = [Span(1, 1, 3), Span(2, 1, 2)]
    assert rec.run(sink, rows({1: [10, 11, 12], 2: [13, 14]}), 2, owed=owed) == 5
    assert sink.delivered == [10, 11, 12, 13, 14]
    assert rec.done == [(1, 3), (2, 2)]
    # the call of [12, 13] confirms batch 2's first event; the last call ends batch 2: its BatchDone says it
    assert rec.confirmed == [(1, 2), (2, 1)]


def test_rows_out_of_order_stop_before_publishing() -> None:
    sink = Rejecting()

    def bad() -> Iterator[Positioned]:
        yield 1, 1, Event(1, 1, {}, None, NOW)
        yield 1, 1, Event(1, 1, {}, None, NOW)

    with pytest.raises(OrderError, match=r"arrived after"):
        drain(publish(_sink(sink.build()), bad(), 10))
    assert sink.delivered == []


def test_a_vanished_event_stops_the_run_at_the_gap() -> None:
    sink, rec = Rejecting(), Recorder()
    owed = [Span(1, 1, 2), Span(2, 1, 3), Span(3, 1, 1)]
    with pytest.raises(MissingEventsError) as info:
        rec.run(sink, rows({1: [10, 11], 2: [12, None, 14], 3: [15]}), 100, owed=owed)
    assert info.value.positions == [(2, 2)]
    # what came before the gap is delivered and confirmed; batch 1 is done; nothing after the gap is sent
    assert sink.delivered == [10, 11, 12]
    assert rec.done == [(1, 2)]
    assert rec.confirmed[-1] == (2, 1)


def test_vanished_events_at_the_end_and_whole_batches() -> None:
    sink, rec = Rejecting(), Recorder()
    owed = [Span(1, 1, 2), Span(2, 1, 2)]
    with pytest.raises(MissingEventsError) as info:
        rec.run(sink, rows({1: [10, 11], 2: [None, None]}), 100, owed=owed)
    assert info.value.positions == [(2, 1), (2, 2)]
    assert sink.delivered == [10, 11] and rec.done == [(1, 2)]


def test_set_aside_positions_are_skipped_whether_their_row_is_there_or_not() -> None:
    sink, rec = Rejecting(), Recorder()
    owed = [Span(1, 1, 3), Span(2, 1, 2)]
    skip = frozenset({(1, 2), (2, 1)})  # (1, 2) is still in the table, (2, 1) vanished
    handled = rec.run(sink, rows({1: [10, 11, 12], 2: [None, 14]}), 100, owed=owed, skip=skip)
    assert handled == 5
    assert sink.delivered == [10, 12, 14]
    assert rec.done == [(1, 3), (2, 2)]


def test_resuming_after_a_confirmed_prefix() -> None:
    sink, rec = Rejecting(), Recorder()

    def resumed() -> Iterator[Positioned]:
        for ord, event_id in ((3, 12), (4, 13)):
            yield 1, ord, Event(event_id, 1, {}, None, NOW)

    assert rec.run(sink, resumed(), 10, owed=[Span(1, 3, 4)]) == 2
    assert rec.done == [(1, 2)]


def test_block_policy_stops_at_a_permanent_rejection() -> None:
    sink, rec = Rejecting(permanent={12}), Recorder()
    with pytest.raises(SinkError, match="422"):
        rec.run(sink, rows({1: [10, 11, 12, 13]}), 100)
    assert sink.delivered == [10, 11] and rec.aside == [] and rec.done == []


def test_dead_letter_policy_retries_then_sets_aside_and_goes_on_in_order() -> None:
    sink, rec = Rejecting(permanent={12, 15}), Recorder()
    owed = [Span(1, 1, 4), Span(2, 1, 3)]
    handled = rec.run(sink, rows({1: [10, 11, 12, 13], 2: [14, 15, 16]}), 3, owed=owed,
                      reject=policy(rec, max_attempts=3))
    assert handled == 7
    assert sink.delivered == [10, 11, 13, 14, 16]
    assert [(b, o, e, n) for b, o, e, _err, n in rec.aside] == [(1, 3, 12, 3), (2, 2, 15, 3)]
    assert "422 invalid" in rec.aside[0][3]
    assert rec.done == [(1, 4), (2, 3)]
    assert sink.calls.count([12]) == 3  # the first rejection came with its chunk, then 3 attempts alone
    # the confirmed prefix moves past a set-aside event (and batch 2's last call ends it: its BatchDone says so)
    assert (1, 3) in rec.confirmed and rec.confirmed[-1] == (2, 2)


def test_a_request_rejected_as_a_whole_is_split_to_find_the_bad_event() -> None:
    sink, rec = Rejecting(permanent={12}, whole=True), Recorder()
    handled = rec.run(sink, rows({1: [10, 11, 12, 13]}), 10, reject=policy(rec))
    assert handled == 4
    assert sorted(set(sink.delivered)) == [10, 11, 13]
    assert [e for _b, _o, e, _err, _n in rec.aside] == [12]
    # 13 is delivered after 12 was set aside, never before
    assert sink.delivered.index(13) > sink.delivered.index(11)


def test_bisecting_a_large_refused_request_takes_few_calls() -> None:
    sink, rec = Rejecting(permanent={1000 + 300}, whole=True), Recorder()
    ids = list(range(1000, 1512))
    assert rec.run(sink, rows({1: ids}), 512, reject=policy(rec, max_attempts=1)) == 512
    assert sink.delivered == [i for i in ids if i != 1300]  # once each, in order
    assert [e for _b, _o, e, _err, _n in rec.aside] == [1300]
    assert len(sink.calls) <= 2 * 10 + 2  # ~2 calls per halving of 512, not one per event


def test_a_transient_error_while_isolating_stops_the_run() -> None:
    sink, rec = Rejecting(permanent={11}, transient=set()), Recorder()

    class Flaky(Rejecting.Sink):
        def publish(self, events: Sequence[Event]) -> None:
            if len(events) == 1 and events[0].id == 11 and len(self.config.calls) > 1:
                self.config.calls.append([11])
                raise SinkError("test sink: connection refused", sink="test", event_ids=[11])
            super().publish(events)

    class Config(Rejecting):
        def build(self) -> Rejecting.Sink:
            return Flaky(self)

    flaky = Config(permanent={11})
    with pytest.raises(SinkError, match="refused"):
        rec.run(flaky, rows({1: [10, 11, 12]}), 10, reject=policy(rec))
    assert flaky.delivered == [10] and rec.aside == []
    del sink


def test_a_sink_that_rejects_everything_blocks_instead_of_setting_all_aside() -> None:
    sink, rec = Rejecting(permanent=set(range(10, 30))), Recorder()
    with pytest.raises(RejectStormError, match="5 events in a row"):
        rec.run(sink, rows({1: list(range(10, 30))}), 10, reject=policy(rec, max_consecutive=5))
    assert len(rec.aside) == 4 and sink.delivered == []
    # a delivered event in between resets the count
    sink, rec = Rejecting(permanent={10, 11, 12, 14, 15, 16}), Recorder()
    assert rec.run(sink, rows({1: list(range(10, 18))}), 10, reject=policy(rec, max_consecutive=4)) == 8
    assert sink.delivered == [13, 17] and len(rec.aside) == 6


# -- what the publish loop yields: what the delivery run writes to the ledger, and when ---------------


def _sink(fake: Rejecting.Sink) -> Sink:
    """A test sink where the publish loop takes a :class:`Sink` (it calls ``publish`` and ``close`` only)."""
    return cast(Sink, fake)


class Timeline(Rejecting):
    """A sink config whose sinks write each publish call into ``timeline``, next to the deliveries
    the test consumes: it shows what was published before each delivery reached the caller."""

    def __init__(self, timeline: list[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeline = timeline

    class Sink(Rejecting.Sink):
        closed = False

        def publish(self, events: Sequence[Event]) -> None:
            assert isinstance(self.config, Timeline)
            self.config.timeline.append(("publish", [e.id for e in events]))
            super().publish(events)

        def close(self) -> None:
            self.closed = True

    def build(self) -> Timeline.Sink:
        return Timeline.Sink(self)


def test_each_delivery_reaches_the_caller_before_anything_more_is_published() -> None:
    timeline: list[Any] = []
    sink = Timeline(timeline).build()
    owed = [Span(1, 1, 3), Span(2, 1, 2)]
    for delivery in publish(_sink(sink), rows({1: [10, 11, 12], 2: [13, 14]}), 2, owed=owed):
        timeline.append(delivery)
    assert timeline == [
        ("publish", [10, 11]), Confirmed(1, 2), Progress(2),
        ("publish", [12, 13]), Confirmed(2, 1), Progress(4), BatchDone(1, 3),  # batch 1 done with the call
        ("publish", [14]), Progress(5), BatchDone(2, 2),  # carrying its last event: done says confirmed
        Finished(5),
    ]
    assert not sink.closed  # the caller's sink: a run keeps it for its next round
    assert drain(publish(_sink(sink), rows({3: [15]}), 2)) == 1 and timeline[-1] == ("publish", [15])


def test_closing_the_publish_loop_publishes_nothing_more() -> None:
    timeline: list[Any] = []
    sink = Timeline(timeline).build()
    deliveries = publish(_sink(sink), rows({1: [10, 11, 12, 13]}), 2)
    assert next(deliveries) == Confirmed(1, 2)
    deliveries.close()
    assert timeline == [("publish", [10, 11])] and not sink.closed


@dataclass
class LedgerBatch:
    """What the publish loop's caller knows of a ledger batch (engine.ledger.state.Batch's fields that matter)."""

    id: int
    event_count: int
    confirmed_count: int = 0
    delivered: bool = False


def _deliver(sink: Rejecting.Sink, batches: dict[int, LedgerBatch], table: dict[int, list[int]]) -> None:
    """One attempt of a run over the batches not delivered, applying the deliveries to ``batches`` as
    the run applies them to the ledger (mark_confirmed, mark_delivered)."""
    owed = owed_spans([b for b in batches.values() if not b.delivered], resume=True)

    def read() -> Iterator[Positioned]:  # what Spark reads: each span's ordinals
        for span in owed:
            for ord in range(span.first, span.last + 1):
                yield span.batch_id, ord, Event(table[span.batch_id][ord - 1], 1, {}, None, NOW)

    for delivery in publish(_sink(sink), read(), 2, owed=owed):
        match delivery:
            case Confirmed(batch_id, ord):
                batch = batches[batch_id]
                batch.confirmed_count = max(batch.confirmed_count, ord)
            case BatchDone(batch_id, events):
                assert events == next(s for s in owed if s.batch_id == batch_id).events
                batches[batch_id].delivered = True


def test_the_ledger_gets_what_the_sink_confirmed_and_a_retry_resumes_after_it() -> None:
    table = {1: [10, 11, 12], 2: [13, 14, 15], 3: [16]}
    batches = {b: LedgerBatch(b, len(ids)) for b, ids in table.items()}
    config = Rejecting(transient={14})
    with pytest.raises(SinkError, match="timed out"):
        _deliver(config.build(), batches, table)  # [10, 11], [12, 13] confirmed; [14, 15] fails
    assert (batches[1].delivered, batches[1].confirmed_count) == (True, 2)  # done: its prefix no longer matters
    assert (batches[2].delivered, batches[2].confirmed_count) == (False, 1)
    assert (batches[3].delivered, batches[3].confirmed_count) == (False, 0)
    _deliver(config.build(), batches, table)  # the retry owes batch 2 from #2 on, and batch 3
    assert all(b.delivered for b in batches.values())
    assert config.delivered == [10, 11, 12, 13, 14, 15, 16]  # each once, in order: nothing lost, nothing repeated


def test_a_batch_confirmed_in_full_is_owed_nothing() -> None:
    owed = owed_spans([LedgerBatch(1, 3, confirmed_count=3), LedgerBatch(2, 2, confirmed_count=1)],
                      resume=True)
    assert owed == [Span(1, 4, 3), Span(2, 2, 2)] and [s.events for s in owed] == [0, 1]
    assert owed_spans([LedgerBatch(2, 2, confirmed_count=1)], resume=False) == [Span(2, 1, 2)]
    sink, rec = Rejecting(), Recorder()

    def resumed() -> Iterator[Positioned]:
        yield 2, 2, Event(14, 1, {}, None, NOW)

    assert rec.run(sink, resumed(), 10, owed=owed) == 1
    assert rec.done == [(2, 1)] and rec.confirmed == []  # (the call ended the batch: its BatchDone says it)


def test_packed_partitions_group_consecutive_spans_up_to_the_partition_size() -> None:
    from pgstream_dagster.engine.spark import group_sized, partition_spans

    spans = [Span(1, 1, 3), Span(2, 4, 3), Span(3, 1, 2), Span(4, 1, 7), Span(5, 2, 2)]
    groups = group_sized([(part, 0) for part in partition_spans(spans, 5)], 5, 0)  # (load_batches without sizes)
    # in delivery order, every owed ordinal once, empty spans dropped, a long span split
    assert groups == [[Span(1, 1, 3), Span(3, 1, 2)], [Span(4, 1, 5)], [Span(4, 6, 7), Span(5, 2, 2)]]
    assert [(s.batch_id, o) for g in groups for s in g for o in range(s.first, s.last + 1)] == \
        [(b.batch_id, o) for b in spans for o in range(b.first, b.last + 1)]
    assert all(sum(s.events for s in g) <= 5 for g in groups)


def test_a_reject_storm_is_checked_against_an_event_the_sink_confirmed_before() -> None:
    """Rejections an application's events cause do not block the stream: after max_consecutive of them
    the sink gets the last event it confirmed again (a duplicate by id); it takes it, so the rejections
    are the events' own and they go on being set aside."""
    sink, rec = Rejecting(permanent=set(range(11, 23))), Recorder()
    assert rec.run(sink, rows({1: list(range(10, 25))}), 10, reject=policy(rec, max_consecutive=5)) == 15
    assert [a[2] for a in rec.aside] == list(range(11, 23))
    assert sink.delivered == [10, 10, 10, 23, 24]  # checked twice with event 10, then the good ones
    # nothing confirmed in the call: the stream's last confirmed event (known_good) is the check
    sink, rec = Rejecting(permanent=set(range(11, 23))), Recorder()
    known = Event(5, 1, {"n": 5}, None, NOW)
    assert rec.run(sink, rows({1: list(range(11, 25))}), 10,
                   reject=policy(rec, max_consecutive=5, known_good=lambda: known)) == 14
    # checked at the first rejection (nothing confirmed in the call yet), then every 5 in a row
    assert sink.delivered == [5, 5, 5, 23, 24] and len(rec.aside) == 12


def test_a_sink_that_refuses_what_it_confirmed_before_trips_the_storm_guard() -> None:
    sink, rec = Rejecting(permanent={5} | set(range(11, 30))), Recorder()
    known = Event(5, 1, {"n": 5}, None, NOW)  # confirmed by an earlier run; the sink refuses it now
    # checked at the call's first rejection: nothing is set aside
    with pytest.raises(RejectStormError, match=r"event 11 was rejected.*now also rejects event 5, which it confirmed"):
        rec.run(sink, rows({1: list(range(11, 30))}), 10,
                reject=policy(rec, max_consecutive=5, known_good=lambda: known))
    assert rec.aside == [] and sink.delivered == []
    # a sink that confirmed event 10 in this call, then refuses everything: checked after 5 in a row
    sink, rec = Rejecting(permanent=set(range(11, 30))), Recorder()

    class Breaking(Rejecting.Sink):
        def publish(self, events: Sequence[Event]) -> None:
            if self.config.delivered:
                self.config.permanent.add(10)  # it refuses what it confirmed
            super().publish(events)

    class Config(Rejecting):
        def build(self) -> Rejecting.Sink:
            return Breaking(self)

    broken = Config(permanent=set(range(11, 30)))
    with pytest.raises(RejectStormError, match=r"5 events in a row.*now also rejects event 10"):
        rec.run(broken, rows({1: list(range(10, 30))}), 10, reject=policy(rec, max_consecutive=5))
    assert len(rec.aside) == 4 and broken.delivered == [10]


class _Positions(Sink):
    """A sink that takes positions (``accepts_positions``): records each call's events and positions."""

    type_name = "positions"
    accepts_positions = True

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[tuple[int, int]]]] = []
        self.plain: list[list[int]] = []

    def publish(self, events: Sequence[Event]) -> None:
        self.plain.append([e.id for e in events])

    def publish_at(self, events: Sequence[Event], positions: Sequence[tuple[int, int]]) -> None:
        self.calls.append(([e.id for e in events], list(positions)))


def test_a_sink_that_takes_positions_gets_each_events_ledger_position() -> None:
    sink = _Positions()
    assert drain(publish(sink, rows({7: [70, 71, 72], 8: [80, None, 82]}), 2,
                         skip=frozenset({(8, 2)}))) == 5
    assert sink.plain == []
    assert sink.calls == [([70, 71], [(7, 1), (7, 2)]), ([72, 80], [(7, 3), (8, 1)]), ([82], [(8, 3)])]


def test_other_sinks_are_published_to_as_before() -> None:
    config = Rejecting()
    assert Recorder().run(config, rows({1: [10, 11, 12]}), 2) == 3
    assert config.calls == [[10, 11], [12]]
