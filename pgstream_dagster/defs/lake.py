"""A stream with a lake sink (delta, iceberg, parquet): its table is an asset downstream of the
stream's deliveries asset, with a check comparing per-day counts between ``pgstream.events`` and the
table (read with the format's own reader; the window is explained in ``engine/lakecheck.py``)."""

from typing import Any

import dagster as dg

from ..config import StreamConfig
from ..engine import reconcile
from ..engine.lakecheck import delivered_day_counts, differences
from ..sinks import LAKE_SINK_TYPES, SinkError, build_sink
from ..sinks.base import describe_exception, scrub
from ..sinks.lake import LakeSink
from .names import LAKE_COUNTS_CHECK, deliveries_asset_key, lake_table_asset_key
from .resources import PgstreamResource


def _where(stream: StreamConfig) -> str:
    sink: Any = stream.sink
    return str(getattr(sink, "table", None) or getattr(sink, "path", ""))


def lake_counts_check(stream: StreamConfig) -> dg.AssetChecksDefinition:
    key = lake_table_asset_key(stream.id)

    @dg.asset_check(asset=key, name=LAKE_COUNTS_CHECK, blocking=False,
                    description="Per UTC day, the table holds as many events of the stream as pgstream.events "
                                "has delivered (settled days and the delivered part of the current one).")
    def _check(pgstream: dg.ResourceParam[PgstreamResource]) -> dg.AssetCheckResult:
        sink = build_sink(stream.sink)
        assert isinstance(sink, LakeSink)
        with pgstream.connect() as conn:
            owed = delivered_day_counts(conn, stream.id)
            ended = reconcile.ended_timelines(conn, stream.id)
            try:
                with sink:
                    held = sink.day_counts(stream.id, owed.since, owed.upto) if owed.upto is not None else {}
                    from_ended = reconcile.lake_ids(sink, stream.id, ended)
            except SinkError:
                raise
            except Exception as exc:  # the format's reader: name the table, never a secret
                secrets = stream.sink.secret_values()
                why = (f"{stream.sink.type} sink: {sink.where()}: cannot read the table "
                       f"({describe_exception(exc, secrets)})")
                raise SinkError(scrub(why, secrets), sink=stream.sink.type) from None
            lost = reconcile.phantoms(conn, stream.id, from_ended, ended)
        wrong = differences(owed.counts, held)
        shown = "; ".join(f"{day}: {want} delivered, {got} in the table" for day, want, got in wrong[:10])
        said = [f"{len(wrong)} {'day differs' if len(wrong) == 1 else 'days differ'}: {shown}"] if wrong else []
        said += [f"{len(lost)} events in the table were written on a former primary and are missing from "
                 f"pgstream.events (phantoms of a failover; `pgstream-dagster reconcile {stream.id}` lists them): "
                 f"{', '.join(map(str, lost[:10]))}"] if lost else []
        return dg.AssetCheckResult(
            passed=not said, severity=dg.AssetCheckSeverity.ERROR,
            description="; ".join(said) or f"{sum(owed.counts.values())} events over {len(owed.counts)} days match",
            metadata={"days_compared": len(owed.counts), "events": sum(owed.counts.values()),
                      "differing_days": dg.MetadataValue.json([[str(d), w, g] for d, w, g in wrong[:100]]),
                      "phantoms": dg.MetadataValue.json(lost[:100]),
                      "window": dg.MetadataValue.json([str(owed.since), str(owed.upto)])})

    return _check


def lake_materializations(stream: StreamConfig, metadata: dict[str, Any]) -> list[dg.AssetMaterialization]:
    """What a delivery run reports of a lake sink's table with its deliveries (``metadata``: theirs):
    the batches it wrote to the table. Nothing for other sinks."""
    if stream.sink.type not in LAKE_SINK_TYPES:
        return []
    return [dg.AssetMaterialization(
        asset_key=lake_table_asset_key(stream.id),
        description=f"batches {metadata['first_batch_id']}..{metadata['last_batch_id']} written to the "
                    f"{stream.sink.type} table",
        metadata={key: metadata[key] for key in ("batches", "events", "first_batch_id", "last_batch_id")})]


def lake_definitions(stream: StreamConfig) -> tuple[list[dg.AssetSpec], list[dg.AssetChecksDefinition]]:
    """The stream's lake table asset and its check (none unless its sink is a lake sink)."""
    if stream.sink.type not in LAKE_SINK_TYPES:
        return [], []
    table = dg.AssetSpec(
        key=lake_table_asset_key(stream.id), group_name="pgstream", deps=[deliveries_asset_key(stream.id)],
        description=f"The {stream.sink.type} table stream {stream.id} delivers to ({_where(stream)}): one row per "
                    f"event, written exactly once (commits keyed by the ledger position).",
        metadata={"stream_id": stream.id, "sink_type": stream.sink.type, "table": _where(stream)},
        kinds={stream.sink.type})  # (the format: delta, iceberg, parquet)
    return [table], [lake_counts_check(stream)]
