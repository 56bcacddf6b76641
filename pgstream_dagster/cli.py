"""The pgstream-dagster command line: install and migrate the pgstream schema, apply the streams of
pgstream.yaml, operate the streams (status, controls, dead letters, consumers, backfills), serve their
metrics, run the local demo and a Spark Connect server, write the reference docs."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack, closing, nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import psycopg

from . import __version__

if TYPE_CHECKING:
    from .config import PgstreamConfig
    from .engine.controls import Action
    from .engine.limits import DagsterStorage, TagRunLimit


def _ranged(name: str, low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (what the database's column takes)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{name} must be between {low} and {high}, got {value}")
        return value

    parse.__name__ = name  # argparse names the type in its messages
    return parse


_ID = _ranged("id", 1, 2**63 - 1)
_COUNT = _ranged("count", 0, 2**31 - 1)


class _Refused(Exception):
    """A command's refusal: its message on stderr, its exit status ``code`` (:func:`main`)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _open(url: str) -> psycopg.Connection:
    """An autocommit connection to ``url`` with the engine's pinned search path (``pg_catalog, pg_temp``: an
    operator's command runs as the owner or a superuser, and another role's function or operator on its search
    path must not run with those rights) and the password masked in a connection error."""
    from .engine.dbconn import connect

    return connect(url, autocommit=True)


def _connect(args: argparse.Namespace) -> psycopg.Connection:
    return _open(_database_url(args))


def _config(args: argparse.Namespace) -> PgstreamConfig:
    """``--config`` (default ``$PGSTREAM_CONFIG``) with the StreamComponents of ``--defs-folder``."""
    from .config import load_config

    return load_config(Path(args.config) if args.config else None, _defs_folder(args))  # (ConfigError: exit 1)


def _database_url(args: argparse.Namespace) -> str:
    url = args.database_url or os.environ.get("PGSTREAM_DATABASE_URL")
    if not url:
        raise SystemExit("error: no database: pass --database-url or set PGSTREAM_DATABASE_URL")
    return url


def _owner_url(args: argparse.Namespace) -> str:
    """The owner's URL (``migrate``, ``tear-down``): ``--database-url``, else ``$PGSTREAM_OWNER_DATABASE_URL``,
    else ``$PGSTREAM_DATABASE_URL`` (an install where one role is both)."""
    url = (args.database_url or os.environ.get("PGSTREAM_OWNER_DATABASE_URL")
           or os.environ.get("PGSTREAM_DATABASE_URL"))
    if not url:
        raise SystemExit("error: no database: pass --database-url (the owner's) or set PGSTREAM_OWNER_DATABASE_URL "
                         "(or PGSTREAM_DATABASE_URL when one role is both)")
    return url


def _defs_folder(args: argparse.Namespace) -> str | None:
    return args.defs_folder or os.environ.get("PGSTREAM_DEFS_FOLDER") or None


def _add_defs_folder(p: argparse.ArgumentParser, config: bool = False) -> None:
    if config:
        p.add_argument("--config", help="pgstream.yaml (default: $PGSTREAM_CONFIG or ./pgstream.yaml)")
    p.add_argument("--defs-folder", metavar="DIR",
                   help="also the streams declared as pgstream_dagster.StreamComponent in the defs.yaml files under "
                        "DIR, the project's defs folder (default: $PGSTREAM_DEFS_FOLDER)")


def _cmd_migrate(args: argparse.Namespace) -> None:
    from .engine.migrations import migrate

    url = _owner_url(args)
    print("\n".join(f"applied {name}" for name in migrate(url, partitions_ahead=args.days_ahead)) or "up to date")
    _warn_without_drift_guard(url)


def _warn_without_drift_guard(owner_url: str) -> None:
    """``migrate`` and ``init``: say on stderr, in one line, that the drift guard is off (an install by a
    non-superuser owner, as on a managed service), and what that leaves open."""
    from .engine.migrations import DRIFT_GUARD_MISSING, drift_guard_installed

    with _open(owner_url) as conn:
        if not drift_guard_installed(conn):
            print(DRIFT_GUARD_MISSING, file=sys.stderr)


def _cmd_install_drift_guard(args: argparse.Namespace) -> None:
    from .engine.migrations import DRIFT_GUARD_TRIGGERS, install_drift_guard

    install_drift_guard(args.database_url)
    print(f"the schema-drift guard is active (event triggers {', '.join(DRIFT_GUARD_TRIGGERS)})")


def _cmd_tear_down(args: argparse.Namespace) -> None:
    from .engine.migrations import TearDownRefused, tear_down

    if not args.yes:
        raise _Refused("error: tear-down deletes all pgstream state, undelivered events included; pass --yes", 2)
    try:
        removed = tear_down(_owner_url(args), cascade=args.cascade)
    except TearDownRefused as exc:
        raise _Refused("\n".join(["error: tear-down would also drop these objects outside schema pgstream, which "
                                  "depend on it (nothing was changed):", *exc.objects, "remove them (or their "
                                  "dependency on pgstream) first, or pass --cascade to drop them too"]), 2) from None
    print("\n".join(f"removed {item}" for item in removed) or "nothing to remove")


