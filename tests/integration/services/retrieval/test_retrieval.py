"""The retrieval service as real processes: ingest, search modes, isolation, freshness,
durability across kill -9, and bad input."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from ragline.processes import free_ports
from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc
from ragline_services.retrieval.documents import doc_key, point_id
from support import DEFAULT_EMBEDDING_MODEL, error_info, wait_until
from support.processes import all_gone, children
from support.retrieval import MODES, OTHER_MODEL, Client, squad_docs, start_retrieval, who

pytestmark = pytest.mark.integration


async def test_ingest_then_search_in_every_mode(launcher, embedding_service, tmp_path):
    service = start_retrieval(launcher, embedding_service, tmp_path / "index")
    client = Client(service.address)
    docs, questions = squad_docs(40)
    reply = await client.upsert("acme", docs)
    assert reply.upserted == 40 and reply.index_version == reply.log_sequence
    for mode in MODES:
        found_top5 = 0
        for q in questions[:20]:
            result = await client.search("acme", q.text, mode)
            assert result.mode_used == MODES[mode] and not result.fell_back
            found_top5 += q.passage_id in [h.id for h in result.hits]
        assert found_top5 >= 14, (mode, found_top5)
    result = await client.search("acme", questions[0].text, "hybrid", include_text=True)
    hit = result.hits[0]
    assert hit.text and hit.version == reply.log_sequence and hit.rank == 1
    assert set(hit.scores) >= {"fused"}
    assert [s.name for s in result.timing.stages][:1] == ["embed"]
    assert result.embedding_model_version.startswith(f"{DEFAULT_EMBEDDING_MODEL}@")
    await client.close()


async def test_chinese_and_mixed_questions_find_their_passage(
    launcher, embedding_service, tmp_path
):
    """Chinese segmented for BM25 (jieba), in the service as deployed: a Chinese question
    and a mixed Chinese-English one find their passage in BM25 and HYBRID, and the text
    comes back as written."""
    service = start_retrieval(launcher, embedding_service, tmp_path / "index")
    client = Client(service.address)
    docs = [
        {
            "id": "kv",
            "title": "KV Cache 设计",
            "text": "高频 query 的 KV Cache 存放在 Redis 中，TTL 为 10 分钟，每次命中都会续期。",
        },
        {
            "id": "hnsw",
            "title": "检索笔记",
            "text": "HNSW 重建期间为了不阻塞查询，采用双缓冲索引：新索引在后台构建。",
        },
        {
            "id": "river",
            "title": "长江",
            "text": "长江是中国第一长河，全长约6300公里，最终在上海注入东海。",
        },
        *squad_docs(10)[0],
    ]
    await client.upsert("acme", docs)
    for mode in ("bm25", "hybrid"):
        for question, expected in (
            ("哪条河最终注入东海？", "river"),
            ("HNSW 重建会阻塞查询吗？", "hnsw"),
            ("KV Cache 的 TTL 是多少？", "kv"),
        ):
            result = await client.search("acme", question, mode, k=3, include_text=True)
            assert [h.id for h in result.hits][:1] == [expected], (mode, question)
    assert result.hits[0].text == docs[0]["text"]  # stored as written, not as segmented
    await client.close()


async def test_a_multilingual_model_finds_chinese_by_meaning_and_across_languages(
    launcher, tmp_path
):
    """With me5-small-int8 (multilingual-e5-small) as the embedding model: VECTOR search
    finds a Chinese passage for a Chinese question that shares few of its words, and for an
    English question about it (the English model ranks by script, not meaning)."""
    embedding = launcher.start("embedding", env={"RAGLINE_EMBEDDING_MODEL": "me5-small-int8"})
    service = start_retrieval(launcher, embedding, tmp_path / "index")
    client = Client(service.address)
    docs = [
        {
            "id": "river",
            "title": "长江",
            "text": "长江是中国第一长河，全长约6300公里，最终在上海注入东海。",
        },
        {
            "id": "panda",
            "title": "大熊猫",
            "text": "大熊猫是中国特有的哺乳动物，以竹子为主要食物。",
        },
        {
            "id": "tea",
            "title": "茶",
            "text": "乌龙茶属于半发酵茶，绿茶是不发酵茶，红茶是全发酵茶。",
        },
        {"id": "rail", "title": "高铁", "text": "京沪高铁全长约1318公里，连接北京和上海。"},
    ]
    await client.upsert("acme", docs)
    for question, expected in (
        ("熊猫平时吃什么？", "panda"),
        ("What does the giant panda eat?", "panda"),
        ("Which river is the longest in China?", "river"),
        ("Which kind of tea is fully fermented?", "tea"),
    ):
        result = await client.search("acme", question, "vector", k=1)
        assert [h.id for h in result.hits] == [expected], question
        assert result.embedding_model_version.startswith("me5-small-int8@")
    await client.close()


async def test_a_tenant_cannot_read_another_tenants_counters(launcher, embedding_service, tmp_path):
    # A build after every 4 writes: its timing would show acme globex's write rate.
    service = start_retrieval(launcher, embedding_service, tmp_path / "index", rebuild_after=4)
    client = Client(service.address)
    first = await client.upsert("acme", [{"id": "a1", "text": "acme one"}])
    before = await client.status("acme")
    for i in range(6):  # another tenant's traffic
        await client.upsert("globex", [{"id": f"g{i}", "text": f"globex {i}"}])
    second = await client.upsert("acme", [{"id": "a2", "text": "acme two"}])
    after = await client.status("acme")
    # Only acme's own numbering moves, by acme's own writes; nothing counts globex.
    assert (first.log_sequence, second.log_sequence) == (1, 2)
    assert (before.index_version, after.index_version) == (1, 2)
    assert after.log_sequence == after.applied_sequence == 2
    assert after.total_documents == 0 and after.delta_documents == 0
    assert after.tenant_documents == 2
    found = await client.search("acme", "acme", "bm25")
    assert found.index_version == 2 and {h.version for h in found.hits} == {1, 2}
    operator = await client.status("acme", operator=True)
    assert operator.total_documents == 8 and operator.log_sequence == 8
    for _ in range(100):  # the operator sees the builds the writes started ...
        if (await client.status("acme", operator=True)).last_build_finished.seconds:
            break
        await asyncio.sleep(0.1)
    assert (await client.status("acme", operator=True)).last_build_finished.seconds
    # ... a tenant does not
    tenant_view = await client.status("acme")
    assert not tenant_view.HasField("last_build_finished") and not tenant_view.rebuilding
    await client.close()


async def test_tenants_and_revoked_scopes(launcher, embedding_service, tmp_path):
    service = start_retrieval(launcher, embedding_service, tmp_path / "index")
    client = Client(service.address)
    await client.upsert(
        "acme",
        [
            {
                "id": "plan",
                "title": "Merger plan",
                "text": "The confidential merger plan with Globex.",
            },
            {
                "id": "pay",
                "title": "Salaries",
                "text": "Salary bands for engineers.",
                "acl": ["hr"],
            },
        ],
    )
    await client.upsert("globex", [{"id": "x", "title": "Lunch", "text": "Lunch menu."}])
    for mode in ("bm25", "vector", "hybrid", "prefilter"):
        spy = await client.search("globex", "confidential merger plan", mode, k=10)
        assert [h.id for h in spy.hits] in ([], ["x"]), mode
        assert "pay" not in [h.id for h in (await client.search("acme", "salary bands", mode)).hits]
        hr = await client.search("acme", "salary bands", mode, scopes="hr")
        assert hr.hits[0].id == "pay", mode
    await client.upsert(
        "acme",
        [
            {
                "id": "pay",
                "title": "Salaries",
                "text": "Salary bands for engineers.",
                "acl": ["finance"],
            }
        ],
        scopes="hr,finance",  # it sees the document it moves, and holds where it moves it
    )
    for mode in ("bm25", "vector", "hybrid", "prefilter"):
        hr = await client.search("acme", "salary bands", mode, scopes="hr")
        assert "pay" not in [h.id for h in hr.hits], mode
    await client.close()


async def test_writes_are_searchable_before_the_rebuild_and_queries_run_during_it(
    launcher, embedding_service, tmp_path
):
    service = start_retrieval(launcher, embedding_service, tmp_path / "index", rebuild_after=100)
    client = Client(service.address)
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(3000, 384)).astype(np.float32)
    for start in range(0, 3000, 500):
        await client.upsert(
            "acme",
            [
                {
                    "id": f"bulk-{i}",
                    "title": "",
                    "text": f"bulk document {i}",
                    "vector": vectors[i].tolist(),
                }
                for i in range(start, start + 500)
            ],
        )
    answered_during_build, fresh = 0, None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = await client.status("acme", operator=True)
        probe = await client.search(
            "acme", "probe", "vector", k=3, query_vector=vectors[42].tolist()
        )
        assert probe.hits[0].id == "bulk-42"
        if status.rebuilding:
            answered_during_build += 1
            if fresh is None:  # a write while the build runs is searchable at once
                fresh = await client.upsert(
                    "acme", [{"id": "fresh", "title": "Fresh", "text": "zanzibar quokka"}]
                )
                found = await client.search("acme", "zanzibar quokka", "hybrid")
                assert found.hits[0].id == "fresh"
                assert found.index_version >= fresh.log_sequence
        elif answered_during_build and status.last_build_finished.seconds:
            break
        await asyncio.sleep(0.05)
    final = await client.status("acme", operator=True)
    # A rebuild was seen running, queries were answered during it, a write made meanwhile
    # was searchable at once, and the build finished.
    assert answered_during_build > 0 and fresh is not None, "no rebuild was observed"
    assert final.last_build_finished.seconds and not final.rebuilding
    assert final.vector_index_ready and final.total_documents >= 3000
    # The built shard is searched by a child process of the service, gone with it.
    shards = shard_processes(service.process.pid)
    assert shards
    await client.close()
    service.stop()
    assert all_gone(shards, 5.0)


def test_a_shard_process_never_outlives_its_service_even_killed_outright(
    launcher, embedding_service, tmp_path
):
    service = start_retrieval(launcher, embedding_service, tmp_path / "index", rebuild_after=1)

    async def build():
        client = Client(service.address)
        await client.upsert("acme", [{"id": "a", "title": "", "text": "alpha beta"}])
        deadline = time.monotonic() + 60
        while not (await client.status("acme", operator=True)).last_build_finished.seconds:
            assert time.monotonic() < deadline, "no HNSW build in 60 s"
            await asyncio.sleep(0.1)
        await client.search("acme", "alpha", "vector")
        await client.close()

    asyncio.run(build())
    shards = shard_processes(service.process.pid)
    assert shards
    service.process.kill()  # SIGKILL: the service runs no shutdown code
    service.process.wait()
    launcher.forget(service)
    assert all_gone(shards, 5.0), "the shard process outlived its service"


def shard_processes(parent: int) -> list[int]:
    return children(parent, b"retrieval.shard_process")


def test_kill_9_during_ingest_loses_no_acknowledged_document(launcher, embedding_service, tmp_path):
    index_dir = tmp_path / "index"
    service = start_retrieval(launcher, embedding_service, index_dir)
    acked: list[str] = []

    async def ingest_until_killed():
        client = Client(service.address)
        rng = np.random.default_rng(1)
        try:
            for i in range(10_000):
                doc_id = f"doc-{i}"
                await client.upsert(
                    "acme",
                    [
                        {
                            "id": doc_id,
                            "title": "",
                            "text": f"token{i} payload",
                            "vector": rng.normal(size=384).tolist(),
                        }
                    ],
                )
                acked.append(doc_id)
                if i == 150:
                    service.process.send_signal(signal.SIGKILL)
        except grpc.aio.AioRpcError:
            pass
        await client.close()

    asyncio.run(ingest_until_killed())
    assert service.process.wait(timeout=10) == -signal.SIGKILL
    launcher.forget(service)
    assert len(acked) >= 150
    restarted = start_retrieval(launcher, embedding_service, index_dir)

    async def check():
        client = Client(restarted.address)
        status = await client.status("acme")
        assert status.tenant_documents >= len(acked)
        assert status.tenant_documents <= len(acked) + 1  # at most the one in flight
        for i in (0, len(acked) // 2, len(acked) - 1):
            found = await client.search("acme", f"token{i}", "bm25", k=1)
            assert found.hits[0].id == f"doc-{i}"
        await client.close()

    asyncio.run(check())


def test_kill_9_while_writes_are_in_flight_loses_none_acknowledged_and_tears_none(
    launcher, embedding_service, tmp_path
):
    """SIGKILL lands while several Upserts are in the service (the count in flight is
    checked at the kill): every acknowledged one is there after the restart, and each one
    in flight is there whole or not at all (a request is one log record)."""
    index_dir = tmp_path / "index"
    service = start_retrieval(launcher, embedding_service, index_dir)
    batch, writers = 16, 6
    acked: list[list[str]] = []
    unanswered: list[list[str]] = []
    in_flight = 0
    in_flight_at_kill = -1

    async def writer(number: int, client: Client):
        nonlocal in_flight, in_flight_at_kill
        rng = np.random.default_rng(number)
        for round_ in range(10_000):
            ids = [f"w{number}-r{round_}-{i}" for i in range(batch)]
            docs = [
                {
                    "id": doc_id,
                    "title": "",
                    "text": f"{doc_id} payload " * 20,
                    "vector": rng.normal(size=384).tolist(),
                }
                for doc_id in ids
            ]
            in_flight += 1
            try:
                await client.upsert("acme", docs)
            except grpc.aio.AioRpcError:
                unanswered.append(ids)
                return
            finally:
                in_flight -= 1
            acked.append(ids)
            if len(acked) >= 60 and in_flight >= writers // 2 and in_flight_at_kill < 0:
                in_flight_at_kill = in_flight
                service.process.send_signal(signal.SIGKILL)

    async def write_until_killed():
        client = Client(service.address)
        await asyncio.gather(*(writer(n, client) for n in range(writers)))
        await client.close()

    asyncio.run(write_until_killed())
    assert service.process.wait(timeout=10) == -signal.SIGKILL
    launcher.forget(service)
    assert in_flight_at_kill >= writers // 2, "the kill did not land during writes"
    restarted = start_retrieval(launcher, embedding_service, index_dir)

    async def check():
        client = Client(restarted.address)
        for ids in acked:
            found = (await client.versions("acme", ids)).versions
            assert set(found) == set(ids), f"acknowledged write lost: {set(ids) - set(found)}"
        for ids in unanswered:
            found = (await client.versions("acme", ids)).versions
            assert len(found) in (0, len(ids)), f"a torn write: {len(found)} of {len(ids)}"
        await client.close()

    asyncio.run(check())


def test_a_corrupt_log_stops_the_service_with_a_repair_command_that_works(
    launcher, embedding_service, tmp_path
):
    import struct
    import subprocess
    import sys

    index_dir = tmp_path / "index"
    service = start_retrieval(launcher, embedding_service, index_dir)

    async def write(count: int):
        client = Client(service.address)
        for i in range(count):  # one record each
            await client.upsert("acme", [{"id": f"doc-{i}", "title": "", "text": f"token{i}"}])
        await client.close()

    asyncio.run(write(4))
    launcher.forget(service)
    assert service.stop() == 0
    log_path = index_dir / "write.log"
    data = bytearray(log_path.read_bytes())
    (first_length,) = struct.unpack_from("<I", data, 0)
    data[8 + first_length + 8 + 20] ^= 0xFF  # inside record 2; records 3 and 4 follow
    log_path.write_bytes(bytes(data))

    refused = launcher.start(
        "retrieval",
        env={
            "RAGLINE_EMBEDDING_ADDR": embedding_service.address,
            "RAGLINE_RETRIEVAL_INDEX_DIR": str(index_dir),
        },
        wait=False,
    )
    assert refused.process.wait(timeout=60) == 1
    launcher.forget(refused)
    said = refused.log_path.read_text()
    assert "is corrupt at byte" in said and "wal repair" in said
    assert log_path.read_bytes() == bytes(data)  # nothing cut

    repair = subprocess.run(
        [sys.executable, "-m", "ragline_services.retrieval.wal", "repair", str(log_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert repair.returncode == 0 and "records lost to the damage: [2]" in repair.stdout
    restarted = start_retrieval(launcher, embedding_service, index_dir)

    async def check():
        client = Client(restarted.address)
        for i in (0, 2, 3):
            found = await client.search("acme", f"token{i}", "bm25", k=1)
            assert [h.id for h in found.hits] == [f"doc-{i}"]
        await client.close()

    asyncio.run(check())


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"query": "", "k": 5}, "query"),
        ({"query": "q", "k": 0}, "k"),
        ({"query": "q", "k": 1001}, "k"),
        ({"query": "q", "k": 5, "mode": 17}, "mode"),
        ({"query": "q", "k": 5, "query_vector": [0.1, 0.2]}, "query_vector"),
    ],
)
async def test_bad_search_is_invalid_argument(launcher, embedding_service, tmp_path, fields, field):
    service = start_retrieval(launcher, embedding_service, tmp_path / "index")
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Search(
                retrieval_pb2.SearchRequest(**fields), timeout=10, metadata=who("acme")
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(field)


async def test_bad_documents_write_nothing(launcher, embedding_service, tmp_path):
    service = start_retrieval(launcher, embedding_service, tmp_path / "index")
    client = Client(service.address)
    before = await client.status("acme")
    cases = [
        ([{"id": "a", "text": "ok"}, {"id": "b", "text": "x" * 70_000}], "documents[1].text"),
        ([{"id": "a", "text": "ok", "vector": [0.5] * 10}], "documents[0].vector"),
        ([{"id": "", "text": "no id"}], "documents[0].id"),
    ]
    for docs, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.upsert("acme", docs)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith(field)
    after = await client.status("acme")
    assert after.log_sequence == before.log_sequence and after.tenant_documents == 0
    await client.close()


async def switch_embedding_model(launcher, embedding_service, index_dir, **env):
    """An index made with the default model, then its service restarted beside an
    embedding service that runs another one; (client, questions, made_by)."""
    first = start_retrieval(launcher, embedding_service, index_dir)
    client = Client(first.address)
    docs, questions = squad_docs(10)
    await client.upsert("acme", docs)
    made_by = (await client.status("acme")).embedding_model_version
    await client.close()
    first.stop()
    other = launcher.start("embedding", env={"RAGLINE_EMBEDDING_MODEL": OTHER_MODEL})
    service = start_retrieval(launcher, other, index_dir, **env)
    return Client(service.address), questions, made_by


async def test_another_embedding_model_re_embeds_the_index(launcher, embedding_service, tmp_path):
    client, questions, made_by = await switch_embedding_model(
        launcher, embedding_service, tmp_path / "index"
    )
    question = questions[0]
    during = await client.search("acme", question.text, "hybrid")  # sees the new model
    assert during.fallback_reason in ("vector_index_reembedding", "")
    await client.upsert("acme", [{"id": "new", "title": "New", "text": "A new passage."}])
    for _ in range(300):
        status = await client.status("acme")
        if not status.reembedding_to:
            break
        await asyncio.sleep(0.1)
    assert not status.reembedding_to, status
    assert status.embedding_model_version.startswith(f"{OTHER_MODEL}@")
    assert made_by.startswith(f"{DEFAULT_EMBEDDING_MODEL}@")
    assert status.tenant_documents == 11
    result = await client.search("acme", question.text, "hybrid")
    assert not result.fell_back and result.embedding_model_version == status.embedding_model_version
    assert result.hits[0].id == question.passage_id
    await client.close()


async def test_with_re_embedding_off_the_index_refuses_another_models_vectors(
    launcher, embedding_service, tmp_path
):
    client, questions, made_by = await switch_embedding_model(
        launcher, embedding_service, tmp_path / "index", reembed_on_model_change="false"
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.upsert("acme", [{"id": "new", "title": "New", "text": "A new passage."}])
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reason, _, metadata = error_info(caught.value)
    assert reason == "EMBEDDING_MODEL_CHANGED" and metadata["index_model"] == made_by
    assert metadata["service_model"].startswith(f"{OTHER_MODEL}@")
    result = await client.search("acme", questions[0].text, "hybrid")
    assert result.fell_back and result.fallback_reason == "embedding_model_changed"
    assert result.mode_used == retrieval_pb2.SEARCH_MODE_BM25
    assert result.hits[0].id == questions[0].passage_id
    status = await client.status("acme")
    assert status.embedding_model_version == made_by and status.tenant_documents == 10
    await client.close()


async def test_without_the_embedding_service_search_falls_back_to_bm25(launcher, tmp_path):
    service = launcher.start(
        "retrieval",
        env={
            "RAGLINE_EMBEDDING_ADDR": f"127.0.0.1:{free_ports(1)[0]}",
            "RAGLINE_RETRIEVAL_INDEX_DIR": str(tmp_path / "index"),
        },
    )
    client = Client(service.address)
    await client.upsert(
        "acme",
        [{"id": "w", "title": "Warsaw", "text": "Warsaw on the Vistula", "vector": [0.1] * 384}],
    )
    result = await client.search("acme", "Vistula", "hybrid")
    assert result.fell_back and result.fallback_reason == "embedding_unavailable"
    assert result.mode_used == retrieval_pb2.SEARCH_MODE_BM25 and result.hits[0].id == "w"
    await client.close()


async def test_document_versions_follow_writes_deletes_and_visibility(
    launcher, embedding_service, tmp_path
):
    service = start_retrieval(launcher, embedding_service, tmp_path / "index")
    client = Client(service.address)
    first = await client.upsert(
        "acme",
        [
            {"id": "open", "text": "the canteen opens at eight"},
            {"id": "pay", "text": "salary bands for engineers", "acl": ["hr"]},
        ],
    )
    await client.upsert("globex", [{"id": "open", "text": "another tenant's document"}])
    seen = await client.versions("acme", ["open", "pay", "missing"], scopes="hr")
    assert dict(seen.versions) == {"open": first.versions[0], "pay": first.versions[1]}
    assert seen.index_version == first.index_version
    # Without the scope the hidden document is absent, exactly like a missing one.
    assert dict((await client.versions("acme", ["open", "pay"])).versions) == {
        "open": first.versions[0]
    }
    update = await client.upsert("acme", [{"id": "open", "text": "the canteen opens at nine"}])
    after = await client.versions("acme", ["open"])
    assert after.versions["open"] == update.versions[0] > first.versions[0]
    assert after.index_version == update.index_version > seen.index_version
    deleted = await client.delete("acme", ["open"])
    gone = await client.versions("acme", ["open"])
    assert dict(gone.versions) == {} and gone.index_version == deleted.index_version
    # globex's document of the same id is globex's alone
    assert dict((await client.versions("globex", ["pay"])).versions) == {}
    assert set((await client.versions("globex", ["open"])).versions) == {"open"}
    await client.close()


async def wait_for_shard(index_dir: Path, condition, timeout_s: float = 30.0) -> bool:
    """Whether the current HNSW shard's point ids come to meet `condition`."""
    import json

    from ragline_services.retrieval.vectors import load_point_ids

    for _ in range(int(timeout_s / 0.1)):
        with contextlib.suppress(OSError, ValueError):
            current = json.loads((index_dir / "vectors" / "current.json").read_text())
            pids = load_point_ids(index_dir / "vectors" / current["dir"])
            if pids is not None and condition(set(pids.tolist())):
                return True
        await asyncio.sleep(0.1)
    return False


