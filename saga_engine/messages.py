"""The messages that travel between services, as frozen pydantic models.

``Envelope`` is what the outbox stores and the transports carry: routing (destination, partition
key), identity (message id, correlation and causation ids) and a self-contained JSON payload (the
article's §4.1: consumers must not call back to learn what happened).

``Message`` is the base class for the typed payloads teams declare (commands, replies, events); the
``MessageRegistry`` maps their type names back to classes when a consumer decodes a payload.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from saga_engine import errors, ids

JsonObject = dict[str, Any]


def utcnow() -> datetime:
    return datetime.now(UTC)


class Message(BaseModel):
    """Base class of a typed payload. Its ``message_type`` is the class name unless overridden."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    message_type: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "message_type" not in cls.__dict__:
            cls.message_type = cls.__name__


class Envelope(BaseModel):
    """One message with everything needed to route, deduplicate and trace it."""

    model_config = ConfigDict(frozen=True)

    message_id: str = Field(default_factory=ids.new_id, min_length=1, max_length=64)
    message_type: str = Field(min_length=1, max_length=128)
    destination: str = Field(min_length=1, max_length=255)
    partition_key: str = Field(min_length=1, max_length=255)
    aggregate_type: str = Field(default="", max_length=64)
    aggregate_id: str = Field(default="", max_length=128)
    correlation_id: str | None = Field(default=None, max_length=64)
    causation_id: str | None = Field(default=None, max_length=64)
    tenant_id: str | None = Field(default=None, max_length=64)
    headers: dict[str, str] = Field(default_factory=dict)
    payload: JsonObject = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=utcnow)

    @classmethod
    def of(
        cls, message: Message, *, destination: str, partition_key: str, **fields: Any
    ) -> Envelope:
        """Wrap a typed message; ``fields`` are any other envelope fields."""
        return cls(
            message_type=message.message_type,
            destination=destination,
            partition_key=partition_key,
            payload=message.model_dump(mode="json"),
            **fields,
        )

    def to_wire(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_wire(cls, raw: bytes) -> Envelope:
        """Decode bytes from a transport; any problem becomes a :class:`errors.DecodeError`."""
        try:
            return cls.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            raise errors.DecodeError(_describe(exc)) from exc


def wire_bytes(row_fields: JsonObject, headers_json: str, payload_json: str) -> bytes:
    """Build an envelope's wire form from an outbox row without re-parsing its JSON columns.

    The relay sends thousands of rows a second; splicing the stored headers and payload text into
    the JSON saves a parse and a dump of each per message. ``Envelope.from_wire`` reads the result.
    """
    head = _ENCODER.encode(row_fields)
    return f'{head[:-1]},"headers":{headers_json},"payload":{payload_json}}}'.encode()


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def _describe(exc: pydantic.ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "message"
    return f"{exc.error_count()} validation error(s); first at {where}: {first.get('msg')}"


M = TypeVar("M", bound=Message)


class MessageRegistry:
    """Maps message type names to their classes, for decoding payloads."""

    def __init__(self) -> None:
        self._types: dict[str, type[Message]] = {}

    def register(self, cls: type[M]) -> type[M]:
        existing = self._types.get(cls.message_type)
        if existing is not None and existing is not cls:
            raise errors.DefinitionError(
                f"message type {cls.message_type!r} is declared twice "
                f"({existing.__module__} and {cls.__module__})"
            )
        self._types[cls.message_type] = cls
        return cls

    def __contains__(self, message_type: str) -> bool:
        return message_type in self._types

    def decode(self, envelope: Envelope) -> Message:
        cls = self._types.get(envelope.message_type)
        if cls is None:
            raise errors.DecodeError(f"unknown message type {envelope.message_type!r}")
        try:
            return cls.model_validate(envelope.payload)
        except pydantic.ValidationError as exc:
            raise errors.DecodeError(
                f"payload does not match {envelope.message_type}: {_describe(exc)}"
            ) from exc
