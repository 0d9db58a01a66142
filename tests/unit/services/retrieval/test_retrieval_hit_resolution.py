"""Hit resolution: a search ranks on point ids alone, resolves the k hits it returns from
the key map, and reads stored documents only for text it was asked for; visibility filters
select without moving a score; resolving never reveals a document the caller may not see,
even while an engine has not applied a narrowed acl or a delete yet."""

from __future__ import annotations

import asyncio
import hashlib
import re

import numpy as np

from ragline.vocabulary import SearchMode
from ragline_services.retrieval.documents import Visibility, doc_key, point_id
from ragline_services.retrieval.index import RetrievalIndex
from ragline_services.retrieval.index_types import (
    DocumentInput,
    Embedded,
    IndexSettings,
    SearchQuery,
)
from ragline_services.retrieval.vectors import EdgeVectorIndex

DIM = 32


async def toy_embed(texts: list[str], kind: str) -> Embedded:
    out = np.zeros((len(texts), DIM), dtype=np.float32)
    for row, text in enumerate(texts):
        for word in re.findall(r"\w+", text.lower()):
            out[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % DIM] += 1.0
    return Embedded(out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9), "toy-1")


RIVERS = [
    DocumentInput(f"r{i}", f"River {i}", f"The river number {i} flows through town {i}.")
    for i in range(60)
]


def open_index(path) -> RetrievalIndex:
    vectors = EdgeVectorIndex(path / "vectors", DIM, path / "write.log")
    index = RetrievalIndex(path, vectors, IndexSettings(dim=DIM), toy_embed)
    index.replay()
    return index


class CountingSearcher:
    """The tenant index's searcher with its stored-document loads counted."""

    def __init__(self, searcher, loads: list) -> None:
        self._searcher, self._loads = searcher, loads

    def doc(self, address):
        self._loads.append(address)
        return self._searcher.doc(address)

    def __getattr__(self, name):
        return getattr(self._searcher, name)


class CountingIndex:
    def __init__(self, index, loads: list) -> None:
        self._index, self._loads = index, loads

    def searcher(self):
        return CountingSearcher(self._index.searcher(), self._loads)

    def __getattr__(self, name):
        return getattr(self._index, name)


def count_loads(index: RetrievalIndex, tenant: str) -> list:
    loads: list = []
    tenant_index = index.bm25._tenant(tenant, create=False)
    tenant_index.index = CountingIndex(tenant_index.index, loads)
    return loads


def test_a_search_loads_stored_documents_only_for_the_text_it_returns(tmp_path):
    index = open_index(tmp_path)
    asyncio.run(index.upsert("acme", RIVERS))
    loads = count_loads(index, "acme")
    for mode in (SearchMode.BM25, SearchMode.HYBRID):
        loads.clear()
        query = SearchQuery("river flows through town", 5, mode, candidates=60)
        found = asyncio.run(index.search(Visibility("acme"), query))
        assert len(found.hits) == 5 and all(h.version == 1 for h in found.hits)
        assert {h.id for h in found.hits} <= {d.id for d in RIVERS}
        assert loads == [], mode  # keys and versions come from the key map
    loads.clear()
    query = SearchQuery("river", 3, SearchMode.BM25, include_text=True)
    hits = asyncio.run(index.search(Visibility("acme"), query)).hits
    assert all(h.text.startswith("The river number") for h in hits) and len(loads) == 3
    index.close()


def test_visibility_filters_select_without_moving_scores(tmp_path):
    index = open_index(tmp_path)
    docs = [
        DocumentInput("a", "", "alpha beta gamma", attributes={"lang": "en", "team": "x"}),
        DocumentInput("b", "", "alpha delta", acl=("eng",), attributes={"lang": "en"}),
    ]
    asyncio.run(index.upsert("acme", docs))
    plain = asyncio.run(
        index.search(
            Visibility("acme", frozenset({"eng"})), SearchQuery("alpha", 5, SearchMode.BM25)
        )
    )
    narrowed = asyncio.run(
        index.search(
            Visibility("acme", frozenset({"eng", "ops"}), (("lang", "en"),)),
            SearchQuery("alpha", 5, SearchMode.BM25),
        )
    )
    scores = {h.id: h.score for h in plain.hits}
    assert {h.id: h.score for h in narrowed.hits} == scores and len(scores) == 2
    index.close()


def test_resolving_never_reveals_a_hidden_document(tmp_path):
    index = open_index(tmp_path)
    secret = DocumentInput("s", "", "salary bands", acl=("hr",))
    asyncio.run(index.upsert("acme", [secret, *RIVERS[:2]]))
    pid = point_id(doc_key("acme", "s"))
    assert index.bm25.resolve(Visibility("acme"), [pid]) == {}
    assert index.bm25.resolve(Visibility("globex", frozenset({"hr"})), [pid]) == {}
    assert index.bm25.resolve(Visibility("acme", frozenset({"hr"})), [pid])[pid].key == (
        doc_key("acme", "s")
    )
    assert index.bm25.existing("acme", [pid]) == {pid}  # deletes see every scope
    index.close()


def test_the_key_map_hides_what_an_engine_has_not_caught_up_with(tmp_path):
    """The map is applied before the engines: a hit an engine still returns under an old
    acl, or after a delete, is dropped by the map's check."""
    index = open_index(tmp_path)
    asyncio.run(index.upsert("acme", RIVERS[:3]))
    query = SearchQuery("river flows through town", 5, SearchMode.BM25)
    assert len(asyncio.run(index.search(Visibility("acme"), query)).hits) == 3
    narrowed = next(iter(_stored(index, "acme", "r0")))
    # Only the map knows: r0 is now for "hr" only, r1 is deleted (the engines still have both).
    index.bm25.keys.apply("acme", [_with_acl(narrowed, ("hr",))], [doc_key("acme", "r1")])
    hits = asyncio.run(index.search(Visibility("acme"), query)).hits
    assert [h.id for h in hits] == ["r2"]
    hr = asyncio.run(index.search(Visibility("acme", frozenset({"hr"})), query)).hits
    assert sorted(h.id for h in hr) == ["r0", "r2"]
    with_text = SearchQuery("river flows through town", 5, SearchMode.BM25, include_text=True)
    assert [h.id for h in asyncio.run(index.search(Visibility("acme"), with_text)).hits] == ["r2"]
    index.close()


def _stored(index: RetrievalIndex, tenant: str, doc_id: str):
    from ragline_services.retrieval.documents import StoredDocument

    for record in index.wal.replay(after_seq=0):
        for d in record.get("upserts", ()):
            if d["tenant"] == tenant and d["id"] == doc_id:
                yield StoredDocument.from_record({**d, "version": 1})


def _with_acl(doc, acl):
    import dataclasses

    return dataclasses.replace(doc, acl=acl, version=doc.version + 1)
