"""``pgstream.yaml``: streams, their batching and sink, subscriptions, housekeeping.

Read from ``$PGSTREAM_CONFIG`` (default ``./pgstream.yaml``); ``${VAR}`` and ``${VAR:-default}`` are replaced from
the environment in every string value. Every error names the file, the key and what is wrong. Secrets (database URL,
sink credentials, header values) are ``SecretStr`` and never printed. A stream declared on its own (a
``StreamComponent``'s attributes: :class:`StreamDeclaration`) is validated by :func:`parse_stream` with the same
models and messages, and added by :func:`with_streams` under the same checks (ids and slots unique).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import yaml
from croniter import croniter
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .engine.cluster import database_problem, executors_elsewhere, is_local, sink_problems
from .engine.dbconn import conninfo_problem
from .sinks import LAKE_SINK_TYPES, SinkConfig
from .sinks.base import EventPath

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """The configuration file is missing, unreadable or invalid."""


def _libpq_parses(value: SecretStr) -> SecretStr:
    """A connection string libpq can parse, else its problem (the password masked: libpq echoes it)."""
    problem = conninfo_problem(value.get_secret_value())
    if problem:
        raise ValueError(f"not a connection string libpq can parse: {problem}")
    return value


#: a database URL (or key=value connection string): a secret, refused when libpq cannot parse it
DatabaseUrl = Annotated[SecretStr, AfterValidator(_libpq_parses)]

#: The largest stream id: ids are ``bigint`` in the database.
MAX_STREAM_ID = 2**63 - 1


#: keys no longer read (``warm``: the value of ``delivery.mode``): what each is told
GONE_KEYS = {
    "read_slot": "delivery.tuning.read_slot is no longer read: every stream's events are read by its reader group "
                 "(the group's delivery run reads the group's slot over the replication protocol); remove the key",
    "linger_secs": "delivery.tuning.linger_secs is no longer read: in mode open a stream always has a run open "
                   "(until tuning.max_run_secs, then a fresh one); remove the key (a run per batch: delivery.mode: "
                   "per_batch)",
    "keep_warm": "delivery.keep_warm is no longer read: in mode open (the default) a stream always has a run open; "
                 "remove the key",
    "warm": "delivery.mode warm is no longer read: in mode open (the default) a stream always has a run open; write "
            "delivery.mode: open or leave it out",
    "slot_name": "streams[].slot_name is no longer read: every stream reads its reader group's slot; give a stream "
                 "a reader group of its own (reader: <name>) for a slot of its own",
}


class _Model(BaseModel):
    # every float is finite: they reach time arithmetic (timedelta, backoff) and SQL
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    #: the keys of :data:`GONE_KEYS` the model refuses, each with its line
    _gone: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _gone_keys(cls, data: Any) -> Any:
        for key in cls._gone if isinstance(data, dict) else ():
            if key in data:
                raise ValueError(GONE_KEYS[key])
        return data


class BatchConfig(_Model):
    max_size: int = Field(1000, ge=1, le=1_000_000,
                          description="events per ledger batch at most: its reader group's reader "
                                      "cuts what it reads from the slot into batches of this size (a run takes many "
                                      "batches: delivery.max_events_per_run)")
    max_fill_secs: float = Field(0.5, ge=0, le=3600,
                                 description="the group's slot reader (its sensor, or its delivery run's) records "
                                             "what waits once max_size events wait, the slot has sent everything "
                                             "committed, or the oldest waiting event committed this long ago (under "
                                             "continuous traffic)")


#: ``delivery.tuning.direct_max_events``'s default
DIRECT_MAX_EVENTS = 100_000


class DeliveryTuning(_Model):
    """Measured defaults of a delivery (``delivery.tuning``): how much, how long, how often; never which
    route (that is ``delivery.mode`` and ``delivery.ordering``)."""

    direct_max_events: int = Field(
        DIRECT_MAX_EVENTS, ge=0, le=1_000_000,
        description="ordering global: a round of at most this many events is read by the run's own connection (5,000 "
                    "at a time) instead of by Spark (a Spark job costs 0.1-0.3 s and about half a CPU-second); a "
                    "larger backlog is delivered in rounds of this size (whole batches, at least one). Replays to a "
                    "sink other than a file also read without Spark, 5,000 events at a time (0: always Spark). Mode "
                    "per_batch reads every round through PySpark unless this is given")
    max_read_bytes: int = Field(
        32 * 2**20, ge=2**20, le=2**30,
        description="bytes of events (payload and metadata as JSON text) a run or a replay reads at once and hands "
                    "to the sink in one publish call, at most (one event at least): every read is cut at this as well "
                    "as at its number of rows, so events that are large as text (small stored: compressed) cannot "
                    "fill the run's memory. A run holds about four times this at its peak, or four times its largest "
                    "event; events of up to 6 KiB never reach it (5,000 are read at a time)")
    rows_per_partition: int = Field(50_000, ge=100, le=1_000_000,
                                    description="events per Spark partition when Spark reads (by_key rounds, a "
                                                "single batch larger than direct_max_events, direct_max_events "
                                                "0); the driver holds about two partitions")
    prefetch_partitions: bool = Field(True, description="ordered delivery read by Spark: Spark reads the next "
                                                        "partition while the sink publishes the current one")
    report_every_secs: float = Field(5, ge=0, le=3600,
                                     description="an open run reports its rounds to Dagster together (run log line, "
                                                 "deliveries materialization, status observation) at most this "
                                                 "often; the first round at once (0: every round); a "
                                                 "round logs its progress (every tenth) at most this often too")
    max_run_secs: float = Field(1800, ge=1, le=7 * 86400,
                                description="an open run takes no new batch after this long (a fresh run picks "
                                            "up configuration changes; a group delivery run's successor, "
                                            "requested run_grace_secs before, takes over)")

    _gone = ("read_slot", "linger_secs")


class DeliveryConfig(_Model):
    mode: Literal["open", "per_batch"] = Field(
        "open", description="open: the stream always has a run open, a thread of its reader group's delivery run, "
                            "handed each batch as it is recorded and delivering it without Spark for rounds up to "
                            "tuning.direct_max_events (a fresh run replaces it after tuning.max_run_secs); per_batch: "
                            "a run per batch (or per run of batches, max_events_per_run), its events read by PySpark, "
                            "as the design card has it")
    tuning: DeliveryTuning = DeliveryTuning()
    ordering: Literal["global", "by_key"] = Field(
        "global", description="global: the run's own process publishes every event in commit order (no Spark "
                              "for rounds up to tuning.direct_max_events); by_key: Spark tasks publish in parallel, "
                              "each key (routing_key) in commit order")
    routing_key: EventPath = Field("group_id",
                                   description="event path (payload, or metadata:<path>) used to partition "
                                               "deliveries when ordering=by_key")
    parallelism: int = Field(4, ge=1, le=256, description="ordering by_key: Spark partitions (tasks) a round is "
                                                           "split into by routing_key")
    chunk_size: int = Field(500, ge=1, le=100_000, description="events handed to the sink per publish call")
    max_events_per_run: int = Field(100_000, ge=1, le=10_000_000,
                                    description="a run takes every pending batch behind the head, up to this many "
                                                "events (adaptive batching; a backlog drains in few runs)")
    on_reject: Literal["block", "dead_letter"] = Field(
        "block", description="an event the sink rejects for good (see each sink's permanent rejections): block: the "
                             "stream waits for it (failover, retried with backoff) until the sink accepts it or an "
                             "operator sets it aside; dead_letter: after max_attempts it is moved to "
                             "pgstream.dead_letters with the sink's answer and the stream goes on")
    max_attempts: int = Field(3, ge=1, le=100, description="on_reject: dead_letter: attempts of a rejected event "
                                                           "before it is set aside")
    max_consecutive_rejects: int = Field(
        20, ge=1, le=1_000_000, description="on_reject: dead_letter: once this many events in a row are rejected (and "
                                            "at a round's first rejection), the sink gets the last event it confirmed "
                                            "again (a duplicate by id): if it refuses that too, it rejects everything "
                                            "and the stream blocks instead, as it does after this many when it never "
                                            "confirmed one; else the rejections are the events' and they go on being "
                                            "set aside")
    run_grace_secs: float = Field(120, ge=1, le=3600,
                                  description="a started run that has taken no delivery lease this long after "
                                              "it started is dead (its process never got going): it is marked "
                                              "failed and its batches retried. A run whose lease's database "
                                              "session has ended (process killed) is dead at once. Also how "
                                              "long before tuning.max_run_secs (half of it at most) a group "
                                              "delivery run's successor is requested, and how long one requested "
                                              "for a configuration change may take to be up before the run it "
                                              "succeeds is asked to end without it")

    _gone = ("read_slot", "linger_secs", "keep_warm")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """Mode warm, no longer read, is refused, and a key of ``tuning`` given here, naming where it goes."""
        if not isinstance(data, dict):
            return data
        if data.get("mode") == "warm":
            raise ValueError(GONE_KEYS["warm"])
        for key in data:
            if key in DeliveryTuning.model_fields and key not in cls.model_fields:
                raise ValueError(f"delivery.{key} is no longer read: write delivery.tuning.{key}")
        return data

    @property
    def keeps_open(self) -> bool:
        """Whether the stream always has a run open (mode open), not a run per batch."""
        return self.mode != "per_batch"

    @property
    def direct_max_events(self) -> int:
        """The largest ordered round read without Spark: ``tuning.direct_max_events``, but 0 (every round
        through PySpark) in mode per_batch unless ``tuning.direct_max_events`` is given."""
        if self.mode == "per_batch" and "direct_max_events" not in self.tuning.model_fields_set:
            return 0
        return self.tuning.direct_max_events


class SensorConfig(_Model):
    interval_secs: int = Field(1, ge=1, le=3600, description="the sensor's minimum interval between ticks (Dagster's "
                                                              "daemon starts one at most every 5 s)")
    tick_budget_secs: float = Field(4.5, gt=0, le=50,
                                    description="how long one tick keeps recording and handing batches to the open "
                                                "run; Dagster's daemon starts a sensor tick at most every 5 s, so "
                                                "just under 5 s keeps a tick running nearly all the time")
    status_every_secs: float = Field(5, ge=1, le=86400, description="observe the stream status asset at least "
                                                                    "this often (and whenever what it shows changes)")


class RetryConfig(_Model):
    initial_backoff_secs: float = Field(5.0, ge=0, le=7 * 86400, description="first failover retry after this long")
    max_backoff_secs: float = Field(300.0, ge=0, le=7 * 86400, description="the backoff doubles up to this")

    @model_validator(mode="after")
    def _ordered(self) -> RetryConfig:
        if self.initial_backoff_secs > self.max_backoff_secs:
            raise ValueError(f"initial_backoff_secs ({self.initial_backoff_secs:g}) must not exceed "
                             f"max_backoff_secs ({self.max_backoff_secs:g})")
        return self


class StreamChecksConfig(_Model):
    """Thresholds of the stream's asset checks (on its deliveries asset)."""

    max_undelivered_age_secs: float = Field(900.0, gt=0, le=366 * 86400,
                                            description="SLA: oldest undelivered event at most this old")
    max_retained_wal_bytes: int = Field(1024**3, ge=0, le=2**63 - 1, description="WAL the stream's slot may hold back")


