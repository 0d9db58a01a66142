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


def forget_calls(metrics_port: int) -> float:
    found = scrape(metrics_port)
    handled = sample_values(found, "grpc_server_handled", "_total")
    return sum(v for labels, v in handled.items() if "ForgetDocuments" in labels)


async def test_a_delete_reaches_every_rerank_replica(launcher, embedding_service, tmp_path):
    rerank_metrics = free_ports(2)
    reranks = [
        await asyncio.to_thread(
            launcher.start, "rerank", env={"RAGLINE_RERANK_METRICS_PORT": str(port)}
        )
        for port in rerank_metrics
    ]
    (retrieval_metrics,) = free_ports(1)
    retrieval = await asyncio.to_thread(
        launcher.start,
        "retrieval",
        env={
            "RAGLINE_EMBEDDING_ADDR": embedding_service.address,
            "RAGLINE_RETRIEVAL_INDEX_DIR": str(tmp_path / "index"),
            "RAGLINE_RETRIEVAL_METRICS_PORT": str(retrieval_metrics),
            # both replicas behind one address, as a headless Service's name resolves
            "RAGLINE_RERANK_ADDR": ",".join(r.address for r in reranks),
        },
    )
    client = Client(retrieval.address)
    await client.upsert("acme", [{"id": "memo", "title": "", "text": "the okapi budget memo"}])
    await client.delete("acme", ["memo"])
    await client.close()

    async def every_replica_told() -> bool:
        calls = [await asyncio.to_thread(forget_calls, port) for port in rerank_metrics]
        return all(count >= 1 for count in calls)

    assert await wait_until(every_replica_told, 15), [forget_calls(p) for p in rerank_metrics]
    notices = sample_values(scrape(retrieval_metrics), "ragline_retrieval_forget_notices", "_total")
    assert notices[("delivered",)] >= 1 and notices[("given_up",)] == 0, notices