def files_holding(index_dir: Path, secret: bytes) -> list[str]:
    """The files under the index directory whose bytes hold `secret`."""
    found = []
    for root, _, names in os.walk(index_dir):  # builds and rewrites come and go
        for name in names:
            with contextlib.suppress(OSError):
                if secret in (Path(root) / name).read_bytes():
                    found.append(str(Path(root, name).relative_to(index_dir)))
    return found


async def test_overwritten_text_is_forgotten_without_any_delete(
    launcher, embedding_service, tmp_path
):
    """An overwrite replaces text as a delete removes it: once it is FORGET_AFTER_S old,
    the old version is in no file (it stayed in the log and in tantivy's segment until the
    log passed its size limit, however long that took)."""
    index_dir = tmp_path / "index"
    service = start_retrieval(launcher, embedding_service, index_dir, forget_after_s=0.5)
    client = Client(service.address)
    await client.upsert("acme", [{"id": "plan", "title": "", "text": "okapi salary draft"}])
    await client.upsert("acme", [{"id": "plan", "title": "", "text": "okapi final plan"}])
    await client.close()

    async def forgotten() -> bool:
        return not files_holding(index_dir, b"okapi salary draft")

    assert await wait_until(forgotten, 15), files_holding(index_dir, b"okapi salary draft")
    assert files_holding(index_dir, b"okapi final plan")


