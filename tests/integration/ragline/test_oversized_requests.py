"""A caller without a credential cannot make a service read, parse or hold a large body:
authentication runs on the call's metadata before the body is read, and each service's
transport cap is sized to its contract (docs/security.md, "Memory bound")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from ragline.auth import mint_token
from ragline.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from ragline_app.stack import health_status_sync
from support import AUTH_CLIENT_KEY, AUTH_ENV

pytestmark = pytest.mark.integration

MiB = 1 << 20
# Nothing listens there: the orchestrator is refused before it calls anyone.
NOWHERE = {
    f"RAGLINE_{name}_ADDR": "127.0.0.1:9"
    for name in ("EMBEDDING", "RETRIEVAL", "RERANK", "GENERATION", "BUDGET")
}
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def ask_many(address: str, request, count: int, metadata=()) -> list[grpc.StatusCode]:
    async with grpc.aio.insecure_channel(address, options=UNLIMITED) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        async def one() -> grpc.StatusCode:
            try:
                async for _ in stub.Ask(request, timeout=60, metadata=metadata):
                    pass
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        return await asyncio.gather(*(one() for _ in range(count)))


@pytest.mark.parametrize("cap", ["default", "64 MiB"])
async def test_unauthenticated_60_mib_asks_are_refused_before_they_are_read(launcher, cap):
    """Eight 60 MiB asks at once without a credential: each UNAUTHENTICATED, the process's
    peak memory grows by less than one of them, and it keeps serving; even with the old
    64 MiB transport cap, which alone would have let every one in to be parsed."""
    env = {**AUTH_ENV, **NOWHERE}
    if cap != "default":
        env["RAGLINE_ORCHESTRATOR_MAX_MESSAGE_BYTES"] = str(64 * MiB)
        env["RAGLINE_ORCHESTRATOR_MAX_REQUEST_BYTES"] = str(64 * MiB)
    orchestrator = await asyncio.to_thread(launcher.start, "orchestrator", env)
    before = peak_rss(orchestrator.process.pid)
    huge = orchestrator_pb2.AskRequest(question="x" * (60 * MiB))
    codes = await ask_many(orchestrator.address, huge, 8, (("x-ragline-tenant", "acme"),))
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    grew = peak_rss(orchestrator.process.pid) - before
    assert grew < 160 * MiB, f"peak memory grew by {grew / MiB:.0f} MiB"
    assert health_status_sync(orchestrator.address) == "SERVING"


async def test_an_authenticated_ask_over_the_contract_is_refused_by_its_size(launcher):
    orchestrator = await asyncio.to_thread(launcher.start, "orchestrator", {**AUTH_ENV, **NOWHERE})
    token = mint_token(AUTH_CLIENT_KEY, "acme")
    big = orchestrator_pb2.AskRequest(question="x" * (2 * MiB))
    codes = await ask_many(orchestrator.address, big, 1, (("authorization", f"Bearer {token}"),))
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED]
