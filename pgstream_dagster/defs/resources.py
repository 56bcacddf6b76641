"""Dagster resources: access to the pgstream configuration and database.

The resource's own config is only the path of ``pgstream.yaml``: the database URL and the sink
credentials stay inside that file / the environment and never appear in run config or the UI.
"""

from __future__ import annotations

from functools import cached_property

import dagster as dg
import psycopg

from ..config import PgstreamConfig, StreamConfig, load_config


# not ConfigurableResource[...]: subscripting the pydantic generic makes another class at runtime
class PgstreamResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """The pgstream configuration file and a way to connect to its database."""

    config_path: str

    @cached_property
    def config(self) -> PgstreamConfig:
        return load_config(self.config_path)

    def stream(self, stream_id: int) -> StreamConfig:
        return self.config.stream(stream_id)

    @property
    def database_url(self) -> str:
        return self.config.database_url.get_secret_value()

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(self.database_url, autocommit=autocommit,
                               application_name="pgstream-dagster")
