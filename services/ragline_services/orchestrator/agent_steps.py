"""The agent plan's model steps: the planning call, and the synthesis of its lookups
(one part per lookup, each answered from its own evidence, joined in order)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import structlog

from ragline.budget import Amounts
from ragline.v1 import (
    generation_pb2,
)
from ragline.vocabulary import FinishReason, ModelTier, tier_to_proto
from ragline_services.orchestrator import answerability, followup
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.agent import (
    PLANNER_PROMPT,
    MalformedPlan,
    parse_plan,
)
from ragline_services.orchestrator.answer_step import answer, generate
from ragline_services.orchestrator.evidence_steps import embedded_or_none
from ragline_services.orchestrator.generation_call import chat, generate_reserved
from ragline_services.orchestrator.params import RetrieveParams
from ragline_services.orchestrator.plan import Kind
from ragline_services.orchestrator.routing import Signal
from ragline_services.orchestrator.run_context import (
    Answer,
    MissingPart,
    NoEvidence,
    Planned,
    Ranked,
    RunContext,
)
from ragline_services.orchestrator.runner import Step
from ragline_services.orchestrator.verdict import stands

log = structlog.get_logger("ragline.orchestrator")


async def synthesize(ctx: RunContext, step: Step) -> Answer:
    """The synthesis step: over lookups (the agent plan's) one part per lookup; over
    evidence or earlier answers, the answer step's one answer."""
    if not any(isinstance(item, Answer | ev.Evidence) for item in step.inputs):
        return await synthesize_lookups(ctx, step)
    return await generate(ctx, step)


async def plan_question(ctx: RunContext, step: Step) -> Planned:
    """The planning call: the small model writes the lookups as JSON; a malformed reply is
    asked for once more with what was wrong; twice malformed is a fallback, not an error."""
    s = ctx.settings
    turns = [(generation_pb2.ROLE_SYSTEM, PLANNER_PROMPT), (generation_pb2.ROLE_USER, s.question)]
    problems: list[str] = []
    for _ in range(2):
        prompt_tokens = ev.tokens_estimate("".join(t for _, t in turns)) + 16 * len(turns)
        request = generation_pb2.GenerateRequest(
            chat=chat(*turns), max_tokens=160, tier=tier_to_proto(ModelTier.SMALL)
        )
        final, _ = await generate_reserved(
            ctx, step, request, ModelTier.SMALL, prompt_tokens, emit=None
        )
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


async def synthesize_lookups(ctx: RunContext, step: Step) -> Answer:
    """The agent plan's answer: one part per lookup, each answered from its own evidence by
    its own generation (side by side) and checked against its own citations, joined as
    "A [1]; B [3]". A part with no answer standing (no evidence answers it, or its answer
    failed its checks) never takes the others with it: they are the answer, and that part
    is named, as a missing part (INCOMPLETE `missing_part`), or, where the request allows
    degrading or the lookup was optional, as left out (PARTIAL). With no part standing,
    the run is INCOMPLETE as a one-part answer would be."""
    s = ctx.settings
    parts: list[_Part] = []
    for dep in step.node.depends_on:
        node = step.plan_node(dep)
        if node.kind != Kind.RETRIEVE:
            continue
        output = step.output_of(dep)
        passages = output.passages[: s.context_passages] if isinstance(output, Ranked) else []
        query, sentences = part_evidence(
            node.params_as(RetrieveParams).query or s.question, passages, s.embed_sentences
        )
        parts.append(_Part(query, not node.optional, passages, sentences))
    parts = await _part_similarities(ctx, step, parts)
    kept: list[_Part] = []
    missing: list[MissingPart] = []
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
        except (NoEvidence, answerability.NotAnswerable) as error:
            _leave_out(ctx, part, "part_without_evidence", str(error), missing)
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

    async def answer_part(index: int, part: _Part, found: ev.Evidence) -> Answer:
        try:
            return await answer(
                ctx, step, part.query, found, emitter.part(index), part=f"p{index + 1}"
            )
        finally:
            emitter.finished(index)

    async with asyncio.TaskGroup() as group:
        tasks = [
            group.create_task(answer_part(i, part, found))
            for i, (part, found) in enumerate(zip(kept, evidences, strict=True))
        ]
    answers = [task.result() for task in tasks]
    standing = [a for a in answers if stands(a)]
    if standing and len(standing) < len(answers):
        for part, written in zip(kept, answers, strict=True):
            if not stands(written):
                why = "; ".join(str(p) for p in written.problems) or "no answer in its evidence"
                _leave_out(ctx, part, "part_failed_checks", why, missing, written.text)
        answers = standing
    return replace(_joined(answers), missing_parts=tuple(missing))


def _leave_out(
    ctx: RunContext, part: _Part, kind: str, why: str, missing: list[MissingPart], draft: str = ""
) -> None:
    """A part without an answer standing: left out of a PARTIAL answer where the request
    allows degrading or the lookup was optional, else named as missing."""
    if not part.required or ctx.settings.allow_degrade:
        ctx.degraded.append(f"{kind}: {part.query}")
    else:
        missing.append(MissingPart(part.query, why, draft))


def part_evidence(
    lookup: str, passages: list[ev.Passage], count: int
) -> tuple[str, list[ev.Sentence]]:
    """A part's question and the sentences shortlisted for it from its lookup's passages.
    The subject a lookup carries (followup.py) found its documents; the clause as asked
    chooses its sentences and is what its answer is judged against: the first clause's
    words ("default escape character ssh") chose that clause's sentence for "which hash
    does it use for fingerprints by default?", and counted as question words its answer
    lacked."""
    clause = followup.without_subject(lookup)
    return clause, ev.shortlist(clause, ev.candidate_sentences(passages), count)


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
    embedded = await embedded_or_none(ctx, step, texts)
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

    def least(attribute: str) -> float | None:
        """The least sure part's reading (None where no part has one)."""
        known = [getattr(a, attribute) for a in answers if getattr(a, attribute) is not None]
        return min(known, default=None)

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
        (
            f
            for f in (FinishReason.DEADLINE, FinishReason.LENGTH)
            if any(a.finish_reason == f for a in answers)
        ),
        FinishReason.STOP,
    )
    usage = Amounts()
    for each in answers:
        usage = usage + each.usage
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
        not_escalated=next((a.not_escalated for a in answers if a.not_escalated), None),
        problems=named("problems"),
        verified=least("verified"),
        answer_logprob=least("answer_logprob"),
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
