"""The answering steps: generate (escalated to the large tier on a checkable signal),
the agent's planning call, and the synthesis of its lookups; each generation streams
inside a reservation of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
import numpy as np
import structlog

from ragline.budget import Amounts, BudgetRefused
from ragline.errors import RaglineError
from ragline.retry import DEFAULT_POLICY, call_with_retry
from ragline.v1 import (
    generation_pb2,
)
from ragline.vocabulary import FinishReason, ModelTier, finish_reason_from_proto, tier_to_proto
from ragline.words import mostly_han
from ragline_services.orchestrator import answerability, followup, second_read, verifier
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.agent import (
    PLANNER_PROMPT,
    MalformedPlan,
    clauses,
    parse_plan,
)
from ragline_services.orchestrator.evidence_steps import embedded_or_none, evidence_of
from ragline_services.orchestrator.params import AnswerParams, RetrieveParams
from ragline_services.orchestrator.plan import Kind
from ragline_services.orchestrator.routing import CUT, UNVERIFIED, Signal, escalation_signals
from ragline_services.orchestrator.run_context import (
    Answer,
    NoEvidence,
    Planned,
    Ranked,
    RunContext,
)
from ragline_services.orchestrator.runner import Step

log = structlog.get_logger("ragline.orchestrator")


async def _generate_reserved(
    ctx: RunContext,
    step: Step,
    request,
    tier: ModelTier,
    prompt_tokens: int,
    *,
    emit: Callable[[str], None] | None,
    part: str = "",
    retry_of_node: bool = True,
) -> tuple[Any, Amounts]:
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
        final = await _stream_generation(
            ctx,
            step,
            request,
            pieces,
            emit,
            attempts,
            raise_light=ctx.clients.light_first.get(tier, False),
            retry_of_node=retry_of_node,
        )
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


def _chat(*turns: tuple[generation_pb2.Role, str]) -> generation_pb2.Chat:
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
    evidence = evidence_of(ctx, step.inputs)
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
    given = step.node.params_as(AnswerParams)
    tier = given.tier or s.tier
    # A part is shown as asked, without a subject carried into it for its lookup.
    asked = "" if question == s.question else followup.without_subject(question)
    user = ev.user_message(s.question, evidence, part=asked)
    prompt_tokens = ev.tokens_estimate(ev.SYSTEM_PROMPT + user) + 16  # + chat template
    # The answer must fit the model's context beside the prompt (the estimate may be short
    # of the real count: a quarter more is kept free).
    room = await _context_window(ctx, tier) - int(prompt_tokens * 1.25) - 16
    max_tokens = max(1, min(given.max_tokens or s.answer_tokens, room))
    request = generation_pb2.GenerateRequest(
        chat=_chat(
            (generation_pb2.ROLE_SYSTEM, ev.SYSTEM_PROMPT), (generation_pb2.ROLE_USER, user)
        ),
        max_tokens=max_tokens,
        tier=tier_to_proto(tier),
        sampling=generation_pb2.Sampling(stop=["\n"]),
        # Saved KV states of this prompt name its documents, so forgetting one reaches them.
        sources=sorted({item.passage.id for item in evidence.items}),
    )
    final, used = await _generate_reserved(
        ctx, step, request, tier, prompt_tokens, emit=emit, part=part
    )
    answer = _checked(_answer_of(final, evidence, used), question, s.verify_threshold)
    if not answer.problems and answer.rivals and (answer.verified or 0.0) < s.confirm_above:
        answer = await _read_again(ctx, step, question, answer, part)
    signals = answer.problems
    if not signals or tier != ModelTier.SMALL or not s.escalate or given.tier is not None:
        return replace(answer, signals=signals)
    if not await _tier_served(ctx, ModelTier.LARGE):
        return replace(answer, signals=signals, outcome="escalation_unavailable: no large tier")
    # Escalation: the large tier, in a reservation of its own; the small answer stands
    # (with its signals) when that does not fit the budget or the tier is not served.
    request.tier = tier_to_proto(ModelTier.LARGE)
    try:
        final, more = await _generate_reserved(
            ctx, step, request, ModelTier.LARGE, prompt_tokens, emit=None, part=part
        )
    except BudgetRefused:
        outcome = "escalation_unaffordable"
    except grpc.aio.AioRpcError as error:
        outcome = f"escalation_failed: {error.code().name}"
    else:
        large = _checked(_answer_of(final, evidence, used + more), question, s.verify_threshold)
        return replace(large, signals=signals, escalated=True)
    return replace(answer, signals=signals, outcome=outcome)


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
        chat=_chat(
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
        final, used = await _generate_reserved(
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
            chat=_chat(*turns), max_tokens=160, tier=tier_to_proto(ModelTier.SMALL)
        )
        final, _ = await _generate_reserved(
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
        query = node.params_as(RetrieveParams).query or s.question
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
        verified=min((a.verified for a in answers if a.verified is not None), default=None),
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


async def _tier_served(ctx: RunContext, tier: ModelTier) -> bool:
    """Whether the generation service serves `tier` (asked once, then remembered)."""
    if tier not in ctx.clients.context_windows:
        try:
            await _context_window(ctx, tier)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                return False  # unknown now: ask again next time
            ctx.clients.context_windows[tier] = 0
    return ctx.clients.context_windows[tier] > 0


async def _context_window(ctx: RunContext, tier: ModelTier) -> int:
    known = ctx.clients.context_windows.get(tier)
    if known is None:
        request = generation_pb2.CountTokensRequest(prompt="x", tier=tier_to_proto(tier))
        reply = await ctx.clients.generation.unary("CountTokens", request, retry=DEFAULT_POLICY)
        known = ctx.clients.context_windows[tier] = reply.context_window
        ctx.clients.light_first[tier] = reply.light_first
    return known


class _TurnedLight(Exception):
    """The run's tenant turned light while its unmarked generation read its prompt."""


