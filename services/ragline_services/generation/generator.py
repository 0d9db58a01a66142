"""The generation domain: validate, admit, stream, stop on deadline or cancel, report.

No gRPC here: the servicer turns these events into GenerateResponse messages.

Why one file of this length: admission, the stream's report and the hot-prefix saves
share one sequence's lease; a sequence's run through the engine is sequence.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

import structlog
from cachetools import LRUCache

from ragline import deadlines, tracing
from ragline.background import detached_task
from ragline.errors import InvalidArgument, RaglineError, Unavailable
from ragline.vocabulary import FinishReason, ModelTier
from ragline_services.generation import sequence
from ragline_services.generation.chat_tokens import tokenize_chat
from ragline_services.generation.engine import (
    GenerationEngine,
    SlotStateEngine,
    TokenizingEngine,
    TokenLogprob,
)
from ragline_services.generation.leases import Lease
from ragline_services.generation.prefix_store import Candidate, PrefixStore, StoreOutcome
from ragline_services.generation.scheduler import SlotScheduler
from ragline_services.generation.sequence import Chunk, common_prefix

log = structlog.get_logger("ragline.generation")

# A stream is closed this long before the deadline, so the final message still reaches a
# caller whose own deadline is the same one.
DEADLINE_MARGIN_S = 0.05

# How long a stopping service waits for the saves under way (a state not saved is only a
# later request's prefill).
SAVES_AT_STOP_S = 10.0


@dataclass
class Speculation:
    """Acceptance of speculative decoding on one tier, and when to give up on it.

    llama-server decides speculation per process, not per request, so the fallback is
    per tier: once the acceptance rate over at least `min_drafted` drafted tokens is below
    `threshold`, the tier's engine is restarted without speculation (see
    GenerationService), and `fell_back` stays set in every later report.
    """

    mode: str  # none | ngram | draft
    threshold: float = 0.7
    min_drafted: int = 64
    drafted: int = 0
    accepted: int = 0
    fell_back: bool = False

    @property
    def rate(self) -> float | None:
        return None if self.drafted == 0 else self.accepted / self.drafted

    def record(self, drafted: int, accepted: int) -> bool:
        """Adds one request's counts; True when the tier should fall back to plain decoding."""
        if self.mode == "none" or self.fell_back:
            return False
        self.drafted += drafted
        self.accepted += accepted
        rate = self.rate
        return self.drafted >= self.min_drafted and rate is not None and rate < self.threshold


@dataclass
class Tier:
    name: ModelTier
    model: str
    model_version: str
    engine: GenerationEngine
    scheduler: SlotScheduler
    speculation: Speculation
    context_window: int
    # Called (as a task) when speculation should be switched off for this tier.
    on_fall_back: Callable[[Tier], Awaitable[None]] | None = None
    # Saved KV states of hot prompt prefixes (llama-server tiers; None: off).
    prefix_store: PrefixStore | None = None


@dataclass
class GenerationRequest:
    tenant: str
    tier: ModelTier
    max_tokens: int
    prompt: str | None = None
    chat: list[dict[str, str]] | None = None
    sampling: dict = field(default_factory=dict)
    # The caller's visibility scopes: its prompt holds evidence only they may see.
    visibility: frozenset[str] = frozenset()
    # What the prompt holds (document ids): its saved KV states name them, to be forgotten.
    sources: tuple[str, ...] = ()
    # The caller says this is a light tenant's request (scheduler.py: it goes first; pausing.py).
    light_tenant: bool = False

    @property
    def input_field(self) -> str:
        """The request field that holds its input (the one a refusal names)."""
        return "chat" if self.chat is not None else "prompt"

    @property
    def cache_owner(self) -> str:
        """Who may reuse this prompt's cached prefix (a warm slot, a stored state): the
        same tenant with the same visibility. A principal who sees less must not learn,
        from a matched prefix's length or speed, the evidence of one who sees more."""
        return f"{self.tenant}|{','.join(sorted(self.visibility))}"


