"""The generation domain: validate, admit, stream, stop on deadline or cancel, report.

No gRPC here: the servicer turns these events into GenerateResponse messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from ragline import deadlines
from ragline.errors import InvalidArgument
from ragline_services.generation.engine import GenerationEngine, StreamEvent
from ragline_services.generation.scheduler import SlotScheduler

SMALL, LARGE = "small", "large"

# A stream is closed this long before the deadline, so the final message still reaches a
# caller whose own deadline is the same one.
DEADLINE_MARGIN_S = 0.05


@dataclass
class Speculation:
    """Acceptance of speculative decoding on one tier, and when to give up on it.

    llama-server decides speculation per process, not per request, so the fallback is
    per tier: once the acceptance rate over at least `min_drafted` drafted tokens is below
    `threshold`, the tier's engine is restarted without speculation (see
    GenerationService), and `fell_back` stays set in every later report.
    """

    mode: str  # none | ngram | draft
    threshold: float = 0.7
    min_drafted: int = 64
    drafted: int = 0
    accepted: int = 0
    fell_back: bool = False

    @property
    def rate(self) -> float | None:
        return None if self.drafted == 0 else self.accepted / self.drafted

    def record(self, drafted: int, accepted: int) -> bool:
        """Adds one request's counts; True when the tier should fall back to plain decoding."""
        if self.mode == "none" or self.fell_back:
            return False
        self.drafted += drafted
        self.accepted += accepted
        rate = self.rate
        return self.drafted >= self.min_drafted and rate is not None and rate < self.threshold


@dataclass
class Tier:
    name: str
    model: str
    model_version: str
    engine: GenerationEngine
    scheduler: SlotScheduler
    speculation: Speculation
    context_window: int
    # Called (as a task) when speculation should be switched off for this tier.
    on_fall_back: Callable[[Tier], Awaitable[None]] | None = None


@dataclass
class GenerationRequest:
    tenant: str
    tier: str
    max_tokens: int
    prompt: str | None = None
    chat: list[dict[str, str]] | None = None
    sampling: dict = field(default_factory=dict)


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    first: bool


@dataclass
class Summary:
    finish_reason: str  # stop | length | deadline
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_wait_s: float
    prefill_s: float
    decode_s: float
    first_token_at: float | None
    model: str
    model_version: str
    tier: str
    speculation_mode: str
    drafted: int
    accepted: int
    fell_back: bool


class Generator:
    def __init__(self, tiers: dict[str, Tier]) -> None:
        self.tiers = tiers
        self._background: set[asyncio.Future] = set()

    def tier(self, name: str) -> Tier:
        try:
            return self.tiers[name]
        except KeyError:
            raise InvalidArgument(
                "tier", f"tier {name!r} is not served here; available: {', '.join(self.tiers)}"
            ) from None

    async def render(self, request: GenerationRequest) -> tuple[Tier, str, int]:
        tier = self.tier(request.tier)
        if request.chat is not None:
            prompt = await tier.engine.render_chat(request.chat)
        else:
            prompt = request.prompt or ""
        if not prompt.strip():
            field_name = "chat" if request.chat is not None else "prompt"
            raise InvalidArgument(field_name, "is empty; give the model something to continue")
        tokens = await tier.engine.count_tokens(prompt)
        return tier, prompt, tokens

    async def count_tokens(self, request: GenerationRequest) -> tuple[int, int, str]:
        tier, _, tokens = await self.render(request)
        return tokens, tier.context_window, tier.model

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk | Summary]:
        tier, prompt, prompt_tokens = await self.render(request)
        input_field = "chat" if request.chat is not None else "prompt"
        if prompt_tokens >= tier.context_window:
            raise InvalidArgument(
                input_field,
                f"is {prompt_tokens} tokens; model {tier.model} has a {tier.context_window}-token "
                "context window",
            )
        if prompt_tokens + request.max_tokens > tier.context_window:
            raise InvalidArgument(
                "max_tokens",
                f"is {request.max_tokens}, but the prompt takes {prompt_tokens} of the "
                f"{tier.context_window}-token context; at most "
                f"{tier.context_window - prompt_tokens} fit",
            )
        speculate = tier.speculation.mode != "none" and not tier.speculation.fell_back
        deadline = deadlines.current_deadline()
        lease = await tier.scheduler.acquire(request.tenant, deadline)
        started = time.monotonic()
        text_parts: list[str] = []
        first_token_at = None
        final: StreamEvent | None = None
        stream = tier.engine.stream(
            prompt,
            slot=lease.slot.index,
            max_tokens=request.max_tokens,
            sampling=request.sampling,
        )
        try:
            stop_at = None if deadline is None else deadline - DEADLINE_MARGIN_S
            finish = "stop"
            while True:
                # The deadline guards each read from the engine, never a `yield` (a cancel
                # scope open across a yield would fire in the caller's code).
                try:
                    async with asyncio.timeout_at(stop_at):
                        event = await anext(stream)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    finish = "deadline"
                    break
                if event.final:
                    final = event
                    finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(
                        event.stop_type, "stop"
                    )
                if event.text or event.token_ids:
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                    text_parts.append(event.text)
                    yield Chunk(event.text, event.token_ids, first=len(text_parts) == 1)
        finally:
            # Closing the engine stream stops decoding now (deadline, cancel or done).
            with contextlib.suppress(Exception):
                await stream.aclose()
            tier.scheduler.release(lease.slot)
        completion_tokens = final.completion_tokens if final else len(text_parts)
        drafted, accepted = (final.drafted, final.accepted) if final else (0, 0)
        if tier.speculation.record(drafted, accepted) and tier.on_fall_back is not None:
            tier.speculation.fell_back = True
            task = asyncio.ensure_future(tier.on_fall_back(tier))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        decode_end = time.monotonic()
        yield Summary(
            finish_reason=finish,
            text="".join(text_parts),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=final.cached_tokens if final else 0,
            queue_wait_s=lease.waited_s,
            # Engine timings when it reports them, else measured here.
            prefill_s=(final.prompt_ms / 1000)
            if final and final.prompt_ms
            else ((first_token_at or decode_end) - started),
            decode_s=(final.decode_ms / 1000)
            if final and final.decode_ms
            else (decode_end - (first_token_at or decode_end)),
            first_token_at=first_token_at,
            model=tier.model,
            model_version=tier.model_version,
            tier=tier.name,
            speculation_mode=tier.speculation.mode if speculate else "none",
            drafted=drafted,
            accepted=accepted,
            fell_back=tier.speculation.fell_back,
        )
