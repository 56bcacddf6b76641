"""The documentation cannot go stale: the generated reference pages equal what the code generates now,
the README's "where things live" table and the architecture page's module map match the tree, and
``pgstream-dagster --version`` prints the package's version."""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from pgstream_dagster import docs_gen
from pgstream_dagster.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_the_generated_reference_pages_match_the_code(db_url: str) -> None:
    """db_url is a freshly migrated database: the SQL page is read from its catalog."""
    stale = [name for name, text in docs_gen.pages(db_url, build_parser()).items()
             if not (ROOT / docs_gen.REFERENCE_DIR / name).exists()
             or (ROOT / docs_gen.REFERENCE_DIR / name).read_text(encoding="utf-8") != text]
    assert stale == [], f"docs/reference/{', '.join(stale)} out of date: run `{docs_gen.COMMAND}` and commit"


def test_the_configuration_reference_describes_every_key_of_pgstream_yaml() -> None:
    """Every key of config.py's models has a description (it reaches the Dagster UI and the reference);
    batch.max_size is the size of a ledger batch, not of a delivery run."""
    rows = [line for line in docs_gen.configuration_page().split("## Sink ")[0].splitlines()
            if line.startswith("| `")]
    undescribed = [row.split("`")[1] for row in rows if row.rstrip().endswith("|  |")
                   and "(below)" not in row]
    assert undescribed == []
    max_size = next(row for row in rows if row.startswith("| `streams[].batch.max_size`"))
    assert "ledger batch" in max_size and "per delivery run" not in max_size


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version("pgstream-dagster") == declared
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"pgstream-dagster {declared}"


def _table_paths(text: str, heading: str) -> list[str]:
    """The paths in the first column of the table under ``heading`` (a markdown heading)."""
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)`", section, re.MULTILINE)]


def test_the_readme_is_short_and_names_every_folder_that_exists() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert text.split("\n\n", 2)[1].count("make dev") and "make test" in text.split("\n\n", 2)[1]
    named = _table_paths(text, "## Where things live")
    missing = [p for p in named if not (ROOT / p.rstrip("/")).exists()]
    assert missing == [], "the README names what is not in the tree"
    top = {p.rstrip("/") for p in named if "/" not in p.rstrip("/")}
    packages = {f"pgstream_dagster/{p.name}" for p in (ROOT / "pgstream_dagster").iterdir()
                if (p / "__init__.py").exists()}
    stages = {f"sql/{p.name}" for p in (ROOT / "sql").iterdir() if p.is_dir()} | {
        f"tests/{p.name}" for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    named_set = {p.rstrip("/") for p in named}
    assert sorted(_tracked_folders() - top) == []
    assert sorted((packages | stages) - named_set) == []


def _tracked_folders() -> set[str]:
    """Top-level folders of the repository, what git would track (not the venv, caches, .pgstream)."""
    skip = {"__pycache__", "site", "node_modules"}
    return {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in skip
            and any(f.is_file() and f.suffix in {".py", ".sql", ".md", ".json", ".png", ".gz", ".yaml"}
                    for f in p.rglob("*"))}


def test_the_architecture_page_maps_every_module_and_sql_file() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = _table_paths(text, "## Module map")
    missing = [p for p in named if not (ROOT / p).exists()]
    assert missing == [], "docs/architecture.md names what is not in the tree"
    # every module of every package, at any depth, and every package's __init__ that holds code (not a
    # marker of a few lines)
    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "pgstream_dagster").rglob("*.py")
                if "__pycache__" not in p.parts
                and (p.name != "__init__.py" or len(p.read_text().splitlines()) >= 10)}
    expected |= {str(p.relative_to(ROOT)) for p in (ROOT / "sql" / "repeatable").glob("*.sql")}
    expected.add("pgstream_dagster/engine/metrics.yaml")
    assert sorted(expected - set(named)) == []


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every subcommand's, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_command_and_argument_of_the_cli_has_plain_help_and_the_summary_names_every_command() -> None:
    """The help is what the CLI reference is generated from: every subcommand and every argument says what it is,
    in plain text (no backtick markup, which a terminal shows as is), and the top-level summary names every
    command."""
    root = build_parser()
    undescribed, marked = [], []

    def described(where: str, text: str | None) -> None:
        if not (text or "").strip():
            undescribed.append(where)
        elif "`" in (text or ""):
            marked.append(f"{where}: {text}")

    for parser in _parsers(root):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    described(f"{parser.prog} {choice.dest}", choice.help)
            elif action.help != argparse.SUPPRESS:
                described(f"{parser.prog} {', '.join(action.option_strings) or action.dest}", action.help)
        if parser.description:
            described(parser.prog, parser.description)
    assert undescribed == []
    assert marked == []
    commands = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [name for name in commands
               if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", root.description or "")]
    assert missing == []


def test_install_drift_guard_takes_a_superusers_url_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Neither the runtime's URL ($PGSTREAM_DATABASE_URL) nor the owner's is a superuser's: the command has no
    default URL, and its help does not offer one."""
    command = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)) \
        .choices["install-drift-guard"]
    (url,) = [a for a in command._actions if "--database-url" in a.option_strings]
    assert url.required and "superuser" in (url.help or "") and "$PGSTREAM" not in (url.help or "")
    monkeypatch.setenv("PGSTREAM_DATABASE_URL", "postgresql://runtime@127.0.0.1:1/pgstream")
    with pytest.raises(SystemExit) as exited:
        main(["install-drift-guard"])
    assert exited.value.code == 2
    assert "the following arguments are required: --database-url" in capsys.readouterr().err
