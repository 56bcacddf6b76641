"""``pgstream_dagster.StreamComponent``: a stream and its subscriptions declared in a ``defs.yaml``
(``type: pgstream_dagster.StreamComponent``). It sits above the definitions (``pgstream_dagster.defs``),
which find it as a :class:`~pgstream_dagster.defs.location.StreamDeclaringComponent` and never import it."""

from .stream import StreamComponent, StreamScaffolder, StreamScaffoldParams

__all__ = ["StreamComponent", "StreamScaffoldParams", "StreamScaffolder"]
