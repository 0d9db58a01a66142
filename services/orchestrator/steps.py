"""What each kind of plan step does: calls to the embedding, retrieval, rerank and
generation services, with a budget reservation around every model call.

Each model call reserves before it starts and settles what it really used after it ends
(a failed or cancelled call too: cancelled goes to pending first, then is settled with
what was observed). Settlement runs concurrently with the steps that need the result, so
it stays off the critical path; the run waits for every settlement before it reports.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import grpc
import numpy as np
import structlog

from ragline import deadlines
from ragline.budget import Amounts, BudgetRefused, Reservation, TaskBudget
from ragline.clients import ServiceClient
from ragline.errors import FailedPrecondition, RaglineError
from ragline.ranking import score_fusion
from ragline.retry import DEFAULT_POLICY, call_with_retry
from ragline.v1 import (
    common_pb2,
    embedding_pb2,
    generation_pb2,
    rerank_pb2,
    retrieval_pb2,
)
from ragline_services.orchestrator import answerability
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.agent import (
    PLANNER_PROMPT,
    AgentPlan,
    MalformedPlan,
    clauses,
    parse_plan,
)
from ragline_services.orchestrator.caches import (
    RETRIEVAL,
    TOOL,
    CacheUse,
    OrchestratorCaches,
    Viewer,
    normalise,
    stale_documents,
)
from ragline_services.orchestrator.plan import Kind
from ragline_services.orchestrator.routing import Signal, escalation_signals
from ragline_services.orchestrator.runner import Step, code_name, describe

log = structlog.get_logger("ragline.orchestrator")

_MODES = {
    "bm25": retrieval_pb2.SEARCH_MODE_BM25,
    "vector": retrieval_pb2.SEARCH_MODE_VECTOR,
    "hybrid": retrieval_pb2.SEARCH_MODE_HYBRID,
    "prefilter": retrieval_pb2.SEARCH_MODE_PREFILTER,
}
_TIERS = {"small": common_pb2.MODEL_TIER_SMALL, "large": common_pb2.MODEL_TIER_LARGE}
_FINISH = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_DEADLINE: "deadline",
}


# A call refused with one of these did no work: it is charged as a call, not as the
# tokens it had reserved.
_REFUSED_BEFORE_WORK = frozenset(
    {
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


class NoEvidence(FailedPrecondition):
    """Nothing to answer from: the run ends INCOMPLETE instead of guessing."""


# -- what flows between steps ------------------------------------------------------------------


@dataclass(frozen=True)
class QueryVector:
    values: np.ndarray
    model_version: str


@dataclass(frozen=True)
class Ranked:
    passages: list[ev.Passage]
    source: str  # bm25 | vector | hybrid | fused | reranked
    index_version: int = 0
    query: str = ""  # the (sub-)query this ranking answers


@dataclass(frozen=True)
class Planned:
    """What the planning step decided: the agent plan, or None when the planner's replies
    were malformed twice (`problems` says how) and the run falls back to the RAG plan."""

    plan: AgentPlan | None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Answer:
    text: str
    evidence: ev.Evidence
    cited: ev.Cited
    finish_reason: str
    usage: Amounts
    cached_input_tokens: int
    model: str
    tier: int
    model_version: str = ""
    # Checks that failed on the small answer (the escalation signals), and whether the
    # large tier then answered; `outcome`: what became of an escalation that was wanted
    # and not made (`escalation_unavailable: ...`), else empty.
    signals: tuple[Signal, ...] = ()
    escalated: bool = False
    outcome: str = ""
    # Checks that failed on this (the final) answer: any makes it INCOMPLETE.
    problems: tuple[Signal, ...] = ()


@dataclass(frozen=True)
class Settings:
    """The knobs of one run (server defaults, narrowed by the request)."""

    question: str
    candidates: int = 50
    search_mode: str = "hybrid"
    attributes: tuple[tuple[str, str], ...] = ()
    fusion: str = "score"
    vector_weight: float = 0.4
    rerank_candidates: int = 30
    late_interaction_k: int = 20
    rerank_cross_encoder: bool = False
    context_passages: int = 4
    evidence_tokens: int = 120
    # Sentences embedded to compete for the prompt (the rest lose on lexical evidence).
    embed_sentences: int = 12
    answer_tokens: int = 64
    tier: str = "small"
    # The tier was not pinned by the request: a checkable signal may escalate to large.
    escalate: bool = False
    allow_degrade: bool = False
    # The answerability gate's threshold (answerability.py; 0: every question is answered).
    answerable_threshold: float = 0.25
    # Cost in micros per 1,000 tokens (input, output), per tier.
    prices: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class Clients:
    embedding: ServiceClient
    retrieval: ServiceClient
    rerank: ServiceClient
    generation: ServiceClient
    budget: ServiceClient
    # At most this many calls in flight to each service, whatever the plans do.
    limits: dict[str, asyncio.Semaphore]
    # Context window of each generation tier, learned on first use (CountTokens).
    context_windows: dict[str, int] = field(default_factory=dict)


class RunContext:
    """One run's clients, budget and settings, shared by its steps."""

    def __init__(
        self,
        clients: Clients,
        budget: TaskBudget,
        settings: Settings,
        run_id: str,
        on_delta: Callable[[str], None],
        *,
        caches: OrchestratorCaches | None = None,
        viewer: Viewer | None = None,
        read_cache: bool = True,
        write_cache: bool = True,
    ) -> None:
        self.clients = clients
        self.budget = budget
        self.settings = settings
        self.run_id = run_id
        # Reservation ids must be this run's own: the run id may be the caller's (sent in
        # x-ragline-run-id), and a second run reusing it would get the first's
        # reservations replayed, uncharged. Retries inside the run keep their ids. (The run
        # id is cut so that a 128-byte one still leaves room for the node's id.)
        self.reservation_prefix = f"{run_id[:24]}-{uuid.uuid4().hex[:12]}"
        self.on_delta = on_delta
        self.settlements: list[asyncio.Task] = []
        self.degraded: list[str] = []
        self.caches = caches if viewer is not None else None
        self.viewer = viewer or Viewer("")
        self.read_cache = read_cache and self.caches is not None
        self.write_cache = write_cache and self.caches is not None
        self.cache_use = CacheUse()

    async def cached(self, step: Step, layer: str, key: str) -> dict | None:
        """A cache entry for this step (None: miss, or reading is off)."""
        if not self.read_cache:
            return None
        assert self.caches is not None
        return await self.caches.get(layer, key)

    def served_from_cache(self, step: Step, layer: str, entry: dict) -> None:
        """The step's result came from `layer`: marked, counted, and what it saved noted."""
        assert self.caches is not None
        self.caches.hit(layer)
        step.record.cached = layer
        self.cache_use.saved.append(
            {
                "node_id": step.node.id,
                "kind": step.node.kind.value,
                "layer": layer,
                "time_s": float(entry.get("time_s", 0.0)),
                "input_tokens": int(entry.get("input_tokens", 0)),
                "output_tokens": int(entry.get("output_tokens", 0)),
            }
        )

    async def remember(self, step: Step, layer: str, key: str, entry: dict) -> None:
        if self.write_cache:
            assert self.caches is not None
            started = step.record.started or step.record.call_start
            if started is not None:
                entry["time_s"] = time.monotonic() - started
            await self.caches.put(layer, key, entry, viewer=self.viewer)

    # -- calls ------------------------------------------------------------------------------

    def _client(self, service: str) -> ServiceClient:
        return getattr(self.clients, service)

    async def call(self, step: Step, service: str, method: str, request):
        """A unary call under the per-service limit, with the kit's retry rule; the node
        records when it started and ended, its attempts and the server's own timing."""
        client = self._client(service)

        async def attempt():
            step.record.attempts += 1
            return await client.unary(method, request)

        async with self.clients.limits[service]:
            step.mark("call_start")
            reply = await call_with_retry(attempt, DEFAULT_POLICY, what=f"{service}.{method}")
            step.mark("call_end")
        if reply.HasField("timing"):
            step.record.server = reply.timing
        return reply

    async def reserve(self, step: Step, amounts: Amounts, *, part: str = "") -> Reservation:
        """A reservation for the step's next call (`part`: one of several calls the step
        makes side by side; each has its own reservation id)."""
        step.mark("reserve_start")
        attempt = step.record.attempts
        name = f"{step.node.id}-{part}" if part else step.node.id
        reservation = self.budget.reserve(
            amounts,
            stage=step.node.id,
            reservation_id=f"{self.reservation_prefix}-{name}-{attempt}",
        )
        await reservation.open()
        return reservation

    def settle_later(
        self, step: Step, reservation: Reservation, *, failed: bool = False, cancelled: bool = False
    ) -> None:
        async def settle() -> None:
            try:
                await reservation.close(failed=failed, cancelled=cancelled)
            except Exception as error:  # the ledger's own expiry releases it eventually
                log.warning("budget.settle_failed", node=step.node.id, error=str(error))
            step.mark("settled")

        self.settlements.append(asyncio.ensure_future(settle()))

    async def model_call(
        self,
        step: Step,
        service: str,
        method: str,
        request,
        amounts: Amounts,
        usage: Callable[[object], Amounts],
        *,
        counts_as_call: bool = True,
    ):
        """One model call inside a reservation. `counts_as_call=False`: work done ahead
        for another step's call (its tokens are charged, the call is that step's)."""
        reservation = await self.reserve(step, amounts)
        try:
            reply = await self.call(step, service, method, request)
        except BaseException as error:
            if isinstance(error, grpc.aio.AioRpcError) and error.code() in _REFUSED_BEFORE_WORK:
                reservation.settle(Amounts(calls=(step.record.attempts or 1) * counts_as_call))
            self.settle_later(
                step, reservation, failed=True, cancelled=isinstance(error, asyncio.CancelledError)
            )
            raise
        # Every attempt is a call charged, retries included.
        calls = max(step.record.attempts, 1) if counts_as_call else 0
        reservation.settle(replace(usage(reply), calls=calls))
        self.settle_later(step, reservation)
        return reply

    async def wait_settled(self) -> None:
        if self.settlements:
            await asyncio.shield(asyncio.gather(*self.settlements, return_exceptions=True))

    def cost(self, tier: str, input_tokens: int, output_tokens: int) -> int:
        price_in, price_out = self.settings.prices.get(tier, (0, 0))
        return (input_tokens * price_in + output_tokens * price_out) // 1000


