"""The engine: everything pgstream does, without Dagster (import-linter keeps it so). Migrations,
WAL decoding and slots, ingest into the ledger, publishing through sinks, Spark data sources,
subscriptions, housekeeping, status, dead letters, operator controls, replay planning, bootstrap."""
