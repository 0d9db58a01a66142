"""SIGKILL of each part of a running stack under steady load, then a restart.

Two closed-loop askers (10 s deadlines, caches bypassed, each ask its own budget task) and
one writer run against real processes while one part is killed outright, left down for
`DOWN_S`, and started again on its port. Whatever was killed:
- no call ends INTERNAL or UNKNOWN (a fault is reported as what it is, or degrades);
- no call outlives its deadline by more than 0.5 s;
- every acknowledged write is there afterwards;
- every budget task the load opened ends with nothing in flight (settled, or never
  reserved) within `SETTLED_WITHIN_S`, but where the orchestrator that held it was killed;
- no engine process outlives a killed service;
- COMPLETE answers come again within `RECOVERY_S` of the restart (generation: answers
  the model writes, once its model is loaded, within `RECOVERY_AFTER_LOAD_S`, or
  `after_load_s` on a slower machine), and acknowledged writes within
  `WRITES_BACK_S` of the restarted part serving;
- without an optional stage (embedding, rerank) every ask is still answered or judged on
  the evidence found (a draft the answer checks refused, the model saying the evidence does
  not answer, the answerability gate): never an error, nor a step that could not run; and
  at least half of them are answered. (Which questions the small model answers without
  rerank's ordering is the model's business: of six questions in turn, two at times end
  ungrounded or unverified; with 3 to 7 asks in a 10 s window, a floor of 60% measured
  where in the cycle the window fell, and failed CI once at 4 of 7.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from ragline.clients import RECONNECT_OPTIONS
from support.load import AskLoad, WriteLoad, absent, judged, unsettled_after
from support.processes import children, seconds_until_gone, states

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.full]

DOWN_S = 3.0
DOWN_OPTIONAL_S = 20.0
RECOVERY_S = 20.0
RECOVERY_AFTER_LOAD_S = 5.0
WRITES_BACK_S = 5.0
SETTLED_WITHIN_S = 15.0
# An engine is sent SIGKILL by the kernel when its service dies: gone at once.
ENGINE_GONE_S = 5.0
# Optional stages: asks go on being answered (PARTIAL, naming what is missing) without them.
ANSWERED_WITHOUT = ("embedding", "rerank")
ANSWERED_SHARE_WITHOUT = 0.5
PARTS = ["embedding", "retrieval", "rerank", "generation", "budget", "orchestrator", "etcd"]


def after_load_s(answered_before: list[float]) -> float:
    """How long after a restarted generation service serves again COMPLETE answers must be
    back: the goal, or on a machine slower than the one it was set on, the clients'
    reconnection cap and two asks as long as the slowest answered before the kill (one
    the restart cut short, one on the cold engine). Timed in the same run, so a loaded
    machine does not turn its own slowness into a failure."""
    reconnect_s = dict(RECONNECT_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000
    return max(RECOVERY_AFTER_LOAD_S, reconnect_s + 2 * max(answered_before, default=0.0))


async def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("part", PARTS)
async def test_sigkill_under_load_then_restart(fault_stack, part):
    stack = fault_stack
    asks = AskLoad(stack.parts["orchestrator"].address, deadline_s=10.0)
    writes = WriteLoad(stack.parts["retrieval"].address)
    asks.start(run=f"kill-{part}")
    writes.start(run=f"kill-{part}")
    try:
        steady = time.monotonic()
        await wait_for(
            lambda: asks.first_complete_after(steady) is not None, 60, "a COMPLETE answer"
        )
        engines = []
        if part == "generation":
            engines = children(stack.parts["generation"].process.pid, b"llama-server")
            assert engines
        killed_at = time.monotonic()
        written_before = len(writes.acknowledged)
        await asyncio.to_thread(stack.kill, part)
        engine_gone_s = None
        if engines:
            engine_gone_s = await asyncio.to_thread(seconds_until_gone, engines, ENGINE_GONE_S)
            assert engine_gone_s is not None, f"the engine outlived it: {states(engines)}"
        # Long enough, without an optional stage, for the share answered to mean something.
        await asyncio.sleep(DOWN_OPTIONAL_S if part in ANSWERED_WITHOUT else DOWN_S)
        restarted_at = time.monotonic()
        await asyncio.to_thread(stack.restart, part)
        serving_s = time.monotonic() - restarted_at
        # Generation is back when its model writes answers again: the first COMPLETE one
        # also waits for a question the small model answers well (4 in 36 at times).
        back = asks.first_drafted_after if part == "generation" else asks.first_complete_after
        allowed_s = (
            serving_s + after_load_s(asks.drafted_before(killed_at))
            if part == "generation"
            else RECOVERY_S
        )
        await wait_for(
            lambda: back(restarted_at) is not None,
            allowed_s + asks.deadline_s,
            f"an answer after the restart of {part}",
        )
        recovered_s = back(restarted_at) - restarted_at
        await wait_for(
            lambda: writes.first_acknowledged_after(restarted_at) is not None,
            max(0.0, restarted_at + RECOVERY_S - time.monotonic()),
            f"a write acknowledged after the restart of {part}",
        )
        writes_back_s = writes.first_acknowledged_after(restarted_at) - restarted_at
    finally:
        await asks.stop()
        await writes.stop()

    down = asks.between(killed_at, restarted_at)
    answered = [o for o in down if o.outcome in ("COMPLETE", "PARTIAL")]
    print(
        f"\n{part}: while down {len(answered)} of {len(down)} asks answered; "
        f"serving {serving_s:.1f} s after the restart, answered again after "
        f"{recovered_s:.1f} s (allowed {allowed_s:.1f} s), writes again after "
        f"{writes_back_s:.1f} s; "
        + (f"engine gone {engine_gone_s:.2f} s after the kill; " if engines else "")
        + f"asks {asks.summary()}; writes acknowledged "
        f"{len(writes.acknowledged)}, failed {len(writes.failures)}: "
        f"{sorted(set(writes.failures))[:3]}"
    )
    assert not asks.bugs(), [(o.outcome, o.reason) for o in asks.bugs()]
    assert not asks.late(0.5), [(o.outcome, round(o.seconds, 2)) for o in asks.late(0.5)]
    assert recovered_s <= allowed_s, f"answered again only after {recovered_s:.1f} s"
    assert writes_back_s <= serving_s + WRITES_BACK_S, f"writes again after {writes_back_s:.1f} s"
    if part in ANSWERED_WITHOUT:  # an optional stage: its absence degrades, not fails
        seen = [(asks.question_of(o)[:32], o.outcome, o.reason) for o in down]
        unjudged = [x for x, o in zip(seen, down, strict=True) if not judged(o)]
        assert not unjudged, unjudged
        assert len(answered) >= ANSWERED_SHARE_WITHOUT * len(down), seen
    assert 0 < written_before < len(writes.acknowledged), "writes before and after the kill"
    missing = await absent(stack.parts["retrieval"].address, writes.acknowledged)
    assert not missing, f"{len(missing)} acknowledged writes lost: {missing[:5]}"
    killed_runs = (
        {o.task_id for o in asks.outcomes if o.started <= killed_at <= o.ended}
        if part == "orchestrator"
        else set()
    )
    # A settlement the ledger could not take while it was down is retried in the background.
    unsettled = await unsettled_after(
        stack.parts["budget"].address,
        [o.task_id for o in asks.outcomes if o.task_id not in killed_runs],
        SETTLED_WITHIN_S,
    )
    assert not unsettled, f"ledgers with reservations still in flight: {unsettled[:5]}"
