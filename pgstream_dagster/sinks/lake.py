"""What the lake sinks (``delta``, ``iceberg``, ``parquet``) share: the table's columns, events as an
Arrow table, and exactly-once keyed by the ledger position (each commit records the :func:`token` of
its last event; of the events at or before it, the sink writes only those whose id the table lacks). How and
why: docs/lake.md."""

from __future__ import annotations

import datetime as dt
import decimal
import math
import re
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

from pydantic import Field, SecretStr, model_validator

from .base import (
    Event,
    EventContentError,
    Sink,
    SinkConfigBase,
    SinkError,
    connect_postgres,
    describe_exception,
    dumps,
    event_columns,
    event_stream,
    import_extra,
)

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "LakeSink",
    "LakeSinkConfigBase",
    "Span",
    "TypedColumn",
    "UnfitValue",
    "arrow_schema",
    "catalog_columns",
    "dataset_filter",
    "events_table",
    "position_of",
    "token",
    "typed_values",
]

Span = tuple[tuple[int, int], tuple[int, int]]
"""The ledger positions ``((batch_id, ord), (batch_id, ord))`` of the first and last event of a commit."""

#: a position's ordinal takes the low 32 bits of a token (a ledger batch holds at most 1,000,000 events)
_ORD_BITS = 32

#: the payload's keys the event columns take (column name, payload key)
_PAYLOAD_COLUMNS = (("operation", "tg_op"), ("schema_name", "tg_table_schema"), ("table_name", "tg_table_name"),
                    ("subscription", "tg_name"))


def token(batch_id: int, ord: int) -> int:
    """The idempotency token of ledger position ``(batch_id, ord)``: increasing along the delivery order."""
    return (batch_id << _ORD_BITS) | ord


def position_of(value: int) -> tuple[int, int]:
    """The ledger position ``(batch_id, ord)`` of a :func:`token`."""
    return value >> _ORD_BITS, value & ((1 << _ORD_BITS) - 1)


def dataset_filter(stream_id: int, ids: tuple[int, int] | None) -> Any:
    """The pyarrow dataset filter of the stream's rows (with ``ids``: of the event ids ``low..high``)."""
    import pyarrow.dataset as ds

    rows = ds.field("stream_id") == stream_id
    return rows if ids is None else rows & (ds.field("id") >= ids[0]) & (ds.field("id") <= ids[1])


def arrow_schema() -> pa.Schema:
    """The columns of every lake table, in order (docs/lake.md, "Columns"); every column nullable, as the
    table formats read them."""
    import pyarrow as pa

    return pa.schema([("id", pa.int64()), ("stream_id", pa.int64()), ("created_at", pa.timestamp("us", tz="UTC")),
                      ("day", pa.date32()), *[(name, pa.string()) for name, _key in _PAYLOAD_COLUMNS],
                      ("payload", pa.string()), ("metadata", pa.string())])


def _object(event: Event) -> dict[str, Any]:
    """The event's payload when it is a JSON object Python can parse, else ``{}``: the lake keeps any
    payload (its text is the ``payload`` column), it only reads keys from one."""
    try:
        payload = event.payload
    except EventContentError:  # nested deeper than Python parses
        return {}
    return payload if isinstance(payload, dict) else {}


def _row(event: Event) -> dict[str, Any] | None:
    """The payload's ``new`` object, else its ``old`` one (a DELETE), else ``None``."""
    payload = _object(event)
    row = payload.get("new") or payload.get("old")
    return row if isinstance(row, dict) else None


