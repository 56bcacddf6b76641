-- Repeatable: metrics. Durable counters (pgstream.stream_counters, 015_metrics.sql) kept by triggers
-- on the ledger, the dead letters and the failovers, in the transaction of the change they count,
-- and the view the Prometheus exporter reads at every scrape (pgstream.metrics). Nothing is
-- counted in the generated triggers that write events: events per subscription key are counted
-- when the sensor records their batch (it reads each event's payload.tg_name then).
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.
--
-- What is counted, per stream (name, label):
--   batches_recorded, events_recorded          a batch recorded (by the sensor, or by recovery)
--   events_written (subscription key)          its events by payload.tg_name when that is a key of one of the
--                                              stream's subscriptions, '' otherwise (manual events)
--   delivery_attempts, delivery_attempts_failed a batch handed to a run (launched), a run failed on it (failed)
--   batches_delivered, events_delivered        marked delivered; events: those the sink confirmed (the batch's
--                                              events minus the ones set aside as dead letters)
--   batches_skipped, events_skipped            an operator skipped it
--   batches_done, events_done                  a batch left the open statuses (delivered or skipped): the
--                                              backlog is recorded minus done, without scanning the ledger
--   delivery_lag_bucket (upper bound), delivery_lag_sum
--                                              one observation per delivered batch: seconds from the commit
--                                              of its first transaction to the moment it was marked delivered
--   dead_letters_opened, dead_letters_redelivered, dead_letters_discarded
--   failovers_entered, failovers_recovered, failover_duration_bucket (upper bound), failover_duration_sum
set local search_path = pg_catalog, pg_temp;

-- ---------------------------------------------------------------------------------------------
-- Counting.

create or replace function pgstream._count(p_stream_id bigint, p_name text, p_label text, p_delta numeric)
returns void language sql security definer set search_path = pg_catalog, pg_temp
as $$
    insert into pgstream.stream_counters as c (stream_id, name, label, value)
    values (p_stream_id, p_name, p_label, p_delta)
    on conflict (stream_id, name, label) do update set value = c.value + excluded.value
$$;
revoke all on function pgstream._count(bigint, text, text, numeric) from public;

-- The bucket of a histogram (pgstream.metric_buckets) an observation of p_seconds falls in: its
-- upper bound, as the label of the bucket's counter.
create or replace function pgstream._bucket(p_histogram text, p_seconds float8)
returns text language sql stable security definer set search_path = pg_catalog, pg_temp
as $$
    select min(b.le)::text from pgstream.metric_buckets b
    where b.histogram = p_histogram and b.le >= greatest(p_seconds, 0)
$$;
revoke all on function pgstream._bucket(text, float8) from public;

-- One observation of a histogram: its bucket and its sum.
create or replace function pgstream._observe(p_stream_id bigint, p_histogram text, p_seconds float8)
returns void language sql security definer set search_path = pg_catalog, pg_temp
as $$
    select pgstream._count(p_stream_id, p_histogram || '_bucket', pgstream._bucket(p_histogram, p_seconds), 1);
    select pgstream._count(p_stream_id, p_histogram || '_sum', '', greatest(p_seconds, 0)::numeric);
$$;
revoke all on function pgstream._observe(bigint, text, float8) from public;

-- events_written by subscription key, for a batch just recorded: the recording transaction reads the
-- batch's events once (the writers' triggers count nothing), and looks at each event's payload.tg_name
-- (a key of one of the stream's subscriptions, '' otherwise). Every event is found: the recorder waited
-- until the batch's transactions are visible to new snapshots first (engine/ledger wait_until_visible;
-- decoding hands a commit out before it leaves the proc array).
--
-- Three ways to find them, by how the batch's ids lie:
-- * one event (a quiet stream's batch): one index probe, one upsert (0.1 ms a batch against
--   0.4 by the range below, whose sorts and hash cost more than the read of one row);
-- * dense (the usual case: the ids of a batch come from one sequence in commit order, so they span little
--   more than the batch): one scan of the id range on the primary key (id, created_at; the created_at
--   range prunes the partitions), the batch's ids hashed. At most 4 rows of the range per event of the
--   batch are read. No nested loop (enable_nestloop off in this function): a plan that probed the range
--   once per id cost seconds per batch (the planner's estimate of the range was stale);
-- * sparse (a long transaction's ids among many others'): one index probe per id, whatever the statistics
--   (the stream is checked after the probe, not in it).
-- Measured on 5,000-event batches: 7.3 ms per batch by probes, 2.1 ms by the range (bench/RESULTS.md,
-- issue 32 items 2 and 3).
create or replace function pgstream._count_written(p_stream_id bigint, p_ids bigint[], p_count bigint,
                                                   p_from timestamptz, p_to timestamptz)
returns void language plpgsql security definer
set search_path = pg_catalog, pg_temp set enable_nestloop = off
as $$
declare
    v_lo bigint;
    v_hi bigint;
    v_tg text;
begin
    if p_count = 1 and pg_catalog.cardinality(p_ids) = 1 then
        select ev.payload ->> 'tg_name' into v_tg
        from pgstream.events ev
        where ev.id = p_ids[pg_catalog.array_lower(p_ids, 1)] and ev.created_at >= p_from and ev.created_at <= p_to
          and ev.stream_id = p_stream_id;
        if found then
            insert into pgstream.stream_counters as c (stream_id, name, label, value)
            values (p_stream_id, 'events_written',
                    case when exists (select 1 from pgstream.subscriptions s
                                      where s.stream_id = p_stream_id and s.key = v_tg) then v_tg
                         else '' end, 1)
            on conflict (stream_id, name, label) do update set value = c.value + excluded.value;
        end if;
        return;
    end if;
    select min(x), max(x) into v_lo, v_hi from pg_catalog.unnest(p_ids) as x;
    if v_lo is null then
        return;
    end if;
    if v_hi - v_lo < 4 * greatest(p_count, 1) then
        insert into pgstream.stream_counters as c (stream_id, name, label, value)
        select p_stream_id, 'events_written', k.key, sum(k.n)
        from (select case when exists (select 1 from pgstream.subscriptions s
                                       where s.stream_id = p_stream_id and s.key = t.tg) then t.tg
                          else '' end as key, t.n
              from (select ev.payload ->> 'tg_name' as tg, count(*) as n
                    from pgstream.events ev
                    where ev.id between v_lo and v_hi
                      and ev.created_at >= p_from and ev.created_at <= p_to
                      and ev.stream_id = p_stream_id
                      and ev.id in (select x from pg_catalog.unnest(p_ids) as x)
                    group by 1) t) k
        group by k.key
        on conflict (stream_id, name, label) do update set value = c.value + excluded.value;
        return;
    end if;
    insert into pgstream.stream_counters as c (stream_id, name, label, value)
    select p_stream_id, 'events_written', k.key, sum(k.n)
    from (select case when exists (select 1 from pgstream.subscriptions s
                                   where s.stream_id = p_stream_id and s.key = t.tg) then t.tg
                      else '' end as key, t.n
          from (select e.tg, count(*) as n
                from pg_catalog.unnest(p_ids) as x(id)
                cross join lateral (
                    select ev.payload ->> 'tg_name' as tg, ev.stream_id
                    from pgstream.events ev
                    where ev.id = x.id and ev.created_at >= p_from and ev.created_at <= p_to
                    limit 1) e
                where e.stream_id = p_stream_id
                group by 1) t) k
    group by k.key
    on conflict (stream_id, name, label) do update set value = c.value + excluded.value;
end
$$;
revoke all on function pgstream._count_written(bigint, bigint[], bigint, timestamptz, timestamptz) from public;

-- The function of the triggers count_changes (below): what a row of pgstream.batches,
-- pgstream.dead_letters or pgstream.failovers that was inserted, or whose status changed (a
-- failover: ended), adds to the counters.
create or replace function pgstream._count_change()
returns trigger language plpgsql security definer set search_path = pg_catalog, pg_temp
as $$
declare
    v_sign integer;
    v_set_aside bigint;
    v_lag float8;
begin
    if tg_table_name = 'failovers' then
        if tg_op = 'INSERT' then
            perform pgstream._count(new.stream_id, 'failovers_entered', '', 1);
        elsif old.ended_at is null and new.ended_at is not null then
            perform pgstream._count(new.stream_id, 'failovers_recovered', '', 1);
            perform pgstream._observe(new.stream_id, 'failover_duration',
                                      extract(epoch from new.ended_at - new.started_at)::float8);
        end if;
        return null;
    end if;
    if tg_op = 'UPDATE' and old.status is not distinct from new.status then
        return null;
    end if;
    if tg_table_name = 'dead_letters' then
        if tg_op = 'INSERT' then
            perform pgstream._count(new.stream_id, 'dead_letters_opened', '', 1);
        elsif new.status in ('redelivered', 'discarded') then
            perform pgstream._count(new.stream_id, 'dead_letters_' || new.status, '', 1);
        end if;
        return null;
    end if;
    -- pgstream.batches: what one change adds, in one upsert (its names are distinct: no row is hit twice),
    -- planned once per session (a static statement of this function), not one call of _count per counter
    if tg_op = 'INSERT' then
        insert into pgstream.stream_counters as c (stream_id, name, label, value)
        values (new.stream_id, 'batches_recorded', '', 1), (new.stream_id, 'events_recorded', '', new.event_count)
        on conflict (stream_id, name, label) do update set value = c.value + excluded.value;
        perform pgstream._count_written(new.stream_id, new.event_ids, new.event_count, new.min_created_at,
                                        new.max_created_at);
        return null;
    end if;
    -- a status change
    if pgstream.batch_is_open(old.status) <> pgstream.batch_is_open(new.status) then
        v_sign := case when pgstream.batch_is_open(new.status) then -1 else 1 end;
    end if;
    if new.status = 'delivered' then
        select count(*) into v_set_aside from pgstream.dead_letters d
         where d.batch_id = new.id and d.stage = 'deliver';
        if new.first_commit_at is not null and new.delivered_at is not null then
            v_lag := greatest(extract(epoch from new.delivered_at - new.first_commit_at)::float8, 0);
        end if;
    end if;
    insert into pgstream.stream_counters as c (stream_id, name, label, value)
    select new.stream_id, v.name, v.label, v.value
    from (values
        ('delivery_attempts', '', case when new.status = 'launched' then 1 end::numeric),
        ('delivery_attempts_failed', '', case when new.status = 'failed' then 1 end::numeric),
        ('batches_done', '', v_sign::numeric),
        ('events_done', '', (v_sign * new.event_count)::numeric),
        ('batches_delivered', '', case when new.status = 'delivered' then 1 end::numeric),
        ('events_delivered', '', case when new.status = 'delivered' then new.event_count - v_set_aside end::numeric),
        ('delivery_lag_bucket', (select min(b.le)::text from pgstream.metric_buckets b
                                 where b.histogram = 'delivery_lag' and b.le >= v_lag),
         case when v_lag is not null then 1 end::numeric),
        ('delivery_lag_sum', '', v_lag::numeric),
        ('batches_skipped', '', case when new.status = 'skipped' then 1 end::numeric),
        ('events_skipped', '', case when new.status = 'skipped' then new.event_count end::numeric)
    ) v(name, label, value)
    where v.value is not null
    on conflict (stream_id, name, label) do update set value = c.value + excluded.value;
    return null;
end
$$;
revoke all on function pgstream._count_change() from public;

-- ---------------------------------------------------------------------------------------------
-- The first time this file is applied, the counters start from the ledger as it is (what was pruned
-- before is not known; per-subscription counts start now). The tables are locked first, so no
-- change slips between this fill and the triggers below: the fill sees every change before them,
-- the triggers count every change after them.
lock table pgstream.batches, pgstream.dead_letters, pgstream.failovers in share row exclusive mode;

insert into pgstream.stream_counters as c (stream_id, name, label, value)
select f.stream_id, f.name, f.label, sum(f.value)
from (
    select b.stream_id, v.name, v.label, v.value
    from pgstream.batches b
    left join lateral (select count(*) as n from pgstream.dead_letters d
                       where d.batch_id = b.id and d.stage = 'deliver') dl on b.status = 'delivered'
    cross join lateral (values
        ('batches_recorded', '', 1::numeric),
        ('events_recorded', '', b.event_count::numeric),
        ('delivery_attempts', '', b.attempts::numeric),
        ('batches_done', '', case when pgstream.batch_is_open(b.status) then 0 else 1 end::numeric),
        ('events_done', '', case when pgstream.batch_is_open(b.status) then 0 else b.event_count end::numeric),
        ('batches_delivered', '', (b.status = 'delivered')::integer::numeric),
        ('events_delivered', '', case when b.status = 'delivered' then b.event_count - dl.n else 0 end::numeric),
        ('batches_skipped', '', (b.status = 'skipped')::integer::numeric),
        ('events_skipped', '', case when b.status = 'skipped' then b.event_count else 0 end::numeric)) v(name, label, value)
    union all
    select b.stream_id, 'delivery_lag_bucket',
           pgstream._bucket('delivery_lag', extract(epoch from b.delivered_at - b.first_commit_at)::float8), 1
    from pgstream.batches b
    where b.status = 'delivered' and b.delivered_at is not null and b.first_commit_at is not null
    union all
    select b.stream_id, 'delivery_lag_sum', '', greatest(extract(epoch from b.delivered_at - b.first_commit_at), 0)
    from pgstream.batches b
    where b.status = 'delivered' and b.delivered_at is not null and b.first_commit_at is not null
    union all
    select d.stream_id, 'dead_letters_' || case d.status when 'open' then 'opened' else d.status end, '', 1
    from pgstream.dead_letters d
    union all
    select d.stream_id, 'dead_letters_opened', '', 1 from pgstream.dead_letters d where d.status <> 'open'
    union all
    select f.stream_id, 'failovers_entered', '', 1 from pgstream.failovers f
    union all
    select f.stream_id, 'delivery_attempts_failed', '', f.attempts from pgstream.failovers f
    union all
    select f.stream_id, 'failovers_recovered', '', 1 from pgstream.failovers f where f.ended_at is not null
    union all
    select f.stream_id, 'failover_duration_bucket',
           pgstream._bucket('failover_duration', extract(epoch from f.ended_at - f.started_at)::float8), 1
    from pgstream.failovers f where f.ended_at is not null
    union all
    select f.stream_id, 'failover_duration_sum', '', greatest(extract(epoch from f.ended_at - f.started_at), 0)
    from pgstream.failovers f where f.ended_at is not null
) f
where not exists (select 1 from pg_catalog.pg_trigger t
                  where t.tgrelid = 'pgstream.batches'::pg_catalog.regclass and t.tgname = 'count_changes')
group by f.stream_id, f.name, f.label
having sum(f.value) <> 0
on conflict (stream_id, name, label) do update set value = c.value + excluded.value;

-- One trigger a table; a row whose status (ended_at) did not change adds nothing.
create or replace trigger count_changes after insert or update of status on pgstream.batches
for each row execute function pgstream._count_change();
create or replace trigger count_changes after insert or update of status on pgstream.dead_letters
for each row execute function pgstream._count_change();
create or replace trigger count_changes after insert or update of ended_at on pgstream.failovers
for each row execute function pgstream._count_change();

-- ---------------------------------------------------------------------------------------------
-- What the exporter reads at every scrape: (metric, stream_id, label, value) rows. Every part is
-- bounded: counters by the primary key, a stream's head batch and its launched batches by the
-- open-batch index, open dead letters by theirs, the last housekeeping pass by its id; nothing
-- reads pgstream.events. Any role granted SELECT on it (and USAGE on the schema) can scrape: the
-- functions it calls are executable by PUBLIC. Metric names: engine/metrics.py.
create or replace view pgstream.metrics as
select c.name as metric, c.stream_id, c.label, c.value::float8 as value
from pgstream.stream_counters c
where c.name not in ('batches_done', 'events_done')
union all
select 'bucket_bound', null::bigint, b.histogram, b.le
from pgstream.metric_buckets b
union all
select g.metric, s.id, g.label, g.value
from pgstream.streams s
-- a reader group's stream that has joined reads the group's slot
left join pgstream.reader_groups rg
  on rg.name = s.reader_group and s.slot_reader = 'group:' || s.reader_group and s.join_lsn is null
left join pg_catalog.pg_replication_slots r
  on r.slot_name = coalesce(rg.slot, s.slot) and r.database = current_database()
cross join lateral (
    select coalesce(sum(c.value) filter (where c.name = 'events_recorded'), 0)
             - coalesce(sum(c.value) filter (where c.name = 'events_done'), 0) as events,
           coalesce(sum(c.value) filter (where c.name = 'batches_recorded'), 0)
             - coalesce(sum(c.value) filter (where c.name = 'batches_done'), 0) as batches
    from pgstream.stream_counters c
    where c.stream_id = s.id and c.label = ''
      and c.name in ('events_recorded', 'events_done', 'batches_recorded', 'batches_done')) backlog
left join lateral (
    select b.first_commit_at from pgstream.batches b
    where b.stream_id = s.id and pgstream.batch_is_open(b.status)
    order by b.id limit 1) head on true
cross join lateral (
    select count(*) as n from pgstream.batches b
    where b.stream_id = s.id and pgstream.batch_is_open(b.status) and b.status = 'launched') launched
cross join lateral (
    select count(*) as n from pgstream.dead_letters d where d.stream_id = s.id and d.status = 'open') letters
cross join lateral (values
    ('backlog_events', '', backlog.events::float8),
    ('backlog_batches', '', backlog.batches::float8),
    ('oldest_undelivered_age', '',
     coalesce(greatest(extract(epoch from now() - head.first_commit_at), 0), 0)::float8),
    ('batches_in_flight', '', launched.n::float8),
    ('open_run', '', (s.open_run_key is not null)::integer::float8),
    ('paused', '', s.paused::integer::float8),
    ('recovering', '', s.recovery_pending::integer::float8),
    ('failover_active', '', (s.failover_since is not null)::integer::float8),
    ('failover_since', '', coalesce(extract(epoch from s.failover_since), 0)::float8),
    ('failover_current', '', coalesce(extract(epoch from now() - s.failover_since), 0)::float8),
    ('failover_attempts', '', s.failover_attempts::float8),
    ('dead_letters_open', '', letters.n::float8),
    ('slot_info', coalesce(rg.slot, s.slot), 1::float8),
    ('slot_exists', '', (r.slot_name is not null)::integer::float8),
    ('slot_active', '', coalesce(r.active, false)::integer::float8),
    ('slot_retained_wal', '', coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), r.restart_lsn), 0)::float8),
    ('slot_lag', '', coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), r.confirmed_flush_lsn), 0)::float8),
    ('slot_wal_status', 'reserved', (r.wal_status is not distinct from 'reserved')::integer::float8),
    ('slot_wal_status', 'extended', (r.wal_status is not distinct from 'extended')::integer::float8),
    ('slot_wal_status', 'unreserved', (r.wal_status is not distinct from 'unreserved')::integer::float8),
    ('slot_wal_status', 'lost', (r.wal_status is not distinct from 'lost')::integer::float8),
    ('slot_wal_status', 'missing', (r.slot_name is null)::integer::float8)) g(metric, label, value)
