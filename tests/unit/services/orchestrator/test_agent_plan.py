"""The agent plan's pure decisions: the router's rule, the planner's schema, what the
budget affords, the graph."""

from __future__ import annotations

import pytest

from ragline.budget import Amounts
from ragline_services.orchestrator.agent import (
    AgentPlan,
    Costs,
    MalformedPlan,
    SubQuery,
    affordable,
    agent_plan,
    clause_lookups,
    clauses,
    parse_plan,
    with_planning,
)
from ragline_services.orchestrator.plan import Kind, Node


@pytest.mark.parametrize(
    "question,several",
    [
        ("Which river flows through Warsaw?", False),
        ("Who founded the university and when?", False),
        ("Which river flows through Warsaw, and also who designed the library garden?", True),
        ("When was the library founded? And who designed its garden?", True),
        ("Where is Normandy and who led the Normans?", True),
        ("What is salt and pepper?", False),
        # A colon, a semicolon, "as well as" before a question, and Chinese joiners.
        ("What did the ECB decide, and also: what did Burnham say about the euro?", True),
        ("What did the ECB decide: what did Burnham say about the euro?", True),
        ("Who built the bridge; when was it opened?", True),
        ("Who founded the firm, as well as when was it sold?", True),
        ("高频 query 的 KV Cache 缓存在哪里，TTL 是多少？", True),
        ("HNSW 重建为什么会阻塞查询？双缓冲索引如何解决？", True),
        ("KV Cache 缓存在哪里以及 TTL 是多少？", True),
        # ... and the same marks inside one question.
        ("Answer this: what is the capital of France?", False),
        ("What did Tesla and Edison as well as Westinghouse invent?", False),
        ("Note: which river flows through Warsaw?", False),
        ("如果查询很多，系统会怎样？", False),
        # A statement whose slot the question word fills is one question (SQuAD dev has
        # 31 such; each went to the agent plan as two lookups of half a question).
        ("The Rhine Gorge is between Koblenz and what other city?", False),
        ("The Rhine and what other river were accepted as the Germanic frontier?", False),
        ("Informal imperialism is still dominant; however, less what?", False),
        ("Arab nationalism was blamed for the defeat as well as what type of stagnation?", False),
        ("Name the river through Warsaw and who designed the library garden?", True),
        ("What term is given to Reno, Nevada; Fresno, California; and Las Vegas combined?", False),
        # "and also" says a second question comes, whatever the first looks like.
        ("The Rhine flows through Basel, and also who designed the library garden?", True),
    ],
)
def test_the_router_sends_joined_questions_to_the_agent(question, several):
    assert bool(clause_lookups(question)) is several


def test_clauses_are_the_questions_joined():
    assert clauses("What did the ECB decide, and also: what did Burnham say?") == [
        "What did the ECB decide",
        "what did Burnham say?",
    ]


def test_a_plan_in_a_fenced_reply_is_read_and_repeated_lookups_merged():
    reply = (
        "Here is the plan:\n```json\n"
        '{"subqueries": [{"query": "river through Warsaw", "required": true},'
        ' {"query": "River through  WARSAW"}, {"query": "library garden designer",'
        ' "required": false}]}\n```'
    )
    plan = parse_plan(reply)
    assert [(s.query, s.required) for s in plan.subqueries] == [
        ("river through Warsaw", True),
        ("library garden designer", False),
    ]


@pytest.mark.parametrize(
    "reply,problem",
    [
        ("I think you should search for Warsaw.", "no JSON object"),
        ('{"subqueries": [{"query": "Warsaw"', "no JSON object"),
        ('{"subqueries": [{"query": "Warsaw",}]}', "does not parse"),
        ('{"subqueries": []}', "subqueries"),
        ('{"subqueries": [{"query": "ab"}]}', "subqueries.0.query"),
        ('{"queries": ["Warsaw river"]}', "queries"),
        (
            '{"subqueries": [{"query": "a b c"}, {"query": "d e f"}, {"query": "g h i"},'
            ' {"query": "j k l"}, {"query": "m n o"}]}',
            "subqueries",
        ),
    ],
)
def test_a_malformed_plan_says_what_is_wrong(reply, problem):
    with pytest.raises(MalformedPlan, match=problem):
        parse_plan(reply)


PLAN = AgentPlan(
    subqueries=[
        SubQuery(query="first part", required=True),
        SubQuery(query="second part", required=False),
        SubQuery(query="third part", required=False),
    ]
)
COSTS = Costs(
    subquery=Amounts(input_tokens=50, calls=1), synthesis=Amounts(input_tokens=500, calls=1)
)