@dataclass
class Summary:
    finish_reason: FinishReason
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_wait_s: float
    prefill_s: float
    decode_s: float
    first_token_at: float | None
    model: str
    model_version: str
    tier: ModelTier
    speculation_mode: str
    drafted: int
    accepted: int
    fell_back: bool
    store: StoreOutcome = field(default_factory=StoreOutcome)
    paused_s: float = 0.0  # paused for light tenants' requests (pausing.py)
    engine_wait_s: float = 0.0  # see sequence.Decoded.engine_wait_s
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the sampling asks


@dataclass
class Rendered:
    tier: Tier
    prompt: str
    tokens: int
    token_ids: list[int] | None = None  # when the engine tokenizes (llama-server)
    boundaries: list[int] = field(default_factory=list)  # candidate prefix lengths


# No token of any vocabulary served here spans more bytes than this: an input longer than
# the context window times it is refused before it is rendered or tokenized (a request of
# many MiB would otherwise be sent to the engine, and its ids held, only to be refused).
MAX_BYTES_PER_TOKEN = 128
# Renders and tokenizations sent to the engines at once (llama-server's /apply-template
# and /tokenize take a request's whole text; without a bound a flood of them holds it all).
RENDERS_AT_ONCE = 4
# Bytes of token ids kept for leading parts of chats (a Python int in a list: ~36 bytes).
PARTIAL_TOKENS_BYTES = 32 << 20


def _ids_size(ids: list[int]) -> int:
    return 36 * len(ids) + 64


