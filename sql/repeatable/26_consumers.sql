-- Repeatable: registered consumers (table in 026_consumers.sql). A consumer is a reader of a stream
-- outside the delivery runs (the Spark source, engine/spark_source.py) whose position in the ledger
-- (batch_id, ord: read through ordinal ord of batch batch_id, in the ledger's order) is stored here,
-- so that housekeeping keeps what it has not read, for at most its max_retention_days.
--
-- Security: only the runtime (an operator: `pgstream-dagster consumers add`) registers a consumer
-- (register_consumer), since a consumer holds events back for up to its bound, and issues its token
-- (consumer_token: shown once, stored as its sha256; a new one replaces the last). The Spark executors
-- (pgstream_executor, whose credentials a shared Spark cluster holds) write the position of a
-- registered consumer only, through consumer_commit with that consumer's token (SECURITY DEFINER: it
-- checks the token, validates the name, the stream and the position, and can neither create a
-- consumer nor change its bound or its stream): a query moves its own consumer's position, never
-- another's. The runtime reads the consumers, and drops one or changes its bound through drop_consumer /
-- set_consumer_retention. Grants in 99_runtime.sql.

-- ---------------------------------------------------------------------------------------------
-- Writing a position.

-- Checks a consumer's name and its stream (both functions below).
create or replace function pgstream.consumer_check(p_fn text, p_name text, p_stream_id bigint)
returns void
language plpgsql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_name is null or p_name !~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$' then
        raise exception 'pgstream.%: a consumer name is 1-100 letters, digits, _ . : - '
                        '(starting with a letter or digit), got %', p_fn, pg_catalog.quote_nullable(pg_catalog.left(p_name, 120))
            using errcode = 'invalid_parameter_value';
    end if;
    if p_stream_id is null or not exists (select 1 from pgstream.streams s where s.id = p_stream_id) then
        raise exception 'pgstream.%: consumer %: no stream %', p_fn, p_name, coalesce(p_stream_id::text, 'null')
            using errcode = 'invalid_parameter_value';
    end if;
end
$$;
revoke all on function pgstream.consumer_check(text, text, bigint) from public;

-- Registers consumer p_name of stream p_stream_id (an operator's act: it holds events back for up to
-- p_max_retention_days). Its position starts at the end of the stream's ledger (what is recorded from
-- now on is kept for it), or before every batch with p_from_start (everything the stream's ledger
-- still has is kept for it). True if it was registered now, false if it already was (for this
-- stream: nothing changes); a consumer of another stream is refused.
create or replace function pgstream.register_consumer(p_name text, p_stream_id bigint,
                                                      p_from_start boolean default false,
                                                      p_max_retention_days integer default 30)
returns boolean
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_batch  bigint := 0;
    v_ord    integer := 0;
    v_stream bigint;
begin
    perform pgstream.consumer_check('register_consumer', p_name, p_stream_id);
    if p_max_retention_days is null or p_max_retention_days < 1 or p_max_retention_days > 3650 then
        raise exception 'pgstream.register_consumer: consumer %: days must be 1-3650, got %', p_name,
                        coalesce(p_max_retention_days::text, 'null')
            using errcode = 'invalid_parameter_value';
    end if;
    select c.stream_id into v_stream from pgstream.consumers c where c.name = p_name;
    if v_stream is not null then
        if v_stream <> p_stream_id then
            raise exception 'pgstream.register_consumer: consumer % reads stream %, not stream %', p_name, v_stream,
                            p_stream_id
                using errcode = 'invalid_parameter_value',
                      hint = 'Use another consumer name, or drop the consumer first (pgstream-dagster consumers drop).';
        end if;
        return false;
    end if;
    if not coalesce(p_from_start, false) then
        select b.id, b.event_count into v_batch, v_ord from pgstream.batches b
         where b.stream_id = p_stream_id order by b.id desc limit 1;
    end if;
    insert into pgstream.consumers (name, stream_id, batch_id, ord, max_retention_days)
    values (p_name, p_stream_id, coalesce(v_batch, 0), coalesce(v_ord, 0), p_max_retention_days)
    on conflict (name) do nothing;
    return found;
