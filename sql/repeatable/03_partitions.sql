-- Repeatable: partitions and retention. Daily partitions of pgstream.events (UTC days), created
-- ahead and dropped after retention; undelivered events are never dropped silently.
--
-- Applied by `pgstream-dagster migrate` after the versioned migrations (sql/NNN_*.sql), and again
-- whenever this file changes, in its own transaction: every statement is idempotent.
--
-- Partition maintenance is serialised: create_partitions and drop_partition(s) take pgstream's lock
-- 'partitions' for their transaction (pgstream.lock_for_transaction, repeatable/00_locks.sql: a row
-- only the owner can lock, not an advisory lock any role could hold) before they look at the catalog. Concurrent
-- callers (housekeeping next to migrate or init) used to deadlock attaching partitions next to the
-- default partition, or fail creating the same day twice.

create or replace function pgstream.partition_name(p_day date)
returns text language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'events_' || to_char(p_day, 'YYYYMMDD') $$;
revoke all on function pgstream.partition_name(date) from public;

create or replace function pgstream.utc_today()
returns date language sql stable
set search_path = pg_catalog, pg_temp
as $$ select (now() at time zone 'UTC')::date $$;
-- Reads only the clock: any role may run it, so that a role granted SELECT on pgstream.stream_status
-- (which counts today's deliveries with it) can read the view.
grant execute on function pgstream.utc_today() to public;

-- ---------------------------------------------------------------------------------------------
-- What retention must keep.

-- Partitions that hold events a stream has not delivered, or may not have read from its slot
-- yet, are protected. consumed_through is moved back one day for transactions that commit long
-- after their rows were inserted.
create or replace function pgstream.oldest_protected_day()
returns date
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select (least(
        (select min(min_created_at) from pgstream.batches where pgstream.batch_is_open(status)),
        (select min(consumed_through) - interval '1 day' from pgstream.streams)
    ) at time zone 'UTC')::date
$$;
revoke all on function pgstream.oldest_protected_day() from public;

-- Which streams hold back which day: for operators and the 'fail' policy's message.
create or replace function pgstream.protected_streams(
    out stream_id bigint, out oldest_undelivered timestamptz, out consumed_through timestamptz
)
returns setof record
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select s.id,
           (select min(b.min_created_at) from pgstream.batches b
             where b.stream_id = s.id and pgstream.batch_is_open(b.status)),
           s.consumed_through
    from pgstream.streams s
    order by s.id
$$;
revoke all on function pgstream.protected_streams() from public;

-- ---------------------------------------------------------------------------------------------
-- Partition maintenance, serialised (see above), and never in front of application writes for
-- more than a bounded moment.
--
-- ATTACH takes SHARE UPDATE EXCLUSIVE on pgstream.events and ACCESS EXCLUSIVE on events_default;
-- DETACH (and the DROP after it) ACCESS EXCLUSIVE on pgstream.events. A lock request waits in the
-- queue behind every session that holds a conflicting lock (an application transaction that wrote
-- an event and sits idle holds ROW EXCLUSIVE on pgstream.events until it ends), and every later
-- request that conflicts with it (each application insert into a subscribed table) queues behind
-- it. So each of these statements runs with a short lock_timeout (p_lock_timeout_ms), in a
-- subtransaction, up to p_lock_attempts times with a growing pause between attempts in which
-- nothing on pgstream.events is held or requested; when every attempt times out the partition is
-- left for the next pass with a WARNING ('... not created/dropped this pass ...'), never an error.
-- DETACH PARTITION ... CONCURRENTLY is not used: Postgres refuses it on a table with a default
-- partition, and pgstream.events keeps events_default so that no insert ever fails for want of a
-- partition.

-- The pause before attempt p_attempt + 1: the lock timeout doubled each attempt, at most 5 s.
create or replace function pgstream._lock_backoff(p_lock_timeout_ms integer, p_attempt integer)
returns void language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pg_catalog.pg_sleep(least(p_lock_timeout_ms * 2.0 ^ (p_attempt - 1), 5000.0) / 1000.0);
end
$$;
revoke all on function pgstream._lock_backoff(integer, integer) from public;

create or replace function pgstream._check_lock_arguments(p_caller text, p_lock_timeout_ms integer,
                                                          p_lock_attempts integer)
returns void language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_lock_timeout_ms is null or p_lock_timeout_ms < 1 then
        raise exception 'pgstream.%: p_lock_timeout_ms must be >= 1, got %', p_caller, p_lock_timeout_ms;
    end if;
    if p_lock_attempts is null or p_lock_attempts < 1 then
        raise exception 'pgstream.%: p_lock_attempts must be >= 1, got %', p_caller, p_lock_attempts;
    end if;
end
$$;
revoke all on function pgstream._check_lock_arguments(text, integer, integer) from public;

-- Creates the partitions for p_today .. p_today + p_days_ahead that do not exist yet and returns
-- their names. A day whose rows already sit in the default partition (maintenance did not run in
-- time) is left in the default partition, with a warning: moving them would replay them through
-- logical replication as new inserts. A day whose ATTACH could not take its locks within
-- p_lock_attempts attempts of p_lock_timeout_ms is not created this pass (WARNING); the days after
-- it are left too (they need the same locks).
create or replace function pgstream.create_partitions(
    p_days_ahead integer default 7,
    p_today date default pgstream.utc_today(),
    p_lock_timeout_ms integer default 200,
    p_lock_attempts integer default 5
)
returns setof text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_day     date;
    v_name    text;
    v_lo      timestamptz;
    v_hi      timestamptz;
    v_saved   text := pg_catalog.current_setting('lock_timeout');
    v_attempt integer;
    v_state   text;  -- 'created', 'parked' (rows in events_default), 'busy'
begin
    if p_days_ahead is null or p_days_ahead < 0 then
        raise exception 'pgstream.create_partitions: p_days_ahead must be >= 0, got %', p_days_ahead;
    end if;
    perform pgstream._check_lock_arguments('create_partitions', p_lock_timeout_ms, p_lock_attempts);
    -- one maintainer at a time; each statement below sees what the previous holder committed
    perform pgstream.lock_for_transaction('partitions');
    for v_day in select d::date from pg_catalog.generate_series(p_today, p_today + p_days_ahead,
                                                                interval '1 day') d loop
        v_name := pgstream.partition_name(v_day);
        continue when pg_catalog.to_regclass(pg_catalog.format('pgstream.%I', v_name)) is not null;
        v_lo := v_day::timestamp at time zone 'UTC';
        v_hi := (v_day + 1)::timestamp at time zone 'UTC';
        v_state := 'busy';
        for v_attempt in 1 .. p_lock_attempts loop
            begin
                -- reverted with the subtransaction when it fails, and by hand below when it succeeds
                perform pg_catalog.set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
                if exists (select 1 from pgstream.events_default where created_at >= v_lo and created_at < v_hi) then
                    v_state := 'parked';
                else
                    -- create standalone then attach: ATTACH only takes SHARE UPDATE EXCLUSIVE on the
                    -- parent, so application inserts keep flowing.
                    execute pg_catalog.format('create table pgstream.%I (like pgstream.events including defaults '
                                              'including constraints)', v_name);
                    execute pg_catalog.format('alter table pgstream.%I add constraint %I check (created_at >= %L '
                                              'and created_at < %L)', v_name, v_name || '_bounds', v_lo, v_hi);
                    execute pg_catalog.format('alter table pgstream.events attach partition pgstream.%I for values '
                                              'from (%L) to (%L)', v_name, v_lo, v_hi);
                    execute pg_catalog.format('alter table pgstream.%I drop constraint %I', v_name,
                                              v_name || '_bounds');
                    v_state := 'created';
                end if;
                perform pg_catalog.set_config('lock_timeout', v_saved, true);
                exit;
            exception when lock_not_available then
                if v_attempt < p_lock_attempts then
                    perform pgstream._lock_backoff(p_lock_timeout_ms, v_attempt);
                end if;
            end;
        end loop;
        if v_state = 'parked' then
            raise warning 'pgstream: events for % are in pgstream.events_default; no partition created for that day', v_day;
        elsif v_state = 'busy' then
            raise warning 'pgstream: partition % not created this pass: other transactions held their locks on '
                          'pgstream.events through % attempts of % ms; the next pass tries again',
                          v_name, p_lock_attempts, p_lock_timeout_ms;
            return;
        else
            return next v_name;
        end if;
    end loop;
end
$$;
revoke all on function pgstream.create_partitions(integer, date, integer, integer) from public;

-- ---------------------------------------------------------------------------------------------
-- Retention of the default partition: a row past retention is deleted only once it is done with:
-- a closed (delivered or skipped) batch holds it, or it is a dead letter (its payload was copied),
-- or it is older than its stream's ledger horizon (delivered by batches pruned since), was read
-- from the slot (a day of slack, as for partitions) and is in no open batch. A row no batch holds
-- yet (not read from the slot, whatever its date) stays, and so does a row of a batch a registered
-- consumer has not read, within its bound (pgstream.consumer_unread counts such a batch as open).
-- (A batch holding a row has min_created_at <= its created_at: only batches older than the
-- cutoff are looked at.) Called by pgstream.delete_expired_default; returns the rows deleted.
create or replace function pgstream._delete_expired_default(p_before timestamptz)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    -- every (stream, event) a batch old enough holds, and whether an open batch holds it
    with held as materialized (
        select b.stream_id, o.id,
               pg_catalog.bool_or(pgstream.batch_is_open(b.status)
                                  or pgstream.consumer_unread(b.stream_id, b.id, b.event_count, b.max_created_at))
                   as open
        from pgstream.batches b
        cross join lateral pg_catalog.unnest(b.event_ids) as o(id)
        where b.min_created_at operator(pg_catalog.<) p_before
        group by b.stream_id, o.id
    ), gone as (
        delete from pgstream.events_default e
        where e.created_at operator(pg_catalog.<) p_before
          and not exists (select 1 from held h
                          where h.stream_id operator(pg_catalog.=) e.stream_id and h.id operator(pg_catalog.=) e.id
                            and h.open)
          and (exists (select 1 from held h
                       where h.stream_id operator(pg_catalog.=) e.stream_id and h.id operator(pg_catalog.=) e.id
                         and not h.open)
               or exists (select 1 from pgstream.dead_letters d
                          where d.stream_id operator(pg_catalog.=) e.stream_id
                            and d.event_id operator(pg_catalog.=) e.id)
               or exists (select 1 from pgstream.streams s
                          where s.id operator(pg_catalog.=) e.stream_id
                            and e.created_at operator(pg_catalog.<=) s.ledger_horizon
                            and e.created_at operator(pg_catalog.<)
                                (s.consumed_through operator(pg_catalog.-) '1 day'::pg_catalog.interval)))
        returning 1
    )
    select pg_catalog.count(*) into v_count from gone;
    return v_count;
end
$$;
revoke all on function pgstream._delete_expired_default(timestamptz) from public;

-- The daily partitions older than p_retention_days (before p_today - p_retention_days), oldest first,
-- protected or not (pgstream.drop_partition decides). With p_policy 'fail', raises instead, naming
-- the streams that hold them back, when one of them holds events a stream has not delivered.
create or replace function pgstream.expired_partitions(
    p_retention_days integer default 7,
    p_today date default pgstream.utc_today(),
    p_policy text default 'keep'
)
returns setof text
language plpgsql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_cutoff    date;
    v_protected date;
    v_held      text;
begin
    if p_retention_days is null or p_retention_days < 1 then
        raise exception 'pgstream.drop_partitions: p_retention_days must be >= 1, got %', p_retention_days;
    end if;
    if p_policy is null or p_policy not in ('keep', 'fail') then
        raise exception 'pgstream.drop_partitions: p_policy must be ''keep'' or ''fail'', got %', p_policy;
    end if;
    v_protected := pgstream.oldest_protected_day();
    v_cutoff := p_today - p_retention_days;
    if p_policy = 'fail' and v_protected is not null and v_protected < v_cutoff then
        select pg_catalog.string_agg(pg_catalog.format('stream %s (oldest undelivered %s, slot consumed through %s)',
                                                       stream_id, coalesce(oldest_undelivered::text, 'none'),
                                                       consumed_through), '; ')
          into v_held
          from pgstream.protected_streams()
         where (oldest_undelivered at time zone 'UTC')::date < v_cutoff
            or ((consumed_through - interval '1 day') at time zone 'UTC')::date < v_cutoff;
        raise exception 'pgstream: partitions before % hold undelivered events; nothing dropped', v_cutoff
            using detail = coalesce(v_held, ''),
                  hint = 'deliver or replay the backlog, skip_batch() what will never be delivered, '
                         'or run housekeeping with the keep policy';
    end if;
    return query
        select c.relname::text
        from pg_catalog.pg_inherits i
        join pg_catalog.pg_class c on c.oid = i.inhrelid
        where i.inhparent = 'pgstream.events'::pg_catalog.regclass
          and c.relname ~ '^events_[0-9]{8}$'
          and pg_catalog.to_date(pg_catalog.substr(c.relname, 8), 'YYYYMMDD') < v_cutoff
        order by c.relname;
end
$$;
revoke all on function pgstream.expired_partitions(integer, date, text) from public;

-- Drops one expired daily partition p_name (see expired_partitions) in the caller's transaction,
-- after taking the 'partitions' lock and checking again that it is past retention and holds no
-- undelivered event. status:
--   'dropped': detached and dropped; rows and bytes say what it held (counted before the detach);
--   'kept':    it holds undelivered events (WARNING 'keeping partition ...'); a later pass drops it;
--   'busy':    other transactions held their locks on pgstream.events through every attempt
--              (WARNING '... not dropped this pass ...'); the next pass tries again;
--   'absent':  no such partition, or not past retention (nothing done).
-- The ACCESS EXCLUSIVE lock of the detach is held until the caller's transaction ends: commit soon.
create or replace function pgstream.drop_partition(
    p_name text,
    p_retention_days integer default 7,
    p_today date default pgstream.utc_today(),
    p_lock_timeout_ms integer default 200,
    p_lock_attempts integer default 5,
    out status text, out rows_dropped bigint, out bytes_dropped bigint
)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_day       date;
    v_protected date;
    v_saved     text := pg_catalog.current_setting('lock_timeout');
    v_attempt   integer;
begin
    if p_retention_days is null or p_retention_days < 1 then
        raise exception 'pgstream.drop_partition: p_retention_days must be >= 1, got %', p_retention_days;
    end if;
    perform pgstream._check_lock_arguments('drop_partition', p_lock_timeout_ms, p_lock_attempts);
    status := 'absent';
    rows_dropped := 0;
    bytes_dropped := 0;
    perform pgstream.lock_for_transaction('partitions');
    if p_name is null or p_name !~ '^events_[0-9]{8}$' or not exists (
            select 1 from pg_catalog.pg_inherits i join pg_catalog.pg_class c on c.oid = i.inhrelid
            where i.inhparent = 'pgstream.events'::pg_catalog.regclass and c.relname = p_name) then
        return;
    end if;
    v_day := pg_catalog.to_date(pg_catalog.substr(p_name, 8), 'YYYYMMDD');
    if v_day >= p_today - p_retention_days then
        return;
    end if;
    v_protected := pgstream.oldest_protected_day();
    if v_protected is not null and v_day >= v_protected then
        raise warning 'pgstream: keeping partition % past retention: it holds undelivered events', p_name;
        status := 'kept';
        return;
    end if;
    -- a registered consumer that has not read it holds it back, for its max_retention_days at most
    -- (repeatable/26_consumers.sql); past that it is dropped and the pass reports the consumer overrun
    v_protected := pgstream.consumer_protected_day(p_today);
    if v_protected is not null and v_day >= v_protected then
        raise warning 'pgstream: keeping partition % past retention: a registered consumer has not read it', p_name;
        status := 'kept';
        return;
    end if;
    -- measured before the detach: counting under its ACCESS EXCLUSIVE lock would hold writes back
    execute pg_catalog.format('select pg_catalog.count(*), pg_catalog.pg_total_relation_size(%L::pg_catalog.regclass) '
                              'from pgstream.%I', 'pgstream.' || pg_catalog.quote_ident(p_name), p_name)
       into rows_dropped, bytes_dropped;
    status := 'busy';
    for v_attempt in 1 .. p_lock_attempts loop
        begin
            perform pg_catalog.set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
            execute pg_catalog.format('alter table pgstream.events detach partition pgstream.%I', p_name);
            execute pg_catalog.format('drop table pgstream.%I', p_name);
            perform pg_catalog.set_config('lock_timeout', v_saved, true);
            status := 'dropped';
            exit;
        exception when lock_not_available then
            if v_attempt < p_lock_attempts then
                perform pgstream._lock_backoff(p_lock_timeout_ms, v_attempt);
            end if;
        end;
    end loop;
    if status = 'busy' then
        raise warning 'pgstream: partition % not dropped this pass: other transactions held their locks on '
                      'pgstream.events through % attempts of % ms; the next pass tries again',
                      p_name, p_lock_attempts, p_lock_timeout_ms;
        rows_dropped := 0;
        bytes_dropped := 0;
    end if;
end
$$;
revoke all on function pgstream.drop_partition(text, integer, date, integer, integer) from public;

-- Deletes the expired rows of the default partition that are done with (_delete_expired_default)
-- and returns how many; the expired ones kept are counted in a WARNING. Takes no lock that blocks
-- inserts (ROW EXCLUSIVE on events_default, like an insert).
create or replace function pgstream.delete_expired_default(
    p_retention_days integer default 7,
    p_today date default pgstream.utc_today()
)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_before  timestamptz;
    v_deleted bigint;
    v_undone  bigint;
begin
    if p_retention_days is null or p_retention_days < 1 then
        raise exception 'pgstream.delete_expired_default: p_retention_days must be >= 1, got %', p_retention_days;
    end if;
    v_before := (p_today - p_retention_days)::timestamp at time zone 'UTC';
    -- row by row: the protected day (which holds whole partitions back) does not apply
    v_deleted := pgstream._delete_expired_default(v_before);
    select pg_catalog.count(*) into v_undone from pgstream.events_default where created_at < v_before;
    if v_undone > 0 then
        raise warning 'pgstream: % expired rows of events_default are kept: no batch has delivered them yet', v_undone;
    end if;
    return v_deleted;
end
$$;
revoke all on function pgstream.delete_expired_default(integer, date) from public;

-- Drops the daily partitions older than p_retention_days (pgstream.drop_partition, each) and the
-- expired rows of the default partition that are done with (delete_expired_default), in one
-- transaction; returns the dropped partition names. Serialised with create_partitions (the
-- 'partitions' lock above). A partition past retention that still holds events a stream has not
-- delivered (pgstream.oldest_protected_day()) is handled by policy:
--   'keep' (default): kept, with a WARNING naming it; dropped by a later run once delivered;
--   'fail': nothing is dropped and an error names the streams that hold it back.
-- Events are never dropped silently. When a partition's locks cannot be taken (see above) it and
-- the rest are left for the next call, with a WARNING. The housekeeping pass (engine/housekeeping.py)
-- calls the same functions, each partition in its own transaction, so that the lock of one detach
-- is not held while the next is measured.
create or replace function pgstream.drop_partitions(
    p_retention_days integer default 7,
    p_today date default pgstream.utc_today(),
    p_policy text default 'keep',
    p_lock_timeout_ms integer default 200,
    p_lock_attempts integer default 5
)
returns setof text
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name   text;
    v_status text;
    v_left   text;
begin
    perform pgstream._check_lock_arguments('drop_partitions', p_lock_timeout_ms, p_lock_attempts);
    perform pgstream.lock_for_transaction('partitions');
    -- first, so that no detach's lock is held while rows are deleted
    perform pgstream.delete_expired_default(p_retention_days, p_today);
    for v_name in select * from pgstream.expired_partitions(p_retention_days, p_today, p_policy) loop
        if v_left is not null then
            v_left := v_left || ', ' || v_name;
            continue;
        end if;
        select d.status into v_status
          from pgstream.drop_partition(v_name, p_retention_days, p_today, p_lock_timeout_ms, p_lock_attempts) d;
        if v_status = 'dropped' then
            return next v_name;
        elsif v_status = 'busy' then
            v_left := '';
        end if;
    end loop;
    if v_left <> '' then
        raise warning 'pgstream: partitions % not dropped this pass either: they need the same locks; the next '
                      'pass tries again', pg_catalog.substr(v_left, 3);
    end if;
end
$$;
revoke all on function pgstream.drop_partitions(integer, date, text, integer, integer) from public;
