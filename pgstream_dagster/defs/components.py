"""The old import path of ``StreamComponent`` (``type: pgstream_dagster.defs.components.StreamComponent``
in a ``defs.yaml``), kept as a re-export: the component lives in :mod:`pgstream_dagster.component`
(use ``type: pgstream_dagster.StreamComponent``). The one import of the component package from the
definitions (an ignored import of the import-linter layers contract); nothing here imports this module."""

from ..component import StreamComponent, StreamScaffolder, StreamScaffoldParams

__all__ = ["StreamComponent", "StreamScaffoldParams", "StreamScaffolder"]
