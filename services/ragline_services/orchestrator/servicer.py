"""OrchestratorService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from ragline import tracing
from ragline.budget import AMOUNT_FIELDS, Amounts
from ragline.errors import ResourceExhausted
from ragline.identity import current_caller, current_run_id
from ragline.server import Deferred
from ragline.timing import current_clock, duration
from ragline.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from ragline.vocabulary import (
    ModelTier,
    SearchMode,
    cache_policy_from_proto,
    search_mode_from_proto,
    tier_from_proto,
)
from ragline_services.orchestrator import followup
from ragline_services.orchestrator import plan as plans
from ragline_services.orchestrator.agent import clause_lookups
from ragline_services.orchestrator.caches import Viewer
from ragline_services.orchestrator.core import (
    AnswerState,
    AskInput,
    AskOutcome,
    Delta,
    NodeChanged,
    Orchestrator,
)
from ragline_services.orchestrator.metrics import OrchestratorMetrics
from ragline_services.orchestrator.params import RetrieveParams
from ragline_services.orchestrator.run_context import Settings
from ragline_services.orchestrator.runner import NodeRecord, NodeState

_KINDS = {
    orchestrator_pb2.NODE_KIND_EMBED: plans.Kind.EMBED,
    orchestrator_pb2.NODE_KIND_BM25: plans.Kind.BM25,
    orchestrator_pb2.NODE_KIND_VECTOR_SEARCH: plans.Kind.VECTOR_SEARCH,
    orchestrator_pb2.NODE_KIND_RERANK: plans.Kind.RERANK,
    orchestrator_pb2.NODE_KIND_GENERATE: plans.Kind.GENERATE,
    orchestrator_pb2.NODE_KIND_PLAN: plans.Kind.PLAN,
    orchestrator_pb2.NODE_KIND_RETRIEVE: plans.Kind.RETRIEVE,
    orchestrator_pb2.NODE_KIND_SYNTHESIZE: plans.Kind.SYNTHESIZE,
    orchestrator_pb2.NODE_KIND_FUSE: plans.Kind.FUSE,
    orchestrator_pb2.NODE_KIND_SELECT_EVIDENCE: plans.Kind.SELECT_EVIDENCE,
    orchestrator_pb2.NODE_KIND_RERANK_QUERY: plans.Kind.RERANK_QUERY,
}
_KIND_ENUM = {kind: number for number, kind in _KINDS.items()}
_NODE_STATES = {
    NodeState.RUNNING: orchestrator_pb2.NODE_STATE_RUNNING,
    NodeState.SUCCEEDED: orchestrator_pb2.NODE_STATE_SUCCEEDED,
    NodeState.FAILED: orchestrator_pb2.NODE_STATE_FAILED,
    NodeState.SKIPPED: orchestrator_pb2.NODE_STATE_SKIPPED,
    NodeState.CANCELLED: orchestrator_pb2.NODE_STATE_CANCELLED,
}
_ANSWER_STATES = {
    AnswerState.COMPLETE: common_pb2.ANSWER_STATE_COMPLETE,
    AnswerState.PARTIAL: common_pb2.ANSWER_STATE_PARTIAL,
    AnswerState.INCOMPLETE: common_pb2.ANSWER_STATE_INCOMPLETE,
}


_ROLES = {
    orchestrator_pb2.CONVERSATION_ROLE_USER: "user",
    orchestrator_pb2.CONVERSATION_ROLE_ASSISTANT: "assistant",
}


def question_of(request: orchestrator_pb2.AskRequest) -> followup.Resolved:
    """The question as the run reads it: a follow-up with the subject it refers back to."""
    turns = [followup.Turn(_ROLES.get(t.role, ""), t.text) for t in request.conversation]
    return followup.resolve(request.question, turns)


def settings_of(
    request: orchestrator_pb2.AskRequest, config, question: str | None = None
) -> Settings:
    """The server defaults, narrowed by what the request sets (0 / unset: the default);
    `question`: the question as resolved (default: the request's, as it is)."""
    options = request.retrieval
    return Settings(
        question=request.question if question is None else question,
        candidates=options.k or config.candidates,
        search_mode=search_mode_from_proto(options.mode),
        attributes=tuple(sorted(options.attributes.items())),
        fusion=config.fusion,
        vector_weight=config.vector_weight,
        rerank_candidates=config.rerank_candidates,
        late_interaction_k=config.late_interaction_k,
        rerank_cross_encoder=config.rerank_cross_encoder,
        context_passages=options.context_passages or config.context_passages,
        evidence_tokens=request.max_evidence_tokens or config.evidence_tokens,
        embed_sentences=config.embed_sentences,
        answer_tokens=request.max_tokens or config.answer_tokens,
        tier=tier_from_proto(request.tier),
        escalate=config.escalation and request.tier == common_pb2.MODEL_TIER_UNSPECIFIED,
        escalate_beside=config.escalate_beside,
        allow_degrade=request.allow_degrade,
        answerable_threshold=config.answerable_threshold,
        verify_threshold=config.verify_threshold,
        confirm_above=config.confirm_above,
        cross_check_below=config.cross_check_below,
        cross_check_beside=config.cross_check_beside,
        prices={
            ModelTier.SMALL: (config.small_input_price, config.small_output_price),
            ModelTier.LARGE: (config.large_input_price, config.large_output_price),
        },
    )


def route_of(request: orchestrator_pb2.AskRequest, question: str) -> dict:
    """The agent plan or not: the caller's choice, else the router's rule on `question` (as
    resolved). A question the rule splits is looked up clause by clause, without a
    planning call."""
    if request.HasField("plan"):
        return {"agent": False, "route_reason": "the request sent its own plan"}
    if request.plan_choice == orchestrator_pb2.PLAN_CHOICE_AGENT:
        return {"agent": True, "route_reason": "the request chose the agent plan"}
    if request.plan_choice == orchestrator_pb2.PLAN_CHOICE_RAG:
        return {"agent": False, "route_reason": "the request chose the RAG plan"}
    lookups = clause_lookups(question)
    if lookups:
        return {
            "agent": True,
            "route_reason": "router: the question joins several questions",
            "clauses": lookups,
        }
    return {"agent": False, "route_reason": "router: one lookup"}


def limits_of(request: orchestrator_pb2.AskRequest, defaults: Amounts) -> Amounts:
    return Amounts(*(getattr(request.budget, f) or getattr(defaults, f) for f in AMOUNT_FIELDS))


def plan_of(request: orchestrator_pb2.AskRequest) -> plans.Plan | None:
    if not request.HasField("plan"):
        return None
    return plans.build_plan(
        [
            plans.NodeSpec(
                id=n.id,
                kind=_KINDS[n.kind].value if n.kind in _KINDS else f"#{n.kind}",
                depends_on=tuple(n.depends_on),
                params=dict(n.params),
                budget_s=n.budget.ToNanoseconds() / 1e9 if n.HasField("budget") else None,
                optional=n.optional,
            )
            for n in request.plan.nodes
        ]
    )


def plan_message(plan: plans.Plan) -> orchestrator_pb2.Plan:
    """A domain plan as the contract writes it (for clients that send explicit plans)."""
    message = orchestrator_pb2.Plan()
    for node in plan.nodes:
        entry = message.nodes.add(
            id=node.id,
            kind=_KIND_ENUM[node.kind],
            depends_on=list(node.depends_on),
            params=node.params.as_text(),
            optional=node.optional,
        )
        if node.budget_s is not None:
            entry.budget.CopyFrom(duration(node.budget_s))
    return message


def default_plan(mode: SearchMode, rerank: bool) -> plans.Plan:
    """The default RAG plan for a search mode (PREFILTER is one retrieval step)."""
    if mode == SearchMode.HYBRID:
        return plans.default_rag_plan(rerank=rerank)
    first = plans.Node("retrieve", plans.Kind.RETRIEVE, params=RetrieveParams(mode=mode))
    nodes = [first]
    ranked = "retrieve"
    if rerank:
        nodes += plans.rerank_nodes("retrieve")
        ranked = "rerank"
    nodes += [
        plans.Node("evidence", plans.Kind.SELECT_EVIDENCE, (ranked,)),
        plans.Node("generate", plans.Kind.GENERATE, ("evidence",)),
    ]
    return plans.Plan(tuple(nodes))


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, config) -> None:
        self.config = config
        self.orchestrator: Deferred[Orchestrator] = Deferred("the orchestrator")
        self.metrics: OrchestratorMetrics | None = None  # when the process serves metrics

    async def Ask(
        self, request: orchestrator_pb2.AskRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.AskResponse]:
        orchestrator = self.orchestrator.value
        caller = current_caller()  # UNAUTHENTICATED before any work when no tenant came
        resolved = question_of(request)
        route = route_of(request, resolved.question)
        if resolved.subject:
            route["route_reason"] += f"; follow-up read with ({resolved.subject})"
        ask = AskInput(
            settings=settings_of(request, self.config, resolved.question),
            limits=limits_of(request, orchestrator.settings.default_limits),
            task_id=request.task_id,
            plan=plan_of(request),
            viewer=Viewer(caller.tenant, caller.visibility),
            cache_policy=cache_policy_from_proto(request.cache),
            **route,
        )
        clock = current_clock()
        events: asyncio.Queue = asyncio.Queue()
        run = asyncio.create_task(
            orchestrator.ask(
                ask,
                events.put_nowait,
                received=clock.received,
                run_id=current_run_id() or "",
                default_plan=default_plan(ask.settings.search_mode, orchestrator.settings.rerank),
            ),
            name="ask",
        )
        first_text = True
        try:
            while True:
                waiting = asyncio.ensure_future(events.get())
                await asyncio.wait({waiting, run}, return_when=asyncio.FIRST_COMPLETED)
                if not waiting.done():
                    waiting.cancel()
                    break
                event = waiting.result()
                if isinstance(event, Delta):
                    if first_text:
                        clock.mark_first_token()
                        first_text = False
                    yield orchestrator_pb2.AskResponse(delta=event.text)
                else:
                    yield orchestrator_pb2.AskResponse(node=_node_event(event))
            while not events.empty():
                event = events.get_nowait()
                if isinstance(event, Delta):
                    yield orchestrator_pb2.AskResponse(delta=event.text)
                else:
                    yield orchestrator_pb2.AskResponse(node=_node_event(event))
            try:
                outcome = run.result()
            except ResourceExhausted as refused:
                if self.metrics is not None:
                    self.metrics.refused(refused.reason)
                raise
            if self.metrics is not None:
                self.metrics.record(outcome, caller.tenant)
            yield orchestrator_pb2.AskResponse(result=_result(outcome, current_run_id() or ""))
        finally:
            if not run.done():
                run.cancel()  # the caller went away: cancel the work down the tree
                with contextlib.suppress(BaseException):
                    await run


