"""One search through the engines, in one worker thread: BM25 (Tantivy), the vector
index, or both fused (HYBRID, the vector half on a second thread), then the k ranked
first resolved to keys and versions. Each engine's time is a stage of the report."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragline import tracing
from ragline.ranking import rrf, score_fusion
from ragline.vocabulary import Fusion, SearchMode
from ragline_services.retrieval.bm25 import LexicalIndex
from ragline_services.retrieval.documents import Visibility
from ragline_services.retrieval.index_types import IndexSettings, SearchQuery
from ragline_services.retrieval.vectors import VectorIndex

# Stages that are an engine's search, a span each while tracing is on (the others are
# short enough to read as the rest of the call's span).
_ENGINE_STAGES: dict[str, str] = {
    SearchMode.BM25: "search bm25",
    SearchMode.VECTOR: "search vector",
}


def timed_stage(stages: list[tuple[str, float]], name: str, fn, *args):
    """`fn(*args)`, its duration appended to `stages` as (name, seconds) and, for an
    engine's search (Tantivy, qdrant) while tracing is on, a span of its own."""
    started = time.perf_counter()
    if name in _ENGINE_STAGES and tracing.sampled():
        with tracing.span(_ENGINE_STAGES[name]):
            result = fn(*args)
    else:
        result = fn(*args)
    stages.append((name, time.perf_counter() - started))
    return result


def in_context(fn, *args):
    """`fn(*args)` in a copy of the caller's context (its trace) when run on a pool's
    thread; `fn` itself while nothing is traced."""
    if not tracing.sampled():
        return (fn, *args)
    return (contextvars.copy_context().run, fn, *args)


def timed_apart(name: str, fn, *args):
    """`fn(*args)` and its own stages list, for a half whose time is reported later (in
    the order of the report, not of the threads)."""
    stages: list[tuple[str, float]] = []
    return timed_stage(stages, name, fn, *args), stages


Hits = list[tuple[Hashable, float, dict[str, float]]]  # each hit's scores by part


@dataclass(frozen=True)
class Engines:
    """The engines a search reads, as the index holds them when the search starts."""

    bm25: LexicalIndex
    vectors: VectorIndex
    settings: IndexSettings
    half_pool: ThreadPoolExecutor

    def search(
        self,
        visibility: Visibility,
        query: SearchQuery,
        mode: SearchMode,
        vector: np.ndarray | None,
        candidates: int,
        ef: int,
        stages: list[tuple[str, float]],
        early_bm25: Future | None,
    ) -> tuple[Hits, dict]:
        """The whole search in one worker thread: the engines return point ids, and only
        the k ranked first are resolved to keys, versions (and text when asked).
        `early_bm25`: the BM25 half already started (`candidates` long), or None."""

        def timed(name: str, fn, *args):
            return timed_stage(stages, name, fn, *args)

        def bm25_pool():
            if early_bm25 is None:
                return timed(SearchMode.BM25, self.bm25.search, query.text, visibility, candidates)
            pool, own_stages = early_bm25.result()
            stages.extend(own_stages)
            return pool

        # each hit's scores by part ("bm25", "vector", "fused")
        ordered: Hits
        if mode == SearchMode.BM25:
            if early_bm25 is not None:  # a fallback: the first k of the longer list
                ranked = bm25_pool()[: query.k]
            else:
                ranked = timed(SearchMode.BM25, self.bm25.search, query.text, visibility, query.k)
            ordered = [(c.pid, c.score, {SearchMode.BM25: c.score}) for c in ranked]
        elif mode == SearchMode.VECTOR:
            ranked = timed(SearchMode.VECTOR, self.vectors.search, vector, visibility, query.k, ef)
            ordered = [(c.pid, c.score, {SearchMode.VECTOR: c.score}) for c in ranked]
        elif mode == SearchMode.PREFILTER:
            pool = bm25_pool()
            bm25_scores = {c.pid: c.score for c in pool}
            only = [c.pid for c in pool]
            ranked = (
                timed(SearchMode.VECTOR, self.vectors.search, vector, visibility, query.k, ef, only)
                if pool
                else []
            )
            ordered = [
                (c.pid, c.score, {SearchMode.VECTOR: c.score, SearchMode.BM25: bm25_scores[c.pid]})
                for c in ranked
            ]
        else:
            started_bm25 = bm25_pool if early_bm25 is not None else None
            ordered = self._hybrid(visibility, query, vector, candidates, ef, timed, started_bm25)
        resolved = timed(
            "resolve",
            self.bm25.resolve,
            visibility,
            [pid for pid, _, _ in ordered],
            query.include_text,
        )
        return ordered, resolved

    def _hybrid(
        self,
        visibility: Visibility,
        query: SearchQuery,
        vector: np.ndarray | None,
        candidates: int,
        ef: int,
        timed: Callable[..., Any],
        started_bm25: Callable[[], Any] | None,
    ) -> Hits:
        """Both halves and their fusion, each timed by `timed`. `started_bm25`: the BM25 half
        already started (its result when called), or None."""
        s = self.settings
        semantic = (SearchMode.VECTOR, self.vectors.search, vector, visibility, candidates, ef)
        if started_bm25 is not None:
            vector_list = timed(*semantic)
            bm25_list = started_bm25()
        else:
            # The vector half goes to the other thread and BM25 runs here: qdrant-edge
            # keeps the GIL for its whole search, so the other way round the BM25 thread
            # could not even start until the vector search had finished; this way the
            # vector search runs while Tantivy searches without the GIL.
            pending = (
                self.half_pool.submit(*in_context(timed, *semantic)) if s.parallel_hybrid else None
            )
            bm25_list = timed(SearchMode.BM25, self.bm25.search, query.text, visibility, candidates)
            vector_list = pending.result() if pending is not None else timed(*semantic)
        if (query.fusion or s.default_fusion) == Fusion.SCORE:
            fuse, weight = score_fusion, query.vector_weight or s.default_score_weight
        else:
            fuse, weight = rrf, query.vector_weight or s.default_vector_weight

        def fused() -> Hits:
            return [
                (pid, score, {**parts, "fused": score})
                for pid, score, parts in fuse(bm25_list, vector_list, weight, query.k)
            ]

        return timed("fusion", fused)
