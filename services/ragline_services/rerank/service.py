"""Wiring of the rerank service: models from the manifest, batchers, the cascade."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from pydantic import Field

from ragline.batching import MicroBatcher
from ragline.config import ServiceConfig
from ragline.cores import parallel_runs
from ragline.embedder import PASSAGE, QUERY, input_prefixes, texts_per_run
from ragline.errors import FailedPrecondition
from ragline.metrics import ProcessMetrics
from ragline.models import ModelSpec, ModelStore
from ragline.server import Service, ServiceSpec
from ragline.stopwords import CHINESE_STOP_WORDS, STOP_WORDS
from ragline.tokenization import Tokenizer
from ragline.v1 import rerank_pb2, rerank_pb2_grpc
from ragline_services.rerank.cascade import Reranker, TokenCache
from ragline_services.rerank.models import PROJECTION_SEED, CrossEncoder, TokenEncoder
from ragline_services.rerank.servicer import RerankServicer
from ragline_services.rerank.token_store import TokenStore, store_name

log = structlog.get_logger("ragline.rerank")


class RerankConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("rerank")
    # Stage 1: an embedding model of the manifest with per-token outputs; the embedding
    # service's model, so that ingest takes a passage's embedding from this run.
    token_model: str = "me5-small-int8"
    # Token vectors are stored projected to this many components, int8: a third of the
    # memory for 0.002 nDCG@10 (docs/tuning.md).
    token_dim: int = Field(128, ge=8, le=4096)
    token_cache_mb: int = Field(256, ge=1)
    # The token vectors on disk too, so that a restart does not encode again what Prepare
    # (or earlier queries) encoded: bound in MiB (0: memory only) and folder (default:
    # RAGLINE_DATA_DIR/rerank).
    token_store_mb: int = Field(2048, ge=0)
    token_store_dir: Path | None = None
    # An entry unused this long is deleted (0: only the size bound): the vectors of a
    # deleted document leave the disk within it.
    token_store_retention_s: float = Field(7 * 86400.0, ge=0)
    # MaxSim averages over the query's tokens except stop words and punctuation, whose best
    # match says little about a passage (docs/tuning.md).
    query_skip_stop_words: bool = True
    # Weight of MaxSim against the candidate's incoming score in stage 1 (0..1; the sweep:
    # docs/tuning.md).
    late_interaction_weight: float = Field(0.7, ge=0, le=1)
    # Weight of the cross-encoder's score against stage 1's in stage 2 (0..1).
    cross_encoder_weight: float = Field(0.3, ge=0, le=1)
    # Stage 2: a cross-encoder of the manifest ("" turns stage 2 off).
    cross_encoder_model: str = "minilm-ce-l3-int8"
    # Stage-1 survivors the cross-encoder reads: more cost time and found nothing more
    # (docs/tuning.md).
    cross_encoder_candidates: int = Field(5, ge=1, le=1000)
    # Tokens of one (query, passage) pair (0: the model's own limit); the passage is cut,
    # which costs nothing in quality and a quarter of the time (docs/tuning.md).
    cross_encoder_max_tokens: int = Field(96, ge=0, le=512)
    model_dir: Path | None = None
    prepare_models: bool = True
    intra_op_threads: int = Field(1, ge=1)
    # Token-model runs at once (0 = the cores this process may use divided by
    # intra_op_threads): a bulk Prepare (ingest, which takes each passage's embedding from
    # the same run) keeps every core busy; a question's run still waits for at most one
    # bulk run, as with one runner. The cross-encoder keeps one run at a time.
    token_parallel_runs: int = Field(0, ge=0)
    # ONNX Runtime threads of the cross-encoder's runs (0: intra_op_threads), for a rerank
    # with cores to itself; on shared cores more threads contend (docs/tuning.md).
    cross_encoder_threads: int = Field(0, ge=0)
    max_batch_texts: int = Field(32, ge=1)
    # How long a batch waits for more work once the model is free. 0: work that arrives
    # while a batch runs forms the next one anyway (Triton's default too; docs/tuning.md).
    max_wait_ms: float = Field(0.0, ge=0)
    max_queue_texts: int = Field(4096, ge=1)
    # One tenant's share of the queue (0: half of it).
    max_queue_texts_per_tenant: int = Field(0, ge=0)


# Texts per token-model run of bulk work (Prepare of documents): a question's rerank that
# arrives while every runner is busy with passages waits for one such run, so a few texts.
BULK_BATCH_TEXTS = 8
# SentencePiece vocabularies (XLM-R's, multilingual-e5's) mark a word's start with this.
_WORD_START = "\u2581"
_SKIPPED_WORDS = STOP_WORDS | CHINESE_STOP_WORDS


def skipped_query_tokens(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokens late interaction leaves out of a query: stop words (English and
    Chinese, as WordPiece or SentencePiece spells them), and tokens without a letter or
    digit (punctuation, special tokens)."""
    return frozenset(
        token_id
        for token, token_id in tokenizer.vocabulary().items()
        if token.removeprefix(_WORD_START).lower() in _SKIPPED_WORDS
        or not any(c.isalnum() for c in token)
    )


