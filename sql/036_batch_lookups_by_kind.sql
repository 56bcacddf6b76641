-- 036: the reader's lookups of a stream's batches by kind and position read a few index pages.
--
-- On every recording pass the reader asks, for each stream it records, where the slot's batches end
-- (max end_lsn of kind 'stream') and which recovery batches reach past a position (kind 'recovery').
-- On (stream_id, end_lsn) both read every batch of the stream, whenever their plan was made without
-- statistics (a new install, a table that grew faster than autovacuum analyzes it: the prepared
-- statement's plan is kept), a cost that grows with the batches kept. On (stream_id, kind, end_lsn)
-- both are one index range whatever the statistics. The index is built under a SHARE lock on
-- pgstream.batches (recording waits for the build: seconds for millions of batches).
create index if not exists batches_stream_kind_lsn_idx on pgstream.batches (stream_id, kind, end_lsn);
drop index if exists pgstream.batches_stream_lsn_idx;
