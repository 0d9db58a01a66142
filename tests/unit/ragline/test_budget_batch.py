"""The client-side budget batcher against an in-process gRPC server that records what it
receives: calls made in one turn of the event loop travel as one Batch call, each caller
gets its own answer or its own error, identities and deadlines stay per caller."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ragline import deadlines
from ragline.budget import Amounts, BudgetRefused, TaskBudget
from ragline.budget_batch import BudgetCallBatcher, item_error
from ragline.clients import ChannelPool, ServiceClient
from ragline.errors import ResourceExhausted, to_rpc_status
from ragline.identity import Caller
from ragline.v1 import budget_pb2, budget_pb2_grpc


class RecordingBudget(budget_pb2_grpc.BudgetServiceServicer):
    """Answers reserves by id: `refuse-*` is BUDGET_EXHAUSTED, `slow-*` takes 0.5 s."""

    def __init__(self, *, batch: bool = True) -> None:
        self.batch = batch
        self.batches: list[tuple[str, list[str]]] = []  # (tenant, reservation ids)
        self.unary = 0
        self.settled: list[tuple[str, int]] = []  # (reservation id, calls used)

    async def _reserve(self, request) -> budget_pb2.ReserveResponse:
        if request.reservation_id.startswith("slow-"):
            await asyncio.sleep(0.5)
        if request.reservation_id.startswith("refuse-"):
            raise ResourceExhausted(
                f"task {request.task_id} budget cannot cover this reservation",
                reason="BUDGET_EXHAUSTED",
            )
        return budget_pb2.ReserveResponse(
            reservation=budget_pb2.Reservation(
                task_id=request.task_id, reservation_id=request.reservation_id
            )
        )

    async def Reserve(self, request, context):
        self.unary += 1
        try:
            return await self._reserve(request)
        except ResourceExhausted as error:  # as the server interceptor maps it
            await context.abort_with_status(rpc_status.to_status(to_rpc_status(error)[2]))

    async def Batch(self, request, context):
        if not self.batch:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        tenant = dict(context.invocation_metadata()).get("x-ragline-tenant", "")
        if request.items[0].HasField("settle"):
            for item in request.items:
                self.settled.append((item.settle.reservation_id, item.settle.actual.calls))
            return budget_pb2.BatchResponse(
                results=[budget_pb2.BatchResult(settle=budget_pb2.SettleResponse())]
                * len(request.items)
            )
        self.batches.append((tenant, [item.reserve.reservation_id for item in request.items]))

        async def one(item):
            try:
                return budget_pb2.BatchResult(reserve=await self._reserve(item.reserve))
            except ResourceExhausted as error:
                _, message, status = to_rpc_status(error)
                return budget_pb2.BatchResult(
                    error=budget_pb2.ItemStatus(
                        code=status.code, message=message, details=status.details
                    )
                )

        results = await asyncio.gather(*(one(item) for item in request.items))
        return budget_pb2.BatchResponse(results=results)


@pytest.fixture
async def server_and_client():
    servers, pools = [], []

    async def start(servicer: RecordingBudget, tenant: str = "acme"):
        server = grpc.aio.server()
        budget_pb2_grpc.add_BudgetServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        pool = ChannelPool()
        pools.append(pool)
        return ServiceClient(
            budget_pb2_grpc.BudgetServiceStub,
            f"127.0.0.1:{port}",
            pool=pool,
            caller=Caller(tenant),
        )

    yield start
    for pool in pools:
        await pool.close()
    for server in servers:
        await server.stop(None)


def reserve(rid: str) -> budget_pb2.ReserveRequest:
    return budget_pb2.ReserveRequest(
        task_id="t", reservation_id=rid, amounts=Amounts(calls=1).to_proto()
    )


async def test_calls_of_one_turn_share_one_batch_in_order(server_and_client):
    servicer = RecordingBudget()
    batcher = BudgetCallBatcher(await server_and_client(servicer))
    ids = [f"r{i}" for i in range(20)]
    replies = await asyncio.gather(*(batcher.call("Reserve", reserve(rid)) for rid in ids))
    assert [r.reservation.reservation_id for r in replies] == ids
    assert servicer.batches == [("acme", ids)]
    assert servicer.unary == 0
    # A lone call is sent on its own, without waiting for company.
    await batcher.call("Reserve", reserve("alone"))
    assert servicer.batches[-1] == ("acme", ["alone"])
    assert (batcher.batches_sent, batcher.items_sent) == (2, 21)


async def test_a_batch_never_exceeds_the_contract_cap(server_and_client):
    servicer = RecordingBudget()
    batcher = BudgetCallBatcher(await server_and_client(servicer))
    await asyncio.gather(*(batcher.call("Reserve", reserve(f"r{i}")) for i in range(100)))
    # Two batches, sent at once (which one arrives first is the transport's business).
    assert sorted(len(ids) for _, ids in servicer.batches) == [36, 64]
    sent = sorted((ids for _, ids in servicer.batches), key=len, reverse=True)
    assert sent[0] + sent[1] == [f"r{i}" for i in range(100)]


async def test_a_refused_item_raises_what_its_own_call_would(server_and_client):
    servicer = RecordingBudget()
    client = await server_and_client(servicer)
    batcher = BudgetCallBatcher(client)
    results = await asyncio.gather(
        batcher.call("Reserve", reserve("ok-1")),
        batcher.call("Reserve", reserve("refuse-1")),
        batcher.call("Reserve", reserve("ok-2")),
        return_exceptions=True,
    )
    assert len(servicer.batches) == 1
    assert results[0].reservation.reservation_id == "ok-1"
    assert results[2].reservation.reservation_id == "ok-2"
    batched = results[1]
    with pytest.raises(grpc.aio.AioRpcError) as direct:
        await client.unary("Reserve", reserve("refuse-1"))
    assert isinstance(batched, grpc.aio.AioRpcError)
    assert batched.code() == direct.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert batched.details() == direct.value.details()
    assert rpc_status.from_call(batched) == rpc_status.from_call(direct.value)
    info = error_details_pb2.ErrorInfo()
    rpc_status.from_call(batched).details[0].Unpack(info)
    assert info.reason == "BUDGET_EXHAUSTED"


async def test_task_budget_turns_a_batched_refusal_into_budget_refused(server_and_client):
    budget = TaskBudget(await server_and_client(RecordingBudget()), "t")
    assert budget.batcher is not None
    with pytest.raises(BudgetRefused, match="cannot cover"):
        await budget.reserve(Amounts(calls=1), reservation_id="refuse-2").open()


async def test_identities_are_never_mixed_in_one_batch(server_and_client):
    servicer = RecordingBudget()
    acme = BudgetCallBatcher(await server_and_client(servicer, "acme"))
    globex_client = await server_and_client(servicer, "globex")
    # Two clients aimed at one server: each batch carries one tenant's calls only.
    globex = BudgetCallBatcher(globex_client)
    await asyncio.gather(
        acme.call("Reserve", reserve("a1")),
        globex.call("Reserve", reserve("g1")),
        acme.call("Reserve", reserve("a2")),
    )
    assert sorted(servicer.batches) == [("acme", ["a1", "a2"]), ("globex", ["g1"])]


async def test_each_caller_keeps_its_own_deadline(server_and_client):
    servicer = RecordingBudget()
    batcher = BudgetCallBatcher(await server_and_client(servicer))

    async def hurried():
        with deadlines.deadline_scope(0.1):
            return await batcher.call("Reserve", reserve("slow-hurried"))

    async def patient():
        with deadlines.deadline_scope(5.0):
            return await batcher.call("Reserve", reserve("slow-patient"))

    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(hurried(), patient(), return_exceptions=True)
    assert isinstance(results[0], grpc.aio.AioRpcError)
    assert results[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The short deadline did not cut the batch short for the patient caller.
    assert results[1].reservation.reservation_id == "slow-patient"
    assert len(servicer.batches) == 1
    assert asyncio.get_running_loop().time() - started >= 0.5
    # The hurried caller's reservation was granted after it left: released, with no use.
    for _ in range(100):
        if batcher.released:
            break
        await asyncio.sleep(0.01)
    assert servicer.settled == [("slow-hurried", 0)]
    assert batcher.released == 1


async def test_a_cancelled_caller_s_granted_reservation_is_released(server_and_client):
    servicer = RecordingBudget()
    batcher = BudgetCallBatcher(await server_and_client(servicer))
    leaving = asyncio.ensure_future(batcher.call("Reserve", reserve("slow-leaving")))
    staying = asyncio.ensure_future(batcher.call("Reserve", reserve("slow-staying")))
    await asyncio.sleep(0.1)  # both sent, in one batch
    leaving.cancel()
    assert (await staying).reservation.reservation_id == "slow-staying"
    for _ in range(100):
        if batcher.released:
            break
        await asyncio.sleep(0.01)
    assert servicer.settled == [("slow-leaving", 0)]


async def test_a_server_without_batch_is_called_one_call_at_a_time(server_and_client):
    servicer = RecordingBudget(batch=False)
    batcher = BudgetCallBatcher(await server_and_client(servicer))
    replies = await asyncio.gather(*(batcher.call("Reserve", reserve(f"r{i}")) for i in range(3)))
    assert [r.reservation.reservation_id for r in replies] == ["r0", "r1", "r2"]
    assert batcher.unbatched and servicer.unary == 3
    await batcher.call("Reserve", reserve("later"))
    assert servicer.unary == 4


def test_item_error_parses_as_google_rpc_status():
    _, message, status = to_rpc_status(ResourceExhausted("full", retry_after_s=0.2))
    error = item_error(
        budget_pb2.ItemStatus(code=status.code, message=message, details=status.details)
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rpc_status.from_call(error) == status
