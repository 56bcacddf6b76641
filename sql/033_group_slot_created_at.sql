-- 033: a reader group's slot is known by the point it was created at (issue 46).
--
-- A replication slot is not replicated to a physical standby (a failover slot's synchronized copy
-- aside), and pg_rewind keeps the target's slots: a former primary that rejoins as a standby keeps
-- the group's slot as it was when it stopped, under the same name. Promoted again (a switchover and
-- back), it offers that slot, positioned before everything recorded since through the slot the other
-- server's readers created. Read from it, what the WAL holds of that time is decoded again, and what
-- it lost to pg_rewind (a failover with the standby behind) is decoded differently or not at all.
--
-- slot_lsn: the consistent point the group's slot was created at (pg_create_logical_replication_slot's
-- lsn), set by the group's reader when it creates the slot. A slot of that name whose confirmed
-- position is before it is not the one the ledger was recorded through: the reader replaces it and
-- recovers from the table, as for a lost slot. Set here from the slot that exists now: a lower bound
-- of its creation point, as its confirmed position only moves forward.
alter table pgstream.reader_groups add column if not exists slot_lsn pg_lsn;

update pgstream.reader_groups g
   set slot_lsn = s.confirmed_flush_lsn
  from pg_catalog.pg_replication_slots s
 where s.slot_name operator(pg_catalog.=) g.slot
   and s.database operator(pg_catalog.=) pg_catalog.current_database()
   and g.slot_lsn is null;
