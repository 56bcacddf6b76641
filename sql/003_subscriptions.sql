-- 003: subscriptions carry the tool that manages them.
--
-- Validation, trigger generation, the triggers on pgstream.subscriptions and set_subscriptions()
-- are in repeatable/04_subscriptions.sql.

-- Subscriptions written by a tool (the Dagster YAML loader writes 'yaml') carry a marker so the tool
-- can remove its own subscriptions without touching those created by hand in SQL.
alter table pgstream.subscriptions add column if not exists managed_by text;