def _node_event(event: NodeChanged) -> orchestrator_pb2.NodeEvent:
    record = event.record
    return orchestrator_pb2.NodeEvent(
        node_id=record.node.id,
        kind=_KIND_ENUM[record.node.kind],
        state=_NODE_STATES.get(record.state, orchestrator_pb2.NODE_STATE_UNSPECIFIED),
        at=duration(event.at_s),
    )


def _offset(value: float | None, origin: float):
    return None if value is None else duration(value - origin)


def _node_timing(record: NodeRecord, origin: float) -> orchestrator_pb2.NodeTiming:
    state = _NODE_STATES.get(record.state, orchestrator_pb2.NODE_STATE_UNSPECIFIED)
    if record.cached and record.state == NodeState.SUCCEEDED:
        state = orchestrator_pb2.NODE_STATE_CACHED
    timing = orchestrator_pb2.NodeTiming(
        node_id=record.node.id,
        kind=_KIND_ENUM[record.node.kind],
        depends_on=list(record.node.depends_on),
        state=state,
        attempts=record.attempts,
        error=record.error or record.note,
    )
    for name in (
        "began",
        "reserve_start",
        "call_start",
        "first_byte",
        "call_end",
        "settled",
        "finished",
    ):
        value = _offset(getattr(record, name), origin)
        if value is not None:
            getattr(timing, name).CopyFrom(value)
    if record.server is not None:
        timing.server.CopyFrom(record.server)
        timing.calls = record.calls
    return timing


