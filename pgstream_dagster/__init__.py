"""pgstream-dagster: durable Postgres change events delivered in commit order by Dagster runs."""

import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

# Dagster warns about its own preview/beta APIs when it loads a defs folder (load_definitions_from_module(s) for each
# plain module, its SparkDeclarativePipelineScaffolder in the component snapshot) and when it binds a sensor's jobs
# (`owners`, which it passes itself: no sensor of ours has owners), in every process that loads the code location or our
# component registry: none about our code. Ignored by these messages only (a preview API we call still warns); here, as
# `dg` imports this package (registry_modules) before its snapshot, and without importing Dagster.
for _preview in ("Function `load_definitions_from_module` is currently in preview",
                 "Function `load_definitions_from_modules` is currently in preview",
                 "Class `SparkDeclarativePipelineScaffolder` is currently in preview",
                 "Parameter `owners` of initializer `SensorDefinition.__init__` is currently in beta"):
    warnings.filterwarnings("ignore", message=_preview)

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
