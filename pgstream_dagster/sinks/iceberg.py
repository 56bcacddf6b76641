"""Apache Iceberg sink (the ``pyiceberg`` package with a SQL catalog in Postgres): each publish call is one
append whose snapshot summary, and a table property set by the same commit, hold the token of the call's
last ledger position (``pgstream.stream-<id>.position``). Docs: docs/lake/iceberg.md."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, SecretStr, field_validator

from .base import POSTGRES_SCHEMES, psycopg2_url, redact_url
from .lake import LakeSink, LakeSinkConfigBase, Span, arrow_schema, token

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["IcebergSink", "IcebergSinkConfig", "snapshot_property"]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def snapshot_property(stream_id: int) -> str:
    """The snapshot summary property holding a stream's last committed position (its token)."""
    return f"pgstream.stream-{stream_id}.position"


class IcebergSinkConfig(LakeSinkConfigBase):
    """Append events to the Iceberg table ``table`` of a SQL catalog kept in Postgres, exactly once."""

    type: Literal["iceberg"] = "iceberg"
    catalog_url: SecretStr = Field(description="the catalog database: postgresql://user:password@host/db (a secret, "
                                               "never logged); pyiceberg creates its tables there on first use")
    catalog_name: str = Field("pgstream", min_length=1, max_length=200,
                              description="the catalog's name (its rows in the catalog database)")
    warehouse: str = Field(min_length=1, description="where data and metadata files go: file:///path or an object "
                                                     "store URI (s3://bucket/prefix)")
    table: str = Field(description="namespace.table (created on the first write)")
    properties: dict[str, SecretStr] = Field(
        default_factory=dict, description="more pyiceberg catalog properties (s3.endpoint, credentials); values "
                                          "are secrets, never logged")

    @field_validator("table")
    @classmethod
    def _table(cls, value: str) -> str:
        if not _IDENT.match(value):
            raise ValueError("table must be namespace.table (letters, digits and _ in each part)")
        return value

    @field_validator("catalog_url")
    @classmethod
    def _url(cls, value: SecretStr) -> SecretStr:
        scheme = value.get_secret_value().partition("://")[0]
        if scheme not in POSTGRES_SCHEMES:
            raise ValueError("catalog_url must be a postgresql:// URL (the SQL catalog lives in Postgres)")
        return value


class IcebergSink(LakeSink, builds=IcebergSinkConfig):
    """Appends to an Iceberg table; each snapshot records the stream's last position."""

    config: IcebergSinkConfig

    def __init__(self, config: IcebergSinkConfig) -> None:
        super().__init__(config)
        self._sql: Any = self._import("pyiceberg", "pyiceberg.catalog.sql")
        self._catalog: Any = None
        self._loaded: Any = None

    def where(self) -> str:
        return (f"table {self.config.table} of catalog {self.config.catalog_name} at "
                f"{redact_url(self.config.catalog_url.get_secret_value())}")

    def catalog(self) -> Any:
        if self._catalog is None:
            props = {k: v.get_secret_value() for k, v in self.config.properties.items()}
            self._catalog = self._sql.SqlCatalog(
                self.config.catalog_name, uri=psycopg2_url(self.config.catalog_url.get_secret_value()),
                warehouse=self.config.warehouse, **props)
        return self._catalog

    def close(self) -> None:
        """Close the catalog's database connections (SQLAlchemy's pool)."""
        catalog, self._catalog, self._loaded = self._catalog, None, None
        engine = getattr(catalog, "engine", None)
        if engine is not None:
            engine.dispose()

    def reset(self) -> None:
        self._loaded = None  # a failed commit (a concurrent writer, an outage): load the table again

    def _table(self, create: bool) -> Any:
        """The table to read (its metadata read again; ``None`` when missing) or, with ``create``, to commit
        to (the sink's own appends keep it current: a commit needs no refresh, a stale one fails and resets)."""
        if self._loaded is not None:
            if not create:
                self._loaded.refresh()
            return self._loaded
        catalog = self.catalog()
        if not catalog.table_exists(self.config.table):
            if not create:
                return None
            catalog.create_namespace_if_not_exists(self.config.table.rpartition(".")[0])
            created = catalog.create_table_if_not_exists(self.config.table, schema=arrow_schema())
            if not created.spec().fields:
                with created.update_spec() as spec:
                    spec.add_identity("day")
        self._loaded = catalog.load_table(self.config.table)
        return self._loaded

    def read_token(self, stream_id: int) -> int | None:
        table = self._table(create=False)
        if table is None:
            return None
        # set by each of the stream's commits with its snapshot (docs/lake/iceberg.md): snapshot expiry cannot remove it
        value = table.properties.get(snapshot_property(stream_id))
        return int(value) if value is not None else None

    def read(self, stream_id: int, columns: Sequence[str], ids: tuple[int, int] | None = None) -> pa.Table:
        table = self._table(create=False)
        if table is None:
            return arrow_schema().empty_table().select(list(columns))
        where = f"stream_id = {int(stream_id)}" + (f" and id >= {int(ids[0])} and id <= {int(ids[1])}" if ids else "")
        result: pa.Table = table.scan(row_filter=where, selected_fields=tuple(columns)).to_arrow()
        return result

    def commit(self, stream_id: int, table: pa.Table, span: Span | None) -> None:
        target = self._table(create=True)
        names = {f.name for f in target.schema().fields}
        if any(name not in names for name in table.column_names):
            with target.update_schema() as update:
                update.union_by_name(table.schema)
        if span is None:
            target.append(table)
            return
        properties = {snapshot_property(stream_id): str(token(*span[1]))}
        with target.transaction() as transaction:  # one commit: the rows, the snapshot's and the table's property
            transaction.append(table, snapshot_properties=properties)
            transaction.set_properties(properties)