class Generator:
    def __init__(self, tiers: dict[ModelTier, Tier]) -> None:
        self.tiers = tiers
        self._background: set[asyncio.Future] = set()
        self._saves: set[asyncio.Task] = set()  # hot prefixes saved after their answers
        # Token ids of rendered leading parts of chats (system prompts repeat verbatim),
        # by a digest of the part (never the text itself as a key), bounded in bytes.
        self._partial_tokens: LRUCache[bytes, list[int]] = LRUCache(
            maxsize=PARTIAL_TOKENS_BYTES, getsizeof=_ids_size
        )
        self._renders = asyncio.Semaphore(RENDERS_AT_ONCE)

    def tier(self, name: ModelTier) -> Tier:
        try:
            return self.tiers[name]
        except KeyError:
            raise InvalidArgument(
                "tier", f"tier {name!r} is not served here; available: {', '.join(self.tiers)}"
            ) from None

    async def forget(self, tenant: str, sources: list[str]) -> int:
        """Drops the saved KV states of `tenant` whose prompts named any of `sources`, in
        every tier's prefix store. Returns how many."""
        forgotten = 0
        for store in self.prefix_stores():
            forgotten += await store.forget(tenant, sources)
        return forgotten

    async def finish_saves(self, timeout_s: float = SAVES_AT_STOP_S) -> None:
        """Waits for the saves under way (a stopping service), then cancels what is left."""
        if not self._saves:
            return
        _, late = await asyncio.wait(set(self._saves), timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)

    def prefix_stores(self) -> list[PrefixStore]:
        """Each tier's prefix store, once (tiers may share one)."""
        stores = {id(t.prefix_store): t.prefix_store for t in self.tiers.values()}
        return [store for store in stores.values() if store is not None]

    def _refuse_if_it_cannot_fit(self, request: GenerationRequest, tier: Tier) -> None:
        """Refused from its size alone, before any engine sees it: at least one token per
        MAX_BYTES_PER_TOKEN bytes, more than the context window holds."""
        if request.chat is not None:
            size = sum(len(m["content"].encode()) for m in request.chat)
        else:
            size = len((request.prompt or "").encode())
        at_least = size // MAX_BYTES_PER_TOKEN
        if at_least >= tier.context_window:
            raise InvalidArgument(
                request.input_field,
                f"is {size} bytes: at least {at_least} tokens, more than model "
                f"{tier.model}'s {tier.context_window}-token context window",
            )

    async def render(self, request: GenerationRequest, *, for_store: bool = True) -> Rendered:
        tier = self.tier(request.tier)
        self._refuse_if_it_cannot_fit(request, tier)
        async with self._renders:
            return await self._render(tier, request, for_store)

    async def _render(self, tier: Tier, request: GenerationRequest, for_store: bool) -> Rendered:
        engine = tier.engine
        tokenizing = engine if isinstance(engine, TokenizingEngine) else None
        token_ids = None
        if request.chat is not None and tokenizing is not None:
            # Tokenized once: the count and the prompt the engine runs are these ids; a
            # message's content is text, never control tokens.
            prompt, token_ids = await tokenize_chat(tokenizing, request.chat)
        elif request.chat is not None:
            prompt = await engine.render_chat(request.chat)
        else:
            prompt = request.prompt or ""
        if not prompt.strip():
            raise InvalidArgument(
                request.input_field, "is empty; give the model something to continue"
            )
        if tokenizing is None:  # an engine that only counts (Triton's preprocessing model)
            return Rendered(tier, prompt, await engine.count_tokens(prompt))
        if token_ids is None:
            # A raw prompt is the caller's own text, control tokens included.
            token_ids = await tokenizing.tokenize(prompt)
        if tier.prefix_store is None or not for_store:
            return Rendered(tier, prompt, len(token_ids), token_ids)
        boundaries = [len(token_ids)]
        if request.chat is not None:
            boundaries += await self._chat_boundaries(tier, request.chat, token_ids)
        return Rendered(tier, prompt, len(token_ids), token_ids, boundaries)

    async def _chat_boundaries(
        self, tier: Tier, chat: list[dict[str, str]], ids: list[int]
    ) -> list[int]:
        """Token counts where the leading system messages and the conversation before the
        last message end (their rendering's common prefix with the whole prompt's)."""
        system = next((i for i, m in enumerate(chat) if m["role"] != "system"), len(chat))
        cuts = []
        for upto in {system, len(chat) - 1}:
            if not 0 < upto < len(chat):
                continue
            memo = hashlib.sha256(
                json.dumps([tier.name, tier.model_version, chat[:upto]]).encode()
            ).digest()
            partial = self._partial_tokens.get(memo)
            if partial is None:
                try:
                    _, partial = await tokenize_chat(_tokenizing(tier.engine), chat[:upto])
                except Unavailable:
                    continue  # a template that can't render a part: no boundary there
                with contextlib.suppress(ValueError):  # larger than the whole bound
                    self._partial_tokens[memo] = partial
            cuts.append(common_prefix(partial, ids))
        return cuts

    async def count_tokens(self, request: GenerationRequest) -> tuple[int, Tier]:
        rendered = await self.render(request, for_store=False)
        return rendered.tokens, rendered.tier

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Chunk | Summary, None]:
        rendered = await self.render(request)
        tier = rendered.tier
        _refuse_if_its_tokens_do_not_fit(rendered, request)
        speculate = tier.speculation.mode != "none" and not tier.speculation.fell_back
        deadline = deadlines.current_deadline()
        # A sequence can be paused and resumed where its prompt is token ids of this
        # engine: the resumed prompt is them and the tokens generated so far.
        pausable = rendered.token_ids is not None and isinstance(tier.engine, TokenizingEngine)
        lease = await tier.scheduler.acquire(
            request.tenant,
            deadline,
            owner=request.cache_owner,
            pausable=pausable,
            light=request.light_tenant,
        )
        acquired, arrived_at = time.monotonic(), time.time()
        try:
            store = await self._use_store(rendered, lease, request.cache_owner)
        except BaseException:
            tier.scheduler.release(lease.slot)
            raise
        decoded = sequence.Decoded(started=time.monotonic())
        stop_at = None if deadline is None else deadline - DEADLINE_MARGIN_S
        try:
            async with contextlib.aclosing(
                sequence.run(rendered, request, lease, decoded, stop_at)
            ) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            lease.interrupt = None
            lease.slot.tokens = tuple(rendered.token_ids or ())
            # Saved only from a slot that holds the prompt (the engine read it).
            if store.to_save and (decoded.first_token_at is not None or decoded.final):
                self._save_after_answer(rendered, lease, request, store.to_save, arrived_at)
            else:
                store.to_save = []
                tier.scheduler.release(lease.slot)
        decoded.ended = time.monotonic()
        if decoded.finish != FinishReason.DEADLINE and decoded.first_token_at is not None:
            tier.scheduler.pausing.note_decode(decoded.decode_s())
        final = decoded.final
        drafted, accepted = (final.drafted, final.accepted) if final else (0, 0)
        self._note_speculation(tier, drafted, accepted)
        if tracing.sampled():
            self._trace(
                tier, lease, acquired, decoded.started, decoded.first_token_at, decoded.ended, final
            )
        yield Summary(
            finish_reason=decoded.finish,
            text="".join(decoded.parts),
            prompt_tokens=rendered.tokens,
            completion_tokens=decoded.completion_tokens(),
            cached_tokens=decoded.cached_tokens(),
            queue_wait_s=lease.waited_s,
            prefill_s=decoded.prefill_s(),
            decode_s=decoded.decode_s(),
            first_token_at=decoded.first_token_at,
            model=tier.model,
            model_version=tier.model_version,
            tier=tier.name,
            speculation_mode=tier.speculation.mode if speculate else "none",
            drafted=drafted,
            accepted=accepted,
            fell_back=tier.speculation.fell_back,
            store=store,
            paused_s=decoded.paused_s,
            engine_wait_s=decoded.engine_wait_s(),
            logprobs=decoded.logprobs,
        )

    def _note_speculation(self, tier: Tier, drafted: int, accepted: int) -> None:
        """Counts a sequence's drafted and accepted tokens; the tier's engine is restarted
        without speculation (in the background) once its acceptance says to."""
        if tier.speculation.record(drafted, accepted) and tier.on_fall_back is not None:
            tier.speculation.fell_back = True
            task = asyncio.ensure_future(tier.on_fall_back(tier))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @staticmethod
    def _trace(tier, lease, acquired, started, first_token_at, decode_end, final) -> None:
        """The slot wait and the engine's call (its prefill and decode) as spans."""
        tracing.record("generation slot wait", acquired - lease.waited_s, acquired)
        engine = tracing.record(
            f"{type(tier.engine).__name__} generate",
            started,
            decode_end,
            {
                "ragline.tier": tier.name,
                "gen_ai.request.model": tier.model,
                "ragline.slot": lease.slot.index,
                "gen_ai.usage.input_tokens": final.prompt_tokens if final else 0,
                "gen_ai.usage.output_tokens": final.completion_tokens if final else 0,
            },
        )
        if first_token_at is not None:
            tracing.record("prefill", started, first_token_at, parent=engine)
            tracing.record("decode", first_token_at, decode_end, parent=engine)

    async def _use_store(self, rendered: Rendered, lease: Lease, owner: str) -> StoreOutcome:
        """Restores the longest stored prefix into the leased slot (unless the slot already
        holds more of this prompt); names the hot prefixes not yet stored, which are saved
        after the answer (_save_after_answer)."""
        outcome = StoreOutcome()
        store, ids = rendered.tier.prefix_store, rendered.token_ids
        if store is None or ids is None:
            return outcome
        warm = common_prefix(lease.slot.tokens, ids) if lease.warm else 0
        candidates = store.candidates(owner, ids, rendered.boundaries)
        if not candidates:
            return outcome
        # Sightings count even in a warm slot: the state must outlive the slot.
        await store.look_up(owner, candidates)
        engine = _slot_states(rendered.tier.engine)
        slot = lease.slot
        if any(c.tokens > warm for c in candidates):
            store.counters.lookups += 1  # there was prefill to skip
        for candidate in candidates:  # longest first
            entry = candidate.stored
            if candidate.tokens <= warm:
                break  # the slot already holds this much of the prompt
            if entry is None or not await store.verified(entry):
                candidate.stored = None
                continue
            began = time.monotonic()
            try:
                restored = await engine.restore_slot(slot.index, entry.file)
            except Unavailable as error:
                restored, why = -1, str(error)
            else:
                why = f"llama-server restored {restored} of {entry.tokens} tokens"
            outcome.restore_s += time.monotonic() - began
            if restored == entry.tokens:
                await store.used(entry)
                outcome.restored_tokens = restored
                slot.tokens = tuple(ids[:restored])
                break
            # Never half-loaded: whatever the engine kept of it goes.
            candidate.stored = None
            slot.tokens = ()
            await store.discard(entry, why)
            await rendered.tier.engine.erase_slot(slot.index)
        outcome.to_save = [c for c in candidates if c.hot and c.stored is None]
        if outcome.restored_tokens:
            _log_store(store, owner, rendered.tier.name, restored=outcome.restored_tokens)
        return outcome

    def _save_after_answer(
        self,
        rendered: Rendered,
        lease: Lease,
        request: GenerationRequest,
        to_save: list[Candidate],
        arrived_at: float,
    ) -> None:
        """Saves the hot prefixes of a prompt whose answer is out, from its slot, which its
        lease keeps until then (no other owner's prompt gets into it meanwhile). The
        service's own work, in the background: no caller waits for it, and no request's
        deadline or identity bounds it."""
        rendered.tier.scheduler.set_aside(lease)
        saving = self._save_prefixes(
            rendered, lease, request.cache_owner, request.sources, to_save, arrived_at
        )
        task = detached_task(saving, name=f"generation prefix save slot {lease.slot.index}")
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

    async def _save_prefixes(
        self,
        rendered: Rendered,
        lease: Lease,
        owner: str,
        sources: tuple[str, ...],
        to_save: list[Candidate],
        arrived_at: float,
    ) -> None:
        tier = rendered.tier
        store, engine, slot = tier.prefix_store, _slot_states(tier.engine), lease.slot
        assert store is not None and rendered.token_ids is not None
        began, saved_tokens = time.monotonic(), 0
        try:
            if store.too_old_to_save(arrived_at):
                return
            for candidate in to_save:  # longest first: each only cuts the slot's cache back
                file = store.new_file_name(candidate.key)
                try:
                    await engine.prefill(slot.index, rendered.token_ids[: candidate.tokens])
                    slot.tokens = tuple(rendered.token_ids[: candidate.tokens])
                    saved = await engine.save_slot(slot.index, file)
                except RaglineError as error:  # the engine's failure: no state this time
                    slot.tokens = ()  # what the engine holds now is not known
                    log.warning("generation.prefix_save_failed", owner=owner, error=str(error))
                    return
                # Every prefix carries all of the prompt's sources, the system part's too:
                # which tokens quote which document is not known here, and forgetting a
                # state too many costs one save.
                entry = await store.saved(owner, candidate, file, saved, sources, arrived_at)
                if entry is not None:
                    saved_tokens += entry.tokens
        finally:
            store.counters.save_s += time.monotonic() - began
            tier.scheduler.release(slot)
            if saved_tokens:
                _log_store(store, owner, tier.name, saved=saved_tokens)


