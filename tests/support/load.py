"""Steady load for the fault tests: closed-loop `Ask` workers and a writer, every outcome
recorded (nothing dropped), for checks made after the fault."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import grpc

from ragline.clients import RECONNECT_OPTIONS
from ragline.identity import WRITE_SCOPE
from ragline.v1 import (
    budget_pb2,
    budget_pb2_grpc,
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)
from ragline_services.orchestrator import answerability, routing
from support import error_info
from support.orchestrator import who

QUESTIONS = (
    "What century did the Normans first gain their separate identity?",
    "Who was the duke in the battle of Hastings?",
    "What is the original meaning of the word Norman?",
    "When was the Duchy of Normandy founded?",
    "Who ruled the duchy of Normandy?",
    "What religion were the Normans?",
)

# Codes that mean a bug, whatever was killed: a fault is reported as what it is
# (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...) or degrades the answer.
BUG_CODES = ("INTERNAL", "UNKNOWN")


@dataclass
class Outcome:
    started: float  # time.monotonic()
    seconds: float
    outcome: str  # COMPLETE | PARTIAL | INCOMPLETE, or the status code's name
    reason: str = ""  # the answer's reason, or the error's ErrorInfo reason
    task_id: str = ""
    detail: str = ""  # the error's message

    @property
    def ended(self) -> float:
        return self.started + self.seconds


# INCOMPLETE reasons given to a draft the model wrote (the answer checks' own words).
DRAFT_REASONS = frozenset(
    {
        routing.UNGROUNDED,
        routing.CONFLICTING,
        routing.FAILED_VALIDATION,
        routing.MISSING_PART,
        routing.UNVERIFIED,
    }
)


def drafted(outcome: Outcome) -> bool:
    return outcome.outcome in ("COMPLETE", "PARTIAL") or (
        outcome.outcome == "INCOMPLETE" and outcome.reason in DRAFT_REASONS
    )


# INCOMPLETE reasons that judge the question against the evidence found without a draft:
# the model saying the evidence does not answer, the answerability gate.
UNDRAFTED_JUDGMENTS = frozenset({"not_in_evidence", answerability.NO_RELEVANT_EVIDENCE})


def judged(outcome: Outcome) -> bool:
    """Drafted, or INCOMPLETE because the evidence found was judged not to answer: never
    an error, nor a step that could not run."""
    return drafted(outcome) or (
        outcome.outcome == "INCOMPLETE" and outcome.reason in UNDRAFTED_JUDGMENTS
    )


@dataclass
class AskLoad:
    """`workers` closed-loop askers, each ask with its own budget task and `deadline_s`."""

    address: str
    deadline_s: float = 10.0
    workers: int = 2
    tenant: str = "default"
    cache: int = orchestrator_pb2.CACHE_POLICY_BYPASS
    outcomes: list[Outcome] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _numbers: itertools.count = field(default_factory=itertools.count)
    _stopping: bool = False

    def start(self, run: str) -> None:
        self._tasks = [asyncio.create_task(self._worker(run, w)) for w in range(self.workers)]

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._tasks)

    async def _worker(self, run: str, worker: int) -> None:
        # The service's own reconnection rule, so a restart is measured, not this backoff.
        async with grpc.aio.insecure_channel(self.address, options=RECONNECT_OPTIONS) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            while not self._stopping:
                number = next(self._numbers)
                question = QUESTIONS[number % len(QUESTIONS)]
                outcome = await self._ask(stub, f"{run}-{number}", question)
                self.outcomes.append(outcome)
                if outcome.seconds < 0.2 and outcome.outcome != "COMPLETE":
                    await asyncio.sleep(0.2)  # failed at once: do not spin

    async def _ask(self, stub, task_id: str, question: str) -> Outcome:
        request = orchestrator_pb2.AskRequest(
            question=question,
            cache=self.cache,
            task_id=task_id,
            budget=common_pb2.BudgetAmounts(
                input_tokens=20_000, output_tokens=2_000, cost_micros=10**9, calls=64
            ),
            allow_degrade=True,
            max_tokens=48,
        )
        started = time.monotonic()
        try:
            call = stub.Ask(request, timeout=self.deadline_s, metadata=who(self.tenant))
            messages = [message async for message in call]
            status = messages[-1].result.status
            state = common_pb2.AnswerState.Name(status.state).removeprefix("ANSWER_STATE_")
            return Outcome(started, time.monotonic() - started, state, status.reason, task_id)
        except grpc.aio.AioRpcError as error:
            seconds = time.monotonic() - started
            return Outcome(
                started, seconds, error.code().name, _reason(error), task_id, error.details() or ""
            )

    # -- what the checks read ------------------------------------------------------------

    def bugs(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.outcome in BUG_CODES]

    def late(self, slack_s: float = 0.5) -> list[Outcome]:
        return [o for o in self.outcomes if o.seconds > self.deadline_s + slack_s]

    def between(self, start: float, end: float) -> list[Outcome]:
        """The asks that started in [start, end)."""
        return [o for o in self.outcomes if start <= o.started < end]

    @staticmethod
    def question_of(outcome: Outcome) -> str:
        return QUESTIONS[int(outcome.task_id.rsplit("-", 1)[1]) % len(QUESTIONS)]

    def not_as_without(self, start: float, end: float) -> list[Outcome]:
        """The asks started in [start, end) that were not answered (COMPLETE or PARTIAL)
        and ended otherwise than the same question ever did outside that window: what a
        fault in it did. (A question the model answers ungrounded is so with or without.)"""
        usual: dict[str, set[tuple[str, str]]] = {}
        for o in self.outcomes:
            if not start <= o.started < end:
                usual.setdefault(self.question_of(o), set()).add((o.outcome, o.reason))
        return [
            o
            for o in self.between(start, end)
            if o.outcome not in ("COMPLETE", "PARTIAL")
            and (o.outcome, o.reason) not in usual.get(self.question_of(o), set())
        ]

    def first_complete_after(self, moment: float) -> float | None:
        """When the first COMPLETE answer asked after `moment` ended."""
        ends = [o.ended for o in self.outcomes if o.outcome == "COMPLETE" and o.started >= moment]
        return min(ends, default=None)

    def answered_before(self, moment: float) -> list[float]:
        """How long each COMPLETE answer that ended before `moment` took, in seconds."""
        return [o.seconds for o in self.outcomes if o.outcome == "COMPLETE" and o.ended <= moment]

    def first_drafted_after(self, moment: float) -> float | None:
        """When the first answer a model wrote, asked after `moment`, ended: COMPLETE or
        PARTIAL, or INCOMPLETE for a reason only a written draft can have. The engine's
        proof of life: whether that draft passes the checks is the model's business, and
        waiting for a COMPLETE one measures the load's luck (one ask in nine at times)."""
        ends = [o.ended for o in self.outcomes if o.started >= moment and drafted(o)]
        return min(ends, default=None)

    def drafted_before(self, moment: float) -> list[float]:
        """How long each ask that a model wrote an answer for, ended before `moment`, took."""
        return [o.seconds for o in self.outcomes if o.ended <= moment and drafted(o)]

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for o in self.outcomes:
            counts[o.outcome] = counts.get(o.outcome, 0) + 1
        return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def writer(tenant: str) -> tuple[tuple[str, str], ...]:
    return (*who(tenant), ("x-ragline-scopes", WRITE_SCOPE))


