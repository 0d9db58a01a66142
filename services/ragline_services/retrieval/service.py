"""Wiring of the retrieval service: write log, BM25 + vector indexes, embedding client,
background HNSW builder."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import grpc
import numpy as np
import structlog
from pydantic import Field

from ragline import deadlines
from ragline.clients import Replica, ServiceClient, connect, each_replica
from ragline.config import ConfigError, ServiceConfig
from ragline.cores import usable_cores
from ragline.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from ragline.identity import WRITE_SCOPE, Caller
from ragline.retry import DEFAULT_POLICY
from ragline.server import Periodic, Service, ServiceSpec
from ragline.v1 import (
    embedding_pb2,
    embedding_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    rerank_pb2,
    rerank_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)
from ragline.vocabulary import Fusion
from ragline_services.retrieval.bm25_params import Bm25Params
from ragline_services.retrieval.forget_notices import ForgetNotices, ForgetTarget
from ragline_services.retrieval.index import RetrievalIndex
from ragline_services.retrieval.index_types import Embedded, IndexSettings
from ragline_services.retrieval.metrics import RetrievalMetrics
from ragline_services.retrieval.query_encoder import LocalQueryEncoder
from ragline_services.retrieval.servicer import RetrievalServicer
from ragline_services.retrieval.vectors import EdgeVectorIndex, VectorIndex

log = structlog.get_logger("ragline.retrieval")

_EMBED_BATCH = 64
_BULK_EMBED_BATCH = 8


class RetrievalConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("retrieval")
    # Index files and the write log (default: RAGLINE_DATA_DIR/retrieval).
    index_dir: Path | None = None
    dim: int = Field(384, ge=1, le=4096)
    vector_backend: Literal["edge", "qdrant"] = "edge"
    qdrant_url: str = "127.0.0.1:6334"
    # Qdrant's API key (its service.api_key), sent on every call; empty: none.
    qdrant_api_key: str = ""
    # TLS to Qdrant: the CA of its certificate (unset: plaintext).
    qdrant_ca_file: Path | None = None
    qdrant_collection: str = "ragline"
    # Exact search over recent writes up to this many; rebuild HNSW after this many.
    exact_limit: int = Field(20_000, ge=1)
    rebuild_after: int = Field(2_000, ge=1)
    build_check_s: float = Field(2.0, gt=0)
    # The write log is rewritten with only what a replay needs once it is larger than
    # this (and twice what the last rewrite left); 0: never for size.
    wal_compact_mb: int = Field(256, ge=0)
    # ... and once a delete or an overwrite is this old: the replaced text leaves the log
    # and the indexes within it (0: only for size).
    forget_after_s: float = Field(3600.0, ge=0)
    # The HNSW builder's threads (0: every core) and Linux's idle class (SCHED_IDLE: a core
    # runs it only when nothing else wants it; qdrant's build thread can raise its own
    # niceness, not leave the class); it runs at niceness 19 either way (vectors.py): a
    # build is background work and must not take the cores the queries need.
    build_threads: int = Field(default_factory=lambda: max(1, usable_cores() // 2), ge=0)
    build_idle: bool = True
    # The embedded HNSW shard searched in a child process (qdrant-edge holds the GIL for
    # the whole search, which stopped the service's other threads meanwhile).
    vector_search_process: bool = True
    # HYBRID fusion when a search names none, and its weight of the vector list for each.
    default_fusion: Fusion = Fusion.SCORE
    # BM25 indexes (one per tenant) kept open, most recently used first.
    bm25_max_open_tenants: int = Field(256, ge=1)
    # Weight of a BM25 query word's translation into the other language (0: none).
    cross_lingual_weight: float = Field(0.5, ge=0, le=10)
    # BM25's term saturation and length normalisation. Tantivy's own (1.2, 0.75) score in
    # the index; others score its candidates again (bm25_params.py, ~12 ms per search) and
    # ranked no better here (docs/tuning.md).
    bm25_k1: float = Field(1.2, gt=0, le=10)
    bm25_b: float = Field(0.75, ge=0, le=1)
    # Worker threads for searches (one hop each), apart from writes and HNSW builds.
    query_threads: int = Field(2, ge=1)
    # HYBRID's vector half on a second thread while BM25 runs (false: one after the
    # other, for a service with a single core).
    parallel_hybrid: bool = True
    default_vector_weight: float = Field(0.2, gt=0, lt=1)
    default_score_weight: float = Field(0.4, gt=0, lt=1)
    default_candidates: int = Field(100, ge=1)
    default_hnsw_ef: int = Field(128, ge=1)
    # When the embedding service runs another model than the index's vectors came from:
    # re-embed every document with it in the background, searches answered by BM25 until
    # it ends (false: refuse writes that need embedding, FAILED_PRECONDITION).
    reembed_on_model_change: bool = True
    # Query text embedded in this process when the model store (RAGLINE_MODEL_DIR) holds
    # the exact model version the embedding service runs: the same vectors without the hop
    # to it (measured: see query_encoder.py). Off: every query goes to the service (a GPU
    # embedding service, or a node without the models).
    local_query_encoder: bool = True
    # Its model runs at once (one thread each); passages always go to the service.
    local_query_encoder_runs: int = Field(1, ge=1)
    # While queries are embedded here, the embedding service is asked its model this often,
    # so that a change of model is noticed (and the index re-embedded) as before.
    embedding_check_s: float = Field(10.0, gt=0)
    # After a delete or overwrite, the rerank and generation services (those whose
    # RAGLINE_<NAME>_ADDR is set) are told to drop what they keep of the old text; one that
    # cannot be reached is tried again for this long (0: never told; their own expiry then
    # removes it).
    forget_notice_retry_s: float = Field(600.0, ge=0)


class RetrievalService(Service):
    config: RetrievalConfig

    def __init__(self, config: RetrievalConfig, common) -> None:
        super().__init__(config, common)
        self.index: RetrievalIndex | None = None
        self.embedding_version = ""
        self._probe: asyncio.Future | None = None
        self._reanalysing: asyncio.Future | None = None
        self._embedder = connect("embedding", embedding_pb2_grpc.EmbeddingServiceStub, common)
        self.notices = ForgetNotices(
            forget_targets(common) if config.forget_notice_retry_s else [],
            retry_for_s=config.forget_notice_retry_s,
        )
        # The model of the index's vectors once it has made some, else the one serving.
        self._servicer = RetrievalServicer(
            lambda: (
                (self.index.models.current.model_version if self.index else "")
                or self.embedding_version
            )
        )
        self._builder = Periodic(config.build_check_s, self._maybe_build, "hnsw-builder")
        self._local = (
            LocalQueryEncoder(common.model_dir, parallel_runs=config.local_query_encoder_runs)
            if config.local_query_encoder
            else None
        )
        self._adopting: asyncio.Task | None = None
        self._model_check = Periodic(
            config.embedding_check_s, self._check_embedding_model, "embedding-model-check"
        )

    def register(self, server: grpc.aio.Server) -> None:
        retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(self._servicer, server)

    async def embed(self, texts: list[str], kind: str) -> Embedded:
        """`kind`: "query", "passage" (a caller's write waits on it), "bulk" (passages
        nobody waits on: a re-embed; the embedding service runs them after the others) or
        "probe" (a query that must ask the embedding service itself)."""
        if (
            kind == "query"
            and self._local is not None
            and self._local.serves(self.embedding_version)
        ):
            try:
                result = await self._local.embed(texts, dim=self.config.dim)
            except ResourceExhausted:
                pass  # its queue is full: the service has its own
            else:
                return Embedded(result.vectors, self._local.version)
        input_type = (
            embedding_pb2.INPUT_TYPE_QUERY
            if kind in ("query", "probe")
            else embedding_pb2.INPUT_TYPE_PASSAGE
        )
        priority = (
            embedding_pb2.PRIORITY_BULK if kind == "bulk" else embedding_pb2.PRIORITY_INTERACTIVE
        )
        rows: list[list[float]] = []
        versions: set[str] = set()
        # Bulk work goes in short calls, one at a time: a question waits for one of them at
        # most, and a re-embed leaves the other cores to the callers.
        step = _BULK_EMBED_BATCH if kind == "bulk" else _EMBED_BATCH
        for start in range(0, len(texts), step):
            request = embedding_pb2.EmbedRequest(
                texts=texts[start : start + step],
                input_type=input_type,
                dim=self.config.dim,
                priority=priority,
            )
            try:
                reply = await self._embedder.unary("Embed", request, retry=DEFAULT_POLICY)
            except grpc.aio.AioRpcError as error:
                # The embedding service's trouble is ours to report, never the caller's
                # bad input: search falls back to BM25, a write fails retryably.
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded(f"embedding service: {error.details()}") from error
                raise Unavailable(
                    f"embedding service: {error.code().name}: {error.details()}"
                ) from error
            self._heard_model(reply.model_version)
            versions.add(reply.model_version)
            rows.extend(list(e.values) for e in reply.embeddings)
        if len(versions) > 1:  # a model changed between two batches of one write
            raise Unavailable(
                f"the embedding service changed models during one call ({sorted(versions)})"
            )
        return Embedded(np.asarray(rows, dtype=np.float32), versions.pop() if versions else "")

    def _heard_model(self, version: str) -> None:
        """The embedding service answered with `version`: load it here for queries when
        this machine holds it (in the background; queries use the service meanwhile)."""
        self.embedding_version = version
        if (
            self._local is not None
            and not self._local.serves(version)
            and (self._adopting is None or self._adopting.done())
        ):
            # The service's own work, in a context of its own: not under the deadline or
            # identity of the call that happened to hear the model.
            self._adopting = asyncio.get_running_loop().create_task(
                self._local.adopt(version), context=contextvars.Context()
            )

    async def _check_embedding_model(self) -> None:
        # Only needed while queries skip the service: otherwise each one hears its model.
        if self._local is not None and self._local.serves(self.embedding_version):
            try:
                await self._opened.models.probe()
            except (Unavailable, DeadlineExceeded) as error:
                log.info("retrieval.embedding_check_failed", error=str(error))

    def _open_index(self) -> RetrievalIndex:
        """Opens the indexes and replays the write log (disk and network: in a thread)."""
        cfg = self.config
        directory = cfg.index_dir or (self.common.data_dir / "retrieval")
        if cfg.vector_backend == "qdrant":
            from ragline_services.retrieval.qdrant_server import QdrantServerIndex

            directory.mkdir(parents=True, exist_ok=True)
            vectors: VectorIndex = QdrantServerIndex(
                cfg.qdrant_url,
                cfg.qdrant_collection,
                cfg.dim,
                directory / "qdrant_state.json",
                api_key=cfg.qdrant_api_key,
                ca_file=cfg.qdrant_ca_file,
            )
        else:
            vectors = EdgeVectorIndex(
                directory / "vectors",
                cfg.dim,
                directory / "write.log",
                exact_limit=cfg.exact_limit,
                rebuild_after=cfg.rebuild_after,
                build_threads=cfg.build_threads,
                build_idle=cfg.build_idle,
                search_process=cfg.vector_search_process,
            )
        settings = IndexSettings(
            dim=cfg.dim,
            default_candidates=cfg.default_candidates,
            default_hnsw_ef=cfg.default_hnsw_ef,
            default_vector_weight=cfg.default_vector_weight,
            default_score_weight=cfg.default_score_weight,
            default_fusion=cfg.default_fusion,
            bm25_max_open_tenants=cfg.bm25_max_open_tenants,
            cross_lingual_weight=cfg.cross_lingual_weight,
            bm25=Bm25Params(cfg.bm25_k1, cfg.bm25_b),
            query_threads=cfg.query_threads,
            parallel_hybrid=cfg.parallel_hybrid,
            reembed_on_model_change=cfg.reembed_on_model_change,
            wal_compact_bytes=cfg.wal_compact_mb << 20,
            forget_after_s=cfg.forget_after_s,
        )
        index = RetrievalIndex(directory, vectors, settings, self.embed, self.notices.notify)
        index.bm25.warm()  # jieba's dictionary, before the first query pays for it
        replayed = index.replay()
        log.info("retrieval.replayed", records=replayed, index_version=index.applied_seq)
        return index

    @property
    def _opened(self) -> RetrievalIndex:
        """The index, for the work that runs only once start() opened it."""
        if self.index is None:
            raise RuntimeError("the retrieval index is not open yet")
        return self.index

    async def start(self) -> None:
        self.index = await asyncio.to_thread(self._open_index)
        if self.metrics is not None:
            metrics = self._servicer.metrics = RetrievalMetrics(self.metrics)
            metrics.watch(self.index)
            metrics.watch_notices(self.notices.counts)
        self._servicer.index.set(self.index)
        await self.index.models.resume()
        if not await self._adopt_query_encoder_before_serving():
            self._probe = asyncio.ensure_future(self._probe_embedding_model())
        self._builder.start()
        self._model_check.start()
        self.notices.start()
        self._reanalysing = asyncio.ensure_future(self.index.compaction.reanalyse())

    async def _adopt_query_encoder_before_serving(self, wait_s: float = 2.0) -> bool:
        """Loads the local query encoder before the service says SERVING when the embedding
        service answers at once (a restart beside a running stack). Loading parses the
        tokenizer with the GIL held (~0.65 s, several seconds on a busy machine): done while
        serving, it stalled every call in flight (writes timed out after a restart under
        load). Where the embedding service is not up yet, it is loaded in the background
        once it answers, as before. True when the embedding service answered: its model has
        then been probed, and the background probe is not needed."""
        if self._local is None:
            return False
        try:
            with deadlines.deadline_scope(wait_s):
                version = await self._opened.models.probe()
        except (Unavailable, DeadlineExceeded) as error:
            log.info("retrieval.query_encoder_later", reason=str(error))
            return False
        # Hearing the model started its adoption in the background; this waits for it (the
        # encoder adopts one model at a time) and loads it again only if that one failed.
        await self._local.adopt(version)
        return True

    async def _probe_embedding_model(self) -> None:
        """Asks the embedding service its model once it answers, so that a change of
        model is noticed (and the re-embed started) at start, not at the first write."""
        delay = 0.5
        while True:
            try:
                await self._opened.models.probe()
                return
            except (Unavailable, DeadlineExceeded) as error:
                log.info("retrieval.embedding_probe_retry", error=str(error), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def _maybe_build(self) -> None:
        # A failed build is logged by Periodic and leaves the current index serving.
        started = time.monotonic()
        if await self._opened.maybe_build() and self._servicer.metrics is not None:
            self._servicer.metrics.built(time.monotonic() - started)
        await self._opened.compaction.maybe_compact()

    async def stop(self) -> None:
        await self._builder.stop()
        await self.notices.stop()
        await self._model_check.stop()
        if self._probe is not None:
            self._probe.cancel()
        if self._reanalysing is not None:
            # A pass runs in a thread a cancel would not stop: the current one ends first.
            self._opened.compaction.stop_reanalysis()
            with contextlib.suppress(Exception):
                await self._reanalysing
        if self._adopting is not None:
            self._adopting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._adopting
        if self._local is not None:
            await self._local.close()
        if self.index is not None:
            await self.index.models.stop()
            await self.index.drain_writes()
            self.index.close()


FORGET_CALL_S = 10.0
# Who keeps copies of document text, and how each is told: (service, stub, method, request).
_FORGET_CALLS = (
    (
        "rerank",
        rerank_pb2_grpc.RerankServiceStub,
        "ForgetDocuments",
        lambda ids: rerank_pb2.ForgetDocumentsRequest(ids=ids),
    ),
    (
        "generation",
        generation_pb2_grpc.GenerationServiceStub,
        "ForgetSources",
        lambda ids: generation_pb2.ForgetSourcesRequest(sources=ids),
    ),
)


def forget_targets(common) -> list[ForgetTarget]:
    """The services keeping copies of document text that this deployment runs (an address
    set), each told as the tenant, with only the write scope."""
    targets = []
    for name, stub, method, request in _FORGET_CALLS:
        try:
            address = common.address_of(name)
        except ConfigError:
            continue
        targets.append(ForgetTarget(name, _forget_call(common, address, stub, method, request)))
    return targets


def _forget_call(common, address: str, stub, method: str, request) -> Callable:
    async def forget(tenant: str, ids: list[str]) -> None:
        # Every replica keeps copies of its own: each is told (a load-balanced call would
        # reach one), resolved anew each time (replicas come and go).
        caller = Caller(tenant, principal="retrieval", scopes=frozenset({WRITE_SCOPE}))

        async def tell(replica: Replica) -> None:
            client = ServiceClient(
                stub,
                replica.target,
                hop_margin_s=common.hop_margin_s,
                caller=caller,
                server_name=replica.server_name,
            )
            with deadlines.deadline_scope(FORGET_CALL_S):
                await client.unary(method, request(ids))

        replicas = await each_replica(address)
        told = await asyncio.gather(*(tell(r) for r in replicas), return_exceptions=True)
        # One that failed fails the notice, which is tried again for all (forgetting
        # twice is forgetting).
        failed = [(r, e) for r, e in zip(replicas, told, strict=True) if e is not None]
        if failed:
            replica, error = failed[0]
            raise RuntimeError(
                f"{len(failed)} of {len(replicas)} replicas did not take it "
                f"({replica.target}: {error})"
            ) from error

    return forget


SPEC = ServiceSpec(
    name="retrieval",
    grpc_service=retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"].full_name,
    config_factory=RetrievalConfig,
    service_factory=RetrievalService,
)
