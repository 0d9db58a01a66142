"""A tenant's BM25 rewrite (the index rebuilt from its live documents) touches that
tenant's index alone, whatever the other tenants are called: `acme.old` and `acme.rewrite`
are valid tenant ids, and the rewrite's staging folders are never theirs."""

from __future__ import annotations

from ragline_services.retrieval.bm25 import Bm25Index
from ragline_services.retrieval.documents import StoredDocument, Visibility


def document(tenant: str, key: str, text: str) -> StoredDocument:
    return StoredDocument(tenant, key, "", text, (), {}, None, 1)


def test_a_rewrite_leaves_tenants_named_like_its_staging_folders_alone(tmp_path):
    index = Bm25Index(tmp_path)
    tenants = ["acme", "acme.old", "acme.rewrite", "old-acme", "rewrite-acme"]
    index.apply([document(t, "river", f"the vistula flows through {t}") for t in tenants], [])
    live = [document("acme", "river", "the vistula flows north")]
    index.rewrite({"acme"}, lambda wanted: {"acme": live})
    for tenant in tenants:
        found = index.search("vistula", Visibility(tenant), 5)
        assert len(found) == 1, tenant
        assert index.count(Visibility(tenant)) == 1, tenant
    assert sorted(index.tenants()) == sorted(tenants)
    index.close()
    # and after a restart, from the files alone
    reopened = Bm25Index(tmp_path)
    assert sorted(reopened.tenants()) == sorted(tenants)
    assert all(reopened.count(Visibility(t)) == 1 for t in tenants)
    reopened.close()
