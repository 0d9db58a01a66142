"""GenerationService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from ragline import auth
from ragline.identity import current_caller, write_scope_missing
from ragline.server import Deferred
from ragline.timing import current_clock
from ragline.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from ragline.vocabulary import finish_reason_to_proto, tier_from_proto, tier_to_proto
from ragline_services.generation.engine import LOGPROBS
from ragline_services.generation.generator import (
    Chunk,
    GenerationRequest,
    Generator,
    Summary,
)
from ragline_services.generation.metrics import GenerationMetrics

_ROLES = {
    generation_pb2.ROLE_SYSTEM: "system",
    generation_pb2.ROLE_USER: "user",
    generation_pb2.ROLE_ASSISTANT: "assistant",
}
_SPECULATION_ENUM = {
    "none": generation_pb2.SPECULATION_OFF,
    "ngram": generation_pb2.SPECULATION_NGRAM,
    "draft": generation_pb2.SPECULATION_DRAFT_MODEL,
}


def _sampling(message: generation_pb2.Sampling) -> dict:
    # All zero means greedy, so that answers are reproducible unless asked otherwise.
    sampling: dict[str, float | list[str]] = {
        "temperature": message.temperature,
        "top_p": message.top_p or 1.0,
        "top_k": message.top_k,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
    }
    if message.seed:
        sampling["seed"] = message.seed
    if message.stop:
        sampling["stop"] = list(message.stop)
    if message.logprobs:
        sampling[LOGPROBS] = True
    return sampling


def _chat(request) -> list[dict[str, str]] | None:
    if request.WhichOneof("input") != "chat":
        return None
    return [{"role": _ROLES[m.role], "content": m.content} for m in request.chat.messages]


def generation_request(
    request: generation_pb2.GenerateRequest, tenant: str, visibility: frozenset[str] = frozenset()
) -> GenerationRequest:
    # The speculation field is advisory: llama.cpp fixes speculation per engine process,
    # so the tier decides and the final message's SpeculationStats says what ran.
    chat = _chat(request)
    return GenerationRequest(
        tenant=tenant,
        tier=tier_from_proto(request.tier),
        max_tokens=request.max_tokens,
        prompt=request.prompt if chat is None else None,
        chat=chat,
        sampling=_sampling(request.sampling),
        visibility=visibility,
        sources=tuple(request.sources),
        # A scheduling hint: believed from a ragline service (the orchestrator) only.
        light_tenant=request.light_tenant and auth.from_the_orchestrator(),
    )


def count_request(request: generation_pb2.CountTokensRequest, tenant: str) -> GenerationRequest:
    chat = _chat(request)
    return GenerationRequest(
        tenant=tenant,
        tier=tier_from_proto(request.tier),
        max_tokens=1,
        prompt=request.prompt if chat is None else None,
        chat=chat,
    )


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self) -> None:
        self.generator: Deferred[Generator] = Deferred("the generation engines")
        self.metrics: GenerationMetrics | None = None  # when the process serves metrics

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        generator = self.generator.value
        clock = current_clock()
        caller = current_caller()
        domain = generation_request(request, caller.tenant, caller.visibility)
        index = 0
        async with contextlib.aclosing(generator.generate(domain)) as events:
            async for event in events:
                if isinstance(event, Chunk):
                    if event.first:
                        clock.mark_first_token()
                    yield generation_pb2.GenerateResponse(
                        text=event.text,
                        token_ids=event.token_ids,
                        first_token=event.first,
                        index=index,
                    )
                    index += 1
                elif isinstance(event, Summary):
                    final = self._final(event)
                    if self.metrics is not None:
                        first = clock.first_token
                        ttft = None if first is None else first - clock.received
                        self.metrics.record(event, ttft)
                    yield generation_pb2.GenerateResponse(index=index, final=final)

    def _final(self, summary: Summary) -> generation_pb2.GenerateFinal:
        clock = current_clock()
        clock.started = clock.received + summary.queue_wait_s
        if summary.store.restore_s:
            clock.add_stage("kv_restore", summary.store.restore_s)
        clock.add_stage("prefill", summary.prefill_s)
        clock.add_stage("decode", summary.decode_s)
        if summary.paused_s:
            clock.add_stage("paused", summary.paused_s)  # while a light tenant's request ran
        if summary.engine_wait_s >= 0.001:
            clock.add_stage("engine_wait", summary.engine_wait_s)
        clock.mark_finished()
        drafted, accepted = summary.drafted, summary.accepted
        return generation_pb2.GenerateFinal(
            finish_reason=finish_reason_to_proto(summary.finish_reason),
            usage=common_pb2.Usage(
                input_tokens=summary.prompt_tokens,
                output_tokens=summary.completion_tokens,
                cached_input_tokens=summary.cached_tokens,
            ),
            timing=clock.to_proto(),
            decode_tokens_per_second=(
                summary.completion_tokens / summary.decode_s if summary.decode_s > 0 else 0.0
            ),
            model=summary.model,
            model_version=summary.model_version,
            tier=tier_to_proto(summary.tier),
            speculation=generation_pb2.SpeculationStats(
                mode=_SPECULATION_ENUM[summary.speculation_mode],
                drafted_tokens=drafted,
                accepted_tokens=accepted,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                fell_back=summary.fell_back,
            ),
            text=summary.text,
            prefix_store=generation_pb2.PrefixStoreStats(
                restored_tokens=summary.store.restored_tokens,
                saved_tokens=summary.store.saved_tokens,
            ),
            logprobs=[
                generation_pb2.TokenLogprob(
                    text=token.text, logprob=token.logprob, runner_up_logprob=token.runner_up
                )
                for token in summary.logprobs
            ],
        )

    async def CountTokens(
        self, request: generation_pb2.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.CountTokensResponse:
        generator = self.generator.value
        domain = count_request(request, current_caller().tenant)
        tokens, tier = await generator.count_tokens(domain)
        return generation_pb2.CountTokensResponse(
            tokens=tokens,
            context_window=tier.context_window,
            model=tier.model,
            model_version=tier.model_version,
            light_first=tier.scheduler.priority_slots > 0,
        )

    async def ForgetSources(
        self, request: generation_pb2.ForgetSourcesRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ForgetSourcesResponse:
        caller = current_caller()
        if not caller.may_write:
            raise write_scope_missing("ForgetSources")
        forgotten = await self.generator.value.forget(caller.tenant, list(request.sources))
        return generation_pb2.ForgetSourcesResponse(forgotten=forgotten)
