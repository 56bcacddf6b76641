"""The engine: everything pgstream does (migrations to bootstrap, ingest to delivery), without Dagster."""
