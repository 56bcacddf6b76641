-- 015: metrics. The Prometheus exporter (`pgstream-dagster metrics`) computes every metric from the
-- database when it is scraped, so any number of exporters agree and nothing is lost when a process
-- ends. What the ledger forgets (pgstream.prune_batches deletes delivered batches) must not take
-- the totals down with it: counters are kept per stream in pgstream.stream_counters, incremented
-- by triggers on the ledger (batches), dead letters and failovers in the transaction of the change
-- they count (repeatable/09_metrics.sql), so pruning, restarts and exporter replicas never change a
-- total. Histograms are stored as counts per bucket (pgstream.metric_buckets: the upper bounds).
-- Housekeeping records each pass in pgstream.housekeeping_runs.
--
-- This version holds the tables and the bucket bounds; the counting triggers, the view the
-- exporter reads (pgstream.metrics) and the first fill of the counters from an existing ledger are
-- in repeatable/09_metrics.sql.

create table if not exists pgstream.stream_counters (
    stream_id bigint not null references pgstream.streams (id) on delete cascade,
    -- what is counted (events_recorded, events_delivered, delivery_lag_bucket, ...: repeatable/09_metrics.sql)
    name      text not null,
    -- a subscription key (events_written) or a bucket's upper bound (*_bucket); '' otherwise
    label     text not null default '',
    value     numeric not null default 0,
    primary key (stream_id, name, label)
);
revoke all on pgstream.stream_counters from public;

-- The upper bounds (inclusive) of the histograms' buckets, in seconds; 'Infinity' is +Inf.
create table if not exists pgstream.metric_buckets (
    histogram text not null,
    le        double precision not null,
    primary key (histogram, le)
);
revoke all on pgstream.metric_buckets from public;
insert into pgstream.metric_buckets (histogram, le)
select 'delivery_lag', le
from unnest(array[0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 'Infinity']::float8[]) le
union all
select 'failover_duration', le
from unnest(array[10, 30, 60, 300, 900, 1800, 3600, 7200, 21600, 86400, 'Infinity']::float8[]) le
on conflict do nothing;

-- One row per housekeeping pass (engine/housekeeping.py); the exporter shows the last one.
create table if not exists pgstream.housekeeping_runs (
    id                   bigint generated always as identity primary key,
    ran_at               timestamptz not null default now(),
    today                date not null,
    partitions_created   integer not null,
    partitions_dropped   integer not null,
    partitions_kept      integer not null,
    rows_dropped         bigint not null,
    bytes_dropped        bigint not null,
    default_rows_deleted bigint not null,
    batches_pruned       bigint not null,
    warnings             integer not null
);
revoke all on pgstream.housekeeping_runs from public;
