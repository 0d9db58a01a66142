"""Calls spread over replicas (issue 39): the kit's client sends round-robin over every
address its target resolves to, and servers close connections at MAX_CONNECTION_AGE_S so
that a replica added later is found and gets its share.

Real service processes on loopback, counted by each replica's own metrics:
- two replicas of each stateless service behind one `ip:port,ip:port` address;
- two replicas behind one DNS name (a real DNS server on loopback answers for it, as a
  headless Service's name does in a cluster), then a third added to the name.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid

import grpc
import pytest
from dnslib import QTYPE, RR, A
from dnslib.server import BaseResolver, DNSServer
from google.protobuf import duration_pb2

from ragline import identity
from ragline.clients import ChannelPool, ServiceClient
from ragline.processes import free_ports
from ragline.v1 import embedding_pb2, embedding_pb2_grpc
from ragline_app.stack import health_status
from support import SMALL_GENERATION
from support.metrics import sample_values, scrape

pytestmark = pytest.mark.integration


# The stateless services (retrieval owns an index: one writer), what each needs to start,
# and one call of each: (method, request, streamed). The orchestrator's is refused at its
# front door (INVALID_ARGUMENT, no question), which needs no other service.
def stateless_calls():
    from ragline.v1 import (
        budget_pb2,
        budget_pb2_grpc,
        common_pb2,
        generation_pb2,
        generation_pb2_grpc,
        orchestrator_pb2,
        orchestrator_pb2_grpc,
        rerank_pb2,
        rerank_pb2_grpc,
    )

    return {
        "embedding": (
            embedding_pb2_grpc.EmbeddingServiceStub,
            "Embed",
            lambda: embedding_pb2.EmbedRequest(texts=["Which river flows through Warsaw?"]),
        ),
        "rerank": (
            rerank_pb2_grpc.RerankServiceStub,
            "Rerank",
            lambda: rerank_pb2.RerankRequest(
                query="Which river flows through Warsaw?",
                candidates=[
                    rerank_pb2.RerankCandidate(id="a", text="The Seine flows through Paris."),
                    rerank_pb2.RerankCandidate(id="b", text="The Vistula flows through Warsaw."),
                ],
                top_k=1,
            ),
        ),
        "generation": (
            generation_pb2_grpc.GenerationServiceStub,
            "CountTokens",
            lambda: generation_pb2.CountTokensRequest(prompt="Name the river of Warsaw."),
        ),
        "budget": (
            budget_pb2_grpc.BudgetServiceStub,
            "OpenTask",
            lambda: budget_pb2.OpenTaskRequest(
                task_id=uuid.uuid4().hex,
                limits=common_pb2.BudgetAmounts(calls=1),
                timeout=duration_pb2.Duration(seconds=60),
            ),
        ),
        "orchestrator": (
            orchestrator_pb2_grpc.OrchestratorServiceStub,
            "Ask",
            lambda: orchestrator_pb2.AskRequest(),
        ),
    }


def handled(replica, method: str) -> float:
    """Calls of `method` the replica finished (any status), from its own metrics."""
    found = scrape(replica.metrics_port, replica.host)
    counts = sample_values(found, "grpc_server_handled", "_total")
    return sum(value for labels, value in counts.items() if method in labels)


def start_replica(launcher, name: str, env: dict, host: str = "127.0.0.1", port=None):
    metrics_port = free_ports(1, host)[0]
    env = {**env, f"RAGLINE_{name.upper()}_METRICS_PORT": str(metrics_port)}
    return launcher.start(name, env=env, wait=False, port=port, host=host)


async def serving(*replicas, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        while await health_status(replica.address) != "SERVING":
            assert replica.process.poll() is None, replica.log()[-3000:]
            assert time.monotonic() < deadline, replica.log()[-3000:]
            await asyncio.sleep(0.2)


async def calls(client: ServiceClient, method: str, request, count: int, concurrency=8) -> None:
    """`count` calls through the kit's client (its channel options and target rules),
    `concurrency` at a time; a refusal is a call too (the orchestrator's)."""
    remaining = [count]

    async def one() -> None:
        try:
            if method == "Ask":
                async for _ in client.stream(method, request(), stage_budget_s=10):
                    pass
            else:
                await client.unary(method, request(), stage_budget_s=10)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            await one()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


@pytest.mark.parametrize("name", ["budget", "embedding", "generation", "orchestrator", "rerank"])
async def test_two_replicas_behind_one_address_list_share_the_calls(name, launcher, etcd):
    env = {
        "generation": SMALL_GENERATION,
        "budget": {"RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint},
    }.get(name, {})
    replicas = [start_replica(launcher, name, env) for _ in range(2)]
    await serving(*replicas)
    stub, method, request = stateless_calls()[name]
    client = ServiceClient(
        stub,
        ",".join(r.address for r in replicas),
        pool=ChannelPool(),
        caller=identity.Caller(tenant="acme"),
    )
    before = [handled(r, method) for r in replicas]
    await calls(client, method, request, count=200)
    # A refused stream is counted when the server has closed it, a moment after the
    # client read its status.
    shares = await counted_since(replicas, method, before, total=200)
    print(f"{name}: calls per replica {shares}")
    assert sum(shares) == 200, shares
    assert all(0.4 <= share / 200 <= 0.6 for share in shares), shares


async def counted_since(replicas, method: str, before: list[float], total=None, wait_s=5.0):
    deadline = time.monotonic() + wait_s
    while True:
        shares = [handled(r, method) - b for r, b in zip(replicas, before, strict=True)]
        if total is None or sum(shares) >= total or time.monotonic() > deadline:
            return shares
        await asyncio.sleep(0.1)


class Names(BaseResolver):
    """A DNS zone of one name whose A records a test changes (a headless Service)."""

    def __init__(self, name: str) -> None:
        self.name = name.rstrip(".") + "."
        self.addresses: list[str] = []
        self.lock = threading.Lock()

    def resolve(self, request, handler):
        reply = request.reply()
        question = request.q
        if str(question.qname) == self.name and question.qtype == QTYPE.A:
            with self.lock:
                for address in self.addresses:
                    reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(address), ttl=1))
        return reply


