"""``pgstream-dagster`` command line: migrate, tear-down, init, status, pause, resume, dev."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _database_url(args: argparse.Namespace) -> str:
    url = args.database_url or os.environ.get("PGSTREAM_DATABASE_URL")
    if not url:
        raise SystemExit("error: no database: pass --database-url or set PGSTREAM_DATABASE_URL")
    return url


def _cmd_migrate(args: argparse.Namespace) -> int:
    from .migrations import migrate

    applied = migrate(_database_url(args), partitions_ahead=args.days_ahead)
    if applied:
        for name in applied:
            print(f"applied {name}")
    else:
        print("up to date")
    return 0


def _cmd_tear_down(args: argparse.Namespace) -> int:
    from .migrations import tear_down

    if not args.yes:
        print("error: tear-down deletes all pgstream state, undelivered events included; pass --yes",
              file=sys.stderr)
        return 2
    removed = tear_down(_database_url(args))
    for item in removed:
        print(f"removed {item}")
    if not removed:
        print("nothing to remove")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pgstream-dagster", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--database-url", help="Postgres URL (default: $PGSTREAM_DATABASE_URL)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("migrate", parents=[common], help="apply the sql/ migrations (idempotent)")
    p.add_argument("--days-ahead", type=int, default=7, help="daily partitions to create ahead")
    p.set_defaults(func=_cmd_migrate)

    p = sub.add_parser("tear-down", parents=[common],
                       help="remove the pgstream schema, generated triggers, publications and slots")
    p.add_argument("--yes", action="store_true", help="confirm: all events are deleted")
    p.set_defaults(func=_cmd_tear_down)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:  # a clear one-line error, not a traceback, for operators
        from .migrations import MigrationError

        if isinstance(exc, MigrationError) or type(exc).__module__.startswith("psycopg"):
            print(f"error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