#: The prefix of the names pgstream gives a stream's objects: its publication ``pgstream_stream_<id>`` (so is
#: the sensor that tells an invalid entry; tear-down recognises the publications by it), an open run's NOTIFY
#: channel ``pgstream_stream_<id>_runs``. (Slot names: ``engine.ledger.streams.stream_slot``.)
STREAM_NAME_PREFIX = "pgstream_stream_"


def stream_object_name(stream_id: int) -> str:
    """``pgstream_stream_<id>``: the stream's publication and its sensor."""
    return f"{STREAM_NAME_PREFIX}{stream_id}"


#: the reader group of a stream that names none (``streams[].reader``)
DEFAULT_READER = "default"


class StreamConfig(_Model):
    id: int = Field(ge=1, le=MAX_STREAM_ID, description="the stream's id (unique)")
    batch: BatchConfig = BatchConfig()
    sink: SinkConfig = Field(description="where the stream's events are delivered (type selects the sink)")
    delivery: DeliveryConfig = DeliveryConfig()
    sensor: SensorConfig = SensorConfig()
    retry: RetryConfig = RetryConfig()
    checks: StreamChecksConfig = StreamChecksConfig()
    reader: str = Field(
        DEFAULT_READER, pattern=r"^[a-z][a-z0-9_]{0,30}$",
        description="the stream's reader group: the streams naming the same group share one replication slot and "
                    "one publication (pgstream_group_<name>), read by the group's sensor (pgstream_group_<name>) "
                    "and its delivery run, which decode the WAL once and record each stream's transactions in its "
                    "ledger. Every stream belongs to one: a stream that names none shares the database's default "
                    "group, so any number of streams take one slot and one WAL sender; name a group of its own to "
                    "give a stream a slot of its own. A stream that had its own slot joins without losing or "
                    "repeating an event (its slot is drained, then dropped); leaving a group, or moving to another, "
                    "is refused (one-line error naming the stream)")

    _gone = ("slot_name",)

    @model_validator(mode="after")
    def _lake_needs_global_order(self) -> StreamConfig:
        # a lake sink's commits carry the last ledger position as their token: one publisher, in order
        if self.sink.type in LAKE_SINK_TYPES and self.delivery.ordering == "by_key":
            raise ValueError(f"sink.type {self.sink.type}: needs delivery.ordering global (its commits are keyed by "
                             f"the ledger position, which by_key's parallel tasks do not follow)")
        return self

    @property
    def publication(self) -> str:
        """What a joining member's own slot is decoded with: the event id and created_at only."""
        return stream_object_name(self.id)