union all
select g.metric, null::bigint, g.label, g.value
from (select * from pgstream.housekeeping_runs order by id desc limit 1) h
cross join lateral (values
    ('housekeeping_last_run', '', extract(epoch from h.ran_at)::float8),
    ('housekeeping_partitions', 'created', h.partitions_created::float8),
    ('housekeeping_partitions', 'dropped', h.partitions_dropped::float8),
    ('housekeeping_partitions', 'kept', h.partitions_kept::float8),
    ('housekeeping_partitions', 'busy', h.partitions_busy::float8),
    ('housekeeping_rows', 'dropped', h.rows_dropped::float8),
    ('housekeeping_rows', 'default_deleted', h.default_rows_deleted::float8),
    ('housekeeping_bytes_dropped', '', h.bytes_dropped::float8),
    ('housekeeping_batches_pruned', '', h.batches_pruned::float8),
    ('housekeeping_warnings', '', h.warnings::float8),
    ('housekeeping_consumers_overrun', '', h.consumers_overrun::float8)) g(metric, label, value)
union all
-- registered consumers (026_consumers.sql): what each has not read, by the ledger's stream-and-id index;
-- an abandoned consumer's sum covers at most its max_retention_days of batches (housekeeping prunes the rest).
-- Spelled out here, not through pgstream.consumer_positions: this file is applied before 26_consumers.sql
select g.metric, c.stream_id, c.name, g.value
from pgstream.consumers c
cross join lateral (
    select coalesce(sum(b.event_count - case when b.id = c.batch_id then c.ord else 0 end), 0) as events,
           min(b.min_created_at) as oldest
    from pgstream.batches b
    where b.stream_id = c.stream_id and b.id >= c.batch_id and (b.id > c.batch_id or c.ord < b.event_count)) u
cross join lateral (values
    ('consumer_lag_events', u.events::float8),
    ('consumer_oldest_unread_age', coalesce(greatest(extract(epoch from now() - u.oldest), 0), 0)::float8),
    ('consumer_overrun',
     coalesce(u.oldest < ((pgstream.utc_today() - c.max_retention_days)::timestamp at time zone 'UTC'),
              false)::integer::float8)) g(metric, value)
union all
select 'orphaned_slot_retained_wal', null::bigint, o.slot_name, o.retained_bytes::float8
from pgstream.orphaned_slots o
union all
select 'events_partitions', null::bigint, '', count(*)::float8
from pg_catalog.pg_inherits i
where i.inhparent = 'pgstream.events'::pg_catalog.regclass;

revoke all on pgstream.metrics from public;
