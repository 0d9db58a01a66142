"""The two models of the cascade, on ONNX Runtime, each behind a micro-batcher.

- TokenEncoder: the embedding model's per-token vectors (`last_hidden_state`), reduced for
  storage to `dim` components by a fixed orthogonal projection (seeded, so every process
  projects alike) and to int8 with one scale per token; and, from the same run, each
  text's embedding (the mean-pooled states), so a passage is encoded once for both.
- CrossEncoder: a sequence classifier that reads (query, passage) together: one logit.

Each runs on threads of its own, so the event loop never waits on them: the token
encoder up to `parallel_runs` batches at once (bulk preparation uses every core), the
cross-encoder one batch at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ragline.batching import pad, pad_pairs
from ragline.errors import FailedPrecondition
from ragline.pooling import mean_pool_normalise
from ragline.tokenization import TokenizedText

PROJECTION_SEED = 20261130


def _session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def projection(width: int, dim: int) -> np.ndarray:
    """A [width, dim] matrix with orthonormal columns (dim >= width: the identity)."""
    if dim >= width:
        return np.eye(width, dtype=np.float32)
    gaussian = np.random.default_rng(PROJECTION_SEED).normal(size=(width, dim))
    q, _ = np.linalg.qr(gaussian)
    return q.astype(np.float32)


def quantize(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 rows and their scales (symmetric, one scale per row)."""
    scales = np.maximum(np.abs(vectors).max(axis=1), 1e-12) / 127.0
    return np.round(vectors / scales[:, None]).astype(np.int8), scales.astype(np.float32)


def dequantize(rows: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return rows.astype(np.float32) * scales[:, None]


@dataclass(frozen=True)
class EncodedText:
    """One text's run: its token vectors ([tokens, dim] float32, each row of length 1, the
    [CLS] and [SEP] rows left out) and its embedding (all states mean-pooled, L2 norm 1)."""

    tokens: np.ndarray
    embedding: np.ndarray


class TokenEncoder:
    """Token vectors and embeddings of texts, up to `parallel_runs` batches at once."""

    def __init__(
        self, model_path: Path, *, dim: int, threads: int = 1, parallel_runs: int = 1
    ) -> None:
        self._session = _session(model_path, threads)
        inputs = {i.name for i in self._session.get_inputs()}
        self._types = "token_type_ids" in inputs
        outputs = [o.name for o in self._session.get_outputs()]
        if "last_hidden_state" not in outputs:
            raise FailedPrecondition(
                f"{model_path} has no last_hidden_state output ({outputs}): late interaction "
                "needs a token-level embedding model"
            )
        width = int(self._session.get_outputs()[outputs.index("last_hidden_state")].shape[-1])
        self.projection = projection(width, dim)
        self.dim = min(dim, width)
        self.parallel_runs = max(1, parallel_runs)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.parallel_runs, thread_name_prefix="li"
        )

    def run_sync(self, texts: Sequence[TokenizedText]) -> list[EncodedText]:
        ids, mask = pad(texts)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self._types:
            feeds["token_type_ids"] = np.zeros_like(ids)
        (hidden,) = self._session.run(["last_hidden_state"], feeds)
        embeddings = mean_pool_normalise(hidden, mask)
        out = []
        for row, text in enumerate(texts):
            tokens = hidden[row, 1 : max(text.length - 1, 2)] @ self.projection
            norms = np.linalg.norm(tokens, axis=1, keepdims=True)
            tokens = (tokens / np.clip(norms, 1e-12, None)).astype(np.float32)
            out.append(EncodedText(tokens, embeddings[row]))
        return out

    async def run(self, texts: Sequence[TokenizedText]) -> list[EncodedText]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run_sync, texts)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def maxsim_many(query: np.ndarray, documents: list[np.ndarray]) -> np.ndarray:
    """Late interaction (MaxSim) of the query against each document: each query token's
    best match in the document, averaged; 0 for a document without tokens. One product
    over every document's tokens (one call into BLAS instead of one per candidate)."""
    scores = np.zeros(len(documents), dtype=np.float32)
    present = [i for i, d in enumerate(documents) if len(d)]
    if not len(query) or not present:
        return scores
    kept = [documents[i] for i in present]
    starts = np.cumsum([0] + [len(d) for d in kept[:-1]])
    similarities = query @ np.concatenate(kept).T  # [query tokens, all document tokens]
    scores[present] = np.maximum.reduceat(similarities, starts, axis=1).mean(axis=0)
    return scores


class CrossEncoder:
    """Scores encoded (query, passage) pairs: one logit each."""

    def __init__(self, model_path: Path, *, threads: int = 1) -> None:
        self._session = _session(model_path, threads)
        self._output = self._session.get_outputs()[0].name
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ce")

    def run_sync(self, pairs: Sequence[TokenizedText]) -> np.ndarray:
        ids, mask, types = pad_pairs(pairs)
        (logits,) = self._session.run(
            [self._output], {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        )
        return logits.reshape(len(pairs), -1)[:, 0].astype(np.float32)

    async def run(self, pairs: Sequence[TokenizedText]) -> np.ndarray:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run_sync, pairs)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
