"""The agent plan: a planning call writes the lookups a question needs, they run in
parallel, a synthesis answers from their merged evidence. Pure decisions here (routing,
the planner's prompt and schema, what the budget affords, the plan's graph); the calls
are steps (steps.py), the run is core.py's.

The planner's reply must be JSON valid against `AgentPlan`; a malformed reply is asked for
once more (with what was wrong), then the run falls back to the RAG plan and says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ragline.budget import Amounts
from ragline_services.orchestrator.plan import Kind, Node, Plan

MAX_SUBQUERIES = 4

PLANNER_PROMPT = (
    "Split the user's question into the separate search queries needed to answer it, one "
    "per fact to look up. Reply with JSON only, in this form:\n"
    '{"subqueries": [{"query": "first search query", "required": true}, '
    '{"query": "second search query", "required": true}]}\n'
    "Use one query when one lookup is enough. Mark a query required when the question "
    f"cannot be answered without it. At most {MAX_SUBQUERIES} queries."
)


SYNTHESIS_PROMPT = (
    "The question has several parts. Answer every part from the evidence, in order, "
    "separated by '; '. For each part give only a few words copied from the evidence, then "
    "its passage number in brackets."
)


class SubQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(min_length=3, max_length=400)
    required: bool = True


class AgentPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    subqueries: list[SubQuery] = Field(min_length=1, max_length=MAX_SUBQUERIES)


class MalformedPlan(ValueError):
    pass


_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def parse_plan(text: str) -> AgentPlan:
    """The plan in a model's reply (code fences and words around the JSON are tolerated);
    MalformedPlan saying what is wrong otherwise."""
    found = _JSON_OBJECT.search(text)
    if found is None:
        raise MalformedPlan("the reply holds no JSON object")
    try:
        data = json.loads(found.group(0))
    except ValueError as error:
        raise MalformedPlan(f"the JSON does not parse: {error}") from None
    try:
        plan = AgentPlan.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the object"
        raise MalformedPlan(f"{where}: {first['msg']}") from None
    # The same lookup twice is one lookup.
    seen: set[str] = set()
    unique = []
    for sub in plan.subqueries:
        key = " ".join(sub.query.lower().split())
        if key not in seen:
            seen.add(key)
            unique.append(sub)
    return AgentPlan(subqueries=unique)


# Questions that join several asks: "A, and also B?", "A? And B?", "A and what/who... B?".
_SEVERAL = re.compile(
    r",?\s+and also\s+|\?\s*(and\s+)?\w[^?]*\?|\s(and|also)\s+(what|who|whom|when|where|which|"
    r"how|why|whose)\s+\w+",
    re.IGNORECASE,
)


def needs_several_lookups(question: str) -> bool:
    """The router's rule (checkable, no model): the question joins several questions."""
    return bool(_SEVERAL.search(question.strip()))


@dataclass(frozen=True)
class Costs:
    """What one sub-query and the synthesis are expected to take from the budget."""

    subquery: Amounts
    synthesis: Amounts


def affordable(
    plan: AgentPlan, remaining: Amounts | None, costs: Costs, *, allow_degrade: bool
) -> tuple[list[SubQuery], list[SubQuery]]:
    """The sub-queries to run and those dropped: when the remaining budget cannot pay for
    every one and the synthesis, optional ones go first (last first), and only when the
    request allows degrading; required ones are never dropped here (their refusal ends
    the run INCOMPLETE)."""
    kept = list(plan.subqueries)
    if remaining is None or not allow_degrade:
        return kept, []
    dropped: list[SubQuery] = []

    def total() -> Amounts:
        spent = costs.synthesis
        for _ in kept:
            spent = spent + costs.subquery
        return spent

    for sub in reversed(plan.subqueries):
        if total().fits_within(remaining):
            break
        if not sub.required:
            kept.remove(sub)
            dropped.insert(0, sub)
    return kept, dropped


def agent_plan(subqueries: list[SubQuery], *, allow_degrade: bool, k: int) -> Plan:
    """One retrieval per sub-query, all in parallel, then the synthesis. An optional
    sub-query may fail without ending the run only when degrading is allowed."""
    nodes = [
        Node(
            f"lookup{i}",
            Kind.RETRIEVE,
            params={"query": sub.query, "mode": "hybrid", "k": k, "charged": True},
            optional=allow_degrade and not sub.required,
        )
        for i, sub in enumerate(subqueries, start=1)
    ]
    nodes.append(Node("synthesize", Kind.SYNTHESIZE, tuple(n.id for n in nodes)))
    return Plan(tuple(nodes))


def with_planning(planning: Node, plan: Plan) -> Plan:
    """The whole run as the report shows it: the planning node first, every node without
    inputs depending on it."""
    nodes = [planning] + [
        Node(n.id, n.kind, n.depends_on or (planning.id,), n.params, n.budget_s, n.optional)
        for n in plan.nodes
    ]
    return Plan(tuple(nodes))
