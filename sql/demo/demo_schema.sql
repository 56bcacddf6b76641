-- Demo application schema for `make dev` (not a migration). Idempotent.
create schema if not exists demo;
create table if not exists demo.users (
    id             bigint generated always as identity primary key,
    email          text not null,
    email_verified boolean not null default false,
    created_at     timestamptz not null default now()
);
