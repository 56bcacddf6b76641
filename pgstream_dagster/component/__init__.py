"""``pgstream_dagster.StreamComponent`` (:mod:`.stream`): a stream and its subscriptions declared in a ``defs.yaml``."""

from .stream import StreamComponent, StreamScaffolder, StreamScaffoldParams

__all__ = ["StreamComponent", "StreamScaffoldParams", "StreamScaffolder"]
