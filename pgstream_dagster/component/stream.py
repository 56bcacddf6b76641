"""``pgstream_dagster.StreamComponent``: a stream and its subscriptions declared in a ``defs.yaml``.

Its attributes, a stream of ``pgstream.yaml`` plus ``subscriptions``
(:class:`~pgstream_dagster.config.StreamDeclaration`), are validated by the same models with the same messages
(``${VAR}`` read as there). The shared definitions (:func:`pgstream_dagster.defs.location.pgstream_location`)
find the components as :class:`~..defs.location.StreamDeclaringComponent`s and never import this package.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field

from ..config import parse_stream
from ..defs.location import StreamDeclaringComponent


class _Attributes(BaseModel):
    """Any mapping: :meth:`StreamComponent.load` validates it with the pgstream models, so a bad
    defs.yaml reads like a bad pgstream.yaml (key and problem, never a value: it may be a secret)."""

    model_config = ConfigDict(extra="allow")


class StreamScaffoldParams(BaseModel):
    """``dg scaffold defs pgstream_dagster.StreamComponent NAME [--id N] [--table-name T]``."""

    id: int = Field(2, ge=1, description="the stream id (unique in the code location)")
    schema_name: str = Field("public", description="schema of the subscribed table")
    table_name: str | None = Field(None, description="the subscribed table (default: NAME)")


_EXAMPLE = """\
# A pgstream stream and its subscriptions. The attributes are those of a stream in pgstream.yaml
# (README, "Configuration") plus `subscriptions`, checked by the same models; ${{VAR}} and
# ${{VAR:-default}} are read from the environment. The database, housekeeping and Spark settings
# stay in pgstream.yaml. Stream ids are unique across pgstream.yaml and every StreamComponent of
# the project.
type: {type_name}
attributes:
  id: {id}                                  # 1 .. 2^63-1
  # reader: default                      # its reader group: the streams naming one share its slot
  batch: {{max_size: 1000, max_fill_secs: 0.5}}
  sink:                                   # file, http, redis, rabbitmq, nats, kafka, mqtt, postgres (README, "Sinks")
    type: file
    path: ${{PGSTREAM_SINK_DIR:-.pgstream}}/{name}-events.jsonl
  # delivery: {{mode: open, ordering: global, on_reject: block}}   # mode: open | per_batch
  # checks: {{max_undelivered_age_secs: 900}}
  subscriptions:                          # as in pgstream.yaml; stream_id is this stream's id
    - key: {name}-insert
      operation: INSERT                   # INSERT, UPDATE or DELETE
      schema_name: {schema_name}
      table_name: {table_name}
      # when_clause: new.active             # a boolean SQL expression over new (old for DELETE)
      column_names: [id]                  # columns copied into the payload's new / old
"""


class StreamScaffolder(dg.Scaffolder[StreamScaffoldParams]):
    """Writes a commented, valid ``defs.yaml`` for one stream."""

    @classmethod
    def get_scaffold_params(cls) -> type[StreamScaffoldParams]:
        return StreamScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[StreamScaffoldParams]) -> None:
        params = request.params or StreamScaffoldParams()
        name = request.target_path.name
        request.target_path.mkdir(parents=True, exist_ok=True)
        (request.target_path / "defs.yaml").write_text(_EXAMPLE.format(
            type_name=request.type_name, id=params.id, name=name, schema_name=params.schema_name,
            table_name=params.table_name or name), encoding="utf-8")


@dg.scaffold_with(StreamScaffolder)
class StreamComponent(StreamDeclaringComponent):
    """A pgstream stream with its subscriptions: its sensor, deliveries and status assets, replay
    job, subscription assets and checks. Attributes: a stream of pgstream.yaml plus `subscriptions`
    (their `stream_id` is the stream's id)."""

    def __repr__(self) -> str:  # never a secret
        return f"StreamComponent(stream {self.declaration.id}, {self.source})"

    @classmethod
    def get_model_cls(cls) -> type[BaseModel]:
        return _Attributes

    @classmethod
    def get_spec(cls) -> dg.ComponentTypeSpec:
        return dg.ComponentTypeSpec(description=cls.__doc__, tags=["pgstream", "postgres"],
                                    produces=["asset", "asset_check", "sensor", "job"])

    @classmethod
    def load(cls, attributes: BaseModel | None, context: dg.ComponentLoadContext) -> StreamComponent:
        path = context.path
        source = next((str(path / n) for n in ("defs.yaml", "component.yaml") if (path / n).is_file()), str(path))
        data: dict[str, Any] = attributes.model_dump() if attributes is not None else {}
        return cls(parse_stream(data, source, at="attributes"), source)
