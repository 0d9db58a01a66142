"""What the retrieval service's Qdrant adapter relies on Qdrant to do, against any endpoint.

`RAGLINE_TEST_QDRANT_URL` (host:port of a Qdrant gRPC port; `RAGLINE_TEST_QDRANT_API_KEY`
for a keyed one) runs these against that server. Without it they run against the
stand-in (`support/fake_qdrant.py`, written to the protocol; no Qdrant server runs on the
CI machine), and a second check holds the stand-in to Qdrant's own semantics as
qdrant-client's local mode (the library's in-process implementation of Qdrant's search and
filters) computes them: the same points, the same filters, the same ids in the same order
and the same scores. Where the two may differ, written down:

- the stand-in searches exactly (a real server searches its HNSW graph, approximate once a
  segment is indexed; the adapter asks for `exact` only with an id filter), so a test
  compares a nearest neighbour only where it is unambiguous;
- `points_count` is documented as approximate on a real server: no test reads it;
- the stand-in ignores `hnsw_ef` and the HNSW settings of a new collection (it has no
  graph) and `wait=False` (every write is applied at once; the adapter always waits).

Each test works in a collection of its own (on a real server, dropped at the end).
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from ragline.processes import free_ports
from ragline_services.retrieval.documents import StoredDocument, Visibility, point_id
from ragline_services.retrieval.qdrant_server import QdrantServerIndex

pytestmark = pytest.mark.integration

DIM = 16


@pytest.fixture(scope="module")
def endpoint():
    """(url, api key) of a real Qdrant when the environment names one, else of the
    stand-in."""
    url = os.environ.get("RAGLINE_TEST_QDRANT_URL", "")
    if url:
        yield url, os.environ.get("RAGLINE_TEST_QDRANT_API_KEY", "")
        return
    from support.fake_qdrant import start_fake_qdrant

    port = free_ports(1)[0]
    server, _ = start_fake_qdrant(port)
    yield f"127.0.0.1:{port}", ""
    server.stop(0)


@pytest.fixture
def index(endpoint, tmp_path):
    url, key = endpoint
    name = f"contract-{uuid.uuid4().hex[:8]}"
    made = QdrantServerIndex(url, name, DIM, tmp_path / "state.json", api_key=key)
    yield made
    if os.environ.get("RAGLINE_TEST_QDRANT_URL"):  # the stand-in's go with its process
        from qdrant_client import grpc as q

        made._collections.Delete(q.DeleteCollection(collection_name=name), timeout=10)
    made.close()


def document(tenant: str, doc_id: str, vector, acl=(), attributes=None) -> StoredDocument:
    return StoredDocument(
        tenant=tenant,
        id=doc_id,
        title="",
        text="",
        acl=tuple(acl),
        attributes=dict(attributes or {}),
        vector=np.asarray(vector, np.float32),
        version=1,
    )


def ids(found) -> list[int]:
    return [c.pid for c in found]


def pid(tenant: str, doc_id: str) -> int:
    return point_id(document(tenant, doc_id, np.zeros(DIM)).key)


def axis(i: int, scale: float = 1.0) -> np.ndarray:
    """A unit direction, scaled: cosine does not see the scale."""
    vector = np.zeros(DIM, np.float32)
    vector[i] = scale
    return vector


def test_search_is_by_cosine_and_never_crosses_a_tenant(index):
    index.apply(
        1,
        [
            document("acme", "near", axis(0, 5.0) + axis(1, 0.5)),
            document("acme", "far", axis(1)),
            document("globex", "exact", axis(0)),
        ],
        [],
    )
    found = index.search(axis(0, 0.1), Visibility("acme"), k=5, hnsw_ef=64)
    assert ids(found) == [pid("acme", "near"), pid("acme", "far")]
    # Cosine of the directions, whatever the lengths written or asked.
    assert found[0].score == pytest.approx(5 / np.hypot(5, 0.5), abs=1e-4)
    assert found[1].score == pytest.approx(0.0, abs=1e-4)
    assert ids(index.search(axis(0), Visibility("globex"), k=5, hnsw_ef=64)) == [
        pid("globex", "exact")
    ]


def test_scopes_and_attributes_filter_before_the_limit(index):
    index.apply(
        1,
        [
            document("acme", "hr-only", axis(0), acl=("hr",)),
            document("acme", "public", axis(0) + axis(1, 0.2)),
            document("acme", "eu", axis(0) + axis(1, 0.4), attributes={"region": "eu"}),
        ],
        [],
    )
    anyone = index.search(axis(0), Visibility("acme"), k=1, hnsw_ef=64)
    assert ids(anyone) == [pid("acme", "public")]  # the closer hr point is not counted
    hr = index.search(axis(0), Visibility("acme", frozenset({"hr"})), k=1, hnsw_ef=64)
    assert ids(hr) == [pid("acme", "hr-only")]
    eu = Visibility("acme", attributes=(("region", "eu"),))
    assert ids(index.search(axis(0), eu, k=5, hnsw_ef=64)) == [pid("acme", "eu")]


def test_an_overwrite_replaces_the_vector_and_a_delete_removes_the_point(index):
    index.apply(1, [document("acme", "a", axis(0)), document("acme", "b", axis(1))], [])
    index.apply(2, [document("acme", "a", axis(2))], [])
    assert ids(index.search(axis(2), Visibility("acme"), k=1, hnsw_ef=64)) == [pid("acme", "a")]
    # Its old vector is gone: nothing points along axis 0 any more.
    old = index.search(axis(0), Visibility("acme"), k=2, hnsw_ef=64)
    assert [c.score for c in old] == pytest.approx([0.0, 0.0], abs=1e-4)
    index.apply(3, [], [document("acme", "a", axis(0)).key])
    assert ids(index.search(axis(2), Visibility("acme"), k=5, hnsw_ef=64)) == [pid("acme", "b")]


def test_an_id_filter_restricts_the_search_to_those_points(index):
    index.apply(1, [document("acme", name, axis(i)) for i, name in enumerate("abcd")], [])
    only = [pid("acme", "c"), pid("acme", "d")]
    found = index.search(axis(0), Visibility("acme"), k=5, hnsw_ef=64, only_pids=only)
    assert sorted(ids(found)) == sorted(only)


def test_a_reopened_collection_is_kept_and_its_points_with_it(endpoint, index, tmp_path):
    url, key = endpoint
    index.apply(1, [document("acme", "a", axis(0))], [])
    again = QdrantServerIndex(url, index.collection, DIM, tmp_path / "state.json", api_key=key)
    try:
        assert again.built_seq == 1  # a restart replays only what Qdrant has not seen
        assert ids(again.search(axis(0), Visibility("acme"), k=1, hnsw_ef=64)) == [pid("acme", "a")]
    finally:
        again.close()


def test_the_stand_in_searches_as_qdrant_itself_does(endpoint, tmp_path):
    """Differential: random points with tenants, scopes and attributes, written through
    the adapter to the stand-in and through qdrant-client to its local mode; every search
    of the adapter's kind gives the same ids, in the same order, with the same scores."""
    if os.environ.get("RAGLINE_TEST_QDRANT_URL"):
        pytest.skip("a real server is under test: nothing stands in for it")
    from qdrant_client import QdrantClient, models

    url, _ = endpoint
    rng = np.random.default_rng(7)
    tenants, scopes, regions = ["acme", "globex"], [(), ("hr",), ("eng",)], ["eu", "us"]
    documents = [
        document(
            tenants[i % 2],
            f"d{i}",
            rng.normal(size=DIM),
            acl=scopes[i % 3],
            attributes={"region": regions[(i // 3) % 2]},
        )
        for i in range(60)
    ]
    adapter = QdrantServerIndex(url, f"diff-{uuid.uuid4().hex[:8]}", DIM, tmp_path / "s.json")
    adapter.apply(1, documents, [])
    local = QdrantClient(":memory:")
    local.create_collection(
        "ref", vectors_config=models.VectorParams(size=DIM, distance=models.Distance.COSINE)
    )
    local.upsert(
        "ref",
        [
            models.PointStruct(
                id=point_id(d.key),
                vector=d.vector.tolist(),
                payload={
                    "tenant": d.tenant,
                    "scope": list(d.scopes),
                    "attr": d.attribute_terms,
                },
            )
            for d in documents
        ],
    )
    try:
        for n in range(20):
            query = rng.normal(size=DIM).astype(np.float32)
            visibility = Visibility(
                tenants[n % 2],
                frozenset(scopes[n % 3]),
                (("region", regions[n % 2]),) if n % 4 == 0 else (),
            )
            must = [
                models.FieldCondition(
                    key="tenant", match=models.MatchValue(value=visibility.tenant)
                ),
                models.FieldCondition(
                    key="scope", match=models.MatchAny(any=visibility.allowed_scopes)
                ),
                *(
                    models.FieldCondition(key="attr", match=models.MatchValue(value=term))
                    for term in visibility.attribute_terms
                ),
            ]
            expected = local.query_points(
                "ref",
                query=query.tolist(),
                query_filter=models.Filter(must=must),
                limit=5,
            ).points
            found = adapter.search(query, visibility, k=5, hnsw_ef=64)
            assert ids(found) == [p.id for p in expected], visibility
            assert [c.score for c in found] == pytest.approx([p.score for p in expected], abs=1e-4)
    finally:
        adapter.close()
        local.close()
