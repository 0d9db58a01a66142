"""Light tenants first, on a real llama-server: a tenant's single request beside a flood gets
the engine to itself (the flood's sequences pause), and every paused sequence resumes where
it stopped, to the same text it gives unpaused."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from ragline.processes import free_ports
from ragline.v1 import generation_pb2, generation_pb2_grpc
from support import SMALL_GENERATION
from support.metrics import sample_values, scrape

pytestmark = pytest.mark.integration

# Greedy and long: the model counts on for every token it is given.
COUNTING = "Count from 1 to 300, separated by commas: 1, 2, 3, 4,"
TOKENS = 160


@pytest.fixture(scope="module")
def two_slots_and_a_priority_one(module_launcher):
    (metrics_port,) = free_ports(1)
    handle = module_launcher.start(
        "generation",
        env={
            **SMALL_GENERATION,
            "RAGLINE_GENERATION_MAX_NUM_SEQS": "2",
            "RAGLINE_GENERATION_PRIORITY_SLOTS": "1",
            "RAGLINE_GENERATION_MAX_QUEUE": "8",
            "RAGLINE_GENERATION_METRICS_PORT": str(metrics_port),
        },
    )
    return handle, metrics_port


async def generate(stub, who: str, started: asyncio.Event | None = None):
    """(the text, when the last message came) of one counting generation as tenant `who`;
    `started` is set at its first token."""
    request = generation_pb2.GenerateRequest(
        prompt=COUNTING, max_tokens=TOKENS, speculation=generation_pb2.SPECULATION_OFF
    )
    messages = []
    async for message in stub.Generate(request, timeout=120, metadata=(("x-ragline-tenant", who),)):
        messages.append(message)
        if started is not None:
            started.set()
    final = messages[-1].final
    assert final.text == "".join(m.text for m in messages[:-1])
    paused = {s.name for s in final.timing.stages} & {"paused"}
    return final.text, final.usage.output_tokens, time.monotonic(), paused


def small_tier_count(metrics_port: int, counter: str) -> float:
    """The small tier's value of `counter` (a ragline_generation_* counter)."""
    counted = sample_values(scrape(metrics_port), f"ragline_generation_{counter}", "_total")
    assert ("small",) in counted, f"the {counter} counter is not exported"
    return counted[("small",)]


def pauses(metrics_port: int) -> float:
    return small_tier_count(metrics_port, "pauses")


async def test_a_light_tenant_runs_alone_beside_a_flood_which_resumes_unchanged(
    two_slots_and_a_priority_one,
):
    handle, metrics_port = two_slots_and_a_priority_one
    async with grpc.aio.insecure_channel(handle.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        # The flood alone: what its two sequences say decoding side by side.
        alone = await asyncio.gather(generate(stub, "flood"), generate(stub, "flood"))
        assert all(tokens == TOKENS for _, tokens, _, _ in alone), "the count stopped early"
        before = pauses(metrics_port)

        started = [asyncio.Event(), asyncio.Event()]
        flood = [asyncio.create_task(generate(stub, "flood", s)) for s in started]
        for event in started:
            await asyncio.wait_for(event.wait(), 60)
        # Both flood sequences decode; the same long request from a quiet tenant.
        quiet_text, quiet_tokens, _, _ = await generate(stub, "quiet")
        flooded = await asyncio.gather(*flood)

    assert pauses(metrics_port) - before >= 2, "the flood's sequences were not paused"
    # Which ends first is not asserted: once the quiet request's first token is out, the
    # flood's decoding sequences run beside it (pausing.py), a few tokens ahead of it, so
    # the order of the ends is a race of a few tokens (lost under a loaded machine).
    # The time they waited is in their reports, a stage of its own.
    assert all(paused == {"paused"} for *_, paused in flooded)
    assert not any(paused for *_, paused in alone)
    assert quiet_tokens == TOKENS and quiet_text == alone[0][0]
    # Paused mid-count and resumed from their slots' caches: not a token lost or repeated.
    assert [(text, tokens) for text, tokens, *_ in flooded] == [
        (text, tokens) for text, tokens, *_ in alone
    ]


async def test_count_tokens_says_whether_the_tier_serves_light_tenants_first(
    two_slots_and_a_priority_one, module_launcher
):
    """The orchestrator sends a generation again, marked light, only to a tier that serves
    light tenants first: CountTokens says which do."""
    handle, _ = two_slots_and_a_priority_one
    without = await asyncio.to_thread(
        module_launcher.start,
        "generation",
        env={
            **SMALL_GENERATION,
            "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
            "RAGLINE_GENERATION_PRIORITY_SLOTS": "0",
        },
    )
    request = generation_pb2.CountTokensRequest(prompt="Hello world")
    served = {}
    for name, service in (("priority", handle), ("none", without)):
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            reply = await stub.CountTokens(
                request, timeout=10, metadata=(("x-ragline-tenant", "acme"),)
            )
        served[name] = reply.light_first
    assert served == {"priority": True, "none": False}


# Long enough for several yielding steps (64 tokens each), and greedy to a known end.
LONG_COUNT = "Continue the list: " + ", ".join(str(n) for n in range(1, 121)) + ","


async def long_count(stub, who: str):
    """(the text, cached prompt tokens, stage names) of the long count as tenant `who`."""
    request = generation_pb2.GenerateRequest(
        prompt=LONG_COUNT, max_tokens=24, speculation=generation_pb2.SPECULATION_OFF
    )
    messages = [
        m async for m in stub.Generate(request, timeout=120, metadata=(("x-ragline-tenant", who),))
    ]
    final = messages[-1].final
    return final.text, final.usage.cached_input_tokens, {s.name for s in final.timing.stages}


def yielding_prompts(metrics_port: int) -> float:
    return small_tier_count(metrics_port, "yielding_prompts")


async def test_beside_a_light_tenant_a_prompt_read_in_yielding_steps_gives_the_same_answer(
    module_launcher,
):
    """A tenant a light request held back reads its next prompt in small engine steps
    before its stream (the light tenant's next request waits for one small step): on the
    real engine the answer is the one the prompt read whole gives, and no token of it is
    reported as a cache hit."""
    (metrics_port,) = free_ports(1)
    handle = await asyncio.to_thread(
        module_launcher.start,
        "generation",
        env={
            **SMALL_GENERATION,
            "RAGLINE_GENERATION_PRIORITY_SLOTS": "1",
            "RAGLINE_GENERATION_METRICS_PORT": str(metrics_port),
        },
    )
    async with grpc.aio.insecure_channel(handle.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        whole = await long_count(stub, "long-a")  # nobody light yet: read whole
        # long-b counts; a light request comes, and holds it back.
        started = asyncio.Event()
        counting = asyncio.create_task(generate(stub, "long-b", started))
        await asyncio.wait_for(started.wait(), 60)
        light = generation_pb2.GenerateRequest(prompt="Hi", max_tokens=2, light_tenant=True)
        async for _ in stub.Generate(light, timeout=60, metadata=(("x-ragline-tenant", "q"),)):
            pass
        await counting
        assert yielding_prompts(metrics_port) == 0
        stepped = await long_count(stub, "long-b")
        assert yielding_prompts(metrics_port) == 1, "its prompt was read whole"
        alone = await long_count(stub, "long-c")  # never held back: read whole
        assert yielding_prompts(metrics_port) == 1
    assert stepped[0] and stepped[0] == whole[0] == alone[0]
    assert whole[1] == 0  # a cold slot
    assert stepped[1] < 64  # what the steps read is not a cache hit
    assert "prefill" in stepped[2]