def _instance_limits() -> tuple[int | None, str, DagsterStorage | None, TagRunLimit | None]:
    """The Dagster instance's ``max_concurrent_runs`` (``$DAGSTER_HOME``; ``None``: no instance or no
    limit), the file that sets it, the connections its storage keeps open (``None``: none) and its run queue's
    limit on the group delivery runs (``None``: none)."""
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        return None, "dagster.yaml", None, None
    import dagster as dg

    from .defs.limits import group_run_limit, max_concurrent_runs, storage_connections

    with dg.DagsterInstance.get() as instance:
        runs = max_concurrent_runs(instance)
        return runs, str(Path(home) / "dagster.yaml"), storage_connections(instance, runs), group_run_limit(instance)


def _cmd_check(args: argparse.Namespace) -> None:
    config = _config(args)
    print(f"{len(config.streams)} streams and {len(config.subscriptions)} subscriptions are valid "
          f"(reader groups: {', '.join(sorted({s.reader for s in config.streams}))})")


def _cmd_preflight(args: argparse.Namespace) -> None:
    from .engine.bootstrap import preflight

    config = _config(args)
    if problems := preflight(config, *_instance_limits()):
        raise _Refused("\n".join(problems))
    checked = "" if os.environ.get("DAGSTER_HOME") else " (max_concurrent_runs not checked: DAGSTER_HOME is not set)"
    print(f"{len(config.streams)} streams fit in this server's and instance's limits{checked}")


def _cmd_init(args: argparse.Namespace) -> None:
    from .engine.bootstrap import init
    from .engine.limits import LimitsExceeded

    owner = args.owner_database_url or os.environ.get("PGSTREAM_OWNER_DATABASE_URL") or None
    runs, where, dagster, group_runs = _instance_limits()
    try:
        lines = init(Path(args.config) if args.config else None, owner_url=owner, defs_folder=_defs_folder(args),
                     max_concurrent_runs=runs, runs_where=where, dagster=dagster, group_runs=group_runs)
    except LimitsExceeded as exc:
        raise _Refused(str(exc)) from None  # (its lines)
    for line in lines:
        print(line)
    _warn_without_drift_guard(owner or _config(args).database_url.get_secret_value())
    print("ready")


def _cmd_status(args: argparse.Namespace) -> None:
    from .engine import status

    with _connect(args) as conn:
        streams = status.stream_status(conn, args.stream, args.batches)
        if args.stream is not None and not streams:
            raise _Refused(f"error: stream {args.stream} does not exist in this database (`pgstream-dagster status` "
                           "lists the streams it has)")
        orphans = status.render_orphaned_slots(status.orphaned_slots(conn)) if args.stream is None else ""
        print(status.render_status(streams) + orphans)
    if args.stream is None and (said := status.render_standby_slots(status.standby_slots(_database_url(args)))):
        print(said.lstrip("\n"))


def _cmd_reconcile(args: argparse.Namespace) -> None:
    from .engine import reconcile
    from .sinks import LAKE_SINK_TYPES, build_sink
    from .sinks.lake import LakeSink

    config = _config(args)
    stream = config.stream(args.stream)
    received: list[int] = []
    if args.received is not None:
        text = sys.stdin.read() if args.received == "-" else Path(args.received).read_text()
        for number, line in enumerate(text.splitlines(), 1):
            for word in line.replace(",", " ").split():
                if not word.isdigit():
                    raise _Refused(f"error: {args.received} line {number}: {word[:40]!r} is not an event id", 2)
                received.append(int(word))
    with _open(args.database_url or config.database_url.get_secret_value()) as conn:
        ended = reconcile.ended_timelines(conn, stream.id)
        if not ended:
            print(f"stream {stream.id}: every event this database holds was written on its current timeline: no "
                  "failover to reconcile")
            return
        for timeline in ended:
            print(timeline.describe(stream.id))
        sources: list[tuple[str, list[int]]] = []
        if args.received is not None:
            sources.append((f"of the {len(received)} ids in {args.received}", received))
        if stream.sink.type in LAKE_SINK_TYPES:
            sink = build_sink(stream.sink)
            assert isinstance(sink, LakeSink)
            with sink:
                held = reconcile.lake_ids(sink, stream.id, ended)
            sources.append((f"in its {stream.sink.type} table ({sink.where()})", held))
        for what, ids in sources:
            lost = reconcile.phantoms(conn, stream.id, ids, ended)
            print(f"stream {stream.id}: {len(lost)} events {what} are missing from this database (phantoms of the "
                  f"failover){': ' + ', '.join(map(str, lost)) if lost else ''}")
        if not sources:
            print(f"stream {stream.id}: its {stream.sink.type} sink cannot be read back: pass --received with the ids "
                  "it got (the webhook-id / Idempotency-Key of each event) to list the phantoms")


def _cmd_consumers_list(args: argparse.Namespace) -> None:
    from .engine.status import consumers, render_consumer

    with _connect(args) as conn:
        print("\n".join(render_consumer(c) for c in consumers(conn, args.stream)) or "no registered consumers")


def _cmd_consumers_add(args: argparse.Namespace) -> None:
    # one statement: the token is issued only to a consumer this registers, in its transaction
    token = _consumer_call(args, "add", "select case when pgstream.register_consumer(%s, %s, %s, %s) then "
                           "pgstream.consumer_token(%s) end", args.stream, args.from_start, args.retention_days,
                           args.name)
    if token is None:
        print(f"consumer {args.name} of stream {args.stream} was registered already: nothing changed "
              f"(`pgstream-dagster consumers token {args.name}` issues a new token)")
        return
    start = "before every batch the stream's ledger has" if args.from_start else "at the end of the stream's ledger"
    print(f"registered consumer {args.name} of stream {args.stream}, its position {start}: housekeeping keeps "
          f"what it has not read for up to {args.retention_days} days")
    _print_token(token)


