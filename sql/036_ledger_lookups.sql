-- 036: the ledger's lookups made for every event read a few index pages, however many rows the tables keep.
--
-- On every recording pass the reader asks, for each stream it records, where the slot's batches end
-- (max end_lsn of kind 'stream') and which recovery batches reach past a position (kind 'recovery').
-- On (stream_id, end_lsn) both read every batch of the stream whenever their plan was made without
-- statistics (a new install, a table that grew faster than autovacuum analyzes it: a prepared
-- statement's plan is kept); on (stream_id, kind, end_lsn) both are one index range whatever the plan.
-- A member run asks, for every batch, which events of its batches have a dead letter (they are skipped):
-- (stream_id, batch_id) answers that in a few pages however many dead letters the stream has (on
-- (stream_id, event_id) it read all of them). The indexes are built under a SHARE lock on each table
-- (recording and delivery wait for the build: seconds for millions of rows).
create index if not exists batches_stream_kind_lsn_idx on pgstream.batches (stream_id, kind, end_lsn);
drop index if exists pgstream.batches_stream_lsn_idx;
create index if not exists dead_letters_stream_batch_idx on pgstream.dead_letters (stream_id, batch_id);
