"""The ledger (``pgstream.batches``) and everything else pgstream keeps per stream in Postgres, by concern
(docs/architecture.md's module map): streams, recording, state, locks, deadletters, keyprogress, groups.
Callers import its modules by name (``from pgstream_dagster.engine.ledger import state``)."""
