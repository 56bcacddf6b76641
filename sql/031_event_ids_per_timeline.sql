-- 031: an event id is never handed out twice, not even across a failover of the primary (issue 46).
--
-- The events sequence is physically replicated like everything else; a standby promoted while it
-- lagged an asynchronous primary resumes it from what it had replayed, below ids the old primary had
-- already handed out, committed and delivered. Reused, those ids would name other rows, and a consumer
-- deduplicating by event id (Idempotency-Key, webhook-id) would drop them.
--
-- So an event id carries the WAL timeline it was written on: (timeline - 1) * 2^48 + the sequence's
-- value. Every promotion starts a timeline above the one the standby followed, so the new primary's
-- ids lie above every id the old one could have handed out, from its first write, whether pgstream has
-- noticed the promotion or not. On timeline 1 (a cluster that was never promoted nor restored to a
-- point in time) ids are the sequence's values, as before. The sequence stops at 2^48 - 1 (2.8e14
-- events) rather than run into the next timeline's range; timelines up to 32768 fit a bigint.
--
-- The timeline is the one WAL is inserted on (pg_walfile_name of the insert position: its first 8 hex
-- digits), read in shared memory: 0.8 to 1.2 us per event on top of nextval (bench/event_ids.py,
-- bench/RESULTS.md "Event ids with the timeline"). The same expression assigns the id of every insert
-- that goes through pgstream._check_event (repeatable/06_event_integrity.sql).

alter sequence pgstream.events_id_seq maxvalue 281474976710655;

alter table pgstream.events alter column id set default
    pg_catalog.nextval('pgstream.events_id_seq'::pg_catalog.regclass)
    operator(pg_catalog.+) ((('x' operator(pg_catalog.||) pg_catalog.substr(
        pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::pg_catalog.bit(32)::pg_catalog.int8
        operator(pg_catalog.-) 1) operator(pg_catalog.<<) 48);
