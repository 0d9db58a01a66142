"""llama-server calls: the caller's remaining time (a stalled engine cannot hold a request
past its deadline), and how a stream is sent and read."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from ragline import deadlines
from ragline.errors import DeadlineExceeded
from ragline_services.generation.llama_engine import EngineSettings, LlamaServerEngine


async def test_a_stalled_llama_server_call_ends_at_the_callers_deadline(tmp_path):
    async def never_answer(reader, writer):
        await asyncio.sleep(60)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = LlamaServerEngine(
        EngineSettings(model_path=Path("unused"), binary=Path("unused")), port, tmp_path / "log"
    )
    started = time.monotonic()
    with deadlines.deadline_scope(0.3), pytest.raises(DeadlineExceeded):
        await asyncio.shield(engine.count_tokens("hello"))  # shielded: no cancel to help
    assert time.monotonic() - started < 1.0  # not the 30 s cap
    with deadlines.deadline_scope(0.0), pytest.raises(DeadlineExceeded):
        await engine.erase_slot(0)  # no time left: not even sent
    server.close()


def _sse(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def test_a_stream_sends_the_prompt_ids_and_yields_one_event_per_read(tmp_path):
    """Tokens that arrive together come out as one event (one gRPC message later), a line
    split across two reads is joined, and the prompt goes as the ids already made."""
    received: list[bytes] = []
    second_part = asyncio.Event()

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(
                line.split(b":")[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        received.append(await reader.readexactly(length))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        )
        together = _sse({"content": "Par", "tokens": [11]}) + _sse(
            {"content": "is", "tokens": [12]}
        )
        split = _sse({"content": " is", "tokens": [13]})
        writer.write(together + split[:9])
        await writer.drain()
        await second_part.wait()
        writer.write(split[9:])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_sse({"stop": True, "stop_type": "eos", "content": "", "timings": {}}))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = LlamaServerEngine(
        EngineSettings(model_path=Path("unused"), binary=Path("unused")), port, tmp_path / "log"
    )
    events = []
    async for event in engine.stream(
        "ignored text", slot=0, max_tokens=8, sampling={}, prompt_ids=[1, 2, 3]
    ):
        events.append(event)
        second_part.set()
    await engine.close()
    server.close()
    assert json.loads(received[0])["prompt"] == [1, 2, 3]
    assert [(e.text, e.token_ids, e.final) for e in events] == [
        ("Paris", [11, 12], False),
        (" is", [13], False),
        ("", [], True),
    ]
