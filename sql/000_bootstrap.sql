-- pgstream bootstrap: the schema and the ledgers of what `migrate` applied. Run before every
-- migration pass; idempotent. The migrator holds the pgstream migration advisory lock.
--   * schema_migrations: the versioned migrations (NNN_*.sql), applied once each, with checksum.
--   * schema_repeatables: the repeatable files (repeatable/NN_*.sql) and the checksum each was
--     last applied with; a file whose checksum differs is applied again.
create schema if not exists pgstream;

create table if not exists pgstream.schema_migrations (
    version    integer primary key,
    name       text not null,
    checksum   text not null,
    applied_at timestamptz not null default now()
);

create table if not exists pgstream.schema_repeatables (
    name       text primary key,
    checksum   text not null,
    applied_at timestamptz not null default now()
);
revoke all on pgstream.schema_repeatables from public;
