"""The Dagster code location (``workspace.yaml``, ``[tool.dagster]`` and ``[tool.dg]`` point here): the defs folder
``pgstream_dagster/defs/`` (``pgstream.yaml``, the shared definitions of ``defs/location.py``, every
``pgstream_dagster.StreamComponent`` of a ``defs.yaml`` below it), loaded as ``dg.load_from_defs_folder`` does but
from the defs module itself: an installed wheel has no ``pyproject.toml`` beside the package to search for.
"""

from pathlib import Path

import dagster as dg

from . import defs as defs_module
from .config import ConfigError, check_defs_yaml

# (Dagster's preview warnings about its own defs-folder loading: filtered in pgstream_dagster/__init__.py)


@dg.definitions
def defs() -> dg.Definitions:
    root = Path(__file__).resolve().parent
    check_defs_yaml(root / "defs")  # before Dagster's reader, which follows every alias of an alias bomb
    tree = dg.ComponentTree.from_module(defs_module=defs_module, project_root=root)
    try:
        return tree.build_defs()
    except Exception as exc:
        # a mistake in pgstream.yaml (or a component's attributes) is the error the UI shows, in the lines that
        # name the file, the key and what is allowed, not a cause under Dagster's dump of the component tree
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise ConfigError(str(cause)) from None
