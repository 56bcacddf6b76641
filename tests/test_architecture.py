"""The package's import graph has no cycle (function-level and TYPE_CHECKING imports count): each
stage can be read, tested and replaced from the bottom up. The stage contracts themselves are
import-linter's (pyproject.toml, `lint-imports` in `make test`). The stream's open run and the slot's
declared reader are written by one module, through the state machine's actions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph("pgstream_dagster")
    cycles = sorted({tuple(sorted((module, imported)))
                     for module in graph.modules
                     for imported in graph.find_modules_directly_imported_by(module)
                     if graph.chain_exists(importer=imported, imported=module)})
    assert cycles == [], "import cycles (each pair imports the other, directly or through others): " + ", ".join(
        f"{a} <-> {b}" for a, b in cycles)


# --- the open run and the slot's reader: written only by the state machine's transitions ---------------

PACKAGE = Path(__file__).resolve().parent.parent / "pgstream_dagster"
SQL_DIR = PACKAGE.parent / "sql"
#: SQL that changes streams.open_run_key or streams.slot_reader: an UPDATE of pgstream.streams whose SET
#: (up to its WHERE) assigns one of them
_WRITES = re.compile(r"update\s+pgstream\.streams\s+(?:\w+\s+)?set\s+((?:(?!\bwhere\b|;).)*)", re.I | re.S)
_COLUMNS = re.compile(r"\b(open_run_key|slot_reader)\s*=", re.I)
#: ledger/state.py's functions that run that SQL; apply and apply_run are the only ways to them from
#: outside the ledger
STATE_WRITERS = {"open_run", "clear_open_run", "open_warm_run"}
#: the ledger functions that reach those writers (the transitions composed of them)
TRANSITIONS = STATE_WRITERS | {"launch", "fail_run", "_close_run", "close_run"}


def _writes_columns(text: str) -> bool:
    return any(_COLUMNS.search(m.group(1)) for m in _WRITES.finditer(text))


def _functions_writing(path: Path) -> set[str]:
    """The functions of ``path`` with a string literal that writes open_run_key or slot_reader."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str) and _writes_columns(inner.value):
                    found.add(node.name)
    for node in tree.body:  # module-level SQL (a constant) counts as written by the module
        for inner in ast.walk(node):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and \
                    isinstance(inner, ast.Constant) and isinstance(inner.value, str) and _writes_columns(inner.value):
                found.add("<module>")
    return found


def test_only_the_ledger_state_writes_the_open_run_and_the_slot_reader() -> None:
    """Every UPDATE that sets streams.open_run_key or streams.slot_reader is in engine/ledger/state.py,
    in the transition functions ledger.apply / ledger.apply_run carry out; no SQL function writes them."""
    writers = {(str(path.relative_to(PACKAGE)), name)
               for path in sorted(PACKAGE.rglob("*.py")) for name in _functions_writing(path)}
    assert writers == {("engine/ledger/state.py", name) for name in STATE_WRITERS}, writers
    in_sql = {(str(p.relative_to(SQL_DIR)), name) for p in sorted(SQL_DIR.rglob("*.sql"))
              for name, body in _sql_functions(p.read_text()) if _writes_columns(body)}
    assert in_sql == GROUP_SQL_WRITERS, f"SQL writing streams.open_run_key / slot_reader: {in_sql}"
    callers = {str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
               for _file, name in GROUP_SQL_WRITERS if f"pgstream.{name}(" in path.read_text()}
    assert callers == {"engine/ledger/groups.py"}, callers


#: the one SQL function that sets slot_reader: a stream joining its reader group hands the slot to the
#: group's reader (the owner's function, as the runtime cannot write pgstream.streams); only
#: engine/ledger/groups.py calls it
GROUP_SQL_WRITERS = {("repeatable/27_reader_groups.sql", "begin_join")}


def _sql_functions(text: str) -> list[tuple[str, str]]:
    """(name, text up to the next function) of each ``create or replace function pgstream.<name>`` of
    ``text``; what comes before the first function is named ``""``."""
    parts = re.split(r"create\s+(?:or\s+replace\s+)?function\s+pgstream\.(\w+)", text, flags=re.I)
    return [("", parts[0]), *zip(parts[1::2], parts[2::2], strict=True)]


def test_the_pattern_finds_what_it_is_meant_to() -> None:
    """The check above can fail: it sees each form these UPDATEs take, and nothing else."""
    assert _writes_columns("update pgstream.streams set slot_reader = %s where id = %s")
    assert _writes_columns("update pgstream.streams s\n  set paused = true, open_run_key = null where id = 1")
    assert _writes_columns("UPDATE pgstream.streams SET open_run_key=NULL")
    assert not _writes_columns("update pgstream.streams set paused = true where open_run_key = 'x'")
    assert not _writes_columns("select open_run_key = %s from pgstream.streams where id = %s")


def _ledger_names_used(path: Path) -> set[str]:
    """The names of ``engine/ledger/state.py`` a module uses: ``<alias>.X`` of a ``from ..ledger import
    state [as alias]`` and ``from ..ledger.state import X``."""
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "ledger":
            aliases.update(a.asname or a.name for a in node.names if a.name == "state")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("ledger.state"):
            names.update(a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            names.add(node.attr)
    return names


def test_outside_the_ledger_the_open_run_changes_by_actions() -> None:
    """Outside engine/ledger the open run changes only through ledger.apply (the sensor's decision) and
    ledger.apply_run (the run's CloseRun): no module calls a transition function itself. The run's delivery
    loop does use apply_run."""
    uses = {str(path.relative_to(PACKAGE)): _ledger_names_used(path)
            for path in sorted(PACKAGE.rglob("*.py")) if "ledger" not in path.relative_to(PACKAGE).parts}
    direct = {module: sorted(names & TRANSITIONS) for module, names in uses.items() if names & TRANSITIONS}
    assert direct == {}, f"transitions called outside ledger.apply / ledger.apply_run: {direct}"
    assert "apply" in uses["defs/sensors.py"]
    assert "apply_run" in uses["engine/delivery/run.py"]
    from pgstream_dagster.engine.ledger import state
    assert not (set(dir(state)) & {"close_run"}), "the run's transition is an action"


def test_the_package_opens_its_connections_pinned() -> None:
    """Every connection pgstream opens to a pgstream database pins ``search_path = pg_catalog, pg_temp`` and
    masks a URL's password in a connection error (``sinks.base.connect_postgres``, the engine's
    ``dbconn.connect``): the installers (bootstrap, migrations) and the CLI run as the owner or a superuser,
    the runtime as itself, where another role's function or operator on the search path (a ``~~(name, name)``
    in a ``public`` it owns) would run with their rights. No module calls ``psycopg.connect`` itself but the
    connector, the Postgres sink (a user's own database: it pins the path with ``set_config`` first) and the
    local clusters pgstream starts itself (``make dev``, the reference docs)."""
    allowed = {"sinks/base.py", "sinks/postgres.py", "dev.py", "devdb.py", "docs_gen.py"}
    direct = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                    if str(p.relative_to(PACKAGE)) not in allowed and "psycopg.connect(" in p.read_text())
    assert direct == [], f"call dbconn.connect instead of psycopg.connect in {direct}"
