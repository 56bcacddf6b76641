-- 011: a stream's publication carries only what its sensor reads: the event id and created_at
-- (and stream_id, the row filter's column). The sensor records ids in commit order and the
-- delivery run loads payloads from the table, so logical decoding no longer turns every payload
-- into text for nothing (jsonb output was most of the decoding cost of a large slot read).
-- New streams get such a publication from pgstream._sync_publication (repeatable/01_streams.sql);
-- this version gives existing streams' publications the same column list (a no-op where it is
-- set). The publication name is pgstream.publication_name(id), spelled out: a versioned
-- migration calls no pgstream function.
do $$
declare
    v_stream bigint;
    v_name   text;
begin
    for v_stream, v_name in
        select s.id, p.pubname::pg_catalog.text from pgstream.streams s
        join pg_catalog.pg_publication p
          on p.pubname operator(pg_catalog.=) ('pgstream_stream_' operator(pg_catalog.||) s.id::pg_catalog.text)
    loop
        execute pg_catalog.format('alter publication %I set table pgstream.events (id, stream_id, created_at) '
                                  'where (stream_id = %s)', v_name, v_stream);
    end loop;
end
$$;
