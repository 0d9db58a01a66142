"""The generator's side of a stream: the prompt is tokenized once and those ids are what the
engine runs; several tokens of one engine event are one chunk; the deadline ends a stream
that stalls, with finish reason deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

from ragline import deadlines
from ragline.vocabulary import ModelTier
from ragline_services.generation.engine import StreamEvent
from ragline_services.generation.generator import (
    Chunk,
    GenerationRequest,
    Generator,
    Speculation,
    Summary,
    Tier,
)
from ragline_services.generation.scheduler import SlotScheduler


class ScriptedEngine:
    """Counts tokenize calls and records what each stream was asked to run."""

    context_window = 2048

    def __init__(self, events: list[StreamEvent], stall_s: float = 0.0) -> None:
        self.events = events
        self.stall_s = stall_s
        self.tokenized: list[str] = []
        self.streams: list[dict] = []

    async def render_chat(self, messages: list[dict[str, str]]) -> str:
        raise AssertionError("these tests send prompts, not chats")

    async def tokenize(self, text: str, **_options) -> list[int]:
        self.tokenized.append(text)
        return [ord(c) for c in text]

    async def count_tokens(self, text: str) -> int:
        raise AssertionError("an engine that tokenizes is never asked only to count")

    async def erase_slot(self, slot: int) -> None:
        pass

    async def stream(self, prompt, *, slot, max_tokens, sampling, prompt_ids=None):
        self.streams.append({"prompt": prompt, "prompt_ids": prompt_ids})
        for event in self.events:
            yield event
        await asyncio.sleep(self.stall_s)
        yield StreamEvent(final=True, stop_type="eos", completion_tokens=3)


def generator_on(engine: ScriptedEngine) -> Generator:
    tier = Tier(
        name=ModelTier.SMALL,
        model="scripted",
        model_version="v1",
        engine=engine,
        scheduler=SlotScheduler(1, 4, engine.erase_slot),
        speculation=Speculation("none"),
        context_window=engine.context_window,
    )
    return Generator({ModelTier.SMALL: tier})


async def collect(generator: Generator, prompt: str) -> tuple[list[Chunk], Summary]:
    request = GenerationRequest(tenant="ann", tier=ModelTier.SMALL, max_tokens=8, prompt=prompt)
    chunks, summary = [], None
    async for event in generator.generate(request):
        if isinstance(event, Chunk):
            chunks.append(event)
        else:
            summary = event
    assert summary is not None
    return chunks, summary


async def test_the_prompt_is_tokenized_once_and_run_as_those_ids():
    engine = ScriptedEngine([StreamEvent(text="Paris is", token_ids=[7, 8])])
    chunks, summary = await collect(generator_on(engine), "Where?")
    assert engine.tokenized == ["Where?"]
    assert engine.streams == [{"prompt": "Where?", "prompt_ids": [ord(c) for c in "Where?"]}]
    assert summary.prompt_tokens == len("Where?")
    # two tokens of one engine event stay one chunk (one gRPC message)
    assert [(c.text, c.token_ids, c.first) for c in chunks] == [("Paris is", [7, 8], True)]
    assert summary.finish_reason == "stop"


async def test_a_stalled_stream_ends_at_the_deadline_with_what_it_had():
    engine = ScriptedEngine([StreamEvent(text="Par", token_ids=[7])], stall_s=30.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with deadlines.deadline_scope(0.3):
        chunks, summary = await collect(generator_on(engine), "Where?")
    assert loop.time() - started < 2.0
    assert summary.finish_reason == "deadline"
    assert summary.text == "Par" and len(chunks) == 1


class ContinuingEngine(ScriptedEngine):
    """Decodes `words` one per `step_s`, each stream going on from the tokens its prompt
    already ends with (as llama-server does from its slot's cache)."""

    def __init__(self, words: list[str], step_s: float = 0.02) -> None:
        super().__init__([])
        self.words = words
        self.step_s = step_s
        self.prompt_length = 0

    async def stream(self, prompt, *, slot, max_tokens, sampling, prompt_ids=None):
        self.streams.append({"prompt_ids": prompt_ids, "max_tokens": max_tokens})
        self.prompt_length = self.prompt_length or len(prompt_ids)
        done = len(prompt_ids) - self.prompt_length
        assert prompt_ids[self.prompt_length :] == [1000 + i for i in range(done)]
        emitted = 0
        for index in range(done, min(done + max_tokens, len(self.words))):
            await asyncio.sleep(self.step_s)
            emitted += 1
            yield StreamEvent(text=self.words[index], token_ids=[1000 + index])
        yield StreamEvent(final=True, stop_type="eos", completion_tokens=emitted)


async def test_a_paused_sequence_resumes_where_it_stopped_with_every_token_once():
    engine = ContinuingEngine([f" w{i}" for i in range(6)])
    generator = generator_on(engine)
    scheduler = SlotScheduler(2, 4, engine.erase_slot, priority_slots=1)
    generator.tier(ModelTier.SMALL).scheduler = scheduler
    request = GenerationRequest(tenant="ann", tier=ModelTier.SMALL, max_tokens=8, prompt="Hi")
    texts, summary = [], None
    other = None
    began = time.monotonic()
    async for event in generator.generate(request):
        if isinstance(event, Chunk):
            texts.append(event.text)
            if len(texts) == 2:
                # Ann floods (a second request of hers runs); a quiet tenant asks.
                other = await scheduler.acquire("ann", None, pausable=True)
                quiet = await scheduler.acquire("bob", None)
                assert quiet.priority
                asyncio.get_running_loop().call_later(0.1, scheduler.release, quiet.slot)
        else:
            summary = event
    assert other is not None and scheduler.pausing.pauses >= 1
    assert "".join(texts) == "".join(engine.words)  # nothing lost, nothing twice
    assert len(engine.streams) == 2
    resumed = engine.streams[1]
    assert resumed["prompt_ids"] == [ord("H"), ord("i"), 1000, 1001]
    assert resumed["max_tokens"] == 6
    assert summary.completion_tokens == 6 and summary.finish_reason == "stop"
    assert 0.05 < summary.paused_s < 5  # the time paused is reported apart
    # ... and only there: the stages add up to no more than the time it took
    elapsed = time.monotonic() - began
    assert summary.prefill_s + summary.decode_s + summary.paused_s <= elapsed + 0.005


async def test_a_sequence_decoding_near_its_deadline_is_not_paused_for_a_light_request():
    engine = ContinuingEngine([f" w{i}" for i in range(6)], step_s=0.05)
    generator = generator_on(engine)
    scheduler = SlotScheduler(2, 4, engine.erase_slot, priority_slots=1)
    generator.tier(ModelTier.SMALL).scheduler = scheduler
    for _ in range(4):
        scheduler.pausing.note_decode(2.0)  # decodes take about 2 s; this one has less left
    request = GenerationRequest(tenant="ann", tier=ModelTier.SMALL, max_tokens=8, prompt="Hi")
    texts, summary = [], None
    with deadlines.deadline_scope(1.5):
        async for event in generator.generate(request):
            if isinstance(event, Chunk):
                texts.append(event.text)
                if len(texts) == 2:
                    quiet = await scheduler.acquire("bob", None, light=True)
                    asyncio.get_running_loop().call_later(0.1, scheduler.release, quiet.slot)
            else:
                summary = event
    assert scheduler.pausing.pauses == 0 and scheduler.pausing.kept_for_deadline == 1
    assert len(engine.streams) == 1 and "".join(texts) == "".join(engine.words)
    assert summary.finish_reason == "stop" and summary.paused_s == 0


async def test_a_paused_decoding_sequence_runs_again_once_the_light_request_decodes():
    engine = ContinuingEngine([f" w{i}" for i in range(6)], step_s=0.05)
    generator = generator_on(engine)
    scheduler = SlotScheduler(2, 4, engine.erase_slot, priority_slots=1)
    generator.tier(ModelTier.SMALL).scheduler = scheduler
    flood = GenerationRequest(tenant="ann", tier=ModelTier.SMALL, max_tokens=8, prompt="Hi")
    light = GenerationRequest(
        tenant="bob", tier=ModelTier.SMALL, max_tokens=2, prompt="Hi", light_tenant=True
    )
    texts, summary = [], None
    async for event in generator.generate(flood):
        if isinstance(event, Chunk):
            texts.append(event.text)
            if len(texts) == 2:
                # A light request comes: the flood pauses; once the light one's first token
                # is out (its prompt read), the flood decodes beside it.
                async with contextlib.aclosing(generator.generate(light)) as events:
                    async for _ in events:
                        break
        else:
            summary = event
    assert scheduler.pausing.pauses == 1 and scheduler.pausing.decoding_beside == 1
    assert "".join(texts) == "".join(engine.words)
    assert summary.finish_reason == "stop"


class SlotStateContinuingEngine(ContinuingEngine):
    """A ContinuingEngine whose slots can be read into ahead of a stream (`prefill`), each
    call taking `prefill_s`; records each call's end token and how many ran at once."""

    def __init__(self, words: list[str], prefill_s: float = 0.0) -> None:
        super().__init__(words)
        self.prefill_s = prefill_s
        self.prefilled: list[tuple[int, int, float]] = []  # (slot, end, when it began)
        self.in_flight = self.most_in_flight = 0
        self.on_prefill: Callable[[int], None] | None = None

    async def prefill(self, slot: int, tokens: list[int]) -> None:
        self.prefilled.append((slot, len(tokens), time.monotonic()))
        if self.on_prefill is not None:
            self.on_prefill(len(self.prefilled))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.prefill_s)
        finally:
            self.in_flight -= 1

    async def stream(self, prompt, *, slot, max_tokens, sampling, prompt_ids=None):
        # Its cache held what the steps before it read (llama-server reports it as cached).
        read = max((end for s, end, _ in self.prefilled if s == slot), default=0)
        async for event in super().stream(
            prompt, slot=slot, max_tokens=max_tokens, sampling=sampling, prompt_ids=prompt_ids
        ):
            yield replace(event, cached_tokens=read) if event.final else event

    async def save_slot(self, slot: int, filename: str) -> int:
        raise AssertionError("no prefix store here")

    async def restore_slot(self, slot: int, filename: str) -> int:
        raise AssertionError("no prefix store here")


