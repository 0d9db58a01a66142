"""Merging a BM25 and a vector candidate list into one ranking (HYBRID search).

Used where the two lists meet: inside the retrieval service (HYBRID mode) and in the
orchestrator's plan (BM25 and vector search as separate nodes).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from ragline.vocabulary import SearchMode


class Candidate(Protocol):
    """Anything with a key (a document id, or any hashable that names it) and a score
    (higher is better)."""

    @property
    def key(self) -> Hashable: ...

    @property
    def score(self) -> float: ...


RRF_K = 60


def rrf(
    bm25: Sequence[Candidate], vector: Sequence[Candidate], vector_weight: float, k: int
) -> list[tuple[Hashable, float, dict[str, float]]]:
    """Weighted reciprocal-rank fusion: w/(60 + rank_vector) + (1 - w)/(60 + rank_bm25)."""
    fused: dict[Hashable, float] = {}
    parts: dict[Hashable, dict[str, float]] = {}
    for weight, name, ranked in (
        (1 - vector_weight, SearchMode.BM25, bm25),
        (vector_weight, SearchMode.VECTOR, vector),
    ):
        for rank, candidate in enumerate(ranked, start=1):
            fused[candidate.key] = fused.get(candidate.key, 0.0) + weight / (RRF_K + rank)
            parts.setdefault(candidate.key, {})[name] = candidate.score
    ordered = sorted(fused.items(), key=lambda item: -item[1])[:k]
    return [(key, score, parts[key]) for key, score in ordered]


def _normalised(ranked: Sequence[Candidate]) -> dict[Hashable, float]:
    if not ranked:
        return {}
    scores = [c.score for c in ranked]
    low, high = min(scores), max(scores)
    span = high - low or 1.0
    return {c.key: (c.score - low) / span for c in ranked}


def score_fusion(
    bm25: Sequence[Candidate], vector: Sequence[Candidate], vector_weight: float, k: int
) -> list[tuple[Hashable, float, dict[str, float]]]:
    """Weighted sum of min-max normalised scores (a list's missing document scores 0)."""
    b, v = _normalised(bm25), _normalised(vector)
    raw: dict[Hashable, dict[str, float]] = {c.key: {SearchMode.BM25: c.score} for c in bm25}
    for c in vector:
        raw.setdefault(c.key, {})[SearchMode.VECTOR] = c.score
    fused = {
        key: (1 - vector_weight) * b.get(key, 0.0) + vector_weight * v.get(key, 0.0) for key in raw
    }
    ordered = sorted(fused.items(), key=lambda item: -item[1])[:k]
    return [(key, score, raw[key]) for key, score in ordered]
