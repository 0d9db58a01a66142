"""The hot-prefix store's decisions without an engine: keys, hotness, tenancy, integrity,
the LRU size bound and the sweep (files written here stand in for llama-server's)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ragline.cache import MemoryCache
from ragline.errors import Unavailable
from ragline_services.generation import prefix_store
from ragline_services.generation.prefix_store import PrefixStore, StoredPrefix, StoreSettings

TOKENS = list(range(1000, 1300))


def make_store(tmp_path: Path, **settings) -> PrefixStore:
    options = {"min_tokens": 8, **settings}
    return PrefixStore(MemoryCache(), StoreSettings(tmp_path / "kv", **options), "model@1|b1|f16")


async def save(store: PrefixStore, tenant: str, tokens: int, size: int = 1000) -> StoredPrefix:
    [candidate] = store.candidates(tenant, TOKENS, [tokens])
    file = store.new_file_name(candidate.key)
    (store.settings.directory / file).write_bytes(os.urandom(size))
    entry = await store.saved(tenant, candidate, file, tokens)
    assert entry is not None
    return entry


def test_keys_differ_by_tenant_engine_and_tokens(tmp_path):
    store = make_store(tmp_path)
    other_engine = PrefixStore(MemoryCache(), store.settings, "model@1|b1|q8_0")
    key = store.key("ann", TOKENS)
    assert key == store.key("ann", list(TOKENS))
    assert key != store.key("bob", TOKENS)
    assert key != other_engine.key("ann", TOKENS)
    assert key != store.key("ann", TOKENS[:-1])


def test_candidates_are_long_enough_distinct_and_longest_first(tmp_path):
    store = make_store(tmp_path, min_tokens=64)
    found = store.candidates("ann", TOKENS, [300, 100, 100, 10, 500])
    assert [c.tokens for c in found] == [300, 100]


async def test_a_prefix_is_hot_at_its_second_sighting_by_the_same_tenant(tmp_path):
    store = make_store(tmp_path)

    async def hot(tenant: str) -> bool:
        [candidate] = store.candidates(tenant, TOKENS, [100])
        await store.look_up(tenant, [candidate])
        return candidate.hot

    assert not await hot("ann")
    assert not await hot("bob")  # another tenant's sighting does not count for ann
    assert await hot("ann")


async def test_a_stored_state_is_found_for_its_tenant_only(tmp_path):
    store = make_store(tmp_path)
    await save(store, "ann", 200)
    for tenant, expected in (("ann", 200), ("bob", None)):
        [candidate] = store.candidates(tenant, TOKENS, [200])
        await store.look_up(tenant, [candidate])
        assert (candidate.stored.tokens if candidate.stored else None) == expected


async def test_an_entry_pointing_at_another_owners_state_or_any_path_is_ignored(tmp_path):
    """The shared index is not trusted as written: an entry names only a state file made
    for its own key, inside the store's directory; anything else is ignored, and no file
    it names is ever deleted."""
    store = make_store(tmp_path)
    anns = await save(store, "ann", 200)
    [bobs] = store.candidates("bob", TOKENS, [200])
    outside = tmp_path / "precious.txt"
    outside.write_text("not a state")
    for file in (anns.file, str(outside), "../precious.txt"):
        # bob's key and tenant, with ann's state (it would restore ann's evidence) or a path
        forged = StoredPrefix(**{**anns.__dict__, "key": bobs.key, "tenant": "bob", "file": file})
        await store.cache.set(store._index + bobs.key, forged.encode(), 60)
        await store.look_up("bob", [bobs])
        assert bobs.stored is None, file
    assert (store.settings.directory / anns.file).exists()


async def test_eviction_never_deletes_a_path_a_forged_entry_names(tmp_path):
    store = make_store(tmp_path, max_bytes=1500)
    outside = tmp_path / "precious.txt"
    outside.write_text("not a state")
    [bobs] = store.candidates("bob", TOKENS, [200])
    forged = StoredPrefix(bobs.key, "bob", str(outside), 200, 1000, "0" * 64, last_use=0.0)
    await store.cache.set(store._index + bobs.key, forged.encode(), 60)
    await save(store, "ann", 100, size=1000)  # over the bound: the oldest entry would go
    assert outside.read_text() == "not a state"


async def test_an_entry_naming_another_tenant_is_ignored(tmp_path):
    store = make_store(tmp_path)
    entry = await save(store, "ann", 200)
    [bobs] = store.candidates("bob", TOKENS, [200])
    forged = StoredPrefix(**{**entry.__dict__, "key": bobs.key})
    await store.cache.set(store._index + bobs.key, forged.encode(), 60)
    await store.look_up("bob", [bobs])
    assert bobs.stored is None


async def test_a_missing_file_is_a_miss_that_keeps_the_entry(tmp_path):
    store = make_store(tmp_path)
    entry = await save(store, "ann", 200)
    (store.settings.directory / entry.file).unlink()
    assert not await store.verified(entry)
    [candidate] = store.candidates("ann", TOKENS, [200])
    await store.look_up("ann", [candidate])
    assert candidate.stored is not None and store.counters.discarded == 0


async def test_a_changed_file_is_discarded_not_used(tmp_path):
    store = make_store(tmp_path)
    entry = await save(store, "ann", 200)
    assert await store.verified(entry)
    path = store.settings.directory / entry.file
    data = bytearray(path.read_bytes())
    data[500] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not await store.verified(entry)
    assert not path.exists()
    [candidate] = store.candidates("ann", TOKENS, [200])
    await store.look_up("ann", [candidate])
    assert candidate.stored is None and store.counters.discarded == 1


async def test_a_save_whose_token_count_differs_is_dropped(tmp_path):
    store = make_store(tmp_path)
    [candidate] = store.candidates("ann", TOKENS, [200])
    file = store.new_file_name(candidate.key)
    (store.settings.directory / file).write_bytes(b"x" * 100)
    assert await store.saved("ann", candidate, file, 150) is None
    assert not (store.settings.directory / file).exists()


async def test_the_size_bound_evicts_the_least_recently_used(tmp_path):
    store = make_store(tmp_path, max_bytes=2500)
    first = await save(store, "ann", 100)
    second = await save(store, "ann", 150)
    await store.used(first)  # first is now more recent than second
    third = await save(store, "ann", 200)
    names = {p.name for p in store.settings.directory.glob("*.bin")}
    assert names == {first.file, third.file}
    assert store.counters.evictions == 1 and second.file not in names


async def test_the_sweep_deletes_old_files_without_an_entry_only(tmp_path):
    store = make_store(tmp_path, ttl_s=60)
    directory = store.settings.directory
    old, young = directory / "orphan-old.bin", directory / "orphan-young.bin"
    for path in (old, young):
        path.write_bytes(b"x")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    kept = await save(store, "ann", 100)
    assert not old.exists()
    assert young.exists()  # maybe another replica's save whose entry is on its way
    assert (directory / kept.file).exists()


class BrokenCache(MemoryCache):
    async def get(self, key):
        raise Unavailable("cache get failed: connection refused")

    async def incr(self, key, ttl_s):
        raise Unavailable("cache incr failed: connection refused")


async def test_a_failing_cache_backend_is_a_miss_not_an_error(tmp_path):
    store = PrefixStore(BrokenCache(), StoreSettings(tmp_path / "kv", min_tokens=8), "m")
    [candidate] = store.candidates("ann", TOKENS, [100])
    await store.look_up("ann", [candidate])
    assert candidate.stored is None and not candidate.hot
    assert store.counters.errors == 2


@pytest.mark.parametrize("tokens", [0, 5])
def test_prefixes_shorter_than_the_minimum_are_not_candidates(tmp_path, tokens):
    assert make_store(tmp_path).candidates("ann", TOKENS, [tokens]) == []


async def test_forgetting_a_source_drops_the_states_that_named_it_for_that_tenant_only(tmp_path):
    store = make_store(tmp_path)

    async def save_naming(owner: str, tokens: int, sources: tuple[str, ...]) -> StoredPrefix:
        [candidate] = store.candidates(owner, TOKENS, [tokens])
        file = store.new_file_name(candidate.key)
        (store.settings.directory / file).write_bytes(os.urandom(100))
        entry = await store.saved(owner, candidate, file, tokens, sources)
        assert entry is not None
        return entry

    quoting = await save_naming("ann|hr", 200, ("payroll", "intro"))
    quoting_too = await save_naming("ann|", 100, ("payroll",))
    unrelated = await save_naming("ann|", 50, ("intro",))
    other_tenant = await save_naming("bob|", 200, ("payroll",))
    assert await store.forget("ann", ["payroll"]) == 2
    names = {p.name for p in store.settings.directory.iterdir()}
    assert quoting.file not in names and quoting_too.file not in names
    assert {unrelated.file, other_tenant.file} <= names
    for owner, tokens, expected in (("ann|hr", 200, None), ("ann|", 50, 50), ("bob|", 200, 200)):
        [candidate] = store.candidates(owner, TOKENS, [tokens])
        await store.look_up(owner, [candidate])
        assert (candidate.stored.tokens if candidate.stored else None) == expected


async def test_a_save_under_way_when_its_source_is_forgotten_is_dropped_once_written(tmp_path):
    # The forget ran while the state was being written (its entry not yet in the index):
    # the save sees the forget's marker and drops what it wrote.
    store = make_store(tmp_path)
    arrived = time.time()
    assert await store.forget("ann", ["payroll"]) == 0  # nothing indexed to drop yet

    async def save_naming(owner: str, sources: tuple[str, ...], prompt_at: float):
        [candidate] = store.candidates(owner, TOKENS, [200])
        file = store.new_file_name(candidate.key)
        (store.settings.directory / file).write_bytes(os.urandom(100))
        return file, await store.saved(owner, candidate, file, 200, sources, prompt_at)

    file, stale = await save_naming("ann|hr", ("intro", "payroll"), arrived)
    assert stale is None and not (store.settings.directory / file).exists()
    assert store.counters.stale == 1 and store.counters.saves == 0
    # another tenant's prompt naming the same id, a prompt without it, and one that
    # arrived long enough after the forget that it cannot quote the old text: kept
    assert (await save_naming("bob|", ("payroll",), arrived))[1] is not None
    assert (await save_naming("ann|", ("intro",), arrived))[1] is not None
    later = arrived + prefix_store.PROMPT_AGE_BOUND_S + 1
    assert (await save_naming("ann|", ("payroll",), later))[1] is not None
    assert store.too_old_to_save(time.time() - prefix_store.FORGET_MARKER_S)


async def test_a_forget_the_index_cannot_take_fails_for_its_caller_to_retry(tmp_path):
    store = make_store(tmp_path)

    async def down(prefix):
        raise Unavailable("cache backend: down")

    store.cache.keys = down
    with pytest.raises(Unavailable):
        await store.forget("ann", ["payroll"])


async def test_expired_files_are_swept_without_a_save(tmp_path, monkeypatch):
    """sweep_expired (run every minute by the service): a state whose entry expired
    leaves the disk also when no later save would sweep."""
    store = make_store(tmp_path, ttl_s=60)
    entry = await save(store, "ann", 200)
    path = store.settings.directory / entry.file
    await store.sweep_expired()
    assert path.exists()  # its entry is live
    later = time.time() + 120
    os.utime(path, (later - 90, later - 90))
    monkeypatch.setattr(prefix_store.time, "time", lambda: later)
    await store.cache.delete(*(await store.cache.keys("")))  # the TTL passed
    await store.sweep_expired()
    assert not path.exists()


async def test_a_prefix_saved_again_leaves_no_file_a_forget_would_miss(tmp_path):
    """Two answers from the same prompt both save its prefix: the second entry replaces the
    first, and the first one's file goes with it (else a forget, which finds files through
    the entries, left it on disk until the sweep's TTL)."""
    store = make_store(tmp_path)
    [candidate] = store.candidates("ann", TOKENS, [100])
    files = []
    for _ in range(2):
        file = store.new_file_name(candidate.key)
        (store.settings.directory / file).write_bytes(os.urandom(1000))
        assert await store.saved("ann", candidate, file, 100, sources=("doc-1",))
        files.append(file)
    assert sorted(p.name for p in store.settings.directory.glob("*.bin")) == [files[1]]
    assert await store.forget("ann", ["doc-1"]) == 1
    assert not list(store.settings.directory.glob("*.bin"))
