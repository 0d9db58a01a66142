"""The orchestrator's three caches: answers, retrievals and tool results. Each entry is
keyed on everything that decides it and checked again on a hit.

| layer     | key (all of it)                                        | checked again on a hit   |
|-----------|--------------------------------------------------------|--------------------------|
| answer    | tenant, visibility scopes, normalised question, the    | every returned document  |
|           | settings and plan that shape the answer, prompt        | still at its version and |
|           | template version, tier                                 | visible to the caller;   |
|           |                                                        | the tier's model version |
| retrieval | tenant, scopes, normalised query, mode, k, filters,    | the tenant's index       |
|           | hnsw_ef, embedding model version of a given vector     | version and each hit     |
|           |                                                        | still visible            |
| tool      | tenant, scopes, tool, parameters (with the versions    | freshness bound (TTL)    |
|           | of the objects they name)                              |                          |

The scopes are the caller's, from its credential: a principal whose scope was revoked
presents other scopes, so it misses at once (no TTL to wait out), and every hit asks the
retrieval service again which of the entry's documents this caller may see now
(`DocumentVersions`). A write or delete bumps the tenant's index version and the
document's version: the retrieval entries of that tenant and the answers that returned the
document stop validating, and are dropped when next met. Only COMPLETE answers are stored;
nothing that writes is ever served from here (the orchestrator only reads).

Backends: the kit's `ragline.cache` (in-process LRU when embedded, Redis shared by the
replicas with RAGLINE_ORCHESTRATOR_CACHE_URL). A failing backend is a miss.

What the backend returns is not trusted as found: every entry carries the key it was
stored under (an entry copied to another key, another tenant's or view's, is refused),
and with a signing key (derived from RAGLINE_AUTH_SERVICE_KEY, which every replica holds)
an HMAC over both, so an entry written by anything but a ragline service is refused. A
refused entry is a miss, and is dropped.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import unicodedata
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from ragline.cache import CacheBackend
from ragline.errors import Unavailable

log = structlog.get_logger("ragline.orchestrator.caches")

# The current versions of documents in a view (retrieval's DocumentVersions).
VersionsOf = Callable[["Viewer", list[str]], Awaitable[dict[str, int]]]

ANSWER, RETRIEVAL, TOOL = "answer", "retrieval", "tool"
_TRAILING = re.compile(r"[\s?!.]+$")


def normalise(text: str) -> str:
    """Case, Unicode form, spacing and closing punctuation do not change a question."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _TRAILING.sub("", " ".join(text.split()))


@dataclass(frozen=True)
class Viewer:
    """Whose view of the tenant's documents an entry holds."""

    tenant: str
    scopes: frozenset[str] = frozenset()

    def parts(self) -> list[str]:
        return [self.tenant, ",".join(sorted(self.scopes))]


@dataclass(frozen=True)
class CacheTtls:
    answer_s: float = 3600.0
    retrieval_s: float = 600.0
    tool_s: float = 300.0

    def of(self, layer: str) -> float:
        return {ANSWER: self.answer_s, RETRIEVAL: self.retrieval_s, TOOL: self.tool_s}[layer]


@dataclass
class LayerCounters:
    hits: int = 0
    misses: int = 0
    invalidated: int = 0  # found, then failed its check (dropped)


@dataclass
class CacheUse:
    """One run's use of the caches, for its report."""

    answer_hit: bool = False
    answer_miss: bool = False  # looked up, not found
    retrieval_hits: int = 0
    retrieval_misses: int = 0
    tool_hits: int = 0
    tool_misses: int = 0
    # Work saved, by node: dicts as CacheSaving messages carry them.
    saved: list[dict] = field(default_factory=list)

    def count(self, layer: str, *, hit: bool) -> None:
        """A lookup in a node's layer (retrieval or tool) that hit or missed."""
        name = f"{layer}_{'hits' if hit else 'misses'}"
        setattr(self, name, getattr(self, name) + 1)


