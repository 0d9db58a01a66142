"""The key map: point id -> key, version and visibility, per tenant, durable."""

from __future__ import annotations

import threading

import numpy as np

from ragline_services.retrieval.documents import StoredDocument, Visibility, doc_key, point_id
from ragline_services.retrieval.keymap import KeyMap


def doc(tenant, doc_id, version=1, acl=(), attributes=None) -> StoredDocument:
    return StoredDocument(
        tenant,
        doc_id,
        "",
        "text",
        tuple(acl),
        dict(attributes or {}),
        np.zeros(1, np.float32),
        version,
    )


def pid(tenant, doc_id) -> int:
    return point_id(doc_key(tenant, doc_id))


def test_entries_are_replaced_deleted_and_kept_apart_by_tenant(tmp_path):
    keys = KeyMap(tmp_path / "keys.sqlite")
    keys.apply("acme", [doc("acme", "a"), doc("acme", "b")], [])
    keys.apply("globex", [doc("globex", "a")], [])
    keys.apply("acme", [doc("acme", "a", version=2)], [doc_key("acme", "b")])
    found = keys.lookup("acme", [pid("acme", "a"), pid("acme", "b"), pid("globex", "a")])
    assert {p: (e.key, e.version) for p, e in found.items()} == {
        pid("acme", "a"): (doc_key("acme", "a"), 2)
    }  # b deleted; globex's own point never answers for acme
    assert keys.count("acme") == 1 and keys.count("globex") == 1
    keys.close()
    reopened = KeyMap(tmp_path / "keys.sqlite")  # durable
    assert reopened.lookup("globex", [pid("globex", "a")])[pid("globex", "a")].version == 1
    reopened.close()


def test_visibility_is_any_scope_and_every_attribute(tmp_path):
    keys = KeyMap(tmp_path / "keys.sqlite")
    keys.apply(
        "acme",
        [
            doc("acme", "public"),
            doc("acme", "hr", acl=("hr", "finance")),
            doc("acme", "en", attributes={"lang": "en", "team": "x"}),
        ],
        [],
    )
    entries = keys.lookup("acme", [pid("acme", d) for d in ("public", "hr", "en")])
    visible = {
        name: sorted(e.key.split("\x1f")[1] for e in entries.values() if e.visible_to(visibility))
        for name, visibility in {
            "anyone": Visibility("acme"),
            "finance": Visibility("acme", frozenset({"finance"})),
            "lang=en": Visibility("acme", attributes=(("lang", "en"),)),
            "lang=de": Visibility("acme", attributes=(("lang", "de"),)),
        }.items()
    }
    assert visible == {
        "anyone": ["en", "public"],
        "finance": ["en", "hr", "public"],
        "lang=en": ["en"],
        "lang=de": [],
    }
    keys.close()


def test_many_ids_at_once_and_reads_from_several_threads(tmp_path):
    keys = KeyMap(tmp_path / "keys.sqlite")
    keys.apply("acme", [doc("acme", str(i)) for i in range(2500)], [])
    wanted = [pid("acme", str(i)) for i in range(2500)]
    results: list[int] = []

    def read() -> None:
        results.append(len(keys.lookup("acme", wanted)))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [2500] * 4  # more ids than one statement may carry
    keys.close()
