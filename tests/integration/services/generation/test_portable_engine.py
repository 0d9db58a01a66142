"""The prebuilt engine an AVX2 CPU gets runs and answers on one: the generation service on
an emulated Intel Haswell (AVX2, 2013; `qemu-x86_64 -cpu Haswell`, Debian's qemu-user),
whatever CPU runs the tests, so this never depends on the machine CI happens to have. The
emulation is strict: the engine built for AVX-512 and AMX dies of SIGILL on it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest

from ragline.config import CommonConfig
from ragline.v1 import generation_pb2, generation_pb2_grpc
from ragline_services.generation.prebuilt import AVX512_AMX, PrebuiltEngine, prebuilt_choices
from support import SMALL_GENERATION
from support.cpus import HASWELL

pytestmark = pytest.mark.integration


def on_emulated_cpu(engine: PrebuiltEngine, folder: Path, cpu: str = "Haswell") -> Path:
    """A llama-server to start that is `engine`'s binary run by qemu-user on `cpu`."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.fail("no qemu-x86_64: `make test` installs Debian's qemu-user")
    binary = engine.binary(CommonConfig().cache_dir)
    if not binary.exists():
        pytest.fail(
            f"the prebuilt engine {engine.name} is not installed: `make test-engines` "
            f"(tools/install_llama_server.py --prebuilt {engine.name} --no-check)"
        )
    wrapper = folder / f"llama-server-{engine.name}-on-{cpu}"
    # exec: the service's signals (stop, kill) reach qemu, which is the engine's process.
    wrapper.write_text(f'#!/bin/sh\nexec {qemu} -cpu {cpu} {binary} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


async def test_the_engine_an_avx2_cpu_gets_answers_on_an_emulated_haswell(launcher, tmp_path):
    (engine,) = prebuilt_choices(HASWELL)  # what `make llama-server` installs on one
    env = {
        **SMALL_GENERATION,
        "RAGLINE_GENERATION_LLAMA_SERVER": str(on_emulated_cpu(engine, tmp_path)),
        "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
        "RAGLINE_GENERATION_THREADS": "2",  # qemu runs guest threads on host cores
        "RAGLINE_GENERATION_KV_STORE": "false",
    }
    service = await asyncio.to_thread(launcher.start, "generation", env=env)
    request = generation_pb2.GenerateRequest(
        prompt="The capital of France is",
        max_tokens=2,  # ~2 s a token emulated
        speculation=generation_pb2.SPECULATION_OFF,
    )
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        metadata = (("x-ragline-tenant", "acme"),)
        messages = [m async for m in stub.Generate(request, timeout=120, metadata=metadata)]
    assert "Paris" in messages[-1].final.text
    # and it was the emulated CPU that answered: qemu names the host features it hides
    logs = "".join(path.read_text(errors="replace") for path in tmp_path.rglob("*.log"))
    assert "TCG doesn't support requested feature" in logs


@pytest.mark.full
async def test_the_avx512_engine_dies_on_the_same_emulated_cpu(tmp_path):
    from ragline.models import ModelStore
    from ragline_services.generation.llama_engine import engine_serves

    model = ModelStore(CommonConfig().model_dir).gguf_file(SMALL_GENERATION[
        "RAGLINE_GENERATION_SMALL_MODEL"
    ])  # fmt: skip
    failure = await engine_serves(on_emulated_cpu(AVX512_AMX, tmp_path), model, timeout_s=60)
    assert failure is not None and failure.startswith("exit -4")  # SIGILL