def _consumer_call(args: argparse.Namespace, command: str, query: str, *params: object, found: bool = False) -> Any:
    """The value of ``query``, a consumer function of schema pgstream given ``args.name`` and ``params``: a value
    the function refuses is exit 2; with ``found``, a consumer the database does not have (null, false) exit 1."""
    with _connect(args) as conn:
        try:
            row = conn.execute(query, [args.name, *params]).fetchone()
        except psycopg.errors.InvalidParameterValue as exc:
            raise _Refused(f"error: consumers {command}: {exc.diag.message_primary}", 2) from None
    if found and not (row and row[0]):
        raise _Refused(f"error: no registered consumer {args.name!r}")
    return row[0] if row else None


def _print_token(token: str) -> None:
    print("its token (the query's option consumerToken; shown once, stored hashed; keep it secret like a "
          f"password):\n{token}")


def _cmd_consumers_token(args: argparse.Namespace) -> None:
    token = _consumer_call(args, "token", "select pgstream.consumer_token(%s)", found=True)
    print(f"consumer {args.name}: a new token; the last one no longer records its position")
    _print_token(token)


def _cmd_consumers_drop(args: argparse.Namespace) -> None:
    _consumer_call(args, "drop", "select pgstream.drop_consumer(%s)", found=True)
    print(f"dropped consumer {args.name}: housekeeping no longer keeps events for it")


def _cmd_consumers_retention(args: argparse.Namespace) -> None:
    _consumer_call(args, "retention", "select pgstream.set_consumer_retention(%s, %s)", args.days, found=True)
    print(f"consumer {args.name}: housekeeping keeps its unread events for up to {args.days} days")


def _control(args: argparse.Namespace, action: Action, **kwargs: Any) -> None:
    """``action`` on ``args.stream`` (its batch, or ``kwargs``: a dead letters control's)."""
    from .engine.controls import ControlError, apply_control

    if action == "skip_batch" and not args.yes:
        raise _Refused(f"error: skipping batch {args.batch} means its events are not delivered (they stay in "
                       "pgstream.events for a replay); pass --yes", 2)
    with _connect(args) as conn:
        try:
            print(apply_control(conn, args.stream, action, getattr(args, "batch", None), **kwargs))
        except ControlError as exc:
            raise _Refused(f"error: {exc}") from None


def _operator() -> str:
    """Who runs the command, kept with the dead letters it resolves."""
    import getpass

    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = str(os.getuid()) if hasattr(os, "getuid") else "unknown"
    return f"cli {user}"


def _cmd_dead_letters_list(args: argparse.Namespace) -> None:
    from .engine.deadletters import list_dead_letters

    with _connect(args) as conn:
        letters = list_dead_letters(conn, args.stream, None if args.all else "open", args.limit)
    which = "dead letters" if args.all else "open dead letters"
    if not letters:
        print(f"no {which}" + (f" in stream {args.stream}" if args.stream is not None else ""))
        return
    for letter in letters:
        print(letter.describe())
    if len(letters) == args.limit:
        print(f"(first {args.limit} {which}; --limit N for more)")


def _cmd_dead_letters_show(args: argparse.Namespace) -> None:
    from .engine.deadletters import get_dead_letter

    with _connect(args) as conn:
        d = get_dead_letter(conn, args.id)
    print(f"dead letter {d.id}: stream {d.stream_id}, event {d.event_id}, {d.status}")
    print(f"  stage: {d.stage} (" + ("the sink rejected it, or an operator set it aside" if d.stage == "deliver"
                                     else "the sensor could not record it") + ")")
    print(f"  position: {d.position}")
    print(f"  overtaken by: {d.overtaken} delivered events of stream {d.stream_id} after its position")
    if d.status == "open" and d.waiting_for_batch is not None:
        print(f"  redelivery waits for batch {d.waiting_for_batch} (not delivered yet)")
    print(f"  event created at: {d.event_created_at or '- (unreadable)'}")
    print(f"  set aside at: {d.created_at}; updated {d.updated_at}; attempts {d.attempts}; sink {d.sink or '-'}")
    if d.resolved_at is not None:
        print(f"  {d.status} at {d.resolved_at} by {d.resolved_by}")
    print(f"  error: {d.error}")
    if d.undeliverable and d.status == "open":
        print(f"  cannot be redelivered: {d.undeliverable}; discard it")
    print("  payload: " + ("-" if d.payload_json is None else _indented_json(d.payload_json)))
    print(f"  metadata: {d.metadata_json or '-'}")


def _indented_json(text: str) -> str:
    """JSON text indented for ``show``; as stored when Python cannot parse it (an integer over its
    conversion limit, nesting deeper than its recursion limit): the dead letter is shown all the same."""
    import json

    try:
        return str(json.dumps(json.loads(text), indent=2, ensure_ascii=False)).replace("\n", "\n  ")
    except (ValueError, RecursionError):
        return text


