"""The Dagster code location (``workspace.yaml``, ``[tool.dagster]`` and ``[tool.dg]`` point here).

``dg.load_from_defs_folder`` loads ``pgstream_dagster/defs/``: ``pgstream.yaml``
(``$PGSTREAM_CONFIG``, default ``./pgstream.yaml``) and the shared definitions
(``defs/location.py``), and every ``pgstream_dagster.StreamComponent`` declared in a ``defs.yaml``
below it.
"""

from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
