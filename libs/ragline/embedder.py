"""Embedding text: validate, tokenize, batch, truncate dimensions. No gRPC here.

Shared by whatever embeds text with a model of the store: the embedding service, and an
in-process query encoder that runs the very model that service runs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ragline import deadlines
from ragline.batching import MicroBatcher, pad
from ragline.errors import InvalidArgument
from ragline.pooling import normalise
from ragline.tokenization import TokenizedText, Tokenizer

if TYPE_CHECKING:
    from ragline.embedding_backends import EmbeddingBackend
    from ragline.models import ModelSpec


@dataclass(frozen=True)
class EmbedResult:
    vectors: np.ndarray  # [texts, dim] float32, L2-normalised
    token_counts: list[int]
    truncated: list[bool]
    dim: int
    tokenize_s: float
    enqueued: float
    batch_started: float
    compute_s: float
    batch_texts: int


QUERY, PASSAGE = "query", "passage"


class Embedder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        batcher: MicroBatcher,
        *,
        model: str,
        model_version: str,
        dim: int,
        prefixes: dict[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.model = model
        self.model_version = model_version
        self.dim = dim
        # Asymmetric models (e5: "query: " / "passage: ") embed each kind with its own
        # prefix; symmetric ones (MiniLM) have none and treat both alike.
        self.prefixes = prefixes or {}

    async def embed(
        self,
        texts: list[str],
        *,
        dim: int = 0,
        refuse_over_limit: bool = False,
        input_type: str = PASSAGE,
        tenant: str = "",
        bulk: bool = False,
    ) -> EmbedResult:
        """`bulk`: nobody waits on it (an ingest); it runs after interactive work."""
        if dim > self.dim:
            raise InvalidArgument(
                "dim", f"is {dim}; model {self.model} has {self.dim} dimensions (0 means all)"
            )
        prefix = self.prefixes.get(input_type, "")
        if prefix:
            texts = [prefix + text for text in texts]
        started = time.monotonic()
        tokens = self.tokenizer.encode(texts, refuse_over_limit=refuse_over_limit)
        tokenize_s = time.monotonic() - started
        batch = await self.batcher.submit(
            tokens, deadlines.current_deadline(), tenant, urgent=not bulk
        )
        vectors = batch.vectors
        if dim and dim < self.dim:
            # Matryoshka-style truncation: keep the leading components, re-normalise.
            vectors = normalise(vectors[:, :dim])
        return EmbedResult(
            vectors=vectors,
            token_counts=[t.length for t in tokens],
            truncated=[t.truncated for t in tokens],
            dim=dim or self.dim,
            tokenize_s=tokenize_s,
            enqueued=batch.enqueued,
            batch_started=batch.batch_started,
            compute_s=batch.compute_s,
            batch_texts=batch.batch_texts,
        )


def input_prefixes(extra: dict[str, Any]) -> dict[str, str]:
    """What an asymmetric model wants before each kind of text, from its manifest entry's
    `query_prefix` / `passage_prefix` (none for symmetric ones)."""
    return {
        kind: extra[f"{kind}_prefix"] for kind in (QUERY, PASSAGE) if extra.get(f"{kind}_prefix")
    }


def batch_invariant(spec: ModelSpec) -> bool:
    """Whether a text's vector is the same whatever shares its batch (false for dynamic
    activation quantization, whose scales come from the whole batch)."""
    return bool(spec.extra.get("batch_invariant", True))


def texts_per_run(spec: ModelSpec, limit: int) -> int:
    """How many texts one model run of `spec` may hold, `limit` at most: one for a model
    that is not batch invariant, so that every process running a model version gives the
    same vectors (alone, as the embedding service runs it) and no text's vector depends on
    who else, another tenant, shares its run."""
    return limit if batch_invariant(spec) else 1


async def start_embedder(
    backend: EmbeddingBackend,
    tokenizer: Tokenizer,
    spec: ModelSpec,
    *,
    version: str,
    max_batch_texts: int = 32,
    **batcher_options: Any,
) -> Embedder:
    """An Embedder over `backend` for the model `spec`, its batcher started and one run
    made (kernels loaded, memory allocated, so the first caller does not pay for them). The
    one way a process embeds with a model of the store; runs hold `texts_per_run`."""

    async def run(texts: Sequence[TokenizedText]) -> np.ndarray:
        return await backend.embed(*pad(texts))

    batcher = MicroBatcher(
        run,
        max_batch_texts=texts_per_run(spec, max_batch_texts),
        max_parallel_runs=backend.parallel_runs,
        **batcher_options,
    )
    await batcher.start()
    embedder = Embedder(
        tokenizer,
        batcher,
        model=spec.name,
        model_version=version,
        dim=backend.dim,
        prefixes=input_prefixes(spec.extra),
    )
    try:
        await embedder.embed(["warm up"])
    except BaseException:
        await batcher.stop()
        raise
    return embedder