def test_optional_lookups_are_dropped_last_first_when_the_budget_is_short():
    kept, dropped = affordable(PLAN, Amounts(input_tokens=620, calls=10), COSTS, allow_degrade=True)
    assert [s.query for s in kept] == ["first part", "second part"]
    assert [s.query for s in dropped] == ["third part"]
    kept, dropped = affordable(PLAN, Amounts(input_tokens=100, calls=10), COSTS, allow_degrade=True)
    assert [s.query for s in kept] == ["first part"]  # a required lookup is never dropped here


def test_nothing_is_dropped_without_leave_to_degrade_or_a_known_budget():
    short = Amounts(input_tokens=100, calls=10)
    assert affordable(PLAN, short, COSTS, allow_degrade=False)[1] == []
    assert affordable(PLAN, None, COSTS, allow_degrade=True)[1] == []
    assert (
        affordable(PLAN, Amounts(input_tokens=10_000, calls=10), COSTS, allow_degrade=True)[1] == []
    )


def test_the_graph_runs_every_lookup_in_parallel_into_the_synthesis():
    graph = agent_plan(PLAN.subqueries, allow_degrade=True, k=8)
    lookups = [n for n in graph.nodes if n.kind == Kind.RETRIEVE]
    assert [n.depends_on for n in lookups] == [(), (), ()]
    assert [n.optional for n in lookups] == [False, True, True]
    assert graph.answer_node.kind == Kind.SYNTHESIZE
    assert graph.answer_node.depends_on == ("lookup1", "lookup2", "lookup3")
    strict = agent_plan(PLAN.subqueries, allow_degrade=False, k=8)
    assert not any(n.optional for n in strict.nodes)
    whole = with_planning(Node("plan", Kind.PLAN), graph)
    assert [n.depends_on for n in whole.nodes][:2] == [(), ("plan",)]
    assert whole.node("synthesize").depends_on == ("lookup1", "lookup2", "lookup3")


def test_the_routers_lookups_are_its_clauses_a_later_one_with_the_first_ones_subject():
    assert clause_lookups("Which river flows through Warsaw?") == ()
    first, second = clause_lookups(
        "What is the default escape character in ssh, and which hash does it use for "
        "fingerprints by default?"
    )
    assert first == "What is the default escape character in ssh"
    # "it" names nothing to search for alone: the first clause's subject goes with it
    assert second.startswith("which hash does it use for fingerprints by default?")
    assert "ssh" in second
    # a clause that stands alone is searched as it is
    assert (
        clause_lookups(
            "What is zstd's largest compression level, and what is gzip's worst-case expansion "
            "ratio for large files?"
        )[1]
        == "what is gzip's worst-case expansion ratio for large files?"
    )


def test_a_follow_ups_carried_subject_is_not_another_question():
    from ragline_services.orchestrator.agent import clauses
    from ragline_services.orchestrator.followup import without_subject

    resolved = "And when was it built? (Sigismund's Column)"
    assert clauses(resolved) == [resolved]  # one lookup: the RAG plan
    assert without_subject(resolved) == "And when was it built?"
    assert without_subject("What is (x)?") == "What is (x)?"  # only a trailing subject


def test_a_second_question_may_open_with_a_preposition():
    from ragline_services.orchestrator.agent import clauses

    assert clauses(
        "Since which version does xz --keep handle symbolic links, and in which release was "
        "the + prefix for threads added?"
    ) == [
        "Since which version does xz --keep handle symbolic links",
        "in which release was the + prefix for threads added?",
    ]


def test_a_parts_sentences_are_chosen_by_its_clause_not_by_the_subject_it_carried():
    from ragline_services.orchestrator import evidence as ev
    from ragline_services.orchestrator.agent_steps import part_evidence

    _, lookup = clause_lookups(
        "What is the default escape character in ssh, and which hash does it use for "
        "fingerprints by default?"
    )
    page = ev.Passage(
        "ssh:1",
        "ssh(1)",
        "EscapeChar Sets the default escape character for ssh sessions (default: '~'). "
        "FingerprintHash Specifies the hash algorithm used when displaying key "
        "fingerprints. The default is sha256.",
    )
    clause, sentences = part_evidence(lookup, [page], count=1)
    assert clause == "which hash does it use for fingerprints by default?"
    # the carried words ("default escape character ssh") would choose the first sentence
    assert [s.text for s in sentences] == [
        "FingerprintHash Specifies the hash algorithm used when displaying key fingerprints."
    ]