def _reason(error: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason of a failed call; "" when it has none (no server reached)."""
    try:
        return error_info(error)[0]
    except AssertionError:
        return ""


@dataclass
class WriteLoad:
    """One writer upserting small documents to retrieval, one per call; `acknowledged`
    holds every id whose Upsert returned OK, `acknowledged_at` when (monotonic)."""

    address: str
    tenant: str = "default"
    acknowledged: list[str] = field(default_factory=list)
    acknowledged_at: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # code: message of each failed write
    _task: asyncio.Task | None = None
    _stopping: bool = False

    def start(self, run: str) -> None:
        self._task = asyncio.create_task(self._write(run))

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await self._task

    def first_acknowledged_after(self, moment: float) -> float | None:
        return next((t for t in self.acknowledged_at if t >= moment), None)

    async def _write(self, run: str) -> None:
        # The service's own reconnection rule, so a restart is measured, not this backoff.
        async with grpc.aio.insecure_channel(self.address, options=RECONNECT_OPTIONS) as channel:
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
            for number in itertools.count():
                if self._stopping:
                    return
                doc_id = f"{run}-w{number}"
                request = retrieval_pb2.UpsertRequest(
                    documents=[
                        common_pb2.Document(id=doc_id, title="", text=f"faultword{number} {run}")
                    ]
                )
                try:
                    # A call sent into a connection the restart broke waits out its whole
                    # timeout: short, so that the recovery measured is the service's, not
                    # this client's timeout (a write takes tens of ms).
                    await stub.Upsert(request, timeout=2, metadata=writer(self.tenant))
                    self.acknowledged.append(doc_id)
                    self.acknowledged_at.append(time.monotonic())
                except grpc.aio.AioRpcError as error:
                    self.failures.append(f"{error.code().name}: {error.details()}")
                    await asyncio.sleep(0.2)
                await asyncio.sleep(0.05)


async def absent(retrieval: str, ids: list[str]) -> list[str]:
    missing = []
    async with grpc.aio.insecure_channel(retrieval) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            reply = await stub.DocumentVersions(
                retrieval_pb2.DocumentVersionsRequest(ids=chunk), timeout=10, metadata=who()
            )
            missing += [doc for doc in chunk if doc not in reply.versions]
    return missing


async def in_flight_ledgers(budget: str, task_ids: list[str]) -> list[str]:
    found = []
    async with grpc.aio.insecure_channel(budget) as channel:
        stub = budget_pb2_grpc.BudgetServiceStub(channel)
        for task_id in task_ids:
            try:
                ledger = await stub.GetLedger(
                    budget_pb2.GetLedgerRequest(task_id=task_id), timeout=10, metadata=who()
                )
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    continue  # never opened: its ask was refused or failed before
                raise
            if ledger.in_flight or any(ledger.pending.ListFields()):
                found.append(f"{task_id}: in flight {ledger.in_flight}")
    return found


async def unsettled_after(budget: str, task_ids: list[str], within_s: float) -> list[str]:
    """The ledgers still holding reservations in flight after `within_s` (late
    settlements retried in the background may land meanwhile)."""
    give_up = time.monotonic() + within_s
    while True:
        unsettled = await in_flight_ledgers(budget, task_ids)
        if not unsettled or time.monotonic() > give_up:
            return unsettled
        await asyncio.sleep(0.5)
