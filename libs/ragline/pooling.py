"""Sentence vectors from a transformer's token states, the one way every service makes
them (the embedding service's backends, and rerank, whose token model run gives a
passage's embedding too): mean over the real tokens, as sentence-transformers does, then
L2 norm."""

from __future__ import annotations

import numpy as np


def mean_pool_normalise(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """[batch, tokens, width] states and their [batch, tokens] mask -> [batch, width]."""
    mask = attention_mask[..., None].astype(hidden.dtype)
    summed = (hidden * mask).sum(axis=1)
    counts = np.clip(mask.sum(axis=1), 1e-9, None)
    return normalise(summed / counts)


def normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit: np.ndarray = (vectors / np.clip(norms, 1e-12, None)).astype(np.float32)
    return unit
