"""The in-process cache's bound: least recently used entries go first, in bytes."""

from __future__ import annotations

from ragline.cache import MemoryCache


async def test_the_byte_bound_evicts_the_least_recently_used():
    cache = MemoryCache(max_bytes=3 * (1000 + 64))
    for name in "abc":
        await cache.set(name, b"x" * 1000, ttl_s=60)
    assert await cache.get("a") is not None  # a is now the most recently used
    await cache.set("d", b"x" * 1000, ttl_s=60)
    assert await cache.get("b") is None
    assert all([await cache.get(name) for name in "acd"])


async def test_a_value_larger_than_the_cache_is_not_kept():
    cache = MemoryCache(max_bytes=500)
    await cache.set("big", b"x" * 1000, ttl_s=60)
    assert await cache.get("big") is None
