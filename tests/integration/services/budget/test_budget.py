"""The budget ledger against a real etcd, through real budget-service processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import pytest
from grpc_status import rpc_status

from ragline.budget import AMOUNT_FIELDS, Amounts, BudgetRefused, TaskBudget
from ragline.budget_batch import item_error
from ragline.clients import ChannelPool, ServiceClient
from ragline.identity import Caller
from ragline.v1 import budget_pb2, budget_pb2_grpc, common_pb2
from ragline_app.stack import health_status
from support import error_info, retry_delay
from support.budget import BUDGET_HAMMER, Api, budget_env, new_id

pytestmark = pytest.mark.integration


async def test_600_and_500_against_1000_exactly_one_is_granted(api):
    task = new_id()
    await api.open(task, output_tokens=1000)
    results = await asyncio.gather(
        api.reserve(task, "a", output_tokens=600),
        api.reserve(task, "b", output_tokens=500),
        return_exceptions=True,
    )
    granted = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(granted) == 1 and len(refused) == 1
    assert refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    remaining = 1000 - granted[0].reservation.amounts.output_tokens
    assert f"output_tokens={remaining}" in refused[0].details()
    ledger = await api.ledger(task)
    assert ledger.reserved.output_tokens + ledger.remaining.output_tokens == 1000


def test_64_workers_in_4_processes_never_overspend(budget, etcd, launcher):
    # Two budget-service replicas on the same etcd: only the etcd guard can keep them honest.
    # One client process of each pair sends Batch calls (the kit's batcher), the other a
    # call per request: both paths share the one ledger.
    replica = launcher.start("budget", env=budget_env(etcd))
    tenant, task = new_id("tenant"), new_id()
    limits = {"input_tokens": 3000, "output_tokens": 1500, "calls": 200}

    async def open_task():
        async with grpc.aio.insecure_channel(budget.address) as channel:
            await Api(channel, tenant).open(task, **limits)

    asyncio.run(open_task())
    addresses = [budget.address, replica.address, budget.address, replica.address]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(BUDGET_HAMMER),
                address,
                tenant,
                task,
                "16",
                "4",
                str(seed),
                "batched" if seed % 2 else "unary",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed, address in enumerate(addresses)
    ]
    reports = []
    for process in processes:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        reports.append(json.loads(out))

    grants = [g for r in reports for g in r["grants"]]
    assert len(grants) > 50, "the hammer made too few grants to prove anything"
    batched = [r for r in reports if r["batches"]]
    assert len(batched) == 2, "the batched hammers sent no Batch call"
    assert sum(r["batched_items"] for r in batched) > sum(r["batches"] for r in batched)
    assert any(r["refusals"].get("RESOURCE_EXHAUSTED") for r in reports), "budget never ran out"
    for grant in grants:  # every intermediate view right after a grant
        for field in AMOUNT_FIELDS:
            assert grant["committed"][field] <= limits.get(field, 0), grant

    async def final_ledger():
        async with grpc.aio.insecure_channel(budget.address) as channel:
            return await Api(channel, tenant).ledger(task, include_reservations=True)

    ledger = asyncio.run(final_ledger())
    settled_use = {f: sum(r["used"][f] for r in reports) for f in AMOUNT_FIELDS}
    assert Amounts.from_proto(ledger.used) == Amounts(**settled_use)
    assert Amounts.from_proto(ledger.reserved).is_zero()
    assert Amounts.from_proto(ledger.pending).is_zero()
    assert Amounts.from_proto(ledger.used).fits_within(Amounts(**limits))
    assert ledger.in_flight == 0
    assert len(ledger.reservations) == len(grants)
    assert {r.state for r in ledger.reservations} == {budget_pb2.RESERVATION_STATE_SETTLED}


async def test_a_write_that_keeps_losing_to_other_replicas_is_aborted_conflict(etcd, launcher):
    """Two replicas on one task, each write allowed one transaction
    (RAGLINE_BUDGET_MAX_CONFLICT_ATTEMPTS=1): a write whose transaction another replica's
    beat ends ABORTED with reason CONFLICT, charged nothing, and retrying it with the same
    id is granted once."""
    env = budget_env(etcd, RAGLINE_BUDGET_MAX_CONFLICT_ATTEMPTS="1")
    replicas = [launcher.start("budget", env=env) for _ in range(2)]
    tenant, task = new_id("tenant"), new_id()
    channels = [grpc.aio.insecure_channel(r.address) for r in replicas]
    apis = [Api(channel, tenant) for channel in channels]
    await apis[0].open(task, calls=1000)

    async def reserve(number: int):
        rid = f"r{number}"
        try:
            await apis[number % 2].reserve(task, rid, calls=1)
            return rid, None
        except grpc.aio.AioRpcError as error:
            return rid, error

    outcomes = await asyncio.gather(*(reserve(n) for n in range(64)))
    aborted = [(rid, e) for rid, e in outcomes if e is not None]
    assert aborted, "no write lost a transaction to the other replica"
    assert {(e.code(), error_info(e)[0]) for _, e in aborted} == {
        (grpc.StatusCode.ABORTED, "CONFLICT")
    }
    assert all(retry_delay(e) > 0 for _, e in aborted)  # retried by the kit's rule
    ledger = await apis[0].ledger(task)
    assert ledger.reserved.calls == 64 - len(aborted)  # an aborted write charged nothing
    for rid, _ in aborted:  # retried with the same id: granted once
        await apis[1].reserve(task, rid, calls=1)
    assert (await apis[0].ledger(task)).reserved.calls == 64
    for channel in channels:
        await channel.close()


async def test_replay_is_not_charged_twice_and_other_amounts_are_refused(api):
    task = new_id()
    await api.open(task, input_tokens=100, calls=10)
    first = await api.reserve(task, "r1", input_tokens=30, calls=1)
    again = await api.reserve(task, "r1", input_tokens=30, calls=1)
    assert (first.replayed, again.replayed) == (False, True)
    assert again.reservation == first.reservation
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.reserve(task, "r1", input_tokens=50, calls=1)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error_info(caught.value)[0] == "ALREADY_EXISTS"
    ledger = await api.ledger(task)
    assert (ledger.reserved.input_tokens, ledger.reserved.calls) == (30, 1)

    settled = await api.settle(task, "r1", input_tokens=20, calls=1)
    replay = await api.settle(task, "r1", input_tokens=20, calls=1)
    assert (settled.replayed, replay.replayed) == (False, True)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.settle(task, "r1", input_tokens=25, calls=1)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    ledger = await api.ledger(task)
    assert ledger.used.input_tokens == 20 and ledger.reserved.input_tokens == 0


async def test_retry_after_a_lost_response_is_not_double_charged(api, budget):
    task = new_id()
    await api.open(task, output_tokens=10_000)
    for i in range(20):
        rid = f"lost-{i}"
        call = api.stub.Reserve(
            budget_pb2.ReserveRequest(
                task_id=task, reservation_id=rid, amounts=common_pb2.BudgetAmounts(output_tokens=7)
            ),
            timeout=10,
            metadata=api.metadata,
        )
        await asyncio.sleep(0.0005 * i)  # cut the first attempt at varying points
        call.cancel()
        retry = await api.reserve(task, rid, output_tokens=7)
        assert retry.reservation.amounts.output_tokens == 7
    ledger = await api.ledger(task, include_reservations=True)
    assert ledger.reserved.output_tokens == 20 * 7
    assert len(ledger.reservations) == 20


async def test_cancel_leaves_pending_until_settled(api):
    task = new_id()
    await api.open(task, output_tokens=100)
    await api.reserve(task, "r", output_tokens=60)
    cancelled = await api.cancel(task, "r")
    assert cancelled.reservation.state == budget_pb2.RESERVATION_STATE_PENDING
    assert (cancelled.ledger.pending.output_tokens, cancelled.ledger.reserved.output_tokens) == (
        60,
        0,
    )
    # pending still holds its amounts: 50 more cannot fit
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.reserve(task, "r2", output_tokens=50)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await api.cancel(task, "r")).replayed
    settled = await api.settle(task, "r", output_tokens=12)
    assert settled.reservation.state == budget_pb2.RESERVATION_STATE_SETTLED
    assert settled.ledger.pending.output_tokens == 0
    assert settled.ledger.used.output_tokens == 12
    assert settled.ledger.remaining.output_tokens == 88


async def test_failed_calls_are_charged_and_overuse_is_bounded(api):
    task = new_id()
    await api.open(task, output_tokens=100, calls=5)
    await api.reserve(task, "r", output_tokens=10, calls=1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.settle(task, "r", output_tokens=200, calls=1)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    settled = await api.settle(task, "r", failed=True, output_tokens=30, calls=1)  # within left
    assert settled.reservation.failed
    assert settled.ledger.used.output_tokens == 30


async def test_in_flight_cap(api):
    task = new_id()
    await api.open(task, calls=10, max_in_flight=2)
    await api.reserve(task, "a", calls=1)
    await api.reserve(task, "b", calls=1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.reserve(task, "c", calls=1)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "in flight" in caught.value.details()
    assert error_info(caught.value)[0] == "TOO_MANY_IN_FLIGHT"
    assert retry_delay(caught.value) > 0  # curable: settle one, then retry
    await api.settle(task, "a", calls=1)
    await api.reserve(task, "c", calls=1)


async def test_open_is_idempotent_and_close_stops_reservations(api):
    task = new_id()
    first = await api.open(task, calls=3)
    again = await api.open(task, calls=3)
    assert (first.created, again.created) == (True, False)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.open(task, calls=4)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await api.reserve(task, "before", calls=1)
    closed = await api.stub.CloseTask(
        budget_pb2.CloseTaskRequest(task_id=task), timeout=10, metadata=api.metadata
    )
    assert closed.ledger.state == budget_pb2.TASK_STATE_CLOSED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.reserve(task, "after", calls=1)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(caught.value)[0] == "TASK_CLOSED"
    await api.settle(task, "before", calls=1)  # late settlement still lands


async def test_deadline_refuses_and_the_lease_removes_every_key(api, etcd):
    import etcd3aio

    task = new_id()
    await api.open(task, timeout_s=0.5, calls=5)
    await api.reserve(task, "r", calls=1)
    await asyncio.sleep(0.6)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.reserve(task, "late", calls=1)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await api.ledger(task)).state == budget_pb2.TASK_STATE_EXPIRED

    tenant = api.metadata[0][1]
    prefix = f"/ragline/budget/v1/{tenant}/{task}/".encode()
    async with etcd3aio.Etcd3Client([etcd.endpoint]) as client:
        assert (await client.kv.get(prefix, range_end=etcd3aio.prefix_range_end(prefix))).count == 2
        deadline = time.monotonic() + 15  # lease TTL = 0.5 s + 1 s grace, rounded up
        while time.monotonic() < deadline:
            reply = await client.kv.get(prefix, range_end=etcd3aio.prefix_range_end(prefix))
            if reply.count == 0:
                break
            await asyncio.sleep(0.25)
        assert reply.count == 0, "the task's lease did not remove its keys"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.ledger(task)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(caught.value)[0] == "NOT_FOUND"


async def test_tenants_are_isolated_and_a_tenant_is_required(budget):
    async with grpc.aio.insecure_channel(budget.address) as channel:
        alice, bob = Api(channel, new_id("alice")), Api(channel, new_id("bob"))
        task = new_id()
        await alice.open(task, calls=1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await bob.ledger(task)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await bob.reserve(task, "x", calls=1)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        anonymous = budget_pb2_grpc.BudgetServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await anonymous.GetLedger(budget_pb2.GetLedgerRequest(task_id=task), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_bad_input_names_the_field(api):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.reserve("t/../x", "r", calls=1)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("task_id:")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.stub.OpenTask(
            budget_pb2.OpenTaskRequest(task_id="t"), timeout=10, metadata=api.metadata
        )
    assert "limits: is required" in caught.value.details()


def _reserve_item(task, rid, **amounts):
    return budget_pb2.BatchItem(
        reserve=budget_pb2.ReserveRequest(
            task_id=task, reservation_id=rid, amounts=common_pb2.BudgetAmounts(**amounts)
        )
    )


async def test_batch_answers_each_item_as_its_own_call_would(api):
    task = new_id()
    await api.open(task, output_tokens=100, calls=10)
    reply = await api.stub.Batch(
        budget_pb2.BatchRequest(
            items=[
                _reserve_item(task, "a", output_tokens=60, calls=1),
                _reserve_item(task, "b", output_tokens=60, calls=1),  # 40 left: refused
                budget_pb2.BatchItem(
                    settle=budget_pb2.SettleRequest(task_id=task, reservation_id="never")
                ),
                _reserve_item(task, "a", output_tokens=60, calls=1),  # a replay
                _reserve_item(task, "bad/id", calls=1),
            ]
        ),
        timeout=10,
        metadata=api.metadata,
    )
    kinds = [r.WhichOneof("result") for r in reply.results]
    assert kinds == ["reserve", "error", "error", "reserve", "error"]
    assert reply.results[0].reserve.reservation.reservation_id == "a"
    assert reply.results[3].reserve.replayed
    codes = [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND]
    codes.append(grpc.StatusCode.INVALID_ARGUMENT)
    errors = [item_error(reply.results[i].error) for i in (1, 2, 4)]
    assert [e.code() for e in errors] == codes
    # The same refusal, asked as a call of its own: same code, message and details.
    with pytest.raises(grpc.aio.AioRpcError) as direct:
        await api.reserve(task, "b", output_tokens=60, calls=1)
    assert errors[0].details() == direct.value.details()
    assert rpc_status.from_call(errors[0]) == rpc_status.from_call(direct.value)
    ledger = await api.ledger(task)
    assert ledger.reserved.output_tokens == 60 and ledger.in_flight == 1


async def test_batch_refuses_a_malformed_item_naming_it_and_keeps_tenants_apart(api, budget):
    task = new_id()
    await api.open(task, calls=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.stub.Batch(
            budget_pb2.BatchRequest(
                items=[_reserve_item(task, "ok", calls=1), _reserve_item("", "r", calls=1)]
            ),
            timeout=10,
            metadata=api.metadata,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[1].reserve.task_id" in caught.value.details()
    assert (await api.ledger(task)).in_flight == 0  # nothing of the batch was applied
    async with grpc.aio.insecure_channel(budget.address) as channel:
        other = Api(channel, new_id("tenant"))
        reply = await other.stub.Batch(
            budget_pb2.BatchRequest(items=[_reserve_item(task, "theirs", calls=1)]),
            timeout=10,
            metadata=other.metadata,
        )
    assert item_error(reply.results[0].error).code() == grpc.StatusCode.NOT_FOUND
    assert (await api.ledger(task)).in_flight == 0


async def test_client_helper_settles_on_success_failure_and_cancellation(budget):
    tenant = new_id("tenant")
    pool = ChannelPool()
    client = ServiceClient(
        budget_pb2_grpc.BudgetServiceStub, budget.address, pool=pool, caller=Caller(tenant)
    )
    api = Api(pool.get(budget.address), tenant)
    task = new_id()
    await api.open(task, output_tokens=100, calls=10)
    ledger = TaskBudget(client, task)

    async with ledger.reserve(Amounts(output_tokens=20, calls=1), stage="generate") as r:
        r.settle(Amounts(output_tokens=7, calls=1))
    assert r.final.reservation.state == budget_pb2.RESERVATION_STATE_SETTLED

    with pytest.raises(RuntimeError):
        async with ledger.reserve(Amounts(output_tokens=10, calls=1), stage="rerank") as failing:
            raise RuntimeError("model crashed")
    assert failing.final.reservation.failed
    assert failing.final.reservation.actual.output_tokens == 10  # nothing reported: all of it

    started = asyncio.Event()

    async def long_call():
        async with ledger.reserve(Amounts(output_tokens=30, calls=1)) as cancelled:
            cancelled.settle(Amounts(output_tokens=4, calls=1))  # partial use so far
            started.set()
            await asyncio.sleep(30)

    job = asyncio.create_task(long_call())
    await started.wait()
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job

    with pytest.raises(BudgetRefused, match="remaining"):
        async with ledger.reserve(Amounts(output_tokens=500, calls=1)):
            pass

    final = await api.ledger(task, include_reservations=True)
    assert final.used.output_tokens == 7 + 10 + 4
    assert final.used.calls == 3
    assert final.reserved.output_tokens == 0 and final.pending.output_tokens == 0
    assert [r.stage for r in final.reservations] == ["generate", "rerank", ""]
    await pool.close()


def test_etcd_outage_is_unavailable_and_the_ledger_survives(own_etcd, launcher):
    handle = launcher.start("budget", env=budget_env(own_etcd))
    tenant, task = new_id("tenant"), new_id()

    async def before():
        async with grpc.aio.insecure_channel(handle.address) as channel:
            api = Api(channel, tenant)
            await api.open(task, output_tokens=1000, calls=10)
            await api.reserve(task, "r1", output_tokens=100, calls=1)
            await api.settle(task, "r1", output_tokens=40, calls=1)
            await api.reserve(task, "r2", output_tokens=200, calls=1)
            return await api.ledger(task, include_reservations=True)

    snapshot = asyncio.run(before())
    own_etcd.stop()

    async def during():
        async with grpc.aio.insecure_channel(handle.address) as channel:
            api = Api(channel, tenant)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await api.reserve(task, "r3", output_tokens=1, calls=1)
            elapsed = time.monotonic() - started
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "etcd" in caught.value.details()
            assert error_info(caught.value)[0] == "LEDGER_STORE_UNAVAILABLE"
            assert retry_delay(caught.value) > 0
            assert elapsed < 5.0
            deadline = time.monotonic() + 10
            while await health_status(handle.address) != "NOT_SERVING":
                assert time.monotonic() < deadline, "health never reported etcd's outage"
                await asyncio.sleep(0.1)
            # ... while the liveness probe's answer stays SERVING: no restart for etcd's outage
            assert await health_status(handle.address, service="liveness") == "SERVING"

    asyncio.run(during())
    own_etcd.start()

    async def after():
        deadline = time.monotonic() + 10
        while await health_status(handle.address) != "SERVING":
            assert time.monotonic() < deadline, "health never saw etcd come back"
            await asyncio.sleep(0.1)
        async with grpc.aio.insecure_channel(handle.address) as channel:
            api = Api(channel, tenant)
            assert await api.ledger(task, include_reservations=True) == snapshot
            granted = await api.reserve(task, "r3", output_tokens=1, calls=1)
            assert granted.ledger.reserved.output_tokens == 201

    asyncio.run(after())


def test_budget_service_restart_loses_nothing(etcd, launcher):
    env = budget_env(etcd)
    first = launcher.start("budget", env=env)
    tenant, task = new_id("tenant"), new_id()

    async def write():
        async with grpc.aio.insecure_channel(first.address) as channel:
            api = Api(channel, tenant)
            await api.open(task, input_tokens=500, calls=5)
            await api.reserve(task, "r", input_tokens=123, calls=1)
            return await api.ledger(task, include_reservations=True)

    snapshot = asyncio.run(write())
    assert first.stop() == 0
    second = launcher.start("budget", env=env)

    async def read():
        async with grpc.aio.insecure_channel(second.address) as channel:
            return await Api(channel, tenant).ledger(task, include_reservations=True)

    assert asyncio.run(read()) == snapshot
