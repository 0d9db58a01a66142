"""The answer step: one answer from selected evidence (escalated to the large tier on a
checkable signal, read again where the verifier is unsure), checked against its
citations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import grpc
import structlog

from ragline.budget import Amounts, BudgetRefused
from ragline.v1 import (
    generation_pb2,
)
from ragline.vocabulary import ModelTier, finish_reason_from_proto, tier_to_proto
from ragline.words import mostly_han
from ragline_services.orchestrator import confidence, followup, second_read, verifier
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.agent import (
    clauses,
)
from ragline_services.orchestrator.evidence_steps import evidence_of
from ragline_services.orchestrator.generation_call import (
    chat,
    context_window,
    generate_reserved,
    tier_served,
)
from ragline_services.orchestrator.params import AnswerParams
from ragline_services.orchestrator.routing import CUT, UNVERIFIED, Signal, escalation_signals
from ragline_services.orchestrator.run_context import (
    Answer,
    NoEvidence,
    NotEscalated,
    RunContext,
)
from ragline_services.orchestrator.runner import Step

log = structlog.get_logger("ragline.orchestrator")

# The answerability gate's estimate below which a failed answer is not escalated.
ESCALATE_FROM = 0.85


async def generate(ctx: RunContext, step: Step) -> Answer:
    """The answer from selected evidence, earlier answers' sources, or the best passages."""
    evidence = evidence_of(ctx, step.inputs)
    if not evidence.items:
        raise NoEvidence("retrieval found no passage visible to this caller for the question")
    emit = ctx.on_delta if step.is_answer else None
    return await answer(ctx, step, ctx.settings.question, evidence, emit)


