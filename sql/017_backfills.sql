-- 017: backfills. A backfill turns the rows a table already has into events of one of its
-- subscriptions (payload tg_op 'READ'), in key-range partitions read in parallel, chunk by chunk;
-- each chunk writes its events and its progress in one transaction, so progress is durable and a
-- resumed backfill reads no row twice. The functions are in repeatable/10_backfills.sql.
--
-- Status: running (a run owns it: owner_token), stopped (its run was cancelled or died), failed
-- (a row could not become an event, or its subscription went away), done, cancelled. The first
-- three are unfinished: at most one per (stream, subscription key, table), and launching a
-- backfill of that target resumes it.

create table if not exists pgstream.backfills (
    id                      bigint generated always as identity primary key,
    stream_id               bigint not null,
    subscription_id         bigint,
    subscription_key        text not null,
    schema_name             text not null,
    table_name              text not null,
    operation               pgstream.operation_type not null,
    filter                  text,
    key_columns             text[] not null,
    from_key                jsonb,
    to_key                  jsonb,
    status                  text not null default 'running'
                            check (status in ('running', 'stopped', 'failed', 'done', 'cancelled')),
    owner_token             uuid,
    run_id                  text,
    subscription_updated_at timestamptz,
    rows_total              bigint,
    error                   text,
    created_at              timestamptz not null default now(),
    updated_at              timestamptz not null default now(),
    finished_at             timestamptz
);

create unique index if not exists backfills_one_unfinished
    on pgstream.backfills (stream_id, subscription_key, schema_name, table_name)
    where status in ('running', 'stopped', 'failed');

-- One key range of a backfill. Bounds are JSON arrays of the key columns' values: lower_key
-- exclusive (null: the start of the backfill's range), upper_key inclusive (null: its end);
-- cursor_key is the last key read (the next chunk starts after it).
create table if not exists pgstream.backfill_partitions (
    backfill_id    bigint not null references pgstream.backfills (id) on delete cascade,
    part           integer not null check (part >= 0),
    lower_key      jsonb,
    upper_key      jsonb,
    cursor_key     jsonb,
    done           boolean not null default false,
    rows_read      bigint not null default 0,
    events_written bigint not null default 0,
    chunks         bigint not null default 0,
    updated_at     timestamptz not null default now(),
    primary key (backfill_id, part)
);

revoke all on pgstream.backfills, pgstream.backfill_partitions from public;
