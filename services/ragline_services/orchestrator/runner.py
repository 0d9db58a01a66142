"""Runs a plan as a dependency graph. No gRPC here: each kind's executor is injected.

A node starts the moment every node it depends on has finished; independent nodes run
concurrently, so a slow node never delays one that does not depend on it. Each node runs
under its own deadline, min(its stage budget, what remains of the run). A failed optional
node (or one dropped for lack of time) passes its inputs through and is reported as
degraded; a failed required node stops the run (its dependents are skipped and whatever
still runs is cancelled). Cancelling the run cancels every node in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Span

from ragline import deadlines, tracing
from ragline.timing import summed_server_timing
from ragline_services.orchestrator.plan import Kind, Node, Plan

if TYPE_CHECKING:
    from ragline.v1 import common_pb2


class NodeState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


FINAL_STATES = frozenset(
    {NodeState.SUCCEEDED, NodeState.FAILED, NodeState.SKIPPED, NodeState.CANCELLED}
)


@dataclass
class NodeRecord:
    """What happened to one node, with monotonic timestamps (None: never reached)."""

    node: Node
    state: NodeState = NodeState.PENDING
    began: float | None = None  # its task started (every input ready)
    reserve_start: float | None = None
    call_start: float | None = None
    first_byte: float | None = None
    call_end: float | None = None
    settled: float | None = None
    finished: float | None = None
    # The service's own report of its queue and compute (a ServerTiming), when it sent one;
    # over several calls, summed (`calls` of them).
    server: common_pb2.ServerTiming | None = None
    calls: int = 0
    attempts: int = 0
    error: str = ""
    exception: BaseException | None = field(default=None, repr=False)
    output: object | None = field(default=None, repr=False)
    # Set on a node that ran in place of a real call (answered from its inputs).
    note: str = ""
    # The cache layer that answered the node ("answer", "retrieval", "tool"), if one did.
    cached: str = ""

    @property
    def started(self) -> float | None:
        return self.reserve_start or self.call_start

    def served(self, timing: common_pb2.ServerTiming) -> None:
        """The server's own timing of one call the node made, added to the others'."""
        self.calls += 1
        self.server = timing if self.server is None else summed_server_timing(self.server, timing)

    @property
    def duration_s(self) -> float:
        """The node's own work: from its first step to its result (settlement runs off the
        critical path, concurrently with the nodes that need the result)."""
        start = self.started
        end = self.call_end or self.finished
        return 0.0 if start is None or end is None else max(end - start, 0.0)


class Step:
    """The handle an executor gets: its node, its inputs, and the marks of its timeline."""

    def __init__(self, runner: PlanRunner, record: NodeRecord, inputs: list[object]) -> None:
        self._runner = runner
        self.record = record
        self.node = record.node
        self.inputs = inputs

    def upstream(self, kind: Kind) -> object | None:
        """Output of the nearest node of `kind` this node depends on, directly or not."""
        for ancestor in self._runner.plan.ancestors(self.node.id):
            record = self._runner.records[ancestor.id]
            if ancestor.kind == kind and record.state == NodeState.SUCCEEDED:
                return record.output
        return None

    def plan_node(self, node_id: str) -> Node:
        return self._runner.plan.node(node_id)

    def output_of(self, node_id: str) -> object | None:
        record = self._runner.records[node_id]
        return record.output if record.state == NodeState.SUCCEEDED else None

    def mark(self, what: str) -> None:
        now = time.monotonic()
        if what in ("first_byte", "reserve_start", "call_start"):
            # A node that makes several calls (an escalation, the verifier's second read)
            # began its work at its first: later calls extend it, they do not restart it.
            if getattr(self.record, what) is None:
                setattr(self.record, what, now)
            return
        setattr(self.record, what, now)
        if what == "settled":
            # Settlement runs beside the nodes that use the result: a child span that may
            # end after its node's.
            self._runner.traced_settlement(self.record, now)

    @property
    def is_answer(self) -> bool:
        answer = self._runner.plan.answer_node
        return answer is not None and self.node.id == answer.id


Executor = Callable[[Step], Awaitable[object]]


class Abstain(Exception):  # a decision, not an error
    """A step's decision that the run cannot answer, made before any answer is written
    (the evidence is plainly irrelevant): the run stops there. The step itself succeeded
    (an answer step that abstains never ran its model: it is SKIPPED); everything after it
    is SKIPPED. `reason` is machine-readable, `detail` says why to a person."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class RunResult:
    records: dict[str, NodeRecord]
    answer: object | None
    failure: NodeRecord | None
    degraded: list[str]
    # The step that decided the run cannot answer (its exception is an Abstain).
    abstained: NodeRecord | None = None