async def answer(
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
    given = step.node.params_as(AnswerParams)
    tier = given.tier or s.tier
    # A part is shown as asked, without a subject carried into it for its lookup.
    asked = "" if question == s.question else followup.without_subject(question)
    user = ev.user_message(s.question, evidence, part=asked)
    prompt_tokens = ev.tokens_estimate(ev.SYSTEM_PROMPT + user) + 16  # + chat template
    # The answer must fit the model's context beside the prompt (the estimate may be short
    # of the real count: a quarter more is kept free).
    room = await context_window(ctx, tier) - int(prompt_tokens * 1.25) - 16
    max_tokens = max(1, min(given.max_tokens or s.answer_tokens, room))
    request = generation_pb2.GenerateRequest(
        chat=chat((generation_pb2.ROLE_SYSTEM, ev.SYSTEM_PROMPT), (generation_pb2.ROLE_USER, user)),
        max_tokens=max_tokens,
        tier=tier_to_proto(tier),
        sampling=generation_pb2.Sampling(stop=["\n"], logprobs=True),  # for the verifier
        # Saved KV states of this prompt name its documents, so forgetting one reaches them.
        sources=sorted({item.passage.id for item in evidence.items}),
    )
    final, used = await generate_reserved(
        ctx, step, request, tier, prompt_tokens, emit=emit, part=part
    )
    answer = _checked(_answer_of(final, evidence, used), question, s.verify_threshold)
    if not answer.problems and answer.rivals and (answer.verified or 0.0) < s.confirm_above:
        answer = await _read_again(ctx, step, question, answer, part)
    signals = answer.problems
    if not signals or tier != ModelTier.SMALL or not s.escalate or given.tier is not None:
        return replace(answer, signals=signals)
    if not await tier_served(ctx, ModelTier.LARGE):
        return replace(
            answer,
            signals=signals,
            outcome="escalation_unavailable: no large tier",
            not_escalated=NotEscalated.NO_LARGE_TIER,
        )
    gate = evidence.signals
    if gate is not None and gate.probability < ESCALATE_FROM:
        # A larger model cannot read what the evidence does not hold: escalated below this,
        # the large tier mostly wrote a grounded-looking answer to a question the documents
        # do not answer (docs/answer-states.md, "Which tiers").
        skipped = (
            f"escalation_skipped: the evidence likely does not answer ({gate.probability:.2f})"
        )
        return replace(
            answer, signals=signals, outcome=skipped, not_escalated=NotEscalated.EVIDENCE_UNLIKELY
        )
    beside = ctx.others_running()
    if beside > s.escalate_beside:
        skipped = f"escalation_skipped: {beside} other runs in flight"
        return replace(
            answer, signals=signals, outcome=skipped, not_escalated=NotEscalated.OTHERS_IN_FLIGHT
        )
    # Escalation: the large tier, in a reservation of its own; the small answer stands
    # (with its signals) when that does not fit the budget or the tier is not served.
    request.tier = tier_to_proto(ModelTier.LARGE)
    try:
        final, more = await generate_reserved(
            ctx, step, request, ModelTier.LARGE, prompt_tokens, emit=None, part=part
        )
    except BudgetRefused:
        outcome, why = "escalation_unaffordable", NotEscalated.UNAFFORDABLE
    except grpc.aio.AioRpcError as error:
        outcome, why = f"escalation_failed: {error.code().name}", NotEscalated.FAILED
    else:
        large = _checked(_answer_of(final, evidence, used + more), question, s.verify_threshold)
        return replace(large, signals=signals, escalated=True)
    return replace(answer, signals=signals, outcome=outcome, not_escalated=why)


def _checked(answer: Answer, question: str, verify_threshold: float) -> Answer:
    """The answer with the checks that failed on it (a question that joins several, asked
    of one answer, needs every part answered); an answer that passed them is read by the
    verifier, whose estimate below `verify_threshold` is a check failed too."""
    found = escalation_signals(
        answer.text,
        answer.evidence,
        answer.cited,
        answer.finish_reason,
        question=question,
        parts=len(clauses(question)),
    )
    verified: float | None = None
    rivals: tuple[str, ...] = ()
    if all(x.reason == CUT for x in found) and not ev.is_refusal(answer.text):
        gate = answer.evidence.signals
        reading = verifier.verify(
            question,
            answer.text,
            answer.cited.citations,
            answer.evidence.items,
            None if gate is None else gate.probability,
            answer.answer_logprob,
            answer.model,
        )
        verified = round(reading.estimate, 4)
        cited = " ".join(item.text for item in answer.cited.citations)
        # Across languages the question's words meet their passage only through the
        # lexicon, too thinly to refuse on or to rank rivals by: the estimate is reported,
        # nothing more (cross-lingual verification is still to be built).
        if mostly_han(question) == mostly_han(cited):
            if verify_threshold and reading.estimate < verify_threshold:
                found.append(Signal("unverified", reading.explain(), UNVERIFIED))
            else:
                rivals = reading.rivals
    return replace(answer, problems=tuple(found), verified=verified, rivals=rivals)


async def _read_again(
    ctx: RunContext, step: Step, question: str, answer: Answer, part: str
) -> Answer:
    """The verifier's second read (second_read.py): the small model chooses the answer
    among its rivals, from the text the answer cites; another choice makes it unverified.
    A second read that cannot run (budget, engine) leaves the answer as it was."""
    cited = " ".join(item.text for item in answer.cited.citations)
    asked = second_read.options(ev.strip_markers(answer.text), answer.rivals, cited)
    user = second_read.user_message(question, cited, asked)
    request = generation_pb2.GenerateRequest(
        chat=chat(
            (generation_pb2.ROLE_SYSTEM, second_read.SYSTEM_PROMPT),
            (generation_pb2.ROLE_USER, user),
        ),
        max_tokens=2,
        tier=tier_to_proto(ModelTier.SMALL),
        sampling=generation_pb2.Sampling(stop=["\n"]),
        sources=sorted({item.passage.id for item in answer.cited.citations}),
    )
    prompt_tokens = ev.tokens_estimate(second_read.SYSTEM_PROMPT + user) + 16
    try:
        final, used = await generate_reserved(
            ctx,
            step,
            request,
            ModelTier.SMALL,
            prompt_tokens,
            emit=None,
            part=f"{part}read2",
            retry_of_node=False,
        )
    except (BudgetRefused, grpc.aio.AioRpcError) as error:
        log.info("verifier.second_read_skipped", error=str(error)[:200])
        return answer
    choice = second_read.chosen(final.text, asked)
    usage = answer.usage + used
    if choice is None or choice == asked.answer:
        return replace(answer, usage=usage)
    other = asked.texts[choice]
    found = Signal(
        "unverified",
        f"a second read chose {other!r} over it among the candidates of its citation",
        UNVERIFIED,
    )
    return replace(answer, usage=usage, problems=(*answer.problems, found))


def _answer_of(final, evidence: ev.Evidence, used: Amounts) -> Answer:
    text = final.text
    return Answer(
        text=text.strip(),
        evidence=evidence,
        cited=ev.cite(text, evidence),
        finish_reason=finish_reason_from_proto(final.finish_reason),
        usage=used,
        cached_input_tokens=final.usage.cached_input_tokens,
        model=final.model,
        tier=final.tier,
        model_version=final.model_version,
        answer_logprob=confidence.answer_logprob(final.logprobs),
    )
