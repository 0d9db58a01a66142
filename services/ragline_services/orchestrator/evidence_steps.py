"""The steps between retrieval and the answer: rerank (and its query encoded early), and
the selection of evidence sentences within the prompt budget."""

from __future__ import annotations

from dataclasses import dataclass, replace

import grpc
import numpy as np
import structlog

from ragline.budget import Amounts
from ragline.errors import RaglineError
from ragline.v1 import (
    embedding_pb2,
    rerank_pb2,
)
from ragline.vocabulary import SkipCause, skip_cause_from_proto
from ragline_services.orchestrator import answerability
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.caches import (
    TOOL,
)
from ragline_services.orchestrator.params import EvidenceParams, RerankParams
from ragline_services.orchestrator.plan import Kind
from ragline_services.orchestrator.run_context import (
    Answer,
    QueryVector,
    Ranked,
    RunContext,
    merged,
)
from ragline_services.orchestrator.runner import Step, code_name, describe

log = structlog.get_logger("ragline.orchestrator")


async def rerank(ctx: RunContext, step: Step) -> Ranked:
    s = ctx.settings
    passages = merged(step.inputs)[: s.rerank_candidates]
    if not passages:
        return Ranked([], "reranked")
    given = step.node.params_as(RerankParams)
    top_k = given.top_k or s.context_passages
    cross_encoder = given.cross_encoder
    request = rerank_pb2.RerankRequest(
        query=s.question,
        candidates=[
            rerank_pb2.RerankCandidate(id=p.id, text=ev_text(p), first_stage_score=p.score)
            for p in passages
        ],
        top_k=top_k,
        late_interaction_k=given.late_interaction_k or s.late_interaction_k,
        allow_skip=s.allow_degrade,
        late_interaction_only=not (
            s.rerank_cross_encoder if cross_encoder is None else cross_encoder
        ),
    )
    # A tool result: the documents' versions are part of its parameters.
    key, entry = await ctx.look_up(
        step,
        TOOL,
        "rerank",
        s.question,
        [(p.id, p.version) for p in passages],
        request.top_k,
        request.late_interaction_k,
        request.late_interaction_only,
    )
    if entry is not None:
        ctx.served_from_cache(step, TOOL, entry)
        results = entry["results"]
    else:
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
        lacking = [s for s in reply.skipped if skip_cause_from_proto(s.cause) != SkipCause.LANGUAGE]
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
    given = step.node.params_as(EvidenceParams)
    count = given.passages or s.context_passages
    budget = given.max_tokens or s.evidence_tokens
    passages = merged(step.inputs)[:count]
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


async def embedded_or_none(ctx: RunContext, step: Step, texts: list[str]) -> _Embedded | None:
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
    embedded = await embedded_or_none(ctx, step, texts)
    if embedded is None:
        return None, ""
    vectors = embedded.values
    if isinstance(question, QueryVector):
        return vectors @ question.values, embedded.model
    return vectors[1:] @ vectors[0], embedded.model


def evidence_of(ctx: RunContext, inputs: list[object]) -> ev.Evidence:
    """The evidence a generate step answers from: selected sentences when a selection step
    ran; the passages earlier answers cited (a synthesis answers from its parts' sources);
    else the best passages, cut to the budget by lexical evidence alone."""
    items: list[ev.EvidenceItem] = []
    tokens = 0
    # The gate's reading of the one selection the answer reads: the verifier weighs it (it
    # was fitted with it), and escalation asks it. Merged evidence has none.
    alone = inputs[0] if len(inputs) == 1 else None
    gate = alone.signals if isinstance(alone, ev.Evidence) else None
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
        passages = merged(inputs)[: ctx.settings.context_passages]
        sentences = ev.candidate_sentences(passages)
        return ev.select(
            ctx.settings.question, passages, sentences, None, ctx.settings.evidence_tokens
        )
    # Number the markers anew over the merged evidence.
    return replace(ev.renumbered(ev.Evidence(tuple(items), tokens, 0)), signals=gate)