class OrchestratorCaches:
    def __init__(
        self,
        backend: CacheBackend,
        ttls: CacheTtls,
        namespace: str = "ragline:orch:",
        signing_key: bytes = b"",
    ) -> None:
        self.backend = backend
        self.ttls = ttls
        self.namespace = namespace
        self.counters = {layer: LayerCounters() for layer in (ANSWER, RETRIEVAL, TOOL)}
        self._signing_key = signing_key

    def key(self, layer: str, viewer: Viewer, *parts: object) -> str:
        # The tenant and scopes lead every key: no entry is ever another view's.
        material = json.dumps([layer, *viewer.parts(), *parts], sort_keys=True, default=str)
        return f"{self.namespace}{layer}:{hashlib.sha256(material.encode()).hexdigest()}"

    def _seal(self, key: str, entry: dict, viewer: Viewer | None) -> bytes:
        sealed = {"key": key, "entry": entry}
        if viewer is not None:  # whose view it is: what a sweep asks retrieval with
            sealed["viewer"] = [viewer.tenant, sorted(viewer.scopes)]
        body = json.dumps(sealed).encode()
        return self._mac(body) + b"." + body

    def _mac(self, body: bytes) -> bytes:
        if not self._signing_key:
            return b"-"
        return hmac.new(self._signing_key, body, hashlib.sha256).hexdigest().encode()

    def _unsealed(self, key: str, data: bytes) -> dict | None:
        """The sealed record stored under `key` by a ragline service, or None."""
        mac, _, body = data.partition(b".")
        if not hmac.compare_digest(mac, self._mac(body)):
            return None
        try:
            sealed = json.loads(body)
        except ValueError:
            return None
        if not isinstance(sealed, dict) or sealed.get("key") != key:
            return None
        return sealed if isinstance(sealed.get("entry"), dict) else None

    def _opened(self, key: str, data: bytes) -> dict | None:
        """The entry stored under `key` by a ragline service, or None."""
        sealed = self._unsealed(key, data)
        return sealed["entry"] if sealed is not None else None

    async def get(self, layer: str, key: str) -> dict | None:
        try:
            data = await self.backend.get(key)
        except Unavailable as error:
            log.warning("cache.unavailable", layer=layer, op="get", error=str(error))
            data = None
        entry = self._opened(key, data) if data else None
        if data and entry is None:
            await self.drop(layer, key, "not an entry this key was given by a ragline service")
            return None
        counters = self.counters[layer]
        if entry is None:
            counters.misses += 1
        return entry

    def hit(self, layer: str) -> None:
        self.counters[layer].hits += 1

    async def put(self, layer: str, key: str, entry: dict, viewer: Viewer | None = None) -> None:
        try:
            await self.backend.set(key, self._seal(key, entry, viewer), self.ttls.of(layer))
        except Unavailable as error:
            log.warning("cache.unavailable", layer=layer, op="set", error=str(error))

    async def drop(self, layer: str, key: str, why: str) -> None:
        counters = self.counters[layer]
        counters.invalidated += 1
        counters.misses += 1
        log.info("cache.invalidated", layer=layer, why=why)
        try:
            await self.backend.delete(key)
        except Unavailable as error:
            log.warning("cache.unavailable", layer=layer, op="delete", error=str(error))

    async def sweep(self, versions: VersionsOf) -> int:
        """Drops every answer and retrieval entry that cites a document deleted, changed
        or hidden since (asking `versions` in the entry's own view), so that a deleted
        document's text leaves the backend without waiting for the TTL. Returns how many."""
        by_viewer: dict[tuple[str, tuple[str, ...]], list[tuple[str, str, dict[str, int]]]] = {}
        for layer in (ANSWER, RETRIEVAL):
            try:
                keys = await self.backend.keys(f"{self.namespace}{layer}:")
            except Unavailable as error:
                log.warning("cache.unavailable", layer=layer, op="sweep", error=str(error))
                return 0
            for key in keys:
                try:
                    data = await self.backend.get(key)
                except Unavailable:
                    return 0
                sealed = self._unsealed(key, data) if data else None
                viewer = sealed.get("viewer") if sealed else None
                if not sealed or not isinstance(viewer, list) or len(viewer) != 2:
                    continue  # a foreign or old entry: refused when met
                entry = sealed["entry"]
                cited = entry.get("documents") or {p[0]: p[3] for p in entry.get("passages", ())}
                by_viewer.setdefault((viewer[0], tuple(viewer[1])), []).append((layer, key, cited))
        dropped = 0
        for (tenant, scopes), entries in by_viewer.items():
            ids = sorted({doc for _, _, cited in entries for doc in cited})
            current = await versions(Viewer(tenant, frozenset(scopes)), ids)
            for layer, key, cited in entries:
                if stale_documents(cited, current):
                    await self.drop(layer, key, "a document it cites changed or is gone")
                    dropped += 1
        return dropped

    async def close(self) -> None:
        await self.backend.close()


def signing_key(service_key: str) -> bytes:
    """The key cache entries are signed with: derived from the service key (one secret
    fewer to hand out, and never the key itself); none when there is no service key."""
    if not service_key:
        return b""
    return hmac.new(service_key.encode(), b"ragline orchestrator cache v1", hashlib.sha256).digest()


def stale_documents(cached: dict[str, int], current: dict[str, int]) -> list[str]:
    """Ids whose current version (absent: deleted or hidden from this caller) differs."""
    return sorted(doc for doc, version in cached.items() if current.get(doc) != version)
