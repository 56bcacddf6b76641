"""The Dagster code location (``workspace.yaml``, ``[tool.dagster]`` and ``[tool.dg]`` point here).

It loads the defs folder ``pgstream_dagster/defs/``: ``pgstream.yaml`` (``$PGSTREAM_CONFIG``,
default ``./pgstream.yaml``) and the shared definitions (``defs/location.py``), and every
``pgstream_dagster.StreamComponent`` declared in a ``defs.yaml`` below it.

This is what ``dg.load_from_defs_folder`` does, given the defs module itself instead of a path to
search for ``pyproject.toml``: an installed wheel has no ``pyproject.toml`` beside the package.
"""

import warnings
from pathlib import Path

import dagster as dg

from . import defs as defs_module

# Loading a defs folder (dg.ComponentTree, the Components API) makes Dagster itself call two preview
# functions for each plain Python module of the folder (load_definitions_from_module(s), from
# dagster/components/core/defs_module.py) and snapshot every registered component, its own preview
# SparkDeclarativePipelineScaffolder included: five PreviewWarnings in every process that loads the
# code location (code server, each run, each `dg` command), about Dagster's code, none about ours.
# Ignored by name only; a preview API we call ourselves still warns.
for _preview in ("Function `load_definitions_from_module` ", "Function `load_definitions_from_modules` ",
                 "Class `SparkDeclarativePipelineScaffolder` "):
    warnings.filterwarnings("ignore", message=_preview, category=dg.PreviewWarning)


@dg.definitions
def defs() -> dg.Definitions:
    tree = dg.ComponentTree.from_module(defs_module=defs_module, project_root=Path(__file__).resolve().parent)
    return tree.build_defs()
