-- 015 (temporary: the repeatable file that defines pgstream's functions replaces it at merge):
-- pgstream.batch_is_open(status), the one SQL definition of an open batch: neither delivered nor
-- skipped (pending, launched, failed), as BatchStatus.is_open in pgstream_dagster/engine/batches.py.
-- An immutable SQL function without SET or SECURITY DEFINER, so the planner inlines it: a query
-- filtering on it still matches the partial indexes whose predicate is
-- `status not in ('delivered', 'skipped')` (pgstream.batches_open_idx).

create or replace function pgstream.batch_is_open(p_status text)
returns boolean
language sql
immutable
parallel safe
as $$
    select p_status not in ('delivered', 'skipped')
$$;

revoke all on function pgstream.batch_is_open(text) from public;
