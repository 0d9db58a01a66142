"""The answer step: one answer from selected evidence (escalated to the large tier on a
checkable signal; where the verifier is unsure, cross-checked by the large tier, or read
again by the small model where the large tier may not be asked), checked against its
citations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import structlog

from ragline import answer_match
from ragline.budget import Amounts, BudgetRefused
from ragline.v1 import (
    generation_pb2,
)
from ragline.vocabulary import ModelTier, finish_reason_from_proto, tier_to_proto
from ragline.words import mostly_han
from ragline_services.orchestrator import (
    confidence,
    grounding,
    restatement,
    second_read,
    verifier,
)
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
from ragline_services.orchestrator.routing import (
    CUT,
    UNGROUNDED,
    UNVERIFIED,
    Signal,
    escalation_signals,
)
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
    escalated to the large tier when a check fails and the run may, cross-checked by it
    when the verifier passed the answer unsure (the large tier's text is not streamed: the
    result carries it)."""
    s = ctx.settings
    given = step.node.params_as(AnswerParams)
    tier = given.tier or s.tier
    # A part comes as asked (agent_steps.part_evidence took off a subject its lookup carried).
    asked = "" if question == s.question else question
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
    answer = _checked(_answer_of(final, evidence, used, question), question, s.verify_threshold)
    may_escalate = tier == ModelTier.SMALL and s.escalate and given.tier is None
    again = _Asked(ctx, step, request, prompt_tokens, question, part)
    judged = _judged(question, answer)
    if may_escalate and not answer.problems and _unsure(answer, judged, s.cross_check_below):
        # At any estimate of the gate: the answer has passed its checks, and where the
        # evidence is weak the large tier's reading is what refuses a wrong one (replayed:
        # docs/answer-states.md, "The gate's floor and the cross-check").
        refused = await _not_escalated(ctx, evidence, s.cross_check_beside, weak_evidence=True)
        if refused is None:
            # The large tier's reading settles it: a second read first would only add a
            # call (what it refuses is escalated to the same large tier, with the same
            # outcomes; docs/answer-states.md, "The large tier as a cross-check").
            return await _cross_checked(again, answer)
        if refused[1] == NotEscalated.OTHERS_IN_FLIGHT:
            # What COMPLETE promises must not depend on how busy the replica is: passed
            # unsure and not cross-checked, an answer is right about two times in three
            # (docs/answer-states.md, "COMPLETE under load").
            return _not_cross_checked(answer, refused[0], judged)
    if not answer.problems and answer.rivals and (answer.verified or 0.0) < s.confirm_above:
        answer = await _read_again(ctx, step, question, answer, part)
    if not may_escalate:
        return replace(answer, signals=answer.problems)
    if answer.problems:
        return await _escalated(again, answer)
    return answer


@dataclass(frozen=True)
class _Asked:
    """The small tier's call, as the large tier is asked it again."""

    ctx: RunContext
    step: Step
    request: generation_pb2.GenerateRequest
    prompt_tokens: int
    question: str
    part: str


async def _not_escalated(
    ctx: RunContext,
    evidence: ev.Evidence,
    beside: int | None = None,
    *,
    weak_evidence: bool = False,
) -> tuple[str, NotEscalated] | None:
    """Why the large tier may not be asked for this run's answer (as the fields an
    answer reports it by), or None: it may, while at most `beside` other runs are in
    flight (the escalation's allowance unless given), and where the gate's estimate is
    at least ESCALATE_FROM unless `weak_evidence` may be read."""
    if not await tier_served(ctx, ModelTier.LARGE):
        return "escalation_unavailable: no large tier", NotEscalated.NO_LARGE_TIER
    gate = evidence.signals
    if not weak_evidence and gate is not None and gate.probability < ESCALATE_FROM:
        # A larger model cannot read what the evidence does not hold: escalated below this,
        # the large tier mostly wrote a grounded-looking answer to a question the documents
        # do not answer (docs/answer-states.md, "Which tiers").
        why = f"escalation_skipped: the evidence likely does not answer ({gate.probability:.2f})"
        return why, NotEscalated.EVIDENCE_UNLIKELY
    running = ctx.others_running()
    if running > (ctx.settings.escalate_beside if beside is None else beside):
        runs = "run" if running == 1 else "runs"
        why = f"escalation_skipped: {running} other {runs} in flight"
        return why, NotEscalated.OTHERS_IN_FLIGHT
    return None


async def _large_tier(asked: _Asked, small: Answer) -> Answer | tuple[str, NotEscalated]:
    """The large tier's answer to the small tier's prompt, checked (its usage added to the
    small one's), in a reservation of its own; or why it could not be had."""
    ctx = asked.ctx
    asked.request.tier = tier_to_proto(ModelTier.LARGE)
    try:
        final, more = await generate_reserved(
            ctx,
            asked.step,
            asked.request,
            ModelTier.LARGE,
            asked.prompt_tokens,
            emit=None,
            part=asked.part,
        )
    except BudgetRefused:
        return "escalation_unaffordable", NotEscalated.UNAFFORDABLE
    except grpc.aio.AioRpcError as error:
        return f"escalation_failed: {error.code().name}", NotEscalated.FAILED
    answer = _answer_of(final, small.evidence, small.usage + more, asked.question)
    return _checked(answer, asked.question, ctx.settings.verify_threshold)


