"""BM25 with other k1 and b than Tantivy's: its candidates scored again from its own term
statistics reproduce its scores for its own parameters, and move as BM25 says for others."""

from __future__ import annotations

import pytest

from ragline_services.retrieval.bm25 import Bm25Index
from ragline_services.retrieval.bm25_params import TANTIVY, Bm25Params
from ragline_services.retrieval.documents import StoredDocument, Visibility, doc_key, point_id

DOCS = {
    # "vistula" three times in a long text, against both words once in a short one
    "long": ("Rivers", "the vistula " * 3 + "flows north through many towns and fields " * 4),
    "short": ("Warsaw", "The Vistula river in Warsaw"),
    "other": ("Paris", "The Seine flows through Paris"),
}


class ForcedRescore(Bm25Params):
    @property
    def native(self) -> bool:
        return False


@pytest.fixture
def index(tmp_path):
    made = Bm25Index(tmp_path)
    made.apply(
        [
            StoredDocument("t", key, title, text, (), {}, None, 1)
            for key, (title, text) in DOCS.items()
        ],
        [],
    )
    yield made
    made.close()


def scores(index: Bm25Index, params: Bm25Params, query: str) -> dict[str, float]:
    index.params = params
    pids = {point_id(doc_key("t", key)): key for key in DOCS}
    return {pids[c.pid]: c.score for c in index.search(query, Visibility("t"), 3)}


@pytest.mark.parametrize("query", ["vistula river", "Vistula 华沙"])  # the second: a boost
def test_tantivys_own_parameters_scored_again_are_its_scores(index, query):
    native = scores(index, TANTIVY, query)
    again = scores(index, ForcedRescore(1.2, 0.75), query)
    assert native.keys() == again.keys()
    assert all(again[key] == pytest.approx(native[key], rel=1e-4) for key in native)


def test_other_parameters_move_scores_as_bm25_says(index):
    native = scores(index, TANTIVY, "vistula")
    # b = 0: no length normalisation, so the long text's three occurrences win outright
    flat = scores(index, Bm25Params(1.2, 0.0), "vistula")
    assert flat["long"] > flat["short"]
    assert native["long"] / native["short"] < flat["long"] / flat["short"]
    # a higher k1 saturates term frequency later: repetition weighs more (lengths aside)
    steep = scores(index, Bm25Params(3.0, 0.0), "vistula")
    assert steep["long"] / steep["short"] > flat["long"] / flat["short"]


def test_a_pool_deeper_than_k_only_when_scoring_again():
    assert TANTIVY.native and TANTIVY.pool(50) == 50
    assert Bm25Params(1.5, 0.75).pool(50) == 200 and Bm25Params(1.5).pool(500) == 500
