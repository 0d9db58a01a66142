"""The context one run's steps share: what flows between steps, the run's settings and
clients, and RunContext (the calls every step makes through it, each model call inside a
budget reservation).

Each model call reserves before it starts and settles what it really used after it ends
(a failed or cancelled call too: cancelled goes to pending first, then is settled with
what was observed). Settlement runs concurrently with the steps that need the result, so
it stays off the critical path; the run waits for every settlement before it reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import numpy as np
import structlog

from ragline.budget import Amounts, Reservation, TaskBudget
from ragline.clients import ServiceClient
from ragline.errors import FailedPrecondition
from ragline.retry import DEFAULT_POLICY, call_with_retry
from ragline.v1 import common_pb2
from ragline.vocabulary import FinishReason, Fusion, ModelTier, SearchMode
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.agent import (
    AgentPlan,
)
from ragline_services.orchestrator.caches import (
    CacheUse,
    OrchestratorCaches,
    Viewer,
)
from ragline_services.orchestrator.params import QueryParams
from ragline_services.orchestrator.routing import Signal
from ragline_services.orchestrator.runner import Step

log = structlog.get_logger("ragline.orchestrator")


# A call refused with one of these did no work: it is charged as a call, not as the
# tokens it had reserved.
_REFUSED_BEFORE_WORK = frozenset(
    {
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


class NoEvidence(FailedPrecondition):
    """Nothing to answer from: the run ends INCOMPLETE instead of guessing."""


# -- what flows between steps ------------------------------------------------------------------


@dataclass(frozen=True)
class QueryVector:
    values: np.ndarray
    model_version: str


@dataclass(frozen=True)
class Ranked:
    passages: list[ev.Passage]
    source: str  # bm25 | vector | hybrid | fused | reranked
    index_version: int = 0
    query: str = ""  # the (sub-)query this ranking answers


@dataclass(frozen=True)
class Planned:
    """What the planning step decided: the agent plan, or None when the planner's replies
    were malformed twice (`problems` says how) and the run falls back to the RAG plan."""

    plan: AgentPlan | None
    problems: tuple[str, ...] = ()


class NotEscalated(enum.StrEnum):
    """Why an escalation that was wanted was not made (the metric's label)."""

    NO_LARGE_TIER = "no_large_tier"
    EVIDENCE_UNLIKELY = "evidence_unlikely"  # the gate's estimate under ESCALATE_FROM
    OTHERS_IN_FLIGHT = "others_in_flight"  # more than ESCALATE_BESIDE runs beside it
    UNAFFORDABLE = "unaffordable"  # its reservation did not fit the task's budget
    FAILED = "failed"  # the large tier's call failed


@dataclass(frozen=True)
class MissingPart:
    """A part of a several-part question that has no answer standing: why, and the draft
    its generation wrote where one was written (it failed its checks)."""

    query: str
    why: str
    draft: str = ""

    def __str__(self) -> str:
        return f"{self.query!r}: {self.why}"


@dataclass(frozen=True)
class Answer:
    text: str
    evidence: ev.Evidence
    cited: ev.Cited
    finish_reason: FinishReason
    usage: Amounts
    cached_input_tokens: int
    model: str
    tier: common_pb2.ModelTier
    model_version: str = ""
    # Checks that failed on the small answer (the escalation signals), and whether the
    # large tier then answered; `outcome`: what became of an escalation that was wanted
    # and not made (`escalation_unavailable: ...`), else empty.
    signals: tuple[Signal, ...] = ()
    escalated: bool = False
    outcome: str = ""
    not_escalated: NotEscalated | None = None  # why, where `outcome` says one was not made
    # Checks that failed on this (the final) answer: any makes it INCOMPLETE.
    problems: tuple[Signal, ...] = ()
    # The verifier's estimate that the answer is the one the question asks for (None: not
    # read, as for a refusal or an answer that failed an earlier check).
    verified: float | None = None
    # The model's own confidence in the text (confidence.py; None: the engine gave none).
    answer_logprob: float | None = None
    # Candidates of the answer's kind in its evidence (the verifier's rivals), for the
    # second read.
    rivals: tuple[str, ...] = ()
    # A several-part answer: the required parts that have no answer standing (the text,
    # citations and checks above are the parts that stand).
    missing_parts: tuple[MissingPart, ...] = ()


@dataclass(frozen=True)
class Settings:
    """The knobs of one run (server defaults, narrowed by the request)."""

    question: str
    candidates: int = 50
    search_mode: SearchMode = SearchMode.HYBRID
    attributes: tuple[tuple[str, str], ...] = ()
    fusion: Fusion = Fusion.SCORE
    vector_weight: float = 0.4
    rerank_candidates: int = 30
    late_interaction_k: int = 20
    rerank_cross_encoder: bool = False
    context_passages: int = 4
    evidence_tokens: int = 120
    # Sentences embedded to compete for the prompt (the rest lose on lexical evidence).
    embed_sentences: int = 6
    answer_tokens: int = 64
    tier: ModelTier = ModelTier.SMALL
    # The tier was not pinned by the request: a checkable signal may escalate to large,
    # while at most `escalate_beside` other runs are in flight.
    escalate: bool = False
    escalate_beside: int = 0
    allow_degrade: bool = False
    # The answerability gate's threshold (answerability.py; 0: every question is answered).
    answerable_threshold: float = 0.25
    verify_threshold: float = 0.5
    confirm_above: float = 0.85
    cross_check_below: float = 0.8
    # The cross-check runs while at most this many other runs are in flight; beyond it an
    # answer it would have checked is INCOMPLETE `unverified`.
    cross_check_beside: int = 1
    # Cost in micros per 1,000 tokens (input, output), per tier.
    prices: dict[ModelTier, tuple[int, int]] = field(default_factory=dict)


@dataclass
class Clients:
    embedding: ServiceClient
    retrieval: ServiceClient
    rerank: ServiceClient
    generation: ServiceClient
    budget: ServiceClient
    # At most this many calls in flight to each service, whatever the plans do.
    limits: dict[str, asyncio.Semaphore]
    # Context window of each generation tier, learned on first use (CountTokens), and
    # whether the tier serves a light tenant's request first.
    context_windows: dict[str, int] = field(default_factory=dict)
    light_first: dict[str, bool] = field(default_factory=dict)


class RunContext:
    """One run's clients, budget and settings, shared by its steps."""

    def __init__(
        self,
        clients: Clients,
        budget: TaskBudget,
        settings: Settings,
        run_id: str,
        on_delta: Callable[[str], None],
        *,
        caches: OrchestratorCaches | None = None,
        viewer: Viewer | None = None,
        read_cache: bool = True,
        write_cache: bool = True,
        light_tenant: Callable[[], bool] | None = None,
        others_running: Callable[[], int] | None = None,
    ) -> None:
        self.clients = clients
        # How many other runs are in flight now (admission.py): escalation waits for none.
        self.others_running = others_running or (lambda: 0)
        # Whether the run is a light tenant's beside a flood now (admission.py): its
        # generations go first. Asked at each generation: a flood may start meanwhile.
        self.light_tenant = light_tenant or (lambda: False)
        # Generations sent unmarked and still reading their prompt: each waits on its
        # event, which the orchestrator sets when the run's tenant turns light meanwhile
        # (a flood that began beside it), to be sent again marked. `raised_light` counts
        # the generations sent again.
        self._unmarked: set[asyncio.Event] = set()
        self.raised_light = 0
        self.budget = budget
        self.settings = settings
        self.run_id = run_id
        # Reservation ids must be this run's own: the run id may be the caller's (sent in
        # x-ragline-run-id), and a second run reusing it would get the first's
        # reservations replayed, uncharged. Retries inside the run keep their ids. (The run
        # id is cut so that a 128-byte one still leaves room for the node's id.)
        self.reservation_prefix = f"{run_id[:24]}-{uuid.uuid4().hex[:12]}"
        self.on_delta = on_delta
        self.settlements: list[asyncio.Task] = []
        self.degraded: list[str] = []
        self.caches = caches if viewer is not None else None
        self.viewer = viewer or Viewer("")
        self.read_cache = read_cache and self.caches is not None
        self.write_cache = write_cache and self.caches is not None
        self.cache_use = CacheUse()

    @contextlib.contextmanager
    def until_light(self) -> Iterator[asyncio.Event]:
        """An event set if the run's tenant turns light while a generation sent unmarked
        is under way."""
        event = asyncio.Event()
        self._unmarked.add(event)
        try:
            yield event
        finally:
            self._unmarked.discard(event)

    def turn_light_if_so(self) -> None:
        """Wakes the run's unmarked generations if its tenant is light now."""
        if self._unmarked and self.light_tenant():
            for event in self._unmarked:
                event.set()

    async def look_up(self, step: Step, layer: str, *parts) -> tuple[str, dict | None]:
        """The step's cache key from `parts` ("" while caching is off) and its entry (None:
        a miss, counted, or reading is off). A hit is the caller's to check and then
        take with `served_from_cache`, or to drop as a miss with `missed`."""
        if self.caches is None:
            return "", None
        key = self.caches.key(layer, self.viewer, *parts)
        if not self.read_cache:
            return key, None
        entry = await self.caches.get(layer, key)
        if entry is None:
            self.missed(layer)
        return key, entry

    def missed(self, layer: str) -> None:
        self.cache_use.count(layer, hit=False)

    def served_from_cache(self, step: Step, layer: str, entry: dict) -> None:
        """The step's result came from `layer`: marked, counted, and what it saved noted."""
        assert self.caches is not None
        self.caches.hit(layer)
        self.cache_use.count(layer, hit=True)
        step.record.cached = layer
        self.cache_use.saved.append(
            {
                "node_id": step.node.id,
                "kind": step.node.kind.value,
                "layer": layer,
                "time_s": float(entry.get("time_s", 0.0)),
                "input_tokens": int(entry.get("input_tokens", 0)),
                "output_tokens": int(entry.get("output_tokens", 0)),
            }
        )

    async def remember(self, step: Step, layer: str, key: str, entry: dict) -> None:
        if self.write_cache:
            assert self.caches is not None
            started = step.record.started or step.record.call_start
            if started is not None:
                entry["time_s"] = time.monotonic() - started
            await self.caches.put(layer, key, entry, viewer=self.viewer)

    # -- calls ------------------------------------------------------------------------------

    def _client(self, service: str) -> ServiceClient:
        return getattr(self.clients, service)

    async def call(self, step: Step, service: str, method: str, request: Any) -> Any:
        """A unary call under the per-service limit, with the kit's retry rule; the node
        records when it started and ended, its attempts and the server's own timing."""
        client = self._client(service)

        async def attempt():
            step.record.attempts += 1
            return await client.unary(method, request)

        async with self.clients.limits[service]:
            step.mark("call_start")
            reply = await call_with_retry(attempt, DEFAULT_POLICY, what=f"{service}.{method}")
            step.mark("call_end")
        if reply.HasField("timing"):
            step.record.served(reply.timing)
        return reply

    async def reserve(self, step: Step, amounts: Amounts, *, part: str = "") -> Reservation:
        """A reservation for the step's next call (`part`: one of several calls the step
        makes side by side; each has its own reservation id)."""
        step.mark("reserve_start")
        attempt = step.record.attempts
        name = f"{step.node.id}-{part}" if part else step.node.id
        reservation = self.budget.reserve(
            amounts,
            stage=step.node.id,
            reservation_id=f"{self.reservation_prefix}-{name}-{attempt}",
        )
        await reservation.open()
        return reservation

    def settle_later(
        self, step: Step, reservation: Reservation, *, failed: bool = False, cancelled: bool = False
    ) -> None:
        async def settle() -> None:
            try:
                await reservation.close(failed=failed, cancelled=cancelled)
            except Exception as error:  # the ledger's own expiry releases it eventually
                log.warning("budget.settle_failed", node=step.node.id, error=str(error))
            step.mark("settled")

        self.settlements.append(asyncio.ensure_future(settle()))

    async def model_call(
        self,
        step: Step,
        service: str,
        method: str,
        request: Any,
        amounts: Amounts,
        usage: Callable[[Any], Amounts],
        *,
        counts_as_call: bool = True,
    ) -> Any:
        """One model call inside a reservation (requests and replies are the messages of
        the generated stub's `method`, hence Any). `counts_as_call=False`: work done ahead
        for another step's call (its tokens are charged, the call is that step's)."""
        reservation = await self.reserve(step, amounts)
        try:
            reply = await self.call(step, service, method, request)
        except BaseException as error:
            if isinstance(error, grpc.aio.AioRpcError) and error.code() in _REFUSED_BEFORE_WORK:
                reservation.settle(Amounts(calls=(step.record.attempts or 1) * counts_as_call))
            self.settle_later(
                step, reservation, failed=True, cancelled=isinstance(error, asyncio.CancelledError)
            )
            raise
        # Every attempt is a call charged, retries included.
        calls = max(step.record.attempts, 1) if counts_as_call else 0
        reservation.settle(replace(usage(reply), calls=calls))
        self.settle_later(step, reservation)
        return reply

    async def wait_settled(self) -> None:
        if self.settlements:
            await asyncio.shield(asyncio.gather(*self.settlements, return_exceptions=True))

    def cost(self, tier: ModelTier, input_tokens: int, output_tokens: int) -> int:
        price_in, price_out = self.settings.prices.get(tier, (0, 0))
        return (input_tokens * price_in + output_tokens * price_out) // 1000


# -- inputs ----------------------------------------------------------------------------------


def rankings(inputs: list[object]) -> list[Ranked]:
    found: list[Ranked] = []
    for item in inputs:
        if isinstance(item, Ranked):
            found.append(item)
        elif isinstance(item, list):
            found += rankings(item)
    return found


def merged(inputs: list[object]) -> list[ev.Passage]:
    """One ranking of every passage the inputs carry: round robin by rank, no repeats."""
    lists = [r.passages for r in rankings(inputs)]
    seen: set[str] = set()
    out = []
    for rank in range(max((len(x) for x in lists), default=0)):
        for passages in lists:
            if rank < len(passages) and passages[rank].id not in seen:
                seen.add(passages[rank].id)
                out.append(passages[rank])
    return out


def query_of(step: Step, settings: Settings) -> str:
    return step.node.params_as(QueryParams).query or settings.question