async def _escalated(asked: _Asked, small: Answer) -> Answer:
    """A small answer that failed a check, escalated to the large tier where the run may;
    the small answer stands (with its signals) where it may not or the call fails."""
    signals = small.problems
    refused = await _not_escalated(asked.ctx, small.evidence)
    if refused is None:
        large = await _large_tier(asked, small)
        if isinstance(large, Answer):
            return replace(large, signals=signals, escalated=True)
        refused = large
    outcome, why = refused
    return replace(small, signals=signals, outcome=outcome, not_escalated=why)


async def _cross_checked(asked: _Asked, small: Answer) -> Answer:
    """A small answer the verifier passed but was unsure of, asked of the large tier too:
    the same answer stands; another one stands only where it clears every check itself,
    and else neither does (INCOMPLETE `unverified`, the small draft kept). Where the
    large tier's call fails, the small answer stands as checked (the caller has found that
    the large tier may be asked)."""
    large = await _large_tier(asked, small)
    if not isinstance(large, Answer):
        return small
    said, other = ev.strip_markers(small.text), ev.strip_markers(large.text)
    if answer_match.same_answer(said, other) or grounding.says_the_same(said, other):
        return replace(small, usage=large.usage, outcome="cross_checked: the large tier agreed")
    if not large.problems and not ev.is_refusal(large.text):
        outcome = f"cross_checked: the large tier's answer stands over {said.strip()!r}"
        return replace(large, escalated=True, outcome=outcome)
    found = Signal(
        "unverified",
        f"the large tier answered {other.strip()!r} from the same evidence",
        UNVERIFIED,
    )
    outcome = "cross_checked: the large tier answered otherwise, and its answer failed its checks"
    return replace(small, usage=large.usage, problems=(*small.problems, found), outcome=outcome)


def _not_cross_checked(small: Answer, why: str, judged: bool) -> Answer:
    """A small answer the verifier passed unsure (or could not judge, across languages),
    which the large tier could not cross-check for the runs in flight beside it:
    INCOMPLETE `unverified`, the draft kept."""
    doubt = (
        f"the verifier was unsure of it ({small.verified:.2f})"
        if judged
        else "the verifier cannot judge it across languages"
    )
    found = Signal(
        "unverified",
        f"{doubt} and it could not be cross-checked: {why.removeprefix('escalation_skipped: ')}",
        UNVERIFIED,
    )
    outcome = why.replace("escalation_skipped", "cross_check_skipped", 1)
    return replace(
        small,
        problems=(*small.problems, found),
        outcome=outcome,
        not_escalated=NotEscalated.OTHERS_IN_FLIGHT,
    )


def _unsure(answer: Answer, judged: bool, cross_check_below: float) -> bool:
    """Whether the large tier is to cross-check `answer` (which passed its checks): the
    verifier passed it below `cross_check_below` (0: never), or it cannot judge it (not
    `judged`: the question and the passage cited are in different languages). Across languages the
    small tier's COMPLETE answers were right 41 times in 57 on the Chinese set; the
    cross-check left 41 and 9 (docs/answer-states.md, "Cross-lingual answers")."""
    if answer.verified is None or not cross_check_below:
        return False
    return answer.verified < cross_check_below or not judged


def _judged(question: str, answer: Answer) -> bool:
    """Whether the verifier's estimate may refuse `answer`: across languages the question's
    words meet their passage only through the lexicon, too thinly to refuse on or to rank
    rivals by (cross-lingual verification is still to be built)."""
    cited = " ".join(item.text for item in answer.cited.citations)
    return mostly_han(question) == mostly_han(cited)


def _signals(answer: Answer, question: str) -> list[Signal]:
    """The checkable signals that fire on `answer` (routing.py)."""
    return escalation_signals(
        answer.text,
        answer.evidence,
        answer.cited,
        answer.finish_reason,
        question=question,
        parts=len(clauses(question)),
    )


def _checked(answer: Answer, question: str, verify_threshold: float) -> Answer:
    """The answer with the checks that failed on it (a question that joins several, asked
    of one answer, needs every part answered); an answer that passed them is read by the
    verifier, whose estimate below `verify_threshold` is a check failed too. A citation
    whose passage does not hold the answer is moved to the one that does, if only one does
    (`grounding.recited`)."""
    found = _signals(answer, question)
    if any(x.reason == UNGROUNDED for x in found):
        # Only a draft its citation does not support can have the wrong marker: the
        # support check runs once on every other draft.
        moved = grounding.recited(answer.text, answer.cited, answer.evidence.items, question)
        if moved is not None:
            answer = replace(answer, text=moved[0], cited=moved[1])
            found = _signals(answer, question)
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
        if _judged(question, answer):  # else the estimate is reported, nothing more
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


def _answer_of(final, evidence: ev.Evidence, used: Amounts, question: str) -> Answer:
    """The engine's reply as an answer: its markers read, its restatement of the question
    cut (restatement.py; the citations are read before the cut)."""
    text = ev.with_markers(final.text, evidence)
    return Answer(
        text=restatement.core(question, text.strip()),
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