@pytest.fixture
def dns_names():
    names = Names("embedding.ragline.test")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = DNSServer(names, port=port, address="127.0.0.1")
    server.start_thread()
    yield names, f"127.0.0.1:{port}"
    server.stop()


async def test_replicas_behind_one_dns_name_share_the_calls_and_a_new_one_gets_its_share(
    launcher, dns_names
):
    names, dns_server = dns_names
    # Replicas of a headless Service: one port, an address each (loopback has 127/8).
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = free_ports(1, hosts[0])[0]
    env = {"RAGLINE_EMBEDDING_MAX_CONNECTION_AGE_S": "2"}
    replicas = [start_replica(launcher, "embedding", env, host, port) for host in hosts[:2]]
    await serving(*replicas)
    names.addresses = hosts[:2]
    target = f"dns://{dns_server}/embedding.ragline.test:{port}"
    client = ServiceClient(
        embedding_pb2_grpc.EmbeddingServiceStub,
        target,
        pool=ChannelPool(),
        caller=identity.Caller(tenant="acme"),
    )
    request = embedding_pb2.EmbedRequest(texts=["Which river flows through Warsaw?"])

    async def load(seconds: float) -> None:
        async def worker():
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await client.unary("Embed", request, stage_budget_s=10)

        await asyncio.gather(*(worker() for _ in range(4)))

    await load(3.0)
    counts = [handled(r, "Embed") for r in replicas]
    assert all(0.4 <= c / sum(counts) <= 0.6 for c in counts), counts

    third = start_replica(launcher, "embedding", env, hosts[2], port)
    await serving(third)
    with names.lock:
        names.addresses = hosts
    # Connections close at 2 s; the name is resolved again at most every 5 s.
    await load(10.0)
    replicas.append(third)
    late = [handled(r, "Embed") for r in replicas]
    since = [after - before for after, before in zip(late, [*counts, 0], strict=True)]
    print(f"embedding by DNS name: two replicas {counts}; with a third added {since}")
    assert since[2] / sum(since) >= 0.15, since  # a fair share is a third
