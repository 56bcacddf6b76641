"""The Dagster code location (``workspace.yaml`` points here).

Everything is derived from ``pgstream.yaml`` (``$PGSTREAM_CONFIG``, default ``./pgstream.yaml``).
"""

from .defs.location import build_definitions

defs = build_definitions()
