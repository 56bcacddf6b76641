-- 005: privileges. Only the owner (the role that runs `pgstream-dagster migrate`) may read or
-- write pgstream objects. Application roles need no grant at all: the generated trigger functions
-- are SECURITY DEFINER and write pgstream.events as the owner. The SQL text in subscriptions runs
-- with the owner's rights, which is why nobody else may write pgstream.subscriptions.
-- To let an application insert events directly, grant explicitly (see README, "Privileges"):
--   grant usage on schema pgstream to app;
--   grant insert on pgstream.events to app;
--   grant usage on sequence pgstream.events_id_seq to app;
revoke all on schema pgstream from public;
revoke all on all tables in schema pgstream from public;
revoke all on all sequences in schema pgstream from public;
revoke all on all functions in schema pgstream from public;
alter default privileges in schema pgstream revoke all on tables from public;
alter default privileges in schema pgstream revoke all on sequences from public;
alter default privileges in schema pgstream revoke execute on functions from public;
