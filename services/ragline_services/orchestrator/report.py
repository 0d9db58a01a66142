"""Where the time went: the critical path of a finished run and its lower bound. No gRPC.

The critical path is the longest dependency chain by measured node durations (a node's
own work: reserve -> result). No schedule of the same nodes could finish sooner than the
sum of its durations, so end-to-end / lower bound says what the orchestration itself
cost (1.0 is a perfect schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragline_services.orchestrator.plan import Plan, topological
from ragline_services.orchestrator.runner import NodeRecord


@dataclass(frozen=True)
class CriticalPath:
    nodes: list[str]
    lower_bound_s: float


def critical_path(plan: Plan, records: dict[str, NodeRecord]) -> CriticalPath:
    best: dict[str, tuple[float, list[str]]] = {}
    for node_id in topological(plan):
        node = plan.node(node_id)
        before = max(
            (best[dep] for dep in node.depends_on), key=lambda item: item[0], default=(0.0, [])
        )
        duration = records[node_id].duration_s
        best[node_id] = (before[0] + duration, [*before[1], node_id] if duration else before[1])
    if not best:
        return CriticalPath([], 0.0)
    total, path = max(best.values(), key=lambda item: item[0])
    return CriticalPath(path, total)
