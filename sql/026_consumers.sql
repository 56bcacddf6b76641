-- 026: registered consumers. A reader of a stream outside the delivery runs (the Spark source,
-- spark.readStream.format("pgstream"), engine/spark_source.py) records how far it has read in the
-- ledger's order: batch_id and ord (1-based, in the batch's commit order; 0: nothing of it; batch 0:
-- before every batch). Housekeeping keeps the partitions and the ledger batches a consumer has not
-- passed, for at most max_retention_days (then it drops them anyway and reports the consumer as
-- overrun), so an abandoned consumer cannot fill the disk silently. The functions are in
-- repeatable/26_consumers.sql; who may do what in repeatable/99_runtime.sql.

create table if not exists pgstream.consumers (
    name               text primary key
                       check (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$'),
    stream_id          bigint not null references pgstream.streams (id) on delete cascade,
    batch_id           bigint not null check (batch_id >= 0),
    ord                integer not null check (ord >= 0),
    max_retention_days integer not null default 30 check (max_retention_days between 1 and 3650),
    created_at         timestamptz not null default now(),
    updated_at         timestamptz not null default now(),
    check (batch_id > 0 or ord = 0)
);
revoke all on pgstream.consumers from public;

-- a stream's batches in ledger order (a consumer's next batches, its lag)
create index if not exists batches_stream_id_idx on pgstream.batches (stream_id, id);

-- what the housekeeping pass dropped although a consumer had not read it (its bound had passed)
alter table pgstream.housekeeping_runs add column if not exists consumers_overrun integer not null default 0;
