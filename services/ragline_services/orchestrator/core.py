"""The orchestrator's domain: admit a run, open its budget, run its plan, report.

No protobuf is built here beyond the requests the steps send downstream; the servicer
turns an AskOutcome and the run's events into AskResponse messages.

Why one file of this length: admission, the budget's task and the plan's run share one
run's lifetime (its deadline, its ledger, its report); the steps are their own modules.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from ragline import deadlines
from ragline.budget import Amounts, TaskBudget
from ragline.retry import DEFAULT_POLICY
from ragline.timing import duration
from ragline.v1 import budget_pb2
from ragline.vocabulary import CachePolicy
from ragline_services.orchestrator import answer_cache, answerability
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.admission import Admission
from ragline_services.orchestrator.agent import (
    AgentPlan,
    Costs,
    SubQuery,
    affordable,
    agent_plan,
    with_planning,
)
from ragline_services.orchestrator.caches import (
    ANSWER,
    CacheUse,
    OrchestratorCaches,
    Viewer,
)
from ragline_services.orchestrator.plan import Kind, Node, Plan
from ragline_services.orchestrator.report import CriticalPath, critical_path
from ragline_services.orchestrator.run_context import (
    Clients,
    Planned,
    RunContext,
    Settings,
)
from ragline_services.orchestrator.runner import NodeRecord, NodeState, PlanRunner, RunResult
from ragline_services.orchestrator.steps import executors_for
from ragline_services.orchestrator.verdict import AnswerState, Written, of_run
from ragline_services.orchestrator.wording import status_detail

# Kept back from the caller's deadline to settle the budget, close the ledger and send the
# result: a few loopback calls, far under this on any node.
ANSWER_MARGIN_S = 0.15
# An optional step is dropped (when the request allows) unless this much would remain for
# the answer after it: a short answer's generation on the small tier.
RESERVE_FOR_ANSWER_S = 1.0

log = structlog.get_logger("ragline.orchestrator")


# Time a closing ledger read may take after the run (bookkeeping, not the answer).
_CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class AskInput:
    settings: Settings
    limits: Amounts
    task_id: str = ""
    plan: Plan | None = None
    # Whose view the caches hold (None: no caching), and how this run uses them.
    viewer: Viewer | None = None
    cache_policy: CachePolicy = CachePolicy.USE
    # The agent plan (chosen by the caller or the router) instead of the RAG plan.
    agent: bool = False
    route_reason: str = ""
    # The questions the router found joined in the question (its rule, agent.py): the
    # lookups themselves, no planning call. Empty: the planner writes them.
    clauses: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeChanged:
    record: NodeRecord
    at_s: float  # since the request arrived


@dataclass(frozen=True)
class Delta:
    text: str


Event = NodeChanged | Delta


@dataclass(frozen=True)
class AskOutcome:
    """Everything the servicer reports of one run, built once at its end."""

    task_id: str
    state: AnswerState
    reason: str
    detail: str
    written: Written
    plan: Plan
    records: dict[str, NodeRecord]
    critical: CriticalPath
    received: float
    admitted: float
    plan_ready: float
    finished: float
    ledger: budget_pb2.Ledger | None = None
    degraded: list[str] = field(default_factory=list)
    cache: CacheUse = field(default_factory=CacheUse)
    # Which plan answered ("rag", "agent", "rag_fallback", "explicit") and why.
    route: str = "rag"
    route_detail: str = ""
    subqueries: list[str] = field(default_factory=list)
    # The gate's estimate that the evidence answers the question (None: not computed).
    answerability: float | None = None

    @property
    def end_to_end_s(self) -> float:
        return self.finished - self.received


@dataclass(frozen=True)
class OrchestratorSettings:
    max_in_flight: int
    max_queue: int
    max_queue_per_tenant: int
    max_deadline_s: float
    stage_budgets: dict[Kind, float]
    default_limits: Amounts
    rerank: bool


class Orchestrator:
    def __init__(
        self,
        clients: Clients,
        settings: OrchestratorSettings,
        caches: OrchestratorCaches | None = None,
    ) -> None:
        self.clients = clients
        self.settings = settings
        self.caches = caches
        self.admission = Admission(
            settings.max_in_flight,
            settings.max_queue,
            max_queue_per_tenant=settings.max_queue_per_tenant,
        )
        # The runs under way: when a tenant asks for more than it gets, another tenant's
        # run already generating may have turned light (its generation is sent again,
        # marked, while still reading its prompt). `generations_raised` counts those.
        self._runs: set[RunContext] = set()
        self.admission.on_pressure = self._turn_light_runs
        self.generations_raised = 0
        # Recent duration of each kind of step (moving average): what an optional step is
        # expected to cost when time runs short.
        self.typical_s: dict[Kind, float] = {}

    # -- one run ----------------------------------------------------------------------------

    async def ask(
        self,
        request: AskInput,
        emit: Callable[[Event], None],
        *,
        received: float,
        run_id: str,
        default_plan: Plan,
    ) -> AskOutcome:
        plan = request.plan or default_plan
        key = self._answer_key(request, plan)
        looked_up = bool(key) and request.cache_policy == CachePolicy.USE
        if looked_up:
            # Before admission: a hit is a few cheap calls, it never queues behind runs.
            cached = await self._cached_answer(key, request, plan, received)
            if cached is not None:
                emit(Delta(cached.written.answer))
                return cached
        tenant = request.viewer.tenant if request.viewer is not None else ""
        # A caller's deadline is capped: no run holds a place (or a queue entry) for longer.
        with deadlines.deadline_scope(self.settings.max_deadline_s or None):
            async with self.admission.admit(deadlines.current_deadline(), tenant) as place:
                left = deadlines.remaining()
                # Keep back time to settle, close the ledger and send the result.
                scope = None if left is None else max(left - ANSWER_MARGIN_S, 0.001)
                with deadlines.deadline_scope(scope):
                    outcome = await self._run(
                        request,
                        emit,
                        received,
                        place.admitted,
                        run_id,
                        plan,
                        light_tenant=lambda: self.admission.light(tenant),
                        others_running=lambda: self.admission.in_flight - 1,
                    )
                place.ran_out = outcome.reason == "deadline"
        outcome.cache.answer_miss = looked_up
        if (
            key
            and self.caches is not None
            and request.cache_policy != CachePolicy.BYPASS
            and outcome.state == AnswerState.COMPLETE
            and request.viewer is not None
        ):
            await answer_cache.remember(self.caches, key, outcome, request.viewer)
        return outcome

    def _turn_light_runs(self) -> None:
        for ctx in self._runs:
            ctx.turn_light_if_so()

    # -- the answer cache (answer_cache.py) ----------------------------------------------------

    def _answer_key(self, request: AskInput, plan: Plan) -> str:
        if (
            self.caches is None
            or request.viewer is None
            or request.cache_policy == CachePolicy.BYPASS
        ):
            return ""
        return answer_cache.answer_key(
            self.caches, request.viewer, request.settings, plan, request.agent
        )

    async def _cached_answer(
        self, key: str, request: AskInput, plan: Plan, received: float
    ) -> AskOutcome | None:
        """The stored answer, as this run's outcome, when it may be served now."""
        assert self.caches is not None
        entry = await answer_cache.lookup(self.caches, self.clients, key)
        if entry is None:
            return None
        now = time.monotonic()
        records = {
            node.id: NodeRecord(node, state=NodeState.SUCCEEDED, cached=ANSWER)
            for node in plan.nodes
        }
        return AskOutcome(
            task_id=request.task_id,
            state=AnswerState.COMPLETE,
            reason="",
            detail="answered from the answer cache",
            written=entry.written(),
            plan=plan,
            records=records,
            critical=critical_path(plan, records),
            received=received,
            admitted=received,
            plan_ready=now,
            finished=now,
            cache=CacheUse(answer_hit=True, saved=list(entry.saved)),
            route=entry.route,
            route_detail="answered from the answer cache",
            subqueries=list(entry.subqueries),
        )

    async def _run(
        self,
        request: AskInput,
        emit: Callable[[Event], None],
        received: float,
        admitted: float,
        run_id: str,
        plan: Plan,
        *,
        light_tenant: Callable[[], bool] | None = None,
        others_running: Callable[[], int] | None = None,
    ) -> AskOutcome:
        # A caller's own task id may be shared by several Asks (one budget for an agent's
        # whole job): joined if open, opened if not, never closed here. A task this run
        # made up is its own, and closed at its end.
        own_task = not request.task_id
        task_id = request.task_id or f"ask-{uuid.uuid4().hex[:16]}"
        budget = TaskBudget(self.clients.budget, task_id, retry=DEFAULT_POLICY)
        await self._open_task(budget, request.limits, join=not own_task)
        plan_ready = time.monotonic()
        ctx = self._context(request, budget, run_id, emit, light_tenant, others_running)

        def changed(record: NodeRecord) -> None:
            self._learn_duration(record)
            emit(NodeChanged(record, time.monotonic() - received))

        def runner_for(graph: Plan) -> PlanRunner:
            return PlanRunner(
                graph,
                executors_for(ctx),
                on_change=changed,
                stage_budget=self._stage_budget,
                skip_reason=lambda node: self._skip_reason(node, request.settings.allow_degrade),
            )

        ledger = None
        self._runs.add(ctx)
        try:
            plan, result, route = await self._dispatch(ctx, budget, runner_for, request, plan)
        finally:
            self._runs.discard(ctx)
            self.generations_raised += ctx.raised_light
            await ctx.wait_settled()
            ledger = await self._final_ledger(budget, close=own_task)
        degraded = list(dict.fromkeys([*result.degraded, *ctx.degraded]))
        verdict, written = of_run(result, degraded)
        detail = verdict.detail
        if route.name == "rag_fallback":
            detail = "; ".join(filter(None, [detail, route.detail]))
        return AskOutcome(
            task_id=task_id,
            state=verdict.state,
            reason=verdict.reason,
            detail=status_detail(request.settings.question, verdict.reason, detail),
            written=written,
            plan=plan,
            records=result.records,
            critical=critical_path(plan, result.records),
            received=received,
            admitted=admitted,
            plan_ready=plan_ready,
            finished=time.monotonic(),
            ledger=ledger,
            degraded=degraded,
            cache=ctx.cache_use,
            route=route.name,
            route_detail=route.detail,
            subqueries=route.subqueries,
            answerability=_answerability(result.records),
        )

    def _context(
        self,
        request: AskInput,
        budget: TaskBudget,
        run_id: str,
        emit: Callable[[Event], None],
        light_tenant: Callable[[], bool] | None,
        others_running: Callable[[], int] | None,
    ) -> RunContext:
        """What the run's steps share: clients, budget, settings, caches as the request's
        cache policy allows, and the stream its answer's text goes out on."""
        return RunContext(
            self.clients,
            budget,
            request.settings,
            run_id,
            lambda text: emit(Delta(text)),
            caches=self.caches,
            viewer=request.viewer,
            read_cache=request.cache_policy == CachePolicy.USE,
            write_cache=request.cache_policy != CachePolicy.BYPASS,
            light_tenant=light_tenant,
            others_running=others_running,
        )

    async def _dispatch(
        self, ctx: RunContext, budget: TaskBudget, runner_for, request: AskInput, plan: Plan
    ) -> tuple[Plan, RunResult, _Route]:
        """The plan that runs (the agent's, when the request is one) and its result."""
        if request.agent and request.clauses:
            return await self._run_clauses(ctx, budget, runner_for, request.clauses)
        if request.agent:
            return await self._run_agent(ctx, budget, runner_for, plan)
        route = _Route("explicit" if request.plan else "rag", request.route_reason)
        return plan, await runner_for(plan).run(), route

    # -- the agent plan -------------------------------------------------------------------------

    async def _run_clauses(
        self, ctx: RunContext, budget: TaskBudget, runner_for, clauses: tuple[str, ...]
    ):
        """The agent plan's lookups and synthesis for the questions the router found joined:
        each clause is a lookup and the part its answer answers, as written (a planning
        call cost a model run, and the small model's lookups were keyword fragments that
        its part answers then echoed: docs/answer-states.md)."""
        planned = AgentPlan(subqueries=[SubQuery(query=clause) for clause in clauses])
        graph, result, kept, dropped = await self._lookups_and_synthesis(
            ctx, budget, runner_for, planned
        )
        route = _Route(
            "agent",
            f"the router's {len(clauses)} questions, {len(kept)} looked up in parallel"
            + (f", {len(dropped)} optional dropped for the budget" if dropped else ""),
            list(clauses),
        )
        return graph, result, route

    async def _lookups_and_synthesis(
        self, ctx: RunContext, budget: TaskBudget, runner_for, planned: AgentPlan
    ):
        """Runs the lookups of `planned` the budget affords, in parallel, and the synthesis:
        (the graph, its result, the lookups kept, those dropped)."""
        s = ctx.settings
        remaining = await self._remaining(budget)
        # A lookup: its search (the query embedded), its sentences embedded for the gate
        # and the evidence, its part's answer. The synthesis: the one embedding call.
        costs = Costs(
            subquery=Amounts(
                input_tokens=64 + s.embed_sentences * 40 + s.evidence_tokens + 150,
                output_tokens=s.answer_tokens,
                calls=2,
            ),
            synthesis=Amounts(calls=1),
        )
        kept, dropped = affordable(planned, remaining, costs, allow_degrade=s.allow_degrade)
        graph = agent_plan(kept, allow_degrade=s.allow_degrade, k=min(s.candidates, 10))
        result = await runner_for(graph).run()
        for sub in dropped:
            result.degraded.append(f"lookup_dropped_budget: {sub.query}")
        return graph, result, kept, dropped

    async def _run_agent(self, ctx: RunContext, budget: TaskBudget, runner_for, rag: Plan):
        """Plans, then runs the lookups the plan affords in parallel and the synthesis;
        falls back to the RAG plan when the planner's replies were malformed twice."""
        planning = Node("plan", Kind.PLAN, budget_s=self.settings.stage_budgets.get(Kind.PLAN))
        first = await runner_for(Plan((planning,))).run()
        planned = first.records["plan"].output
        if first.failure is not None:
            return Plan((planning,)), first, _Route("agent", "the planning step failed")
        assert isinstance(planned, Planned)
        if planned.plan is None:
            second = await runner_for(rag).run()
            detail = (
                "the planner's replies were not a valid plan twice ("
                + "; ".join(planned.problems)
                + "): answered with the RAG plan"
            )
            return _merged_run(planning, first, rag, second, _Route("rag_fallback", detail))
        graph, second, kept, dropped = await self._lookups_and_synthesis(
            ctx, budget, runner_for, planned.plan
        )
        route = _Route(
            "agent",
            f"{len(kept)} lookup(s) run in parallel"
            + (f", {len(dropped)} optional dropped for the budget" if dropped else ""),
            [sub.query for sub in planned.plan.subqueries],
        )
        if planned.problems:
            route.detail += f" (the first plan was malformed: {planned.problems[0]})"
        return _merged_run(planning, first, graph, second, route)

    async def _remaining(self, budget: TaskBudget) -> Amounts | None:
        try:
            ledger = await budget.call(
                "GetLedger", budget_pb2.GetLedgerRequest(task_id=budget.task_id)
            )
        except grpc.aio.AioRpcError:
            return None  # unknown: nothing dropped in advance; reservations still guard
        return Amounts.from_proto(ledger.remaining)

    # -- budget -----------------------------------------------------------------------------

    async def _open_task(self, budget: TaskBudget, limits: Amounts, *, join: bool) -> None:
        if join:
            try:
                ledger = await budget.call(
                    "GetLedger", budget_pb2.GetLedgerRequest(task_id=budget.task_id)
                )
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            else:
                if ledger.state == budget_pb2.TASK_STATE_OPEN:
                    return
        left = deadlines.remaining()
        request = budget_pb2.OpenTaskRequest(task_id=budget.task_id, limits=limits.to_proto())
        # The ledger outlives the run a little: late settlements and the closing read.
        request.timeout.CopyFrom(duration((left or 600.0) + _CLOSE_TIMEOUT_S))
        await budget.call("OpenTask", request)

    async def _final_ledger(self, budget: TaskBudget, *, close: bool):
        """The ledger after every settlement; the run's own task is closed on the way."""

        async def close_or_read():
            with deadlines.detached(_CLOSE_TIMEOUT_S):
                if not close:
                    return await budget.call(
                        "GetLedger", budget_pb2.GetLedgerRequest(task_id=budget.task_id)
                    )
                reply = await budget.call(
                    "CloseTask", budget_pb2.CloseTaskRequest(task_id=budget.task_id)
                )
            return reply.ledger

        try:
            return await asyncio.shield(asyncio.ensure_future(close_or_read()))
        except grpc.aio.AioRpcError as error:
            log.warning("budget.close_failed", task=budget.task_id, error=error.details())
            return None

    # -- policy ---------------------------------------------------------------------------

    def _learn_duration(self, record: NodeRecord) -> None:
        """What a step of its kind typically takes (a moving average), for _skip_reason."""
        if record.state == NodeState.SUCCEEDED and record.duration_s:
            kind = record.node.kind
            last = self.typical_s.get(kind, record.duration_s)
            self.typical_s[kind] = 0.8 * last + 0.2 * record.duration_s

    def _stage_budget(self, node: Node) -> float | None:
        return node.budget_s or self.settings.stage_budgets.get(node.kind)

    def _skip_reason(self, node: Node, allow_degrade: bool) -> str | None:
        """Drop an optional step that the time left cannot afford (when the request allows
        degrading): its expected cost plus what the answer still needs must fit."""
        left = deadlines.remaining()
        expected = self.typical_s.get(node.kind)
        if not allow_degrade or left is None or expected is None:
            return None
        if left < expected + RESERVE_FOR_ANSWER_S:
            return f"{node.kind.value}_skipped_deadline"
        return None


@dataclass
class _Route:
    name: str
    detail: str = ""
    subqueries: list[str] = field(default_factory=list)


def _merged_run(planning: Node, first, graph: Plan, second, route: _Route):
    """The two phases of an agent run as one plan and one result for the report."""
    plan = with_planning(planning, graph)
    second.records = {"plan": first.records["plan"], **second.records}
    for record in second.records.values():
        record.node = plan.node(record.node.id)  # with its edge from the planning step
    second.degraded = [*first.degraded, *second.degraded]
    return plan, second, route


def _answerability(records: dict[str, NodeRecord]) -> float | None:
    """The gate's estimate, from the evidence step that computed one."""
    for record in records.values():
        output = record.output
        if isinstance(output, ev.Evidence) and output.signals is not None:
            return output.signals.probability
        if isinstance(record.exception, answerability.NotAnswerable):
            return record.exception.signals.probability
    return None
