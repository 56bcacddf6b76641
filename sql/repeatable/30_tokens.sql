-- Repeatable: the secret tokens that let a role write what one token names (a by_key round's
-- delivery token, a registered consumer's token; sql/030_executor_writes.sql). A token is shown once,
-- to whoever it is issued to; the database keeps its sha256 only. Owner only: the SECURITY DEFINER
-- functions that issue and check tokens call these.

-- A new token: 64 hex digits from two random UUIDs (244 random bits, the server's strong random source).
create or replace function pgstream.new_token()
returns text
language sql
volatile
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.replace(pg_catalog.gen_random_uuid()::text operator(pg_catalog.||)
                              pg_catalog.gen_random_uuid()::text, '-', '')
$$;
revoke all on function pgstream.new_token() from public;

-- What is stored of a token (null for null).
create or replace function pgstream.token_hash(p_token text)
returns bytea
language sql
immutable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.sha256(pg_catalog.convert_to(p_token, 'UTF8'))
$$;
revoke all on function pgstream.token_hash(text) from public;
