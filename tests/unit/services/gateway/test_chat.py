"""The chat translation: what an Ask a chat request becomes, and how a result is shown."""

from __future__ import annotations

import json

import grpc
import pytest
from google.rpc import status_pb2

from ragline.errors import InvalidArgument, ResourceExhausted, error_info, retry_info
from ragline.v1 import common_pb2, orchestrator_pb2
from ragline_services.gateway import chat, errors
from ragline_services.gateway.models import ChatCompletionRequest


def request(**fields) -> ChatCompletionRequest:
    fields.setdefault("model", "ragline")
    fields.setdefault("messages", [{"role": "user", "content": "Which river?"}])
    return ChatCompletionRequest(**fields)


def result(state=common_pb2.ANSWER_STATE_COMPLETE, answer="Vistula River", **fields):
    made = orchestrator_pb2.AskResult(
        answer=answer,
        status=common_pb2.AnswerStatus(state=state, **fields.pop("status", {})),
        citations=[
            orchestrator_pb2.Citation(
                document_id="w:1", version=3, marker="[1]", title="Warsaw", snippet="The Vistula"
            )
        ],
        **fields,
    )
    made.timing.run_id = "run42"
    return made


def test_the_last_user_turn_is_the_question_and_the_turns_before_are_conversation():
    ask = chat.ask_request(
        request(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about Warsaw."},
                {"role": "assistant", "content": [{"type": "text", "text": "A city."}]},
                {"role": "user", "content": [{"type": "text", "text": "Which river?"}]},
            ]
        )
    )
    assert ask.question == "Which river?"
    assert [(t.role, t.text) for t in ask.conversation] == [
        (orchestrator_pb2.CONVERSATION_ROLE_USER, "Tell me about Warsaw."),
        (orchestrator_pb2.CONVERSATION_ROLE_ASSISTANT, "A city."),
    ]


def test_model_names_pick_the_tier_and_plan():
    assert chat.ask_request(request()).tier == common_pb2.MODEL_TIER_UNSPECIFIED
    assert chat.ask_request(request(model="ragline-large")).tier == common_pb2.MODEL_TIER_LARGE
    agent = chat.ask_request(request(model="ragline-agent"))
    assert agent.plan_choice == orchestrator_pb2.PLAN_CHOICE_AGENT
    with pytest.raises(chat.UnknownModel):
        chat.ask_request(request(model="gpt-4o"))


def test_options_reach_the_ask():
    ask = chat.ask_request(
        request(
            max_completion_tokens=99,
            ragline={"task_id": "job-1", "budget": {"output_tokens": 500}, "cache": "bypass"},
        )
    )
    assert (ask.max_tokens, ask.task_id, ask.budget.output_tokens) == (99, "job-1", 500)
    assert ask.cache == orchestrator_pb2.CACHE_POLICY_BYPASS


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "  "}]}, "messages[0].content"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_field(fields, field):
    with pytest.raises(InvalidArgument) as caught:
        chat.ask_request(request(**fields))
    assert caught.value.violations[0].field == field


def test_a_standing_answer_is_content_with_markers_and_sources():
    completion = chat.completion(result(), "ragline", 1, sources_in_content=True)
    message = completion["choices"][0]["message"]
    assert message["content"] == "Vistula River [1]\n\nsources:\n[1] Warsaw (w:1 v3)"
    assert message["refusal"] is None
    assert completion["ragline"]["state"] == "COMPLETE"
    assert completion["ragline"]["citations"][0]["document_id"] == "w:1"
    assert completion["id"] == "chatcmpl-run42"
    bare = chat.completion(result(answer="Vistula [1]"), "ragline", 1, sources_in_content=False)
    assert bare["choices"][0]["message"]["content"] == "Vistula [1]"  # no marker twice
    # The verifier's estimate and the model's confidence, only where the result has them.
    assert "answer_logprob" not in completion["ragline"]
    sure = chat.completion(result(verified=0.9, answer_logprob=-0.05), "ragline", 1, False)
    assert sure["ragline"]["verified"] == 0.9 and sure["ragline"]["answer_logprob"] == -0.05


def test_an_incomplete_answer_is_never_content():
    refused = result(
        common_pb2.ANSWER_STATE_INCOMPLETE,
        answer="",
        draft_answer="Oder",
        status={"reason": "unverified", "detail": "another item of the passage"},
    )
    completion = chat.completion(refused, "ragline", 1, sources_in_content=True)
    message = completion["choices"][0]["message"]
    assert message["content"] is None
    assert message["refusal"] == "INCOMPLETE (unverified): another item of the passage"
    assert completion["ragline"]["draft"] == "Oder"
    events = chat.ChunkWriter("ragline", "s", include_usage=True).closing(refused, True)
    payloads = [json.loads(e.removeprefix("data: ")) for e in events]
    assert payloads[0]["choices"][0]["delta"] == {"refusal": message["refusal"]}
    assert payloads[1]["choices"][0]["finish_reason"] == "stop"
    assert payloads[2]["choices"] == [] and "usage" in payloads[2]


def test_grpc_errors_keep_their_meaning_over_http():
    full = errors.from_exception(
        ResourceExhausted("queue full", reason="QUEUE_FULL", retry_after_s=1.2)
    )
    assert (full.status, full.headers["Retry-After"]) == (429, "2")
    assert full.body["error"]["code"] == "QUEUE_FULL"
    bad = errors.from_exception(InvalidArgument("question", "is required"))
    assert (bad.status, bad.body["error"]["param"]) == (400, "question")
    status = status_pb2.Status(details=[error_info("DEADLINE_EXCEEDED"), retry_info(0.5)])
    late = errors.from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "late", status)
    assert late.status == 504 and late.body["error"]["type"] == "timeout_error"
    assert errors.from_status(grpc.StatusCode.UNAUTHENTICATED, "who?", None).status == 401
