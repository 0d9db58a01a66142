"""Embedding many texts in process (tools: eval, bench, ingest of large files)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ragline.batching import bucket_groups, pad
from ragline.embedder import PASSAGE, QUERY, input_prefixes, texts_per_run
from ragline.embedding_backends import OnnxRuntimeBackend
from ragline.models import ModelSpec, ModelStore
from ragline.tokenization import Tokenizer


@dataclass
class OfflineEmbedder:
    backend: OnnxRuntimeBackend
    tokenizer: Tokenizer
    spec: ModelSpec

    def embed(self, texts: list[str], batch: int = 32, kind: str = PASSAGE) -> np.ndarray:
        """Vectors of `texts` (L2-normalised), batched by length bucket like the service,
        and, like it, only as many per run as the model allows, each after the prefix the
        model wants for its `kind` (an e5 model's "query: "): the service's vectors."""
        prefix = input_prefixes(self.spec.extra).get(kind, "")
        if prefix:
            texts = [prefix + text for text in texts]
        batch = texts_per_run(self.spec, batch)
        tokens = self.tokenizer.encode(texts, refuse_over_limit=False)
        out = np.empty((len(texts), self.backend.dim), dtype=np.float32)
        for group in bucket_groups([t.length for t in tokens], batch):
            out[group] = self.backend.run(*pad([tokens[i] for i in group]))
        return out


def load_embedder(
    model: str, *, threads: int = 2, max_tokens: int | None = None
) -> OfflineEmbedder:
    """A model's ONNX graph and its tokenizer from the model store (fetched if missing)."""
    store = ModelStore()
    store.prepare(model)
    spec = store.spec(model)
    tokenizer = Tokenizer(
        store.file(spec.tokenizer, "tokenizer.json"), max_tokens or spec.max_tokens
    )
    return OfflineEmbedder(
        OnnxRuntimeBackend(store.file(model, "model.onnx"), intra_op_threads=threads),
        tokenizer,
        spec,
    )


def squad_vectors(
    path: Path, model: str, passages, questions, threads: int
) -> tuple[np.ndarray, np.ndarray, str]:
    """Passage and question vectors of a SQuAD-format file and the model version, cached
    next to the file in a .npz keyed by that version (a read-only folder: no cache)."""
    store = ModelStore()
    store.prepare(model)
    version = store.version(model).split("@", 1)[1]
    cache = path.with_suffix(f".{model}.{version}.npz")
    if cache.exists():
        data = np.load(cache)
        return data["passages"], data["questions"], version
    embedder = load_embedder(model, threads=threads)
    started = time.monotonic()
    p = embedder.embed([f"{x.title}. {x.text}" for x in passages])
    q = embedder.embed([x.text for x in questions], kind=QUERY)
    print(
        f"embedded {len(p)} passages, {len(q)} questions in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    try:
        np.savez(cache, passages=p, questions=q)
    except OSError:
        pass
    return p, q, version