class PlanRunner:
    def __init__(
        self,
        plan: Plan,
        executors: Mapping[Kind, Executor],
        *,
        on_change: Callable[[NodeRecord], None] = lambda record: None,
        stage_budget: Callable[[Node], float | None] = lambda node: node.budget_s,
        skip_reason: Callable[[Node], str | None] = lambda node: None,
    ) -> None:
        self.plan = plan
        self.executors = executors
        self.records = {n.id: NodeRecord(n) for n in plan.nodes}
        self._on_change = on_change
        self._stage_budget = stage_budget
        self._skip_reason = skip_reason
        self.degraded: list[str] = []
        # Each node's span (tracing on): its calls are the span's children.
        self._spans: dict[str, Span] = {}

    def _set(self, record: NodeRecord, state: NodeState) -> None:
        record.state = state
        if state in FINAL_STATES:
            record.finished = time.monotonic()
            made = self._spans.get(record.node.id)
            if made is not None and made.is_recording():
                made.set_attribute("ragline.node.state", state)
                if record.cached:
                    made.set_attribute("ragline.node.cached", record.cached)
                tracing.finish(
                    made, record.finished, record.error if state == NodeState.FAILED else ""
                )
        self._on_change(record)

    def traced_settlement(self, record: NodeRecord, settled: float) -> None:
        started = record.call_end or record.started
        if started is not None:
            tracing.record(
                "budget settle", started, settled, parent=self._spans.get(record.node.id)
            )

    def _inputs(self, node: Node) -> list[object]:
        return [self.records[dep].output for dep in node.depends_on]

    async def _execute(self, record: NodeRecord) -> None:
        node = record.node
        step = Step(self, record, self._inputs(node))
        record.began = time.monotonic()
        made = tracing.start(
            f"node {node.id}",
            record.began,
            {"ragline.node.id": node.id, "ragline.node.kind": node.kind.value},
        )
        if made is not None:
            self._spans[node.id] = made
        with tracing.current(made), deadlines.deadline_scope(self._stage_budget(node)):
            deadlines.check(f"step {node.id}")
            record.output = await self.executors[node.kind](step)

    async def run(self) -> RunResult:
        pending = [n.id for n in self.plan.nodes]
        running: dict[asyncio.Task, NodeRecord] = {}
        failure: NodeRecord | None = None
        try:
            while pending or running:
                for node_id in list(pending):
                    record = self.records[node_id]
                    deps = [self.records[d] for d in record.node.depends_on]
                    if not all(d.state in FINAL_STATES for d in deps):
                        continue
                    pending.remove(node_id)
                    self._start(record, deps, running)
                if not running:
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    record = running.pop(task)
                    if self._finish(record, task) and failure is None:
                        failure = record
                if failure is not None:
                    break
        finally:
            for task in running:
                task.cancel()
            for task, record in list(running.items()):
                with contextlib.suppress(BaseException):
                    await task
                if record.state not in FINAL_STATES:
                    self._set(record, NodeState.CANCELLED)
        for node_id in pending:
            self._set(self.records[node_id], NodeState.SKIPPED)
        answer_node = self.plan.answer_node
        answer_record = self.records[(answer_node or self.plan.nodes[-1]).id]
        answer = answer_record.output if answer_record.state == NodeState.SUCCEEDED else None
        if failure is not None and isinstance(failure.exception, Abstain):
            return RunResult(self.records, None, None, self.degraded, abstained=failure)
        return RunResult(self.records, answer, failure, self.degraded)

    def _start(self, record: NodeRecord, deps: list[NodeRecord], running: dict) -> None:
        node = record.node
        blocked = [d for d in deps if d.state != NodeState.SUCCEEDED and not d.node.optional]
        if blocked:
            record.error = f"input {blocked[0].node.id} did not succeed"
            self._set(record, NodeState.SKIPPED)
            return
        reason = self._skip_reason(node) if node.optional else None
        if reason is not None:
            self._pass_through(record, reason, NodeState.SKIPPED)
            return
        self._set(record, NodeState.RUNNING)
        running[asyncio.create_task(self._execute(record), name=f"node-{node.id}")] = record

    def _finish(self, record: NodeRecord, task: asyncio.Task) -> bool:
        """Records a finished node; True when it failed and the run cannot go on."""
        error = task.exception() if not task.cancelled() else asyncio.CancelledError()
        if error is None:
            self._set(record, NodeState.SUCCEEDED)
            return False
        record.exception = error
        if isinstance(error, Abstain):
            record.note = f"abstained ({error.reason}): {error.detail}"
            answer = self.plan.answer_node
            self._set(
                record,
                NodeState.SKIPPED
                if answer and answer.id == record.node.id
                else NodeState.SUCCEEDED,
            )
            return True
        record.error = describe(error)
        if record.node.optional:
            self._pass_through(record, _reason_of(record.node, error), NodeState.FAILED)
            return False
        self._set(record, NodeState.FAILED)
        return True

    def _pass_through(self, record: NodeRecord, reason: str, state: NodeState) -> None:
        inputs = self._inputs(record.node)
        record.output = inputs[0] if len(inputs) == 1 else inputs
        record.note = reason
        self.degraded.append(reason)
        self._set(record, state)


def code_name(error: BaseException) -> str:
    """The status code name of a failed call or a ragline error ("" for anything else)."""
    code = getattr(error, "code", None)
    return code().name if callable(code) else getattr(code, "name", "")


def describe(error: BaseException) -> str:
    """One line for the report: the status code and what the server said."""
    message = getattr(error, "message", None)
    if message is None:  # a failed call carries what the server said in details()
        details = getattr(error, "details", None)
        message = details() if callable(details) else str(error)
    name = code_name(error) or type(error).__name__
    return f"{name}: {message}" if message else name


def _reason_of(node: Node, error: BaseException) -> str:
    name = code_name(error)
    if name in ("UNAVAILABLE", "UNIMPLEMENTED"):
        return f"{node.kind.value}_unavailable"
    if name == "DEADLINE_EXCEEDED" or isinstance(error, TimeoutError):
        return f"{node.kind.value}_skipped_deadline"
    if name == "RESOURCE_EXHAUSTED":
        return f"{node.kind.value}_skipped_budget"
    return f"{node.kind.value}_failed"
