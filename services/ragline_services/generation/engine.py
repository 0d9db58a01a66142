"""The one interface every generation engine implements (llama-server, TensorRT-LLM on
Triton), and the events it streams. The generator talks only to this."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token and the natural log of the probabilities the model gave it and
    its likeliest other token; None for a token accepted from a speculative draft (the
    engine reports none: it was the likeliest, with a probability unknown)."""

    text: str
    logprob: float | None
    runner_up: float | None


# The sampling key that asks an engine for its tokens' probabilities (Sampling.logprobs).
LOGPROBS = "logprobs"


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
    # One per token of `text`, when the sampling asked for them (LOGPROBS) and the engine
    # gives them.
    logprobs: list[TokenLogprob] = field(default_factory=list)


class GenerationEngine(Protocol):
    """One model tier's engine. Every failure of the engine itself raises Unavailable."""

    context_window: int

    async def start(self) -> None:
        """Starts (or connects to) the engine; returns when it can serve."""

    async def close(self) -> None: ...

    async def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt the model's chat template makes of `messages`."""

    async def count_tokens(self, text: str) -> int: ...

    async def erase_slot(self, slot: int) -> None:
        """Drops whatever the engine caches for `slot` (before another tenant uses it)."""

    def stream(
        self,
        prompt: str,
        *,
        slot: int,
        max_tokens: int,
        sampling: dict,
        prompt_ids: list[int] | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Streams one completion in `slot`, ending with a final event. Closing the
        iterator stops decoding at once. `prompt_ids`: the prompt already tokenized by this
        engine's `tokenize` (an engine that has one), so it is not tokenized again. An
        event may carry several tokens: those that arrived in one read."""


# What some engines can do beyond GenerationEngine; the generator asks with isinstance.


@runtime_checkable
class TokenizingEngine(Protocol):
    """An engine that tokenizes (llama-server): a chat is tokenized with its contents read
    as text (chat_tokens.py), and the prompt it runs is those ids."""

    async def render_chat(self, messages: list[dict[str, str]]) -> str: ...

    async def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]: ...


@runtime_checkable
class SlotStateEngine(Protocol):
    """An engine whose slots' KV state can be saved and restored (llama-server): the
    hot-prefix store (prefix_store.py) runs only on such an engine."""

    async def prefill(self, slot: int, tokens: list[int]) -> None:
        """Evaluates `tokens` into the slot's cache and keeps exactly these tokens."""

    async def save_slot(self, slot: int, filename: str) -> int:
        """The slot's KV state written to `filename`; the tokens saved."""

    async def restore_slot(self, slot: int, filename: str) -> int:
        """A saved state loaded into the slot; the tokens restored."""
