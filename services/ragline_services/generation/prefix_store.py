"""The hot-prefix KV store: saved llama.cpp slot states of prompt prefixes that repeat, so a
later request restores them into its slot and skips their prefill, also after an engine
restart and on another replica (files on a shared volume, index in a shared Redis).

What is a candidate prefix: the whole prompt, and for chats the end of the leading system
messages and the end of the conversation before the last message (the orchestrator's
fixed system prompt; a repeated question; a conversation's history), each as exact token
ids, at least `min_tokens` long (shorter ones are cheaper to prefill than to restore).

The owner of a prefix is a tenant and the visibility scopes of the caller whose prompt it
is (`GenerationRequest.cache_owner`): a principal who sees less never reuses, or times, a
prefix holding evidence of one who sees more.

When a prefix is hot: seen `hot_after` times (default 2) by the same owner within the TTL,
counted in the cache backend. A hot prefix without a stored state is saved after the
request's answer, off its path: its slot, which holds the prompt, is cut back to the prefix
(longest first: nothing is prefilled again) and saved while the slot is still the
request's, so no other owner's prompt can be in it.

Key: sha256 of (owner, engine identity, token ids). The engine identity is the model
version, the llama.cpp build, the KV cache types and flash attention, so a state is never
restored into an engine whose KV layout differs. A state is restored only for the owner
that saved it (the owner is in the key and checked again in the entry).

Index entries (file, tokens, bytes, sha256, last use) live in the kit's cache backend with a
TTL (default 5 minutes) that every use renews; a size bound evicts the least recently used.
Before a restore the file's size and sha256 are checked against the entry: a corrupt,
truncated or replaced file is discarded (entry and file), never loaded. Files whose entry
expired are deleted by a sweep after each save and every `sweep_s` (`sweep_expired`).

Each entry also names what its prompt held (`GenerateRequest.sources`: the orchestrator
sends the ids of the documents its evidence quotes); `forget` drops every state of a tenant
naming one of them, so a deleted document's text leaves the store at once (the retrieval
service calls ForgetSources after each delete and overwrite). A save can be under way while
the forget runs (on this replica or another sharing the index): `forget` first leaves a
marker per source in the index, and a save whose prompt arrived less than
`PROMPT_AGE_BOUND_S` before a marker of one of its sources is dropped once written (one of
the two always sees the other: the forget writes its marker before it reads the entries,
the save its entry before it reads the markers).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import json
import os
import re
import struct
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog

from ragline.cache import CacheBackend
from ragline.errors import Unavailable

log = structlog.get_logger("ragline.generation.prefix_store")

# How long before it reached this service a prompt's text may have been read (the evidence
# an orchestrator quoted, fetched at the start of its run): the orchestrator's longest
# deadline. A save whose prompt arrived less than this before a forget of one of its
# sources may quote the forgotten text, and is dropped.
PROMPT_AGE_BOUND_S = 300.0
# How long a forget's markers are kept: a save is checked against them while they last, so
# one whose prompt is older than FORGET_MARKER_S - PROMPT_AGE_BOUND_S is not made at all.
FORGET_MARKER_S = 900.0


@dataclass(frozen=True)
class StoreSettings:
    directory: Path
    ttl_s: float = 300.0
    max_bytes: int = 2 << 30
    hot_after: int = 2
    min_tokens: int = 64
    namespace: str = "ragline:kv:"


# The name of every state file the store makes (new_file_name): a key's first 32 hex
# characters, a unique suffix.
_FILE_NAME = re.compile(r"[0-9a-f]{32}-[0-9a-f]{12}\.bin")


@dataclass(frozen=True)
class StoredPrefix:
    key: str
    tenant: str
    file: str  # a name inside the store's directory (llama-server takes no paths)
    tokens: int
    bytes: int
    sha256: str
    last_use: float  # wall-clock seconds, comparable across replicas
    # What the prompt held (GenerateRequest.sources): a ForgetSources naming one drops it.
    sources: tuple[str, ...] = ()

    def encode(self) -> builtins.bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(data: builtins.bytes) -> StoredPrefix:
        """An entry read back from the shared index, trusted only once checked: its file
        must be a state file named for its own key (a name this store made for it, inside
        its directory), so an entry cannot point one owner's key at another's state or
        any other path (ValueError otherwise)."""
        fields = json.loads(data)
        entry = StoredPrefix(**{**fields, "sources": tuple(fields.get("sources", ()))})
        if not all(isinstance(source, str) for source in entry.sources):
            raise ValueError("entry names sources that are not strings")
        if not isinstance(entry.file, str) or not _FILE_NAME.fullmatch(entry.file):
            raise ValueError(f"entry names a file this store never makes: {entry.file!r}")
        if not entry.file.startswith(f"{entry.key[:32]}-"):
            raise ValueError(f"entry of key {entry.key[:12]} names another key's file")
        return entry


@dataclass
class StoreCounters:
    lookups: int = 0  # requests that had a candidate and no warm slot covering it
    hits: int = 0
    saves: int = 0
    evictions: int = 0
    discarded: int = 0  # corrupt, missing or mismatched states thrown away
    errors: int = 0  # the cache backend or a file operation failed (treated as a miss)
    # saves dropped because a source of their prompt was forgotten meanwhile
    stale: int = 0
    saved_bytes: int = 0
    save_s: float = 0.0  # time slots spent saving after their answers

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass
class Candidate:
    tokens: int  # length of the prefix in tokens
    key: str
    stored: StoredPrefix | None = None
    hot: bool = False


@dataclass
class StoreOutcome:
    restored_tokens: int = 0
    # Hot prefixes without a state, longest first: saved after the answer.
    to_save: list[Candidate] = field(default_factory=list)
    restore_s: float = 0.0

    @property
    def saved_tokens(self) -> int:
        return sum(candidate.tokens for candidate in self.to_save)


# What a guarded index call returns when the index could not answer (None is an answer).
_UNANSWERED = object()


def _framed_digest(*parts: str):
    """sha256 over `parts`, each framed by its length (no two tuples of strings collide)."""
    digest = hashlib.sha256()
    for part in parts:
        encoded = part.encode()
        digest.update(struct.pack("<I", len(encoded)) + encoded)
    return digest


def owner_tenant(owner: str) -> str:
    """The tenant of a cache owner (`GenerationRequest.cache_owner`: "tenant|scopes")."""
    return owner.split("|", 1)[0]


def _file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class PrefixStore:
    def __init__(self, cache: CacheBackend, settings: StoreSettings, engine_identity: str) -> None:
        self.cache = cache
        self.settings = settings
        self.engine_identity = engine_identity
        self.counters = StoreCounters()
        # Bytes of the states the index named at its last save (every replica's).
        self.stored_bytes = 0
        self._index = f"{settings.namespace}entry:"
        self._hot = f"{settings.namespace}seen:"
        self._forgot = f"{settings.namespace}forgot:"
        settings.directory.mkdir(parents=True, exist_ok=True)

    # -- keys ----------------------------------------------------------------------------------

    def key(self, tenant: str, tokens: Sequence[int]) -> str:
        digest = _framed_digest(tenant, self.engine_identity)
        digest.update(struct.pack(f"<{len(tokens)}I", *tokens))
        return digest.hexdigest()

    def candidates(
        self, tenant: str, tokens: Sequence[int], boundaries: Sequence[int]
    ) -> list[Candidate]:
        """Candidate prefixes at `boundaries` (token counts), longest first."""
        lengths = sorted(
            {b for b in boundaries if self.settings.min_tokens <= b <= len(tokens)}, reverse=True
        )
        return [Candidate(n, self.key(tenant, tokens[:n])) for n in lengths]

    # -- index ---------------------------------------------------------------------------------

    async def _guarded(self, what: str, call, default=None):
        """The cache backend is an optimisation: its failure is a miss, logged."""
        try:
            return await call
        except Unavailable as error:
            self.counters.errors += 1
            log.warning("prefix_store.cache_failed", op=what, error=str(error))
            return default

    async def look_up(self, tenant: str, candidates: list[Candidate]) -> None:
        """Fills `stored` (this tenant's entries) and counts a sighting of each candidate
        without one, marking it `hot` once seen `hot_after` times within the TTL."""
        for candidate in candidates:
            data = await self._guarded("get", self.cache.get(self._index + candidate.key))
            if data:
                try:
                    entry = StoredPrefix.decode(data)
                except (ValueError, TypeError):
                    entry = None
                if entry is not None and entry.tenant == tenant and entry.key == candidate.key:
                    candidate.stored = entry
                    continue
            seen = await self._guarded(
                "incr", self.cache.incr(self._hot + candidate.key, self.settings.ttl_s), 0
            )
            candidate.hot = seen >= self.settings.hot_after

    async def verified(self, entry: StoredPrefix) -> bool:
        """The file is there, whole and unchanged. A file that differs from the one saved is
        discarded with its entry; a missing one is only a miss (the entry may name a file
        on another replica's disk when replicas share an index but not a volume)."""
        path = self.settings.directory / entry.file
        try:
            size, digest = await asyncio.to_thread(_file_digest, path)
        except OSError:
            return False
        if size == entry.bytes and digest == entry.sha256:
            return True
        await self.discard(entry, "the file differs from the one saved")
        return False

    async def used(self, entry: StoredPrefix) -> None:
        """A restore: renews the entry's TTL and last use (the LRU order)."""
        self.counters.hits += 1
        renewed = StoredPrefix(**{**asdict(entry), "last_use": time.time()})
        await self._guarded(
            "set", self.cache.set(self._index + entry.key, renewed.encode(), self.settings.ttl_s)
        )

    async def discard(self, entry: StoredPrefix, why: str) -> None:
        self.counters.discarded += 1
        log.warning("prefix_store.discarded", file=entry.file, tokens=entry.tokens, why=why)
        await self._guarded("delete", self.cache.delete(self._index + entry.key))
        await self._remove_file(entry.file)

    def new_file_name(self, key: str) -> str:
        # Unique per save: two replicas saving the same prefix never write one file.
        return f"{key[:32]}-{uuid.uuid4().hex[:12]}.bin"

    async def saved(
        self,
        tenant: str,
        candidate: Candidate,
        file: str,
        tokens: int,
        sources: Sequence[str] = (),
        prompt_at: float | None = None,
    ) -> StoredPrefix | None:
        """Records a state that llama-server wrote to `file` (of a prompt that arrived at
        `prompt_at`, wall clock; default now), then enforces the size bound and sweeps
        expired files. Returns None (and deletes the file) when it can't, or when a source
        of the prompt was forgotten since it may have been read."""
        path = self.settings.directory / file
        try:
            size, digest = await asyncio.to_thread(_file_digest, path)
        except OSError as error:
            log.warning("prefix_store.save_unreadable", file=file, error=str(error))
            return None
        if tokens != candidate.tokens or size > self.settings.max_bytes:
            await self._remove_file(file)
            return None
        entry = StoredPrefix(
            candidate.key, tenant, file, tokens, size, digest, time.time(), tuple(sources)
        )
        # The same prefix saved again replaces its entry: the file the old entry named would
        # be named by none, and a forget (which finds files through the entries) would miss
        # it until the sweep's TTL.
        replaced = await self._entries([self._index + entry.key])
        stored = await self._guarded(
            "set",
            self.cache.set(self._index + entry.key, entry.encode(), self.settings.ttl_s),
            False,
        )
        if stored is False:
            await self._remove_file(file)
            return None
        for old in replaced:
            if old.file != file:
                await self._remove_file(old.file)
        read_after = (time.time() if prompt_at is None else prompt_at) - PROMPT_AGE_BOUND_S
        if await self._forgotten_since(owner_tenant(tenant), sources, read_after):
            self.counters.stale += 1
            log.info("prefix_store.stale_save_dropped", file=file, tokens=tokens)
            await self._guarded("delete", self.cache.delete(self._index + entry.key))
            await self._remove_file(file)
            return None
        self.counters.saves += 1
        self.counters.saved_bytes += size
        await self._evict_and_sweep(keep=entry)
        return entry

    async def forget(self, tenant: str, sources: Sequence[str]) -> int:
        """Drops every state of `tenant` (any of its owners) whose prompt named one of
        `sources`, entry and file. Returns how many."""
        wanted = set(sources)
        forgotten = 0
        # Unguarded: a forget the index could not take must fail, for its caller to retry.
        # The markers first: a save that writes its entry after the scan below sees them.
        now = str(time.time()).encode()
        for source in wanted:
            await self.cache.set(self._forgot_key(tenant, source), now, FORGET_MARKER_S)
        keys = await self.cache.keys(self._index)
        for entry in await self._entries(keys):
            if owner_tenant(entry.tenant) == tenant and wanted.intersection(entry.sources):
                await self._guarded("delete", self.cache.delete(self._index + entry.key))
                await self._remove_file(entry.file)
                forgotten += 1
        if forgotten:
            log.info("prefix_store.forgotten", tenant=tenant, states=forgotten)
        return forgotten

    def _forgot_key(self, tenant: str, source: str) -> str:
        return self._forgot + _framed_digest(tenant, source).hexdigest()

    async def _forgotten_since(self, tenant: str, sources: Sequence[str], since: float) -> bool:
        """Whether one of `sources` of `tenant` was forgotten after `since` (wall clock);
        an index that cannot say counts as yes (a save is only worth its cost)."""
        for source in set(sources):
            marker = await self._guarded(
                "get", self.cache.get(self._forgot_key(tenant, source)), _UNANSWERED
            )
            if marker is _UNANSWERED:
                return True
            if marker is not None:
                try:
                    if float(marker) >= since:
                        return True
                except ValueError:
                    return True
        return False

    def too_old_to_save(self, prompt_at: float) -> bool:
        """A prompt so old that a forget of its sources may no longer be marked."""
        return time.time() - prompt_at > FORGET_MARKER_S - PROMPT_AGE_BOUND_S

    async def sweep_expired(self) -> None:
        """Deletes the files of entries that expired (their TTL passed unused) also when
        no save comes to sweep after it."""
        keys = await self._guarded("keys", self.cache.keys(self._index), None)
        if keys is None:
            return  # the index is unreachable: which files are live is unknown
        live = {e.file for e in await self._entries(keys)}
        await asyncio.to_thread(self._sweep, live)

    async def _entries(self, keys: list[str] | None = None) -> list[StoredPrefix]:
        if keys is None:
            keys = await self._guarded("keys", self.cache.keys(self._index), [])
        entries = []
        for key in keys:
            data = await self._guarded("get", self.cache.get(key))
            if data:
                with contextlib.suppress(ValueError, TypeError):
                    entries.append(StoredPrefix.decode(data))
        return entries

    async def _evict_and_sweep(self, keep: StoredPrefix) -> None:
        entries = await self._entries()
        total = sum(e.bytes for e in entries)
        for entry in sorted(entries, key=lambda e: e.last_use):
            if total <= self.settings.max_bytes:
                break
            if entry.key == keep.key:
                continue
            total -= entry.bytes
            self.counters.evictions += 1
            await self._guarded("delete", self.cache.delete(self._index + entry.key))
            await self._remove_file(entry.file)
        self.stored_bytes = total
        live = {e.file for e in entries} | {keep.file}
        await asyncio.to_thread(self._sweep, live)

    def _sweep(self, live: set[str]) -> None:
        """Deletes state files no entry names, once older than the TTL (a younger one may
        be another replica's save whose entry is on its way)."""
        cutoff = time.time() - self.settings.ttl_s
        for path in self.settings.directory.glob("*.bin"):
            with contextlib.suppress(OSError):
                if path.name not in live and path.stat().st_mtime < cutoff:
                    path.unlink()

    async def _remove_file(self, file: str) -> None:
        if not _FILE_NAME.fullmatch(file):  # never a path: only what this store names
            return
        with contextlib.suppress(OSError):
            await asyncio.to_thread(os.unlink, self.settings.directory / file)