# -- inputs ----------------------------------------------------------------------------------


def _rankings(inputs: list[object]) -> list[Ranked]:
    found: list[Ranked] = []
    for item in inputs:
        if isinstance(item, Ranked):
            found.append(item)
        elif isinstance(item, list):
            found += _rankings(item)
    return found


def _merged(inputs: list[object]) -> list[ev.Passage]:
    """One ranking of every passage the inputs carry: round robin by rank, no repeats."""
    lists = [r.passages for r in _rankings(inputs)]
    seen: set[str] = set()
    merged = []
    for rank in range(max((len(x) for x in lists), default=0)):
        for passages in lists:
            if rank < len(passages) and passages[rank].id not in seen:
                seen.add(passages[rank].id)
                merged.append(passages[rank])
    return merged


def _query(step: Step, settings: Settings) -> str:
    return str(step.node.params.get("query") or settings.question)


# -- the steps -------------------------------------------------------------------------------


async def embed(ctx: RunContext, step: Step) -> QueryVector:
    text = _query(step, ctx.settings)
    key = ctx.caches.key(TOOL, ctx.viewer, "embed", text) if ctx.caches else ""
    entry = await ctx.cached(step, TOOL, key) if key else None
    if entry is not None:
        ctx.served_from_cache(step, TOOL, entry)
        ctx.cache_use.tool_hits += 1
        return QueryVector(np.asarray(entry["values"], np.float32), entry["model_version"])
    ctx.cache_use.tool_misses += bool(ctx.read_cache)
    request = embedding_pb2.EmbedRequest(texts=[text], input_type=embedding_pb2.INPUT_TYPE_QUERY)
    reply = await ctx.model_call(
        step,
        "embedding",
        "Embed",
        request,
        Amounts(input_tokens=ev.tokens_estimate(text) + 2, calls=1),
        lambda r: Amounts(input_tokens=r.usage.input_tokens, calls=1),
    )
    vector = QueryVector(np.asarray(reply.embeddings[0].values, np.float32), reply.model_version)
    if key:
        await ctx.remember(
            step,
            TOOL,
            key,
            {
                "values": vector.values.tolist(),
                "model_version": vector.model_version,
                "input_tokens": reply.usage.input_tokens,
            },
        )
    return vector


