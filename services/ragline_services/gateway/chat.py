"""Chat completions <-> Ask: the translation, pure (no I/O), so it is tested without a stack.

An answer is presented as one only when it stands: COMPLETE or PARTIAL put the answer text
(its sources as markers, and a `sources:` list unless the request turns it off) in
`message.content`; INCOMPLETE leaves `content` null and says why in `message.refusal` (what
LangChain's ChatOpenAI shows as `additional_kwargs["refusal"]`), the draft only in the
extension. Everything else a gRPC caller reads in AskResult is in the `ragline` extension
object (docs/clients.md, docs/openapi.json).

Streaming sends the role at once, the model's text as it is written only as
`ragline.draft_delta` (an answer is not one before its checks ran), then the content or
the refusal, a last chunk with `finish_reason` and the extension, and `data: [DONE]`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable

from ragline.errors import InvalidArgument
from ragline.v1 import common_pb2, orchestrator_pb2
from ragline.vocabulary import cache_policy_to_proto, search_mode_to_proto, tier_to_proto
from ragline_services.gateway.models import SERVED_MODELS, ChatCompletionRequest, ServedModel

_MARKER = re.compile(r"\[\d+\]")


class UnknownModel(LookupError):
    """A `model` the gateway does not serve (404 model_not_found, as OpenAI answers)."""


def served_model(name: str) -> ServedModel:
    try:
        return SERVED_MODELS[name]
    except KeyError:
        raise UnknownModel(
            f"the model {name!r} does not exist; GET /v1/models lists {', '.join(SERVED_MODELS)}"
        ) from None


def question_of(request: ChatCompletionRequest) -> str:
    """The last user turn (the conversation before it is context, not the question)."""
    last = request.messages[-1]
    if last.role != "user":
        raise InvalidArgument(
            f"messages[{len(request.messages) - 1}].role",
            f"the last message must be the user's question, not {last.role!r}",
        )
    question = last.text().strip()
    if not question:
        raise InvalidArgument(f"messages[{len(request.messages) - 1}].content", "is empty")
    return question


def conversation_of(request: ChatCompletionRequest) -> list[orchestrator_pb2.ConversationTurn]:
    """The user and assistant turns before the question, oldest first (system prompts are
    the caller's instructions to its own model: ragline's answer step has its own)."""
    roles = {
        "user": orchestrator_pb2.CONVERSATION_ROLE_USER,
        "assistant": orchestrator_pb2.CONVERSATION_ROLE_ASSISTANT,
    }
    return [
        orchestrator_pb2.ConversationTurn(role=roles[m.role], text=m.text())
        for m in request.messages[:-1]
        if m.role in roles and m.text().strip()
    ]


def ask_request(request: ChatCompletionRequest) -> orchestrator_pb2.AskRequest:
    """The Ask of a chat request; InvalidArgument (naming the field) for what it cannot
    honour, UnknownModel for a model it does not serve."""
    model = served_model(request.model)
    if request.n != 1:
        raise InvalidArgument("n", "ragline writes one answer per question: n must be 1")
    if request.tools:
        raise InvalidArgument(
            "tools", "ragline answers from its documents; it does not call the caller's tools"
        )
    options = request.ragline
    ask = orchestrator_pb2.AskRequest(
        question=question_of(request),
        conversation=conversation_of(request),
        task_id=options.task_id,
        allow_degrade=options.allow_degrade,
        max_tokens=request.max_completion_tokens or request.max_tokens or 0,
        cache=cache_policy_to_proto(options.cache),
        max_evidence_tokens=options.max_evidence_tokens,
    )
    if model.tier is not None:
        ask.tier = tier_to_proto(model.tier)
    if model.agent:
        ask.plan_choice = orchestrator_pb2.PLAN_CHOICE_AGENT
    if options.mode is not None:
        ask.retrieval.mode = search_mode_to_proto(options.mode)
    if options.budget is not None:
        for name, value in options.budget.model_dump(exclude_none=True).items():
            setattr(ask.budget, name, value)
    return ask


def state_name(result: orchestrator_pb2.AskResult) -> str:
    return common_pb2.AnswerState.Name(result.status.state).removeprefix("ANSWER_STATE_")


def stands(result: orchestrator_pb2.AskResult) -> bool:
    """Whether the result is an answer (COMPLETE or PARTIAL with text)."""
    return bool(result.answer) and result.status.state in (
        common_pb2.ANSWER_STATE_COMPLETE,
        common_pb2.ANSWER_STATE_PARTIAL,
    )


def content_of(result: orchestrator_pb2.AskResult, sources_in_content: bool) -> str | None:
    """The answer with its citations' markers (those the text does not carry already) and,
    when asked, the sources as `ragline ask` prints them; None unless the answer stands."""
    if not stands(result):
        return None
    text = result.answer.strip()
    written = set(_MARKER.findall(text))
    missing = [c.marker for c in result.citations if c.marker and c.marker not in written]
    if missing:
        text = f"{text} {''.join(missing)}"
    if sources_in_content and result.citations:
        lines = [f"{c.marker} {c.title} ({c.document_id} v{c.version})" for c in result.citations]
        text += "\n\nsources:\n" + "\n".join(lines)
    return text


def refusal_of(result: orchestrator_pb2.AskResult) -> str | None:
    """Why there is no answer (INCOMPLETE: the state, its reason and detail); None when the
    answer stands."""
    if stands(result):
        return None
    reason = f" ({result.status.reason})" if result.status.reason else ""
    detail = f": {result.status.detail}" if result.status.detail else ""
    return f"{state_name(result)}{reason}{detail}"


def extension(result: orchestrator_pb2.AskResult) -> dict:
    """The `ragline` object: what AskResult says beyond the text (docs/clients.md)."""
    timing = result.timing
    out: dict = {
        "state": state_name(result),
        "reason": result.status.reason,
        "detail": result.status.detail,
        "citations": [_citation(c) for c in result.citations],
        "draft": result.draft_answer,
        "answerability": round(result.answerability, 4),
        "task_id": result.task_id,
        "model": result.model,
        "tier": common_pb2.ModelTier.Name(result.tier).removeprefix("MODEL_TIER_").lower(),
        "route": result.route,
        "route_detail": result.route_detail,
        "degraded": list(result.degraded),
        "escalated": result.escalated,
        "escalation_signals": list(result.escalation_signals),
        "dropped_citations": list(result.dropped_citations),
        "run_id": timing.run_id,
        "trace_id": timing.trace_id,
        "timing": {
            "end_to_end_ms": round(timing.end_to_end.ToNanoseconds() / 1e6, 1),
            "admission_wait_ms": round(timing.admission_wait.ToNanoseconds() / 1e6, 1),
            "critical_path": list(timing.critical_path),
            "overhead_ratio": round(timing.overhead_ratio, 3),
        },
    }
    if result.HasField("verified"):
        out["verified"] = round(result.verified, 4)
    if result.HasField("answer_logprob"):
        out["answer_logprob"] = round(result.answer_logprob, 4)
    return out


def _citation(citation: orchestrator_pb2.Citation) -> dict:
    return {
        "marker": citation.marker,
        "document_id": citation.document_id,
        "version": citation.version,
        "title": citation.title,
        "snippet": citation.snippet,
    }


def usage_of(result: orchestrator_pb2.AskResult) -> dict:
    """Tokens of the task's ledger (an Ask in a shared task: the task's totals so far)."""
    used = result.budget.used
    return {
        "prompt_tokens": used.input_tokens,
        "completion_tokens": used.output_tokens,
        "total_tokens": used.input_tokens + used.output_tokens,
    }


def completion_id(result: orchestrator_pb2.AskResult | None, fallback: str) -> str:
    run_id = result.timing.run_id if result is not None else ""
    return f"chatcmpl-{run_id or fallback}"


def completion(
    result: orchestrator_pb2.AskResult, model: str, created: int, sources_in_content: bool
) -> dict:
    """The whole `chat.completion` object."""
    return {
        "id": completion_id(result, result.task_id),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content_of(result, sources_in_content),
                    "refusal": refusal_of(result),
                },
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage_of(result),
        "ragline": extension(result),
    }


class ChunkWriter:
    """The server-sent events of one streamed completion."""

    def __init__(self, model: str, stream_id: str, include_usage: bool) -> None:
        self.model = model
        self.id = f"chatcmpl-{stream_id}"
        self.created = int(time.time())
        self.include_usage = include_usage

    def _chunk(self, choices: list[dict], **extra) -> str:
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        )

    def _event(self, delta: dict, finish_reason: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._chunk([choice], **extra)

    def opening(self) -> str:
        return self._event({"role": "assistant", "content": ""})

    def draft(self, text: str) -> str:
        return self._event({}, ragline={"draft_delta": text})

    def closing(self, result: orchestrator_pb2.AskResult, sources_in_content: bool) -> list[str]:
        content = content_of(result, sources_in_content)
        events = [
            self._event(
                {"content": content} if content is not None else {"refusal": refusal_of(result)}
            ),
            self._event({}, "stop", ragline=extension(result)),
        ]
        if self.include_usage:
            events.append(self._chunk([], usage=usage_of(result)))
        return events


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def model_list(created: int, names: Iterable[str] = SERVED_MODELS) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "ragline",
                "description": SERVED_MODELS[name].description,
            }
            for name in names
        ],
    }