def _cache_report(outcome: AskOutcome) -> orchestrator_pb2.CacheReport:
    use = outcome.cache
    report = orchestrator_pb2.CacheReport(
        answer_hit=use.answer_hit,
        retrieval_hits=use.retrieval_hits,
        retrieval_misses=use.retrieval_misses,
        prefill_tokens_saved=outcome.written.prefill_tokens_saved,
        tool_hits=use.tool_hits,
        tool_misses=use.tool_misses,
    )
    for saving in use.saved:
        entry = report.saved.add(
            node_id=saving["node_id"],
            kind=_KIND_ENUM.get(plans.Kind(saving["kind"]), 0),
            layer=saving["layer"],
            input_tokens=saving.get("input_tokens", 0),
            output_tokens=saving.get("output_tokens", 0),
        )
        entry.time.CopyFrom(duration(saving.get("time_s", 0.0)))
        if "prefill_s" in saving:
            entry.prefill.CopyFrom(duration(saving["prefill_s"]))
            entry.decode.CopyFrom(duration(saving["decode_s"]))
    return report


def _citation(item) -> orchestrator_pb2.Citation:
    return orchestrator_pb2.Citation(
        document_id=item.passage.id,
        version=item.passage.version,
        marker=item.marker,
        title=item.passage.title,
        snippet=item.text,
    )


