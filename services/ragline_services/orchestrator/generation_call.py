"""Calls to the generation service for the answering steps: each generation streams
inside a budget reservation of its own, is retried while no text has reached the caller,
and is sent again marked light when its tenant turns light before its first text."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from ragline.budget import Amounts
from ragline.errors import RaglineError
from ragline.retry import DEFAULT_POLICY, call_with_retry
from ragline.v1 import (
    generation_pb2,
)
from ragline.vocabulary import ModelTier, tier_to_proto
from ragline_services.orchestrator.run_context import (
    RunContext,
)
from ragline_services.orchestrator.runner import Step

log = structlog.get_logger("ragline.orchestrator")


async def generate_reserved(
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
        final = await stream_generation(
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


def chat(*turns: tuple[generation_pb2.Role, str]) -> generation_pb2.Chat:
    return generation_pb2.Chat(
        messages=[generation_pb2.ChatMessage(role=role, content=text) for role, text in turns]
    )


async def tier_served(ctx: RunContext, tier: ModelTier) -> bool:
    """Whether the generation service serves `tier` (asked once, then remembered)."""
    if tier not in ctx.clients.context_windows:
        try:
            await context_window(ctx, tier)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                return False  # unknown now: ask again next time
            ctx.clients.context_windows[tier] = 0
    return ctx.clients.context_windows[tier] > 0


async def context_window(ctx: RunContext, tier: ModelTier) -> int:
    known = ctx.clients.context_windows.get(tier)
    if known is None:
        request = generation_pb2.CountTokensRequest(prompt="x", tier=tier_to_proto(tier))
        reply = await ctx.clients.generation.unary("CountTokens", request, retry=DEFAULT_POLICY)
        known = ctx.clients.context_windows[tier] = reply.context_window
        ctx.clients.light_first[tier] = reply.light_first
    return known


class TurnedLight(Exception):
    """The run's tenant turned light while its unmarked generation read its prompt."""


async def read_generation(
    client,
    request,
    step: Step,
    pieces: list[str],
    emit: Callable[[str], None] | None,
    turned: asyncio.Event | None,
):
    """One Generate call read to its end: its final message (None if it sent none).
    TurnedLight, the call cancelled, when `turned` is set before its first text."""

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
            raise TurnedLight
        return await reader
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


class StreamStarted(RaglineError):
    """A stream failed after text went out: never retried (the caller saw the text)."""

    code = grpc.StatusCode.UNAVAILABLE


async def stream_generation(
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
                    return await read_generation(client, request, step, pieces, emit, turned)
                except TurnedLight:
                    request.light_tenant = True
                    ctx.raised_light += 1
                    step.record.attempts += 1
                    log.info("generation.raised_light", node=step.node.id)
                except grpc.aio.AioRpcError as error:
                    if pieces:
                        raise StreamStarted(
                            f"generation stream broke: {error.details()}"
                        ) from error
                    raise

    async with ctx.clients.limits["generation"]:
        step.mark("call_start")
        final = await call_with_retry(attempt, DEFAULT_POLICY, what="generation.Generate")
        step.mark("call_end")
    if final is None:
        raise StreamStarted("the generation stream ended without its final message")
    step.record.served(final.timing)
    return final
