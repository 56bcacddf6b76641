"""Delta Lake sink (the ``deltalake`` package, delta-rs: no JVM): each publish call is one Delta commit
carrying a transaction identifier (app id ``pgstream-stream-<id>``, version: the token of the call's
last ledger position). Docs: docs/lake/delta.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, SecretStr

from .lake import LakeSink, LakeSinkConfigBase, Span, arrow_schema, dataset_filter, token

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["DeltaSink", "DeltaSinkConfig", "delta_app_id"]


def delta_app_id(stream_id: int) -> str:
    """The Delta transaction identifier (``txn.appId``) of a stream's commits."""
    return f"pgstream-stream-{stream_id}"


class DeltaSinkConfig(LakeSinkConfigBase):
    """Append events to the Delta table at ``path`` (created on the first write), exactly once."""

    type: Literal["delta"] = "delta"
    path: str = Field(min_length=1, description="the table's location: a local directory or an object store URI "
                                                "(s3://bucket/table, az://..., gs://...)")
    storage_options: dict[str, SecretStr] = Field(
        default_factory=dict, description="delta-rs storage options (credentials, endpoint) for an object store; "
                                          "values are secrets, never logged")


class DeltaSink(LakeSink, builds=DeltaSinkConfig):
    """Appends to a Delta table; each commit records the stream's transaction version."""

    config: DeltaSinkConfig

    def __init__(self, config: DeltaSinkConfig) -> None:
        super().__init__(config)
        self._deltalake: Any = self._import("deltalake", "deltalake")
        #: the table the commits go to, kept open between them (each commit advances it; a failure drops it)
        self._target: Any = None
        self._options = {k: v.get_secret_value() for k, v in config.storage_options.items()} or None

    def where(self) -> str:
        return f"table {self.config.path}"

    def _table(self) -> Any:
        deltalake = self._deltalake
        if not deltalake.DeltaTable.is_deltatable(self.config.path, storage_options=self._options):
            return None
        return deltalake.DeltaTable(self.config.path, storage_options=self._options)

    def reset(self) -> None:
        self._target = None  # a failed commit (a concurrent writer, an outage): open the table again

    def read_token(self, stream_id: int) -> int | None:
        table = self._target = self._table()
        if table is None:
            return None
        version = table.transaction_version(delta_app_id(stream_id))
        return int(version) if version is not None else None

    def read(self, stream_id: int, columns: Sequence[str], ids: tuple[int, int] | None = None) -> pa.Table:
        table = self._table()
        if table is None:
            return arrow_schema().empty_table().select(list(columns))
        return table.to_pyarrow_dataset().to_table(columns=list(columns), filter=dataset_filter(stream_id, ids))

    def commit(self, stream_id: int, table: pa.Table, span: Span | None) -> None:
        deltalake = self._deltalake
        properties = deltalake.CommitProperties(
            app_transactions=[deltalake.Transaction(delta_app_id(stream_id), token(*span[1]))]
            if span is not None else None)
        target = self._target
        deltalake.write_deltalake(self.config.path if target is None else target, table, mode="append",
                                  partition_by=["day"], schema_mode="merge",
                                  storage_options=self._options if target is None else None,
                                  commit_properties=properties)
        if target is None:  # the table's first commit (by this sink): the next ones go to it, open
            self._target = self._table()
