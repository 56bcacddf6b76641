"""Assets: the YAML subscriptions (one multi-asset per stream), their source tables, and the partition housekeeping
of ``pgstream.events``.

Each subscription of ``pgstream.yaml`` is an asset ``pgstream/stream_<id>/subscriptions/<name>`` whose code version is
a digest of its definition: the ``pgstream_subscriptions`` sensor (``schedules.py``) requests a run for those new or
edited. Applying goes through ``pgstream.set_subscriptions`` (one call per stream, one transaction): unchanged
subscriptions never recreate their trigger, and a subset materialization passes the stream's other subscriptions back
unchanged. The stream's ``subscription_set`` asset (code version = which subscriptions the YAML declares) removes the
ones deleted from the YAML.
"""

import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
from pydantic import Field

from ..config import PgstreamConfig, SubscriptionConfig
from ..engine import housekeeping
from ..engine.subscriptions import (
    Identity,
    SubscriptionError,
    TriggerState,
    apply_stream,
    asset_name,
    code_version,
    identity,
    set_code_version,
    trigger_state,
)
from .names import EVENTS_PARTITIONS_KEY, subscriptions_op_name
from .resources import PgstreamResource


@dataclass(frozen=True)
class DeclaredIn:
    """Where streams' subscriptions are declared: every subscription of that file, validated together when one of
    its streams is applied, and the file (named in errors)."""

    subscriptions: Sequence[SubscriptionConfig]
    source: str  # the file's path
    origin: str  # what descriptions call it: pgstream.yaml, or the component's defs.yaml

    def of_stream(self, stream_id: int) -> list[SubscriptionConfig]:
        return [s for s in self.subscriptions if s.stream_id == stream_id]


def source_table_key(schema: str, table: str) -> dg.AssetKey:
    return dg.AssetKey(["postgres", schema, table])


def subscription_set_key(stream_id: int) -> dg.AssetKey:
    return dg.AssetKey(["pgstream", f"stream_{stream_id}", "subscription_set"])


def stream_subscription_keys(stream_id: int, subs: Sequence[SubscriptionConfig]) -> dict[Identity, dg.AssetKey]:
    """The asset key of every YAML subscription of the stream (``subs``: the stream's), by identity."""
    return {identity(s): dg.AssetKey(["pgstream", f"stream_{stream_id}", "subscriptions", asset_name(s, list(subs))])
            for s in subs}


def subscription_keys(config: PgstreamConfig, stream_id: int) -> dict[Identity, dg.AssetKey]:
    """The asset key of every YAML subscription of the stream, by identity."""
    return stream_subscription_keys(stream_id, [s for s in config.subscriptions if s.stream_id == stream_id])


def _describe(sub: SubscriptionConfig, origin: str) -> str:
    where = f" where `{sub.when_clause}`" if sub.when_clause else " (every row)"
    return (f"Subscription `{sub.key}`: {sub.operation} on `{sub.schema_name}.{sub.table_name}`{where} "
            f"→ stream {sub.stream_id}. Applied from {origin} through `pgstream.set_subscriptions`; "
            f"its materialization shows the generated trigger.")


def _spec_metadata(sub: SubscriptionConfig) -> dict[str, object]:
    return {
        "key": sub.key, "stream_id": sub.stream_id, "table": f"{sub.schema_name}.{sub.table_name}",
        "operation": sub.operation, "filter": sub.when_clause or "(every row)",
        "columns": dg.MetadataValue.json(list(sub.column_names)),
        "payload_extensions": dg.MetadataValue.json([e.model_dump() for e in sub.payload_extensions]),
        "event_metadata": dg.MetadataValue.json(sub.metadata or {}),
        "metadata_extensions": dg.MetadataValue.json([e.model_dump() for e in sub.metadata_extensions]),
        "trigger_mode": sub.trigger_mode,
    }


def _trigger_metadata(state: TriggerState) -> dict[str, Any]:
    body = state.function_body or ""
    return {
        "trigger": state.trigger_name,
        "trigger_oid": state.trigger_oid if state.trigger_oid is not None else dg.MetadataValue.null(),
        "trigger_function": f"pgstream.{state.function_name}()",
        "trigger_mode": state.mode,
        "trigger_when": state.when_clause or ("(statement trigger: filters are applied in its INSERT ... SELECT)"
                                              if state.mode == "statement"
                                              else "(none: some subscription on this table has no filter)"),
        "trigger_hash": state.installed_hash or "",
        "trigger_definition": dg.MetadataValue.md(f"```sql\n{body.strip()}\n```"),
    }