def yielding_tier(engine: SlotStateContinuingEngine) -> tuple[Generator, SlotScheduler]:
    generator = generator_on(engine)
    scheduler = SlotScheduler(2, 4, engine.erase_slot, priority_slots=1, yield_step_tokens=64)
    generator.tier(ModelTier.SMALL).scheduler = scheduler
    return generator, scheduler


async def held_back_for_a_light_tenant(scheduler: SlotScheduler, *tenants: str) -> None:
    """A light request of bob's has just held back sequences of `tenants` (they flood
    beside a light tenant), and ended."""
    held = [await scheduler.acquire(tenant, None, pausable=True) for tenant in tenants]
    light = await scheduler.acquire("bob", None, light=True)
    for lease in [light, *held]:
        scheduler.release(lease.slot)


async def generated(generator: Generator, tenant: str, prompt: str) -> tuple[str, Summary]:
    request = GenerationRequest(tenant=tenant, tier=ModelTier.SMALL, max_tokens=8, prompt=prompt)
    texts, summary = [], None
    async for event in generator.generate(request):
        if isinstance(event, Chunk):
            texts.append(event.text)
        else:
            summary = event
    assert summary is not None
    return "".join(texts), summary


async def test_beside_a_light_tenant_a_prompt_is_read_in_yielding_steps_before_its_stream():
    engine = SlotStateContinuingEngine([" w0", " w1"])
    generator, scheduler = yielding_tier(engine)
    await held_back_for_a_light_tenant(scheduler, "ann")
    text, summary = await generated(generator, "ann", "x" * 300)
    # 64 tokens a step, all but the last step's worth: the stream reads that (its logits).
    assert [end for _, end, _ in engine.prefilled] == [64, 128, 192, 256]
    assert engine.streams[0]["prompt_ids"] == [ord("x")] * 300
    assert text == " w0 w1" and scheduler.pausing.yielding_prompts == 1
    assert summary.cached_tokens == 0  # what the steps read is not a cache hit


