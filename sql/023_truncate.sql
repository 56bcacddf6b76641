-- 023: TRUNCATE of a subscribed table.
--
-- pgstream.subscriptions.emit_truncate (DELETE subscriptions only, default false): a TRUNCATE of the
-- table writes one event per such subscription, tg_op 'TRUNCATE', new and old null. A TRUNCATE of a
-- table with a DELETE subscription that has not opted in is refused, naming the subscription: its
-- subscriber would otherwise keep the rows for ever. The statement-level TRUNCATE trigger that does
-- both is generated with the others (repeatable/04_subscriptions.sql); this version adds the column.
-- Existing subscriptions keep false, and a row written without the column (jsonb_populate_record of
-- an object without the key, an INSERT that names the columns) gets it.

alter table pgstream.subscriptions add column if not exists emit_truncate boolean not null default false;