def _ranked(reply, source: str) -> Ranked:
    passages = [
        ev.Passage(h.id, h.title, h.text, h.version, h.score, dict(h.scores)) for h in reply.hits
    ]
    return Ranked(passages, source, reply.index_version)


async def _search(ctx: RunContext, step: Step, mode: str, vector: QueryVector | None) -> Ranked:
    s = ctx.settings
    request = retrieval_pb2.SearchRequest(
        query=_query(step, s),
        k=int(step.node.params.get("k") or s.candidates),
        mode=_MODES[mode],
        attributes=dict(s.attributes),
        hnsw_ef=int(step.node.params.get("hnsw_ef", 0)),
        include_text=True,
    )
    key = ""
    if ctx.caches is not None:
        key = ctx.caches.key(
            RETRIEVAL,
            ctx.viewer,
            normalise(request.query),
            mode,
            request.k,
            sorted(s.attributes),
            request.hnsw_ef,
            vector.model_version if vector else "",
        )
        found = await _cached_search(ctx, step, key, mode)
        if found is not None:
            return found
    if vector is not None:
        request.query_vector.extend(vector.values.tolist())
    if step.node.params.get("charged"):
        # An agent's lookup: the retrieval service embeds its query (a model call).
        reply = await ctx.model_call(
            step,
            "retrieval",
            "Search",
            request,
            Amounts(input_tokens=ev.tokens_estimate(request.query) + 2, calls=1),
            lambda r: Amounts(input_tokens=ev.tokens_estimate(request.query) + 2, calls=1),
        )
    else:
        reply = await ctx.call(step, "retrieval", "Search", request)
    if reply.fell_back:
        ctx.degraded.append(reply.fallback_reason)
    ranked = replace(_ranked(reply, mode), query=request.query)
    if key and ranked.passages and not reply.fell_back:
        await ctx.remember(
            step,
            RETRIEVAL,
            key,
            {
                "passages": [
                    [p.id, p.title, p.text, p.version, p.score, p.scores] for p in ranked.passages
                ],
                "index_version": reply.index_version,
                "embedding_model_version": "" if mode == "bm25" else reply.embedding_model_version,
            },
        )
    return ranked


async def _cached_search(ctx: RunContext, step: Step, key: str, mode: str) -> Ranked | None:
    """A retrieval entry still true for this caller: the tenant's index has not changed
    since (no write or delete), the vector model neither, and every hit is still visible."""
    assert ctx.caches is not None
    entry = await ctx.cached(step, RETRIEVAL, key)
    if entry is None:
        ctx.cache_use.retrieval_misses += bool(ctx.read_cache)
        return None
    request = retrieval_pb2.DocumentVersionsRequest(ids=[p[0] for p in entry["passages"]])
    current = await ctx.call(step, "retrieval", "DocumentVersions", request)
    model = entry["embedding_model_version"]
    stale = stale_documents({p[0]: p[3] for p in entry["passages"]}, dict(current.versions))
    if (
        current.index_version != entry["index_version"]
        or (model and model != current.embedding_model_version)
        or stale
    ):
        await ctx.caches.drop(RETRIEVAL, key, "index or documents changed")
        ctx.cache_use.retrieval_misses += 1
        return None
    ctx.served_from_cache(step, RETRIEVAL, entry)
    ctx.cache_use.retrieval_hits += 1
    passages = [
        ev.Passage(i, t, x, v, sc, dict(parts)) for i, t, x, v, sc, parts in entry["passages"]
    ]
    return Ranked(passages, mode, current.index_version)


