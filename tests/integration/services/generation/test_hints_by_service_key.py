"""A scheduling hint believed from the orchestrator's own key only, on a real generation
service with per-service keys: a request marked `light_tenant` with retrieval's
credential runs like any other (the flood beside it goes on), the same request with the
orchestrator's pauses the flood; a credential signed with a key the service does not
hold is UNAUTHENTICATED."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ragline.auth import AuthConfig, ServiceCredential
from ragline.processes import free_ports
from ragline.v1 import generation_pb2, generation_pb2_grpc
from support import AUTH_ENV, SMALL_GENERATION, service_key_pairs
from support.metrics import sample_values, scrape

pytestmark = pytest.mark.integration

COUNTING = "Count from 1 to 300, separated by commas: 1, 2, 3, 4,"
NAMES = ("orchestrator", "retrieval", "generation")


@pytest.fixture(scope="module")
def keyed_generation(module_launcher, tmp_path_factory):
    keys = service_key_pairs(tmp_path_factory.mktemp("service-keys"), NAMES)
    (metrics_port,) = free_ports(1)
    handle = module_launcher.start(
        "generation",
        env={
            **AUTH_ENV,
            **keys["generation"],
            **SMALL_GENERATION,
            "RAGLINE_GENERATION_MAX_NUM_SEQS": "2",
            "RAGLINE_GENERATION_PRIORITY_SLOTS": "1",
            "RAGLINE_GENERATION_METRICS_PORT": str(metrics_port),
        },
    )
    return handle, metrics_port, keys


def as_service(keys, name: str, tenant: str) -> tuple[tuple[str, str], ...]:
    env = keys[name]
    config = AuthConfig(
        mode="jwt",
        jwt_key=AUTH_ENV["RAGLINE_AUTH_JWT_KEY"],
        service_private_key_file=env["RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE"],
        service_public_keys_dir=env["RAGLINE_AUTH_SERVICE_PUBLIC_KEYS_DIR"],
    )
    return (*ServiceCredential(config, name).metadata(), ("x-ragline-tenant", tenant))


def pauses(metrics_port: int) -> float:
    counted = sample_values(scrape(metrics_port), "ragline_generation_pauses", "_total")
    return counted.get(("small",), 0.0)


async def generate(stub, metadata, *, light: bool = False, tokens: int = 120, started=None):
    request = generation_pb2.GenerateRequest(
        prompt=COUNTING,
        max_tokens=tokens,
        light_tenant=light,
        speculation=generation_pb2.SPECULATION_OFF,
    )
    async for _ in stub.Generate(request, timeout=120, metadata=metadata):
        if started is not None:
            started.set()


async def paused_by(stub, metrics_port: int, keys, sender: str) -> float:
    """How many sequences a light request sent with `sender`'s credential paused: one
    flood sequence decodes (a tenant with one request is not light by itself), then
    another tenant's request marked light arrives."""
    before = pauses(metrics_port)
    started = asyncio.Event()
    flood = asyncio.create_task(
        generate(stub, as_service(keys, "orchestrator", "flood"), started=started)
    )
    await asyncio.wait_for(started.wait(), 60)
    await generate(stub, as_service(keys, sender, "quiet"), light=True, tokens=8)
    await flood
    return pauses(metrics_port) - before


async def test_light_tenant_is_believed_from_the_orchestrators_key_only(keyed_generation):
    handle, metrics_port, keys = keyed_generation
    async with grpc.aio.insecure_channel(handle.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        assert await paused_by(stub, metrics_port, keys, "retrieval") == 0
        assert await paused_by(stub, metrics_port, keys, "orchestrator") >= 1


async def test_a_credential_of_a_key_the_service_does_not_hold_is_refused(
    keyed_generation, tmp_path
):
    handle, _, _ = keyed_generation
    impostor = service_key_pairs(tmp_path, ["orchestrator"])
    async with grpc.aio.insecure_channel(handle.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, as_service(impostor, "orchestrator", "acme"), tokens=1)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
