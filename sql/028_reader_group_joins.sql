-- 028: the hand-over of a stream that joins a reader group is checked by the owner's functions, not
-- left to the order the runtime calls them in (repeatable/27_reader_groups.sql).
--
-- pgstream.reader_groups.changed_xmax: the first transaction id not yet assigned when the group's
-- publication last changed (created, or its row filter altered; pg_snapshot_xmax of that moment). A
-- transaction with a smaller id may have written before the publication included a joining member,
-- so begin_join refuses while one of them still runs (null: not changed since this migration).

alter table pgstream.reader_groups add column if not exists changed_xmax xid8;
