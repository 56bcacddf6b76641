"""The Postgres and Dagster limits that can stop a stream, checked before they do (``preflight``, ``init``,
a group's sensor whose slot cannot be created): ``wal_level``, the runtime's replication right,
``max_replication_slots``, ``max_wal_senders``, ``max_connections`` (with Dagster storage's connections),
``max_concurrent_runs`` and the run queue's limit on the group delivery runs (given by the caller). One line per
problem, naming the setting and the value to set, in ``postgresql.conf`` or the managed service's own setting
(:func:`how_to_set`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

from ..config import StreamConfig, reader_groups
from .ledger.locks import POOL_SIZE

#: a group's sensor, and its delivery run's lease and listener, its reader and its members' lease session
_CONNECTIONS_PER_GROUP = 5
#: housekeeping, checks, metrics and a replay or backfill beside the streams
_CONNECTIONS_SHARED = 4


@dataclass(frozen=True)
class DagsterStorage:
    """Dagster's instance storage when it keeps connections open on a Postgres server (a pool in each
    process): the server's address and how many connections it keeps there at most when idle."""

    host: str
    port: int
    connections: int


@dataclass(frozen=True)
class TagRunLimit:
    """The run queue's limit on the runs of one run tag (``tag_concurrency_limits``): ``limit`` runs at once per
    value of ``key`` (``per_value``: ``applyLimitPerUniqueValue``), or with any value of it together."""

    key: str
    limit: int
    per_value: bool


_LOCAL = frozenset({"localhost", "127.0.0.1", "::1", ""})


def _server(host: str, port: int) -> tuple[str, int]:
    """``host``, ``port`` told apart only as far as the name says: loopback names and socket directories
    are this host."""
    return ("local" if host in _LOCAL or host.startswith("/") else host.lower(), port)


class LimitsExceeded(RuntimeError):
    """Limits the streams do not fit in: one line each (``lines``)."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


#: the managed services, told apart by the role the service creates for its administrator
MANAGED_SERVICES = {"rds_superuser": "rds", "cloudsqlsuperuser": "cloudsql", "azure_pg_admin": "azure"}


def managed_service(conn: psycopg.Connection) -> str | None:
    """``rds`` (RDS, Aurora), ``cloudsql``, ``azure`` (flexible server) or ``None`` (self-hosted), by the
    administrator's role the service creates in the cluster."""
    row = conn.execute("select rolname::text from pg_catalog.pg_roles where rolname operator(pg_catalog.=) any(%s) "
                       "order by 1 limit 1", [list(MANAGED_SERVICES)]).fetchone()
    return MANAGED_SERVICES[row[0]] if row else None


#: per managed service (:func:`managed_service`; ``None``: self-hosted): how its administrator sets a server setting
#: that takes a restart (``{named}``: ``setting = value``), its own setting for ``wal_level = logical``, and how
#: the administrator gives ``{role}`` the right to read replication slots
_SERVICE_STEPS: dict[str | None, tuple[str, str | None, str]] = {
    "rds": ("set {named} in the DB parameter group (Aurora: the DB cluster parameter group) and reboot the instance",
            "rds.logical_replication = 1", "as the master user (rds_superuser): grant rds_replication to {role}"),
    "cloudsql": ("set the database flag {named} and restart the instance", "cloudsql.logical_decoding = on",
                 "as a cloudsqlsuperuser (the postgres user): alter role {role} with replication"),
    "azure": ("set the server parameter {named} and restart the server", None,
              "as the administrator (azure_pg_admin): alter role {role} with replication"),
    None: ("set {named} in postgresql.conf and restart Postgres", None,
           "as a superuser: alter role {role} replication"),
}


def how_to_set(service: str | None, setting: str, value: object) -> str:
    """The words that tell how to set ``setting`` to ``value`` on ``service`` (:func:`managed_service`)."""
    how, logical, _grant = _SERVICE_STEPS[service]
    return how.format(named=logical if logical and setting == "wal_level" else f"{setting} = {value}")


@dataclass(frozen=True)
class ServerLimits:
    wal_level: str
    max_replication_slots: int
    max_wal_senders: int
    max_connections: int
    reserved_connections: int  # superuser_reserved_connections (+ reserved_connections on Postgres 16+)
    service: str | None = None  # the managed service (:func:`managed_service`), None: self-hosted


