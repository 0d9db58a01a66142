"""One process of the budget hammer: N concurrent workers reserving against one task.

Run by tests/integration/test_budget.py (and usable by hand):
    python budget_hammer.py ADDRESS TENANT TASK_ID WORKERS SECONDS SEED [unary|batched]
`batched` sends through the kit's BudgetCallBatcher (Batch calls) instead of a call each.
Prints one JSON object: every grant's ledger view and the use this process settled.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import grpc

from ragline.budget import AMOUNT_FIELDS
from ragline.budget_batch import BudgetCallBatcher
from ragline.clients import ChannelPool, ServiceClient
from ragline.identity import Caller
from ragline.v1 import budget_pb2, budget_pb2_grpc, common_pb2


async def worker(stub, tenant, task_id, seconds, rng, prefix, results):
    metadata = (("x-ragline-tenant", tenant),)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        rid = f"{prefix}-{n}"
        amounts = common_pb2.BudgetAmounts(
            input_tokens=rng.randint(1, 40), output_tokens=rng.randint(1, 20), calls=1
        )
        try:
            reply = await stub.Reserve(
                budget_pb2.ReserveRequest(task_id=task_id, reservation_id=rid, amounts=amounts),
                timeout=10,
                metadata=metadata,
            )
        except grpc.aio.AioRpcError as error:
            results["refusals"][error.code().name] = (
                results["refusals"].get(error.code().name, 0) + 1
            )
            await asyncio.sleep(0.001)
            continue
        ledger = reply.ledger
        results["grants"].append(
            {
                "attempts": reply.attempts,
                "committed": {
                    f: getattr(ledger.reserved, f)
                    + getattr(ledger.pending, f)
                    + getattr(ledger.used, f)
                    for f in AMOUNT_FIELDS
                },
            }
        )
        actual = common_pb2.BudgetAmounts(
            input_tokens=rng.randint(0, amounts.input_tokens),
            output_tokens=rng.randint(0, amounts.output_tokens),
            calls=1,
        )
        if rng.random() < 0.2:
            await stub.Cancel(
                budget_pb2.CancelRequest(task_id=task_id, reservation_id=rid, reason="test"),
                timeout=10,
                metadata=metadata,
            )
        settled = await stub.Settle(
            budget_pb2.SettleRequest(task_id=task_id, reservation_id=rid, actual=actual),
            timeout=10,
            metadata=metadata,
        )
        results["settle_attempts"].append(settled.attempts)
        for f in AMOUNT_FIELDS:
            results["used"][f] += getattr(actual, f)


class BatchedStub:
    """The stub's Reserve / Settle / Cancel, sent through a BudgetCallBatcher."""

    def __init__(self, batcher: BudgetCallBatcher) -> None:
        self.batcher = batcher

    def __getattr__(self, method):
        return lambda request, **_: self.batcher.call(method, request)


async def main(address, tenant, task_id, workers, seconds, seed, client="unary"):
    results = {
        "grants": [],
        "refusals": {},
        "used": dict.fromkeys(AMOUNT_FIELDS, 0),
        "settle_attempts": [],
    }
    pool = ChannelPool()
    batcher = BudgetCallBatcher(
        ServiceClient(budget_pb2_grpc.BudgetServiceStub, address, pool=pool, caller=Caller(tenant))
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = budget_pb2_grpc.BudgetServiceStub(channel)
        if client == "batched":
            stub = BatchedStub(batcher)
        await asyncio.gather(
            *(
                worker(
                    stub,
                    tenant,
                    task_id,
                    seconds,
                    random.Random(seed * 1000 + i),
                    f"p{seed}w{i}",
                    results,
                )
                for i in range(workers)
            )
        )
    await pool.close()
    results["batches"], results["batched_items"] = batcher.batches_sent, batcher.items_sent
    print(json.dumps(results))


if __name__ == "__main__":
    address, tenant, task_id, workers, seconds, seed = sys.argv[1:7]
    client = sys.argv[7] if len(sys.argv) > 7 else "unary"
    asyncio.run(main(address, tenant, task_id, int(workers), float(seconds), int(seed), client))
