"""What the orchestrator's cache backend returns is checked before it is served: an entry
is the one stored under its key, by a ragline service."""

from __future__ import annotations

import json

from ragline.cache import MemoryCache
from ragline_services.orchestrator.caches import (
    ANSWER,
    CacheTtls,
    OrchestratorCaches,
    Viewer,
    signing_key,
)

ANSWERED = {"answer": "The Vistula [1].", "documents": {"river": 3}}


def caches(key: bytes = signing_key("s" * 32)) -> OrchestratorCaches:
    return OrchestratorCaches(MemoryCache(), CacheTtls(), signing_key=key)


async def test_an_entry_comes_back_as_it_was_stored():
    store = caches()
    key = store.key(ANSWER, Viewer("acme"), "which river")
    await store.put(ANSWER, key, ANSWERED)
    assert await store.get(ANSWER, key) == ANSWERED


async def test_an_entry_moved_to_another_tenants_key_is_refused_and_dropped():
    store = caches(key=b"")  # even unsigned (no service key), an entry is bound to its key
    mine = store.key(ANSWER, Viewer("acme", frozenset({"hr"})), "salary bands")
    theirs = store.key(ANSWER, Viewer("acme"), "salary bands")
    await store.put(ANSWER, mine, ANSWERED)
    await store.backend.set(theirs, await store.backend.get(mine), 60)
    assert await store.get(ANSWER, theirs) is None
    assert await store.backend.get(theirs) is None  # dropped
    assert await store.get(ANSWER, mine) == ANSWERED


async def test_an_entry_not_written_by_a_ragline_service_is_refused():
    store = caches()
    key = store.key(ANSWER, Viewer("acme"), "which river")
    await store.backend.set(key, json.dumps(ANSWERED).encode(), 60)  # the old format
    assert await store.get(ANSWER, key) is None
    await store.put(ANSWER, key, ANSWERED)
    # a deployment with another service key does not take it
    elsewhere = OrchestratorCaches(store.backend, CacheTtls(), signing_key=signing_key("t" * 32))
    assert await elsewhere.get(ANSWER, key) is None
    await store.put(ANSWER, key, ANSWERED)
    sealed = await store.backend.get(key)
    forged = sealed.replace(b"The Vistula", b"The Thames")  # an answer changed in Redis
    await store.backend.set(key, forged, 60)
    assert await store.get(ANSWER, key) is None
