"""The example application: both sagas and every service, in one place.

    saga-engine worker --app sagas.app:app --db sqlite:///shop.sqlite3

:func:`build_app` makes another one with other settings (the demo and the tests poll more
often than a production worker needs to).
"""

from __future__ import annotations

from saga_engine.app import App
from saga_engine.consumer import ConsumerConfig
from saga_engine.outbox.relay import RelayConfig
from sagas import money_transfer, order_fulfilment
from sagas.services import inventory, ledger, loyalty, notifications, payee_bank, payment


def build_app(*, relay: RelayConfig | None = None, consumer: ConsumerConfig | None = None) -> App:
    return App(
        "shop",
        sagas=[order_fulfilment.order_fulfilment, money_transfer.money_transfer],
        participants=[
            inventory.service,
            payment.service,
            loyalty.service,
            ledger.service,
            payee_bank.service,
            notifications.service,
        ],
        # The orchestrator's own tables (the order service's); each participant brings its own.
        metadata=[order_fulfilment.metadata],
        relay=relay,
        consumer=consumer,
    )


app = build_app()
