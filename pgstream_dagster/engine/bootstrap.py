"""Bootstrap a database for ``pgstream.yaml`` (``pgstream-dagster init``): migrations, today's
partitions, the streams and their slots, the YAML subscriptions."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from ..config import PgstreamConfig, reader_groups
from .dbconn import connect, describe_url, error_line
from .limits import DagsterStorage, LimitsExceeded, TagRunLimit, group_run_problem, postgres_problems, run_problem


class InitError(RuntimeError):
    """``init`` stopped at a database error: one line naming the URL it used (its role, never the URL)
    and Postgres' message."""


@contextmanager
def _as(role: str, url: str) -> Iterator[None]:
    """A database error in the block becomes an :class:`InitError` naming ``role`` (who, and which
    setting its URL came from)."""
    who, _, source = role.partition(" from ")
    try:
        yield
    except psycopg.Error as exc:
        raise InitError(f"init as the {who} ({describe_url(url)}, from {source}): {error_line(exc)}") from None


def preflight(config: PgstreamConfig, max_concurrent_runs: int | None = None,
              runs_where: str = "dagster.yaml", dagster: DagsterStorage | None = None,
              group_runs: TagRunLimit | None = None) -> list[str]:
    """One line per Postgres or Dagster limit the streams of ``config`` do not fit in (empty: they fit);
    ``dagster``: its storage's connections on the same server, ``group_runs``: its run queue's limit on the group
    delivery runs, ``runs_where``: the file of its limits."""
    with connect(config.database_url.get_secret_value(), autocommit=True) as conn:
        lines = postgres_problems(conn, config.streams, dagster)
    runs = [run_problem(max_concurrent_runs, config.streams, runs_where),
            group_run_problem(group_runs, config.streams, runs_where)]
    return [*lines, *(line for line in runs if line)]


def init(config_path: Path | None = None, owner_url: str | None = None,
         defs_folder: Path | str | None = None, max_concurrent_runs: int | None = None,
         runs_where: str = "dagster.yaml", dagster: DagsterStorage | None = None,
         group_runs: TagRunLimit | None = None) -> list[str]:
    """:func:`preflight` (:class:`~.limits.LimitsExceeded` before any change); as the owner: migrate, housekeeping,
    the subscriptions (``defs_folder``'s too); as the runtime: the streams in their groups, the groups' slots."""
    from ..config import load_config
    from .housekeeping import run_housekeeping
    from .ingest.group import GroupResult, ensure_group
    from .migrations import migrate
    from .subscriptions import apply_subscriptions

    config = load_config(config_path, defs_folder)
    url = config.database_url.get_secret_value()
    owner = owner_url or url
    runtime = "runtime from database_url"
    owner_role = ("owner from --owner-database-url / PGSTREAM_OWNER_DATABASE_URL" if owner_url
                  else "owner from database_url (no owner URL given)")
    with _as(runtime, url):
        problems = preflight(config, max_concurrent_runs, runs_where, dagster, group_runs)
    if problems:
        raise LimitsExceeded(problems)
    with _as(owner_role, owner):
        out = [f"applied migration {m}" for m in migrate(owner, partitions_ahead=config.housekeeping.days_ahead)]
    with _as(owner_role, owner), connect(owner, autocommit=True) as conn:
        report = run_housekeeping(conn, config.housekeeping)
        if report.created or report.dropped or report.kept or report.busy or report.batches_pruned \
                or report.default_rows_deleted:
            out.append(report.summary())
    with _as(runtime, url), connect(url, autocommit=True) as conn:
        for group, members in reader_groups(config.streams).items():
            # registers the streams (a stream that had its own slot joins at the group sensor's first tick)
            grouped = GroupResult()
            ensure_group(conn, group, members, grouped)
            out += grouped.left_out.values()  # (a member refused is left out, the others registered)
            if grouped.slot_created:
                out.append(f"created slot {grouped.slot} for reader group {group} (streams "
                           f"{', '.join(str(s.id) for s in members)})")
    with _as(owner_role, owner), connect(owner, autocommit=True) as conn:
        for action, key, stream_id in apply_subscriptions(conn, config):
            out.append(f"{action} subscription {key!r} (stream {stream_id})")
    return out