def payload_columns(events: Sequence[Event], texts: Sequence[str]) -> list[pa.Array]:
    """The columns of :data:`_PAYLOAD_COLUMNS`, parsed from the payloads' JSON ``texts`` by Arrow's JSON
    reader in one pass (one block, in this thread); when it cannot take a payload (one of these keys not a
    string), by Python's parser, where such a value is null."""
    import io

    import pyarrow as pa
    import pyarrow.json as pj

    data = "\n".join(texts).encode()
    schema = pa.schema([pa.field(key, pa.string()) for _, key in _PAYLOAD_COLUMNS])
    with suppress(pa.ArrowInvalid, pa.ArrowNotImplementedError):
        parsed = pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(use_threads=False,
                                                                   block_size=max(len(data) + 1, 1 << 20)),
                              parse_options=pj.ParseOptions(explicit_schema=schema,
                                                            unexpected_field_behavior="ignore"))
        if parsed.num_rows == len(texts):
            return [parsed.column(key).combine_chunks() for _, key in _PAYLOAD_COLUMNS]
    payloads = [_object(e) for e in events]
    return [pa.array([v if isinstance(v := p.get(key), str) else None for p in payloads], type=pa.string())
            for _, key in _PAYLOAD_COLUMNS]


class UnfitValue(ValueError):
    """A row's value its typed column cannot hold (:meth:`TypedColumn.convert`): the event's rejection."""


def typed_values(events: Sequence[Event], typed: Sequence[TypedColumn]) -> tuple[list[pa.Array], int | None, str]:
    """Each ``typed`` column's values for ``events`` as an Arrow array (:meth:`TypedColumn.array`), up to
    the first event with a value its column cannot hold: ``(arrays, its index or None, why)``."""
    rows = [_row(e) for e in events]
    first: int | None = None
    why = ""
    arrays: list[pa.Array] = []
    for column in typed:
        name = column.column
        values = [row.get(name) if row is not None else None for row in rows]
        # after an unfit event, only the events before it: a later column can only name an earlier one
        array, unfit, reason = column.array(values if first is None else values[:first])
        if unfit is not None:
            first, why = unfit, reason
        arrays.append(array)
    if first is not None:
        arrays = [array.slice(0, first) for array in arrays]
    return arrays, first, why