async def bm25(ctx: RunContext, step: Step) -> Ranked:
    return await _search(ctx, step, "bm25", None)


async def vector_search(ctx: RunContext, step: Step) -> Ranked:
    vector = step.upstream(Kind.EMBED)
    return await _search(ctx, step, "vector", vector if isinstance(vector, QueryVector) else None)


async def retrieve(ctx: RunContext, step: Step) -> Ranked:
    mode = str(step.node.params.get("mode") or ctx.settings.search_mode)
    vector = step.upstream(Kind.EMBED) if "query" not in step.node.params else None
    return await _search(ctx, step, mode, vector if isinstance(vector, QueryVector) else None)


async def fuse(ctx: RunContext, step: Step) -> Ranked:
    s = ctx.settings
    k = int(step.node.params.get("k") or s.candidates)
    lists = _rankings(step.inputs)
    by_source = {r.source: r for r in lists}
    if len(lists) == 2 and {"bm25", "vector"} <= set(by_source):
        passages = {p.id: p for r in lists for p in r.passages}
        weight = float(step.node.params.get("vector_weight", s.vector_weight))
        if str(step.node.params.get("fusion", s.fusion)) == "rrf":
            from ragline.ranking import rrf as fusion
        else:
            fusion = score_fusion
        fused = fusion(
            [_Scored(p.id, p.score) for p in by_source["bm25"].passages],
            [_Scored(p.id, p.score) for p in by_source["vector"].passages],
            weight,
            k,
        )
        out = [
            ev.Passage(
                key, passages[key].title, passages[key].text, passages[key].version, score, parts
            )
            for key, score, parts in fused
        ]
        return Ranked(out, "fused", max(r.index_version for r in lists))
    return Ranked(
        _merged(step.inputs)[:k], "fused", max((r.index_version for r in lists), default=0)
    )


@dataclass(frozen=True)
class _Scored:
    key: str
    score: float


async def rerank(ctx: RunContext, step: Step) -> Ranked:
    s = ctx.settings
    passages = _merged(step.inputs)[: s.rerank_candidates]
    if not passages:
        return Ranked([], "reranked")
    top_k = int(step.node.params.get("top_k") or s.context_passages)
    request = rerank_pb2.RerankRequest(
        query=s.question,
        candidates=[
            rerank_pb2.RerankCandidate(id=p.id, text=ev_text(p), first_stage_score=p.score)
            for p in passages
        ],
        top_k=top_k,
        late_interaction_k=int(step.node.params.get("late_interaction_k") or s.late_interaction_k),
        allow_skip=s.allow_degrade,
        late_interaction_only=not step.node.params.get("cross_encoder", s.rerank_cross_encoder),
    )
    # A tool result: the documents' versions are part of its parameters.
    key = ""
    if ctx.caches is not None:
        key = ctx.caches.key(
            TOOL,
            ctx.viewer,
            "rerank",
            s.question,
            [(p.id, p.version) for p in passages],
            request.top_k,
            request.late_interaction_k,
            request.late_interaction_only,
        )
    entry = await ctx.cached(step, TOOL, key) if key else None
    if entry is not None:
        ctx.served_from_cache(step, TOOL, entry)
        ctx.cache_use.tool_hits += 1
        results = entry["results"]
    else:
        ctx.cache_use.tool_misses += bool(ctx.read_cache)
        tokens = sum(ev.tokens_estimate(ev_text(p)) for p in passages)
        reply = await ctx.model_call(
            step,
            "rerank",
            "Rerank",
            request,
            Amounts(input_tokens=tokens, calls=1),
            lambda r: Amounts(input_tokens=r.usage.input_tokens, calls=1),
        )
        # A stage whose model does not read the question's language is left out on
        # purpose (the ranking is the better for it), not for want of time or a model.
        lacking = [s for s in reply.skipped if not s.reason.startswith("language:")]
        for skipped in lacking:
            stage = rerank_pb2.RerankStage.Name(skipped.stage).removeprefix("RERANK_STAGE_")
            ctx.degraded.append(f"{stage.lower()}_skipped")
        results = [[h.id, h.score, dict(h.scores)] for h in reply.results]
        if key and not lacking:  # a degraded ranking is not worth keeping
            entry = {"results": results, "input_tokens": reply.usage.input_tokens}
            await ctx.remember(step, TOOL, key, entry)
    by_id = {p.id: p for p in passages}
    out = [
        ev.Passage(
            i, by_id[i].title, by_id[i].text, by_id[i].version, score, {**by_id[i].scores, **parts}
        )
        for i, score, parts in results
        if i in by_id
    ]
    return Ranked(out, "reranked")


async def rerank_query(ctx: RunContext, step: Step) -> None:
    """Has rerank encode the question while retrieval runs (Prepare with the query), so
    that the rerank step only scores its candidates. Only ever a saving: when it cannot
    run (the service, the budget, the time), the rerank step encodes the question itself,
    and the answer is not degraded for it."""
    text = ctx.settings.question
    # The encoding is the rerank call's, done early: its tokens are charged, not a call.
    estimate = Amounts(input_tokens=ev.tokens_estimate(text) + 2)
    try:
        await ctx.model_call(
            step,
            "rerank",
            "Prepare",
            rerank_pb2.PrepareRequest(query=text),
            estimate,
            lambda r: Amounts(input_tokens=r.usage.input_tokens),
            counts_as_call=False,
        )
    except (grpc.aio.AioRpcError, RaglineError) as error:
        step.record.note = f"not prepared ({describe(error)}): the rerank step encodes it"
        log.info("orchestrator.rerank_query_not_prepared", error=describe(error))


