"""What a run's answer is worth to the agent that reads it: the state (COMPLETE, PARTIAL,
INCOMPLETE), the reason and the words, decided once from how the plan ended.

Pure functions of the run's result; the orchestrator builds its AskOutcome from them in one
go. COMPLETE is a promise: an answer that failed a check, or cites nothing, is reported as
a draft (INCOMPLETE), never as the answer.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import grpc

from ragline.budget import Amounts, BudgetRefused
from ragline.errors import DeadlineExceeded
from ragline.v1 import common_pb2
from ragline.vocabulary import FinishReason
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator import routing
from ragline_services.orchestrator.plan import Kind
from ragline_services.orchestrator.run_context import Answer, NoEvidence, NotEscalated
from ragline_services.orchestrator.runner import Abstain, NodeRecord, NodeState, RunResult


class AnswerState(enum.StrEnum):
    COMPLETE = "complete"
    PARTIAL = "partial"
    INCOMPLETE = "incomplete"


@dataclass(frozen=True)
class Verdict:
    state: AnswerState
    reason: str = ""
    detail: str = ""


@dataclass(frozen=True)
class Written:
    """What the answer step wrote, as the outcome reports it (nothing for a run that
    abstained or failed before it)."""

    answer: str = ""
    citations: list[ev.EvidenceItem] = field(default_factory=list)
    evidence: list[ev.EvidenceItem] = field(default_factory=list)
    dropped_citations: list[str] = field(default_factory=list)
    model: str = ""
    tier: common_pb2.ModelTier = common_pb2.MODEL_TIER_UNSPECIFIED
    model_version: str = ""
    usage: Amounts | None = None
    # Checkable signals that fired on the small answer, whether the large tier answered,
    # and whether its answer cleared them.
    signals: list[str] = field(default_factory=list)
    escalated: bool = False
    escalation_cured: bool = False
    not_escalated: NotEscalated | None = None  # why one that was wanted was not made
    prefill_tokens_saved: int = 0
    # An answer that failed its checks: the text written, unverified.
    draft_answer: str = ""
    # The verifier's estimate that the answer answers the question (None: not read).
    verified: float | None = None
    # The model's own confidence in it (confidence.py; None: the engine gave none).
    answer_logprob: float | None = None


def of_run(result: RunResult, degraded: list[str]) -> tuple[Verdict, Written]:
    """The run's state and reason, and what its answer wrote (nothing unless answered)."""
    if result.abstained is not None:
        return abstained(result.abstained), Written()
    if result.failure is not None:
        return failed(result.failure, result.records), Written()
    # A run that neither abstained nor failed ended in its answer step.
    return answered(cast(Answer, result.answer), degraded)


def stands(answer: Answer) -> bool:
    """Whether an answer's text may be given as the answer: the model did not refuse, and
    no check failed but the cut at its token limit (a cut answer is PARTIAL, not a draft).
    The verdict's rule, and each part's of a several-part answer."""
    return not ev.is_refusal(answer.text) and all(p.reason == routing.CUT for p in answer.problems)


