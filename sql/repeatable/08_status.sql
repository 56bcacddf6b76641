-- Repeatable: status. pgstream.stream_status, one row per stream: state, failover checkpoint,
-- backlog, slot lag, open dead letters. Read by `pgstream-dagster status`, the stream status asset
-- and the asset checks; usable from psql.
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent. `create or
-- replace view` keeps the columns it had and may only append new ones: add a column at the end,
-- or drop the view first (`drop view if exists pgstream.stream_status;`) to reorder or remove one.
create or replace view pgstream.stream_status as
select s.id,
       case when s.paused then 'paused'
            when s.recovery_pending then 'recovering'
            when s.failover_since is not null and exists (
                 select 1 from pgstream.batches b where b.stream_id = s.id and b.status = 'failed') then 'failover'
            when s.failover_since is not null then 'catching up'
            else 'healthy' end as state,
       s.paused, s.failover_since, s.failover_checkpoint_id, s.failover_checkpoint_ts, s.failover_error,
       s.failover_retry_at, s.failover_attempts, s.consumed_through, s.recovery_pending,
       o.batches as undelivered_batches, o.events as undelivered_events,
       o.oldest_event_id as oldest_undelivered_event_id, o.oldest_commit_at as oldest_undelivered_at,
       (select coalesce(sum(b.event_count), 0) from pgstream.batches b
         where b.stream_id = s.id and b.status = 'delivered'
           and b.delivered_at >= (pgstream.utc_today()::timestamp at time zone 'UTC')) as delivered_today,
       (select max(b.last_event_id) from pgstream.batches b where b.stream_id = s.id) as last_recorded_event_id,
       (select max(b.delivered_at) from pgstream.batches b where b.stream_id = s.id) as last_delivered_at,
       coalesce(g.slot, s.slot) as slot_name,
       r.slot_name is not null as slot_exists,
       r.wal_status,
       pg_wal_lsn_diff(pg_current_wal_lsn(), r.restart_lsn)::bigint as slot_retained_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), r.confirmed_flush_lsn)::bigint as slot_lag_bytes,
       d.open as open_dead_letters,
       d.oldest as oldest_dead_letter_at,
       greatest((select b.end_lsn from pgstream.batches b
                  where b.stream_id = s.id and b.kind = 'stream' and b.end_lsn is not null
                  order by b.end_lsn desc limit 1),
                (select b.end_lsn from pgstream.batches b
                  where b.stream_id = s.id and b.kind = 'recovery' and b.end_lsn is not null
                  order by b.end_lsn desc limit 1))::text as last_recorded_lsn
from pgstream.streams s
cross join lateral (
    select count(*) as batches, coalesce(sum(b.event_count), 0) as events,
           min(b.first_event_id) as oldest_event_id, min(b.first_commit_at) as oldest_commit_at
    from pgstream.batches b
    where b.stream_id = s.id and pgstream.batch_is_open(b.status)) o
cross join lateral (
    select count(*) as open, min(dl.created_at) as oldest
    from pgstream.dead_letters dl
    where dl.stream_id = s.id and dl.status = 'open') d
-- a member of a reader group that has joined reads the group's slot
left join pgstream.reader_groups g
  on g.name = s.reader_group and s.slot_reader = 'group:' || s.reader_group and s.join_lsn is null
left join pg_catalog.pg_replication_slots r
  on r.slot_name = coalesce(g.slot, s.slot) and r.database = current_database();

revoke all on pgstream.stream_status from public;

-- Logical slots of this database named like a stream's default slot (pgstream.default_slot_pattern():
-- pgstream_stream_<id>, or pgstream_stream_<id>_d<oid>_<hex>; other databases' are not listed) that no
-- stream reads: left by a deleted stream, or by a stream whose slot_name changed. Each keeps its WAL
-- until dropped (the no_orphaned_slots check, `pgstream-dagster status`, the
-- pgstream_orphaned_slot_retained_wal_bytes metric). A custom-named slot a stream stopped using cannot
-- be told from another consumer's and is not listed.
create or replace view pgstream.orphaned_slots as
select r.slot_name::text as slot_name,
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), r.restart_lsn), 0)::bigint as retained_bytes,
       r.active,
       r.wal_status
from pg_catalog.pg_replication_slots r
where r.database = current_database()
  and r.slot_type = 'logical'
  and r.slot_name::text ~ pgstream.default_slot_pattern()
  and not exists (select 1 from pgstream.streams s where s.slot = r.slot_name::text)
  and not exists (select 1 from pgstream.reader_groups g where g.slot = r.slot_name::text);

revoke all on pgstream.orphaned_slots from public;
