"""pgstream-dagster: durable Postgres change events delivered by Dagster runs on Spark."""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["StreamComponent", "__version__"]

if TYPE_CHECKING:
    from .defs.components import StreamComponent


def __getattr__(name: str) -> Any:
    # imported on first use: the engine, the sinks and Spark's Python workers import this package
    # and must not pay for importing Dagster
    if name == "StreamComponent":
        from .defs.components import StreamComponent

        return StreamComponent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "StreamComponent"])
