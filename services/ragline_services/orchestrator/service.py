"""Wiring of the orchestrator service: config, clients of the other services, servicer."""

from __future__ import annotations

import asyncio

import grpc
import structlog
from pydantic import Field

from ragline import deadlines, identity
from ragline.auth import AuthConfig
from ragline.budget import Amounts
from ragline.cache import open_cache
from ragline.clients import ServiceClient, connect
from ragline.config import MiB, ServiceConfig
from ragline.server import Periodic, Service, ServiceSpec
from ragline.v1 import (
    budget_pb2_grpc,
    embedding_pb2_grpc,
    generation_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    rerank_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)
from ragline.vocabulary import Fusion
from ragline_services.orchestrator import answerability
from ragline_services.orchestrator.caches import CacheTtls, OrchestratorCaches, signing_key
from ragline_services.orchestrator.core import Orchestrator, OrchestratorSettings
from ragline_services.orchestrator.metrics import OrchestratorMetrics
from ragline_services.orchestrator.plan import Kind
from ragline_services.orchestrator.run_context import Clients
from ragline_services.orchestrator.servicer import OrchestratorServicer

log = structlog.get_logger("ragline.orchestrator")


class OrchestratorConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("orchestrator")
    # An Ask is its question (8 KiB) and at most a plan of 64 nodes: larger messages are
    # refused by the transport before they are read whole or parsed, so that calls in
    # flight times this stay far inside the pod's memory (docs/security.md).
    max_message_bytes: int = Field(1 * MiB, ge=1024)
    max_request_bytes: int = Field(512 * 1024, ge=1024)
    # Admission holds MAX_IN_FLIGHT + MAX_QUEUE asks; more calls than this only wait.
    max_concurrent_rpcs: int = Field(128, ge=0)
    # Admission: runs at once, then a queue (entries keep their deadline), then refusal.
    # The stages of one run already use every core: more at once only wait on each other
    # (docs/tuning.md).
    max_in_flight: int = Field(2, ge=1)
    max_queue: int = Field(16, ge=0)
    # One tenant's share of the queue (0: half of it); freed places go to the waiting
    # tenant with the fewest runs in flight.
    max_queue_per_tenant: int = Field(0, ge=0)
    # The longest deadline a run gets, whatever the caller asked (0: the caller's).
    max_deadline_s: float = Field(300.0, ge=0)
    # Calls in flight to each downstream service, whatever the plans do in parallel.
    embedding_concurrency: int = Field(16, ge=1)
    retrieval_concurrency: int = Field(16, ge=1)
    rerank_concurrency: int = Field(8, ge=1)
    generation_concurrency: int = Field(8, ge=1)
    # The default plan: candidates per search list, fusion, passages reranked, passages
    # whose sentences compete for the prompt, and the prompt's evidence budget in tokens
    # (about a second of prefill for the 0.5B model on 2 CPU cores).
    candidates: int = Field(50, ge=1, le=1000)
    fusion: Fusion = Fusion.SCORE
    vector_weight: float = Field(0.4, ge=0, le=1)
    rerank: bool = True
    # More candidates do not rerank better, and stage 1's cost grows with them
    # (docs/tuning.md).
    rerank_candidates: int = Field(30, ge=1, le=1000)
    late_interaction_k: int = Field(20, ge=1, le=1000)
    # The cross-encoder stage of rerank in the default plan: off, it ranked no better than
    # late interaction after hybrid search and costs ~45 ms a question (docs/tuning.md).
    rerank_cross_encoder: bool = False
    context_passages: int = Field(4, ge=1, le=50)
    evidence_tokens: int = Field(120, ge=16, le=32768)
    # Sentences (shortlisted by lexical evidence) embedded to compete for the prompt; 12
    # found the answer's sentence no more often than 6, at twice the cost (docs/tuning.md).
    embed_sentences: int = Field(6, ge=1, le=256)
    answer_tokens: int = Field(64, ge=1, le=8192)
    # The answerability gate (answerability.py): below this estimate the run ends
    # INCOMPLETE `no_relevant_evidence` before generation; 0 turns it off.
    answerable_threshold: float = Field(0.25, ge=0, le=1)
    # The answer verifier (verifier.py): a written answer whose estimate of being the one
    # the question asks for is below this is INCOMPLETE `unverified`; 0 turns it off. One
    # half: the estimate is calibrated, so an answer below it is more likely wrong than
    # right (docs/answer-states.md, "The model's own confidence").
    verify_threshold: float = Field(0.5, ge=0, le=1)
    # An answer the verifier passed below this estimate, with rivals of its kind in its
    # citation, is read a second time (second_read.py); 0 never reads twice.
    confirm_above: float = Field(0.85, ge=0, le=1)
    # A small-tier answer the verifier passed below this estimate (or cannot judge: across
    # languages) is cross-checked by the large tier, at any estimate of the gate: the same
    # answer stands, another one must clear the checks itself or the run is INCOMPLETE
    # `unverified`; 0 never cross-checks (docs/answer-states.md, "The large tier as a
    # cross-check").
    cross_check_below: float = Field(0.8, ge=0, le=1)
    # ... while at most this many other runs are in flight on the replica; beyond it, an
    # answer the cross-check would have read is INCOMPLETE `unverified` (its draft kept),
    # so that COMPLETE means the same under load as on an idle replica. 1 with the default
    # MAX_IN_FLIGHT of 2 is every load: at c=4 on SQuAD, right answers 35 -> 42 of 100 and
    # precision 0.67 -> 0.82-0.84, for 0.91x the answers a second (docs/answer-states.md).
    cross_check_beside: int = Field(1, ge=0)
    # Stage budgets (seconds) per step; generation gets whatever remains.
    embed_budget_s: float = Field(2.0, gt=0)
    search_budget_s: float = Field(2.0, gt=0)
    rerank_budget_s: float = Field(3.0, gt=0)
    evidence_budget_s: float = Field(2.0, gt=0)
    # Task budget of an Ask whose request leaves an amount unset.
    default_input_tokens: int = Field(32_000, ge=0)
    default_output_tokens: int = Field(4_096, ge=0)
    default_cost_micros: int = Field(1_000_000, ge=0)
    default_calls: int = Field(64, ge=0)
    # Price in micros per 1,000 tokens, input and output, per tier (0: not charged).
    small_input_price: int = Field(0, ge=0)
    small_output_price: int = Field(0, ge=0)
    large_input_price: int = Field(0, ge=0)
    large_output_price: int = Field(0, ge=0)
    # Escalate a small answer to the large tier on a checkable signal (routing.py), when
    # the request does not pin a tier and the generation service serves a large tier.
    escalation: bool = True
    # ... and only while at most this many other runs are in flight here: an escalation is
    # optional work, the large tier shares the cores with the small one on a laptop (c=4
    # on SQuAD: answers/s 0.85 small-only, 0.40 escalating every failed answer). Raise it
    # where the large tier has cores or a GPU of its own.
    escalate_beside: int = Field(0, ge=0)
    # The answer, retrieval and tool-result caches (orchestrator/caches.py): Redis shared
    # by the replicas when set (redis://host:port/db), else in-process.
    cache: bool = True
    cache_url: str = ""
    cache_max_mb: int = Field(256, ge=1)
    answer_cache_ttl_s: float = Field(3600.0, gt=0)
    retrieval_cache_ttl_s: float = Field(600.0, gt=0)
    # The freshness bound of tool results (query embeddings, reranks).
    tool_cache_ttl_s: float = Field(300.0, gt=0)
    # How often cached answers and retrievals are checked against the documents they cite
    # (a deleted document's text leaves the cache then, not at the TTL); 0: never.
    cache_sweep_s: float = Field(300.0, ge=0)