def _cmd_dead_letters_redeliver(args: argparse.Namespace) -> int:
    from .engine.deadletters import redeliver
    from .engine.ledger import locks

    config = _config(args)
    stream = config.stream(args.stream)
    url = args.database_url or config.database_url.get_secret_value()
    with ExitStack() as held:
        if not args.dry_run:  # the stream's delivery lease, as a replay holds it: never between live deliveries
            held.enter_context(locks.acquire_replay_lease(
                url, stream.id, _operator(), lambda what: print(f"waiting for {what}", file=sys.stderr)))
        with _open(url) as conn:
            report = redeliver(conn, stream, args.ids or None, _operator(), args.chunk_size, dry_run=args.dry_run)
    first, *problems = report.lines()
    print(first)
    for line in problems:
        print(line, file=sys.stderr)
    return 0 if report.complete else 1


def _cmd_dead_letters_discard(args: argparse.Namespace) -> None:
    if bool(args.ids) == args.all:
        raise _Refused("error: give dead letter ids or --all (one of them)", 2)
    if not args.yes:
        what = "every open dead letter" if args.all else f"dead letters {', '.join(map(str, args.ids))}"
        raise _Refused(f"error: discarding {what} of stream {args.stream} means their events are never delivered; "
                       "pass --yes", 2)
    _control(args, "discard_dead_letters", dead_letter_ids=args.ids, all_dead_letters=args.all, by=_operator())


def _cmd_dead_letters_set_aside(args: argparse.Namespace) -> None:
    if not args.yes:
        raise _Refused(f"error: setting events aside means delivery goes on without them (they wait as dead letters "
                       f"of stream {args.stream}); pass --yes", 2)
    _control(args, "set_aside", event_ids=args.event_ids, reason=args.reason)


def _cmd_backfill_run(args: argparse.Namespace) -> int:
    from .engine import backfill
    from .engine.spark import open_session

    config = _config(args)
    config.stream(args.stream)  # the stream must be declared
    url = args.database_url or config.database_url.get_secret_value()
    request = backfill.Request(args.stream, args.keys, table=args.table, where=args.where, from_key=args.from_key,
                               to_key=args.to_key, chunk_size=args.chunk_size, parallelism=args.parallelism,
                               max_rows_per_sec=args.max_rows_per_sec or None, max_backlog=args.max_backlog or None,
                               restart=args.restart)
    with _open(url) as conn:
        chosen = backfill.targets(conn, request)
    spark = open_session(config)
    unfinished = 0
    for target in chosen:
        with _open(url) as conn:
            backfill_id, resumed = backfill.open_backfill(conn, target, request)
        print(f"{'resuming' if resumed else 'starting'} backfill {backfill_id} of {target.describe()}", flush=True)
        with closing(backfill.run(url, backfill_id, request, backfill.spark_executor(spark, config.executor_url),
                                  run_id=f"cli {_operator()}", progress_secs=args.progress_secs,
                                  on_stop=lambda: backfill.cancel_spark(spark))) as steps:
            for step in steps:
                if isinstance(step, backfill.Progress):
                    print(step.line(), flush=True)
                else:
                    print(step.progress.line(), flush=True)
                    unfinished += 0 if step.done else 1
    return 0 if unfinished == 0 else 1


def _cmd_backfill_list(args: argparse.Namespace) -> None:
    from .engine import backfill

    with _connect(args) as conn:
        print("\n".join(p.line() for p in backfill.list_backfills(conn, args.stream)) or "no backfills")


def _cmd_backfill_stop(args: argparse.Namespace, cancel: bool) -> None:
    from .engine import backfill

    if cancel and not args.yes:
        raise _Refused(f"error: cancelling backfill {args.id} is final (a new backfill starts over); pass --yes", 2)
    with _connect(args) as conn:
        before = backfill.stop(conn, args.id, cancel=cancel)
        after = backfill.progress(conn, args.id)
    print(f"backfill {args.id}: {before} -> {after.status}")


def _cmd_metrics(args: argparse.Namespace) -> None:
    from .config import MetricsSettings, config_path, load_metrics_settings
    from .exporter import serve_forever, start

    path = Path(args.config) if args.config else config_path()
    # with --database-url the file's database_url (and the variables it names) is not needed
    settings = (load_metrics_settings(path, database_url=not args.database_url) if args.config or path.exists()
                else MetricsSettings())
    metrics = settings.metrics
    secret = metrics.database_url or settings.database_url
    url = (args.database_url or (secret.get_secret_value() if secret else None)
           or os.environ.get("PGSTREAM_DATABASE_URL"))
    if not url:
        raise SystemExit("error: no database: pass --database-url, set metrics.database_url or database_url in "
                         "pgstream.yaml, or set PGSTREAM_DATABASE_URL")
    exporter = start(url, args.host or metrics.host, metrics.port if args.port is None else args.port,
                     metrics.scrape_timeout_secs)
    serve_forever(exporter, lambda line: print(line, flush=True), exit_with_parent=args.exit_with_parent)


def _cmd_dev(args: argparse.Namespace) -> int:
    from .dev import dev_services, run_dev, stop_dev

    root = Path(args.root).resolve()
    if args.status:
        print("\n".join(dev_services(root)))
        return 0
    if args.stop:
        print("\n".join(stop_dev(root)) or f"no service of `make dev` runs in {root / '.pgstream'}")
        return 0
    return run_dev(port=args.port, root=root, spark_server=not args.no_spark_server)


def _cmd_executor_requirements(args: argparse.Namespace) -> None:
    from .engine.cluster import executor_requirements

    sinks = list(args.sink or [])
    if args.config:
        sinks += [s.sink.type for s in _config(args).streams if s.delivery.ordering == "by_key"]
    print("\n".join(executor_requirements(sinks)))


