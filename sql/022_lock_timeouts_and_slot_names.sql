-- 022: partition maintenance never holds application writes back for more than a moment, and a
-- stream's default replication slot name is unique in the cluster.
--
-- Partitions (repeatable/03_partitions.sql): create_partitions and drop_partitions gained lock
-- arguments (p_lock_timeout_ms, p_lock_attempts), so the forms without them go; a housekeeping
-- pass records the partitions it could not drop because their locks were held (partitions_busy).
drop function if exists pgstream.create_partitions(integer, date);
drop function if exists pgstream.drop_partitions(integer, date, text);
alter table pgstream.housekeeping_runs add column if not exists partitions_busy integer not null default 0;