def answered(answer: Answer, degraded: Sequence[str]) -> tuple[Verdict, Written]:
    """The verdict on an answer the plan produced, and what of it the caller gets."""
    text, draft, citations = answer.text, "", answer.cited.citations
    if answer.finish_reason == FinishReason.DEADLINE:
        verdict = Verdict(
            AnswerState.PARTIAL,
            "deadline",
            "the deadline passed while the answer was generated; it is cut",
        )
    elif ev.is_refusal(answer.text):
        verdict = Verdict(
            AnswerState.INCOMPLETE,
            "not_in_evidence",
            "the model found no answer in the retrieved evidence",
        )
        citations = []
    elif not stands(answer):
        detail = "the answer failed its checks: " + "; ".join(str(p) for p in answer.problems)
        if answer.escalated:
            detail += " (the large tier's answer did not clear them)"
        detail += "".join(f"; no answer stands for the part {m}" for m in answer.missing_parts)
        reason = next(p.reason for p in answer.problems if p.reason != routing.CUT)
        verdict = Verdict(AnswerState.INCOMPLETE, reason, detail)
        draft, text, citations = answer.text, "", []
    elif answer.problems:  # only the cut
        verdict = Verdict(
            AnswerState.PARTIAL,
            "length",
            "the answer reached its token limit and is cut; its text is grounded",
        )
    elif answer.missing_parts:
        # The parts that stand are kept (they passed every check); the question is not
        # answered whole, so the run is not COMPLETE.
        verdict = Verdict(
            AnswerState.INCOMPLETE,
            routing.MISSING_PART,
            "no answer stands for "
            + "; ".join(f"the part {m}" for m in answer.missing_parts)
            + "; the answer holds the other parts",
        )
        draft = "; ".join(m.draft for m in answer.missing_parts if m.draft)
    elif degraded:
        verdict = Verdict(
            AnswerState.PARTIAL,
            "degraded: " + ", ".join(degraded),
            "optional steps were skipped or failed; the answer stands without them",
        )
    else:
        verdict = Verdict(AnswerState.COMPLETE)
    if answer.cited.dropped:
        dropped = f"dropped citations not in the evidence: {', '.join(answer.cited.dropped)}"
        verdict = replace(verdict, detail="; ".join(filter(None, [verdict.detail, dropped])))
    if verdict.state == AnswerState.COMPLETE and not citations:
        # Unreachable while the checks hold (no citation is a signal); kept as the rule.
        verdict = Verdict(
            AnswerState.INCOMPLETE, "ungrounded", "the answer cites no passage of the evidence"
        )
        draft, text = answer.text, ""
    signals = [str(signal) for signal in answer.signals]
    if answer.outcome:
        signals.append(answer.outcome)
    return verdict, Written(
        answer=text,
        citations=citations,
        evidence=list(answer.evidence.items),
        dropped_citations=answer.cited.dropped,
        model=answer.model,
        tier=answer.tier,
        model_version=answer.model_version,
        usage=answer.usage,
        signals=signals,
        escalated=answer.escalated,
        not_escalated=answer.not_escalated,
        escalation_cured=answer.escalated and not answer.problems,
        prefill_tokens_saved=answer.cached_input_tokens,
        draft_answer=draft,
        verified=answer.verified,
        answer_logprob=answer.answer_logprob,
    )


def abstained(record: NodeRecord) -> Verdict:
    """The gate's decision that the evidence does not answer the question."""
    decision = record.exception
    assert isinstance(decision, Abstain)
    return Verdict(AnswerState.INCOMPLETE, decision.reason, decision.detail)


def failed(failure: NodeRecord, records: Mapping[str, NodeRecord]) -> Verdict:
    """The verdict on a run whose step `failure` failed; raises DeadlineExceeded where the
    deadline passed before any evidence was in (nothing to report but the deadline)."""
    error, node = failure.exception, failure.node
    if isinstance(error, BudgetRefused):
        return Verdict(
            AnswerState.INCOMPLETE,
            "budget_exhausted",
            f"step {node.id} did not fit the task budget: {error.message}",
        )
    if isinstance(error, NoEvidence):
        return Verdict(AnswerState.INCOMPLETE, "no_evidence", error.message)
    if is_deadline(error):
        evidence_in = any(
            r.node.kind in (Kind.SELECT_EVIDENCE, Kind.RERANK, Kind.FUSE)
            and r.state == NodeState.SUCCEEDED
            for r in records.values()
        )
        if node.kind not in (Kind.GENERATE, Kind.SYNTHESIZE) or not evidence_in:
            raise DeadlineExceeded(
                f"the deadline passed in step {node.id} ({node.kind.value}), before the "
                "evidence was in; ask again with a longer deadline"
            ) from None
        return Verdict(
            AnswerState.PARTIAL,
            "deadline",
            "the deadline passed before the answer could be generated",
        )
    return Verdict(
        AnswerState.INCOMPLETE,
        f"{node.kind.value}_failed",
        f"step {node.id} failed: {failure.error}",
    )


def is_deadline(error: BaseException | None) -> bool:
    if isinstance(error, DeadlineExceeded | TimeoutError):
        return True
    return (
        isinstance(error, grpc.aio.AioRpcError)
        and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    )
