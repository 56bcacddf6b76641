"""The ``pgstream`` resource: the location's configuration (``pgstream.yaml`` plus the streams declared as
``StreamComponent``s), read once with the definitions, and connections to its database. A plain object handed
to ops, sensors, assets and checks as it is (``dg.ResourceParam``): it has no config schema, so nothing of it
appears in run config or the UI; the database URL and the sink credentials stay ``SecretStr`` inside it.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import suppress
from itertools import groupby

import dagster as dg
import psycopg
from dagster_pyspark import LazyPySparkResource

from ..config import ConfigError, PgstreamConfig, StreamConfig
from ..engine import dbconn
from ..engine.spark_source import register


class PgstreamResource:
    """The pgstream configuration of the code location and a way to connect to its database."""

    def __init__(self, config: PgstreamConfig, config_path: str) -> None:
        self.config = config
        #: the pgstream.yaml the configuration was read from (named in messages)
        self.config_path = config_path

    def __repr__(self) -> str:  # never the URL
        return f"PgstreamResource({self.config_path!r}, streams {[s.id for s in self.config.streams]})"

    def stream(self, stream_id: int) -> StreamConfig:
        return self.config.stream(stream_id)

    def chosen_stream(self, stream_id: int, what: str) -> StreamConfig:
        """The stream a run's config names (``stream_id``, for ``what``: "replay", "backfill"), else a one-line
        :class:`dagster.Failure` naming it and the streams there are (the template's 0 is none)."""
        there = f"the streams of this code location: {id_ranges(s.id for s in self.config.streams) or 'none'}"
        if stream_id == 0:
            raise dg.Failure(f"stream_id: set the stream to {what} (the template's 0 is none); {there}")
        with suppress(ConfigError):
            return self.config.stream(stream_id)
        raise dg.Failure(f"stream_id {stream_id}: no such stream to {what}; {there}")

    @property
    def database_url(self) -> str:
        return self.config.database_url.get_secret_value()

    @property
    def executor_database_url(self) -> str:
        """What Spark executors connect with (``spark.executor_database_url``, default ``database_url``)."""
        return self.config.executor_url

    def connect(self) -> psycopg.Connection:
        # the search path pinned to pg_catalog, pg_temp (engine/dbconn.py)
        return dbconn.connect(self.database_url, autocommit=True, application_name="pgstream-dagster")


class PgstreamSparkResource(LazyPySparkResource):
    """The ``pyspark`` resource: dagster-pyspark's lazily created session, with pgstream's data source
    registered on it when it is created, so an op may ``spark.readStream.format("pgstream")``."""

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False

    def _init_session(self) -> None:
        created = self._spark_session is None
        super()._init_session()
        if created and self._spark_session is not None:
            register(self._spark_session)


def id_ranges(ids: Iterable[int]) -> str:
    """``1-3, 7, 9-12``: ``ids`` in order, consecutive ones as a range (a line at any number of streams)."""
    # (in a run of consecutive ids, id minus position is the same)
    runs = [[i for _, i in run] for _, run in groupby(enumerate(sorted(set(ids))), lambda p: p[1] - p[0])]
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
