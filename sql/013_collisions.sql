-- 013: no configuration collision stalls a stream or loses an event.
--
--   * A replication slot belongs to one stream. Two streams reading one slot would each advance
--     it past the other's events: one records them, the other records nothing and looks healthy.
--     The effective slot name of a stream (streams.slot_name, default pgstream_stream_<id>) is
--     unique; an existing install where two streams share a slot fails this migration with the
--     streams named, before anything changes. pgstream.ensure_stream refuses a stream whose
--     default slot another stream holds (repeatable/01_streams.sql).
--   * Partition maintenance is serialised: create_partitions and drop_partitions take one
--     transaction-level advisory lock (repeatable/03_partitions.sql).

-- ---------------------------------------------------------------------------------------------
-- One slot, one stream.
do $$
declare
    v_clash text;
begin
    select pg_catalog.string_agg(pg_catalog.format('slot %s is used by streams %s', c.slot, c.ids), '; '
                                 order by c.slot)
      into v_clash
      from (select coalesce(s.slot_name, 'pgstream_stream_' operator(pg_catalog.||) s.id::pg_catalog.text) as slot,
                   pg_catalog.string_agg(s.id::pg_catalog.text, ', ' order by s.id) as ids
              from pgstream.streams s
             group by 1
            having pg_catalog.count(*) operator(pg_catalog.>) 1) c;
    if v_clash is not null then
        raise exception 'pgstream: streams share a replication slot (%): only one of them would see its events', v_clash
            using hint = 'Give each stream its own streams[].slot_name in pgstream.yaml and set the same in '
                         'pgstream.streams.slot_name (null means pgstream_stream_<id>), or delete the stream that is '
                         'no longer used (delete from pgstream.streams where id = N); then migrate again.';
    end if;
end
$$;

create unique index if not exists streams_slot_key on pgstream.streams
    ((coalesce(slot_name, 'pgstream_stream_' operator(pg_catalog.||) id::pg_catalog.text)));
