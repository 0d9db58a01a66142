"""Embedding many texts in process (tools: eval, bench, ingest of large files)."""

from __future__ import annotations

import numpy as np

from ragline_services.embedding.batcher import bucket_groups, pad


def embed_texts(backend, tokenizer, texts: list[str], batch: int = 32) -> np.ndarray:
    """Vectors of `texts` (L2-normalised), batched by length bucket like the service does."""
    tokens = tokenizer.encode(texts, refuse_over_limit=False)
    out = np.empty((len(texts), backend.dim), dtype=np.float32)
    for group in bucket_groups([t.length for t in tokens], batch):
        out[group] = backend.run(*pad([tokens[i] for i in group]))
    return out
