"""pgstream-dagster: durable Postgres change events delivered in commit order by Dagster runs."""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("pgstream-dagster")  # the release pyproject.toml names, as installed
except PackageNotFoundError:  # a source tree on PYTHONPATH without the package installed
    __version__ = "0+unknown"
__all__ = ["StreamComponent", "__version__"]

if TYPE_CHECKING:
    from .component import StreamComponent


def __getattr__(name: str) -> Any:
    # imported on first use: the engine, the sinks and Spark's Python workers import this package
    # and must not pay for importing Dagster
    if name == "StreamComponent":
        from .component import StreamComponent

        return StreamComponent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "StreamComponent"])
