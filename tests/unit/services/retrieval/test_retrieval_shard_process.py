"""The HNSW shard searched in a child process: the same answers as in process (filters,
the delta's shadows, exact search among ids), a dead child restarted under the search that
found it dead, builds swapped in there, and nothing left running after close."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from test_retrieval_index import DIM, DOCS, toy_embed, toy_vector

from ragline.vocabulary import SearchMode
from ragline_services.retrieval.documents import Visibility, doc_key, point_id
from ragline_services.retrieval.index import RetrievalIndex
from ragline_services.retrieval.index_types import DocumentInput, IndexSettings, SearchQuery
from ragline_services.retrieval.shard_process import ShardProcess, ShardQuery
from ragline_services.retrieval.vectors import EdgeVectorIndex

MORE = [
    DocumentInput(
        f"city{i}",
        f"City {i}",
        f"City {i} lies on river {i % 7} in region {i % 3}.",
        acl=("eng",) if i % 4 == 0 else (),
        attributes={"region": str(i % 3)},
    )
    for i in range(40)
]


def built_index(path, search_process: bool) -> tuple[RetrievalIndex, EdgeVectorIndex]:
    vectors = EdgeVectorIndex(
        path / "vectors", DIM, path / "write.log", search_process=search_process
    )
    index = RetrievalIndex(path, vectors, IndexSettings(dim=DIM), toy_embed)
    index.replay()
    asyncio.run(index.upsert("acme", DOCS + MORE))
    vectors.build(index.applied_seq)
    # After the build: newer versions and a delete live in the delta and shadow the shard.
    asyncio.run(index.upsert("acme", [DocumentInput("city5", "City 5", "Moved to the coast.")]))
    asyncio.run(index.delete("acme", ["city6"]))
    return index, vectors


QUERIES = [
    (Visibility("acme"), SearchQuery("city on river 3", 8, SearchMode.VECTOR)),
    (
        Visibility("acme", frozenset({"eng"})),
        SearchQuery("city river region", 10, SearchMode.HYBRID),
    ),
    (
        Visibility("acme", attributes=(("region", "1"),)),
        SearchQuery("river", 10, SearchMode.VECTOR),
    ),
    (Visibility("acme"), SearchQuery("city region 2", 5, SearchMode.PREFILTER)),
    (Visibility("globex"), SearchQuery("city", 5, SearchMode.VECTOR)),
]


def answers(index: RetrievalIndex) -> list[tuple[int, list]]:
    """Per query: how many hits, and the (score, ids, versions) of each score above the
    lowest one returned (the toy vectors tie, and two shards may cut a tie differently)."""
    out = []
    for visibility, query in QUERIES:
        hits = asyncio.run(index.search(visibility, query)).hits
        scores = sorted({round(h.score, 5) for h in hits}, reverse=True)
        groups = [
            (score, sorted((h.id, h.version) for h in hits if round(h.score, 5) == score))
            for score in scores[:-1]
        ]
        out.append((len(hits), groups))
    return out


def test_the_child_process_answers_as_the_shard_in_process(tmp_path):
    local, _ = built_index(tmp_path / "local", search_process=False)
    remote, vectors = built_index(tmp_path / "remote", search_process=True)
    assert isinstance(vectors._shard, ShardProcess)
    expected = answers(local)
    assert expected[0][0] == 8 and expected[4] == (0, [])  # another tenant sees nothing
    seen = {i for _, groups in expected for _, hits in groups for i, _ in hits}
    assert seen and "city6" not in seen  # deleted after the build: the delta shadows it
    assert answers(remote) == expected
    local.close()
    remote.close()


def test_a_dead_child_is_restarted_under_the_search_that_found_it(tmp_path):
    index, vectors = built_index(tmp_path, search_process=True)
    before = answers(index)
    shard = vectors._shard
    shard._process.kill()
    shard._process.wait(5)
    assert answers(index) == before
    assert shard.restarts == 1
    index.close()
    assert shard._process is None  # stopped, nothing left running


def test_a_build_loads_the_new_shard_in_a_new_child_and_stops_the_old_one(tmp_path):
    index, vectors = built_index(tmp_path, search_process=True)
    first = vectors._shard
    asyncio.run(index.upsert("acme", [DocumentInput("oslo", "Oslo", "Oslo is in Norway.")]))
    vectors.build(index.applied_seq)
    assert isinstance(vectors._shard, ShardProcess) and vectors._shard is not first
    assert vectors._shard.path == str(vectors._shard_dir)
    assert first._process is None and not Path(first.path).exists()  # stopped, removed
    hits = vectors.search(toy_vector("Oslo Norway"), Visibility("acme"), 1, 64)
    assert [h.pid for h in hits] == [point_id(doc_key("acme", "oslo"))]
    index.close()


def test_an_engine_error_in_the_child_is_raised_where_the_search_asked(tmp_path):
    with pytest.raises(RuntimeError, match="shard process"):
        ShardProcess(str(tmp_path / "no-shard-here"))
    index, vectors = built_index(tmp_path / "index", search_process=True)
    shard = vectors._shard
    wrong = ShardQuery(np.ones(DIM + 3, dtype=np.float32), "acme", ("",), (), 5, 16)
    with pytest.raises(RuntimeError, match="shard process"):
        shard.query(wrong)
    assert shard.restarts == 0  # an error is an answer: the child lives on
    assert answers(index)[0][0] == 8
    index.close()


class RecordingShard:
    """Wraps a shard to keep the queries it is sent."""

    def __init__(self, shard) -> None:
        self.shard, self.queries = shard, []

    def query(self, query: ShardQuery):
        self.queries.append(query)
        return self.shard.query(query)

    def close(self) -> None:
        self.shard.close()


def excluded_by_next_search(vectors: EdgeVectorIndex) -> set[int]:
    recording = RecordingShard(vectors._shard)
    vectors._shard = recording
    vectors.search(toy_vector("city river"), Visibility("acme"), 5, 64)
    vectors._shard = recording.shard
    return set(recording.queries[-1].exclude)


def test_the_shard_query_excludes_only_the_delta_keys_the_shard_holds(tmp_path):
    index, vectors = built_index(tmp_path, search_process=False)
    # city5 (updated) and city6 (deleted) are in the shard; oslo is new since the build.
    asyncio.run(index.upsert("acme", [DocumentInput("oslo", "Oslo", "Oslo is in Norway.")]))
    stale = {point_id(doc_key("acme", "city5")), point_id(doc_key("acme", "city6"))}
    assert excluded_by_next_search(vectors) == stale
    hits = vectors.search(toy_vector("Oslo Norway"), Visibility("acme"), 1, 64)
    assert [h.pid for h in hits] == [point_id(doc_key("acme", "oslo"))]  # from the delta
    index.close()
    # A shard built before its ids were recorded: every delta key is excluded, as before.
    (vectors._shard_dir / "point_ids.npy").unlink()
    reopened = EdgeVectorIndex(tmp_path / "vectors", DIM, tmp_path / "write.log")
    index = RetrievalIndex(tmp_path, reopened, IndexSettings(dim=DIM), toy_embed)
    index.replay()
    assert excluded_by_next_search(reopened) == stale | {point_id(doc_key("acme", "oslo"))}
    index.close()