def events_table(events: Sequence[Event], typed: Sequence[TypedColumn] = (),
                 values: Sequence[pa.Array] = ()) -> pa.Table:
    """``events`` as an Arrow table of :func:`arrow_schema`, built a column at a time, plus the ``typed``
    columns holding ``values`` (their :func:`typed_values`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids, streams, created_at, payloads, metadata = event_columns(events)
    # a naive time is taken as UTC, an aware one converted to UTC
    created = pa.array(created_at, type=pa.timestamp("us", tz="UTC"))
    arrays: list[pa.Array] = [pa.array(ids, type=pa.int64()), pa.array(streams, type=pa.int64()), created,
                              pc.cast(created, pa.date32()), *payload_columns(events, payloads),
                              pa.array(payloads, type=pa.string()), pa.array(metadata, type=pa.string())]
    fields = list(arrow_schema())
    for column, array in zip(typed, values, strict=True):
        arrays.append(array)
        fields.append(pa.field(column.name, column.arrow_type()))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


_UNSAFE = re.compile(r"[^0-9A-Za-z_]")

#: Postgres types (``format_type``, without a modifier) and the Arrow type of their column; any other
#: type (numeric: exact digits; json, arrays, ranges, enums...) is a string column of its JSON text
_ARROW_TYPES = {
    "smallint": "int16", "integer": "int32", "bigint": "int64", "real": "float32", "double precision": "float64",
    "boolean": "bool", "text": "string", "character varying": "string", "character": "string", "uuid": "string",
    "name": "string", "citext": "string", "date": "date32", "timestamp without time zone": "timestamp",
    "timestamp with time zone": "timestamptz",
}


#: the values of each integer kind
_INT_RANGES = {"int16": (-(2**15), 2**15 - 1), "int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
#: the largest finite float32 (Postgres ``real``)
_FLOAT32_MAX = 3.4028234663852886e38
#: a date or timestamp Postgres holds and Python (so Arrow) cannot: infinity, a year of 5+ digits, BC
_BEYOND_ARROW = re.compile(r"\s*[-+]?infinity\s*|\s*\d{5,}-.*|.*\sBC\s*", re.IGNORECASE)
#: a date both Python's and Arrow's parser read alike (year 1 to 9999)
_PLAIN_DATE = r"^(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-[0-9]{2}-[0-9]{2}$"
#: the spellings of an infinite float (``float()`` takes them; a finite number that overflows is refused)
_INFINITY = frozenset({"inf", "infinity"})


@dataclass(frozen=True)
class TypedColumn:
    """A column of a subscription's table in the lake table (``typed_columns: true``): ``row_<column>``,
    its value taken from the payload's ``new`` (``old`` for a DELETE), typed from the catalog type."""

    column: str
    pg_type: str

    @property
    def name(self) -> str:
        """``row_<column>``, any character other than a letter, digit or ``_`` as ``_`` (Delta refuses
        spaces, commas, semicolons, braces, parentheses and ``=`` in column names)."""
        return "row_" + _UNSAFE.sub("_", self.column)  # prefixed: ``id`` is the event's

    @property
    def kind(self) -> str:
        return _ARROW_TYPES.get(self.pg_type.split("(")[0].strip(), "string")

    def arrow_type(self) -> pa.DataType:
        import pyarrow as pa

        return {"int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(), "float32": pa.float32(),
                "float64": pa.float64(), "bool": pa.bool_(), "string": pa.string(), "date32": pa.date32(),
                "timestamp": pa.timestamp("us"), "timestamptz": pa.timestamp("us", tz="UTC")}[self.kind]

    def convert(self, value: Any) -> Any:
        """The payload's JSON value as this column's Python value: None when Arrow cannot hold it (a date
        of infinity, after year 9999: the payload keeps it), :class:`UnfitValue` (naming the column and why,
        never the value) when the type cannot (out of range, not a number, not a date)."""
        if value is None:
            return None
        kind = self.kind
        if kind.startswith("int"):
            return self._integer(value, *_INT_RANGES[kind])
        if kind.startswith("float"):
            return self._float(value, kind == "float32")
        if kind == "bool":
            if not isinstance(value, bool):
                raise self._unfit("not true or false")
            return value
        if kind == "date32":
            return self._temporal(value, "date", dt.date.fromisoformat)
        if kind in ("timestamp", "timestamptz"):
            parsed = self._temporal(value, "timestamp", dt.datetime.fromisoformat)
            try:
                if parsed is None or kind == "timestamp":
                    return parsed if parsed is None else parsed.replace(tzinfo=None)
                return parsed.astimezone(dt.UTC) if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)
            except OverflowError:  # 9999-12-31T23:00-05:00: past Python's last UTC instant
                return None
        return value if isinstance(value, str) else dumps(value)

    def array(self, values: Sequence[Any]) -> tuple[pa.Array, int | None, str]:
        """The payloads' JSON ``values`` as this column's Arrow array, up to the first one the column
        cannot hold: ``(array, its index or None, why)``; converted at once (:meth:`_at_once`) when it can,
        else a value at a time by :meth:`convert`."""
        import pyarrow as pa

        fast = self._at_once(values)
        if fast is not None:
            return fast, None, ""
        converted: list[Any] = []
        for index, value in enumerate(values):
            try:
                converted.append(self.convert(value))
            except UnfitValue as exc:
                return pa.array(converted, type=self.arrow_type()), index, str(exc)
        return pa.array(converted, type=self.arrow_type()), None, ""

    def _at_once(self, values: Sequence[Any]) -> pa.Array | None:
        """``values`` converted by Arrow in one call when they are all of a kind on which it agrees with
        :meth:`convert`; ``None`` when not, or when one does not fit (:meth:`convert` then finds which)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        kinds = set(map(type, values)) - {type(None)}
        kind = self.kind
        try:
            # an integer out of range raises (bool, Decimal, str: one by one)
            if ((kind.startswith("int") and kinds <= {int}) or (kind == "bool" and kinds <= {bool})
                    or (kind == "string" and kinds <= {str})):
                return pa.array(values, type=self.arrow_type())
            if kind.startswith("float") and kinds <= {float, int}:  # an integer past 2**53 raises
                numbers = pa.array(values, type=pa.float64())
                if pc.any(pc.is_inf(numbers)).as_py():  # a finite number past float64 (Python's parser gives inf)
                    return None
                if kind == "float32" and pc.any(pc.greater(pc.abs(numbers), _FLOAT32_MAX)).as_py():
                    return None
                return numbers.cast(self.arrow_type())  # NaN fits, as in convert
            if kind == "date32" and kinds <= {str}:
                texts = pa.array(values, type=pa.string())
                if pc.all(pc.match_substring_regex(texts, _PLAIN_DATE)).as_py() is False:
                    return None
                return texts.cast(pa.date32())  # a day the month has not raises
        except (pa.ArrowInvalid, OverflowError):
            return None
        return None

    def _unfit(self, why: str) -> UnfitValue:
        return UnfitValue(f"column {self.column!r} ({self.pg_type}) cannot hold the row's value: {why}")

    def _integer(self, value: Any, low: int, high: int) -> int:
        # an integer longer than Python converts is a Decimal (loads_event_json); a numeric string is taken
        if isinstance(value, bool) or not isinstance(value, int | str | decimal.Decimal):
            raise self._unfit("not an integer")
        try:
            number = int(value)
        except ValueError:
            raise self._unfit("not an integer") from None
        if isinstance(value, decimal.Decimal) and number != value:
            raise self._unfit("not an integer")
        if not low <= number <= high:
            raise self._unfit("out of range")
        return number

    def _float(self, value: Any, single: bool) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float | str | decimal.Decimal):
            raise self._unfit("not a number")
        try:
            number = float(value)
        except OverflowError:
            raise self._unfit("out of range") from None
        except ValueError:
            raise self._unfit("not a number") from None
        if math.isinf(number) and not (isinstance(value, str) and value.strip().lstrip("+-").lower() in _INFINITY):
            raise self._unfit("out of range")  # a finite number past float64
        if single and math.isfinite(number) and abs(number) > _FLOAT32_MAX:
            raise self._unfit("out of range")
        return number

    def _temporal(self, value: Any, what: str, parse: Any) -> Any:
        if not isinstance(value, str):
            raise self._unfit(f"not a {what}")
        try:
            return parse(value)
        except ValueError:
            if _BEYOND_ARROW.fullmatch(value):
                return None
            raise self._unfit(f"not a {what}") from None


#: the table by its names in the catalog (to_regclass would need USAGE on its schema, which the runtime has not)
_CATALOG_COLUMNS = """
select distinct c.name, pg_catalog.format_type(a.atttypid, a.atttypmod)
from pgstream.subscriptions s
cross join lateral pg_catalog.unnest(s.column_names) as c(name)
join pg_catalog.pg_namespace n on n.nspname = s.schema_name
join pg_catalog.pg_class r on r.relnamespace = n.oid and r.relname = s.table_name
join pg_catalog.pg_attribute a
  on a.attrelid = r.oid and a.attname = c.name and a.attnum > 0 and not a.attisdropped
