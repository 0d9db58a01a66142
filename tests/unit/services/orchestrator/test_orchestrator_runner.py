"""The plan runner with stand-in executors: scheduling, failures, deadlines, cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from ragline import deadlines
from ragline.errors import DeadlineExceeded, Unavailable
from ragline_services.orchestrator.plan import Kind, Node, Plan
from ragline_services.orchestrator.report import critical_path
from ragline_services.orchestrator.runner import NodeState, PlanRunner


class Script:
    """Executors that sleep per node and log when each starts and ends."""

    def __init__(self, seconds: dict[str, float], fail: dict[str, Exception] | None = None):
        self.seconds = seconds
        self.fail = fail or {}
        self.log: list[tuple[str, str, float]] = []
        self.cancelled: list[str] = []
        self.deadlines: dict[str, float | None] = {}

    def executors(self):
        async def run(step):
            node_id = step.node.id
            self.deadlines[node_id] = deadlines.remaining()
            step.mark("call_start")
            self.log.append(("start", node_id, time.monotonic()))
            try:
                await asyncio.sleep(self.seconds.get(node_id, 0.0))
            except asyncio.CancelledError:
                self.cancelled.append(node_id)
                raise
            step.mark("call_end")
            self.log.append(("end", node_id, time.monotonic()))
            if node_id in self.fail:
                raise self.fail[node_id]
            return [node_id, *step.inputs]

        return {kind: run for kind in Kind}

    def time_of(self, event: str, node_id: str) -> float:
        return next(t for e, n, t in self.log if e == event and n == node_id)


def diamond(optional_c: bool = False) -> Plan:
    return Plan(
        (
            Node("a", Kind.RETRIEVE),
            Node("slow", Kind.RETRIEVE),
            Node("c", Kind.RERANK, ("a",), optional=optional_c),
            Node("g", Kind.GENERATE, ("c", "slow")),
        )
    )


async def test_a_node_starts_as_soon_as_its_own_inputs_exist():
    script = Script({"a": 0.01, "slow": 0.3, "c": 0.01})
    result = await PlanRunner(diamond(), script.executors()).run()
    assert result.failure is None and result.records["g"].state == NodeState.SUCCEEDED
    # c depends only on a: it ran while `slow` was still running.
    assert script.time_of("end", "c") < script.time_of("end", "slow")
    assert script.time_of("start", "g") >= script.time_of("end", "slow")
    path = critical_path(diamond(), result.records)
    assert path.nodes == ["slow", "g"]


async def test_a_failed_optional_node_passes_its_inputs_through():
    script = Script({}, fail={"c": Unavailable("rerank down")})
    result = await PlanRunner(diamond(optional_c=True), script.executors()).run()
    assert result.records["c"].state == NodeState.FAILED
    assert result.degraded == ["rerank_unavailable"]
    assert result.records["c"].output == ["a"]  # what c received
    assert result.records["g"].state == NodeState.SUCCEEDED and result.answer[1] == ["a"]


async def test_a_failed_required_node_stops_the_run_and_cancels_the_rest():
    script = Script({"slow": 5.0}, fail={"a": Unavailable("retrieval down")})
    result = await PlanRunner(diamond(), script.executors()).run()
    assert ("end", "slow") not in [(e, n) for e, n, _ in script.log]  # not waited for
    assert result.failure is result.records["a"]
    assert "UNAVAILABLE: retrieval down" == result.records["a"].error
    assert result.records["slow"].state == NodeState.CANCELLED and script.cancelled == ["slow"]
    assert {result.records[n].state for n in ("c", "g")} == {NodeState.SKIPPED}


async def test_a_node_deadline_is_its_stage_budget_within_the_run():
    plan = Plan((Node("a", Kind.RETRIEVE, budget_s=0.2), Node("g", Kind.GENERATE, ("a",))))
    script = Script({})
    with deadlines.deadline_scope(5.0):
        await PlanRunner(plan, script.executors()).run()
    assert script.deadlines["a"] <= 0.2
    assert 4.0 < script.deadlines["g"] <= 5.0


async def test_a_node_over_its_budget_fails_with_deadline_exceeded():
    plan = Plan((Node("a", Kind.RETRIEVE, budget_s=0.05), Node("g", Kind.GENERATE, ("a",))))

    async def overrun(step):
        async with asyncio.timeout_at(deadlines.current_deadline()):
            await asyncio.sleep(1)

    executors = {**Script({}).executors(), Kind.RETRIEVE: overrun}
    result = await PlanRunner(plan, executors).run()
    assert result.failure is result.records["a"]
    assert isinstance(result.failure.exception, TimeoutError)


async def test_no_time_left_means_no_call():
    script = Script({})
    with deadlines.deadline_scope(0.0001):
        await asyncio.sleep(0.01)
        result = await PlanRunner(diamond(), script.executors()).run()
    assert isinstance(result.failure.exception, DeadlineExceeded)
    assert script.log == []


async def test_optional_nodes_the_time_cannot_afford_are_skipped():
    script = Script({})
    runner = PlanRunner(
        diamond(optional_c=True), script.executors(), skip_reason=lambda node: "rerank_skipped"
    )
    result = await runner.run()
    assert result.records["c"].state == NodeState.SKIPPED and result.degraded == ["rerank_skipped"]
    assert "c" not in [n for _, n, _ in script.log]
    assert result.records["g"].state == NodeState.SUCCEEDED


async def test_cancelling_the_run_cancels_every_node_in_flight():
    script = Script({"a": 5.0, "slow": 5.0})
    changes = []
    runner = PlanRunner(diamond(), script.executors(), on_change=lambda r: changes.append(r.state))
    task = asyncio.create_task(runner.run())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(script.cancelled) == ["a", "slow"]
    assert (
        runner.records["a"].state == NodeState.CANCELLED
        and runner.records["slow"].state == NodeState.CANCELLED
    )


async def test_a_step_that_abstains_stops_the_run_without_failing():
    from ragline_services.orchestrator.runner import Abstain

    plan = Plan(
        (
            Node("search", Kind.RETRIEVE),
            Node("slow", Kind.RETRIEVE),
            Node("evidence", Kind.SELECT_EVIDENCE, ("search",)),
            Node("generate", Kind.GENERATE, ("evidence", "slow")),
        )
    )
    script = Script(
        {"slow": 5.0}, fail={"evidence": Abstain("no_relevant_evidence", "nothing relevant")}
    )
    started = time.monotonic()
    result = await PlanRunner(plan, script.executors()).run()
    assert time.monotonic() - started < 2  # the slow branch was cancelled, not awaited
    assert result.failure is None and result.answer is None
    assert result.abstained is result.records["evidence"]
    assert result.records["evidence"].state == NodeState.SUCCEEDED
    assert "nothing relevant" in result.records["evidence"].note
    assert result.records["generate"].state == NodeState.SKIPPED
    assert result.records["slow"].state == NodeState.CANCELLED and script.cancelled == ["slow"]
    # An answer step that abstains never ran its model: SKIPPED, not SUCCEEDED.
    script = Script({}, fail={"generate": Abstain("no_relevant_evidence", "nothing")})
    result = await PlanRunner(plan, script.executors()).run()
    assert result.abstained is result.records["generate"]
    assert result.records["generate"].state == NodeState.SKIPPED
