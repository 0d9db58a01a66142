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
from ragline_services.generation.llama_engine import (
    _KEEPALIVE_S,
    EngineSettings,
    LlamaServerEngine,
)


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
        # One event per engine step of the prompt (asked for: a closed stream is noticed
        # when one is written), none of which is a token.
        progress = {"processed": 64, "total": 128, "cache": 0, "time_ms": 300}
        writer.write(_sse({"content": "", "tokens": [-1], "prompt_progress": progress}))
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
    sent = json.loads(received[0])
    assert sent["prompt"] == [1, 2, 3] and sent["return_progress"] is True
    assert [(e.text, e.token_ids, e.final) for e in events] == [
        ("Paris", [11, 12], False),
        (" is", [13], False),
        ("", [], True),
    ]


async def test_a_connection_llama_server_may_be_closing_is_not_reused(tmp_path):
    """llama-server ends a connection idle for 5 s (its HTTP library's keep-alive): a request
    sent on one as it closes gets no reply. Here a server that drops a request arriving on
    a connection idle for longer than the client keeps idle ones: no request may fail."""
    assert _KEEPALIVE_S < 5.0
    served = 0

    async def serve(reader, writer):
        nonlocal served
        last = time.monotonic()
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if time.monotonic() - last > _KEEPALIVE_S + 0.5:
                break  # closed as the request came
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            body = b'{"tokens": [1, 2]}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            served += 1
            last = time.monotonic()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = LlamaServerEngine(
        EngineSettings(model_path=Path("unused"), binary=Path("unused")), port, tmp_path / "log"
    )
    assert await engine.tokenize("a") == [1, 2]
    await asyncio.sleep(_KEEPALIVE_S + 1.0)
    assert await engine.tokenize("b") == [1, 2]  # on a new connection
    await engine.close()
    server.close()
    assert served == 2
