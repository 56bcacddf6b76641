-- 009: statement-level trigger mode.
--
-- pgstream.subscriptions.trigger_mode = 'row' (default, unchanged behaviour: a deferred
-- constraint trigger FOR EACH ROW, events written at commit) or 'statement': an AFTER ... FOR EACH
-- STATEMENT trigger with a transition table whose function writes all events of the statement with
-- one INSERT ... SELECT. Same payloads, same order (rows of the statement, then subscriptions in
-- (stream_id, key, id) order). Differences: events are written at the end of the statement rather
-- than at commit; tg_table_name/tg_table_schema name the subscribed table (for a partitioned table
-- that is the parent, where row mode names the partition). UPDATE is row mode only: a statement's
-- old and new transition tables cannot be paired without a key.
--
-- A table's subscriptions for one operation may mix modes: each mode gets its own trigger
-- (pgstream_<op> for row mode, pgstream_<op>_stmt for statement mode) and trigger function.
-- The validation of the mode and the generation of both kinds of trigger are in
-- repeatable/04_subscriptions.sql; this version adds the column.

alter table pgstream.subscriptions add column if not exists trigger_mode text not null default 'row';

do $$
begin
    alter table pgstream.subscriptions
        add constraint subscriptions_trigger_mode_check check (trigger_mode in ('row', 'statement'));
exception when duplicate_object then null;
end
$$;
