-- 005: privileges. Only the owner (the role that runs `pgstream-dagster migrate`) may read or
-- write pgstream objects; application roles need no grant at all. Nobody else may write
-- pgstream.subscriptions: a subscription is SQL text that pgstream embeds in generated code.
-- (The generated trigger functions run as pgstream_writer, which may only insert events: see
-- 012_least_privilege.sql.) Each function's own privileges (never executable by PUBLIC) are set
-- next to its definition, in repeatable/*.sql.
-- To let an application insert events directly, grant explicitly (see README, "Security"):
--   grant usage on schema pgstream to app;
--   grant insert (payload, metadata, stream_id) on pgstream.events to app;
--   grant usage on sequence pgstream.events_id_seq to app;
revoke all on schema pgstream from public;
revoke all on all tables in schema pgstream from public;
revoke all on all sequences in schema pgstream from public;
alter default privileges in schema pgstream revoke all on tables from public;
alter default privileges in schema pgstream revoke all on sequences from public;
alter default privileges in schema pgstream revoke execute on functions from public;