where s.stream_id = %s
order by 1
"""


def catalog_columns(database_url: str, stream_id: int) -> list[TypedColumn]:
    """The columns the stream's subscriptions publish, typed from the catalog (``pg_attribute``), in
    name order; a name two tables give different types is a string column."""
    with connect_postgres(database_url, autocommit=True, application_name="pgstream lake sink") as conn:
        rows = conn.execute(_CATALOG_COLUMNS, [stream_id]).fetchall()
    types: dict[str, set[str]] = {}
    for name, pg_type in rows:
        types.setdefault(name, set()).add(pg_type)
    columns: dict[str, TypedColumn] = {}
    for name, found in types.items():  # a name that collides with an earlier one once made safe is left out
        column = TypedColumn(name, next(iter(found)) if len(found) == 1 else "text")
        columns.setdefault(column.name, column)
    return list(columns.values())


class LakeSinkConfigBase(SinkConfigBase):
    """What every lake sink config has."""

    typed_columns: bool = Field(
        False, description="also a column per column the stream's subscriptions publish (row_<column>, from the "
                           "payload's new, or old for a DELETE), typed from the table's catalog type; a column a "
                           "subscription gains is added to the table")
    database_url: SecretStr | None = Field(
        None, description="typed_columns: the pgstream database whose catalog types are read (the runtime role "
                          "can); a secret, never logged")

    @model_validator(mode="after")
    def _typed_needs_database(self) -> Self:
        if self.typed_columns and self.database_url is None:
            raise ValueError("typed_columns: true needs database_url (the pgstream database, e.g. "
                             "${PGSTREAM_DATABASE_URL}) to read the columns' types")
        return self


class LakeSink(Sink):
    """A sink whose commits are keyed by the ledger position (docs/lake.md)."""

    accepts_positions: ClassVar[bool] = True

    def __init__(self, config: SinkConfigBase) -> None:
        super().__init__(config)
        #: per stream: the token of the last committed position, as read (``None``: none committed)
        self._tokens: dict[int, int | None] = {}
        #: per stream (typed_columns): the typed columns known, in the order they joined the table
        self._typed: dict[int, list[TypedColumn]] = {}
        self._untyped: dict[int, set[str]] = {}

    @abstractmethod
    def read_token(self, stream_id: int) -> int | None:
        """The token the table holds for the stream, ``None`` when none (or no table yet); a read only (any
        process may call it while the stream's writer writes)."""

    def recover(self, stream_id: int) -> int | None:
        """The stream's writer, before its first write: the token, once what a writer of the stream killed before
        its commit left is undone. The default: the format's commit is atomic, nothing to undo."""
        return self.read_token(stream_id)

    @abstractmethod
    def commit(self, stream_id: int, table: pa.Table, span: Span | None) -> None:
        """Write ``table`` in one commit; with ``span`` (the ledger positions of its first and last
        event), record ``token(*span[1])`` as the stream's token in the same commit."""

    @abstractmethod
    def read(self, stream_id: int, columns: Sequence[str], ids: tuple[int, int] | None = None) -> pa.Table:
        """The stream's rows of the table (``columns`` of them; with ``ids``, those of the event ids
        ``low..high``), read with the format's own reader; an empty table when there is no table yet."""

    def present_ids(self, stream_id: int, low: int, high: int) -> set[int]:
        """The event ids of the stream in ``low..high`` the table holds."""
        return set(self.read(stream_id, ["id"], (low, high)).column("id").to_pylist())

    @abstractmethod
    def where(self) -> str:
        """The table, for messages (never a secret)."""

    def reset(self) -> None:
        """Forget what the sink holds of the table (after a failure). The default holds nothing."""

    def day_counts(self, stream_id: int, since: dt.datetime | None = None,
                   upto: dt.datetime | None = None) -> dict[dt.date, int]:
        """The stream's events in the table per UTC day of ``created_at`` (in ``[since, upto)`` when
        given): the asset check compares them with ``pgstream.events``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        created = self.read(stream_id, ["created_at"]).column("created_at")
        if since is not None:
            created = created.filter(pc.greater_equal(created, pa.scalar(since, type=created.type)))
        if upto is not None:
            created = created.filter(pc.less(created, pa.scalar(upto, type=created.type)))
        return {row["values"]: row["counts"] for row in pc.value_counts(pc.cast(created, "date32")).to_pylist()}

    def ids(self, stream_id: int) -> list[int]:
        """The stream's event ids in the table, in no particular order, duplicates included."""
        return [int(v) for v in self.read(stream_id, ["id"]).column("id").to_pylist()]

    def publish(self, events: Sequence[Event]) -> None:
        """Events without ledger positions (a replay, a probe): written unless the table has their id."""
        if events:
            self._guard(events, lambda: self._by_id(events))

    def publish_at(self, events: Sequence[Event], positions: Sequence[tuple[int, int]]) -> None:
        if all(b == 0 for b, _o in positions):  # a replay (or no events): positions are event ids
            self.publish(events)
        elif events:
            self._guard(events, lambda: self._positioned(events, positions))

    def _positioned(self, events: Sequence[Event], positions: Sequence[tuple[int, int]]) -> None:
        stream_id = event_stream(events)
        if stream_id not in self._tokens:
            self._tokens[stream_id] = self.recover(stream_id)
        committed = self._tokens[stream_id]
        # by id: positions committed before (a retry, or after a failover of the primary that lost ledger batches, the
        # same positions handed out again for other events: ledger ids are not event ids) and events at batch 0 (a
        # former primary's, which it may have written here: the engine's ``ended_below``)
        known = [b == 0 or (committed is not None and token(b, o) <= committed) for b, o in positions]
        if any(known):
            self._by_id([e for e, k in zip(events, known, strict=True) if k])
        fresh = [i for i, k in enumerate(known) if not k]
        if fresh:
            self._write(stream_id, [events[i] for i in fresh], [positions[i] for i in fresh])

    def _by_id(self, events: Sequence[Event]) -> None:
        stream_id = event_stream(events)
        ids = [e.id for e in events]
        present = self.present_ids(stream_id, min(ids), max(ids))
        missing = [e for e in events if e.id not in present]
        if missing:
            self._write(stream_id, missing)

    def _write(self, stream_id: int, events: Sequence[Event], positions: Sequence[tuple[int, int]] = ()) -> None:
        """Commit ``events`` up to the first unfit one (:meth:`_arrow`), then reject it; ``positions``: the token."""
        table, unfit, why = self._arrow(stream_id, events)
        if table is not None:
            span = (positions[0], positions[table.num_rows - 1]) if positions else None
            self.commit(stream_id, table, span)
            if span is not None:
                self._tokens[stream_id] = token(*span[1])
        if unfit is not None:
            raise self._error([events[unfit]], self._at(why), permanent=True)

    def _at(self, text: str) -> str:
        return f"{self.where()}: {text}"

    def _arrow(self, stream_id: int, events: Sequence[Event]) -> tuple[pa.Table | None, int | None, str]:
        """The events as the table's rows, up to the first one with a value its typed column cannot
        hold: ``(rows or None, its index, why)``. With typed_columns, the catalog is read again when an
        event carries a column not known yet (a subscription gained one)."""
        config: Any = self.config
        if not config.typed_columns:
            return events_table(events), None, ""
        known = self._typed.get(stream_id)
        names = {c.column for c in known} if known is not None else set()
        seen = {name for row in map(_row, events) if row is not None for name in row}
        ignored = self._untyped.setdefault(stream_id, set())
        if known is None or seen - names - ignored:
            columns = known or []
            taken = {c.name for c in columns}
            for column in catalog_columns(config.database_url.get_secret_value(), stream_id):
                if column.column not in names and column.name not in taken:
                    columns.append(column)
                    names.add(column.column)
                    taken.add(column.name)
            ignored.update(seen - names)  # not in the catalog (a column dropped meanwhile): looked up once
            self._typed[stream_id] = known = columns
        values, unfit, why = typed_values(events, known)
        fitting = events if unfit is None else events[:unfit]
        return (events_table(fitting, known, values) if fitting else None), unfit, why

    def _guard(self, events: Sequence[Event], write: Any) -> None:
        try:
            write()
        except SinkError as exc:
            if not exc.permanent:  # a rejection comes after the commit of the events before it
                self._tokens.clear()
                self.reset()
            raise
        except Exception as exc:  # the libraries raise their own types (IO, catalog, schema)
            self._tokens.clear()  # a commit that failed may have been made: read the token again
            self.reset()
            raise self._error(events, self._at(describe_exception(exc, self.config.secret_values()))) from exc

    def _import(self, library: str, *modules: str) -> Any:
        return import_extra(self.type_name, "lake", library, *modules)
