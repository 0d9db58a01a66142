"""Engine calls carry the caller's remaining time (a stalled engine cannot hold a request
past its deadline)."""

from __future__ import annotations

import asyncio
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
