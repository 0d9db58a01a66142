"""The retrieval service on the Qdrant-server backend, against a Qdrant-protocol stand-in."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ragline.processes import free_ports
from ragline_app.stack import health_status_sync
from support.retrieval import Client, who, writing

pytestmark = pytest.mark.integration


def qdrant_env(url: str, tmp_path) -> dict[str, str]:
    """A retrieval service on the Qdrant backend; its embedding address leads nowhere
    (the tests send vectors)."""
    return {
        "RAGLINE_RETRIEVAL_VECTOR_BACKEND": "qdrant",
        "RAGLINE_RETRIEVAL_QDRANT_URL": url,
        "RAGLINE_RETRIEVAL_INDEX_DIR": str(tmp_path / "index"),
        "RAGLINE_EMBEDDING_ADDR": f"127.0.0.1:{free_ports(1)[0]}",
    }


def test_qdrant_backend_writes_filters_and_replays_only_unseen(launcher, qdrant, tmp_path):
    url, fake = qdrant
    env = qdrant_env(url, tmp_path)
    service = launcher.start("retrieval", env=env)
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(6, 384)).tolist()

    async def scenario(address):
        client = Client(address)
        await client.upsert(
            "acme",
            [
                {
                    "id": f"a{i}",
                    "title": f"A{i}",
                    "text": f"acme doc {i}",
                    "vector": vectors[i],
                    "acl": ["hr"] if i == 2 else [],
                }
                for i in range(3)
            ],
        )
        await client.upsert(
            "globex", [{"id": "g", "title": "G", "text": "globex doc", "vector": vectors[0]}]
        )
        found = await client.search("acme", "x", "vector", k=3, query_vector=vectors[1])
        assert found.hits[0].id == "a1"
        assert "a2" not in [h.id for h in found.hits]  # hr only
        hr = await client.search("acme", "x", "vector", k=1, scopes="hr", query_vector=vectors[2])
        assert hr.hits[0].id == "a2"
        globex = await client.search("globex", "x", "vector", k=5, query_vector=vectors[1])
        assert [h.id for h in globex.hits] == ["g"]
        await client.delete("acme", ["a1"])
        after = await client.search("acme", "x", "vector", k=3, query_vector=vectors[1])
        assert "a1" not in [h.id for h in after.hits]
        status = await client.status("acme")
        assert status.vector_index_ready
        await client.close()

    asyncio.run(scenario(service.address))
    assert fake.calls.count("Create") == 1
    upserts = fake.calls.count("Upsert")
    assert service.stop() == 0
    launcher.forget(service)
    restarted = launcher.start("retrieval", env=env)
    assert fake.calls.count("Upsert") == upserts  # nothing replayed twice into Qdrant
    assert fake.calls.count("Create") == 1

    async def still_there(address):
        client = Client(address)
        found = await client.search("acme", "x", "vector", k=1, query_vector=vectors[0])
        assert found.hits[0].id == "a0"
        await client.close()

    asyncio.run(still_there(restarted.address))


async def test_a_stalled_qdrant_call_ends_at_the_callers_deadline(qdrant, tmp_path):
    import time

    from ragline import deadlines
    from ragline.errors import DeadlineExceeded
    from ragline_services.retrieval.documents import Visibility
    from ragline_services.retrieval.qdrant_server import QdrantServerIndex

    url, fake = qdrant
    index = QdrantServerIndex(url, "stalled", 8, tmp_path / "state.json", timeout_s=30.0)
    fake.hold_queries_s = 5.0
    started = time.monotonic()
    with deadlines.deadline_scope(0.3), pytest.raises(DeadlineExceeded):
        await asyncio.to_thread(
            index.search, np.ones(8, dtype=np.float32), Visibility("acme"), 5, 64
        )
    assert time.monotonic() - started < 1.5  # not the 5 s stall, nor the 30 s cap
    index.close()


def test_a_write_whose_caller_left_at_once_neither_fails_its_apply_nor_wedges_later_writes(
    launcher, qdrant, tmp_path
):
    import grpc

    from ragline.v1 import retrieval_pb2

    url, _ = qdrant
    env = qdrant_env(url, tmp_path)
    service = launcher.start("retrieval", env=env)
    vector = np.random.default_rng(5).normal(size=384).tolist()

    async def scenario():
        client = Client(service.address)
        hasty = retrieval_pb2.UpsertRequest()
        hasty.documents.add(id="hasty", title="", text="sent with 10 ms to live", vector=vector)
        try:  # acknowledged or not, it may already be in the log: it must not wedge
            await client.stub.Upsert(hasty, timeout=0.01, metadata=who("a", writing()))
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Every later write of every tenant is applied, not queued behind a retry loop.
        for tenant in ("a", "b"):
            reply = await asyncio.wait_for(
                client.upsert(
                    tenant, [{"id": "later", "title": "", "text": "later", "vector": vector}]
                ),
                timeout=15,
            )
            assert reply.upserted == 1
        found = await client.search("a", "x", "vector", k=5, query_vector=vector)
        assert "later" in [h.id for h in found.hits]
        await client.close()

    asyncio.run(scenario())


def test_a_qdrant_with_an_api_key_and_tls_is_reached_with_both(launcher, tmp_path):
    """Against the stand-in checking the key as Qdrant does (`api-key` metadata) behind
    TLS: with both the service writes and searches; without the key it does not serve."""
    from ragline_app.certificates import local_authority
    from support.fake_qdrant import start_fake_qdrant

    pki = local_authority(tmp_path / "pki")
    port = free_ports(1)[0]
    certificate = (pki.service_key.read_bytes(), pki.service_cert.read_bytes())
    server, fake = start_fake_qdrant(port, api_key="qdrant-key", certificate=certificate)
    try:
        env = {
            **qdrant_env(f"localhost:{port}", tmp_path),
            "RAGLINE_RETRIEVAL_QDRANT_API_KEY": "qdrant-key",
            "RAGLINE_RETRIEVAL_QDRANT_CA_FILE": str(pki.ca),
        }
        service = launcher.start("retrieval", env=env)
        vector = np.random.default_rng(5).normal(size=384).tolist()

        async def scenario(address):
            client = Client(address)
            await client.upsert("acme", [{"id": "a", "title": "A", "text": "t", "vector": vector}])
            found = await client.search("acme", "x", "vector", k=1, query_vector=vector)
            assert found.hits[0].id == "a"

        asyncio.run(scenario(service.address))
        assert "Upsert" in fake.calls and "Query" in fake.calls
        launcher.stop_all()

        keyless = {k: v for k, v in env.items() if k != "RAGLINE_RETRIEVAL_QDRANT_API_KEY"}
        keyless["RAGLINE_RETRIEVAL_INDEX_DIR"] = str(tmp_path / "keyless")
        refused = launcher.start("retrieval", env=keyless, wait=False)
        # Qdrant's refusal ends the start, saying why; the service never serves.
        assert refused.process.wait(timeout=60) != 0
        launcher.forget(refused)
        assert "Qdrant at localhost" in refused.log() and "Invalid api-key" in refused.log()
        assert health_status_sync(refused.address) == "UNREACHABLE"
    finally:
        server.stop(0)
