"""A delete reaches every replica of a service that keeps copies of document text: two
real rerank processes behind one address list, each told ForgetDocuments by the real
retrieval service (a load-balanced call reaches one), and the notice counted."""

from __future__ import annotations

import asyncio

import pytest

from ragline.processes import free_ports
from support import wait_until
from support.metrics import sample_values, scrape
from support.retrieval import Client

pytestmark = pytest.mark.integration


def forget_notices(metrics_port: int) -> dict:
    """Retrieval's forget notices by result (delivered, retried, given_up)."""
    return sample_values(scrape(metrics_port), "ragline_retrieval_forget_notices", "_total")


def forget_calls(metrics_port: int) -> float:
    found = scrape(metrics_port)
    handled = sample_values(found, "grpc_server_handled", "_total")
    return sum(v for labels, v in handled.items() if "ForgetDocuments" in labels)


async def start_retrieval(launcher, embedding_service, tmp_path, keepers: dict[str, str]):
    """A real retrieval service telling the keepers at `keepers`' addresses (replicas
    behind one list each); its handle and its metrics port."""
    (metrics_port,) = free_ports(1)
    retrieval = await asyncio.to_thread(
        launcher.start,
        "retrieval",
        env={
            "RAGLINE_EMBEDDING_ADDR": embedding_service.address,
            "RAGLINE_RETRIEVAL_INDEX_DIR": str(tmp_path / "index"),
            "RAGLINE_RETRIEVAL_METRICS_PORT": str(metrics_port),
            **keepers,
        },
    )
    return retrieval, metrics_port


async def test_a_delete_reaches_every_rerank_replica(launcher, embedding_service, tmp_path):
    rerank_metrics = free_ports(2)
    reranks = [
        await asyncio.to_thread(
            launcher.start, "rerank", env={"RAGLINE_RERANK_METRICS_PORT": str(port)}
        )
        for port in rerank_metrics
    ]
    # both replicas behind one address, as a headless Service's name resolves
    retrieval, retrieval_metrics = await start_retrieval(
        launcher,
        embedding_service,
        tmp_path,
        {"RAGLINE_RERANK_ADDR": ",".join(r.address for r in reranks)},
    )
    client = Client(retrieval.address)
    await client.upsert("acme", [{"id": "memo", "title": "", "text": "the okapi budget memo"}])
    await client.delete("acme", ["memo"])
    await client.close()

    async def every_replica_told() -> bool:
        calls = [await asyncio.to_thread(forget_calls, port) for port in rerank_metrics]
        return all(count >= 1 for count in calls)

    assert await wait_until(every_replica_told, 15), [forget_calls(p) for p in rerank_metrics]

    def notices() -> dict:
        return forget_notices(retrieval_metrics)

    async def counted() -> bool:
        return (await asyncio.to_thread(notices)).get(("delivered",), 0) >= 1

    assert await wait_until(counted, 10), notices()
    assert notices()[("given_up",)] == 0, notices()


def forget_sources_calls(metrics_port: int) -> float:
    handled = sample_values(scrape(metrics_port), "grpc_server_handled", "_total")
    return sum(v for labels, v in handled.items() if "ForgetSources" in labels)


async def test_a_delete_reaches_two_replicas_of_each_keeper_and_one_down_is_retried(
    launcher, embedding_service, tmp_path
):
    """Two rerank and two generation replicas behind their address lists (the chart's
    headless Services), one rerank replica down when the delete is acknowledged: the
    notice is retried, counted, and reaches it once it is up."""
    from support import SMALL_GENERATION

    rerank_metrics, generation_metrics = free_ports(2), free_ports(2)
    late_port, late_metrics = free_ports(1)[0], rerank_metrics[1]
    first_rerank = await asyncio.to_thread(
        launcher.start, "rerank", env={"RAGLINE_RERANK_METRICS_PORT": str(rerank_metrics[0])}
    )
    generations = [
        await asyncio.to_thread(
            launcher.start,
            "generation",
            env={**SMALL_GENERATION, "RAGLINE_GENERATION_METRICS_PORT": str(port)},
        )
        for port in generation_metrics
    ]
    retrieval, retrieval_metrics = await start_retrieval(
        launcher,
        embedding_service,
        tmp_path,
        {
            "RAGLINE_RERANK_ADDR": f"{first_rerank.address},127.0.0.1:{late_port}",
            "RAGLINE_GENERATION_ADDR": ",".join(g.address for g in generations),
        },
    )
    client = Client(retrieval.address)
    await client.upsert("acme", [{"id": "memo", "title": "", "text": "the okapi budget memo"}])
    await client.delete("acme", ["memo"])
    await client.close()

    def notices() -> dict:
        return forget_notices(retrieval_metrics)

    async def retried() -> bool:
        return (await asyncio.to_thread(notices)).get(("retried",), 0) >= 1

    assert await wait_until(retried, 15), notices()
    await asyncio.to_thread(
        launcher.start,
        "rerank",
        env={"RAGLINE_RERANK_METRICS_PORT": str(late_metrics)},
        port=late_port,
    )

    async def every_replica_told() -> bool:
        reranks = [await asyncio.to_thread(forget_calls, p) for p in rerank_metrics]
        gens = [await asyncio.to_thread(forget_sources_calls, p) for p in generation_metrics]
        return all(count >= 1 for count in reranks + gens)

    assert await wait_until(every_replica_told, 30), notices()

    # a replica counts the call when it has handled it; retrieval counts the notice when
    # the reply is back, a moment later
    async def both_keepers_counted() -> bool:
        return (await asyncio.to_thread(notices)).get(("delivered",), 0) >= 2

    assert await wait_until(both_keepers_counted, 10), notices()
    assert notices()[("given_up",)] == 0, notices()