def ev_text(passage: ev.Passage) -> str:
    return f"{passage.title}. {passage.text}" if passage.title else passage.text


@dataclass(frozen=True)
class _Embedded:
    """Rows embedded in one call, and the model ("name@version") that embedded them."""

    values: np.ndarray
    model: str


async def _embedded(ctx: RunContext, step: Step, texts: list[str]) -> _Embedded:
    """`texts` embedded in one call (a model call of the step's), one row each."""
    request = embedding_pb2.EmbedRequest(texts=texts, input_type=embedding_pb2.INPUT_TYPE_PASSAGE)
    reply = await ctx.model_call(
        step,
        "embedding",
        "Embed",
        request,
        Amounts(input_tokens=sum(ev.tokens_estimate(t) + 2 for t in texts), calls=1),
        lambda r: Amounts(input_tokens=r.usage.input_tokens, calls=1),
    )
    return _Embedded(
        np.asarray([e.values for e in reply.embeddings], np.float32), reply.model_version
    )


async def select_evidence(ctx: RunContext, step: Step) -> ev.Evidence:
    s = ctx.settings
    count = int(step.node.params.get("passages") or s.context_passages)
    budget = int(step.node.params.get("max_tokens") or s.evidence_tokens)
    passages = _merged(step.inputs)[:count]
    sentences = ev.shortlist(s.question, ev.candidate_sentences(passages), s.embed_sentences)
    if not sentences:
        return ev.Evidence((), 0, 0)
    similarity, model = await _sentence_similarity(ctx, step, sentences)
    found = answerability.signals(
        s.question, passages, similarity, model, [x.text for x in sentences]
    )
    # The gate: evidence that plainly cannot answer ends the run here, before any model
    # writes an answer (the generate step is skipped, no model budget is spent).
    answerability.gate(found, s.answerable_threshold)
    evidence = ev.select(s.question, passages, sentences, similarity, budget)
    return replace(evidence, signals=found)