class Extension(_Model):
    """A value computed per event: ``json_path`` (``a.b``) set to the SQL ``expression`` over ``new``/``old``
    (a payload extension, or a metadata extension)."""

    json_path: str = Field(description="where the value goes: a dotted path (a.b)")
    expression: str = Field(description="SQL over new/old, evaluated as pgstream_writer")


class SubscriptionConfig(_Model):
    key: str = Field(min_length=1, max_length=200, description="the subscription's name: the payload's tg_name")
    stream_id: int = Field(ge=1, le=MAX_STREAM_ID, description="the stream its events go to")
    operation: Literal["INSERT", "UPDATE", "DELETE"] = Field(description="the row operation subscribed to")
    schema_name: str = Field("public", description="schema of the subscribed table")
    table_name: str = Field(min_length=1, description="the subscribed table")
    when_clause: str | None = Field(None, description="SQL boolean over new/old: only rows it takes become "
                                                      "events (evaluated as pgstream_writer)")
    column_names: list[str] = Field(default_factory=list, description="columns copied into the payload's new/old")
    payload_extensions: list[Extension] = Field(default_factory=list, description="computed per event into the "
                                                                                  "payload: {json_path, expression}")
    metadata: dict[str, Any] | None = Field(None, description="static metadata of every event (travels beside "
                                                              "the payload; sinks may route by it)")
    metadata_extensions: list[Extension] = Field(
        default_factory=list, description="computed per event into the event's metadata, merged over `metadata` "
                                          "(computed values win; along a path the other static keys stay)")
    trigger_mode: Literal["row", "statement"] = Field(
        "row", description="row: a deferred FOR EACH ROW trigger (events written at commit); statement: one "
                           "FOR EACH STATEMENT trigger with a transition table (INSERT and DELETE only, "
                           "and UPDATE on a partitioned table)")
    emit_truncate: bool = Field(
        False, description="DELETE subscriptions only: a TRUNCATE of the table is an event (tg_op TRUNCATE, new "
                           "and old null); without it a TRUNCATE of a table with a DELETE subscription is refused")

    @field_validator("operation", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v


def _none_if_empty(v: object) -> object:
    """An empty (or blank) string given for an optional value: none."""
    return None if isinstance(v, str) and not v.strip() else v


#: an optional database URL, none when given empty
OptionalDatabaseUrl = Annotated[DatabaseUrl | None, BeforeValidator(_none_if_empty)]


def _cron(v: str) -> str:
    """A cron expression Dagster's schedules accept: what croniter parses, five fields (no seconds),
    and not a day that never comes (30 or 31 February)."""
    fields = croniter.expand(v)[0] if croniter.is_valid(v) else []
    if len(fields) != 5 or (fields[3] == [2] and fields[2] in ([30], [31])):
        raise ValueError(f"not a valid cron expression: {v!r}")
    return v


Cron = Annotated[str, AfterValidator(_cron)]


class HousekeepingConfig(_Model):
    cron: Cron = Field("0 3 * * *", description="schedule of the pgstream_housekeeping job (UTC)")
    days_ahead: int = Field(7, ge=0, le=365, description="daily partitions of pgstream.events created ahead")
    retention_days: int = Field(7, ge=1, le=3650, description="days of events kept; older partitions are dropped "
                                                             "unless they hold undelivered events")
    ledger_keep_days: int = Field(7, ge=1, le=3650, description="delivered and skipped ledger batches kept this long")
    undelivered_policy: Literal["keep", "fail"] = Field(
        "keep", description="a partition past retention that holds undelivered events: keep it (warning) or "
                            "fail the housekeeping run and drop nothing")
    lock_timeout_ms: int = Field(
        200, ge=1, le=60_000,
        description="longest wait for a lock on pgstream.events or a partition (ATTACH, DETACH): application "
                    "writes queue behind a waiting request at most this long")
    lock_attempts: int = Field(
        5, ge=1, le=100,
        description="attempts per partition, with a doubling pause between them; a partition whose locks stay "
                    "held is left for the next pass (reported as busy)")


class ChecksConfig(_Model):
    cron: Cron = Field("*/5 * * * *", description="schedule of the pgstream_checks job (UTC)")
    streams_per_sec: float = Field(
        2.0, ge=0, description="a scheduled pgstream_checks run checks at most this many streams a second (0: no "
                               "limit), so that many streams' checks and their writes to Dagster's event log do not "
                               "take the CPUs from the deliveries at once; checks run from the UI are not paced")


class SparkConfig(_Model):
    master: str = Field("local[*]", description="the runs' Spark master when Spark is needed (local[*], "
                                                "spark://host:7077, k8s://..., yarn)")
    remote: Annotated[str | None, BeforeValidator(_none_if_empty)] = Field(
        None, pattern=r"^sc://\S+$", description="Spark Connect URL (sc://host:15002): runs use a long-lived server "
                                                  "(`pgstream-dagster spark-connect`) instead of starting Spark; "
                                                  "overrides master; empty = none")
    conf: dict[str, str] = Field(default_factory=dict, description="Spark settings of the runs' sessions (they win "
                                                                   "over pgstream's cluster defaults)")
    ship_package: bool = Field(True, description="a cluster master: add a zip of the installed pgstream_dagster "
                                                 "package to spark.submit.pyFiles (false: the executors' Python "
                                                 "has it, e.g. a packed environment in spark.archives)")
    host_local_settings: bool = Field(False, description="accept settings the executors read that name their own "
                                                         "host (relative file paths, loopback hosts) on a cluster "
                                                         "master: every executor host has what they name")
    executor_database_url: OptionalDatabaseUrl = Field(
        None, description="the URL Spark executors connect with: a login role that is a member of pgstream_executor "
                          "(reads events and batches, writes by_key resume points, runs backfill chunks); default: "
                          "database_url (the runtime's), which executor hosts then hold; empty = none")


class MetricsConfig(_Model):
    """The Prometheus exporter (``pgstream-dagster metrics``): where it listens, how it reads."""

    enabled: bool = Field(True, description="`make dev` / `pgstream-dagster dev` start the exporter beside dg dev")
    host: str = Field("127.0.0.1", min_length=1, max_length=253, pattern=r"^[A-Za-z0-9_.:\-\[\]]+$",
                      description="address the exporter listens on (0.0.0.0: every interface)")
    port: int = Field(9187, ge=1, le=65535, description="port the exporter listens on")
    database_url: OptionalDatabaseUrl = Field(None, description="the exporter's connection (e.g. a read-only role "
                                                             "granted SELECT on pgstream.metrics); default: "
                                                             "database_url")
    scrape_timeout_secs: float = Field(5.0, gt=0, le=300, description="a scrape's read of the database gives up "
                                                                      "after this long (the scrape then reports "
                                                                      "pgstream_up 0)")


def _check_cluster(config: PgstreamConfig) -> None:
    """On a cluster, settings read by the executors that name this machine are refused: the
    database URL (the executors read pgstream.events) if they may run elsewhere, and the sink of a
    ``by_key`` stream (built on the executors)."""
    spark = config.spark
    if spark.host_local_settings or (spark.remote is None and is_local(spark.master)):
        return
    elsewhere = executors_elsewhere(spark.master, spark.remote)
    hint = ("the executors run {}; use an address and absolute paths every executor host reaches, or set "
            "spark.host_local_settings: true if each of them has what these name")
    where = "on other hosts" if elsewhere else "in working directories of their own"
    problems: list[str] = []
    if elsewhere:
        problem = database_problem(config.executor_url)
        if problem:
            which = "spark.executor_database_url" if spark.executor_database_url else "database_url"
            problems.append(f"{which} {problem}")
    # by_key sinks are built on the executors: a cluster's, or a Spark Connect server's workers
    # (whose working directory is the server's)
    for s in config.streams:
        if s.delivery.ordering == "by_key":
            problems += [f"streams[id={s.id}] (ordering by_key: its sink is built on the executors): {p}"
                         for p in sink_problems(s.sink, elsewhere)]
    if problems:
        label = (("spark.remote (a server on another host)" if elsewhere else "spark.remote") if spark.remote
                 else f"spark.master {spark.master!r}")
        raise ValueError(f"{label}: " + "; ".join(problems) + "; " + hint.format(where))


def _check_subscriptions(ids: list[int], subscriptions: Sequence[SubscriptionConfig]) -> None:
    for i, sub in enumerate(subscriptions):
        if sub.stream_id not in ids:
            raise ValueError(f"subscriptions[{i}] ({sub.key!r}) uses stream_id {sub.stream_id}, "
                             f"which is not in streams {ids}")
    seen: set[tuple[object, ...]] = set()
    for i, sub in enumerate(subscriptions):
        ident = (sub.stream_id, sub.key, sub.schema_name, sub.table_name, sub.operation)
        if ident in seen:
            raise ValueError(f"subscriptions[{i}] ({sub.key!r}) is declared twice for "
                             f"{sub.operation} on {sub.schema_name}.{sub.table_name}")
        seen.add(ident)


class StreamDeclaration(StreamConfig):
    """A stream declared on its own, with its subscriptions: the attributes of a
    ``pgstream_dagster.StreamComponent``. The fields are :class:`StreamConfig`'s (a stream of
    ``pgstream.yaml``) plus ``subscriptions`` (:class:`SubscriptionConfig`; ``stream_id`` may be
    left out: it is the stream's ``id``)."""

    subscriptions: list[SubscriptionConfig] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _own_stream_id(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("id"), int) and isinstance(data.get("subscriptions"), list):
            data = {**data, "subscriptions": [{"stream_id": data["id"], **s} if isinstance(s, dict) else s
                                              for s in data["subscriptions"]]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> StreamDeclaration:
        for i, sub in enumerate(self.subscriptions):
            if sub.stream_id != self.id:
                raise ValueError(f"subscriptions[{i}] ({sub.key!r}) uses stream_id {sub.stream_id}, which is not "
                                 f"this stream's id {self.id} (leave stream_id out)")
        _check_subscriptions([self.id], self.subscriptions)
        return self

    @property
    def stream(self) -> StreamConfig:
        """The stream without its subscriptions, as a stream of ``pgstream.yaml``."""
        return StreamConfig.model_validate({name: getattr(self, name) for name in StreamConfig.model_fields})


def recording_stand_in(stream_id: int, reader: str) -> StreamConfig:
    """A reader group's member whose ``streams[]`` entry is invalid (the code location left it out), as its
    group records it meanwhile: the default batching; no sink (no run delivers it until the entry is fixed)."""
    return StreamConfig.model_construct(id=stream_id, reader=reader, sink=None)  # type: ignore[arg-type]


def reader_groups(streams: Sequence[StreamConfig]) -> dict[str, list[StreamConfig]]:
    """The reader groups ``streams`` name (``streams[].reader``), by name in name order, each with its streams."""
    return {name: [s for s in streams if s.reader == name] for name in sorted({s.reader for s in streams})}


def streams_fingerprint(streams: Sequence[StreamConfig]) -> str:
    """A stable hash of the configuration of ``streams`` (in stream order), the same in every process that
    loads the same configuration: a reader group's delivery run is requested with its members' fingerprint
    (run tag ``pgstream/config``). Secret values are masked, so a fingerprint tells nothing of them (a secret
    changed alone reaches deliveries with the next group run)."""
    dumped = [s.model_dump(mode="json") for s in sorted(streams, key=lambda s: s.id)]
    text = json.dumps(dumped, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PgstreamConfig(_Model):
    database_url: DatabaseUrl = Field(description="what the code location, sensors, runs and CLI connect with: a "
                                                "login member of pgstream_runtime (never shown)")
    streams: list[StreamConfig] = Field(min_length=1, description="the streams, each with its sink")
    subscriptions: list[SubscriptionConfig] = Field(default_factory=list, description="row changes that become "
                                                                                     "events (each is an asset)")
    housekeeping: HousekeepingConfig = HousekeepingConfig()
    checks: ChecksConfig = ChecksConfig()
    spark: SparkConfig = SparkConfig()
    metrics: MetricsConfig = MetricsConfig()

    #: streams whose streams[] entry is invalid, left out of a code location's definitions (by id: the entry's
    #: problems in one line); the others go on (:func:`load_config` ``leave_out_invalid``)
    _left_out: dict[int, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> PgstreamConfig:
        ids = [s.id for s in self.streams]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"stream ids must be unique, duplicated: {dupes}")
        _check_cluster(self)
        self._left_out = dict((info.context or {}).get(LEFT_OUT, {}))
        # a left-out stream's subscriptions stay: its events go on being written (and recorded)
        _check_subscriptions(ids + sorted(self._left_out), self.subscriptions)
        return self

    @property
    def left_out(self) -> dict[int, str]:
        """Streams left out of the code location (their ``streams[]`` entry invalid): id → what is wrong in one line."""
        return dict(self._left_out)

    @property
    def executor_url(self) -> str:
        """What Spark executors connect with: ``spark.executor_database_url``, else ``database_url``."""
        return (self.spark.executor_database_url or self.database_url).get_secret_value()

    def stream(self, stream_id: int) -> StreamConfig:
        for s in self.streams:
            if s.id == stream_id:
                return s
        raise ConfigError(f"stream {stream_id} is not configured")


def _substitute(value: Any, path: str, source: str) -> Any:
    if isinstance(value, dict):
        return {k: _substitute(v, f"{path}.{k}" if path else str(k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, f"{path}[{i}]", source) for i, v in enumerate(value)]
    if isinstance(value, str):
        def repl(m: re.Match[str]) -> str:
            found = os.environ.get(m.group(1), m.group(2))
            if found is None:
                raise ConfigError(f"{source}: {path}: environment variable {m.group(1)} is not set")
            return found

        return _VAR.sub(repl, value)
    return value


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


_M = TypeVar("_M", bound=BaseModel)


#: the validation context key carrying the streams left out (:func:`_leave_out_invalid`), by id: their problems
LEFT_OUT = "left_out"


def _validated(model: type[_M], data: Any, source: str, at: str = "",
               context: dict[str, Any] | None = None) -> _M:
    """``data`` (read from ``source``, at key ``at`` of it) with ``${VAR}`` replaced, validated by
    ``model``; a :class:`ConfigError` names the source, the key of every problem and what is wrong
    (never the value: it may be a secret)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at {at or 'the top level'}, got {type(data).__name__}")
    data = _substitute(data, at, source)
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p in _SINK_TAGS))
            where = _location(((at,) if at else ()) + loc)
            allowed = _allowed_keys(model, err["loc"][:-1]) if err["type"] == "extra_forbidden" else None
            said = f"unknown key (allowed: {', '.join(allowed)})" if allowed else err["msg"]
            problems.append(f"{source}: {where}: {said}{_subscription_hint(data, err['loc'])}")
        raise ConfigError("\n".join(problems)) from None


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a value of type ``annotation`` holds: itself, a list's items, a union's members (each once)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    if typing.get_origin(annotation) in (list, typing.Annotated, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found.extend(m for m in models_in(arg) if m not in found)
    return found


def _allowed_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str] | None:
    """The keys the model at ``loc`` of ``model`` takes (None: not one model found there), for an unknown key."""
    models = [model]
    for part in loc:
        if isinstance(part, str) and part in _SINK_TAGS:  # a sink's tag: the member whose type it is
            models = [m for m in models if part in typing.get_args(m.model_fields["type"].annotation)]
        elif isinstance(part, str):  # (an index is into a list: its items' models are the list's)
            models = [m for current in models for name, f in current.model_fields.items() if (f.alias or name) == part
                      for m in models_in(f.annotation)]
    return [f.alias or name for name, f in models[0].model_fields.items()] if len(models) == 1 else None


def parse_config(data: Any, source: str = "<config>", *, leave_out_invalid: bool = False) -> PgstreamConfig:
    """The configuration in ``data`` (read from ``source``). ``leave_out_invalid`` (the code location): a
    ``streams[]`` entry that is invalid on its own (its ``id`` readable) is left out with its problems
    (:attr:`PgstreamConfig.left_out`) and the others are kept, so one stream's mistake stops no other; the
    whole file is refused as before when every stream is invalid or anything else is."""
    if leave_out_invalid:
        kept, left_out = _leave_out_invalid(data, source)
        if left_out and kept:
            return _validated(PgstreamConfig, {**data, "streams": kept}, source, context={LEFT_OUT: left_out})
    return _validated(PgstreamConfig, data, source)


def _leave_out_invalid(data: Any, source: str) -> tuple[list[Any], dict[int, str]]:
    """The ``streams[]`` entries of ``data`` valid on their own (or whose ``id`` is not readable: the file's
    validation says what is wrong with them), and the others by id, with their problems in one line."""
    entries = data.get("streams") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return [], {}
    kept: list[Any] = []
    left_out: dict[int, str] = {}
    ids = [e.get("id") for e in entries if isinstance(e, dict)]
    for i, entry in enumerate(entries):
        sid = entry.get("id") if isinstance(entry, dict) else None
        if isinstance(sid, int) and not isinstance(sid, bool) and ids.count(sid) == 1:
            try:
                _validated(StreamConfig, entry, source, f"streams[{i}]")
            except ConfigError as exc:
                left_out[sid] = "; ".join(line for line in str(exc).splitlines() if line)
                continue
        kept.append(entry)
    return kept, left_out


def parse_stream(data: Any, source: str = "<stream>", at: str = "") -> StreamDeclaration:
    """A stream declared on its own (``at`` the key holding it in ``source``, e.g. ``attributes``
    in a ``defs.yaml``): the same validation and messages as a stream of ``pgstream.yaml``."""
    return _validated(StreamDeclaration, data, source, at)


def with_streams(config: PgstreamConfig, declared: Sequence[StreamDeclaration], source: str) -> PgstreamConfig:
    """``config`` with the ``declared`` streams and their subscriptions added, under the checks of
    one file: ids and slots unique. ``source`` names where the streams come from, for the error."""
    if not declared:
        return config
    return _validated(PgstreamConfig, {
        **dict(config),
        "streams": [*config.streams, *(d.stream for d in declared)],
        "subscriptions": [*config.subscriptions, *(s for d in declared for s in d.subscriptions)],
    }, source, context={LEFT_OUT: config.left_out})


def _subscription_hint(data: dict[str, Any], loc: tuple[int | str, ...]) -> str:
    """`` (subscription 'key')`` for an error inside ``subscriptions[i]`` whose key is readable."""
    if len(loc) < 2 or loc[0] != "subscriptions" or not isinstance(loc[1], int):
        return ""
    subs = data.get("subscriptions")
    if not isinstance(subs, list) or loc[1] >= len(subs) or not isinstance(subs[loc[1]], dict):
        return ""
    key = subs[loc[1]].get("key")
    return f" (subscription {key!r})" if isinstance(key, str) else ""


#: the sinks' ``type`` values (``http`` and ``webhook``...): the union's tags in a validation error's location
_SINK_TAGS = {tag for sink in typing.get_args(typing.get_args(SinkConfig)[0])
              for tag in typing.get_args(sink.model_fields["type"].annotation)}


class MetricsSettings(BaseModel):
    """What the exporter reads of ``pgstream.yaml``: ``database_url`` and ``metrics`` only (it needs
    no sink credentials), validated by the same models."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    database_url: DatabaseUrl | None = None
    metrics: MetricsConfig = MetricsConfig()


def load_metrics_settings(path: Path | str, *, database_url: bool = True) -> MetricsSettings:
    """``database_url`` (unless ``database_url`` is false: the caller has its own) and the ``metrics``
    block of the configuration file at ``path``."""
    p = Path(path)
    data = read_yaml(p, "the pgstream configuration", single=True)[0]
    if isinstance(data, dict):  # (anything else is refused as the configuration is)
        data = {k: data[k] for k in ("database_url", "metrics") if k in data and (database_url or k == "metrics")}
    return _validated(MetricsSettings, data, str(p))


#: the values (mappings, sequences, scalars) a YAML document may hold once its aliases are followed: a
#: configuration holds thousands; a few hundred bytes of aliases nesting aliases expand to billions
#: (an alias bomb), which every reader of the data (``${VAR}`` substitution, validation) would copy
MAX_YAML_VALUES = 1_000_000


class _YamlBomb(yaml.YAMLError):
    """A document whose aliases expand beyond :data:`MAX_YAML_VALUES` values, or refer to a node holding them."""


def _expanded_values(root: yaml.Node) -> int:
    """How many values ``root`` holds with every alias followed (each shared node counted once per
    reference, computed once per node); raises :class:`_YamlBomb` past :data:`MAX_YAML_VALUES` or on
    an alias inside the node it names."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if done:
            sizes[key] = total = 1 + sum(sizes[id(child)] for child in children)
            if total > MAX_YAML_VALUES:
                raise _YamlBomb(f"its aliases expand to more than {MAX_YAML_VALUES:,} values (an alias bomb?): "
                                "write the values out or use fewer aliases")
            continue
        if key in sizes:
            continue
        if key in entered:
            raise _YamlBomb("an alias refers to a node that holds it (a recursive structure)")
        entered.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a document whose aliases expand beyond :data:`MAX_YAML_VALUES`
    values before anything is built from it."""

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_values(node)
        return super().construct_document(node)


def read_yaml(path: Path, what: str, *, single: bool = False) -> list[Any]:
    """The documents of the YAML file at ``path`` (``what`` it is, for messages; ``single``: it must
    hold one, the result is then a list of one, ``[None]`` for an empty file), loaded safely; a
    :class:`ConfigError` of one line naming the file when it cannot be read, is not YAML, nests too
    deep, or holds an alias bomb (:data:`MAX_YAML_VALUES`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: cannot read {what}: not UTF-8 text") from None
    try:
        documents = list(yaml.load_all(text, Loader=_BoundedLoader))
    except _YamlBomb as exc:
        raise ConfigError(f"{path}: refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ConfigError(f"{path}: refused: it nests deeper than the YAML reader goes") from None
    if single and len(documents) > 1:
        raise ConfigError(f"{path}: invalid YAML: {len(documents)} documents (--- separated), expected one")
    return (documents or [None]) if single else documents


def _component_files(root: Path) -> list[Path]:
    """The files of a defs folder that declare components."""
    return sorted(p for name in ("defs.yaml", "component.yaml") for p in root.rglob(name))


def check_defs_yaml(folder: Path | str) -> None:
    """Read every ``defs.yaml`` (and ``component.yaml``) under ``folder`` as :func:`read_yaml` does, before
    Dagster reads them (its reader follows every alias): an alias bomb is refused at once."""
    for file in _component_files(Path(folder)):
        read_yaml(file, "it")


def config_path() -> Path:
    return Path(os.environ.get("PGSTREAM_CONFIG", "pgstream.yaml"))


#: the ``type`` of a stream declared in a ``defs.yaml`` (:class:`pgstream_dagster.StreamComponent`), as
#: registered with ``dg``, and by its package and module
STREAM_COMPONENT_TYPES = ("pgstream_dagster.StreamComponent", "pgstream_dagster.component.StreamComponent",
                          "pgstream_dagster.component.stream.StreamComponent")


def load_component_streams(folder: Path | str) -> tuple[list[StreamDeclaration], list[str]]:
    """The streams declared as StreamComponents in the ``defs.yaml`` (or ``component.yaml``) files under
    ``folder`` (a dg project's defs folder), validated as the code location validates them, and the
    files they come from. What reads the definitions without loading them (the CLI) sees the same streams."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory (the defs folder with the streams' defs.yaml)")
    declared: list[StreamDeclaration] = []
    sources: list[str] = []
    for file in _component_files(root):
        for doc in read_yaml(file, "it"):
            if isinstance(doc, dict) and doc.get("type") in STREAM_COMPONENT_TYPES:
                declared.append(parse_stream(doc.get("attributes") or {}, str(file), at="attributes"))
                sources.append(str(file))
    return declared, sources


def load_config(path: Path | str | None = None, defs_folder: Path | str | None = None, *,
                leave_out_invalid: bool = False) -> PgstreamConfig:
    """Read and validate the configuration file; with ``defs_folder``, plus the streams declared as
    StreamComponents there (:func:`load_component_streams`), checked together as the code location does.
    ``leave_out_invalid``: as the code location reads it (:func:`parse_config`); else (the CLI) any invalid
    entry refuses the file."""
    p = Path(path) if path is not None else config_path()
    if path is None and not p.exists():
        where = "$PGSTREAM_CONFIG" if "PGSTREAM_CONFIG" in os.environ else "the default, in the current directory"
        raise ConfigError(f"{p}: no such file ({where}): pass --config FILE or set PGSTREAM_CONFIG")
    if defs_folder is not None:
        declared, sources = load_component_streams(defs_folder)
        return with_streams(load_config(p, leave_out_invalid=leave_out_invalid), declared,
                            f"{p} + {', '.join(sorted(set(sources)))}")
    return parse_config(read_yaml(p, "the pgstream configuration", single=True)[0], str(p),
                        leave_out_invalid=leave_out_invalid)
