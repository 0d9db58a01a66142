from __future__ import annotations

import itertools
import re

import pytest

from ragline.errors import InvalidArgument, Unimplemented
from ragline.vocabulary import ModelTier
from ragline_services.orchestrator.params import AnswerParams, RerankParams, RetrieveParams
from ragline_services.orchestrator.plan import (
    PARAMS_OF,
    RUNNABLE,
    Kind,
    Node,
    NodeSpec,
    build_plan,
    default_rag_plan,
    topological,
)
from support import REPO_ROOT


def spec(node_id, kind, depends_on=(), **params):
    return NodeSpec(node_id, kind, tuple(depends_on), params, None, False)


def violations(specs) -> dict[str, str]:
    with pytest.raises(InvalidArgument) as caught:
        build_plan(specs)
    return {v.field: v.description for v in caught.value.violations}


def test_the_default_plan_runs_embedding_and_bm25_side_by_side():
    plan = default_rag_plan()
    order = topological(plan)
    assert set(order[:2]) == {"embed", "bm25"}
    assert plan.node("vector").depends_on == ("embed",)
    assert plan.node("fuse").depends_on == ("bm25", "vector")
    assert plan.node("rerank").optional
    # The rerank's query is encoded beside the retrieval, not after it.
    assert plan.node("rerank_query").depends_on == ()
    assert plan.node("rerank").depends_on == ("fuse", "rerank_query")
    assert "rerank_query" in order[:3]
    assert plan.answer_node.id == "generate"
    assert [n.id for n in default_rag_plan(rerank=False).nodes if n.kind == Kind.RERANK] == []


def test_an_explicit_plan_is_checked_and_typed():
    plan = build_plan(
        [
            spec("a", "retrieve", query="warsaw", k="5"),
            spec("b", "retrieve", query="vistula"),
            spec("g", "generate", ["a", "b"], max_tokens="32", tier="small"),
        ]
    )
    assert plan.node("a").params == RetrieveParams(query="warsaw", k=5)
    assert plan.node("g").params == AnswerParams(max_tokens=32, tier=ModelTier.SMALL)
    assert plan.node("g").params.as_text() == {"max_tokens": "32", "tier": "small"}
    assert plan.answer_node.id == "g"


def test_unknown_kinds_are_refused_naming_the_field():
    assert "plan.nodes[0].kind" in violations([spec("a", "teleport"), spec("g", "generate")])


def test_dangling_and_self_dependencies_are_refused():
    found = violations([spec("a", "retrieve", ["ghost"]), spec("g", "generate", ["g", "a"])])
    assert "no node has the id 'ghost'" in found["plan.nodes[0].depends_on[0]"]
    assert "itself" in found["plan.nodes[1].depends_on[0]"]


def test_duplicate_ids_are_refused():
    found = violations([spec("a", "retrieve"), spec("a", "retrieve"), spec("g", "generate", ["a"])])
    assert "nodes[0]" in found["plan.nodes[1].id"]


def test_cycles_are_refused_with_the_cycle_named():
    found = violations(
        [
            spec("a", "retrieve", ["c"]),
            spec("b", "fuse", ["a"]),
            spec("c", "rerank", ["b"]),
            spec("g", "generate", ["c"]),
        ]
    )
    ((field, why),) = found.items()
    assert field.endswith(".depends_on") and "cycle" in why and "a -> " in why


def test_bad_params_are_refused_naming_the_key():
    found = violations(
        [
            spec("a", "retrieve", k="many", colour="red", mode="psychic"),
            spec("g", "generate", ["a"], max_tokens="-3"),
        ]
    )
    assert set(found) == {
        "plan.nodes[0].params[k]",
        "plan.nodes[0].params[colour]",
        "plan.nodes[0].params[mode]",
        "plan.nodes[1].params[max_tokens]",
    }


