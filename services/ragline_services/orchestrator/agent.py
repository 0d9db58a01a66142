"""The agent plan: a planning call writes the lookups a question needs, they run in
parallel, a synthesis answers from their merged evidence. Pure decisions here (routing,
the planner's prompt and schema, what the budget affords, the plan's graph); the calls
are steps (agent_steps.py, retrieval_steps.py), the run is core.py's.

The planner's reply must be JSON valid against `AgentPlan`; a malformed reply is asked for
once more (with what was wrong), then the run falls back to the RAG plan and says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ragline.budget import Amounts
from ragline.vocabulary import SearchMode
from ragline_services.orchestrator import followup
from ragline_services.orchestrator.params import RetrieveParams
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


# The router's rule (checkable, no model): a question that joins several questions goes to
# the agent plan. Clauses are cut where one question ends and another begins: a question
# mark with more text after it, a semicolon, a colon before a question, "and also",
# "as well as" / "and" before a question word, and their Chinese forms.
_ASKS = r"what|who|whom|when|where|which|how|why|whose|is|are|was|were|did|does|do|can|could"
_QUESTION_WORD = re.compile(rf"^\W*(?:{_ASKS})\b", re.IGNORECASE)
_CJK_ASK = re.compile(r"什么|哪|谁|多少|几|如何|怎么|怎样|为什么|为何|是否|吗|呢")
_CUTS = re.compile(
    r"(?<=[?？])\s*(?=\S)"  # "A? B?"
    r"|\s*[;；]\s*"  # "A; B?" (kept only before a question, below: "Reno; Fresno; ...")
    r"|\s*[:：]\s*(?=\S)"  # "A: B?" (kept only before a question, below)
    r"|,?\s+and also[:,]?\s+"  # "A, and also B?"
    r"|,?\s+as well as\s+"  # "A, as well as when B?" (kept only before a question)
    # "A and who B?", "A, and in which year B?"
    r"|,?\s+and\s+(?=(?:(?:in|on|at|for|from|to|by|with|since|under|of|during)\s+)?"
    r"(?:what|who|whom|when|where|which|how|why|whose)\b)"
    r"|，?\s*(?:以及|还有|另外|并且|同时)\s*"  # Chinese joiners (kept before a question)
    r"|\s*，\s*",  # "A在哪里，B是多少？" (kept only between two questions)
    re.IGNORECASE,
)
_NEEDS_A_QUESTION_AFTER = re.compile(
    r"^\s*[:：;；]|as well as|以及|还有|另外|并且|同时", re.IGNORECASE
)


_WH_ANYWHERE = re.compile(r"\b(?:what|who|whom|when|where|which|how|why|whose)\b", re.I)
# A request put as an order ("Name the river ... and who built ...") asks too.
_REQUEST = re.compile(r"^\W*(?:name|list|give|tell|describe|explain|state|find|show)\b", re.I)


def _is_question(clause: str) -> bool:
    """Whether `clause` asks something by itself: a question mark ends it, or a question
    word, an auxiliary opening it, a request. "The Rhine is between Koblenz" does not:
    "... and what other city?" fills its slot, one question."""
    return bool(
        clause.rstrip().endswith(("?", "？"))
        or _WH_ANYWHERE.search(clause)
        or _asks(clause)
        or _REQUEST.search(clause)
    )


def _asks(clause: str) -> bool:
    return bool(_QUESTION_WORD.search(clause) or _CJK_ASK.search(clause))


def _words(text: str) -> int:
    return len(text.split()) + len(re.findall(r"[\u4e00-\u9fff]", text)) // 2


def clauses(question: str) -> list[str]:
    """The separate questions `question` joins (one item for a simple question)."""
    text = question.strip()
    found: list[str] = []
    start = 0
    for cut in _CUTS.finditer(text):
        before, after = text[start : cut.start()], text[cut.end() :]
        if not before.strip() or len(after.strip()) < 3:
            continue
        joiner = cut.group(0)
        if after.lstrip().startswith(("(", "（")):
            continue  # "When was it built? (Sigismund's Column)": a subject, not a question
        if _NEEDS_A_QUESTION_AFTER.search(joiner) and not _asks(after):
            continue  # "X as well as Y" joins words, not questions
        if ":" in joiner and not (_WH_ANYWHERE.search(before) or _CJK_ASK.search(before)):
            continue  # "Answer this: what ...?" is one question
        if joiner.strip() == "，" and not (_CJK_ASK.search(before) and _CJK_ASK.search(after)):
            continue  # a comma inside one question
        if _words(before) < 2 or _words(after) < 2:
            continue  # "Who founded it and when?" asks two things of one lookup
        if "also" not in joiner.lower() and not _is_question(before):
            continue  # "X is between Koblenz and what other city?" is one question
        found.append(before.strip(" ,，"))
        start = cut.end()
    found.append(text[start:].strip(" ,，"))
    return [c for c in found if c]


def clause_lookups(question: str) -> tuple[str, ...]:
    """The router's lookups for a question that joins several: its clauses, a later one
    that refers back ("... and which hash does it use?") read with the first one's subject
    (followup.py's rule), since each is searched alone."""
    found = clauses(question)
    if len(found) < 2:
        return ()
    first = [followup.Turn("user", found[0])]
    return (found[0], *(followup.resolve(clause, first).question for clause in found[1:]))


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
            params=RetrieveParams(query=sub.query, mode=SearchMode.HYBRID, k=k, charged=True),
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