async def _read_generation(
    client,
    request,
    step: Step,
    pieces: list[str],
    emit: Callable[[str], None] | None,
    turned: asyncio.Event | None,
):
    """One Generate call read to its end: its final message (None if it sent none).
    _TurnedLight, the call cancelled, when `turned` is set before its first text."""

    async def read():
        final = None
        async for message in client.stream("Generate", request):
            if message.text:
                step.mark("first_byte")
                pieces.append(message.text)
                if emit is not None:
                    emit(message.text)
            if message.HasField("final"):
                final = message.final
        return final

    if turned is None:
        return await read()
    reader = asyncio.ensure_future(read())
    try:
        watch = asyncio.ensure_future(turned.wait())
        try:
            await asyncio.wait((reader, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not reader.done() and not pieces:
            # No text out yet (nothing runs before `finally` cancels the reader, and a
            # cancelled reader cannot add any): the call ends and goes again, marked.
            raise _TurnedLight
        return await reader
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


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
    *,
    raise_light: bool = False,
    retry_of_node: bool = True,
):
    """The generation's final message; its text streams into `pieces` (and `emit`);
    `attempts[0]` counts this generation's attempts (the step's record counts them all).

    `raise_light` (the tier serves light tenants first): a generation sent unmarked is sent
    again marked light (GenerateRequest.light_tenant) when the run's tenant turns light
    before its first token: a flood that began beside it (the front door learns of it only
    from the flood's next runs) would otherwise share the engine with it for the whole of
    its prompt. What the engine read of its prompt so far is lost; one of the priority
    slots reads it alone instead, the flood paused."""
    client = ctx.clients.generation

    async def attempt():
        # A call of its own (the verifier's second read) is no attempt of the node's call.
        step.record.attempts += retry_of_node
        attempts[0] += 1
        while True:
            request.light_tenant = request.light_tenant or ctx.light_tenant()
            unmarked = raise_light and not request.light_tenant
            watching = ctx.until_light() if unmarked else contextlib.nullcontext()
            with watching as turned:
                try:
                    return await _read_generation(client, request, step, pieces, emit, turned)
                except _TurnedLight:
                    request.light_tenant = True
                    ctx.raised_light += 1
                    step.record.attempts += 1
                    log.info("generation.raised_light", node=step.node.id)
                except grpc.aio.AioRpcError as error:
                    if pieces:
                        raise _StreamStarted(
                            f"generation stream broke: {error.details()}"
                        ) from error
                    raise

    async with ctx.clients.limits["generation"]:
        step.mark("call_start")
        final = await call_with_retry(attempt, DEFAULT_POLICY, what="generation.Generate")
        step.mark("call_end")
    if final is None:
        raise _StreamStarted("the generation stream ended without its final message")
    step.record.server = final.timing
    return final
