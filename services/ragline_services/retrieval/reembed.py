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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import structlog

from ragline.background import detached_task
from ragline.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from ragline.files import atomic_write_text
from ragline_services.retrieval.documents import doc_key, passage_text
from ragline_services.retrieval.index_types import Embed
from ragline_services.retrieval.wal import WriteLog, tenant_seq

log = structlog.get_logger("ragline.retrieval")

# Documents re-embedded and rewritten at once (one embedding call, one logged write).
BATCH = 64

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


def embedding_call(embed: Embed | None) -> Embed:
    """The index's embedding call; UNAVAILABLE where none is configured (BM25 only)."""
    if embed is None:
        raise Unavailable("no embedding service is configured for this index")
    return embed


# Writes one re-embedded batch of a tenant (the index, under an exclusive write turn).
Rewrite = Callable[[str, list[Stale], np.ndarray, str], Awaitable[None]]


class ModelKeeper:
    """The model of an index's vectors, kept: every embedded write and query is held to it
    (`check`), and the move to another model runs here in the background."""

    def __init__(
        self,
        directory: Path,
        wal: Path,
        embed: Embed | None,
        rewrite: Rewrite,
        *,
        reembed_on_change: bool,
    ) -> None:
        self._path = directory / "vector_model.json"
        # "": no vectors made yet, or an index from before the record (the first model
        # seen is taken as its own).
        self.current = VectorModel.load(self._path)
        self._wal = wal
        self._embed = embed
        self._rewrite = rewrite
        self._reembed_on_change = reembed_on_change
        self._reembedder: asyncio.Future | None = None
        self._batch: asyncio.Future | None = None
        self.remaining = 0  # documents the running re-embed has still to write

    async def check(self, model_version: str, *, writing: bool) -> bool:
        """Whether vectors of `model_version` may go into (writing) or be compared with
        (querying) this index's. The first model that embeds for the index becomes its
        own, recorded before its vectors are logged. Another one starts a re-embed with
        it as the target (writes by the target are accepted, queries wait for the end);
        with re-embedding off, such a write is refused and a query gets False."""
        current = self.current
        if not model_version:
            return True
        if not current.model_version:
            await self._set(VectorModel(model_version))
            log.info("retrieval.vector_model_recorded", model_version=model_version)
            return True
        if model_version == current.target:
            return writing or not current.reembedding_to
        if self._reembed_on_change:
            await self._start(model_version)
            return writing
        log.error(
            "retrieval.embedding_model_changed",
            index_model=current.model_version,
            service_model=model_version,
            writing=writing,
        )
        if not writing:
            return False
        raise FailedPrecondition(
            f"this index's vectors were made by embedding model {current.model_version}, but "
            f"the embedding service now runs {model_version}, and re-embedding is off "
            "(RAGLINE_RETRIEVAL_REEMBED_ON_MODEL_CHANGE): mixing the two would rank without a "
            "word of warning. Serve the index's model again (RAGLINE_EMBEDDING_MODEL), turn "
            "re-embedding on, or send the vectors yourself",
            reason="EMBEDDING_MODEL_CHANGED",
            metadata={"index_model": current.model_version, "service_model": model_version},
        )

    async def check_named(self, model_version: str) -> None:
        """Vectors a caller made with a named model (`ragline ingest` embeds itself) go
        in when they are of the index's model, or of the one the embedding service runs
        now (asked here: the index may not have heard of a change yet, and then moves to
        it); any other model is refused."""
        current = self.current
        if model_version == current.target:
            return
        serving = ""
        if self._embed is not None:
            with contextlib.suppress(Unavailable, DeadlineExceeded):
                serving = await self.probe()
        # Unverifiable (no embedding service to ask) only for an index of no model yet.
        if serving == model_version or (not serving and not self.current.model_version):
            await self.check(model_version, writing=True)
            return
        index_model = current.target
        raise FailedPrecondition(
            f"documents[].vector_model_version is {model_version}, but this index's vectors "
            f"are of {index_model} and the embedding service runs {serving or '(unreachable)'}"
            ": send vectors of the index's model, or none",
            reason="EMBEDDING_MODEL_CHANGED",
            metadata={
                "index_model": index_model,
                "service_model": serving,
                "vector_model": model_version,
            },
        )

    async def probe(self) -> str:
        """The model the embedding service runs now, held to the index's like any reply
        (so a change is noticed at start, before the first write or query)."""
        assert self._embed is not None
        embedded = await self._embed(["model probe"], "probe")
        await self.check(embedded.model_version, writing=False)
        return embedded.model_version

    # -- the move to another model -------------------------------------------------------

    async def resume(self) -> None:
        """Goes on with a re-embed a restart interrupted (called once the loop runs)."""
        if self.current.reembedding_to and self._reembedder is None:
            self._launch(self.current.reembedding_to)

    async def _set(self, model: VectorModel) -> None:
        # Set before the save's await: a concurrent write or query already sees it.
        self.current = model
        await asyncio.to_thread(model.save, self._path)

    async def _start(self, target: str) -> None:
        await self._set(VectorModel(self.current.model_version, target))
        log.warning(
            "retrieval.reembed_started",
            index_model=self.current.model_version,
            target=target,
        )
        self._launch(target)

    def _launch(self, target: str) -> None:
        if self._reembedder is not None:
            self._reembedder.cancel()  # its target is not the index's any more
        # Started by whichever request noticed the new model: it runs as the service, not
        # under that request's deadline or that tenant's identity.
        self._reembedder = detached_task(self._run(target), name="reembed")

    async def _run(self, target: str) -> None:
        delay = 1.0
        while True:
            try:
                if not await self._pass(target):
                    return  # another model took over; its own re-embed runs
                break
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the embedding service, a disk: try again later
                log.warning("retrieval.reembed_retry", error=str(error), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)
        if self.current.reembedding_to == target:
            await self._set(VectorModel(target))
            self._reembedder = None
            log.warning("retrieval.reembed_finished", model_version=target)

    async def _pass(self, target: str) -> bool:
        """Rewrites every live document whose vector another model made; False when the
        embedding service stopped answering with `target` on the way."""
        stale = await asyncio.to_thread(stale_keys, self._wal, target)
        self.remaining = len(stale)
        batches = stale_batches(self._wal, stale, BATCH)
        while (found := await asyncio.to_thread(next, batches, None)) is not None:
            tenant, batch = found
            texts = [passage_text(s.item["title"], s.item["text"]) for s in batch]
            embedded = await embedding_call(self._embed)(texts, "bulk")
            if embedded.model_version != target:
                await self.check(embedded.model_version, writing=True)
                return False
            # Its own task: once the versions are checked, the write must land before
            # any caller's, even if this re-embed is cancelled meanwhile.
            self._batch = asyncio.ensure_future(
                self._rewrite(tenant, batch, embedded.vectors, target)
            )
            await asyncio.shield(self._batch)
            self.remaining -= len(batch)
        return True

    async def stop(self) -> None:
        """Stops a running re-embed (it resumes at the next start) once its batch in
        flight, if any, is written."""
        if self._reembedder is not None:
            self._reembedder.cancel()
            with contextlib.suppress(BaseException):
                await self._reembedder
        if self._batch is not None:
            with contextlib.suppress(Exception):
                await self._batch

    def cancel(self) -> None:
        """Stops a running re-embed without waiting (resumed at the next start)."""
        if self._reembedder is not None:
            self._reembedder.cancel()
