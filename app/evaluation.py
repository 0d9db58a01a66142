"""Ranking metrics for test collections with one relevant document per query (SQuAD)."""

from __future__ import annotations

import collections
import math
import re
import string
from collections.abc import Sequence


def rank_of(ranked: Sequence[str], relevant: str) -> int:
    """1-based rank of the relevant id in `ranked`, 0 when absent."""
    for position, item in enumerate(ranked, start=1):
        if item == relevant:
            return position
    return 0


def ranking_metrics(rankings: Sequence[Sequence[str]], relevant: Sequence[str]) -> dict:
    """nDCG@10, Recall@10, Recall@100 and MRR@10 averaged over queries."""
    ranks = [rank_of(r, rel) for r, rel in zip(rankings, relevant, strict=True)]
    n = max(len(ranks), 1)
    return {
        "ndcg@10": sum(1 / math.log2(r + 1) for r in ranks if 0 < r <= 10) / n,
        "recall@10": sum(1 for r in ranks if 0 < r <= 10) / n,
        "recall@100": sum(1 for r in ranks if 0 < r <= 100) / n,
        "mrr@10": sum(1 / r for r in ranks if 0 < r <= 10) / n,
    }


# SQuAD answer scoring (the official normalisation).


def normalise(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    predicted, expected = normalise(prediction).split(), normalise(gold).split()
    common = collections.Counter(predicted) & collections.Counter(expected)
    overlap = sum(common.values())
    if not overlap:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(expected)
    return 2 * precision * recall / (precision + recall)