def _log_store(store: PrefixStore, owner: str, tier: ModelTier, **what: int) -> None:
    """What the store did for one request, with its running figures."""
    log.info(
        "generation.prefix_store",
        owner=owner,
        tier=tier,
        **what,
        hit_rate=round(store.counters.hit_rate, 3),
        **{k: v for k, v in store.counters.__dict__.items()},
    )


def _tokenizing(engine: GenerationEngine) -> TokenizingEngine:
    """The engine of a rendering that tokenized (only a tokenizing engine's does)."""
    assert isinstance(engine, TokenizingEngine), "tokenized with an engine that cannot"
    return engine


def _slot_states(engine: GenerationEngine) -> SlotStateEngine:
    """The engine of a tier with a hot-prefix store (the service makes one only for an
    engine whose slot states can be saved)."""
    assert isinstance(engine, SlotStateEngine), "a prefix store on an engine without slot states"
    return engine


def _refuse_if_its_tokens_do_not_fit(rendered: Rendered, request: GenerationRequest) -> None:
    """The rendered prompt, and the answer it asks for beside it, within the context."""
    tier, prompt_tokens = rendered.tier, rendered.tokens
    if prompt_tokens >= tier.context_window:
        raise InvalidArgument(
            request.input_field,
            f"is {prompt_tokens} tokens; model {tier.model} has a {tier.context_window}-token "
            "context window",
        )
    if prompt_tokens + request.max_tokens > tier.context_window:
        raise InvalidArgument(
            "max_tokens",
            f"is {request.max_tokens}, but the prompt takes {prompt_tokens} of the "
            f"{tier.context_window}-token context; at most "
            f"{tier.context_window - prompt_tokens} fit",
        )