async def test_deleted_and_overwritten_text_leaves_every_file_and_a_restart_loses_nothing(
    launcher, embedding_service, tmp_path
):
    """With RAGLINE_RETRIEVAL_FORGET_AFTER_S, once a delete is that old the write log is
    compacted, the tenant's BM25 index rewritten and the HNSW shard built again: the
    deleted document's text and an overwritten version's are in no file of the index
    directory (tantivy kept them in its segment before), and a restart replays the
    compacted log to the same documents, versions and numbering."""
    index_dir = tmp_path / "index"
    service = start_retrieval(launcher, embedding_service, index_dir, forget_after_s=0.5)
    client = Client(service.address)
    # One request, one BM25 segment: it stays (anchor lives on), and tantivy keeps in it
    # the bytes of what is deleted from it.
    await client.upsert(
        "acme",
        [
            {"id": "memo", "title": "", "text": "zebrafish budget memo"},
            {"id": "keep", "title": "", "text": "okapi first draft"},
            {"id": "anchor", "title": "", "text": "quokka anchor"},
        ],
    )
    await client.upsert("acme", [{"id": "keep", "title": "", "text": "okapi final text"}])
    memo_pid = point_id(doc_key("acme", "memo"))
    assert await wait_for_shard(index_dir, lambda pids: memo_pid in pids)  # built, with it
    await client.delete("acme", ["memo"])

    def holding(secret: bytes) -> list[str]:
        return files_holding(index_dir, secret)

    for _ in range(150):
        if not holding(b"zebrafish") and not holding(b"okapi first draft"):
            break
        await asyncio.sleep(0.1)
    assert not holding(b"zebrafish") and not holding(b"okapi first draft")
    assert holding(b"okapi final text")
    # The HNSW shard is built again: the deleted document's vector is in no shard file.
    assert await wait_for_shard(index_dir, lambda pids: memo_pid not in pids)
    before = (await client.versions("acme", ["keep", "memo", "anchor"])).versions
    found = await client.search("acme", "okapi", "hybrid", k=1, include_text=True)
    assert [(h.id, h.text) for h in found.hits] == [("keep", "okapi final text")]
    await client.close()
    launcher.forget(service)
    assert service.stop() == 0

    restarted = start_retrieval(launcher, embedding_service, index_dir)
    client = Client(restarted.address)
    assert (await client.versions("acme", ["keep", "memo", "anchor"])).versions == before
    assert before == {"keep": 2, "anchor": 1}
    for mode in ("bm25", "vector", "hybrid"):
        found = await client.search("acme", "okapi", mode, k=1, include_text=True)
        assert [(h.id, h.text) for h in found.hits] == [("keep", "okapi final text")], mode
    assert not (await client.search("acme", "zebrafish", "bm25")).hits
    again = await client.upsert("acme", [{"id": "new", "title": "", "text": "numbered on"}])
    assert again.log_sequence == 4  # the tenant's numbering goes on where it was
    await client.close()
