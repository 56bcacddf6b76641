-- 035: a batch's event ids are stored without compression.
--
-- The reader records every event it reads in a batch row (event_ids, one bigint each). Arrays over about 2 kB
-- (from about 250 ids) went through pglz on every insert: for consecutive ids it halves their size, but it cost
-- about 1 us an id in the reader's ledger session (3.2 ms for an array of 3,000 ids against 0.2-0.4 ms stored
-- as they are; a third of that backend's CPU under a sustained write load), and every read of the batch paid
-- for decompressing them. EXTERNAL keeps a large array out of line in the TOAST table, uncompressed: 8 bytes an
-- id on disk instead of about 3.3, while the batch lives. Rows written before keep their compressed form.
alter table pgstream.batches alter column event_ids set storage external;