end
$$;
revoke all on function pgstream.register_consumer(text, bigint, boolean, integer) from public;

-- Issues consumer p_name's token (what its query gives consumer_commit: option consumerToken) and
-- returns it; the last one it had stops working. Null when there is no such consumer.
create or replace function pgstream.consumer_token(p_name text)
returns text
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_token text := pgstream.new_token();
begin
    update pgstream.consumers c set token_hash = pgstream.token_hash(v_token), updated_at = pg_catalog.now()
     where c.name = p_name;
    return case when found then v_token end;
end
$$;
revoke all on function pgstream.consumer_token(text) from public;

-- Records that registered consumer p_name, whose token is p_token, has read stream p_stream_id through
-- ordinal p_ord of ledger batch p_batch_id (0, 0: before every batch). A consumer that is not
-- registered, or another token, is refused (the token never appears in a message). A position must
-- exist in the stream's ledger (batch 0 with ordinal 0, or a batch of that stream and an ordinal
-- up to its event count); a consumer reads one stream. It may move back (a query restarted from an
-- earlier position): the position is where the consumer's next read starts.
create or replace function pgstream.consumer_commit(p_name text, p_stream_id bigint, p_batch_id bigint,
                                                    p_ord integer, p_token text)
returns void
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count  integer;
    v_stream bigint;
    v_hash   bytea;
begin
    perform pgstream.consumer_check('consumer_commit', p_name, p_stream_id);
    select c.stream_id, c.token_hash into v_stream, v_hash from pgstream.consumers c where c.name = p_name for update;
    if v_stream is null then
        raise exception 'pgstream.consumer_commit: consumer % is not registered', p_name
            using errcode = 'invalid_parameter_value',
                  hint = pg_catalog.format('An operator registers it: pgstream-dagster consumers add %s %s',
                                           p_name, p_stream_id);
    end if;
    if v_hash is null then
        raise exception 'pgstream.consumer_commit: consumer % has no token yet: an operator issues one with '
                        '`pgstream-dagster consumers token %` and gives it to the query as option consumerToken',
                        p_name, p_name
            using errcode = 'insufficient_privilege';
    end if;
    if p_token is null or pgstream.token_hash(p_token) <> v_hash then
        raise exception 'pgstream.consumer_commit: consumer %: the token (option consumerToken) is not this '
                        'consumer''s', p_name
            using errcode = 'insufficient_privilege',
                  hint = pg_catalog.format('`pgstream-dagster consumers token %s` issues a new one', p_name);
    end if;
    if v_stream <> p_stream_id then
        raise exception 'pgstream.consumer_commit: consumer % reads stream %, not stream %', p_name, v_stream, p_stream_id
            using errcode = 'invalid_parameter_value',
                  hint = 'Use another consumer name, or drop the consumer first (pgstream-dagster consumers drop).';
    end if;
    if p_batch_id is null or p_ord is null or p_batch_id < 0 or p_ord < 0 then
        raise exception 'pgstream.consumer_commit: consumer %: a position is a batch id and an ordinal >= 0, got (%, %)',
                        p_name, coalesce(p_batch_id::text, 'null'), coalesce(p_ord::text, 'null')
            using errcode = 'invalid_parameter_value';
    end if;
    if p_batch_id > 0 then
        select b.event_count into v_count from pgstream.batches b
         where b.id = p_batch_id and b.stream_id = p_stream_id;
        if v_count is null or p_ord > v_count then
            raise exception 'pgstream.consumer_commit: consumer %: (batch %, ordinal %) is no position of stream %''s ledger',
                            p_name, p_batch_id, p_ord, p_stream_id
                using errcode = 'invalid_parameter_value';
        end if;
    elsif p_ord <> 0 then
        raise exception 'pgstream.consumer_commit: consumer %: batch 0 (before every batch) has ordinal 0, got %',
                        p_name, p_ord using errcode = 'invalid_parameter_value';
    end if;
    update pgstream.consumers c set batch_id = p_batch_id, ord = p_ord, updated_at = pg_catalog.now()
     where c.name = p_name;
