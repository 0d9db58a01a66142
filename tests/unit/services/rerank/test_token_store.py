"""The rerank token vectors on disk (real SQLite in a temp dir)."""

from __future__ import annotations

import numpy as np

from ragline_services.rerank.models import quantize
from ragline_services.rerank.token_store import TokenStore, store_name


def entry(tokens: int, seed: int):
    return quantize(np.random.default_rng(seed).normal(size=(tokens, 16)).astype(np.float32))


async def test_entries_come_back_as_written_and_only_by_their_own_key(tmp_path):
    store = TokenStore(tmp_path / store_name("m@1", 16, 7), max_bytes=1 << 20)
    await store.open()
    written = entry(5, 1)
    await store.put_many({("acme", "d1", "x"): written})
    found = await store.get_many([("acme", "d1", "x"), ("globex", "d1", "x"), ("acme", "d1", "y")])
    assert list(found) == [("acme", "d1", "x")]  # another tenant, another text: nothing
    rows, scales = found[("acme", "d1", "x")]
    assert np.array_equal(rows, written[0]) and np.array_equal(scales, written[1])
    store.close()
    again = TokenStore(tmp_path / store_name("m@1", 16, 7), max_bytes=1 << 20)
    await again.open()  # across a restart
    assert ("acme", "d1", "x") in await again.get_many([("acme", "d1", "x")])
    assert again.bytes == written[0].nbytes + written[1].nbytes
    again.close()


async def test_the_bound_drops_the_least_recently_used_first(tmp_path):
    one = entry(10, 0)
    size = one[0].nbytes + one[1].nbytes
    store = TokenStore(tmp_path / "tokens-a.sqlite", max_bytes=2 * size)
    await store.open()
    await store.put_many({("acme", "old", "x"): one})
    await store.put_many({("acme", "mid", "x"): entry(10, 1)})
    await store.put_many({("acme", "new", "x"): entry(10, 2)})
    keys = [("acme", name, "x") for name in ("old", "mid", "new")]
    assert set(await store.get_many(keys)) == {keys[1], keys[2]}
    assert store.bytes == 2 * size
    store.close()


async def test_another_models_file_is_removed_and_a_damaged_one_set_aside(tmp_path):
    other = tmp_path / store_name("m@1", 16, 7)
    other.write_bytes(b"vectors of another model")
    mine = tmp_path / store_name("m@2", 16, 7)
    mine.write_bytes(b"this is not a database, nor was it ever")
    store = TokenStore(mine, max_bytes=1 << 20)
    await store.open()
    assert not other.exists()
    assert list(tmp_path.glob(f"{mine.name}.damaged-*"))
    await store.put_many({("acme", "d", "x"): entry(3, 0)})
    assert await store.get_many([("acme", "d", "x")])
    store.close()


async def test_an_entry_unused_past_its_retention_leaves_the_file(tmp_path, monkeypatch):
    import time as clock

    from ragline_services.rerank import token_store

    path = tmp_path / "tokens-a.sqlite"
    store = TokenStore(path, max_bytes=1 << 20, retention_s=3600)
    await store.open()
    gone, kept = entry(8, 3), entry(8, 4)
    await store.put_many({("acme", "deleted-doc", "x"): gone})
    marker = gone[0].tobytes()[:64]
    later = clock.time() + 7200
    monkeypatch.setattr(token_store.time, "time", lambda: later)  # two hours on
    await store.put_many({("acme", "live-doc", "x"): kept})  # a write sweeps
    assert not await store.get_many([("acme", "deleted-doc", "x")])
    assert await store.get_many([("acme", "live-doc", "x")])
    assert store.bytes == kept[0].nbytes + kept[1].nbytes
    store.close()
    # Zeroed, not only unlinked from the table: its bytes are in no file of the store.
    assert not any(marker in f.read_bytes() for f in tmp_path.iterdir() if f.is_file())


async def test_forgetting_a_document_leaves_no_byte_of_its_vectors_in_any_file(tmp_path):
    """ForgetDocuments: every text of the ids goes, of that tenant only, and while the
    store stays open (the write-ahead file emptied too, not only the table)."""
    store = TokenStore(tmp_path / "tokens-a.sqlite", max_bytes=1 << 20)
    await store.open()
    old, new, others = entry(8, 5), entry(8, 6), entry(8, 7)
    await store.put_many({("acme", "doc", "v1"): old})
    await store.put_many({("acme", "doc", "v2"): new, ("globex", "doc", "v1"): others})
    await store.put_many({("acme", "kept", "x"): entry(8, 8)})
    assert await store.forget("acme", ["doc", "never-written"]) == 2
    assert not await store.get_many([("acme", "doc", "v1"), ("acme", "doc", "v2")])
    assert await store.get_many([("globex", "doc", "v1"), ("acme", "kept", "x")])
    files = [f.read_bytes() for f in tmp_path.iterdir() if f.is_file()]
    for vectors in (old, new):
        assert not any(vectors[0].tobytes()[:64] in data for data in files)
    assert any(others[0].tobytes()[:64] in data for data in files)
    store.close()