async def test_a_tenant_no_light_request_held_back_reads_its_prompt_whole():
    engine = SlotStateContinuingEngine([" w0"])
    generator, scheduler = yielding_tier(engine)
    await generated(generator, "ann", "x" * 300)  # nobody light
    await held_back_for_a_light_tenant(scheduler, "ann")
    await generated(generator, "carl", "x" * 300)  # asking alone beside a light tenant
    assert engine.prefilled == [] and scheduler.pausing.yielding_prompts == 0


async def test_a_prompt_paused_between_yielding_steps_issues_none_until_resumed():
    engine = SlotStateContinuingEngine([" w0", " w1"], prefill_s=0.05)
    generator, scheduler = yielding_tier(engine)
    await held_back_for_a_light_tenant(scheduler, "ann")
    held: list[float] = []

    async def bob_asks_again() -> None:
        light = await scheduler.acquire("bob", None, light=True)
        held.append(time.monotonic())
        await asyncio.sleep(0.3)
        held.append(time.monotonic())
        scheduler.release(light.slot)

    asking: list[asyncio.Task] = []
    engine.on_prefill = lambda n: n == 2 and asking.append(asyncio.create_task(bob_asks_again()))
    opened = []
    stream = engine.stream

    def opening(*args, **kwargs):
        opened.append(kwargs["prompt_ids"])
        return stream(*args, **kwargs)

    engine.stream = opening
    began = time.monotonic()
    text, summary = await generated(generator, "ann", "x" * 300)
    elapsed = time.monotonic() - began
    await asyncio.gather(*asking)
    began = [when for _, _, when in engine.prefilled]
    assert not any(held[0] < when < held[1] for when in began), "a step issued while paused"
    assert [end for _, end, _ in engine.prefilled] == [64, 128, 192, 256]
    assert len(engine.streams) == 1 and text == " w0 w1"
    # The pause was obeyed between steps: no stream opened only to be cut by it at once.
    assert len(opened) == 1
    assert summary.paused_s > 0.2
    # the pause is its own stage, not part of the prompt's reading
    assert summary.prefill_s + summary.decode_s + summary.paused_s <= elapsed + 0.005


