"""Query text embedded in this process with the model the embedding service runs.

A search with query text waited for two gRPC hops (client -> retrieval -> embedding) and
the embedding service's queue; the hop to the embedding service and its batcher were
~2.4 ms of a ~13 ms recall stage (tools/bench_retrieval.py). When the machine's model
store holds the exact model version the embedding service answers with (same name, same
pinned sha256), the same graph and tokenizer run here and give the same vectors, so the
index sees no difference but the time.

The embedding service stays the authority: this encoder is used only while its version is
the one the service last reported (the retrieval service re-asks it now and then), passages
are always embedded there (it batches them across every core), and nothing is fetched or
derived here: a model the store does not hold ready is simply not used.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import structlog

from ragline.embedder import QUERY, Embedder, EmbedResult, start_embedder
from ragline.embedding_backends import OnnxRuntimeBackend
from ragline.models import ModelError, ModelSpec, ModelStore
from ragline.tokenization import Tokenizer

log = structlog.get_logger("ragline.retrieval")


class NotLoadable(Exception):
    """The model of a version cannot run here (the message says why); not an error."""


@dataclass
class _Loaded:
    spec: ModelSpec
    backend: OnnxRuntimeBackend
    tokenizer: Tokenizer


def load_model(model_dir: Path, version: str, *, parallel_runs: int) -> _Loaded:
    """The graph and tokenizer of `version` ("<model>@<sha256 prefix>") from the store, when
    it holds that exact version ready (blocking: hashes files the first time)."""
    name, _, _ = version.partition("@")
    store = ModelStore(model_dir)
    try:
        spec = store.spec(name)
    except ModelError as error:
        raise NotLoadable(str(error)) from None
    if spec.kind != "onnx-embedding":
        raise NotLoadable(f"{name} is a {spec.kind}, not an onnx-embedding model")
    if not (store.is_ready(name) and store.is_ready(spec.tokenizer)):
        raise NotLoadable(f"{name} is not prepared in {store.root}")
    if store.version(name) != version:
        raise NotLoadable(f"{store.root} holds {store.version(name)}, not {version}")
    return _Loaded(
        spec=spec,
        backend=OnnxRuntimeBackend(
            store.file(name, "model.onnx"), intra_op_threads=1, parallel_runs=parallel_runs
        ),
        tokenizer=Tokenizer(store.file(spec.tokenizer, "tokenizer.json"), spec.max_tokens),
    )


class LocalQueryEncoder:
    def __init__(
        self, model_dir: Path, *, parallel_runs: int = 1, max_batch_texts: int = 32
    ) -> None:
        self.model_dir = model_dir
        self.parallel_runs = parallel_runs
        self.max_batch_texts = max_batch_texts
        self._embedder: Embedder | None = None
        self._backend: OnnxRuntimeBackend | None = None
        self._not_loadable: dict[str, str] = {}  # version -> why (asked once per version)
        self._adopting: asyncio.Lock = asyncio.Lock()

    @property
    def version(self) -> str:
        """The model loaded here ("": none)."""
        return self._embedder.model_version if self._embedder is not None else ""

    def serves(self, version: str) -> bool:
        """Whether query text of the model `version` can be embedded here."""
        return bool(version) and version == self.version

    async def adopt(self, version: str) -> bool:
        """Loads the model of `version` (the embedding service's) unless it is loaded or
        cannot run here; True when it serves `version` afterwards."""
        async with self._adopting:
            if self.serves(version) or not version or version in self._not_loadable:
                return self.serves(version)
            try:
                loaded = await asyncio.to_thread(
                    load_model, self.model_dir, version, parallel_runs=self.parallel_runs
                )
            except NotLoadable as why:
                self._not_loadable[version] = str(why)
                log.info("retrieval.local_query_encoder_off", version=version, reason=str(why))
                return False
            except Exception as error:  # a graph ONNX Runtime refuses: the service serves
                self._not_loadable[version] = repr(error)
                log.warning(
                    "retrieval.local_query_encoder_failed", version=version, error=repr(error)
                )
                return False
            try:
                embedder = await start_embedder(
                    loaded.backend,
                    loaded.tokenizer,
                    loaded.spec,
                    version=version,
                    max_batch_texts=self.max_batch_texts,
                    max_wait_s=0.0,
                    name="retrieval-query-encoder",
                )
            except Exception as error:  # its warm-up run failed: queries use the service
                await loaded.backend.close()
                log.warning(
                    "retrieval.local_query_encoder_failed", version=version, error=repr(error)
                )
                return False
            except BaseException:
                await loaded.backend.close()
                raise
            previous = (self._embedder, self._backend)
            self._embedder, self._backend = embedder, loaded.backend
            log.info("retrieval.local_query_encoder_on", version=version)
            await self._close(*previous)
            return True

    async def embed(self, texts: list[str], *, dim: int, tenant: str = "") -> EmbedResult:
        assert self._embedder is not None
        return await self._embedder.embed(texts, dim=dim, input_type=QUERY, tenant=tenant)

    async def close(self) -> None:
        previous = (self._embedder, self._backend)
        self._embedder = self._backend = None
        await self._close(*previous)

    @staticmethod
    async def _close(embedder: Embedder | None, backend: OnnxRuntimeBackend | None) -> None:
        if embedder is not None:
            await embedder.batcher.stop()
        if backend is not None:
            await backend.close()