def _result(outcome: AskOutcome, run_id: str) -> orchestrator_pb2.AskResult:
    origin = outcome.received
    lower = outcome.critical.lower_bound_s
    report = orchestrator_pb2.TimingReport(
        run_id=run_id,
        end_to_end=duration(outcome.end_to_end_s),
        admission_wait=duration(outcome.admitted - origin),
        plan_ready=duration(outcome.plan_ready - origin),
        nodes=[_node_timing(outcome.records[n.id], origin) for n in outcome.plan.nodes],
        critical_path=outcome.critical.nodes,
        critical_path_lower_bound=duration(lower),
        overhead_ratio=outcome.end_to_end_s / lower if lower > 0 else 0.0,
        trace_id=tracing.trace_id(),
    )
    result = orchestrator_pb2.AskResult(
        answer=outcome.written.answer,
        citations=[_citation(item) for item in outcome.written.citations],
        evidence=[_citation(item) for item in outcome.written.evidence],
        status=common_pb2.AnswerStatus(
            state=_ANSWER_STATES[outcome.state], reason=outcome.reason, detail=outcome.detail
        ),
        timing=report,
        cache=_cache_report(outcome),
        task_id=outcome.task_id,
        model=outcome.written.model,
        tier=outcome.written.tier,
        degraded=outcome.degraded,
        dropped_citations=outcome.written.dropped_citations,
        route=outcome.route,
        route_detail=outcome.route_detail,
        subqueries=outcome.subqueries,
        escalation_signals=outcome.written.signals,
        escalated=outcome.written.escalated,
        draft_answer=outcome.written.draft_answer,
        escalation_cured=outcome.written.escalation_cured,
        answerability=outcome.answerability or 0.0,
        verified=outcome.written.verified,
        answer_logprob=outcome.written.answer_logprob,
    )
    if outcome.ledger is not None:
        result.budget.CopyFrom(outcome.ledger)
    return result
