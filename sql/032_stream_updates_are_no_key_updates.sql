-- 032: updating a stream row no longer waits for a publish in flight, nor holds one up (issue 45).
--
-- A run publishes each chunk holding its stream row FOR KEY SHARE (ledger.publishing: a pause, FOR
-- UPDATE, waits for the chunk in flight). Updates of other columns (the reader group's read position,
-- which its reader moves for every member once a second; the stream's open run) must not conflict with
-- that lock: they are "no key" updates, unless they change a column of a unique index. The unique index
-- on the generated column slot (022) made every one of them a key update, as Postgres recomputes stored
-- generated columns on each UPDATE: the group's reader waited for every member's publish call in flight
-- (a sink that hangs until its timeout held every member's next events back), and each member's publish
-- waited for the reader's update of every member's row.
--
-- The same uniqueness on the expression instead: an expression index is no key for row locks, so an
-- update of a stream row is a key update only when it changes its id.
drop index if exists pgstream.streams_slot_key;
create unique index streams_slot_key on pgstream.streams ((coalesce(slot_name, default_slot)));