def stream_subscription_assets(stream_id: int, declared: DeclaredIn) -> dg.AssetsDefinition:
    """The stream's subscriptions multi-asset."""
    subs = declared.of_stream(stream_id)
    keys = stream_subscription_keys(stream_id, subs)
    origin, set_key, group = declared.origin, subscription_set_key(stream_id), f"stream_{stream_id}_subscriptions"
    specs = [dg.AssetSpec(key=keys[identity(s)], group_name=group, description=_describe(s, origin),
                          metadata=_spec_metadata(s), code_version=code_version(s), kinds={"postgres"},
                          deps=[source_table_key(s.schema_name, s.table_name)], skippable=True) for s in subs]
    specs.append(dg.AssetSpec(
        key=set_key, group_name=group, kinds={"postgres"}, skippable=True,
        code_version=set_code_version(subs),
        description=f"The set of stream {stream_id}'s YAML subscriptions: materializing it deletes the "
                    f"subscriptions removed from {origin} (those created in SQL are left alone).",
        metadata={"stream_id": stream_id, "declared": dg.MetadataValue.json(sorted(s.key for s in subs))},
    ))

    @dg.multi_asset(name=subscriptions_op_name(stream_id), specs=specs, can_subset=True,
                    description=f"Apply stream {stream_id}'s subscriptions from {origin} (one transaction).")
    def _apply(context: dg.AssetExecutionContext,
               pgstream: dg.ResourceParam[PgstreamResource]) -> Iterator[dg.MaterializeResult[Any]]:
        selected = context.selected_asset_keys
        chosen = {ident for ident, key in keys.items() if key in selected}
        with pgstream.connect() as conn:
            try:
                result = apply_stream(conn, declared.subscriptions, stream_id, declared.source, selected=chosen,
                                      remove_absent=set_key in selected)
            except SubscriptionError as exc:
                raise dg.Failure(description=str(exc), metadata={"file": declared.source}) from None
            states = {identity(s): trigger_state(conn, s.schema_name, s.table_name, s.operation, s.trigger_mode)
                      for s in subs if identity(s) in chosen}  # (in the order of subs)
        for (key, schema, table, op), action in sorted(result.changes.items()):
            context.log.info(f"{action} subscription {key!r} ({op} on {schema}.{table}, stream {stream_id})")
        for ident, state in states.items():
            yield dg.MaterializeResult(asset_key=keys[ident], metadata={
                "action": result.changes.get(ident, "unchanged"), **_trigger_metadata(state)})
        if set_key in selected:
            deleted = sorted(f"{k} ({op} on {s}.{t})" for (k, s, t, op), a in result.changes.items()
                             if a == "deleted")
            yield dg.MaterializeResult(asset_key=set_key, metadata={
                "declared": len(subs), "deleted": dg.MetadataValue.json(deleted),
                "created_in_sql": result.hand_made})

    return _apply


def source_table_specs(config: PgstreamConfig) -> list[dg.AssetSpec]:
    """The tables the subscriptions of every stream watch (external assets, defined once: two streams may watch one)."""
    return [dg.AssetSpec(key=source_table_key(schema, table), group_name="postgres", kinds={"postgres"},
                         description=f"Table {schema}.{table}: its changes feed pgstream subscriptions.")
            for schema, table in sorted({(s.schema_name, s.table_name) for s in config.subscriptions})]


# ---------------------------------------------------------------------------------------------
# housekeeping


class HousekeepingRunConfig(dg.Config):
    today: str | None = Field(default=None, description="UTC day to act as (YYYY-MM-DD); default: today")


@dg.asset(
    key=EVENTS_PARTITIONS_KEY,
    group_name="pgstream",
    kinds={"postgres"},
    description="Daily partitions of pgstream.events and the batch ledger: creates partitions ahead, drops "
                "expired ones (never those holding undelivered events; those whose locks stay held are left for "
                "the next pass), prunes delivered batches. Run by the "
                "pgstream_housekeeping schedule (housekeeping.cron) and at start-up.",
)
def events_partitions(context: dg.AssetExecutionContext, config: HousekeepingRunConfig,
                      pgstream: dg.ResourceParam[PgstreamResource]) -> dg.MaterializeResult[Any]:
    today = dt.date.fromisoformat(config.today) if config.today else None
    with pgstream.connect() as conn:
        report = housekeeping.run_housekeeping(conn, pgstream.config.housekeeping, today, pgstream.database_url)
    context.log.info(report.summary())
    for warning in report.warnings:
        context.log.warning(warning)
    partitions = {"created": report.created, "dropped": report.dropped, "kept": report.kept, "busy": report.busy}
    return dg.MaterializeResult(metadata={
        "today": report.today.isoformat(),
        **{f"partitions_{k}": dg.MetadataValue.json(v) for k, v in partitions.items()},
        **{f"{k}_count": len(v) for k, v in partitions.items()},
        "rows_dropped": report.rows_dropped, "bytes_dropped": report.bytes_dropped,
        "default_rows_deleted": report.default_rows_deleted, "batches_pruned": report.batches_pruned,
        "warnings": dg.MetadataValue.text("\n".join(report.warnings)),
        "report": dg.MetadataValue.json(report.as_dict()),
    })
