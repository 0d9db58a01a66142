"""The write log's compaction and the BM25 re-analysis, both rewrites from the log.

A compaction rewrites the log with only what a replay can need (wal.py), when it has grown
past `wal_compact_bytes` (and twice what the last one left), or once the text of a
deleted or overwritten document has waited `forget_after_s`: that text then leaves every
file (BM25 is rewritten for its tenants, the HNSW shard built again). The re-analysis
re-indexes, in the background, each tenant's BM25 index that an earlier lexical analysis
made (analysis.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from ragline_services.retrieval.bm25 import LexicalIndex
from ragline_services.retrieval.documents import StoredDocument
from ragline_services.retrieval.index_types import IndexSettings
from ragline_services.retrieval.vectors import VectorIndex
from ragline_services.retrieval.wal import WriteLog, live_documents

log = structlog.get_logger("ragline.retrieval")


class LogCompaction:
    def __init__(
        self,
        wal: WriteLog,
        bm25: LexicalIndex,
        vectors: VectorIndex,
        settings: IndexSettings,
        *,
        applied_by_all: Callable[[], int],
    ) -> None:
        """`applied_by_all()`: the last write both engines hold (a tombstone after it is
        kept: a replay may need it)."""
        self.wal = wal
        self.bm25 = bm25
        self.vectors = vectors
        self.settings = settings
        self._applied_by_all = applied_by_all
        # What the last compaction left, and since when a logged text waits to be forgotten.
        self._compacted_bytes = 0
        self._forget_pending_since: float | None = None
        self.count = 0  # compactions made since start
        self._reanalysis_stopped = False

    def text_to_forget(self, *, age_unknown: bool = False) -> None:
        """A deleted or overwritten document's text is in the log from now (`age_unknown`:
        found at start, counted from now too)."""
        if age_unknown or self._forget_pending_since is None:
            self._forget_pending_since = time.monotonic()

    async def maybe_compact(self) -> bool:
        """Compacts the write log when it has grown past `wal_compact_bytes` (and twice
        what the last compaction left), or the text of a deleted or overwritten document has
        waited `forget_after_s`."""
        settings, size = self.settings, self.wal.size
        by_size = bool(settings.wal_compact_bytes) and size > max(
            settings.wal_compact_bytes, 2 * self._compacted_bytes
        )
        pending = self._forget_pending_since
        by_age = (
            bool(settings.forget_after_s)
            and pending is not None
            and time.monotonic() - pending >= settings.forget_after_s
        )
        if not (by_size or by_age):
            return False
        await self.compact("size" if by_size else "forget")
        return True

    def stop_reanalysis(self) -> None:
        """The re-indexing stops after its current pass (what is left: at the next start)."""
        self._reanalysis_stopped = True

    async def reanalyse(self, tenants_per_pass: int = 16) -> int:
        """Re-indexes in the background each tenant's BM25 index that an earlier lexical
        analysis made (analysis.py), from the write log; each answers as before until its
        new index is swapped in. Returns how many tenants it re-indexed."""
        outdated = await asyncio.to_thread(self.bm25.outdated_tenants)
        started = time.monotonic()
        for start in range(0, len(outdated), tenants_per_pass):
            if self._reanalysis_stopped:
                return start
            # One read of the log per pass, holding the live documents of these tenants.
            chosen = set(outdated[start : start + tenants_per_pass])
            await asyncio.to_thread(self.bm25.rewrite, chosen, self._live_documents)
        if outdated:
            log.info(
                "retrieval.bm25_reanalysed",
                tenants=len(outdated),
                seconds=round(time.monotonic() - started, 3),
            )
        return len(outdated)

    async def compact(self, why: str = "asked") -> tuple[int, int]:
        """Rewrites the log with only what a replay can need (wal.py): the text of
        deleted and overwritten documents leaves it. Returns (bytes before, after)."""
        applied_by_all = self._applied_by_all()
        started = time.monotonic()
        before, after, dropped, forgotten = await asyncio.to_thread(
            self.wal.compact, applied_by_all
        )
        if forgotten:
            # The engines keep what they no longer show until they merge or rebuild: BM25
            # is rewritten for these tenants from the compacted log, the HNSW shard is
            # built again from it.
            await asyncio.to_thread(self.bm25.rewrite, forgotten, self._live_documents)
            self.vectors.request_build()
        self._compacted_bytes = after
        self._forget_pending_since = None  # replaced text is gone; tombstones hold only ids
        self.count += 1
        log.info(
            "retrieval.log_compacted",
            why=why,
            bytes_before=before,
            bytes_after=after,
            records_dropped=dropped,
            tenants_rewritten=len(forgotten),
            tombstones_kept_after=applied_by_all,
            seconds=round(time.monotonic() - started, 3),
        )
        return before, after

    def _live_documents(self, tenants: set[str]) -> dict[str, list[StoredDocument]]:
        """Every live document of `tenants`, from the write log."""
        live: dict[str, list[StoredDocument]] = {tenant: [] for tenant in tenants}
        for doc in live_documents(self.wal.path):
            if doc.tenant in live:
                live[doc.tenant].append(doc)
        return live
