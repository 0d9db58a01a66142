"""Which function runs each kind of plan step, and the executors a run's PlanRunner is
given. The steps live by stage in retrieval_steps, evidence_steps, answer_step and
agent_steps (their calls to the generation service in generation_call); what they share
is run_context's."""

from __future__ import annotations

import time

import structlog

from ragline import deadlines
from ragline_services.orchestrator.agent_steps import plan_question, synthesize
from ragline_services.orchestrator.answer_step import generate
from ragline_services.orchestrator.evidence_steps import rerank, rerank_query, select_evidence
from ragline_services.orchestrator.plan import Kind
from ragline_services.orchestrator.retrieval_steps import bm25, embed, fuse, retrieve, vector_search
from ragline_services.orchestrator.run_context import RunContext
from ragline_services.orchestrator.runner import Step

log = structlog.get_logger("ragline.orchestrator")

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
    Kind.SYNTHESIZE: synthesize,
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