@dataclass
class Built:
    reranker: Reranker
    batchers: list[MicroBatcher]
    models: list

    async def close(self) -> None:
        for batcher in self.batchers:
            await batcher.stop()
        for model in self.models:
            model.close()


async def _start_batcher(
    cfg: RerankConfig, name: str, run, parallel_runs: int = 1, *, spec: ModelSpec | None = None
) -> MicroBatcher:
    """A batcher over `run`; for an embedding model `spec`, its runs hold what the model
    allows (`texts_per_run`)."""

    def limit(texts: int) -> int:
        return texts if spec is None else texts_per_run(spec, texts)

    made = MicroBatcher(
        run,
        max_batch_texts=limit(cfg.max_batch_texts),
        max_wait_s=cfg.max_wait_ms / 1000,
        max_queue_texts=cfg.max_queue_texts,
        max_queue_texts_per_tenant=cfg.max_queue_texts_per_tenant,
        name=name,
        max_parallel_runs=parallel_runs,
        max_bulk_batch_texts=limit(BULK_BATCH_TEXTS),
    )
    await made.start()
    return made


async def _cross_encoder(cfg: RerankConfig, store: ModelStore) -> tuple[CrossEncoder, Tokenizer]:
    """The cross-encoder the settings name, and its pair tokenizer."""
    spec = store.spec(cfg.cross_encoder_model)
    if spec.kind != "onnx-cross-encoder":
        raise FailedPrecondition(
            f"RAGLINE_RERANK_CROSS_ENCODER_MODEL={cfg.cross_encoder_model} is a "
            f"{spec.kind}, not an onnx-cross-encoder"
        )
    cross = await asyncio.to_thread(
        CrossEncoder,
        store.file(cfg.cross_encoder_model, "model.onnx"),
        threads=cfg.cross_encoder_threads or cfg.intra_op_threads,
    )
    pair_tokenizer = Tokenizer(
        store.file(cfg.cross_encoder_model, "tokenizer.json"),
        min(cfg.cross_encoder_max_tokens or spec.max_tokens, spec.max_tokens),
    )
    return cross, pair_tokenizer


async def build_reranker(
    cfg: RerankConfig, store: ModelStore, token_store: TokenStore | None = None
) -> Built:
    """The cascade from the manifest's models (the service and tools/eval_retrieval)."""
    batchers: list[MicroBatcher] = []
    models: list = []
    token_spec = store.spec(cfg.token_model)
    encoder = await asyncio.to_thread(
        TokenEncoder,
        store.file(cfg.token_model, "model.onnx"),
        dim=cfg.token_dim,
        threads=cfg.intra_op_threads,
        parallel_runs=parallel_runs(cfg.token_parallel_runs, cfg.intra_op_threads),
    )
    models.append(encoder)
    token_tokenizer = Tokenizer(
        store.file(token_spec.tokenizer, "tokenizer.json"), token_spec.max_tokens
    )
    pair_tokenizer = pair_batcher = None
    pair_scripts: frozenset[str] = frozenset()
    if cfg.cross_encoder_model:
        cross, pair_tokenizer = await _cross_encoder(cfg, store)
        models.append(cross)
        pair_batcher = await _start_batcher(cfg, "rerank-pairs", cross.run)
        batchers.append(pair_batcher)
        pair_scripts = frozenset(store.spec(cfg.cross_encoder_model).extra.get("scripts", ()))
    # A text's token vectors (and the embedding ingest writes from the same run) are what
    # the embedding service gives it: runs hold what the model allows.
    token_batcher = await _start_batcher(
        cfg, "rerank-tokens", encoder.run, encoder.parallel_runs, spec=token_spec
    )
    batchers.append(token_batcher)
    prefixes = input_prefixes(token_spec.extra)
    reranker = Reranker(
        skip_query_tokens=skipped_query_tokens(token_tokenizer)
        if cfg.query_skip_stop_words
        else frozenset(),
        token_tokenizer=token_tokenizer,
        token_batcher=token_batcher,
        pair_tokenizer=pair_tokenizer,
        pair_batcher=pair_batcher,
        cache=TokenCache(cfg.token_cache_mb * 1024 * 1024),
        store=token_store,
        late_interaction_weight=cfg.late_interaction_weight,
        cross_encoder_weight=cfg.cross_encoder_weight,
        cross_encoder_candidates=cfg.cross_encoder_candidates,
        embedding_model_version=store.version(cfg.token_model),
        query_prefix=prefixes.get(QUERY, ""),
        passage_prefix=prefixes.get(PASSAGE, ""),
        token_scripts=frozenset(token_spec.extra.get("scripts", ())),
        pair_scripts=pair_scripts,
    )
    return Built(reranker, batchers, models)


