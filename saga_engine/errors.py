"""Every error the engine raises derives from :class:`SagaEngineError`.

Driver and broker exceptions are translated at the adapter edge (``raise ... from exc``) so callers
only ever catch these.
"""

from __future__ import annotations


class SagaEngineError(Exception):
    """saga-engine failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class ConfigurationError(SagaEngineError):
    """The configuration is invalid (bad URL, unknown option, unknown app)."""


class PayloadTooLarge(SagaEngineError):
    """The message payload is larger than the configured limit."""


class DecodeError(SagaEngineError):
    """A message on the wire could not be decoded or validated."""


class TransportError(SagaEngineError):
    """The broker could not be reached or refused a message."""


class DatabaseUnavailable(SagaEngineError):
    """The database could not be reached."""


class DefinitionError(SagaEngineError):
    """A saga definition is invalid."""


class Rejected(SagaEngineError):
    """A participant refused a command for a business reason; the saga compensates."""


class ConcurrentUpdate(SagaEngineError):
    """A saga instance was changed by someone else since it was read (optimistic concurrency)."""


class UnknownSaga(SagaEngineError):
    """No saga instance or saga type with this id or name exists."""


class InvalidTransition(SagaEngineError):
    """The saga definition does not allow this move."""


class Undeliverable(SagaEngineError):
    """A message that can never be processed (unknown saga, stale reply): it goes to dead letters."""
