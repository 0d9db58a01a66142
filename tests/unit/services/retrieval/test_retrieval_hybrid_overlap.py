"""HYBRID runs its two halves at once: BM25 on a thread of its own while the vector search
runs (Tantivy releases the GIL while it searches), and the fused ranking is the one the
halves give one after the other. With query text to embed, BM25 (HYBRID's half, PREFILTER's
pool) searches while the text is embedded, with the same results."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
from test_retrieval_hit_resolution import RIVERS, open_index, toy_embed

from ragline.errors import Unavailable
from ragline.vocabulary import SearchMode
from ragline_services.retrieval.documents import Visibility
from ragline_services.retrieval.index import RetrievalIndex
from ragline_services.retrieval.index_types import SearchQuery


def meet_inside(index: RetrievalIndex) -> threading.Barrier:
    """Both engines' searches wait at one barrier: a HYBRID search that ran them one after
    the other would break it (BrokenBarrierError) instead of answering."""
    barrier = threading.Barrier(2, timeout=5)
    bm25_search, vector_search = index.bm25.search, index.vectors.search

    def bm25(*args):
        barrier.wait()
        return bm25_search(*args)

    def vector(*args):
        barrier.wait()
        return vector_search(*args)

    index.bm25.search, index.vectors.search = bm25, vector
    return barrier


def test_hybrid_searches_bm25_while_the_vector_half_runs(tmp_path):
    index = open_index(tmp_path)
    asyncio.run(index.upsert("acme", RIVERS))
    query = SearchQuery("river flows through town 7", 5, SearchMode.HYBRID, candidates=60)
    one_after_the_other = dataclasses.replace(index.settings, parallel_hybrid=False)
    settings, index.settings = index.settings, one_after_the_other
    expected = asyncio.run(index.search(Visibility("acme"), query))
    index.settings = settings
    meet_inside(index)
    found = asyncio.run(index.search(Visibility("acme"), query))
    assert found.mode_used == SearchMode.HYBRID and not found.fell_back
    assert [(h.id, h.score) for h in found.hits] == [(h.id, h.score) for h in expected.hits]
    assert {"bm25", "vector", "fusion", "resolve"} <= {name for name, _ in found.stages}
    index.close()


def test_many_concurrent_hybrid_searches_never_wait_on_each_other(tmp_path):
    """More searches in flight than either pool has threads: the BM25 halves have a pool
    of their own, so a search never waits for a thread held by a search waiting on it."""
    index = open_index(tmp_path)
    asyncio.run(index.upsert("acme", RIVERS))

    async def many():
        queries = [SearchQuery(f"river town {i}", 3, SearchMode.HYBRID) for i in range(24)]
        return await asyncio.wait_for(
            asyncio.gather(*(index.search(Visibility("acme"), q) for q in queries)), 30
        )

    results = asyncio.run(many())
    assert all(len(r.hits) == 3 and r.mode_used == SearchMode.HYBRID for r in results)
    index.close()


@pytest.mark.parametrize("mode", [SearchMode.HYBRID, SearchMode.PREFILTER])
def test_bm25_searches_while_the_query_text_is_embedded(tmp_path, mode):
    index = open_index(tmp_path)
    asyncio.run(index.upsert("acme", RIVERS))
    text = "river flows through town 7"
    vector = asyncio.run(toy_embed([text], "query")).vectors[0].tolist()
    query = SearchQuery(text, 5, mode, candidates=60)
    # With the vector sent, nothing is embedded: the ranking the overlap must give.
    expected = asyncio.run(
        index.search(Visibility("acme"), dataclasses.replace(query, vector=vector))
    )
    # The embedding and the BM25 search meet at a barrier: embedding first and searching
    # BM25 after would break it (BrokenBarrierError from the embed) instead of answering.
    barrier = threading.Barrier(2, timeout=5)
    bm25_search = index.bm25.search

    def bm25(*args):
        barrier.wait()
        return bm25_search(*args)

    async def embed(texts, kind):
        await asyncio.to_thread(barrier.wait)
        return await toy_embed(texts, kind)

    index.bm25.search, index._embed = bm25, embed
    found = asyncio.run(index.search(Visibility("acme"), query))
    assert found.mode_used == mode and not found.fell_back
    assert [(h.id, h.score, h.scores) for h in found.hits] == [
        (h.id, h.score, h.scores) for h in expected.hits
    ]
    # The report keeps its order: the embedding, then the engines.
    assert [name for name, _ in found.stages][:2] == [
        "embed",
        "vector" if mode == SearchMode.HYBRID else "bm25",
    ]
    assert "bm25" in {name for name, _ in found.stages}
    index.close()


def test_when_the_embedding_fails_the_early_bm25_list_answers_as_bm25_would(tmp_path):
    index = open_index(tmp_path)
    asyncio.run(index.upsert("acme", RIVERS))
    text = "river flows through town 7"
    expected = asyncio.run(index.search(Visibility("acme"), SearchQuery(text, 5, SearchMode.BM25)))

    async def down(texts, kind):
        raise Unavailable("embedding service: UNAVAILABLE")

    index._embed = down
    found = asyncio.run(
        index.search(Visibility("acme"), SearchQuery(text, 5, SearchMode.HYBRID, candidates=60))
    )
    assert found.mode_used == SearchMode.BM25 and found.fell_back
    assert found.fallback_reason == "embedding_unavailable"
    assert [(h.id, h.score) for h in found.hits] == [(h.id, h.score) for h in expected.hits]
    index.close()
