"""pgstream-dagster: durable Postgres change events delivered by Dagster runs on Spark."""

__version__ = "0.1.0"