class OrchestratorService(Service):
    config: OrchestratorConfig

    def __init__(self, config: OrchestratorConfig, common) -> None:
        super().__init__(config, common)
        self._servicer = OrchestratorServicer(config)
        self._caches: OrchestratorCaches | None = None
        self._sweeper: Periodic | None = None

    def register(self, server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(self._servicer, server)

    async def start(self) -> None:
        if self.metrics is not None:
            self._servicer.metrics = OrchestratorMetrics(self.metrics)
        cfg, common = self.config, self.common
        # jieba's dictionary and the Chinese-English lexicon load with the GIL held for up
        # to ~2 s: before serving, not under the first Chinese question's deadline.
        await asyncio.to_thread(answerability.warm, common.cache_dir)
        clients = Clients(
            embedding=connect("embedding", embedding_pb2_grpc.EmbeddingServiceStub, common),
            retrieval=connect("retrieval", retrieval_pb2_grpc.RetrievalServiceStub, common),
            rerank=connect("rerank", rerank_pb2_grpc.RerankServiceStub, common),
            generation=connect("generation", generation_pb2_grpc.GenerationServiceStub, common),
            budget=connect("budget", budget_pb2_grpc.BudgetServiceStub, common),
            limits={
                "embedding": asyncio.Semaphore(cfg.embedding_concurrency),
                "retrieval": asyncio.Semaphore(cfg.retrieval_concurrency),
                "rerank": asyncio.Semaphore(cfg.rerank_concurrency),
                "generation": asyncio.Semaphore(cfg.generation_concurrency),
                "budget": asyncio.Semaphore(64),
            },
        )
        settings = OrchestratorSettings(
            max_in_flight=cfg.max_in_flight,
            max_queue=cfg.max_queue,
            max_queue_per_tenant=cfg.max_queue_per_tenant,
            max_deadline_s=cfg.max_deadline_s,
            stage_budgets={
                Kind.EMBED: cfg.embed_budget_s,
                Kind.BM25: cfg.search_budget_s,
                Kind.VECTOR_SEARCH: cfg.search_budget_s,
                Kind.RETRIEVE: cfg.search_budget_s,
                Kind.RERANK: cfg.rerank_budget_s,
                Kind.RERANK_QUERY: cfg.rerank_budget_s,
                Kind.SELECT_EVIDENCE: cfg.evidence_budget_s,
            },
            default_limits=Amounts(
                input_tokens=cfg.default_input_tokens,
                output_tokens=cfg.default_output_tokens,
                cost_micros=cfg.default_cost_micros,
                calls=cfg.default_calls,
            ),
            rerank=cfg.rerank,
        )
        caches = None
        if cfg.cache:
            caches = OrchestratorCaches(
                open_cache(cfg.cache_url, max_bytes=cfg.cache_max_mb << 20),
                CacheTtls(cfg.answer_cache_ttl_s, cfg.retrieval_cache_ttl_s, cfg.tool_cache_ttl_s),
                signing_key=signing_key(AuthConfig().service_key),
            )
        self._caches = caches
        orchestrator = Orchestrator(clients, settings, caches)
        if self._servicer.metrics is not None:
            self._servicer.metrics.watch(orchestrator)
        self._servicer.orchestrator.set(orchestrator)
        if caches is not None and cfg.cache_sweep_s:
            self._sweeper = Periodic(
                cfg.cache_sweep_s, lambda: self._sweep(caches, clients.retrieval), "cache-sweep"
            )
            self._sweeper.start()

    @staticmethod
    async def _sweep(caches: OrchestratorCaches, retrieval) -> None:
        async def versions(viewer, ids: list[str]) -> dict[str, int]:
            client = ServiceClient(
                retrieval_pb2_grpc.RetrievalServiceStub,
                retrieval.target,
                caller=identity.Caller(viewer.tenant, scopes=viewer.scopes),
            )
            found: dict[str, int] = {}
            for start in range(0, len(ids), 1024):
                request = retrieval_pb2.DocumentVersionsRequest(ids=ids[start : start + 1024])
                with deadlines.deadline_scope(10.0):
                    reply = await client.unary("DocumentVersions", request)
                found.update(reply.versions)
            return found

        dropped = await caches.sweep(versions)
        if dropped:
            log.info("orchestrator.cache_swept", dropped=dropped)

    async def stop(self) -> None:
        if self._sweeper is not None:
            await self._sweeper.stop()
        if self._caches is not None:
            await self._caches.close()


SPEC = ServiceSpec(
    name="orchestrator",
    grpc_service=orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name,
    config_factory=OrchestratorConfig,
    service_factory=OrchestratorService,
)
