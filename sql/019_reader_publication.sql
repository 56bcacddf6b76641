-- 019: each stream gets a second publication, pgstream_stream_<id>_rows, with the whole event
-- (every column but lsn), for an open run's slot reader: it delivers the rows it decodes instead
-- of reading them back from pgstream.events. The sensor keeps decoding with pgstream_stream_<id>
-- (ids and created_at only; see repeatable/01_streams.sql, which creates both for new streams).
-- The name is pgstream.rows_publication_name(id), spelled out: a versioned migration calls no
-- pgstream function. Idempotent: a publication that exists is left as it is.
do $$
declare
    v_stream bigint;
    v_name   text;
begin
    for v_stream in select s.id from pgstream.streams s order by s.id loop
        v_name := 'pgstream_stream_' operator(pg_catalog.||) v_stream::pg_catalog.text
                  operator(pg_catalog.||) '_rows';
        if not exists (select 1 from pg_catalog.pg_publication p
                       where p.pubname operator(pg_catalog.=) v_name) then
            execute pg_catalog.format(
                'create publication %I for table pgstream.events (id, payload, metadata, stream_id, created_at) '
                'where (stream_id = %s) with (publish = %L, publish_via_partition_root = true)',
                v_name, v_stream, 'insert');
        end if;
    end loop;
end
$$;
