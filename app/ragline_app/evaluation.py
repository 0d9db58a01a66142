"""Ranking metrics for test collections with one relevant document per query (SQuAD)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def rank_of(ranked: Sequence[Hashable], relevant: Hashable) -> int:
    """1-based rank of the relevant id in `ranked`, 0 when absent."""
    for position, item in enumerate(ranked, start=1):
        if item == relevant:
            return position
    return 0


def ranking_metrics(rankings: Sequence[Sequence[Hashable]], relevant: Sequence[Hashable]) -> dict:
    """nDCG@10, Recall@10, Recall@100 and MRR@10 averaged over queries."""
    ranks = [rank_of(r, rel) for r, rel in zip(rankings, relevant, strict=True)]
    n = max(len(ranks), 1)
    return {
        "ndcg@10": sum(1 / math.log2(r + 1) for r in ranks if 0 < r <= 10) / n,
        "recall@10": sum(1 for r in ranks if 0 < r <= 10) / n,
        "recall@100": sum(1 for r in ranks if 0 < r <= 100) / n,
        "mrr@10": sum(1 / r for r in ranks if 0 < r <= 10) / n,
    }
