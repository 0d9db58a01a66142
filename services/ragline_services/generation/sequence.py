"""One sequence's run through the engine, apart from admitting it and reporting it
(generator.py): in stretches between the pauses a light tenant's request makes
(pausing.py), its prompt read in yielding steps while that policy says so, and what its
streams gave, as they arrive."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ragline import deadlines
from ragline.vocabulary import FinishReason
from ragline_services.generation.engine import SlotStateEngine, StreamEvent, TokenLogprob
from ragline_services.generation.leases import Lease

if TYPE_CHECKING:
    from ragline_services.generation.generator import GenerationRequest, Rendered


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    first: bool


def common_prefix(a: tuple[int, ...] | list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


_FINISH_OF_STOP = {
    "eos": FinishReason.STOP,
    "word": FinishReason.STOP,
    "limit": FinishReason.LENGTH,
}


def _joined(first: StreamEvent, later: StreamEvent) -> StreamEvent:
    """The final figures of one sequence run as two engine streams."""
    return replace(
        later,
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        completion_tokens=first.completion_tokens + later.completion_tokens,
        prompt_ms=first.prompt_ms + later.prompt_ms,
        decode_ms=first.decode_ms + later.decode_ms,
        drafted=first.drafted + later.drafted,
        accepted=first.accepted + later.accepted,
    )


@dataclass
class Decoded:
    """What one sequence's stream gave, as it arrives."""

    started: float
    parts: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    final: StreamEvent | None = None
    finish: FinishReason = FinishReason.STOP
    ended: float | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the sampling asks
    pauses: int = 0  # times the scheduler paused the sequence
    paused_s: float = 0.0
    paused_before_first_s: float = 0.0  # of paused_s, before the first token
    over: bool = False  # the engine ended it, or the deadline did
    streamed_s: float = 0.0  # inside the engine's streams, from each request to its end
    streamed: bool = False  # a stream was sent
    # Prompt read in yielding steps before its stream (pausing.py): tokens, seconds.
    yielded_tokens: int = 0
    yielded_s: float = 0.0
    turn_wait_s: float = 0.0  # waiting for another sequence's yielding step to end

    def cached_tokens(self) -> int:
        """Prompt tokens the engine's cache held: what the first stream found there, less
        what yielding steps read into it just before."""
        found = self.final.cached_tokens if self.final else 0
        return max(found - self.yielded_tokens, 0)

    def take(self, event: StreamEvent) -> Chunk | None:
        """The chunk to pass on for `event` (None: it carries no text)."""
        if event.final:
            # A sequence paused and resumed ran as several engine streams: its figures are
            # their sums (the prompt and its cache as the first one found them).
            self.final = event if self.final is None else _joined(self.final, event)
            self.finish = _FINISH_OF_STOP.get(event.stop_type, FinishReason.STOP)
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if not (event.text or event.token_ids):
            return None
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.parts.append(event.text)
        return Chunk(event.text, event.token_ids, first=len(self.parts) == 1)

    def completion_tokens(self) -> int:
        if self.pauses:  # a stream cut by a pause sent no figures: its tokens are counted
            return len(self.token_ids)
        return self.final.completion_tokens if self.final else len(self.parts)

    def prefill_s(self) -> float:
        """The engine's own timing when it reports one (its streams'), and the yielding
        steps before them (not their waits for a turn: engine_wait_s), else measured here."""
        if self.final and self.final.prompt_ms:
            return self.final.prompt_ms / 1000 + self.yielded_s
        # Measured here: less the pauses, which the report has as their own stage.
        first = self.first_token_at or self._ended()
        return max(first - self.started - self.paused_before_first_s, 0.0)

    def engine_wait_s(self) -> float:
        """Time in the engine's streams that its own prefill and decode figures leave out:
        waiting for the step it joins (each engine step runs to its end, whatever the
        other sequences put in it), and the stretches a pause cut (their figures never
        come), any time the reader of the stream kept it waiting, and a yielding prompt's
        waits for its turn. Only where the engine reports its figures."""
        if not (self.final and self.final.prompt_ms):
            return 0.0
        streamed_prefill_s = self.final.prompt_ms / 1000
        in_streams = max(self.streamed_s - streamed_prefill_s - self.decode_s(), 0.0)
        return in_streams + self.turn_wait_s

    def decode_s(self) -> float:
        if self.final and self.final.decode_ms:
            return self.final.decode_ms / 1000
        paused_after_first = self.paused_s - self.paused_before_first_s
        return max(self._ended() - (self.first_token_at or self._ended()) - paused_after_first, 0.0)

    def _ended(self) -> float:
        assert self.ended is not None, "timed once the stream is over"
        return self.ended


