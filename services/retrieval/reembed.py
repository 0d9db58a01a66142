"""Which embedding model made an index's vectors, and moving an index to another model.

An index never compares two models' vectors. `vector_model.json` names the model of its
own vectors; when the embedding service answers with another one, either the index
refuses (writes FAILED_PRECONDITION, queries BM25 only), or, with re-embedding on (the
default), it takes the new model as its target and rewrites, in the background, every
document whose vector an older model made: the same title, text, ACL and attributes
with the new vector, logged as ordinary writes (so replay, the HNSW builder and the
document versions need nothing new: a re-embedded document is at a new version). While
that runs, writes embedded by the target are accepted and queries are answered by BM25
(`vector_index_reembedding`); when it ends the target is the index's model.

A document written by a caller after the re-embedder read it is never overwritten with
the old text: each batch is checked against the documents' current versions and written
while no other write is in flight (`WriteTurns`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ragline.files import atomic_write_text
from ragline_services.retrieval.documents import doc_key
from ragline_services.retrieval.wal import WriteLog, tenant_seq

# What a logged document's "model" says when its vector came from the caller. A record
# from before models were logged has no "model": its vector is taken as the index's own.
CALLER_VECTOR = ""


@dataclass(frozen=True)
class VectorModel:
    """The model of the index's vectors ("": none yet) and, while the index moves to
    another one, that one."""

    model_version: str = ""
    reembedding_to: str = ""

    @property
    def target(self) -> str:
        """The model the index's vectors are, or are becoming, of."""
        return self.reembedding_to or self.model_version

    @classmethod
    def load(cls, path: Path) -> VectorModel:
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(data.get("model_version", ""), data.get("reembedding_to", ""))

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self)))


@dataclass(frozen=True)
class Stale:
    """A live document whose vector the target model did not make."""

    key: str
    version: int
    item: dict  # the logged document


def stale_keys(wal: Path, target: str) -> dict[str, int]:
    """The live documents of the log whose vector came from a model other than `target`
    (caller vectors left alone), as key -> seq of their last write. Only keys are held,
    never the corpus. Reads the whole log: run it in a thread."""
    last: dict[str, tuple[int, bool]] = {}
    for record in WriteLog.read(wal):
        for key in record.get("deletes", ()):
            last.pop(key, None)
        for item in record.get("upserts", ()):
            model = item.get("model")
            stale = model not in (target, CALLER_VECTOR)
            last[doc_key(item["tenant"], item["id"])] = (record["seq"], stale)
    return {key: seq for key, (seq, stale) in last.items() if stale}


def stale_batches(wal: Path, stale: dict[str, int], size: int) -> Iterator[tuple[str, list[Stale]]]:
    """The documents of `stale` read from the log (their last write), as batches of one
    tenant of at most `size`: what is held is a batch per tenant, not the corpus. Each
    `next()` reads on: call it in a thread."""
    buffers: dict[str, list[Stale]] = {}
    for record in WriteLog.read(wal):
        version = tenant_seq(record)
        for item in record.get("upserts", ()):
            key = doc_key(item["tenant"], item["id"])
            if stale.get(key) != record["seq"]:
                continue
            buffer = buffers.setdefault(item["tenant"], [])
            buffer.append(Stale(key, version, item))
            if len(buffer) == size:
                yield item["tenant"], buffers.pop(item["tenant"])
    for tenant, buffer in buffers.items():
        yield tenant, buffer


class WriteTurns:
    """Callers' writes run side by side (shared turns); a re-embed batch runs alone
    (exclusive), so that the versions it checks cannot change before its write lands."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._shared = 0
        self._exclusive = False

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            async with self._changed:
                self._shared -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._exclusive)
            self._exclusive = True  # new shared turns wait from here on
            try:
                await self._changed.wait_for(lambda: self._shared == 0)
            except BaseException:
                self._exclusive = False
                self._changed.notify_all()
                raise
        try:
            yield
        finally:
            async with self._changed:
                self._exclusive = False
                self._changed.notify_all()
