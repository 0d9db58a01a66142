"""The retrieval domain on real Tantivy and qdrant-edge (in a temp dir) with a toy embedder."""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
import threading

import numpy as np
import pytest

from ragline.errors import FailedPrecondition, InvalidArgument
from ragline.vocabulary import SearchMode
from ragline_services.retrieval.analysis import Analyzer
from ragline_services.retrieval.documents import (
    Visibility,
    doc_key,
    encode_vector,
    point_id,
)
from ragline_services.retrieval.index import RetrievalIndex
from ragline_services.retrieval.index_types import (
    DocumentInput,
    Embedded,
    IndexSettings,
    SearchQuery,
)
from ragline_services.retrieval.reembed import VectorModel, WriteTurns
from ragline_services.retrieval.vectors import EdgeVectorIndex

DIM = 64


def toy_vector(text: str) -> np.ndarray:
    """Bag of hashed words: texts sharing words are near each other."""
    vector = np.zeros(DIM, dtype=np.float32)
    for word in re.findall(r"\w+", text.lower()):
        vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % DIM] += 1.0
    return vector / max(np.linalg.norm(vector), 1e-9)


async def toy_embed(texts: list[str], kind: str) -> Embedded:
    return Embedded(np.stack([toy_vector(t) for t in texts]), "toy-1")


def open_index(path, exact_limit=20_000, rebuild_after=2_000, embed=toy_embed) -> RetrievalIndex:
    vectors = EdgeVectorIndex(
        path / "vectors",
        DIM,
        path / "write.log",
        exact_limit=exact_limit,
        rebuild_after=rebuild_after,
    )
    index = RetrievalIndex(path, vectors, IndexSettings(dim=DIM), embed)
    index.replay()
    return index


DOCS = [
    DocumentInput("warsaw", "Warsaw", "Warsaw is the capital of Poland on the Vistula river."),
    DocumentInput("paris", "Paris", "Paris is the capital of France on the Seine river."),
    DocumentInput("salary", "Salaries", "Salary bands of the engineering team.", acl=("hr",)),
    DocumentInput(
        "tesla", "Tesla", "Nikola Tesla worked on alternating current.", attributes={"lang": "en"}
    ),
]
ACME = Visibility("acme")


def ids(result) -> list[str]:
    return [h.id for h in result.hits]


@pytest.mark.parametrize(
    "mode", [SearchMode.BM25, SearchMode.VECTOR, SearchMode.HYBRID, SearchMode.PREFILTER]
)
async def test_writes_are_searchable_at_once_in_every_mode(tmp_path, mode):
    index = open_index(tmp_path)
    result = await index.upsert("acme", DOCS)
    assert result.versions == [1] * 4
    found = await index.search(ACME, SearchQuery("capital of Poland Vistula", 2, mode))
    assert ids(found)[0] == "warsaw"
    assert found.mode_used == mode and not found.fell_back
    assert found.hits[0].version == 1


class Embedder:
    """The toy embedder as a named model; another name gives other vectors (rolled), so a
    document re-embedded shows in the log. `hold` texts wait for `gate` (a slow batch)."""

    def __init__(self, model_version: str) -> None:
        self.model_version = model_version
        self.hold: set[str] = set()
        self.gate = asyncio.Event()
        self.held = asyncio.Event()

    async def __call__(self, texts: list[str], kind: str) -> Embedded:
        if self.hold & set(texts):
            self.held.set()
            await self.gate.wait()
        shift = sum(map(ord, self.model_version)) % DIM
        return Embedded(
            np.roll((await toy_embed(texts, kind)).vectors, shift, axis=1), self.model_version
        )


def logged_models(index: RetrievalIndex) -> dict[str, str]:
    """The model each live document's last logged vector came from."""
    last: dict[str, str] = {}
    for record in index.wal.replay():
        for key in record.get("deletes", ()):
            last.pop(key, None)
        for item in record.get("upserts", ()):
            last[item["id"]] = item.get("model")
    return last


