"""The ledger (``pgstream.batches``) and all pgstream keeps per stream, by concern (streams, recording, state, locks,
deadletters, keyprogress, groups): callers import its modules by name (``from ...engine.ledger import state``)."""
