"""The Dagster code location (``workspace.yaml``, ``[tool.dagster]`` and ``[tool.dg]`` point here).

It loads the defs folder ``pgstream_dagster/defs/``: ``pgstream.yaml`` (``$PGSTREAM_CONFIG``,
default ``./pgstream.yaml``) and the shared definitions (``defs/location.py``), and every
``pgstream_dagster.StreamComponent`` declared in a ``defs.yaml`` below it.

This is what ``dg.load_from_defs_folder`` does, given the defs module itself instead of a path to
search for ``pyproject.toml``: an installed wheel has no ``pyproject.toml`` beside the package.
"""

from pathlib import Path

import dagster as dg

from . import defs as defs_module
from .config import check_defs_yaml

# (Dagster's preview warnings about its own defs-folder loading: filtered in pgstream_dagster/__init__.py)


@dg.definitions
def defs() -> dg.Definitions:
    root = Path(__file__).resolve().parent
    check_defs_yaml(root / "defs")  # before Dagster's reader, which follows every alias of an alias bomb
    tree = dg.ComponentTree.from_module(defs_module=defs_module, project_root=root)
    return tree.build_defs()