# The embedding service did not answer: evidence is then chosen by its words alone.
_NO_EMBEDDING = frozenset(
    {"UNAVAILABLE", "UNIMPLEMENTED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
)


async def _embedded_or_none(ctx: RunContext, step: Step, texts: list[str]) -> _Embedded | None:
    """`_embedded`, or None when the embedding service cannot answer (the run goes on
    without: degraded, `evidence_embedding_unavailable`)."""
    try:
        return await _embedded(ctx, step, texts)
    except (grpc.aio.AioRpcError, RaglineError) as error:
        if code_name(error) not in _NO_EMBEDDING:
            raise
        ctx.degraded.append("evidence_embedding_unavailable")
        step.record.note = f"sentences chosen by their words alone ({describe(error)})"
        return None


async def _sentence_similarity(
    ctx: RunContext, step: Step, sentences: list[ev.Sentence]
) -> tuple[np.ndarray | None, str]:
    """Each sentence's cosine to the question (the embed step's vector, else embedded here
    beside the sentences), and the model that embedded them; None when the embedding
    service cannot answer: the answer then stands on lexical evidence, degraded
    (`evidence_embedding_unavailable`)."""
    texts = [sentence.text for sentence in sentences]
    question = step.upstream(Kind.EMBED)
    if not isinstance(question, QueryVector):
        texts = [ctx.settings.question, *texts]
    embedded = await _embedded_or_none(ctx, step, texts)
    if embedded is None:
        return None, ""
    vectors = embedded.values
    if isinstance(question, QueryVector):
        return vectors @ question.values, embedded.model
    return vectors[1:] @ vectors[0], embedded.model


def _evidence_of(ctx: RunContext, inputs: list[object]) -> ev.Evidence:
    """The evidence a generate step answers from: selected sentences when a selection step
    ran; the passages earlier answers cited (a synthesis answers from its parts' sources);
    else the best passages, cut to the budget by lexical evidence alone."""
    items: list[ev.EvidenceItem] = []
    tokens = 0
    for item in inputs:
        if isinstance(item, ev.Evidence):
            found = list(item.items)
        elif isinstance(item, Answer):
            found = list(item.cited.citations or item.evidence.items)
        else:
            continue
        for entry in found:
            if all(entry.passage.id != known.passage.id for known in items):
                items.append(entry)
                tokens += ev.tokens_estimate(entry.text)
    if not items:
        passages = _merged(inputs)[: ctx.settings.context_passages]
        sentences = ev.candidate_sentences(passages)
        return ev.select(
            ctx.settings.question, passages, sentences, None, ctx.settings.evidence_tokens
        )
    # Number the markers anew over the merged evidence.
    return ev.renumbered(ev.Evidence(tuple(items), tokens, 0))


async def _generate_reserved(
    ctx: RunContext,
    step: Step,
    request,
    tier: str,
    prompt_tokens: int,
    *,
    emit: Callable[[str], None] | None,
    part: str = "",
) -> tuple[object, Amounts]:
    """One generation inside a reservation: the final message and what it used. `emit`
    gets the text as it streams; `part` tells apart generations one step runs side by side
    (their reservations and attempts)."""
    max_tokens = request.max_tokens
    reservation = await ctx.reserve(
        step,
        Amounts(
            input_tokens=prompt_tokens,
            output_tokens=max_tokens,
            cost_micros=ctx.cost(tier, prompt_tokens, max_tokens),
            calls=1,
        ),
        part=part,
    )
    pieces: list[str] = []
    attempts = [0]
    try:
        final = await _stream_generation(ctx, step, request, pieces, emit, attempts)
    except BaseException as error:
        # Whatever streamed was produced: charge it (the prompt was read in full).
        seen = Amounts(input_tokens=prompt_tokens, output_tokens=len(pieces), calls=1)
        reservation.settle(seen)
        ctx.settle_later(
            step, reservation, failed=True, cancelled=isinstance(error, asyncio.CancelledError)
        )
        raise
    used = Amounts(
        input_tokens=final.usage.input_tokens,
        output_tokens=final.usage.output_tokens,
        cost_micros=ctx.cost(tier, final.usage.input_tokens, final.usage.output_tokens),
        calls=max(attempts[0], 1),
    )
    reservation.settle(used)
    ctx.settle_later(step, reservation)
    if not final.text:
        final.text = "".join(pieces)
    return final, used


def _chat(*turns: tuple[int, str]) -> generation_pb2.Chat:
    return generation_pb2.Chat(
        messages=[generation_pb2.ChatMessage(role=role, content=text) for role, text in turns]
    )


async def generate(ctx: RunContext, step: Step) -> Answer:
    """The answer: over lookups (the agent plan's synthesis) one part per lookup; else one
    answer from selected evidence, earlier answers' sources, or the best passages."""
    if step.node.kind == Kind.SYNTHESIZE and not any(
        isinstance(item, Answer | ev.Evidence) for item in step.inputs
    ):
        return await _synthesize(ctx, step)
    evidence = _evidence_of(ctx, step.inputs)
    if not evidence.items:
        raise NoEvidence("retrieval found no passage visible to this caller for the question")
    emit = ctx.on_delta if step.is_answer else None
    return await _answer(ctx, step, ctx.settings.question, evidence, emit)


async def _answer(
    ctx: RunContext,
    step: Step,
    question: str,
    evidence: ev.Evidence,
    emit: Callable[[str], None] | None,
    *,
    part: str = "",
) -> Answer:
    """One answer to `question` (or the part of the run's question it names, `part` being
    one of several generations the step runs side by side) from `evidence`, checked;
    escalated to the large tier when a check fails and the run may (the large tier's text
    is not streamed: the result carries it)."""
    s = ctx.settings
    tier = str(step.node.params.get("tier") or s.tier)
    user = ev.user_message(s.question, evidence, part=question)
    prompt_tokens = ev.tokens_estimate(ev.SYSTEM_PROMPT + user) + 16  # + chat template
    # The answer must fit the model's context beside the prompt (the estimate may be short
    # of the real count: a quarter more is kept free).
    room = await _context_window(ctx, tier) - int(prompt_tokens * 1.25) - 16
    max_tokens = max(1, min(int(step.node.params.get("max_tokens") or s.answer_tokens), room))
    request = generation_pb2.GenerateRequest(
        chat=_chat(
            (generation_pb2.ROLE_SYSTEM, ev.SYSTEM_PROMPT), (generation_pb2.ROLE_USER, user)
        ),
        max_tokens=max_tokens,
        tier=_TIERS[tier],
        sampling=generation_pb2.Sampling(stop=["\n"]),
        # Saved KV states of this prompt name its documents, so forgetting one reaches them.
        sources=sorted({item.passage.id for item in evidence.items}),
    )
    final, used = await _generate_reserved(
        ctx, step, request, tier, prompt_tokens, emit=emit, part=part
    )
    answer = _checked(_answer_of(final, evidence, used), question)
    signals = answer.problems
    if not signals or tier != "small" or not s.escalate or "tier" in step.node.params:
        return replace(answer, signals=signals)
    if not await _tier_served(ctx, "large"):
        return replace(answer, signals=signals, outcome="escalation_unavailable: no large tier")
    # Escalation: the large tier, in a reservation of its own; the small answer stands
    # (with its signals) when that does not fit the budget or the tier is not served.
    request.tier = _TIERS["large"]
    try:
        final, more = await _generate_reserved(
            ctx, step, request, "large", prompt_tokens, emit=None, part=part
        )
    except BudgetRefused:
        outcome = "escalation_unaffordable"
    except grpc.aio.AioRpcError as error:
        outcome = f"escalation_failed: {error.code().name}"
    else:
        large = _checked(_answer_of(final, evidence, used + more), question)
        return replace(large, signals=signals, escalated=True)
    return replace(answer, signals=signals, outcome=outcome)


def _checked(answer: Answer, question: str) -> Answer:
    """The answer with the checks that failed on it (a question that joins several, asked
    of one answer, needs every part answered)."""
    found = escalation_signals(
        answer.text,
        answer.evidence,
        answer.cited,
        answer.finish_reason,
        question=question,
        parts=len(clauses(question)),
    )
    return replace(answer, problems=tuple(found))


def _answer_of(final, evidence: ev.Evidence, used: Amounts) -> Answer:
    text = final.text
    return Answer(
        text=text.strip(),
        evidence=evidence,
        cited=ev.cite(text, evidence),
        finish_reason=_FINISH.get(final.finish_reason, "stop"),
        usage=used,
        cached_input_tokens=final.usage.cached_input_tokens,
        model=final.model,
        tier=final.tier,
        model_version=final.model_version,
    )


async def plan_question(ctx: RunContext, step: Step) -> Planned:
    """The planning call: the small model writes the lookups as JSON; a malformed reply is
    asked for once more with what was wrong; twice malformed is a fallback, not an error."""
    s = ctx.settings
    turns = [(generation_pb2.ROLE_SYSTEM, PLANNER_PROMPT), (generation_pb2.ROLE_USER, s.question)]
    problems: list[str] = []
    for _ in range(2):
        prompt_tokens = ev.tokens_estimate("".join(t for _, t in turns)) + 16 * len(turns)
        request = generation_pb2.GenerateRequest(
            chat=_chat(*turns), max_tokens=160, tier=_TIERS["small"]
        )
        final, _ = await _generate_reserved(ctx, step, request, "small", prompt_tokens, emit=None)
        try:
            return Planned(parse_plan(final.text), tuple(problems))
        except MalformedPlan as error:
            problems.append(str(error))
            turns += [
                (generation_pb2.ROLE_ASSISTANT, final.text[:2000]),
                (
                    generation_pb2.ROLE_USER,
                    f"That reply is not a valid plan ({error}). Reply with the JSON only.",
                ),
            ]
    return Planned(None, tuple(problems))


@dataclass(frozen=True)
class _Part:
    """One lookup of a synthesis, and the evidence chosen for it."""

    query: str
    required: bool
    passages: list[ev.Passage]
    sentences: list[ev.Sentence]
    similarity: np.ndarray | None = None
    embedding_model: str = ""


async def _synthesize(ctx: RunContext, step: Step) -> Answer:
    """The agent plan's answer: one part per lookup, each answered from its own evidence by
    its own generation (side by side) and checked against its own citations, joined as
    "A [1]; B [3]". A part whose evidence cannot answer it (nothing found, or below the
    answerability gate) ends the run INCOMPLETE naming it, before anything is generated;
    where the request allows degrading, or the lookup was optional, that part is left out
    and the answer is PARTIAL."""
    s = ctx.settings
    parts: list[_Part] = []
    for dep in step.node.depends_on:
        node = step.plan_node(dep)
        if node.kind != Kind.RETRIEVE:
            continue
        output = step.output_of(dep)
        query = str(node.params.get("query") or s.question)
        passages = output.passages[: s.context_passages] if isinstance(output, Ranked) else []
        sentences = ev.shortlist(query, ev.candidate_sentences(passages), s.embed_sentences)
        parts.append(_Part(query, not node.optional, passages, sentences))
    parts = await _part_similarities(ctx, step, parts)
    kept: list[_Part] = []
    for part in parts:
        try:
            if not part.sentences:
                raise NoEvidence(f"no visible passage answers the part {part.query!r}")
            found = answerability.signals(
                part.query,
                part.passages,
                part.similarity,
                part.embedding_model,
                [x.text for x in part.sentences],
            )
            answerability.gate(found, s.answerable_threshold, part=part.query)
        except (NoEvidence, answerability.NotAnswerable):
            if part.required and not s.allow_degrade:
                raise
            ctx.degraded.append(f"part_without_evidence: {part.query}")
            continue
        kept.append(part)
    if not kept:
        raise NoEvidence("no lookup found evidence for any part of the question")
    evidences, offset = [], 0
    for part in kept:
        chosen = ev.select(
            part.query, part.passages, part.sentences, part.similarity, s.evidence_tokens
        )
        evidences.append(ev.renumbered(chosen, start=offset + 1))
        offset += len(chosen.items)
    emitter = _InOrder(ctx.on_delta if step.is_answer else None, len(kept), "; ")

    async def answer(index: int, part: _Part, found: ev.Evidence) -> Answer:
        try:
            return await _answer(
                ctx, step, part.query, found, emitter.part(index), part=f"p{index + 1}"
            )
        finally:
            emitter.finished(index)

    async with asyncio.TaskGroup() as group:
        tasks = [
            group.create_task(answer(i, part, found))
            for i, (part, found) in enumerate(zip(kept, evidences, strict=True))
        ]
    return _joined([task.result() for task in tasks])


async def _part_similarities(ctx: RunContext, step: Step, parts: list[_Part]) -> list[_Part]:
    """Every part's query and shortlisted sentences embedded in one call: the cosines the
    gate and the evidence selection read."""
    texts = [
        t
        for part in parts
        if part.sentences
        for t in (part.query, *(x.text for x in part.sentences))
    ]
    if not texts:
        return parts
    embedded = await _embedded_or_none(ctx, step, texts)
    if embedded is None:
        return parts  # each part's evidence is then chosen by its words alone
    vectors = embedded.values
    out, row = [], 0
    for part in parts:
        if not part.sentences:
            out.append(part)
            continue
        query, sentences = vectors[row], vectors[row + 1 : row + 1 + len(part.sentences)]
        row += 1 + len(part.sentences)
        out.append(replace(part, similarity=sentences @ query, embedding_model=embedded.model))
    return out


def _joined(answers: list[Answer]) -> Answer:
    """The parts' answers as one: texts joined in order, evidence and citations merged,
    usage summed, each part's signals named by its number."""

    def named(attribute: str) -> tuple[Signal, ...]:
        if len(answers) == 1:
            return getattr(answers[0], attribute)
        return tuple(
            Signal(x.name, f"part {number}: {x.detail}", x.reason)
            for number, answer in enumerate(answers, start=1)
            for x in getattr(answer, attribute)
        )

    first = answers[0]
    finish = next(
        (f for f in ("deadline", "length") if any(a.finish_reason == f for a in answers)), "stop"
    )
    usage = Amounts()
    for answer in answers:
        usage = usage + answer.usage
    return Answer(
        text="; ".join(a.text for a in answers),
        evidence=ev.Evidence(
            tuple(i for a in answers for i in a.evidence.items),
            sum(a.evidence.tokens for a in answers),
            sum(a.evidence.sentences_considered for a in answers),
        ),
        cited=ev.Cited(
            [c for a in answers for c in a.cited.citations],
            [d for a in answers for d in a.cited.dropped],
        ),
        finish_reason=finish,
        usage=usage,
        cached_input_tokens=sum(a.cached_input_tokens for a in answers),
        model=first.model,
        tier=max(a.tier for a in answers),
        model_version=first.model_version,
        signals=named("signals"),
        escalated=any(a.escalated for a in answers),
        outcome="; ".join(dict.fromkeys(a.outcome for a in answers if a.outcome)),
        problems=named("problems"),
    )


class _InOrder:
    """Streams several parts' text in part order: the first part as it comes, each later
    one held until the parts before it are done, joined by `separator`."""

    def __init__(self, emit: Callable[[str], None] | None, count: int, separator: str) -> None:
        self._emit = emit
        self._held: list[list[str]] = [[] for _ in range(count)]
        self._done = [False] * count
        self._head = 0
        self._separator = separator

    def part(self, index: int) -> Callable[[str], None] | None:
        if self._emit is None:
            return None

        def emit(text: str) -> None:
            self._held[index].append(text)
            self._flush()

        return emit

    def finished(self, index: int) -> None:
        self._done[index] = True
        if self._emit is not None:
            self._flush()

    def _flush(self) -> None:
        assert self._emit is not None
        while self._head < len(self._held):
            pieces = self._held[self._head]
            for text in pieces:
                self._emit(text)
            pieces.clear()
            if not self._done[self._head]:
                return
            self._head += 1
            if self._head < len(self._held):
                self._emit(self._separator)


async def _tier_served(ctx: RunContext, tier: str) -> bool:
    """Whether the generation service serves `tier` (asked once, then remembered)."""
    if tier not in ctx.clients.context_windows:
        try:
            await _context_window(ctx, tier)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                return False  # unknown now: ask again next time
            ctx.clients.context_windows[tier] = 0
    return ctx.clients.context_windows[tier] > 0


async def _context_window(ctx: RunContext, tier: str) -> int:
    known = ctx.clients.context_windows.get(tier)
    if known is None:
        request = generation_pb2.CountTokensRequest(prompt="x", tier=_TIERS[tier])
        reply = await ctx.clients.generation.unary("CountTokens", request, retry=DEFAULT_POLICY)
        known = ctx.clients.context_windows[tier] = reply.context_window
    return known


class _StreamStarted(RaglineError):
    """A stream failed after text went out: never retried (the caller saw the text)."""

    code = grpc.StatusCode.UNAVAILABLE


async def _stream_generation(
    ctx: RunContext,
    step: Step,
    request,
    pieces: list[str],
    emit: Callable[[str], None] | None,
    attempts: list[int],
):
    """The generation's final message; its text streams into `pieces` (and `emit`);
    `attempts[0]` counts this generation's attempts (the step's record counts them all)."""
    client = ctx.clients.generation

    async def attempt():
        step.record.attempts += 1
        attempts[0] += 1
        final = None
        try:
            async for message in client.stream("Generate", request):
                if message.text:
                    step.mark("first_byte")
                    pieces.append(message.text)
                    if emit is not None:
                        emit(message.text)
                if message.HasField("final"):
                    final = message.final
        except grpc.aio.AioRpcError as error:
            if pieces:
                raise _StreamStarted(f"generation stream broke: {error.details()}") from error
            raise
        return final

    async with ctx.clients.limits["generation"]:
        step.mark("call_start")
        final = await call_with_retry(attempt, DEFAULT_POLICY, what="generation.Generate")
        step.mark("call_end")
    if final is None:
        raise _StreamStarted("the generation stream ended without its final message")
    step.record.server = final.timing
    return final


EXECUTORS = {
    Kind.EMBED: embed,
    Kind.BM25: bm25,
    Kind.VECTOR_SEARCH: vector_search,
    Kind.RETRIEVE: retrieve,
    Kind.FUSE: fuse,
    Kind.RERANK: rerank,
    Kind.RERANK_QUERY: rerank_query,
    Kind.SELECT_EVIDENCE: select_evidence,
    Kind.GENERATE: generate,
    Kind.SYNTHESIZE: generate,
    Kind.PLAN: plan_question,
}


def executors_for(ctx: RunContext) -> dict:
    def bind(function):
        async def run(step: Step):
            started = time.monotonic()
            try:
                return await function(ctx, step)
            finally:
                log.debug(
                    "step",
                    node=step.node.id,
                    ms=round((time.monotonic() - started) * 1000, 1),
                    remaining_ms=round((deadlines.remaining() or 0) * 1000),
                )

        return run

    return {kind: bind(function) for kind, function in EXECUTORS.items()}
