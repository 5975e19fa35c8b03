"""The application object: the sagas and participants a team declares, in one place.

    app = App("shop", sagas=[order_fulfilment], participants=[orders, inventory, payment])

    with Session(engine) as session, session.begin():
        session.add(Order(...))
        app.start(session, order_fulfilment, OrderData(...))   # joins this transaction

No global state: the CLI and worker load this object (``--app module:attribute``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from saga_engine import clock, db, errors, schema
from saga_engine.consumer import ConsumerConfig
from saga_engine.definition import Saga
from saga_engine.orchestrator import Orchestrator, command_channel
from saga_engine.outbox.relay import RelayConfig
from saga_engine.outbox.writer import DEFAULT_MAX_PAYLOAD_BYTES, OutboxWriter
from saga_engine.participant import Participant, ParticipantService


class App:
    def __init__(
        self,
        name: str = "saga-engine",
        *,
        sagas: Sequence[Saga[Any]],
        participants: Sequence[Participant] = (),
        metadata: Sequence[sa.MetaData] = (),
        relay: RelayConfig | None = None,
        consumer: ConsumerConfig | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        clock: clock.Clock = clock.SYSTEM,
    ) -> None:
        self.name = name
        self.sagas = {saga.name: saga for saga in sagas}
        self.participants = {p.name: p for p in participants}
        self.metadata = list(metadata)
        self.relay_config = relay or RelayConfig()
        self.consumer_config = consumer or ConsumerConfig()
        self.clock = clock
        self._check(sagas, participants)
        self.writer = OutboxWriter(max_payload_bytes=max_payload_bytes, clock=clock)
        self.orchestrator = Orchestrator(self.sagas, writer=self.writer, clock=clock)

    def replace(
        self,
        *,
        sagas: Sequence[Saga[Any]] | None = None,
        participants: Sequence[Participant] | None = None,
        clock: clock.Clock | None = None,
    ) -> App:
        """A copy with some parts swapped (the fault simulator swaps the clock and wraps steps)."""
        return App(
            self.name,
            sagas=list(self.sagas.values()) if sagas is None else sagas,
            participants=list(self.participants.values()) if participants is None else participants,
            metadata=self.metadata,
            relay=self.relay_config,
            consumer=self.consumer_config,
            max_payload_bytes=self.writer.max_payload_bytes,
            clock=clock or self.clock,
        )

    def _check(self, sagas: Sequence[Saga[Any]], participants: Sequence[Participant]) -> None:
        if len(self.sagas) != len(sagas):
            raise errors.DefinitionError(f"app {self.name!r}: two sagas share a name")
        if len(self.participants) != len(participants):
            raise errors.DefinitionError(f"app {self.name!r}: two participants share a name")
        for saga in sagas:
            for s in saga.steps:
                for name in sorted(s.participants - set(self.participants)):
                    raise errors.DefinitionError(
                        f"saga {saga.name!r}, step {s.name!r}: unknown participant {name!r}"
                    )

    def __repr__(self) -> str:
        return f"App({self.name!r}, sagas={sorted(self.sagas)}, participants={sorted(self.participants)})"

    def saga(self, name: str) -> Saga[Any]:
        try:
            return self.sagas[name]
        except KeyError:
            known = ", ".join(sorted(self.sagas)) or "none"
            raise errors.UnknownSaga(
                f"unknown saga type {name!r} (this app has: {known})"
            ) from None

    def start(
        self,
        tx: Session | Connection,
        saga: Saga[Any] | str,
        data: BaseModel | dict[str, Any],
        *,
        saga_id: str | None = None,
        tenant_id: str | None = None,
    ) -> str:
        """Start a saga in the caller's transaction; returns its id. Nothing is sent before commit."""
        # By name: the app's own definition runs (a test harness may have wrapped its steps).
        definition = self.saga(saga if isinstance(saga, str) else saga.name)
        return self.orchestrator.start(
            db.connection_of(tx), definition, data, saga_id=saga_id, tenant_id=tenant_id
        )

    def participant_service(self, name: str) -> ParticipantService:
        return ParticipantService(self.participants[name], writer=self.writer, clock=self.clock)

    @property
    def reply_channels(self) -> list[str]:
        return sorted(saga.reply_channel for saga in self.sagas.values())

    @property
    def channels(self) -> list[str]:
        return sorted({*self.reply_channels, *(command_channel(p) for p in self.participants)})

    def create_tables(self, engine: Engine, participants: Sequence[str] | None = None) -> None:
        """The engine's tables plus the app's and participants' own (for demos and tests; a real
        service runs its own migrations)."""
        schema.metadata.create_all(engine)
        names = participants if participants is not None else list(self.participants)
        own = [self.participants[name].metadata for name in names]
        for md in [*self.metadata, *own]:
            if md is not None:
                md.create_all(engine)


def load(spec: str) -> App:
    """The App at ``module:attribute``, with one-line errors for every way that can go wrong."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise errors.ConfigurationError(
            f"--app {spec!r}: expected MODULE:OBJECT, e.g. sagas.app:app"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise errors.ConfigurationError(f"--app {spec!r}: no module named {error.name!r}") from None
    app = getattr(module, attribute, None)
    if not isinstance(app, App):
        raise errors.ConfigurationError(
            f"--app {spec!r}: {module_name}.{attribute} is {type(app).__name__}, not a saga_engine App"
        )
    return app