end
$$;
revoke all on function pgstream.consumer_commit(text, bigint, bigint, integer, text) from public;

-- Drops consumer p_name (its position no longer holds anything back); true if it existed.
create or replace function pgstream.drop_consumer(p_name text)
returns boolean
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    delete from pgstream.consumers c where c.name = p_name;
    return found;
end
$$;
revoke all on function pgstream.drop_consumer(text) from public;

-- Sets how many days consumer p_name's position may hold events back (1-3650); true if it exists.
create or replace function pgstream.set_consumer_retention(p_name text, p_days integer)
returns boolean
language plpgsql
volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_days is null or p_days < 1 or p_days > 3650 then
        raise exception 'pgstream.set_consumer_retention: days must be 1-3650, got %', coalesce(p_days::text, 'null')
            using errcode = 'invalid_parameter_value';
    end if;
    update pgstream.consumers c set max_retention_days = p_days, updated_at = pg_catalog.now() where c.name = p_name;
    return found;
end
$$;
revoke all on function pgstream.set_consumer_retention(text, integer) from public;

-- ---------------------------------------------------------------------------------------------
-- What a consumer holds back.

-- Whether a registered consumer of stream p_stream_id has not read all of ledger batch p_batch_id
-- (p_event_count events, the last created at p_max_created_at) and may still hold it back: the
-- batch is within the consumer's max_retention_days of p_today.
create or replace function pgstream.consumer_unread(p_stream_id bigint, p_batch_id bigint, p_event_count integer,
                                                    p_max_created_at timestamptz,
                                                    p_today date default pgstream.utc_today())
returns boolean
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select exists (
        select 1 from pgstream.consumers c
         where c.stream_id = p_stream_id
           and (p_batch_id > c.batch_id or (p_batch_id = c.batch_id and c.ord < p_event_count))
           and p_max_created_at >= ((p_today - c.max_retention_days)::timestamp at time zone 'UTC'))
$$;
revoke all on function pgstream.consumer_unread(bigint, bigint, integer, timestamptz, date) from public;

-- Per consumer: its position, what it has not read (events of the batches after its position, and
-- when the oldest of them was created) and whether that is past its bound on p_today (overrun:
-- housekeeping drops those events anyway).
create or replace function pgstream.consumer_positions(p_today date default pgstream.utc_today())
returns table (name text, stream_id bigint, batch_id bigint, ord integer, lag_events bigint,
               oldest_unread timestamptz, max_retention_days integer, overrun boolean, updated_at timestamptz)
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select c.name, c.stream_id, c.batch_id, c.ord,
           coalesce(u.events, 0), u.oldest, c.max_retention_days,
           coalesce(u.oldest < ((p_today - c.max_retention_days)::timestamp at time zone 'UTC'), false),
           c.updated_at
    from pgstream.consumers c
    left join lateral (
        select pg_catalog.sum(b.event_count - case when b.id = c.batch_id then c.ord else 0 end) as events,
               pg_catalog.min(b.min_created_at) as oldest
        from pgstream.batches b
        where b.stream_id = c.stream_id and b.id >= c.batch_id
          and (b.id > c.batch_id or c.ord < b.event_count)
    ) u on true
    order by c.name
$$;
revoke all on function pgstream.consumer_positions(date) from public;

-- The registered consumers as of today (status, metrics).
create or replace view pgstream.consumer_status as
    select * from pgstream.consumer_positions();
revoke all on pgstream.consumer_status from public;

-- The oldest UTC day a registered consumer still holds back on p_today (null: none): the day of
-- its oldest unread event, but never before p_today - its max_retention_days.
create or replace function pgstream.consumer_protected_day(p_today date default pgstream.utc_today())
returns date
language sql
stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.min(greatest((p.oldest_unread at time zone 'UTC')::date,
                                              p_today - p.max_retention_days))
    from pgstream.consumer_positions(p_today) p
    where p.oldest_unread is not null
$$;
revoke all on function pgstream.consumer_protected_day(date) from public;