def watch_reranker(metrics: ProcessMetrics, built: Built) -> None:
    """The cascade's batchers and its token cache, read at scrape time."""
    for batcher in built.batchers:
        metrics.batchers.watch(batcher)
    cache = built.reranker.cache
    metrics.reading(
        "ragline_rerank_token_cache_lookups_total",
        "Lookups of passages' token vectors in memory, by result (hit, miss).",
        "counter",
        ("result",),
    ).add(lambda: {("hit",): cache.hits, ("miss",): cache.misses})
    metrics.reading(
        "ragline_rerank_token_cache_bytes", "Bytes of token vectors held in memory."
    ).add(lambda: cache.bytes)


class RerankService(Service):
    config: RerankConfig

    def __init__(self, config: RerankConfig, common) -> None:
        super().__init__(config, common)
        self._servicer = RerankServicer()
        self._built: Built | None = None
        self._token_store: TokenStore | None = None

    def register(self, server: grpc.aio.Server) -> None:
        rerank_pb2_grpc.add_RerankServiceServicer_to_server(self._servicer, server)

    async def start(self) -> None:
        cfg = self.config
        store = ModelStore(cfg.model_dir or self.common.model_dir)
        if cfg.prepare_models:
            for name in filter(None, (cfg.token_model, cfg.cross_encoder_model)):
                await asyncio.to_thread(
                    store.prepare, name, log=lambda line: log.info("models.prepare", detail=line)
                )
        self._token_store = await self._open_token_store(store)
        self._built = await build_reranker(cfg, store, self._token_store)
        if self.metrics is not None:
            watch_reranker(self.metrics, self._built)
        self._servicer.reranker.set(self._built.reranker)
        log.info("rerank.ready", token_model=cfg.token_model, cross_encoder=cfg.cross_encoder_model)

    async def _open_token_store(self, models: ModelStore) -> TokenStore | None:
        cfg = self.config
        if not cfg.token_store_mb:
            return None
        directory = cfg.token_store_dir or (self.common.data_dir / "rerank")
        # The prefixes are part of what a run encodes: another prefix, another store.
        prefixes = input_prefixes(models.spec(cfg.token_model).extra)
        version = "|".join([models.version(cfg.token_model), *sorted(prefixes.values())])
        name = store_name(version, cfg.token_dim, PROJECTION_SEED)
        token_store = TokenStore(
            directory / name, cfg.token_store_mb << 20, cfg.token_store_retention_s
        )
        try:
            await token_store.open()
        except (OSError, sqlite3.Error) as error:  # a read-only disk: memory only
            log.warning("rerank.token_store_unavailable", path=str(directory), error=str(error))
            await asyncio.to_thread(token_store.close)
            return None
        log.info("rerank.token_store", path=str(token_store.path), mb=token_store.bytes >> 20)
        return token_store

    async def stop(self) -> None:
        if self._built is not None:
            await self._built.reranker.flush()
            await self._built.close()
        if self._token_store is not None:
            await asyncio.to_thread(self._token_store.close)


SPEC = ServiceSpec(
    name="rerank",
    grpc_service=rerank_pb2.DESCRIPTOR.services_by_name["RerankService"].full_name,
    config_factory=RerankConfig,
    service_factory=RerankService,
)