def _setting(conn: psycopg.Connection, name: str) -> str | None:
    row = conn.execute("select setting from pg_catalog.pg_settings where name = %s", [name]).fetchone()
    return str(row[0]) if row else None


def server_limits(conn: psycopg.Connection) -> ServerLimits:
    reserved = sum(int(_setting(conn, n) or 0) for n in ("superuser_reserved_connections", "reserved_connections"))
    return ServerLimits(wal_level=_setting(conn, "wal_level") or "?",
                        max_replication_slots=int(_setting(conn, "max_replication_slots") or 0),
                        max_wal_senders=int(_setting(conn, "max_wal_senders") or 0),
                        max_connections=int(_setting(conn, "max_connections") or 0),
                        reserved_connections=reserved, service=managed_service(conn))


def _suggest(needed: int) -> int:
    """A value to set for ``needed``: the next multiple of 8, at least ``needed``."""
    return max(8, -(-needed // 8) * 8)


def group_slot_names(conn: psycopg.Connection) -> dict[str, str]:
    """Each reader group's slot name (``pgstream.reader_groups``; none before the group's first tick)."""
    if conn.execute("select pg_catalog.to_regclass('pgstream.reader_groups') is not null").fetchone() != (True,):
        return {}
    return {str(name): str(slot) for name, slot in conn.execute("select name, slot from pgstream.reader_groups")}


def group_slot_problem(conn: psycopg.Connection, group: str) -> str | None:
    """:func:`slot_problem` for reader group ``group``'s slot, with the slots the cluster has in use now."""
    row = conn.execute("select count(*) from pg_catalog.pg_replication_slots").fetchone()
    return slot_problem(server_limits(conn), int(row[0]) if row else 0, [group])


def slot_problem(limits: ServerLimits, in_use: int, missing: Sequence[str]) -> str | None:
    """The line saying that the reader groups ``missing`` (without a slot yet: one slot for each group's
    streams) do not fit in ``max_replication_slots`` with ``in_use`` slots taken, if they do not."""
    free = limits.max_replication_slots - in_use
    if len(missing) <= max(free, 0):
        return None
    short = list(missing[max(free, 0):])
    names = " and ".join(f"reader group {g}" for g in short)
    need = "needs one" if len(short) == 1 else f"need {len(short)}"
    return (f"max_replication_slots is {limits.max_replication_slots} and {in_use} are in use; {names} {need} more: "
            + how_to_set(limits.service, "max_replication_slots", _suggest(in_use + len(missing))))


def replication_problem(conn: psycopg.Connection, service: str | None) -> str | None:
    """The line saying that the session's role (the runtime's login role) may not read replication slots,
    if it may not: a superuser, a role with ``REPLICATION``, or on RDS a member of ``rds_replication`` may."""
    row = conn.execute(
        "select current_user::text, r.rolsuper or r.rolreplication or coalesce(pg_catalog.pg_has_role("
        "current_user, (select g.oid from pg_catalog.pg_roles g where g.rolname operator(pg_catalog.=) "
        "'rds_replication'), 'MEMBER'), false) from pg_catalog.pg_roles r "
        "where r.rolname operator(pg_catalog.=) current_user").fetchone()
    if row is None or row[1]:
        return None
    return (f"role {row[0]} (database_url) may not read replication slots and the reader groups' sensors and "
            f"delivery runs read their slots as it: {_SERVICE_STEPS[service][2].format(role=row[0])}")


def postgres_problems(conn: psycopg.Connection, streams: Sequence[StreamConfig],
                      dagster: DagsterStorage | None = None) -> list[str]:
    """One line per Postgres limit the streams do not fit in (empty: they all fit)."""
    limits = server_limits(conn)
    out: list[str | None] = []  # (None: fits)
    if limits.wal_level != "logical":
        out.append(f"wal_level is {limits.wal_level}; the streams' slots need logical decoding: "
                   + how_to_set(limits.service, "wal_level", "logical"))
    out.append(replication_problem(conn, limits.service))
    # every stream reads with its reader group: one slot, one WAL sender (the group delivery run's reader) per group
    existing = {str(r[0]) for r in conn.execute("select slot_name from pg_catalog.pg_replication_slots")}
    group_slots = group_slot_names(conn)
    groups = list(reader_groups(streams))
    missing = [g for g in groups if group_slots.get(g) not in existing]
    out.append(slot_problem(limits, len(existing), missing))
    # WAL senders other than the groups' readers, told by the slot they hold (application_name may be hidden)
    ours = [group_slots[g] for g in groups if g in group_slots]
    row = conn.execute("select count(*) from pg_catalog.pg_stat_replication r where not exists (select 1 from "
                       "pg_catalog.pg_replication_slots s where s.active_pid operator(pg_catalog.=) r.pid and "
                       "s.slot_name operator(pg_catalog.=) any(%s))", [ours]).fetchone()
    senders_elsewhere = int(row[0]) if row else 0
    if senders_elsewhere + len(groups) > limits.max_wal_senders:
        out.append(f"max_wal_senders is {limits.max_wal_senders} and {senders_elsewhere} are in use by others; "
                   + (f"{len(groups)} reader groups' delivery runs read their group's slot" if len(groups) > 1 else
                      f"reader group {groups[0]}'s delivery run reads its slot")
                   + " over replication, one WAL sender each: "
                   + how_to_set(limits.service, "max_wal_senders", _suggest(senders_elsewhere + len(groups))))
    usable = limits.max_connections - limits.reserved_connections
    # the connections Dagster's storage keeps on this server (0: elsewhere or none)
    storage = (dagster.connections if dagster is not None
               and _server(conn.info.host, conn.info.port) == _server(dagster.host, dagster.port) else 0)
    # a reader group's members hold at most its group delivery run's pool size working at once
    pools = sum(min(len(members), POOL_SIZE) for members in reader_groups(streams).values())
    needed = pools + _CONNECTIONS_PER_GROUP * len(groups) + _CONNECTIONS_SHARED + storage
    if needed > usable:
        of_dagster = f", Dagster's storage on this server {storage}" if storage else ""
        out.append(f"max_connections is {limits.max_connections} ({usable} usable by the streams); {len(streams)} "
                   f"streams in {len(groups)} reader group(s) need up to {needed} (a connection per stream "
                   f"delivering at once, {POOL_SIZE} at most per group, the groups' sensors, readers and "
                   f"leases, housekeeping{of_dagster}): "
                   + how_to_set(limits.service, "max_connections", _suggest(needed + limits.reserved_connections)))
    return [line for line in out if line]


def run_problem(max_concurrent_runs: int | None, streams: Sequence[StreamConfig], where: str) -> str | None:
    """The line saying that the reader groups' delivery runs and one more run do not fit in ``max_concurrent_runs``
    (``None`` or negative: no limit); ``where`` names the instance's configuration."""
    if max_concurrent_runs is None or max_concurrent_runs < 0:
        return None
    groups = list(reader_groups(streams))
    needed = len(groups) + 1
    if needed <= max_concurrent_runs:
        return None
    return (f"max_concurrent_runs is {max_concurrent_runs} and {len(groups)} reader groups keep a group delivery "
            f"run, plus one for housekeeping, checks and replays: a stream "
            f"without a run waits up to delivery.tuning.max_run_secs: set max_concurrent_runs = {_suggest(needed)} "
            f"under run_coordinator.config (or concurrency.runs) in {where}")


def group_run_problem(limit: TagRunLimit | None, streams: Sequence[StreamConfig], where: str) -> str | None:
    """The line saying that the run queue's ``limit`` on the group delivery runs' tag leaves no room for a group
    run's successor beside it (the hand-over every ``max_run_secs`` and at each configuration change: two runs of
    a group at once, one of them waiting), if it does not; ``where`` names the instance's configuration."""
    if limit is None:
        return None
    groups = len(reader_groups(streams))
    pause = ("a group delivery run's successor cannot start beside it, so the group's members pause for a run's "
             "process start at each hand-over (every delivery.tuning.max_run_secs and each configuration change)")
    setting = f"under run_coordinator.config.tag_concurrency_limits in {where}"
    if limit.per_value and limit.limit < 2:
        return (f"the run queue allows {limit.limit} run at once per reader group (run tag {limit.key}): {pause}: "
                f"set limit: 2 for key {limit.key} {setting}")
    if not limit.per_value and limit.limit < groups + 1:
        return (f"the run queue allows {limit.limit} runs at once with run tag {limit.key}, for the delivery runs of "
                f"{groups} reader group(s) together: {pause}: set limit: 2 and value: {{applyLimitPerUniqueValue: "
                f"true}} for key {limit.key} {setting}")
    return None
