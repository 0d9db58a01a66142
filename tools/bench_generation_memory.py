"""Does the generation service's memory stay bounded under a flood of large, distinct chats?

    .venv/bin/python tools/bench_generation_memory.py [--chats 64] [--concurrency 8]

Starts a generation service (SmolLM2, 2048-token context) and sends `--chats` distinct
chats of `--chat-mib` MiB each (15 by default; messages of 240 KB, about the per-message
limit; each chat differs,
so no cache can hold them as one), `--concurrency` at a time, then more floods of the
same size (`--floods` in all). Reported: the service process's resident memory (RSS)
before and after each flood, and its peak (VmHWM), with the outcome of every chat.
Bounded means later floods leave the RSS where the first did: nothing grows per chat.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc

from ragline.v1 import generation_pb2, generation_pb2_grpc
from ragline_app.stack import spawn_service

ENV = {
    "RAGLINE_GENERATION_SMALL_MODEL": "smollm2-135m",
    "RAGLINE_GENERATION_LARGE_MODEL": "",
    "RAGLINE_GENERATION_CONTEXT_PER_SEQ": "2048",
    "RAGLINE_GENERATION_MAX_NUM_SEQS": "2",
}


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of `pid` in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def chat(number: int, mib: float) -> generation_pb2.GenerateRequest:
    """A distinct chat of about `mib` MiB, in messages of at most 240 KB."""
    request = generation_pb2.GenerateRequest(max_tokens=4)
    left = int(mib * (1 << 20))
    part = 0
    while left > 0:
        text = (f"chat {number} part {part} " + "warsaw vistula " * 16_000)[: min(240_000, left)]
        request.chat.messages.add(role=generation_pb2.ROLE_USER, content=text)
        left -= len(text)
        part += 1
    return request


async def flood(
    address: str, first: int, count: int, concurrency: int, mib: float
) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def one(number: int) -> None:
            async with gate:
                try:
                    async for _ in stub.Generate(
                        chat(number, mib), timeout=120, metadata=(("x-ragline-tenant", "flood"),)
                    ):
                        pass
                    outcomes["OK"] += 1
                except grpc.aio.AioRpcError as error:
                    outcomes[error.code().name] += 1

        await asyncio.gather(*(one(n) for n in range(first, first + count)))
    return outcomes


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as work:
        process, address = spawn_service("generation", ENV, Path(work) / "generation.log")
        try:
            report = {"before_mib": memory_mib(process.pid)[0]}
            for round_ in range(1, args.floods + 1):
                started = time.monotonic()
                outcomes = await flood(
                    address, round_ * 10_000, args.chats, args.concurrency, args.chat_mib
                )
                rss, peak = memory_mib(process.pid)
                report[f"flood {round_}"] = {
                    "seconds": round(time.monotonic() - started, 1),
                    "outcomes": dict(outcomes),
                    "rss_mib": round(rss, 1),
                    "peak_mib": round(peak, 1),
                }
        finally:
            process.terminate()
            process.wait()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--floods", type=int, default=3)
    parser.add_argument("--chat-mib", type=float, default=15.0, help="size of each chat")
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
    sys.exit(0)
