-- 016: metadata computed per event.
--
-- pgstream.subscriptions.metadata_extensions: [{"json_path": "a.b", "expression": "<sql over new/old>"}],
-- like payload_extensions but written into the event's metadata: each path is set to its
-- expression's value, merged over the subscription's static metadata (computed values win; a path
-- replaces only its leaf: sibling keys of the static objects along it are kept). Validated like
-- payload extensions and evaluated as pgstream_writer. A subscription without metadata extensions
-- generates exactly the trigger code it generated before this column existed, so the upgrade
-- leaves its trigger untouched.
--
-- Validation and trigger generation are in repeatable/04_subscriptions.sql; this version adds the
-- column.

alter table pgstream.subscriptions
    add column if not exists metadata_extensions jsonb not null default '[]'::jsonb;
