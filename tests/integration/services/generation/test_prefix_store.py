"""The hot-prefix KV store on the real engine (llama-server, SmolLM2-135M): saved slot states
restored for their own tenant only, across a restart through a real Redis index (on the
engine found and on the prebuilt one); expired,
corrupt or evicted states never used; slots sized from memory."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from ragline.config import CommonConfig
from ragline.v1 import generation_pb2, generation_pb2_grpc
from support import SMALL_GENERATION

pytestmark = pytest.mark.integration

# ~200 tokens each: long enough to be worth storing (min_tokens 32 here), quick to prefill.
PASSAGE = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to "
    "Normandy, a region in France. They were descended from Norse raiders and pirates from "
    "Denmark, Iceland and Norway who, under their leader Rollo, agreed to swear fealty to "
    "King Charles III of West Francia. "
) * 3


def prompt(n: int) -> str:
    return f"Document {n}.\n{PASSAGE}\nQuestion {n}: who led the Normans?\nAnswer:"


async def final(address: str, text: str, tenant: str) -> generation_pb2.GenerateFinal:
    request = generation_pb2.GenerateRequest(prompt=text, max_tokens=1)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        messages = [
            m
            async for m in stub.Generate(
                request, timeout=60, metadata=(("x-ragline-tenant", tenant),)
            )
        ]
    return messages[-1].final


def store_env(directory: Path, **more: str) -> dict[str, str]:
    return {
        **SMALL_GENERATION,
        "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",  # every other tenant's request erases the slot
        "RAGLINE_GENERATION_KV_STORE_DIR": str(directory),
        "RAGLINE_GENERATION_KV_STORE_MIN_TOKENS": "32",
        **more,
    }


def state_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.bin"))


async def states_saved(directory: Path, count: int) -> list[Path]:
    """The state files once there are `count`: a hot prefix is saved after its answer."""
    deadline = time.monotonic() + 20
    files = state_files(directory)
    while len(files) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # files on disk: nothing to wait on but the clock
        files = state_files(directory)
    return files


async def engine_env(engine: str) -> dict[str, str]:
    """`found`: the llama-server the service finds (a build for this machine where there is
    one); `prebuilt`: the prebuilt engine for this CPU, which `make llama-server` installs."""
    if engine == "found":
        return {}
    from ragline_services.generation.llama_engine import (
        engine_serves,
        prebuilt_installable,
        prebuilt_llama_server,
    )

    binary = prebuilt_llama_server(CommonConfig().cache_dir)
    if binary is None:
        if prebuilt_installable():
            pytest.fail("the prebuilt llama-server is not installed: run `make llama-server`")
        pytest.skip("the prebuilt llama-server cannot be installed here (glibc < 2.35)")
    # As `make llama-server` decides: a prebuilt binary that cannot run a model on this CPU
    # (SIGILL in its kernels) is not the one the service runs here.
    failure = await engine_serves(binary, small_model_file())
    if failure:
        pytest.skip(f"the prebuilt llama-server does not run on this CPU: {failure[:120]}")
    return {"RAGLINE_GENERATION_LLAMA_SERVER": str(binary)}


def small_model_file() -> Path:
    from ragline.models.store import ModelStore
    from ragline_services.generation.service import GenerationConfig

    name = GenerationConfig.model_fields["small_model"].default
    return ModelStore(CommonConfig().model_dir).gguf_file(name)


@pytest.mark.parametrize("engine", ["found", "prebuilt"])
async def test_a_saved_prefix_is_restored_for_its_tenant_after_a_restart_never_for_another(
    launcher, redis_server, tmp_path, engine
):
    env = store_env(
        tmp_path / "kv", RAGLINE_GENERATION_CACHE_URL=redis_server.url, **(await engine_env(engine))
    )
    # Tenants of this run alone: the prefix index lives in the session's Redis, where the
    # other engine's run of this test left its own entries.
    ann, bob = f"ann-{engine}", f"bob-{engine}"
    service = await asyncio.to_thread(launcher.start, "generation", env=env)
    first = await final(service.address, prompt(1), ann)
    assert first.prefix_store.saved_tokens == 0  # seen once: not hot yet
    second = await final(service.address, prompt(1), ann)
    assert second.prefix_store.saved_tokens == second.usage.input_tokens  # hot: saved
    assert len(await states_saved(tmp_path / "kv", 1)) == 1
    stages = {s.name for s in second.timing.stages}
    assert "prefill" in stages and not {"kv_save", "kv_restore"} & stages  # after the answer

    # A restart: a new process and a new llama-server with empty slots; the index is in Redis.
    service.stop()
    launcher.forget(service)
    service = await asyncio.to_thread(launcher.start, "generation", env=env)

    other = await final(service.address, prompt(1), bob)  # same prompt, another tenant
    assert other.prefix_store.restored_tokens == 0
    assert other.usage.cached_input_tokens == 0
    restored = await final(service.address, prompt(1), ann)  # bob's slot erased first
    assert restored.prefix_store.restored_tokens == restored.usage.input_tokens
    assert restored.usage.cached_input_tokens >= restored.usage.input_tokens - 1
    stages = {s.name: s.duration.ToNanoseconds() for s in restored.timing.stages}
    assert "kv_restore" in stages
    # prefill skipped: one token evaluated instead of the whole prompt
    cold = {s.name: s.duration.ToNanoseconds() for s in other.timing.stages}
    assert stages["prefill"] < cold["prefill"]


async def test_expired_and_corrupt_states_are_not_used(launcher, tmp_path):
    kv = tmp_path / "kv"
    service = await asyncio.to_thread(
        launcher.start, "generation", env=store_env(kv, RAGLINE_GENERATION_KV_STORE_TTL_S="6")
    )
    # Corrupt: same size, bytes changed in the middle.
    for _ in range(2):
        await final(service.address, prompt(2), "ann")
    [saved] = await states_saved(kv, 1)
    data = bytearray(saved.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    saved.write_bytes(bytes(data))
    await final(service.address, prompt(3), "bob")  # takes (erases) the slot
    corrupt = await final(service.address, prompt(2), "ann")
    assert corrupt.prefix_store.restored_tokens == 0
    assert corrupt.usage.cached_input_tokens == 0
    assert not saved.exists()  # discarded with its entry

    # Expired: saved, then unused for longer than the TTL.
    for _ in range(2):
        await final(service.address, prompt(4), "ann")
    await states_saved(kv, 1)
    saved_at = time.monotonic()
    await asyncio.sleep(max(0.0, saved_at + 6.5 - time.monotonic()))
    await final(service.address, prompt(3), "bob")
    expired = await final(service.address, prompt(4), "ann")
    assert expired.prefix_store.restored_tokens == 0
    assert expired.usage.cached_input_tokens == 0


async def test_the_size_bound_evicts_the_least_recently_used_state(launcher, tmp_path):
    kv = tmp_path / "kv"
    # SmolLM2's states are ~23 KB a token: a ~210-token prompt is ~5 MB, two fit in 11 MB.
    service = await asyncio.to_thread(
        launcher.start, "generation", env=store_env(kv, RAGLINE_GENERATION_KV_STORE_MAX_MB="11")
    )

    async def ann(n: int) -> generation_pb2.GenerateFinal:
        await final(service.address, "Hello.", "bob")  # a short prompt that erases the slot
        return await final(service.address, prompt(n), "ann")

    for n in (5, 6):
        await ann(n)
        assert (await ann(n)).prefix_store.saved_tokens > 0
    assert (await ann(5)).prefix_store.restored_tokens > 0  # 5 is now the most recent
    await ann(7)
    assert (await ann(7)).prefix_store.saved_tokens > 0  # over the bound: 6 goes
    assert (await ann(5)).prefix_store.restored_tokens > 0  # (its slot waited for 7's save)
    assert len(state_files(kv)) == 2
    assert (await ann(7)).prefix_store.restored_tokens > 0
    evicted = await ann(6)
    assert evicted.prefix_store.restored_tokens == 0


async def test_slots_come_from_the_memory_budget_and_one_more_request_is_refused(
    launcher, tmp_path
):
    # SmolLM2: ~94 MB file + 256 MiB buffers, 45 MiB of KV per 2048-token slot: a 450 MiB
    # budget holds 2 slots, whatever max_num_seqs allows.
    env = store_env(
        tmp_path / "kv",
        RAGLINE_GENERATION_MAX_NUM_SEQS="8",
        RAGLINE_GENERATION_MAX_QUEUE="0",
        RAGLINE_GENERATION_MEMORY_BUDGET_MB="450",
    )
    service = await asyncio.to_thread(launcher.start, "generation", env=env)
    assert "2 slot(s) of 45 MiB KV each" in service.log()

    async def long_one(n: int):
        request = generation_pb2.GenerateRequest(prompt=prompt(n), max_tokens=48)
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            try:
                async for _ in stub.Generate(
                    request, timeout=60, metadata=(("x-ragline-tenant", f"t{n}"),)
                ):
                    pass
            except grpc.aio.AioRpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    codes = await asyncio.gather(*(long_one(n) for n in range(3)))
    assert sorted(codes, key=str) == sorted(
        [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED], key=str
    )


async def test_a_budget_too_small_for_one_slot_refuses_to_start(launcher, tmp_path):
    env = store_env(tmp_path / "kv", RAGLINE_GENERATION_MEMORY_BUDGET_MB="200")
    handle = launcher.start("generation", env=env, wait=False)
    code = await asyncio.to_thread(handle.process.wait, 120)
    launcher.forget(handle)
    assert code != 0
    assert "RAGLINE_GENERATION_MEMORY_BUDGET_MB" in handle.log()


async def test_a_chats_system_part_is_stored_once_hot_and_serves_new_questions(launcher, tmp_path):
    service = await asyncio.to_thread(launcher.start, "generation", env=store_env(tmp_path / "kv"))
    system = f"Answer from these notes only.\n{PASSAGE}"

    async def ask(question: str, who: str = "ann") -> generation_pb2.GenerateFinal:
        request = generation_pb2.GenerateRequest(max_tokens=1)
        request.chat.messages.add(role=generation_pb2.ROLE_SYSTEM, content=system)
        request.chat.messages.add(role=generation_pb2.ROLE_USER, content=question)
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            replies = [
                m
                async for m in stub.Generate(
                    request, timeout=60, metadata=(("x-ragline-tenant", who),)
                )
            ]
        return replies[-1].final

    await ask("Who led the Normans?")
    second = await ask("Where is Normandy?")  # the same system part, seen twice: saved
    assert 0 < second.prefix_store.saved_tokens < second.usage.input_tokens
    await ask("Hello?", who="bob")  # erases the slot
    third = await ask("Whom did they swear fealty to?")
    assert third.prefix_store.restored_tokens == second.prefix_store.saved_tokens
    assert third.usage.cached_input_tokens >= third.prefix_store.restored_tokens - 1
