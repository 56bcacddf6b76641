-- pgstream bootstrap: the schema and the migrations ledger. Run before every migration pass;
-- idempotent. The migrator takes pg_advisory_xact_lock on the pgstream migration key first.
create schema if not exists pgstream;

create table if not exists pgstream.schema_migrations (
    version    integer primary key,
    name       text not null,
    checksum   text not null,
    applied_at timestamptz not null default now()
);
