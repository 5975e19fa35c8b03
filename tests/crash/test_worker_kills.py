"""kill -9, for real: ``saga-engine worker`` processes run the order saga on PostgreSQL and a
Kafka-protocol broker while orders keep coming, and every few seconds one of them is SIGKILLed
(no signal handler, no cleanup, no goodbye to the consumer group) and a new one is started.

Afterwards every saga has ended as planned (the injected failures COMPENSATED, all others
COMPLETED), the business invariants hold (charged once, points once, stock balanced), no command
was handled twice in effect (one reply per command) and nothing went to the dead letters.

The redeliveries the kills cause are counted (``inbox_duplicates``) and reported, not asserted: a
kill inside a consumer's transaction is rolled back and its batch applied again as if for the
first time, so only a kill in the short moments between a local commit and the broker commit
(consumers) or between publish and mark (relays) leaves a duplicate, and six kills need not.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine

from saga_engine.testing.tansu import TansuBroker
from tests.crash import support

pytestmark = [pytest.mark.crash, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]

WORKERS = 3
ORDERS = 400
BATCHES = 16  # orders are placed in this many transactions, one every PLACE_EVERY seconds
PLACE_EVERY = 1.7
KILLS = 6  # each a moment after a batch was placed, while the workers are busy with it
FAIL_RATE = 0.15
DRAIN_TIMEOUT = 120.0


@pytest.mark.timeout(300)
def test_sigkilled_workers_lose_nothing_and_apply_nothing_twice(
    shop_engine: Engine, pg_url: str, broker: TansuBroker, logs: Path
) -> None:
    rng = random.Random()
    support.seed(shop_engine, ORDERS)
    orders = support.Orders(support.failure_plan(ORDERS, FAIL_RATE, rng))
    began = time.monotonic()

    with support.fleet(pg_url, support.kafka_url(broker.bootstrap), logs) as workers:
        for _ in range(WORKERS):
            workers.spawn()
        kill_after = set(rng.sample(range(1, BATCHES), KILLS))
        per_batch = -(-ORDERS // BATCHES)
        chaos = time.monotonic()
        for batch in range(BATCHES):
            _sleep_until(chaos + 4.0 + batch * PLACE_EVERY, workers)  # the first after the joins
            orders.place(shop_engine, len(orders.placed), per_batch)
            if batch in kill_after:
                # The commit woke the relays (NOTIFY); a moment later they publish the batch and
                # the consumers apply it: that is when a kill leaves the most behind.
                time.sleep(rng.uniform(0.05, 0.6))
                workers.kill_one(rng)
                workers.spawn()
        chaos_s = time.monotonic() - chaos
        assert len(orders.placed) == ORDERS

        drained = time.monotonic()
        all_ended = support.wait_until_all_ended(
            shop_engine, ORDERS, DRAIN_TIMEOUT, check=lambda: _still_running(workers)
        )
        drain_s = time.monotonic() - drained
        exits = workers.stop()

    result = support.figures(
        shop_engine,
        orders,
        workers=WORKERS,
        processes_started=len(workers.workers),
        kills=workers.kills,
        chaos_s=round(chaos_s, 1),
        drain_after_chaos_s=round(drain_s, 1) if all_ended else None,
        wall_s=round(time.monotonic() - began, 1),
    )
    support.report("worker_kills", result)
    assert all_ended, f"{drain_s:.0f} s after the chaos: {support.why_not_ended(shop_engine)}"
    assert exits == [0] * len(exits), f"graceful stop after SIGTERM: {exits}"
    assert workers.problems_in_logs() == []
    assert support.outcome_problems(shop_engine, orders) == []
    assert support.effects_applied_twice(shop_engine) == []
    assert result["dead_letters"] == 0


def _sleep_until(moment: float, workers: support.Fleet) -> None:
    while time.monotonic() < moment:
        _still_running(workers)
        time.sleep(0.05)


def _still_running(workers: support.Fleet) -> None:
    died = workers.died_by_themselves()
    assert not died, "\n".join(died)