async def test_yielding_steps_of_several_sequences_go_to_the_engine_one_at_a_time():
    engine = SlotStateContinuingEngine([" w0"], prefill_s=0.02)
    generator, scheduler = yielding_tier(engine)
    await held_back_for_a_light_tenant(scheduler, "ann", "carl")

    async def one(tenant: str) -> None:
        await generated(generator, tenant, "y" * 200)

    await asyncio.gather(one("ann"), one("carl"))
    assert len(engine.prefilled) == 6 and {slot for slot, _, _ in engine.prefilled} == {1, 2}
    assert engine.most_in_flight == 1


class TimedSlotStateEngine(SlotStateContinuingEngine):
    """Reports its own prefill and decode times, as llama-server does (a stream's last
    event): the generator's timing then splits the rest into engine_wait."""

    async def stream(self, prompt, *, slot, max_tokens, sampling, prompt_ids=None):
        async for event in super().stream(
            prompt, slot=slot, max_tokens=max_tokens, sampling=sampling, prompt_ids=prompt_ids
        ):
            yield replace(event, prompt_ms=1.0, decode_ms=1.0) if event.final else event


async def test_a_yielding_prompts_wait_for_another_ones_step_is_engine_wait_not_prefill():
    engine = TimedSlotStateEngine([" w0"], prefill_s=0.1)
    generator, scheduler = yielding_tier(engine)
    await held_back_for_a_light_tenant(scheduler, "ann", "carl")
    (_, ann), (_, carl) = await asyncio.gather(
        generated(generator, "ann", "y" * 200), generated(generator, "carl", "y" * 200)
    )
    # Each read 3 steps of 0.1 s, one at a time over the engine: each waited for some of
    # the other's steps, which is the engine's queue, not its own prompt's reading.
    for summary in (ann, carl):
        assert 0.3 <= summary.prefill_s < 0.3 + 0.08, summary.prefill_s
    assert ann.engine_wait_s + carl.engine_wait_s >= 0.25
