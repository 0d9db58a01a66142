"""Saving a hot prefix after the answer (generator + scheduler, engine faked): the answer is
out before the save; the slot stays the request's until the save is done (no other owner's
prompt gets into it); a light request's held-back sequences run again meanwhile; the save
is the service's own work, bounded by no request's deadline."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_generator_stream import SlotStateContinuingEngine, generated, generator_on

from ragline import deadlines
from ragline.cache import MemoryCache
from ragline.errors import DeadlineExceeded
from ragline.vocabulary import ModelTier
from ragline_services.generation.generator import GenerationRequest, Generator
from ragline_services.generation.prefix_store import PrefixStore, StoreSettings
from ragline_services.generation.scheduler import SlotScheduler

PROMPT = "x" * 40


class SavingEngine(SlotStateContinuingEngine):
    """Saves a slot's state as a file in the store's folder once `may_save` is set;
    records the order of its calls and the deadline each save ran under."""

    def __init__(self, words: list[str], directory: Path) -> None:
        super().__init__(words)
        self.directory = directory
        self.calls: list[str] = []
        self.may_save = asyncio.Event()
        self.save_deadlines: list[float | None] = []
        self.held: dict[int, int] = {}  # slot -> tokens its cache holds
        self.fails: Exception | None = None

    async def prefill(self, slot: int, tokens: list[int]) -> None:
        self.calls.append(f"prefill {len(tokens)}")
        self.held[slot] = len(tokens)
        await super().prefill(slot, tokens)

    async def stream(self, prompt, *, slot, max_tokens, sampling, prompt_ids=None):
        self.calls.append("stream")
        async for event in super().stream(
            prompt, slot=slot, max_tokens=max_tokens, sampling=sampling, prompt_ids=prompt_ids
        ):
            yield event
        self.calls.append("stream end")
        self.held[slot] = len(prompt_ids) + len(self.words)

    async def save_slot(self, slot: int, filename: str) -> int:
        await self.may_save.wait()
        if self.fails is not None:
            raise self.fails
        self.calls.append("save")
        self.save_deadlines.append(deadlines.current_deadline())
        (self.directory / filename).write_bytes(b"kv" * 100)
        return self.held[slot]


def saving_generator(
    tmp_path: Path, slots: int = 1, **scheduling
) -> tuple[Generator, SavingEngine]:
    settings = StoreSettings(tmp_path / "kv", hot_after=1, min_tokens=8)
    engine = SavingEngine([" w0", " w1"], settings.directory)
    generator = generator_on(engine)
    tier = generator.tier(ModelTier.SMALL)
    tier.prefix_store = PrefixStore(MemoryCache(), settings, "scripted@v1")
    tier.scheduler = SlotScheduler(slots, 4, engine.erase_slot, **scheduling)
    return generator, engine


async def stored_tokens(generator: Generator, owner: str) -> int | None:
    store = generator.tier(ModelTier.SMALL).prefix_store
    [candidate] = store.candidates(owner, [ord(c) for c in PROMPT], [len(PROMPT)])
    await store.look_up(owner, [candidate])
    return candidate.stored.tokens if candidate.stored else None


async def test_the_answer_is_out_before_its_prefix_is_saved_from_the_slot_it_keeps(tmp_path):
    generator, engine = saving_generator(tmp_path)
    scheduler = generator.tier(ModelTier.SMALL).scheduler
    async with asyncio.timeout(5):
        text, summary = await generated(generator, "ann", PROMPT)
    assert text == " w0 w1" and summary.store.saved_tokens == len(PROMPT)
    bob = asyncio.create_task(scheduler.acquire("bob", None))
    await asyncio.sleep(0.05)
    # The save waits; the answer did not, and the slot is still ann's (cut back to the
    # prompt, after the answer's stream, with nothing prefilled again).
    assert engine.calls == ["stream", "stream end", f"prefill {len(PROMPT)}"]
    assert scheduler.busy == 1
    assert not bob.done()  # another owner waits: the slot holds ann's prompt

    engine.may_save.set()
    await generator.finish_saves()
    assert await stored_tokens(generator, "ann|") == len(PROMPT)
    lease = await asyncio.wait_for(bob, 1)
    assert lease.erased  # handed over only after the save, erased first
    assert generator.tier(ModelTier.SMALL).prefix_store.counters.save_s > 0


async def test_a_save_runs_under_no_deadline_of_the_request_that_made_it(tmp_path):
    generator, engine = saving_generator(tmp_path)
    with deadlines.deadline_scope(0.5):
        await generated(generator, "ann", PROMPT)
    await asyncio.sleep(0.6)  # the request's deadline has passed
    engine.may_save.set()
    await generator.finish_saves()
    assert engine.save_deadlines == [None]
    assert await stored_tokens(generator, "ann|") == len(PROMPT)


async def test_a_light_requests_held_back_sequences_run_again_while_its_prefix_is_saved(
    tmp_path,
):
    generator, engine = saving_generator(tmp_path, slots=2, priority_slots=1)
    scheduler = generator.tier(ModelTier.SMALL).scheduler
    flood = await scheduler.acquire("carl", None, pausable=True)
    light = asyncio.create_task(
        generated_light(generator, "bob", PROMPT)  # pauses carl's sequence
    )
    async with asyncio.timeout(5):
        await light
    assert flood.paused is False  # bob's answer is out: carl runs again, save or not
    assert "save" not in engine.calls
    engine.may_save.set()
    await generator.finish_saves()
    assert await stored_tokens(generator, "bob|") == len(PROMPT)
    scheduler.release(flood.slot)


async def generated_light(generator: Generator, tenant: str, prompt: str) -> None:
    request = GenerationRequest(
        tenant=tenant, tier=ModelTier.SMALL, max_tokens=8, prompt=prompt, light_tenant=True
    )
    async for _ in generator.generate(request):
        pass


async def test_a_stopping_service_cancels_a_save_that_does_not_end(tmp_path):
    generator, engine = saving_generator(tmp_path)
    await generated(generator, "ann", PROMPT)
    async with asyncio.timeout(2):
        await generator.finish_saves(timeout_s=0.1)  # may_save never set
    assert engine.calls[-1] == f"prefill {len(PROMPT)}"
    assert generator.tier(ModelTier.SMALL).scheduler.busy == 0  # the slot is given back
    assert await stored_tokens(generator, "ann|") is None


async def test_a_request_a_light_one_held_back_starts_when_its_answer_is_out_not_its_save(
    tmp_path,
):
    generator, engine = saving_generator(tmp_path, slots=3, priority_slots=1)
    engine.step_s = 0.1
    scheduler = generator.tier(ModelTier.SMALL).scheduler
    flood = await scheduler.acquire("carl", None, pausable=True)
    light = asyncio.create_task(generated_light(generator, "bob", PROMPT))
    await asyncio.sleep(0.05)  # bob's request runs
    more = asyncio.create_task(scheduler.acquire("carl", None, pausable=True))
    await asyncio.sleep(0.05)
    assert not more.done()  # held back while bob's request runs, a slot free or not
    async with asyncio.timeout(5):
        await light
    await asyncio.sleep(0.05)
    assert more.done() and "save" not in engine.calls  # bob's answer out: carl starts
    engine.may_save.set()
    await generator.finish_saves()
    for lease in (flood, more.result()):
        scheduler.release(lease.slot)


async def test_a_save_the_engine_fails_gives_the_slot_back_as_unknown_and_stores_nothing(
    tmp_path,
):
    generator, engine = saving_generator(tmp_path)
    engine.fails = DeadlineExceeded("llama-server /slots/0?action=save: the deadline passed")
    engine.may_save.set()
    await generated(generator, "ann", PROMPT)
    [save] = generator._saves
    await generator.finish_saves()
    assert save.exception() is None  # its failure handled (logged), not raised
    scheduler = generator.tier(ModelTier.SMALL).scheduler
    assert scheduler.busy == 0 and scheduler.slots[0].tokens == ()
    assert await stored_tokens(generator, "ann|") is None
