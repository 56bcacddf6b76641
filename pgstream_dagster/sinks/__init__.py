"""Sinks: where change events are delivered.

``SinkConfig`` is a pydantic discriminated union (on ``type``) of every sink config; ``build_sink`` turns
a config (or a plain mapping) into a :class:`Sink`. Importing this package never imports the optional
client libraries (redis, pika, nats-py, confluent-kafka, paho-mqtt, boto3, deltalake, pyiceberg): they
are loaded when the matching sink is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Union

from pydantic import ConfigDict, Field, TypeAdapter

from .base import Event, MissingExtraError, Sink, SinkConfigBase, SinkError
from .delta import DeltaSink, DeltaSinkConfig
from .file import FileSink, FileSinkConfig
from .http import HttpSink, HttpSinkConfig
from .iceberg import IcebergSink, IcebergSinkConfig
from .kafka import KafkaSink, KafkaSinkConfig
from .kinesis import KinesisSink, KinesisSinkConfig
from .memory import MemorySink, MemorySinkConfig
from .mqtt import MqttSink, MqttSinkConfig
from .nats import NatsSink, NatsSinkConfig
from .parquet import ParquetSink, ParquetSinkConfig
from .postgres import PostgresSink, PostgresSinkConfig
from .rabbitmq import RabbitMqSink, RabbitMqSinkConfig
from .redis import RedisSink, RedisSinkConfig
from .sns import SnsSink, SnsSinkConfig
from .sqs import SqsSink, SqsSinkConfig

__all__ = [
    "LAKE_SINK_TYPES",
    "DeltaSink",
    "DeltaSinkConfig",
    "Event",
    "FileSink",
    "FileSinkConfig",
    "HttpSink",
    "HttpSinkConfig",
    "IcebergSink",
    "IcebergSinkConfig",
    "KafkaSink",
    "KafkaSinkConfig",
    "KinesisSink",
    "KinesisSinkConfig",
    "MemorySink",
    "MemorySinkConfig",
    "MissingExtraError",
    "MqttSink",
    "MqttSinkConfig",
    "NatsSink",
    "NatsSinkConfig",
    "ParquetSink",
    "ParquetSinkConfig",
    "PostgresSink",
    "PostgresSinkConfig",
    "RabbitMqSink",
    "RabbitMqSinkConfig",
    "RedisSink",
    "RedisSinkConfig",
    "Sink",
    "SinkConfig",
    "SinkConfigBase",
    "SinkError",
    "SnsSink",
    "SnsSinkConfig",
    "SqsSink",
    "SqsSinkConfig",
    "build_sink",
    "parse_sink_config",
]

SinkConfig = Annotated[
    Union[  # noqa: UP007 - an explicit Union reads best for a discriminated union
        MemorySinkConfig,
        FileSinkConfig,
        HttpSinkConfig,
        RedisSinkConfig,
        RabbitMqSinkConfig,
        NatsSinkConfig,
        KafkaSinkConfig,
        MqttSinkConfig,
        PostgresSinkConfig,
        SqsSinkConfig,
        SnsSinkConfig,
        KinesisSinkConfig,
        DeltaSinkConfig,
        IcebergSinkConfig,
        ParquetSinkConfig,
    ],
    Field(discriminator="type"),
]
"""Any sink config, chosen by its ``type`` field."""

#: the sinks whose commits are keyed by the ledger position (:mod:`.lake`): global ordering only
LAKE_SINK_TYPES = frozenset({"delta", "iceberg", "parquet"})

_adapter: TypeAdapter[SinkConfigBase] = TypeAdapter(SinkConfig, config=ConfigDict(hide_input_in_errors=True))


def parse_sink_config(data: SinkConfigBase | Mapping[str, Any]) -> SinkConfigBase:
    """Validate a mapping such as ``{"type": "http", "url": ...}`` into its config model."""
    if isinstance(data, SinkConfigBase):
        return data
    return _adapter.validate_python(dict(data))


def build_sink(config: SinkConfigBase | Mapping[str, Any]) -> Sink:
    """Build the sink described by ``config`` (a config model or a mapping with a ``type`` key)."""
    return parse_sink_config(config).build()
