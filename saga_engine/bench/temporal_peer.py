"""The peer: the order saga on Temporal's Python SDK, run by ``saga-engine bench saga --peer temporal``.

The same workflow as the shared peer script ``peers/temporal_order_saga.py``, typed: create order,
reserve inventory, charge payment (declined for every tenth order), approve; on failure the
completed steps are compensated in reverse. Same activity options (10 s start-to-close, one
attempt), same worker concurrency (200 activities, 200 workflow tasks), same output line, so
either script can be passed to the bench. Runs as a script in its own process:

    python -m saga_engine.bench.temporal_peer N HOST:PORT
"""
# temporalio is an optional dependency (the ``bench`` extra); without it this module is never
# imported, and mypy must not fail on a machine that lacks it.
# mypy: disable-error-code="import-not-found, untyped-decorator, misc, no-any-return, unused-ignore"

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import Worker


@activity.defn
async def create_order(order_id: str) -> str:
    return order_id


@activity.defn
async def reserve_inventory(order_id: str) -> str:
    return order_id


@activity.defn
async def release_inventory(order_id: str) -> str:
    return order_id


@activity.defn
async def charge_payment(order_id: str) -> str:
    if order_id.endswith("f"):
        raise RuntimeError("card declined")
    return order_id


@activity.defn
async def cancel_order(order_id: str) -> str:
    return order_id


@activity.defn
async def approve_order(order_id: str) -> str:
    return order_id


Activity = Callable[[str], Awaitable[str]]
TIMEOUT = timedelta(seconds=10)
ONCE = RetryPolicy(maximum_attempts=1)


@workflow.defn
class OrderSaga:
    @workflow.run
    async def run(self, order_id: str) -> str:
        compensations: list[Activity] = []
        try:
            await self.step(create_order, order_id)
            compensations.append(cancel_order)
            await self.step(reserve_inventory, order_id)
            compensations.append(release_inventory)
            await self.step(charge_payment, order_id)
            await self.step(approve_order, order_id)
            return "COMPLETED"
        except Exception:
            for compensation in reversed(compensations):
                await self.step(compensation, order_id)
            return "COMPENSATED"

    @staticmethod
    async def step(function: Activity, order_id: str) -> str:
        return await workflow.execute_activity(
            function, order_id, start_to_close_timeout=TIMEOUT, retry_policy=ONCE
        )


async def main(n: int, address: str) -> None:
    client = await Client.connect(address)
    queue = "bench-" + uuid.uuid4().hex[:6]
    activities = [
        create_order,
        reserve_inventory,
        release_inventory,
        charge_payment,
        cancel_order,
        approve_order,
    ]
    async with Worker(
        client,
        task_queue=queue,
        workflows=[OrderSaga],
        activities=activities,
        max_concurrent_activities=200,
        max_concurrent_workflow_tasks=200,
    ):
        started = time.time()
        ids = [uuid.uuid4().hex[:-1] + ("f" if i % 10 == 0 else "a") for i in range(n)]
        handles = await asyncio.gather(
            *[client.start_workflow(OrderSaga.run, i, id=i, task_queue=queue) for i in ids]
        )
        results = await asyncio.gather(*[handle.result() for handle in handles])
        elapsed = time.time() - started
    compensated = results.count("COMPENSATED")
    print(
        f"temporal: {n} sagas ({compensated} compensated) in {elapsed:.2f}s = {n / elapsed:.1f} sagas/s"
    )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1:17233"))
    # The run is over and printed. temporalio's core threads can abort the interpreter while it
    # finalizes ("Fatal Python error: PyGILState_Release", status -6, seen once in a bench run),
    # which would fail the bench after the fact; so skip finalization.
    sys.stdout.flush()
    os._exit(0)
