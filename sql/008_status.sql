-- 008: the slot each stream reads. The view pgstream.stream_status (one row per stream: state,
-- failover checkpoint, backlog, slot lag) is in repeatable/08_status.sql.

-- The slot a stream's sensor reads (streams[].slot_name in pgstream.yaml, default pgstream_stream_<id>).
alter table pgstream.streams add column if not exists slot_name text;