class _Terminated(BaseException):
    """SIGTERM or SIGHUP (what a service manager sends): stop the server, then exit."""


def _cmd_spark_connect(args: argparse.Namespace) -> int:
    """Run a Spark Connect server in the foreground until interrupted (Ctrl-C) or terminated (SIGTERM, SIGHUP): either
    way its whole process group (the JVM and its Python workers) is stopped before this process exits."""
    import signal
    import subprocess

    from . import sparkserver

    if args.stop:
        stopped = sparkserver.stop_recorded(Path(".pgstream"))
        print("stopped the Spark Connect server of `make dev`" if stopped else "no Spark Connect server recorded")
        return 0
    conf = dict(_key_value(item) for item in args.conf or [])

    def terminate(signum: int, _frame: object) -> None:
        raise _Terminated(signum)

    previous = {sig: signal.signal(sig, terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(sparkserver.command(args.port, args.master, host=args.host, conf=conf),
                                env=sparkserver.environment(conf, args.master), start_new_session=True)
        print(f"Spark Connect server (pid {proc.pid}) on sc://{args.host}:{args.port}; set spark.remote to it",
              flush=True)
        return proc.wait()
    except (KeyboardInterrupt, _Terminated):
        return 0
    finally:
        # the server is stopped whatever ends this process; a second signal does not interrupt that
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        if proc is not None and proc.poll() is None:
            sparkserver.stop(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cmd_docs(args: argparse.Namespace) -> None:
    from . import docs_gen

    with nullcontext(args.database_url) if args.database_url else docs_gen.scratch_database() as url:
        changed = docs_gen.write(Path(args.root), url, build_parser())
    for path in changed:
        print(f"wrote {path}")
    print(f"{len(changed)} page(s) changed")


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise SystemExit(f"error: --conf expects KEY=VALUE, got {item.split('=')[0]!r}")
    return key.strip(), value


class _Parser(argparse.ArgumentParser):
    """The command line's parser (its commands' too): argparse echoes a value it refuses (``invalid choice:
    'postgresql://app:pw@host/db'``, a URL given where a command was expected), so a password in it is masked."""

    def error(self, message: str) -> NoReturn:
        from .sinks.base import scrub_conninfo

        super().error(scrub_conninfo(message))

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """A command's option it does not take is named (argparse read the value after it as the command's next
        argument and refused that instead: ``status --config x.yaml`` said ``id must be an integer, got 'x.yaml'``)."""
        if self._subparsers is None:  # a command (a group's options are its commands')
            taken = [o for o in self._option_string_actions if o.startswith("--")]
            for token in args if args is not None else sys.argv[1:]:
                if token == "--":
                    break
                name = token.split("=", 1)[0]
                if name.startswith("--") and not any(o.startswith(name) for o in taken):
                    options = [o for o in taken if o != "--help"]
                    self.error(f"unknown option {name}: this command takes "
                               + (f"{', '.join(options)} (--help describes them)" if options else "no options"))
        return super().parse_known_args(args, namespace)


def _command(sub: argparse._SubParsersAction[_Parser], name: str,
             func: Callable[[argparse.Namespace], int | None] | None, text: str, *parents: _Parser) -> _Parser:
    """The command ``name``, run by ``func`` (its exit status; ``None``: 0): ``text``, its line in its group's list,
    is also what ``COMMAND --help`` opens with."""
    p = sub.add_parser(name, parents=list(parents), help=text, description=text)
    if func is not None:
        p.set_defaults(func=func)
    return p


def _group(sub: argparse._SubParsersAction[_Parser], name: str, text: str) -> argparse._SubParsersAction[_Parser]:
    """A group of commands. Its subparsers have no ``dest``: called without its command, argparse names the ones
    it takes (``the following arguments are required: {list,add,token,drop,retention}``)."""
    return _command(sub, name, None, text).add_subparsers(required=True)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pgstream-dagster")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the installed release and exit")
    common = _Parser(add_help=False)
    common.add_argument("--database-url", help="Postgres URL (default: $PGSTREAM_DATABASE_URL)")
    sub = parser.add_subparsers(required=True)

    owner = _Parser(add_help=False)
    owner.add_argument("--database-url", help="the owner's Postgres URL (default: $PGSTREAM_OWNER_DATABASE_URL, "
                                              "else $PGSTREAM_DATABASE_URL)")
    p = _command(sub, "migrate", _cmd_migrate, "apply the sql/ migrations as the owner (idempotent)", owner)
    p.add_argument("--days-ahead", type=_ranged("days", 0, 365), default=7, help="daily partitions to create ahead")

    p = _command(sub, "install-drift-guard", _cmd_install_drift_guard,
                 "create the schema-drift guard's event triggers as a superuser (--database-url), on an install "
                 "whose owner is not one (on Amazon RDS, as the master user)")
    p.add_argument("--database-url", required=True,
                   help="a superuser's Postgres URL of the pgstream database (on Amazon RDS: the master user's; "
                        "required, no default: only a superuser may create event triggers, and neither the owner's "
                        "nor the runtime's URL is one)")

    p = _command(sub, "tear-down", _cmd_tear_down,
                 "remove the pgstream schema, generated triggers, publications and slots", owner)
    p.add_argument("--yes", action="store_true", help="confirm: all events are deleted")
    p.add_argument("--cascade", action="store_true",
                   help="also drop the objects outside schema pgstream that depend on it (listed without it)")

    p = _command(sub, "init", _cmd_init, "migrate and apply the YAML subscriptions as the owner; register the streams "
                                         "in their reader groups and create the groups' slots as the runtime "
                                         "(database_url)")
    p.add_argument("--config", help="pgstream.yaml (default: $PGSTREAM_CONFIG or ./pgstream.yaml)")
    p.add_argument("--owner-database-url", help="the owner's Postgres URL (default: $PGSTREAM_OWNER_DATABASE_URL, "
                                                "else database_url of pgstream.yaml)")
    _add_defs_folder(p)

    p = _command(sub, "check", _cmd_check, "validate pgstream.yaml (and the StreamComponents of --defs-folder) "
                                           "without connecting anywhere, as strictly as init applies it: one line per "
                                           "problem, exit 1 (the code location only leaves an invalid stream out; run "
                                           "this in CI)")
    _add_defs_folder(p, config=True)

    p = _command(sub, "preflight", _cmd_preflight,
                 "check the Postgres and Dagster limits the streams need (wal_level, database_url's replication "
                 "right, max_replication_slots, max_wal_senders, max_connections, the max_concurrent_runs and "
                 "pgstream/group run limit of $DAGSTER_HOME's instance): one line per problem naming the setting to "
                 "change (on RDS, Cloud SQL or Azure: the service's), exit 1")
    _add_defs_folder(p, config=True)

    p = _command(sub, "status", _cmd_status, "state, failover checkpoint, backlog, slot lag and last batches of every "
                                             "stream", common)
    p.add_argument("stream", type=_ID, nargs="?", help="only this stream")
    p.add_argument("--batches", type=_COUNT, default=5, help="last batches to show per stream")

    p = _command(sub, "reconcile", _cmd_reconcile,
                 "after a failover of the primary with its standby behind: the events a stream's sink received that "
                 "this database lacks (phantoms), read from a lake table or given", common)
    p.add_argument("stream", type=_ID, help="the stream")
    p.add_argument("--received", metavar="FILE", help="event ids the sink received, whitespace or comma separated "
                                                      "(- : standard input)")
    _add_defs_folder(p, config=True)

    consumer = _group(sub, "consumers", "the registered consumers (the Spark source's streaming queries): add, list, "
                                        "drop, set how long housekeeping keeps what they have not read")
    p = _command(consumer, "list", _cmd_consumers_list, "position, lag and bound of each consumer", common)
    p.add_argument("stream", type=_ID, nargs="?", help="only this stream's")
    p = _command(consumer, "add", _cmd_consumers_add,
                 "register a consumer (a streaming query's consumer option) and print its token (its consumerToken "
                 "option): the query records its position with it, and housekeeping keeps what it has not read",
                 common)
    p.add_argument("name", help="the consumer's name (1-100 letters, digits, _ . : -)")
    p.add_argument("stream", type=_ID, help="the stream it reads")
    p.add_argument("--from-start", action="store_true",
                   help="start before every batch the stream's ledger has (default: at its end)")
    p.add_argument("--retention-days", type=int, default=30, help="1-3650 (default 30)")
    p = _command(consumer, "token", _cmd_consumers_token, "issue a consumer a new token (its query's consumerToken "
                                                          "option); the last one stops working", common)
    p.add_argument("name", help="the consumer's name")
    p = _command(consumer, "drop", _cmd_consumers_drop, "forget a consumer (an abandoned query): housekeeping stops "
                                                        "keeping events for it", common)
    p.add_argument("name", help="the consumer's name (the source's consumer option)")
    p = _command(consumer, "retention", _cmd_consumers_retention,
                 "days housekeeping keeps what a consumer has not read (default 30)", common)
    p.add_argument("name", help="the consumer's name")
    p.add_argument("days", type=int, help="1-3650")

    controls: tuple[tuple[str, Action, str], ...] = (
        ("pause", "pause", "stop starting deliveries (the slot keeps being consumed, so WAL is still released)"),
        ("resume", "resume", "start deliveries again"),
        ("retry-now", "retry_now", "retry the failover checkpoint now instead of after the backoff"),
        ("skip", "skip_batch", "give up on an undelivered batch (its events stay in the table for a replay)"),
    )
    for name, action, text in controls:
        p = _command(sub, name, partial(_control, action=action), text, common)
        p.add_argument("stream", type=_ID, help="the stream's id")
        if action == "skip_batch":
            p.add_argument("batch", type=_ID, help="the undelivered batch's id (status STREAM lists them)")
            p.add_argument("--yes", action="store_true", help="confirm: the batch's events are not delivered")

    dl = _group(sub, "dead-letters", "list, show, redeliver, discard dead letters; set events aside")

    p = _command(dl, "list", _cmd_dead_letters_list, "open dead letters (all streams, or STREAM), in delivery order",
                 common)
    p.add_argument("stream", type=_ID, nargs="?", help="only this stream")
    p.add_argument("--all", action="store_true", help="also redelivered and discarded ones")
    p.add_argument("--limit", type=_COUNT, default=100, help="show at most N (default 100)")

    p = _command(dl, "show", _cmd_dead_letters_show, "everything about one dead letter: payload, error, position, how "
                                                     "many later events overtook it", common)
    p.add_argument("id", type=_ID, help="the dead letter's id (dead-letters list shows them)")

    p = _command(dl, "redeliver", _cmd_dead_letters_redeliver,
                 "publish open dead letters of STREAM (all, or the IDs) through its sink, in delivery order; stops at "
                 "the first one the sink refuses", common)
    p.add_argument("stream", type=_ID, help="the stream whose dead letters to redeliver")
    p.add_argument("ids", type=_ID, nargs="*", metavar="ID", help="only these dead letters (default: all open)")
    p.add_argument("--config", help="pgstream.yaml with the stream's sink (default: $PGSTREAM_CONFIG or "
                                    "./pgstream.yaml); its database_url unless --database-url is given")
    p.add_argument("--chunk-size", type=_COUNT, default=None, help="events per publish call (default: the stream's "
                                                                "delivery.chunk_size)")
    p.add_argument("--dry-run", action="store_true", help="list what would be redelivered, send nothing")
    _add_defs_folder(p)

    p = _command(dl, "discard", _cmd_dead_letters_discard, "give up on open dead letters of STREAM (IDs, or --all)",
                 common)
    p.add_argument("stream", type=_ID, help="the stream whose dead letters to discard")
    p.add_argument("ids", type=_ID, nargs="*", metavar="ID", help="the open dead letters to discard (or --all)")
    p.add_argument("--all", action="store_true", help="every open dead letter of the stream")
    p.add_argument("--yes", action="store_true", help="confirm: their events are never delivered")

    p = _command(dl, "set-aside", _cmd_dead_letters_set_aside,
                 "make undelivered events of STREAM's open batches dead letters: delivery goes on without them", common)
    p.add_argument("stream", type=_ID, help="the stream the events belong to")
    p.add_argument("event_ids", type=_ID, nargs="+", metavar="EVENT_ID",
                   help="undelivered events of the stream's open batches")
    p.add_argument("--reason", required=True, help="why (kept with the dead letters)")
    p.add_argument("--yes", action="store_true", help="confirm: delivery goes on without these events")

    bf = _group(sub, "backfill", "existing rows of subscribed tables become READ events (run, list, stop, cancel)")
    p = _command(bf, "run", _cmd_backfill_run,
                 "backfill subscriptions of STREAM in the foreground, in parallel on Spark (the stream's spark "
                 "settings); resumes an unfinished backfill of the same selection; Ctrl-C stops it (resumable)", common)
    p.add_argument("stream", type=_ID, help="the stream whose subscriptions to backfill")
    p.add_argument("keys", nargs="+", metavar="KEY", help="subscription keys")
    p.add_argument("--config", help="pgstream.yaml (default: $PGSTREAM_CONFIG or ./pgstream.yaml); its "
                                    "database_url unless --database-url is given")
    p.add_argument("--table", help="schema.table: only this table of the subscriptions")
    p.add_argument("--where", help="only rows for which this boolean SQL expression over the row (new.<column>) "
                                   "is true")
    p.add_argument("--from", dest="from_key", nargs="+", metavar="VALUE",
                   help="first primary key (inclusive), one value per key column")
    p.add_argument("--to", dest="to_key", nargs="+", metavar="VALUE",
                   help="last primary key (inclusive), one value per key column")
    p.add_argument("--chunk-size", type=_ranged("chunk size", 1, 100_000), default=1000,
                   help="rows per chunk: one transaction, rows locked FOR SHARE meanwhile (1-100000)")
    p.add_argument("--parallelism", type=_ranged("parallelism", 1, 1024), default=4,
                   help="key-range partitions read at once (Spark tasks), fixed when a backfill starts (1-1024)")
    p.add_argument("--max-rows-per-sec", type=float, default=5000.0, help="throttle (0: none; default 5000)")
    p.add_argument("--max-backlog", type=_ranged("max backlog", 0, 10**9), default=20_000,
                   help="wait while the stream has more undelivered events than this (0: never; default 20000)")
    p.add_argument("--restart", action="store_true", help="cancel an unfinished backfill of the same subscription "
                                                          "and table and start over")
    p.add_argument("--progress-secs", type=float, default=5.0, help="seconds between progress lines")
    _add_defs_folder(p)
    p = _command(bf, "list", _cmd_backfill_list, "backfills (of STREAM), newest first, with their progress", common)
    p.add_argument("stream", type=_ID, nargs="?", help="only this stream's")
    for name, text in (("stop", "stop a backfill wherever it runs (resumable)"),
                       ("cancel", "cancel a backfill for good (the rows it read stay delivered)")):
        p = _command(bf, name, partial(_cmd_backfill_stop, cancel=name == "cancel"), text, common)
        p.add_argument("id", type=_ID, help="the backfill's id (backfill list shows them)")
    p.add_argument("--yes", action="store_true", help="confirm: the backfill cannot be resumed")  # (cancel's)

    p = _command(sub, "metrics", _cmd_metrics, "serve Prometheus metrics of every stream on /metrics, read from the "
                                               "database at each scrape", common)
    p.add_argument("--config", help="pgstream.yaml, for its metrics block and database_url (default: "
                                    "$PGSTREAM_CONFIG or ./pgstream.yaml when it exists)")
    p.add_argument("--host", default=None, help="address to listen on (default: metrics.host, 127.0.0.1)")
    p.add_argument("--port", type=_ranged("port", 0, 65535), default=None,
                   help="port to listen on (default: metrics.port, 9187; 0: any free port)")
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)  # make dev's exporter

    p = _command(sub, "dev", _cmd_dev, "the local demo, what make dev runs: a Postgres in .pgstream/, the roles, "
                                       "migrations, the demo's table and stream, a Spark Connect server, the "
                                       "Prometheus exporter and dg dev")
    p.add_argument("--port", type=_ranged("port", 1, 65535), default=3000, help="the port of the Dagster UI (dg dev)")
    p.add_argument("--no-spark-server", action="store_true",
                   help="runs start their own Spark instead of using a Spark Connect server kept in .pgstream/ (a "
                        "JVM: about 300 MB idle, its heap capped at 1 GB)")
    p.add_argument("--root", default=".", help="the checkout whose .pgstream/ holds the demo's services (default: .)")
    services = p.add_mutually_exclusive_group()
    services.add_argument("--status", action="store_true",
                        help="list the services of make dev (Postgres, Spark Connect server, dg dev, Prometheus "
                             "exporter) and whether each runs")
    services.add_argument("--stop", action="store_true",
                        help="stop the services of make dev (what make stop and make clean run); the data stays")

    p = _command(sub, "spark-connect", _cmd_spark_connect, "run a Spark Connect server for the runs (spark.remote) in "
                                                           "the foreground, from PySpark's own jars")
    p.add_argument("--port", type=_ranged("port", 1, 65535), default=15002,
                   help="the port to listen on (spark.remote: sc://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (Spark Connect has no authentication: keep it private)")
    p.add_argument("--master", default="local[*]",
                   help="the server's Spark master (spark://host:7077, k8s://...: see docs/spark-clusters.md)")
    p.add_argument("--conf", action="append", metavar="KEY=VALUE",
                   help="a Spark setting of the server (repeatable), e.g. spark.pyspark.python=/opt/venv/bin/python")
    p.add_argument("--stop", action="store_true", help="stop the server make dev started in .pgstream/")

    p = _command(sub, "executor-requirements", _cmd_executor_requirements,
                 "the pip requirements of the executors' Python on a Spark cluster (pinned to the versions installed "
                 "here), with the client libraries of by_key sinks")
    p.add_argument("--sink", action="append", metavar="TYPE", help="a sink type built on the executors (repeatable)")
    p.add_argument("--config", help="add the sink types of this pgstream.yaml's by_key streams")
    _add_defs_folder(p)

    p = _command(sub, "docs", _cmd_docs, "write the generated reference pages under docs/reference/ (configuration, "
                                         "CLI, metrics, and the SQL objects of a freshly migrated database)")
    p.add_argument("--database-url", help="a freshly migrated database to read the SQL objects from (default: "
                                          "one migrated on a throw-away local Postgres)")
    p.add_argument("--root", default=".", help="the repository to write into")
    # the summary names every command, from the parser itself (pgstream-dagster COMMAND --help for one)
    parser.description = (f"{__doc__} Commands: {', '.join(sub.choices)} (pgstream-dagster COMMAND --help "
                          "describes one).")
    return parser


#: the commands that run as the owner of schema pgstream (the others as a login member of pgstream_runtime)
_OWNER_COMMANDS = frozenset({_cmd_migrate, _cmd_init, _cmd_tear_down, _cmd_install_drift_guard})


def _privilege_advice(args: argparse.Namespace, url: str | None) -> str:
    """What a refused privilege on pgstream's objects means for the command: the role to connect as."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        role = str(conninfo_to_dict(url).get("user") or "") if url else ""
    except psycopg.ProgrammingError:
        role = ""
    if args.func in _OWNER_COMMANDS:
        return (f": this command runs as the owner of schema pgstream, not as {role or 'the login role'}: pass the "
                "owner's URL (docs/security.md, Roles)")
    return (f": connected as {role or 'the login role'}; connect as a login member of pgstream_runtime (as a "
            f"superuser: grant pgstream_runtime to {role or '<role>'}) or as the owner (docs/security.md, Roles)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except _Refused as exc:
        print(exc, file=sys.stderr)
        return exc.code
    except Exception as exc:  # a clear one-line error, not a traceback, for operators
        from . import config, sparkserver
        from .engine import backfill, bootstrap, deadletters, migrations, replication
        from .engine.dbconn import error_line, scrubbed_error

        # the connection strings the command may have used, masked in the line
        urls = [getattr(args, "database_url", None), os.environ.get("PGSTREAM_DATABASE_URL"),
                os.environ.get("PGSTREAM_OWNER_DATABASE_URL")]
        if type(exc).__module__.startswith("psycopg"):  # Postgres' message, not its PL/pgSQL CONTEXT lines
            line = scrubbed_error(error_line(exc), *urls)
            if isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedFunction |
                          psycopg.errors.InvalidSchemaName) and "pgstream." in str(exc):
                line += (": pgstream is not installed in this database, or not at this version: run "
                         "`pgstream-dagster migrate` (or `init`) with the owner's URL first")
            elif isinstance(exc, psycopg.errors.InsufficientPrivilege) and "pgstream" in str(exc):
                line += _privilege_advice(args, next((u for u in urls if u), None))
        elif isinstance(exc, config.ConfigError):  # one line per problem (each names its file and key)
            line = "\nerror: ".join(scrubbed_error(problem, *urls) for problem in str(exc).splitlines()
                                    if problem.strip())
        elif isinstance(exc, migrations.MigrationError | deadletters.DeadLetterError | backfill.BackfillError |
                        sparkserver.SparkServerError | replication.PublicationTaken | bootstrap.InitError):
            line = scrubbed_error(exc, *urls)  # libpq echoes a connection string it cannot parse, the password too
        else:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
