-- 018: resume points of ordering: by_key. A by_key round repartitions its events into
-- `partitions` Spark partitions by the routing key (Spark's hash partitioning: bucket =
-- pmod(hash(routing_key), partitions)) and each partition publishes its keys' events in commit
-- order through a sink of its own. After every chunk the sink confirmed, the Spark task records
-- here, before it publishes anything more, that every event of its buckets at a position
-- (batch_id, ord) up to the one it reached is handled. A retry of the round (a failed run, or
-- Spark retrying a task) partitions the same way and skips those events, so keys that completed
-- are not delivered again. Once a round is delivered, the run deletes the rows whose position
-- lies in its batches; a row past them stays (a failover probe delivers the failed batch alone,
-- and the batches after it resume from it). Positions are the ledger's (batches are delivered in
-- id order), so a row left behind in a delivered batch never matches an event of a later one.

create table if not exists pgstream.key_progress (
    stream_id  bigint not null references pgstream.streams (id) on delete cascade,
    partitions integer not null check (partitions > 0),
    bucket     integer not null check (bucket >= 0 and bucket < partitions),
    batch_id   bigint not null,
    ord        bigint not null,
    updated_at timestamptz not null default now(),
    primary key (stream_id, partitions, bucket)
);
revoke all on pgstream.key_progress from public;
