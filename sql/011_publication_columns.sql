-- 011: a stream's publication carries only what its sensor reads: the event id and created_at
-- (and stream_id, the row filter's column). The sensor records ids in commit order and the
-- delivery run loads payloads from the table, so logical decoding no longer turns every payload
-- into text for nothing (jsonb output was most of the decoding cost of a large slot read).

create or replace function pgstream._sync_publication()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
    if tg_op = 'INSERT' then
        if not exists (select 1 from pg_catalog.pg_publication
                       where pubname = pgstream.publication_name(new.id)) then
            execute format(
                'create publication %I for table pgstream.events (id, stream_id, created_at) '
                'where (stream_id = %s) with (publish = %L, publish_via_partition_root = true)',
                pgstream.publication_name(new.id), new.id, 'insert');
        end if;
        return new;
    end if;
    execute format('drop publication if exists %I', pgstream.publication_name(old.id));
    return old;
end
$$;

-- existing streams: the same column list on their publications (a no-op where it is set)
do $$
declare
    v_stream bigint;
begin
    for v_stream in select s.id from pgstream.streams s
                    join pg_catalog.pg_publication p on p.pubname = pgstream.publication_name(s.id)
    loop
        execute format('alter publication %I set table pgstream.events (id, stream_id, created_at) '
                       'where (stream_id = %s)', pgstream.publication_name(v_stream), v_stream);
    end loop;
end
$$;
