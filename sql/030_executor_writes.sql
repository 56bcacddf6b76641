-- 030: the Spark executors (pgstream_executor, whose credentials every executor host holds) write
-- nothing but through the owner's functions, each with a token that names what it may write:
--   * pgstream.delivery_tokens: a by_key round's token (its sha256), issued by the run holding the
--     stream's delivery lease and given to the round's Spark tasks; set_aside_rejected and
--     record_key_progress (repeatable/99_runtime.sql) write that stream's dead letters and resume
--     points only, while that run holds the lease;
--   * pgstream.consumers.token_hash: a registered consumer's token (its sha256), issued by the
--     runtime (`pgstream-dagster consumers add` / `consumers token`), given to the Spark source's
--     query; consumer_commit (repeatable/26_consumers.sql) moves that consumer's position only. A
--     consumer registered before this version has none until an operator issues one.
-- The executor's table privileges (repeatable/99_runtime.sql) are SELECT only: any write privilege
-- on a table would also let it LOCK the table in a mode that stalls every writer.

create table if not exists pgstream.delivery_tokens (
    stream_id  bigint primary key references pgstream.streams (id) on delete cascade,
    run_id     text not null,
    token_hash bytea not null,
    issued_at  timestamptz not null default now()
);
revoke all on pgstream.delivery_tokens from public;

alter table pgstream.consumers add column if not exists token_hash bytea;

-- replaced by consumer_commit(text, bigint, bigint, integer, text): a position moves with the consumer's token
drop function if exists pgstream.consumer_commit(text, bigint, bigint, integer);
-- replaced by the lease check of record_key_progress and set_aside_rejected (the round's delivery token)
drop function if exists pgstream.delivery_lease_held(bigint, text);
