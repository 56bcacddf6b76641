"""The package's import graph has no cycle (function-level and TYPE_CHECKING imports count): each
stage can be read, tested and replaced from the bottom up. The stage contracts themselves are
import-linter's (pyproject.toml, `lint-imports` in `make test`)."""

from __future__ import annotations

import grimp


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph("pgstream_dagster")
    cycles = sorted({tuple(sorted((module, imported)))
                     for module in graph.modules
                     for imported in graph.find_modules_directly_imported_by(module)
                     if graph.chain_exists(importer=imported, imported=module)})
    assert cycles == [], "import cycles (each pair imports the other, directly or through others): " + ", ".join(
        f"{a} <-> {b}" for a, b in cycles)