def test_params_beyond_what_the_called_service_accepts_are_refused():
    found = violations(
        [
            spec("a", "retrieve", k="1001"),
            spec("v", "vector_search", hnsw_ef="5000"),
            spec("f", "fuse", ["a", "v"], vector_weight="nan"),
            spec("e", "select_evidence", ["f"], max_tokens="20000"),  # prompt tokens: fine
            spec("g", "generate", ["e"], max_tokens="20000"),  # answer tokens: too many
        ]
    )
    assert found == {
        "plan.nodes[0].params[k]": "is 1001; the maximum is 1000",
        "plan.nodes[1].params[hnsw_ef]": "is 5000; the maximum is 4096",
        "plan.nodes[2].params[vector_weight]": "must be a finite number",
        "plan.nodes[4].params[max_tokens]": "is 20000; the maximum is 8192",
    }


def test_a_plan_needs_exactly_one_answer():
    assert "plan.nodes" in violations([spec("a", "retrieve")])
    assert "plan.nodes" in violations(
        [spec("a", "retrieve"), spec("g1", "generate", ["a"]), spec("g2", "generate", ["a"])]
    )


def test_agent_planning_steps_are_not_available_yet():
    with pytest.raises(Unimplemented, match=r"plan\.nodes\[0\]\.kind"):
        build_plan([spec("p", "plan"), spec("g", "generate", ["p"])])


def test_the_serial_form_chains_every_step():
    serial = default_rag_plan().serial()
    order = topological(serial)
    for before, after in itertools.pairwise(order):
        assert before in serial.node(after).depends_on


def test_a_rerank_node_may_turn_the_cross_encoder_on_or_off():
    """WORKSPACE.md documents `cross_encoder` for a rerank node (the setting
    RAGLINE_ORCHESTRATOR_RERANK_CROSS_ENCODER is its default); a plan that sent it was
    refused once."""
    plan = build_plan(
        [
            spec("a", "retrieve"),
            spec("r", "rerank", ["a"], cross_encoder="true"),
            spec("g", "generate", ["r"]),
        ]
    )
    assert plan.node("r").params == RerankParams(cross_encoder=True)
    off = build_plan(
        [
            spec("a", "retrieve"),
            spec("r", "rerank", ["a"], cross_encoder="0"),
            spec("g", "generate", ["r"]),
        ]
    )
    assert off.node("r").params == RerankParams(cross_encoder=False)
    found = violations(
        [
            spec("a", "retrieve"),
            spec("r", "rerank", ["a"], cross_encoder="maybe"),
            spec("g", "generate", ["r"]),
        ]
    )
    assert found == {"plan.nodes[1].params[cross_encoder]": "'maybe' is not a boolean"}


def test_internal_parameters_are_not_part_of_the_contract():
    """`charged` is set by the agent's own plan; a caller's plan cannot send it."""
    found = violations([spec("a", "retrieve", charged="true"), spec("g", "generate", ["a"])])
    assert found == {
        "plan.nodes[0].params[charged]": "is not a parameter of retrieve (known: k, mode, query)"
    }


def test_a_node_holds_its_own_kinds_parameters():
    assert Node("g", Kind.GENERATE).params == AnswerParams()
    with pytest.raises(TypeError, match="AnswerParams"):
        Node("g", Kind.GENERATE, params=RetrieveParams(k=3))


def test_the_contract_lists_each_kinds_parameters():
    """PlanNode.params' comment in orchestrator.proto is what a caller reads: every kind's
    parameters there, and none that the plan would refuse."""
    proto = (REPO_ROOT / "proto" / "ragline" / "v1" / "orchestrator.proto").read_text()
    comment = proto[proto.index("By kind:") : proto.index("map<string, string> params")]
    documented: dict[str, set[str]] = {}
    current: list[str] = []
    for line in comment.splitlines():
        text = line.strip().removeprefix("//").strip()
        heading = re.match(r"^([A-Z0-9_]+(?:, [A-Z0-9_]+)*): (.*)$", text)
        also = re.match(r"^([A-Z0-9_]+) also (.*)$", text)
        if heading:
            current = heading.group(1).split(", ")
            for kind in current:
                documented.setdefault(kind, set()).update(re.findall(r"`(\w+)`", heading.group(2)))
        elif also:
            documented[also.group(1)].update(re.findall(r"`(\w+)`", also.group(2)))
        elif current:
            for kind in current:
                documented[kind].update(re.findall(r"`(\w+)`", text))
    accepted = {
        kind.name: set(PARAMS_OF[kind].accepted())
        for kind in RUNNABLE
        if PARAMS_OF[kind].accepted()
    }
    assert documented == accepted
