"""Plans: a directed acyclic graph of steps, the default RAG plan, and the checks an
explicit plan must pass before anything runs. No gRPC here."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from ragline.errors import FieldViolation, InvalidArgument, Unimplemented
from ragline_services.orchestrator.params import (
    AnswerParams,
    Bm25Params,
    EvidenceParams,
    FuseParams,
    QueryParams,
    RerankParams,
    RetrieveParams,
    StepParams,
    VectorSearchParams,
    read_params,
)

P = TypeVar("P", bound=StepParams)


class Kind(enum.Enum):
    EMBED = "embed"
    BM25 = "bm25"
    VECTOR_SEARCH = "vector_search"
    RERANK = "rerank"
    GENERATE = "generate"
    PLAN = "plan"
    RETRIEVE = "retrieve"
    SYNTHESIZE = "synthesize"
    FUSE = "fuse"
    SELECT_EVIDENCE = "select_evidence"
    RERANK_QUERY = "rerank_query"


# The parameters of each kind (params.py says how each is read and checked).
PARAMS_OF: dict[Kind, type[StepParams]] = {
    Kind.EMBED: QueryParams,
    Kind.BM25: Bm25Params,
    Kind.VECTOR_SEARCH: VectorSearchParams,
    Kind.RETRIEVE: RetrieveParams,
    Kind.FUSE: FuseParams,
    Kind.RERANK: RerankParams,
    Kind.RERANK_QUERY: StepParams,  # the question: what the rerank step sends
    Kind.SELECT_EVIDENCE: EvidenceParams,
    Kind.GENERATE: AnswerParams,
    Kind.SYNTHESIZE: AnswerParams,
    Kind.PLAN: StepParams,
}
# Kinds whose output is an answer; a plan has exactly one that nothing depends on.
ANSWERING = {Kind.GENERATE, Kind.SYNTHESIZE}
# Kinds an explicit plan may hold: a planning step belongs to the built-in agent plan,
# whose graph is made from what the planner writes.
RUNNABLE = set(Kind) - {Kind.PLAN}


@dataclass(frozen=True)
class Node:
    id: str
    kind: Kind
    depends_on: tuple[str, ...] = ()
    # Its kind's parameters (PARAMS_OF); by default all unset.
    params: StepParams = field(default_factory=StepParams)
    # Seconds this node may take; None: what remains of the run.
    budget_s: float | None = None
    # May be dropped (time, budget, a failed optional service): the answer says so.
    optional: bool = False

    def __post_init__(self) -> None:
        expected = PARAMS_OF[self.kind]
        if type(self.params) is StepParams:  # none given
            object.__setattr__(self, "params", expected())
        elif type(self.params) is not expected:
            raise TypeError(f"a {self.kind.value} node takes {expected.__name__}")

    def params_as(self, expected: type[P]) -> P:
        """The node's parameters as the step that reads them expects them (a kind whose
        parameters extend `expected` passes)."""
        if not isinstance(self.params, expected):
            raise TypeError(f"node {self.id} ({self.kind.value}) has no {expected.__name__}")
        return self.params


@dataclass(frozen=True)
class Plan:
    nodes: tuple[Node, ...]
    _by_id: dict[str, Node] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {n.id: n for n in self.nodes})

    def node(self, node_id: str) -> Node:
        return self._by_id[node_id]

    def dependents(self, node_id: str) -> list[Node]:
        return [n for n in self.nodes if node_id in n.depends_on]

    def ancestors(self, node_id: str) -> list[Node]:
        """Every node `node_id` depends on, directly or not, nearest first."""
        seen: list[Node] = []
        frontier = list(self.node(node_id).depends_on)
        while frontier:
            current = self.node(frontier.pop(0))
            if current not in seen:
                seen.append(current)
                frontier.extend(current.depends_on)
        return seen

    @property
    def answer_node(self) -> Node | None:
        """The step whose output is the answer (None in a plan that only plans)."""
        return next(
            (n for n in self.nodes if n.kind in ANSWERING and not self.dependents(n.id)), None
        )

    def serial(self) -> Plan:
        """The same steps, each waiting for the one before (the bench's baseline)."""
        ordered = topological(self)
        return Plan(
            tuple(
                Node(
                    n.id,
                    n.kind,
                    tuple({*n.depends_on, *ordered[i - 1 : i]}),
                    n.params,
                    n.budget_s,
                    n.optional,
                )
                for i, n in enumerate(self._by_id[x] for x in ordered)
            )
        )


def topological(plan: Plan) -> list[str]:
    """Node ids in an order where every node follows its inputs (the plan is acyclic)."""
    order: list[str] = []
    placed: set[str] = set()
    pending = list(plan.nodes)
    while pending:
        ready = [n for n in pending if set(n.depends_on) <= placed]
        for n in ready:
            order.append(n.id)
            placed.add(n.id)
        pending = [n for n in pending if n.id not in placed]
    return order


def rerank_nodes(candidates: str) -> list[Node]:
    """The rerank step over `candidates`, and the encoding of its query that runs beside
    the retrieval (the rerank waits for it only if it is still under way)."""
    return [
        Node("rerank_query", Kind.RERANK_QUERY),
        Node("rerank", Kind.RERANK, (candidates, "rerank_query"), optional=True),
    ]


def default_rag_plan(*, rerank: bool = True) -> Plan:
    """embed || bm25 || rerank query -> vector search -> fuse -> rerank (optional) ->
    evidence -> generate."""
    nodes = [
        # Optional: without the embedding service, vector search sends the query text
        # (retrieval embeds it itself, or falls back to BM25 and says so).
        Node("embed", Kind.EMBED, optional=True),
        Node("bm25", Kind.BM25),
        Node("vector", Kind.VECTOR_SEARCH, ("embed",)),
        Node("fuse", Kind.FUSE, ("bm25", "vector")),
    ]
    ranked = "fuse"
    if rerank:
        nodes += rerank_nodes("fuse")
        ranked = "rerank"
    nodes += [
        Node("evidence", Kind.SELECT_EVIDENCE, (ranked, "embed")),
        Node("generate", Kind.GENERATE, ("evidence",)),
    ]
    return Plan(tuple(nodes))


@dataclass(frozen=True)
class NodeSpec:
    """An explicit plan node as the caller sent it (kind still by name, params as text)."""

    id: str
    kind: str
    depends_on: tuple[str, ...]
    params: Mapping[str, str]
    budget_s: float | None
    optional: bool


def build_plan(specs: list[NodeSpec]) -> Plan:
    """Checks an explicit plan; INVALID_ARGUMENT naming every bad field, UNIMPLEMENTED for a
    kind this version cannot run yet."""
    problems: list[FieldViolation] = []

    def bad(path: str, why: str) -> None:
        problems.append(FieldViolation(path, why))

    ids: dict[str, int] = {}
    for index, spec in enumerate(specs):
        if spec.id in ids:
            bad(
                f"plan.nodes[{index}].id", f"{spec.id!r} is already the id of nodes[{ids[spec.id]}]"
            )
        else:
            ids[spec.id] = index
    nodes: list[Node] = []
    for index, spec in enumerate(specs):
        path = f"plan.nodes[{index}]"
        try:
            kind = Kind(spec.kind)
        except ValueError:
            bad(f"{path}.kind", f"{spec.kind!r} is not a node kind")
            continue
        for position, dep in enumerate(spec.depends_on):
            if dep not in ids:
                bad(f"{path}.depends_on[{position}]", f"no node has the id {dep!r}")
            elif dep == spec.id:
                bad(f"{path}.depends_on[{position}]", "a node cannot depend on itself")
        params, wrong = read_params(PARAMS_OF[kind], kind.value, spec.params, path)
        problems += wrong
        if spec.budget_s is not None and spec.budget_s <= 0:
            bad(f"{path}.budget", "must be positive when set")
        nodes.append(Node(spec.id, kind, spec.depends_on, params, spec.budget_s, spec.optional))
    if not problems:
        problems += _graph_problems(nodes)
    if problems:
        raise InvalidArgument(problems[0].field, problems[0].description, *problems[1:])
    plan = Plan(tuple(nodes))
    for index, node in enumerate(plan.nodes):
        if node.kind not in RUNNABLE:
            raise Unimplemented(
                f"plan.nodes[{index}].kind: {node.kind.value} steps run only in the built-in "
                "agent plan (plan_choice AGENT); an explicit plan sends the retrieval steps "
                "and a generate step instead"
            )
    return plan


def _graph_problems(nodes: list[Node]) -> list[FieldViolation]:
    index = {n.id: i for i, n in enumerate(nodes)}
    cycle = _find_cycle(nodes)
    if cycle:
        first = index[cycle[0]]
        return [
            FieldViolation(
                f"plan.nodes[{first}].depends_on",
                "forms a cycle: " + " -> ".join([*cycle, cycle[0]]),
            )
        ]
    sinks = [
        n for n in nodes if n.kind in ANSWERING and not any(n.id in m.depends_on for m in nodes)
    ]
    if len(sinks) != 1:
        found = ", ".join(s.id for s in sinks) or "none"
        return [
            FieldViolation(
                "plan.nodes",
                f"needs exactly one generate or synthesize step that no other step depends on "
                f"(the answer); found {found}",
            )
        ]
    return []


def _find_cycle(nodes: list[Node]) -> list[str]:
    by_id = {n.id: n for n in nodes}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node_id: str) -> list[str]:
        state[node_id] = 1
        path.append(node_id)
        for dep in by_id[node_id].depends_on:
            if state.get(dep) == 1:
                return path[path.index(dep) :]
            if dep in by_id and dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node_id] = 2
        return []

    for node in nodes:
        if node.id not in state:
            found = visit(node.id)
            if found:
                return found
    return []