async def until(condition, timeout_s: float = 10.0) -> None:
    """Waits for a state of the index that has no event of its own to wait on."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def refusing(path, embed) -> RetrievalIndex:
    vectors = EdgeVectorIndex(path / "vectors", DIM, path / "write.log")
    settings = IndexSettings(dim=DIM, reembed_on_model_change=False)
    index = RetrievalIndex(path, vectors, settings, embed)
    index.replay()
    return index


async def test_with_re_embedding_off_an_index_refuses_another_models_vectors(tmp_path):
    first = open_index(tmp_path, embed=Embedder("minilm-a"))
    await first.upsert("acme", DOCS)
    assert first.models.current.model_version == "minilm-a"
    first.close()
    index = refusing(tmp_path, Embedder("minilm-b"))  # the service changed models
    assert index.models.current.model_version == "minilm-a"  # kept with the index
    logged = index.wal.last_seq
    with pytest.raises(FailedPrecondition) as caught:
        await index.upsert("acme", [DocumentInput("rome", "Rome", "Rome is on the Tiber.")])
    assert caught.value.reason == "EMBEDDING_MODEL_CHANGED"
    assert "minilm-a" in caught.value.message and "minilm-b" in caught.value.message
    assert index.wal.last_seq == logged  # refused before anything was logged
    # A query the index would embed with the other model is answered by BM25, and says so.
    found = await index.search(ACME, SearchQuery("capital of Poland Vistula", 2, SearchMode.HYBRID))
    assert (found.mode_used, found.fell_back, found.fallback_reason) == (
        SearchMode.BM25,
        True,
        "embedding_model_changed",
    )
    assert ids(found)[0] == "warsaw"
    # Vectors the caller brings are the caller's business.
    rome = DocumentInput("rome", "Rome", "Rome is on the Tiber.", vector=tuple(toy_vector("Rome")))
    await index.upsert("acme", [rome])
    query = SearchQuery("", 1, SearchMode.VECTOR, vector=tuple(toy_vector("Rome")))
    assert ids(await index.search(ACME, query)) == ["rome"]
    index.close()
    # The index's own model serving again: everything works as before.
    again = open_index(tmp_path, embed=Embedder("minilm-a"))
    await again.upsert("acme", [DocumentInput("oslo", "Oslo", "Oslo is in Norway.")])
    assert (
        await again.search(ACME, SearchQuery("Oslo Norway", 1, SearchMode.HYBRID))
    ).mode_used == SearchMode.HYBRID


async def test_another_model_re_embeds_the_index_and_bm25_answers_meanwhile(tmp_path):
    first = open_index(tmp_path, embed=Embedder("minilm-a"))
    await first.upsert("acme", DOCS)
    await first.upsert("globex", DOCS[:1])
    mine = DocumentInput("own", "Own", "A caller's own vector.", vector=tuple(toy_vector("own")))
    await first.upsert("acme", [mine])
    first.close()
    embed = Embedder("minilm-b")
    embed.hold = {"Warsaw. " + DOCS[0].text}  # the re-embed's first batch waits
    index = open_index(tmp_path, embed=embed)
    during = await index.search(
        ACME, SearchQuery("capital of Poland Vistula", 2, SearchMode.HYBRID)
    )
    assert (during.mode_used, during.fallback_reason) == (
        SearchMode.BM25,
        "vector_index_reembedding",
    )
    assert ids(during)[0] == "warsaw"
    assert (await index.status("acme")).reembedding_to == "minilm-b"
    # A write embedded by the new model is accepted while the index moves to it.
    await index.upsert("acme", [DocumentInput("rome", "Rome", "Rome is on the Tiber.")])
    embed.gate.set()
    await until(lambda: not index.models.current.reembedding_to)
    assert index.models.current == VectorModel("minilm-b")
    models = logged_models(index)
    assert models == {
        "warsaw": "minilm-b",
        "paris": "minilm-b",
        "salary": "minilm-b",
        "tesla": "minilm-b",
        "rome": "minilm-b",
        "own": "",
    }
    after = await index.search(ACME, SearchQuery("capital of Poland Vistula", 2, SearchMode.HYBRID))
    assert after.mode_used == SearchMode.HYBRID and ids(after)[0] == "warsaw"
    assert after.hits[0].version > during.hits[0].version  # a re-embed is a write
    hr = Visibility("acme", frozenset({"hr"}))  # ACLs came along
    assert "salary" not in ids(
        await index.search(ACME, SearchQuery("salary bands", 5, SearchMode.VECTOR))
    )
    assert "salary" in ids(
        await index.search(hr, SearchQuery("salary bands", 5, SearchMode.VECTOR))
    )
    globex = await index.search(Visibility("globex"), SearchQuery("Warsaw", 5, SearchMode.VECTOR))
    assert ids(globex) == ["warsaw"]
    index.close()
    assert VectorModel.load(tmp_path / "vector_model.json") == VectorModel("minilm-b")


async def test_a_document_rewritten_during_the_re_embed_keeps_its_new_text(tmp_path):
    first = open_index(tmp_path, embed=Embedder("minilm-a"))
    await first.upsert("acme", DOCS[:2])
    first.close()
    embed = Embedder("minilm-b")
    embed.hold = {"Warsaw. " + DOCS[0].text}
    index = open_index(tmp_path, embed=embed)
    await index.search(ACME, SearchQuery("Warsaw", 1, SearchMode.HYBRID))  # sees the new model
    await until(embed.held.is_set)  # the re-embed has read the old text and waits
    new = DocumentInput("warsaw", "Warsaw", "Warsaw now has a new text about the Vistula.")
    await index.upsert("acme", [new])
    await index.delete("acme", ["paris"])
    embed.gate.set()
    await until(lambda: not index.models.current.reembedding_to)
    found = await index.search(ACME, SearchQuery("Warsaw", 5, SearchMode.BM25, include_text=True))
    assert [(h.id, h.text) for h in found.hits] == [("warsaw", new.text)]
    index.close()


async def test_a_re_embed_interrupted_by_a_restart_goes_on_at_the_next_start(tmp_path):
    first = open_index(tmp_path, embed=Embedder("minilm-a"))
    await first.upsert("acme", DOCS)
    first.close()
    stalled = Embedder("minilm-b")
    stalled.hold = {"Warsaw. " + DOCS[0].text}
    index = open_index(tmp_path, embed=stalled)
    await index.search(ACME, SearchQuery("Warsaw", 1, SearchMode.HYBRID))
    await until(stalled.held.is_set)
    await index.models.stop()
    index.close()
    assert VectorModel.load(tmp_path / "vector_model.json").reembedding_to == "minilm-b"
    again = open_index(tmp_path, embed=Embedder("minilm-b"))
    await again.models.resume()
    await until(lambda: not again.models.current.reembedding_to)
    assert set(logged_models(again).values()) == {"minilm-b"}
    again.close()


async def test_vectors_a_caller_names_are_held_to_the_index_model(tmp_path):
    index = open_index(tmp_path, embed=Embedder("minilm-a"))
    await index.upsert("acme", DOCS[:2])

    def named(doc_id: str, model: str) -> DocumentInput:
        vector = tuple(toy_vector(doc_id))
        return DocumentInput(doc_id, doc_id, f"{doc_id} text", vector=vector, vector_model=model)

    await index.upsert("acme", [named("same", "minilm-a")])
    assert logged_models(index)["same"] == "minilm-a"  # re-embedded with the index later
    with pytest.raises(FailedPrecondition) as caught:
        await index.upsert("acme", [named("stray", "minilm-z")])  # nobody runs it here
    assert caught.value.reason == "EMBEDDING_MODEL_CHANGED"
    assert caught.value.metadata["service_model"] == "minilm-a"
    index.close()
    # The embedding service moved to b before the index heard of it: b's vectors go in
    # (the index asks the service) and the index moves to b.
    moved = open_index(tmp_path, embed=Embedder("minilm-b"))
    await moved.upsert("acme", [named("fresh", "minilm-b")])
    await until(lambda: moved.models.current == VectorModel("minilm-b"))
    assert set(logged_models(moved).values()) == {"minilm-b"}
    moved.close()


async def test_an_index_from_before_the_record_takes_the_first_model_it_sees(tmp_path):
    index = open_index(tmp_path, embed=Embedder("minilm-a"))
    await index.upsert("acme", DOCS)
    index.close()
    (tmp_path / "vector_model.json").unlink()
    older = open_index(tmp_path, embed=Embedder("minilm-b"))
    assert older.models.current == VectorModel()
    found = await older.search(ACME, SearchQuery("capital of Poland Vistula", 2, SearchMode.HYBRID))
    assert found.mode_used == SearchMode.HYBRID and older.models.current == VectorModel("minilm-b")
    assert (tmp_path / "vector_model.json").exists()


async def test_a_re_embed_batch_waits_for_writes_in_flight_and_holds_new_ones():
    turns, order = WriteTurns(), []

    async def write(name: str, hold_s: float):
        async with turns.shared():
            order.append(f"{name} start")
            await asyncio.sleep(hold_s)
            order.append(f"{name} end")

    async def batch():
        async with turns.exclusive():
            order.append("batch start")
            await asyncio.sleep(0.05)
            order.append("batch end")

    first = asyncio.create_task(write("a", 0.05))
    await asyncio.sleep(0.01)
    exclusive = asyncio.create_task(batch())
    await asyncio.sleep(0.01)
    later = asyncio.create_task(write("b", 0))
    await asyncio.gather(first, exclusive, later)
    assert order == ["a start", "a end", "batch start", "batch end", "b start", "b end"]


async def test_tenants_never_see_each_other(tmp_path):
    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    await index.upsert("globex", [DocumentInput("warsaw", "Warsaw", "Globex notes on Warsaw.")])
    for mode in (SearchMode.BM25, SearchMode.VECTOR, SearchMode.HYBRID, SearchMode.PREFILTER):
        found = await index.search(Visibility("globex"), SearchQuery("Warsaw capital", 10, mode))
        assert (
            ids(found) == ["warsaw"]
            and "Globex"
            in (
                await index.search(
                    Visibility("globex"), SearchQuery("Warsaw", 1, mode, include_text=True)
                )
            )
            .hits[0]
            .text
        )
        nobody = await index.search(Visibility("initech"), SearchQuery("Warsaw", 10, mode))
        assert ids(nobody) == []


async def test_acl_scopes_and_attributes_are_hard_filters(tmp_path):
    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    for mode in (SearchMode.BM25, SearchMode.VECTOR, SearchMode.HYBRID, SearchMode.PREFILTER):
        public = await index.search(ACME, SearchQuery("salary bands engineering", 10, mode))
        assert "salary" not in ids(public)
        hr = Visibility("acme", frozenset({"hr"}))
        assert "salary" in ids(await index.search(hr, SearchQuery("salary bands", 10, mode)))
        english = Visibility("acme", attributes=(("lang", "en"),))
        assert ids(await index.search(english, SearchQuery("capital current", 10, mode))) == [
            "tesla"
        ]


async def test_revoked_scope_disappears(tmp_path):
    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    hr = Visibility("acme", frozenset({"hr"}))
    await index.upsert(
        "acme",
        [
            DocumentInput(
                "salary", "Salaries", "Salary bands of the engineering team.", acl=("finance",)
            )
        ],
    )
    for mode in (SearchMode.BM25, SearchMode.VECTOR, SearchMode.HYBRID):
        assert "salary" not in ids(await index.search(hr, SearchQuery("salary bands", 10, mode)))


async def test_delete_and_not_found(tmp_path):
    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    result = await index.delete("acme", ["paris", "nope"])
    assert (result.deleted, result.not_found) == (1, 1)
    for mode in (SearchMode.BM25, SearchMode.VECTOR, SearchMode.HYBRID):
        assert "paris" not in ids(await index.search(ACME, SearchQuery("Paris Seine", 10, mode)))


async def test_the_documents_a_delete_or_an_overwrite_replaced_are_told(tmp_path):
    """What forget_notices.py sends to rerank and generation: ids whose old text is gone
    (deleted, or overwritten), never ids written for the first time or absent."""
    vectors = EdgeVectorIndex(tmp_path / "vectors", DIM, tmp_path / "write.log")
    told: list[tuple[str, list[str]]] = []
    index = RetrievalIndex(
        tmp_path, vectors, IndexSettings(dim=DIM), toy_embed, lambda t, ids: told.append((t, ids))
    )
    index.replay()
    await index.upsert("acme", DOCS)
    await index.upsert("globex", DOCS[:1])
    assert told == []  # all new
    await index.upsert("acme", [DOCS[0], DocumentInput("fresh", "", "new text")])
    await index.delete("acme", ["paris", "absent"])
    assert told == [("acme", ["warsaw"]), ("acme", ["paris"])]
    index.close()


async def test_restart_replays_without_duplicates(tmp_path):
    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    await index.upsert("acme", [DocumentInput("warsaw", "Warsaw", "Warsaw, updated text.")])
    index.close()
    reopened = open_index(tmp_path)
    assert reopened.applied_seq == 2
    assert reopened.bm25.count(ACME) == 3  # salary is hr-only
    hits = (
        await reopened.search(ACME, SearchQuery("Warsaw", 10, SearchMode.BM25, include_text=True))
    ).hits
    assert [h.text for h in hits if h.id == "warsaw"] == ["Warsaw, updated text."]
    (tmp_path / "state.json").unlink()  # BM25 rebuilt from the log: versions survive it
    reopened.close()
    rebuilt = open_index(tmp_path)
    hits = (await rebuilt.search(ACME, SearchQuery("Warsaw Paris", 10, SearchMode.BM25))).hits
    assert {h.id: h.version for h in hits} == {"warsaw": 2, "paris": 1}


async def test_a_failed_apply_is_retried_and_a_later_write_never_skips_it(tmp_path, monkeypatch):
    from ragline_services.retrieval import index as index_module

    monkeypatch.setattr(index_module, "APPLY_RETRY_FIRST_S", 0.01, raising=False)
    index = open_index(tmp_path)
    real_apply, failed = index.bm25.apply, threading.Event()

    def apply_failing_once(upserts, deletes):
        if any(d.key.endswith("warsaw") for d in upserts) and not failed.is_set():
            failed.set()
            raise OSError("No space left on device")
        real_apply(upserts, deletes)

    monkeypatch.setattr(index.bm25, "apply", apply_failing_once)
    first = asyncio.create_task(index.upsert("acme", DOCS[:1]))  # warsaw: its apply fails
    assert await asyncio.to_thread(failed.wait, 10)
    later = await index.upsert("acme", DOCS[1:2])  # paris, logged after the failure
    assert (await first).seq == 1 and later.seq == 2
    assert index.apply_error is None
    assert "warsaw" in ids(await index.search(ACME, SearchQuery("Vistula", 10, SearchMode.BM25)))
    index.close()
    reopened = open_index(tmp_path)
    for mode in (SearchMode.BM25, SearchMode.VECTOR):
        assert {"warsaw", "paris"} <= set(
            ids(await reopened.search(ACME, SearchQuery("Warsaw Paris capital", 10, mode)))
        ), mode


async def test_replay_keeps_log_order_for_a_key_written_then_deleted(tmp_path):
    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    await index.delete("acme", ["paris"])
    await index.upsert("acme", [DocumentInput("rome", "Rome", "Rome on the Tiber river.")])
    await index.delete("acme", ["rome"])
    index.close()
    (tmp_path / "state.json").unlink()  # as if BM25 had applied nothing: replay it all
    reopened = open_index(tmp_path)
    for mode in (SearchMode.BM25, SearchMode.VECTOR):
        found = ids(await reopened.search(ACME, SearchQuery("Paris Rome river", 10, mode)))
        assert "paris" not in found and "rome" not in found, mode


async def test_bad_input(tmp_path):
    index = open_index(tmp_path)
    with pytest.raises(InvalidArgument, match=r"documents\[0\]\.vector"):
        await index.upsert("acme", [DocumentInput("a", "", "t", vector=(1.0, 2.0))])
    with pytest.raises(InvalidArgument, match=r"documents\[1\]\.id"):
        await index.upsert("acme", [DocumentInput("a", "", "t"), DocumentInput("a", "", "u")])
    with pytest.raises(InvalidArgument):
        await index.search(ACME, SearchQuery("q", 5, SearchMode.VECTOR, vector=(1.0,)))
    assert index.wal.last_seq == 0  # nothing half-written


async def test_without_a_vector_index_search_falls_back_to_bm25(tmp_path):
    index = open_index(tmp_path, exact_limit=2)
    await index.upsert("acme", DOCS)
    found = await index.search(ACME, SearchQuery("Warsaw capital", 3, SearchMode.HYBRID))
    assert found.mode_used == SearchMode.BM25 and found.fell_back
    assert found.fallback_reason == "vector_index_not_ready"
    assert ids(found)[0] == "warsaw"


async def test_build_swaps_in_hnsw_while_queries_keep_answering(tmp_path):
    index = open_index(tmp_path, exact_limit=10_000, rebuild_after=1)
    await index.upsert("acme", DOCS)
    build = asyncio.create_task(index.maybe_build())
    answered = 0
    while not build.done():
        found = await index.search(ACME, SearchQuery("Warsaw capital", 2, SearchMode.VECTOR))
        assert ids(found)[0] == "warsaw"
        answered += 1
        await asyncio.sleep(0.01)
    assert await build and answered > 0
    status = index.vectors.status()
    assert status.indexed_points == 4 and status.built_seq == 1
    await index.upsert("acme", [DocumentInput("warsaw", "Warsaw", "Renamed to Varsovia.")])
    found = await index.search(ACME, SearchQuery("Varsovia", 1, SearchMode.VECTOR))
    assert ids(found) == ["warsaw"]  # the delta overrides the shard's older version


async def test_stale_shard_copies_never_surface_whatever_k(tmp_path):
    index = open_index(tmp_path, exact_limit=10_000, rebuild_after=1)
    await index.upsert("acme", DOCS)
    assert await index.maybe_build()
    # Change every public document after the build: the shard's copies are all stale and
    # must be excluded inside the engine, not by over-fetching.
    await index.delete("acme", ["paris", "tesla"])
    await index.upsert("acme", [DocumentInput("warsaw", "Warsaw", "Renamed to Varsovia.")])
    found = await index.search(
        ACME, SearchQuery("Paris capital river Tesla", 10, SearchMode.VECTOR)
    )
    assert ids(found) == ["warsaw"]
    assert found.hits[0].version == index.applied_seq


def test_a_swapped_out_shard_closes_only_after_its_last_search(tmp_path):
    vectors = EdgeVectorIndex(tmp_path / "vectors", DIM, tmp_path / "write.log", rebuild_after=1)
    index = RetrievalIndex(tmp_path, vectors, IndexSettings(dim=DIM), toy_embed)
    asyncio.run(index.upsert("acme", DOCS))
    vectors.build(index.applied_seq)
    first_dir = vectors._shard_dir
    vectors._readers[id(vectors._shard)] = 1  # a search holding the first shard
    asyncio.run(index.upsert("acme", [DocumentInput("oslo", "Oslo", "Oslo is in Norway.")]))
    vectors.build(index.applied_seq)
    assert first_dir.exists() and len(vectors._retired) == 1
    old_shard = vectors._retired[0][0]
    vectors._readers.pop(id(old_shard))
    vectors._release_retired()
    assert not first_dir.exists() and not vectors._retired
    hits = vectors.search(toy_vector("Oslo Norway"), ACME, 1, 64)
    assert [h.pid for h in hits] == [point_id(doc_key("acme", "oslo"))]
    vectors.close()


def test_vectors_in_the_log_are_lossless_and_older_json_logs_still_read():
    from ragline_services.retrieval.documents import decode_vector, encode_vector

    values = np.random.default_rng(1).standard_normal(384).astype(np.float32)
    assert np.array_equal(decode_vector(encode_vector(values)), values)
    assert np.array_equal(decode_vector(values.tolist()), values)  # a JSON list
    assert len(encode_vector(values)) < len(str(values.tolist())) / 3


async def test_one_tenants_documents_do_not_change_another_tenants_bm25_scores(tmp_path):
    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    query = SearchQuery("capital river", 10, SearchMode.BM25)
    before = [(h.id, h.score) for h in (await index.search(ACME, query)).hits]
    # Another tenant writes many documents full of the query's words: in a shared index
    # their document frequencies would lower acme's idf, and its scores.
    await index.upsert(
        "globex",
        [
            DocumentInput(f"g{i}", "Capital", f"capital river capital river number {i}")
            for i in range(200)
        ],
    )
    after = [(h.id, h.score) for h in (await index.search(ACME, query)).hits]
    assert before and after == before


async def test_tenant_indexes_beyond_the_open_bound_are_reopened_and_still_right(tmp_path):
    vectors = EdgeVectorIndex(tmp_path / "vectors", DIM, tmp_path / "write.log")
    index = RetrievalIndex(
        tmp_path, vectors, IndexSettings(dim=DIM, bm25_max_open_tenants=2), toy_embed
    )
    index.replay()
    tenants = [f"t{i}" for i in range(5)]
    for tenant in tenants:
        await index.upsert(tenant, [DocumentInput("d", "Doc", f"words of {tenant}")])
    for tenant in tenants * 2:
        hits = (
            await index.search(Visibility(tenant), SearchQuery(tenant, 5, SearchMode.BM25))
        ).hits
        assert [h.id for h in hits] == ["d"], tenant
    assert index.bm25.opened > 2  # evicted ones were opened again
    assert index.bm25.count() == 5 and index.bm25.count_tenant("t3") == 1
    index.close()


async def test_an_index_of_the_shared_layout_is_set_aside_and_rebuilt_per_tenant(tmp_path):
    import tantivy

    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    index.close()
    # What an earlier version left: one tantivy index for every tenant in bm25/.
    builder = tantivy.SchemaBuilder()
    builder.add_text_field("key", stored=True)
    shared = tmp_path / "bm25"
    import shutil

    shutil.rmtree(shared)
    shared.mkdir()
    tantivy.Index(builder.build(), path=str(shared))
    reopened = open_index(tmp_path)
    assert list(tmp_path.glob("bm25.layout1-*"))
    found = await reopened.search(ACME, SearchQuery("Vistula", 5, SearchMode.BM25))
    assert [h.id for h in found.hits] == ["warsaw"]


async def test_a_per_tenant_index_without_the_fast_fields_is_rebuilt_from_the_log(tmp_path):
    """Layout 1 (per tenant, no point-id fast field) cannot answer a search that reads
    ids only: it is set aside and rebuilt, every document back with its version."""
    import tantivy

    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    before = {
        h.id: h.version
        for h in (await index.search(ACME, SearchQuery("Warsaw", 10, SearchMode.BM25))).hits
    }
    index.close()
    (tmp_path / "bm25" / "layout.json").unlink()  # what layout 1 left: no marker, ...
    tenant_dir = next((tmp_path / "bm25").glob("t-*"))
    shutil.rmtree(tenant_dir)
    builder = tantivy.SchemaBuilder()  # ... and the schema without pid
    builder.add_text_field("key", stored=True, tokenizer_name="raw")
    tantivy.Index(builder.build(), path=str(tenant_dir.mkdir() or tenant_dir))
    reopened = open_index(tmp_path)
    assert list(tmp_path.glob("bm25.layout1-*"))
    after = await reopened.search(ACME, SearchQuery("Warsaw", 10, SearchMode.BM25))
    assert {h.id: h.version for h in after.hits} == before


async def test_a_tenant_sees_its_own_write_numbers_and_no_global_counters(tmp_path):
    index = open_index(tmp_path)
    first = await index.upsert("acme", DOCS[:1])
    for i in range(5):  # another tenant's traffic in between
        await index.upsert("globex", [DocumentInput(f"g{i}", "", f"text {i}")])
    second = await index.upsert("acme", DOCS[1:2])
    assert (first.tenant_seq, second.tenant_seq) == (1, 2)  # not 1 and 7
    assert second.versions == [2] and second.seq == 7
    found = await index.search(ACME, SearchQuery("Paris", 5, SearchMode.BM25))
    assert found.index_version == 2 and found.hits[0].version == 2
    mine = await index.status("acme")
    assert (mine.index_version, mine.log_sequence, mine.applied_sequence) == (2, 2, 2)
    assert mine.total_documents == 0 and mine.delta_documents == 0  # operators only
    assert mine.tenant_documents == 2
    ops = await index.status("acme", operator=True)
    assert (ops.index_version, ops.log_sequence, ops.total_documents) == (7, 7, 7)
    index.close()
    reopened = open_index(tmp_path)  # the numbering survives a restart and goes on
    assert (await reopened.status("acme")).index_version == 2
    assert (await reopened.upsert("acme", DOCS[3:4])).tenant_seq == 3


async def test_logs_written_before_tenant_numbering_keep_growing_numbers(tmp_path):
    from ragline_services.retrieval.wal import WriteLog

    log = WriteLog(tmp_path / "write.log")
    record = {
        "tenant": "acme",
        "id": "old",
        "title": "",
        "text": "old text",
        "acl": [],
        "attributes": {},
        "vector": encode_vector(toy_vector("old text")),
        "version": 0,
    }
    for _ in range(3):  # the earlier format: no "tenant", no "tseq"
        await log.append({"op": "write", "upserts": [record], "deletes": []})
    log.close()
    index = open_index(tmp_path)
    hits = (await index.search(ACME, SearchQuery("old", 5, SearchMode.BM25))).hits
    assert [h.version for h in hits] == [3]
    assert (await index.upsert("acme", DOCS[:1])).tenant_seq == 4  # never below an old one


async def test_stop_words_in_a_question_do_not_rank_short_noisy_titles_first(tmp_path):
    index = open_index(tmp_path)
    await index.upsert(
        "acme",
        [
            DocumentInput("noise", "What is the of the", "An unrelated note on gardening."),
            *DOCS[:2],
        ],
    )
    found = await index.search(
        ACME, SearchQuery("What is the capital of Poland?", 3, SearchMode.BM25)
    )
    assert ids(found)[0] == "warsaw"  # not the title full of the question's stop words
    only_stop_words = await index.search(ACME, SearchQuery("what is the", 3, SearchMode.BM25))
    assert ids(only_stop_words)  # searched as it is


async def test_an_index_without_its_key_map_is_rebuilt_from_the_log(tmp_path):
    """Layout 2 had no key map, and a layout-3 index whose map is gone cannot resolve a hit:
    either is set aside and rebuilt, every document back with its version."""
    index = open_index(tmp_path)
    await index.upsert("acme", DOCS)
    before = {
        h.id: h.version
        for h in (await index.search(ACME, SearchQuery("Warsaw", 10, SearchMode.BM25))).hits
    }
    assert before
    index.close()
    (tmp_path / "bm25" / "keys.sqlite").unlink()
    reopened = open_index(tmp_path)
    assert list(tmp_path.glob("bm25.layout3-*"))
    after = await reopened.search(ACME, SearchQuery("Warsaw", 10, SearchMode.BM25))
    assert {h.id: h.version for h in after.hits} == before
    reopened.close()
    (tmp_path / "bm25" / "layout.json").write_text('{"layout": 2}')
    again = open_index(tmp_path)
    assert list(tmp_path.glob("bm25.layout2-*"))
    found = await again.search(ACME, SearchQuery("Warsaw", 10, SearchMode.BM25))
    assert {h.id: h.version for h in found.hits} == before
    again.close()


async def test_stopping_waits_for_a_write_whose_caller_went_away(tmp_path):
    index = open_index(tmp_path)
    applying = threading.Event()
    release = threading.Event()
    real_apply = index._apply_sync

    def slow_apply(*args):
        applying.set()
        release.wait(5)
        real_apply(*args)

    index._apply_sync = slow_apply
    write = asyncio.ensure_future(
        index.upsert("acme", [DocumentInput("late", "Late", "written while stopping")])
    )
    await asyncio.to_thread(applying.wait, 5)
    write.cancel()  # the caller went away; the logged write still must land
    stopping = asyncio.ensure_future(index.drain_writes())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # the apply in flight holds the stop
    release.set()
    await stopping
    index.close()
    reopened = open_index(tmp_path)
    found = await reopened.search(ACME, SearchQuery("written while stopping", 1, SearchMode.BM25))
    assert [h.id for h in found.hits] == ["late"]
    reopened.close()


CHINESE = [
    DocumentInput(
        "kv", "KV Cache 设计", "高频 query 的 KV Cache 存放在 Redis 中，TTL 为 10 分钟。"
    ),
    DocumentInput(
        "hnsw", "检索笔记", "HNSW 重建期间为了不阻塞查询，采用双缓冲索引，新索引后台构建。"
    ),
    DocumentInput("river", "长江", "长江是中国第一长河，全长约6300公里，最终在上海注入东海。"),
    DocumentInput("paris", "Paris", "Paris is the capital of France on the Seine river."),
]


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("长江在哪里注入东海？", "river"),  # Chinese
        ("HNSW 重建会阻塞查询吗", "hnsw"),  # mixed, spaced
        ("HNSW重建", "hnsw"),  # mixed, unspaced
        ("KV Cache 的 TTL 是多少", "kv"),
        ("Which river flows through Paris?", "paris"),  # English beside them
    ],
)
async def test_chinese_and_mixed_questions_find_their_passage_in_bm25(tmp_path, question, expected):
    index = open_index(tmp_path)
    await index.upsert("acme", CHINESE)
    assert ids(await index.search(ACME, SearchQuery(question, 1, SearchMode.BM25))) == [expected]
    index.close()


class FirstAnalysis(Analyzer):
    """How indexes were made before Chinese segmentation (analysis 1): tantivy's en_stem
    over the raw text, where a run of Chinese between punctuation was one token."""

    def document_tokens(self, text):
        self._segmenter()
        return [(word, 0, 0) for word in self._english.analyze(text)]


async def test_an_index_made_by_the_old_analysis_answers_and_is_reindexed(tmp_path):
    """An index built before Chinese segmentation keeps answering English as before, and
    `reanalyse` (started in the background at start) re-indexes it from the log, after
    which Chinese questions find their passage."""
    import json

    index = open_index(tmp_path)
    index.bm25.analyzer = FirstAnalysis()  # the tenant's index is made with it
    await index.upsert("acme", CHINESE)
    marker = tmp_path / "bm25" / "t-acme" / "analysis.json"
    marker.write_text(json.dumps({"analysis": 1}))
    index.close()

    index = open_index(tmp_path)
    # Words alone: a translation of the Chinese question would find the English passages.
    index.bm25.translation_weight = 0

    async def top(question: str) -> list[str]:
        return ids(await index.search(ACME, SearchQuery(question, 1, SearchMode.BM25)))

    assert await top("Which river flows through Paris?") == ["paris"]
    assert await top("哪条河注入东海？") == []  # the old index holds sentences, not words
    assert index.bm25.outdated_tenants() == ["acme"]
    assert await index.compaction.reanalyse() == 1
    assert await top("哪条河注入东海？") == ["river"]
    assert await top("Which river flows through Paris?") == ["paris"]
    assert index.bm25.outdated_tenants() == []
    assert await index.compaction.reanalyse() == 0
    index.close()


async def test_bm25_finds_a_passage_in_the_other_language_through_its_translations(tmp_path):
    """An English question shares no word with a Chinese passage, and the reverse; the
    query's translations (the Chinese-English lexicon) find it, weighing less than the
    query's own words."""
    index = open_index(tmp_path)
    await index.upsert(
        "acme",
        [
            *DOCS,
            DocumentInput("yangtze", "长江", "长江是中国第一长河，最终在上海注入东海。"),
            DocumentInput("rhine", "Rhine", "The Rhine rises in the Swiss Alps."),
        ],
    )
    english = await index.search(
        ACME, SearchQuery("Which sea does the Yangtze River reach?", 3, SearchMode.BM25)
    )
    assert ids(english)[0] == "yangtze"
    chinese = await index.search(ACME, SearchQuery("莱茵河发源于哪里？", 3, SearchMode.BM25))
    assert ids(chinese)[0] == "rhine"
    # words written alike still lead: an English query naming Warsaw finds Warsaw first
    same = await index.search(
        ACME, SearchQuery("Which river flows through Warsaw?", 3, SearchMode.BM25)
    )
    assert ids(same)[0] == "warsaw"
    index.bm25.translation_weight = 0  # off: the other language is not found
    assert "yangtze" not in ids(
        await index.search(
            ACME, SearchQuery("Which sea does the Yangtze River reach?", 3, SearchMode.BM25)
        )
    )
