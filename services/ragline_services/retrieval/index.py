"""The retrieval domain: durable writes, BM25 + vector search modes, freshness, status.

A write is: validated, embedded if it has no vectors, appended to the write log (fsynced:
then it is acknowledged), applied to the BM25 index (commit) and to the vector delta, in
log order. So a write is searchable when its call returns, and a restart replays the log
past what each index had applied. No gRPC here.

The index records which embedding model made the vectors it embedded itself, and
never compares two models' vectors: when the embedding service answers with another
model, the index re-embeds its documents with it in the background (or, with
re-embedding off, refuses such writes); `reembed.py`'s `ModelKeeper` holds that, the
index writes its batches. Vectors a caller sends are the caller's business.

The values a write or a search takes and gives are `index_types.py`'s; one search
through the engines is `search.py`'s. This class keeps what shares the write turn, the
apply order and the log (writes, replay, compaction), by section below.

Why one file of this length: writes in log order, replay, search and status share the
apply turn and the log's numbering.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import structlog

from ragline.background import detached_task
from ragline.errors import (
    DeadlineExceeded,
    InvalidArgument,
    Unavailable,
)
from ragline.files import atomic_write_text
from ragline.vocabulary import SearchMode
from ragline_services.retrieval.bm25 import Bm25Index, LexicalIndex
from ragline_services.retrieval.compaction import LogCompaction
from ragline_services.retrieval.documents import (
    StoredDocument,
    Visibility,
    doc_key,
    encode_vector,
    passage_text,
    point_id,
    split_key,
)
from ragline_services.retrieval.index_types import (
    EMBEDDING_MODEL_CHANGED,
    REEMBEDDING,
    Changed,
    DocumentInput,
    Embed,
    IndexSettings,
    IndexStatus,
    SearchHit,
    SearchQuery,
    SearchResult,
    WriteResult,
)
from ragline_services.retrieval.permissions import (
    Writer,
    check_acls,
    check_may_write,
    refuse_hidden_overwrites,
)
from ragline_services.retrieval.reembed import (
    CALLER_VECTOR,
    ModelKeeper,
    Stale,
    WriteTurns,
    embedding_call,
)
from ragline_services.retrieval.search import Engines, in_context, timed_apart
from ragline_services.retrieval.vectors import VectorIndex
from ragline_services.retrieval.wal import WriteLog, tenant_seq

log = structlog.get_logger("ragline.retrieval")


APPLY_RETRY_FIRST_S, APPLY_RETRY_MAX_S = 0.05, 5.0


class RetrievalIndex:
    def __init__(
        self,
        directory: Path,
        vectors: VectorIndex,
        settings: IndexSettings,
        embed: Embed | None,
        changed: Changed | None = None,
    ) -> None:
        """`changed(tenant, ids)` is told the documents each acknowledged delete or
        overwrite replaced (forget_notices.py: the services keeping copies drop theirs)."""
        self.directory = directory
        self._changed = changed
        directory.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.wal = WriteLog(directory / "write.log")
        bm25 = Bm25Index(
            directory / "bm25",
            max_open=settings.bm25_max_open_tenants,
            translation_weight=settings.cross_lingual_weight,
            params=settings.bm25,
        )
        self.bm25: LexicalIndex = bm25
        self.vectors = vectors
        self._embed = embed
        self._state_path = directory / "state.json"
        self._turns = WriteTurns()
        # The embedding model of the vectors this index made, and the move to another.
        self.models = ModelKeeper(
            directory,
            self.wal.path,
            embed,
            self._rewrite,
            reembed_on_change=settings.reembed_on_model_change,
        )
        state = json.loads(self._state_path.read_text()) if self._state_path.exists() else {}
        self.bm25_seq = int(state.get("bm25_seq", 0))
        if bm25.migrated:
            # An index of an earlier layout was set aside: rebuild from the log.
            log.warning("retrieval.bm25_rebuilding_per_tenant", from_seq=self.bm25_seq)
            self.bm25_seq = 0
        self.applied_seq = 0
        # The last applied write of each tenant, in the tenant's numbering: the index
        # version a tenant is shown (its own writes only).
        self.tenant_applied: dict[str, int] = {}
        self.apply_error: str | None = None  # the write that cannot be applied now, and why
        self._apply_turn = asyncio.Condition()
        self._writes: set[asyncio.Task] = set()
        self.last_build_finished: float | None = None
        self.compaction = LogCompaction(
            self.wal,
            bm25,
            vectors,
            settings,
            applied_by_all=lambda: min(self.bm25_seq, self.vectors.built_seq),
        )
        # Searches run here, one hop each; never queued behind writes or builds.
        self._query_pool = ThreadPoolExecutor(
            max_workers=settings.query_threads, thread_name_prefix="retrieval-search"
        )
        # HYBRID's second half: a pool of its own, since a search waiting on a task queued
        # in its own pool could wait behind the very searches that hold that pool's threads.
        self._half_pool = ThreadPoolExecutor(
            max_workers=settings.query_threads, thread_name_prefix="retrieval-half"
        )

    # -- start: replay the log ------------------------------------------------------------

    def replay(self) -> int:
        """Applies every logged write the indexes have not seen; returns how many records."""
        start = min(self.bm25_seq, self.vectors.built_seq)
        count = 0
        # The last state of each key over a run of records (None: deleted), so a batch
        # applied to BM25 at once ends exactly as the records applied one by one would.
        final: dict[str, StoredDocument | None] = {}
        for record in self.wal.replay(after_seq=start):
            seq = record["seq"]
            # A document's version is its write's number among the tenant's writes (the
            # log stores 0: the number is only known once the record is appended).
            version = tenant_seq(record)
            upserts = [
                StoredDocument.from_record({**d, "version": version})
                for d in record.get("upserts", ())
            ]
            deletes = list(record.get("deletes", ()))
            self.vectors.apply(seq, upserts, deletes)
            if seq > self.bm25_seq:
                final.update(dict.fromkeys(deletes))
                final.update((doc.key, doc) for doc in upserts)
            if len(final) >= 5000:
                self._bm25_apply_final(seq, final)
                final = {}
            self.applied_seq = seq
            count += 1
        if final:
            self._bm25_apply_final(self.applied_seq, final)
        self.applied_seq = max(self.applied_seq, self.wal.last_seq)
        self.tenant_applied = dict(self.wal.tenant_last)  # everything logged is applied now
        if self.wal.holds_forgettable:
            self.compaction.text_to_forget(age_unknown=True)
        return count

    def _bm25_apply_final(self, seq: int, final: dict[str, StoredDocument | None]) -> None:
        self._bm25_apply(
            seq,
            [d for d in final.values() if d is not None],
            [k for k, d in final.items() if d is None],
        )

    def _bm25_apply(self, seq: int, upserts: list[StoredDocument], deletes: list[str]) -> None:
        self.bm25.apply(upserts, deletes)
        self.bm25_seq = seq
        atomic_write_text(self._state_path, json.dumps({"bm25_seq": seq}))

    # -- writes -----------------------------------------------------------------------------

    async def upsert(
        self, tenant: str, documents: list[DocumentInput], *, writer: Writer | None = None
    ) -> WriteResult:
        """Writes `documents` of `tenant`; `writer` (a caller's write, not the service's
        own) must be allowed to (permissions.py)."""
        if writer is not None:
            check_may_write(writer, "Upsert")
            check_acls(writer, [d.acl for d in documents])
        dim = self.settings.dim
        seen: set[str] = set()
        for index, doc in enumerate(documents):
            if doc.vector and len(doc.vector) != dim:
                raise InvalidArgument(
                    f"documents[{index}].vector",
                    f"has {len(doc.vector)} dimensions; this index has {dim}",
                )
            if doc.id in seen:
                raise InvalidArgument(
                    f"documents[{index}].id", f"{doc.id!r} appears twice in one request"
                )
            seen.add(doc.id)
        overwritten = await self._overwritten(tenant, [d.id for d in documents], writer)
        for named in sorted({d.vector_model for d in documents if d.vector and d.vector_model}):
            await self.models.check_named(named)
        missing = [i for i, d in enumerate(documents) if not d.vector]
        vectors: dict[int, tuple[float, ...]] = {}
        model = CALLER_VECTOR
        if missing:
            if self._embed is None:
                raise InvalidArgument(
                    "documents[].vector", "this index has no embedding service; send vectors"
                )
            embedded = await self._embed(
                [passage_text(documents[i].title, documents[i].text) for i in missing],
                "passage",
            )
            await self.models.check(embedded.model_version, writing=True)
            vectors = {i: embedded.vectors[n] for n, i in enumerate(missing)}
            model = embedded.model_version
        # The log assigns the version; documents carry it once the sequence is known. Each
        # names the model of its vector (for a later re-embed; CALLER_VECTOR: the caller's).
        records = [
            {
                "tenant": tenant,
                "id": d.id,
                "title": d.title,
                "text": d.text,
                "acl": list(d.acl),
                "attributes": dict(d.attributes),
                "vector": encode_vector(d.vector if d.vector else vectors[i]),
                "version": 0,
                "model": (d.vector_model or CALLER_VECTOR) if d.vector else model,
            }
            for i, d in enumerate(documents)
        ]
        seq, tseq = await self._write(
            {"op": "write", "tenant": tenant, "upserts": records, "deletes": []}
        )
        self._tell_changed(tenant, overwritten)
        if overwritten:
            self.compaction.text_to_forget()  # the replaced text, as a deleted one's
        return WriteResult(seq, [tseq] * len(records), tenant_seq=tseq)

    async def _rewrite(
        self, tenant: str, batch: list[Stale], vectors: np.ndarray, target: str
    ) -> None:
        """One re-embedded batch (reembed.py), written while no caller's write is in flight."""
        async with self._turns.exclusive():
            # No other write is in flight: a document a caller rewrote or deleted since the
            # log was read has another version now, and is left as it is.
            current = await asyncio.to_thread(
                self.bm25.versions, tenant, [point_id(s.key) for s in batch]
            )
            records = [
                {**s.item, "vector": encode_vector(vectors[n]), "model": target, "version": 0}
                for n, s in enumerate(batch)
                if current.get(point_id(s.key)) == s.version
            ]
            if records:
                await self._write(
                    {"op": "write", "tenant": tenant, "upserts": records, "deletes": []},
                    turn=False,
                )

    async def drain_writes(self) -> None:
        """Waits for the writes in flight (logged, being applied): closing the log under
        them would lose what a caller may already have been told is written."""
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    async def delete(
        self, tenant: str, ids: list[str], *, writer: Writer | None = None
    ) -> WriteResult:
        """Deletes `ids` of `tenant`; a `writer` deletes only documents it can see (the
        others count as not found, as absent ones do)."""
        if writer is not None:
            check_may_write(writer, "Delete")
        keys = [doc_key(tenant, i) for i in dict.fromkeys(ids)]
        pids = [point_id(k) for k in keys]
        if writer is None:
            deletable = await asyncio.to_thread(self.bm25.existing, tenant, pids)
        else:
            _, deletable = await self._existing_and_seen(writer, pids)
        present = [k for k, pid in zip(keys, pids, strict=True) if pid in deletable]
        if not present:
            tseq = self.tenant_applied.get(tenant, 0)
            return WriteResult(self.applied_seq, [], 0, len(keys), tenant_seq=tseq)
        seq, tseq = await self._write(
            {"op": "write", "tenant": tenant, "upserts": [], "deletes": present}
        )
        self._tell_changed(tenant, [split_key(k)[1] for k in present])
        self.compaction.text_to_forget()
        return WriteResult(seq, [], len(present), len(keys) - len(present), tenant_seq=tseq)

    async def _existing_and_seen(
        self, writer: Writer, pids: list[int]
    ) -> tuple[set[int], set[int]]:
        """Which of `pids` are documents of the writer's tenant, and which of those it sees."""
        existing = await asyncio.to_thread(self.bm25.existing, writer.tenant, pids)
        if not existing:
            return existing, set()
        seen = await asyncio.to_thread(self.bm25.resolve, writer.visibility, list(existing))
        return existing, set(seen)

    async def _overwritten(self, tenant: str, ids: list[str], writer: Writer | None) -> list[str]:
        """The ids of `ids` that name existing documents of `tenant`; a `writer` that
        cannot see one of them is refused (it may not overwrite it)."""
        by_pid = {point_id(doc_key(tenant, i)): i for i in dict.fromkeys(ids)}
        if writer is None:
            existing = await asyncio.to_thread(self.bm25.existing, tenant, list(by_pid))
        else:
            existing, seen = await self._existing_and_seen(writer, list(by_pid))
            refuse_hidden_overwrites([by_pid[pid] for pid in by_pid if pid in existing - seen])
        return [by_pid[pid] for pid in by_pid if pid in existing]

    def _tell_changed(self, tenant: str, ids: list[str]) -> None:
        if ids and self._changed is not None:
            self._changed(tenant, ids)

    async def _write(self, record: dict, *, turn: bool = True) -> tuple[int, int]:
        """Log, then apply; returns (seq, tenant seq). Shielded: once a record may be in
        the log it is applied even if the caller goes away, or every later write would wait
        for it forever. A caller's write takes a shared turn (a re-embed batch waits for
        it, reembed.py); the re-embed's own write runs in its exclusive one."""

        async def log_and_apply() -> tuple[int, int]:
            async with self._turns.shared() if turn else contextlib.nullcontext():
                return await logged_and_applied()

        async def logged_and_applied() -> tuple[int, int]:
            seq, tseq = await self.wal.append_numbered(record)
            assert tseq is not None  # a write names its tenant
            # A document's version is its write's number among the tenant's writes.
            upserts = [
                StoredDocument.from_record({**r, "version": tseq}) for r in record["upserts"]
            ]
            await self._apply_in_order(seq, upserts, list(record["deletes"]))
            self.tenant_applied[record["tenant"]] = max(
                self.tenant_applied.get(record["tenant"], 0), tseq
            )
            return seq, tseq

        # The service's own work once logged: not bound by this caller's deadline (a write
        # sent with 10 ms to live must not make its apply, and every later write, fail).
        task = detached_task(log_and_apply(), name="write")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return await asyncio.shield(task)

    async def _apply_in_order(
        self, seq: int, upserts: list[StoredDocument], deletes: list[str]
    ) -> None:
        # Appends can complete out of order relative to their callers; apply strictly in
        # log order so a later write never lands under an earlier one.
        async with self._apply_turn:
            await self._apply_turn.wait_for(lambda: self.applied_seq >= seq - 1)
            # The record is durable in the log: it must reach the indexes before any later
            # one, or replay (which starts after what the indexes report) would skip it.
            # So a failed apply is retried in place, later writes waiting behind it.
            delay = APPLY_RETRY_FIRST_S
            while True:
                try:
                    await asyncio.to_thread(self._apply_sync, seq, upserts, deletes)
                    break
                except Exception as error:  # an engine or disk failure, never the caller's
                    self.apply_error = f"record {seq}: {error}"
                    log.error("retrieval.apply_failed", seq=seq, error=str(error), retry_in_s=delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, APPLY_RETRY_MAX_S)
            self.apply_error = None
            self.applied_seq = max(self.applied_seq, seq)
            self._apply_turn.notify_all()

    def _apply_sync(self, seq: int, upserts: list[StoredDocument], deletes: list[str]) -> None:
        self._bm25_apply(seq, upserts, deletes)
        self.vectors.apply(seq, upserts, deletes)

    # -- search -----------------------------------------------------------------------------

    async def search(self, visibility: Visibility, query: SearchQuery) -> SearchResult:
        s = self.settings
        if query.vector and len(query.vector) != s.dim:
            raise InvalidArgument(
                "query_vector", f"has {len(query.vector)} dimensions; this index has {s.dim}"
            )
        stages: list[tuple[str, float]] = []
        mode, reason = query.mode, ""
        candidates = max(query.candidates or s.default_candidates, query.k)
        ef = query.hnsw_ef or max(s.default_hnsw_ef, candidates)
        vector = None
        early_bm25 = None
        if mode != SearchMode.BM25:
            if not self.vectors.ready():
                mode, reason = SearchMode.BM25, "vector_index_not_ready"
            elif query.vector:
                vector = np.asarray(query.vector, dtype=np.float32)
            else:
                vector, reason, early_bm25 = await self._embedded_query(
                    query, visibility, candidates, stages
                )
                if reason:
                    mode = SearchMode.BM25

        loop = asyncio.get_running_loop()
        ordered, resolved = await loop.run_in_executor(
            self._query_pool,
            *in_context(
                Engines(self.bm25, self.vectors, self.settings, self._half_pool).search,
                visibility,
                query,
                mode,
                vector,
                candidates,
                ef,
                stages,
                early_bm25,
            ),
        )
        hits = []
        for pid, score, parts in ordered:
            found = resolved.get(pid)
            if found is None:
                continue  # deleted between the engines' reads
            hits.append(
                SearchHit(
                    id=split_key(found.key)[1],
                    score=score,
                    version=found.version,
                    scores=parts,
                    title=found.title,
                    text=found.text,
                )
            )
        version = self.tenant_applied.get(visibility.tenant, 0)
        return SearchResult(hits, mode, mode != query.mode, reason, version, stages)

    async def _embedded_query(
        self,
        query: SearchQuery,
        visibility: Visibility,
        candidates: int,
        stages: list[tuple[str, float]],
    ) -> tuple[np.ndarray | None, str, Future | None]:
        """The query text's vector (None, and why the search falls back to BM25, where it
        cannot be compared with the index's), and BM25's search already under way where
        the mode needs one: it needs no vector, so it searches while the query is embedded
        (in its own pool, whose tasks never wait on others, as for HYBRID's halves)."""
        early_bm25 = None
        if query.mode in (SearchMode.HYBRID, SearchMode.PREFILTER):
            early_bm25 = self._half_pool.submit(
                *in_context(
                    timed_apart,
                    SearchMode.BM25,
                    self.bm25.search,
                    query.text,
                    visibility,
                    candidates,
                )
            )
        started = time.perf_counter()
        try:
            embedded = await embedding_call(self._embed)([query.text], "query")
        except (Unavailable, DeadlineExceeded) as error:
            log.warning("retrieval.embed_failed", error=str(error))
            vector, reason = None, "embedding_unavailable"
        except BaseException:
            if early_bm25 is not None:
                early_bm25.cancel()
            raise
        else:
            vector, reason = embedded.vectors[0], ""
            if not await self.models.check(embedded.model_version, writing=False):
                vector = None
                reason = (
                    REEMBEDDING if self.models.current.reembedding_to else EMBEDDING_MODEL_CHANGED
                )
        stages.append(("embed", time.perf_counter() - started))
        return vector, reason, early_bm25

    async def document_versions(
        self, visibility: Visibility, ids: list[str]
    ) -> tuple[dict[str, int], int]:
        """The current version of each of `ids` that exists and `visibility` may see (absent
        otherwise: a hidden document and a deleted one look the same), and the tenant's
        index version. What a cache checks an entry against, cheaper than a search."""
        pids = [point_id(doc_key(visibility.tenant, i)) for i in dict.fromkeys(ids)]
        found = await asyncio.to_thread(self.bm25.resolve, visibility, pids)
        versions = {split_key(hit.key)[1]: hit.version for hit in found.values()}
        return versions, self.tenant_applied.get(visibility.tenant, 0)

    # -- state ------------------------------------------------------------------------------

    async def status(self, tenant: str, *, operator: bool = False) -> IndexStatus:
        """The index as `tenant` may see it: its own documents and write numbers. Figures
        that count every tenant's documents and writes go to operators only (zero here
        otherwise), since they would show a tenant how much the others write."""

        def read() -> IndexStatus:
            vectors = self.vectors.status()
            mine = self.tenant_applied.get(tenant, 0)
            return IndexStatus(
                index_version=self.applied_seq if operator else mine,
                tenant_documents=self.bm25.count_tenant(tenant),
                total_documents=self.bm25.count() if operator else 0,
                log_sequence=self.wal.last_seq if operator else self.wal.tenant_last.get(tenant, 0),
                applied_sequence=self.applied_seq if operator else mine,
                delta_documents=vectors.points - vectors.indexed_points if operator else 0,
                vector_index_ready=vectors.ready,
                # Builds follow every tenant's writes (one every N): their timing is the
                # operators' to see, or a tenant could read the others' write rate.
                rebuilding=vectors.building if operator else False,
                last_build_finished=self.last_build_finished if operator else None,
                dim=self.settings.dim,
                apply_error=(self.apply_error or "") if operator else "",
                reembedding_to=self.models.current.reembedding_to,
                reembed_remaining=self.models.remaining
                if operator and self.models.current.reembedding_to
                else 0,
            )

        return await asyncio.to_thread(read)

    # -- background HNSW builds -------------------------------------------------------------

    async def maybe_build(self) -> bool:
        if not self.vectors.needs_build():
            return False
        upto = self.applied_seq
        started = time.monotonic()
        await asyncio.to_thread(self.vectors.build, upto)
        self.last_build_finished = time.time()
        log.info(
            "retrieval.hnsw_built", upto_seq=upto, seconds=round(time.monotonic() - started, 1)
        )
        return True

    def close(self) -> None:
        """Closes the engines (after `models.stop()` when a loop runs)."""
        self.models.cancel()  # a re-embed resumes at the next start (vector_model.json)
        self._query_pool.shutdown(wait=True)
        self._half_pool.shutdown(wait=True)
        self.wal.close()
        self.bm25.close()
        self.vectors.close()
