-- 025: the declared reader of a stream's slot.
--
-- pgstream.streams.slot_reader says who reads the stream's replication slot now: 'sensor' (the
-- stream's sensor peeks it), or 'run:<run key>' (the open run's reader streams it). It changes in the
-- same UPDATE as open_run_key when a run is opened or closed, and when the open run's reader cannot
-- read for a while and gives the slot back (engine/ledger: open_run, clear_open_run, take_slot,
-- give_slot_back). Each reader reads only while it is the declared one, and checks it again under the
-- stream row's lock before it records. The constraint: a run reads the slot only while it is the
-- stream's open run. Existing streams start with the sensor; an open run's reader takes the slot at
-- its next look.

alter table pgstream.streams add column if not exists slot_reader text not null default 'sensor';

do $$
begin
    if not exists (select 1 from pg_catalog.pg_constraint c
                   where c.conrelid operator(pg_catalog.=) 'pgstream.streams'::pg_catalog.regclass
                     and c.conname operator(pg_catalog.=) 'streams_slot_reader_check') then
        alter table pgstream.streams add constraint streams_slot_reader_check
            check (slot_reader = 'sensor' or (open_run_key is not null and slot_reader = 'run:' || open_run_key));
    end if;
end
$$;
