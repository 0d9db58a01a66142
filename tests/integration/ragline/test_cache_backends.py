"""The cache backend's contract, the same for both backends: in-process and a real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from ragline.cache import MemoryCache, RedisCache, open_cache
from ragline.errors import Unavailable


@pytest.fixture(params=["memory", "redis"])
async def cache(request):
    if request.param == "memory":
        backend = open_cache("")
        assert isinstance(backend, MemoryCache)
    else:
        backend = open_cache(request.getfixturevalue("redis_server").url)
        assert isinstance(backend, RedisCache)
    yield backend
    await backend.close()


@pytest.fixture
def ns() -> str:
    return f"test:{uuid.uuid4().hex[:8]}:"


async def test_set_get_delete(cache, ns):
    assert await cache.get(ns + "a") is None
    await cache.set(ns + "a", b"one", ttl_s=30)
    await cache.set(ns + "b", b"two", ttl_s=30)
    assert await cache.get(ns + "a") == b"one"
    await cache.delete(ns + "a", ns + "missing")
    assert await cache.get(ns + "a") is None
    assert await cache.get(ns + "b") == b"two"


async def test_entries_expire_after_their_ttl(cache, ns):
    await cache.set(ns + "short", b"x", ttl_s=0.2)
    await cache.set(ns + "long", b"y", ttl_s=30)
    await asyncio.sleep(0.4)
    assert await cache.get(ns + "short") is None
    assert await cache.get(ns + "long") == b"y"
    assert await cache.keys(ns) == [ns + "long"]


async def test_a_counter_counts_within_a_window_that_later_increments_do_not_extend(cache, ns):
    assert [await cache.incr(ns + "n", ttl_s=0.5) for _ in range(3)] == [1, 2, 3]
    await asyncio.sleep(0.3)
    assert await cache.incr(ns + "n", ttl_s=0.5) == 4
    await asyncio.sleep(0.35)  # 0.65 s after the first increment: the window is over
    assert await cache.incr(ns + "n", ttl_s=0.5) == 1


async def test_keys_lists_only_the_prefix_and_takes_it_literally(cache, ns):
    await cache.set(ns + "kv:a", b"1", ttl_s=30)
    await cache.set(ns + "kv:b", b"2", ttl_s=30)
    await cache.set(ns + "kvx", b"3", ttl_s=30)
    await cache.set(ns + "other", b"4", ttl_s=30)
    assert sorted(await cache.keys(ns + "kv:")) == [ns + "kv:a", ns + "kv:b"]
    assert await cache.keys(ns + "k*") == []  # a glob character is a character


async def test_two_clients_of_one_redis_share_entries(redis_server, ns):
    first, second = open_cache(redis_server.url), open_cache(redis_server.url)
    try:
        await first.set(ns + "shared", b"v", ttl_s=30)
        assert await second.get(ns + "shared") == b"v"
        assert await first.incr(ns + "c", 30) == 1 and await second.incr(ns + "c", 30) == 2
    finally:
        await first.close()
        await second.close()


async def test_an_unreachable_redis_is_unavailable_quickly(ns):
    from ragline.processes import free_ports

    cache = open_cache(f"redis://127.0.0.1:{free_ports(1)[0]}/0", timeout_s=0.3)
    try:
        with pytest.raises(Unavailable, match="cache get"):
            await asyncio.wait_for(cache.get(ns + "a"), timeout=5)
    finally:
        await cache.close()
