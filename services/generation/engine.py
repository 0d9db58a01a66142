"""llama.cpp's `llama-server` as the CPU generation engine: one process per model tier.

The service launches and owns the process, talks to it over loopback HTTP and always
names the slot a request runs in (our scheduler decides, for prefix-cache isolation).
Cross-slot prompt sharing of llama-server (the RAM prompt cache and "most similar slot"
selection) is switched off for the same reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import structlog

from ragline.errors import Unavailable
from ragline.processes import terminate

log = structlog.get_logger("ragline.generation.engine")


def llama_server_binary() -> Path:
    """The llama-server built by tools/build_llama_server.py (or RAGLINE_LLAMA_SERVER)."""
    configured = os.environ.get("RAGLINE_LLAMA_SERVER")
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    cache = Path(os.environ.get("RAGLINE_LLAMA_CACHE", base / "ragline" / "llama.cpp" / "b11434"))
    return cache / "llama-server"


@dataclass(frozen=True)
class EngineSettings:
    model_path: Path
    slots: int = 4
    context_per_slot: int = 2048
    threads: int = 1
    # "none", "ngram" (prompt lookup) or "draft" (with draft_model_path)
    speculation: str = "ngram"
    draft_model_path: Path | None = None
    draft_max: int = 8


@dataclass
class StreamEvent:
    """A piece of generated text, or (final=True) the engine's summary of the sequence."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: bool = False
    stop_type: str = ""  # eos | limit | word
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    drafted: int = 0
    accepted: int = 0


class LlamaServerEngine:
    def __init__(self, settings: EngineSettings, port: int, log_path: Path) -> None:
        self.settings = settings
        self.port = port
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.context_window = settings.context_per_slot
        self.slot_dir = log_path.parent / f"llama-slots-{port}"
        self._http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=settings.slots * 2 + 4),
        )

    def command(self) -> list[str]:
        s = self.settings
        command = [
            str(llama_server_binary()),
            "--model", str(s.model_path),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--parallel", str(s.slots),
            "--ctx-size", str(s.context_per_slot * s.slots),
            "--no-kv-unified",  # each slot its own context_per_slot window
            "--threads", str(s.threads), "--threads-batch", str(s.threads),
            "--cont-batching",
            "--cache-ram", "0",  # no RAM prompt cache shared across slots (tenant isolation)
            "--no-cache-idle-slots",
            "--slot-prompt-similarity", "0",
            "--offline",
            "--no-webui",
            # enables the slot actions; we only use `erase` (no slot is ever saved there)
            "--slot-save-path", str(self.slot_dir),
        ]  # fmt: skip
        if s.speculation == "ngram":
            # 3-token lookup, 8-token drafts: the best of the n-gram settings measured here.
            command += [
                "--spec-type",
                "ngram-simple",
                "--spec-ngram-simple-size-n",
                "3",
                "--spec-ngram-simple-size-m",
                str(s.draft_max),
            ]
        elif s.speculation == "draft" and s.draft_model_path is not None:
            command += [
                "--spec-type", "draft-simple", "--model-draft", str(s.draft_model_path),
                "--spec-draft-n-max", str(s.draft_max), "--threads-draft", str(s.threads),
            ]  # fmt: skip
        return command

    async def start(self, wait_s: float = 180.0) -> None:
        binary = llama_server_binary()
        if not binary.exists():
            raise Unavailable(
                f"no llama-server at {binary}: build it with `python tools/build_llama_server.py`"
                " (or set RAGLINE_LLAMA_SERVER)"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
                self.command(), stdout=log_file, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Unavailable(
                    f"llama-server exited with {self.process.returncode}: {self.log_tail()}"
                )
            try:
                reply = await self._http.get("/health", timeout=1.0)
                if reply.status_code == 200:
                    log.info("engine.ready", model=self.settings.model_path.name, port=self.port)
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        raise Unavailable(f"llama-server not ready after {wait_s} s: {self.log_tail()}")

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def close(self) -> None:
        await self._http.aclose()
        if self.process is not None:
            terminate(self.process, 10.0)

    async def _post(self, path: str, body: dict) -> dict:
        try:
            reply = await self._http.post(path, json=body, timeout=30.0)
        except httpx.HTTPError as error:
            raise Unavailable(f"llama-server {path} failed: {error}") from error
        if reply.status_code != 200:
            raise Unavailable(
                f"llama-server {path} answered {reply.status_code}: {reply.text[:300]}"
            )
        return reply.json()

    async def render_chat(self, messages: list[dict[str, str]]) -> str:
        return (await self._post("/apply-template", {"messages": messages}))["prompt"]

    async def count_tokens(self, text: str) -> int:
        reply = await self._post(
            "/tokenize", {"content": text, "add_special": True, "parse_special": True}
        )
        return len(reply["tokens"])

    async def erase_slot(self, slot: int) -> None:
        await self._post(f"/slots/{slot}?action=erase", {})

    async def stream(
        self, prompt: str, *, slot: int, max_tokens: int, sampling: dict
    ) -> AsyncIterator[StreamEvent]:
        """Streams one completion in `slot`. Closing the generator closes the HTTP stream,
        which makes llama-server stop decoding and free the slot."""
        body = {
            "prompt": prompt,
            "id_slot": slot,
            "cache_prompt": True,
            "n_predict": max_tokens,
            "stream": True,
            "return_tokens": True,
            **sampling,
        }
        try:
            async with self._http.stream("POST", "/completion", json=body) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    raise Unavailable(
                        f"llama-server /completion answered {reply.status_code}: {text[:300]}"
                    )
                async for line in reply.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = json.loads(line[6:])
                    if data.get("stop"):
                        yield _final_event(data)
                        return
                    yield StreamEvent(
                        text=data.get("content", ""), token_ids=list(data.get("tokens", ()))
                    )
        except httpx.HTTPError as error:
            raise Unavailable(f"llama-server stream failed: {error}") from error


def _final_event(data: dict) -> StreamEvent:
    timings = data.get("timings", {})
    return StreamEvent(
        text=data.get("content", ""),
        token_ids=list(data.get("tokens", ())),
        final=True,
        stop_type=data.get("stop_type", ""),
        prompt_tokens=int(data.get("tokens_evaluated", timings.get("prompt_n", 0))),
        cached_tokens=int(timings.get("cache_n", data.get("tokens_cached", 0)) or 0),
        completion_tokens=int(timings.get("predicted_n", 0)),
        prompt_ms=float(timings.get("prompt_ms", 0.0)),
        decode_ms=float(timings.get("predicted_ms", 0.0)),
        drafted=int(timings.get("draft_n", 0) or 0),
        accepted=int(timings.get("draft_n_accepted", 0) or 0),
    )