async def run(
    rendered: Rendered,
    request: GenerationRequest,
    lease: Lease,
    decoded: Decoded,
    stop_at: float | None,
) -> AsyncGenerator[Chunk, None]:
    """The sequence's text as it comes, run in stretches: paused while a light tenant's
    request runs (the slot keeps its KV cache), resumed where it stopped, until the engine
    ends it, its token limit, or `stop_at`. What it gave is kept in `decoded`."""
    # One timer for the whole sequence: it interrupts a read from the engine, never
    # the caller's code at a `yield`; the scheduler's pause interrupts one too.
    with deadlines.StreamDeadline(stop_at) as timer:
        lease.interrupt = timer.interrupt
        # One engine stream per stretch the sequence runs unpaused.
        while not decoded.over:
            paused_at = time.monotonic() if lease.paused else None
            resumed = await rendered.tier.scheduler.pausing.wait_resumed(lease, stop_at)
            if paused_at is not None:
                paused = time.monotonic() - paused_at
                decoded.paused_s += paused
                if decoded.first_token_at is None:
                    decoded.paused_before_first_s += paused
            if not resumed:
                decoded.finish = FinishReason.DEADLINE
                break
            left = request.max_tokens - len(decoded.token_ids)
            if decoded.token_ids and left <= 0:
                decoded.finish = FinishReason.LENGTH
                break
            if not decoded.streamed and not await read_prompt_yielding(
                rendered, lease, decoded, stop_at
            ):
                continue  # paused (or out of time) before the prompt was read
            if not lease.paused:
                # A pause that came during a yielding step was obeyed there (no
                # step issued until resumed); it must not cut the stream below.
                timer.withdraw_interrupt()
            stretch_started = time.monotonic()
            decoded.streamed = True
            stream = rendered.tier.engine.stream(
                rendered.prompt,
                slot=lease.slot.index,
                max_tokens=left,
                sampling=request.sampling,
                prompt_ids=(
                    None
                    if rendered.token_ids is None
                    else [*rendered.token_ids, *decoded.token_ids]
                ),
            )
            try:
                while True:
                    try:
                        event = await timer.read(stream)
                    except StopAsyncIteration:
                        decoded.over = True
                        break
                    except TimeoutError:
                        decoded.finish, decoded.over = FinishReason.DEADLINE, True
                        break
                    except deadlines.StreamInterrupted:
                        decoded.pauses += 1
                        break  # paused: its slot keeps the KV cache
                    chunk = decoded.take(event)
                    if chunk is not None:
                        if not lease.decoding:
                            rendered.tier.scheduler.pausing.started_decoding(lease)
                        yield chunk
            finally:
                # Closing the engine stream stops decoding now (deadline, cancel,
                # pause or done).
                with contextlib.suppress(Exception):
                    await stream.aclose()
                decoded.streamed_s += time.monotonic() - stretch_started


async def read_prompt_yielding(
    rendered: Rendered, lease: Lease, decoded: Decoded, stop_at: float | None
) -> bool:
    """Reads the prompt in yielding steps while the pause policy says so (pausing.py),
    all but its last step: the stream reads that and the logits come from it. False
    when the sequence was paused, or ran out of time (then it is over), first."""
    pausing, engine, ids = rendered.tier.scheduler.pausing, rendered.tier.engine, rendered.token_ids
    if ids is None or not isinstance(engine, SlotStateEngine):
        return True
    step, slot, counted = pausing.yield_step_tokens, lease.slot, False
    while pausing.yielding(lease):
        read = common_prefix(slot.tokens, ids)
        if len(ids) - read <= step:
            break
        if lease.paused:
            return False
        if not counted:
            pausing.yielding_prompts += 1
            counted = True
        began, turned = time.monotonic(), None
        try:
            async with asyncio.timeout_at(stop_at):
                async with pausing.prompt_turn:
                    turned = time.monotonic()
                    if lease.paused:
                        return False
                    await engine.prefill(slot.index, ids[: read + step])
        except TimeoutError:
            decoded.finish, decoded.over = FinishReason.DEADLINE, True
            return False
        finally:
            # Waiting for another sequence's step is the engine's queue, not this
            # prompt's prefill.
            ended = time.monotonic()
            decoded.turn_wait_s += (turned or ended) - began
            if turned is not None:
                decoded.yielded_s += ended - turned
        slot.tokens = tuple(ids[: read + step])
        decoded.yielded_tokens += step
    return True
