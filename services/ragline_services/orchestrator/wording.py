"""An answer's status detail in the question's language: an agent reads the machine
reason (`status.reason`), a person reads `status.detail`, and a person who asked in Chinese
reads Chinese. The English detail stays after it in brackets (it names steps, limits and
errors that have no fixed wording)."""

from __future__ import annotations

from ragline.vocabulary import Language
from ragline_services.orchestrator.evidence import language_of

# reason (or its prefix before ":" / the suffix "_failed") -> the Chinese lead sentence.
_ZH = {
    "deadline": "截止时间已到，回答不完整",
    "not_in_evidence": "检索到的资料中找不到这个问题的答案",
    "length": "回答达到了长度上限，已被截断；已写出的内容有据可查",
    "degraded": "部分可选步骤被跳过或失败，回答在没有它们的情况下给出",
    "no_evidence": "没有检索到任何资料，无法回答",
    "no_relevant_evidence": "检索到的资料与问题无关，无法据此回答",
    "ungrounded": "回答与所引用的资料不符，仅作为未经核实的草稿",
    "conflicting_evidence": "资料之间相互矛盾，无法给出可靠的回答",
    "budget_exhausted": "任务预算不足，无法完成回答",
    "failed": "回答过程中有步骤失败",
}


def _lead(reason: str) -> str | None:
    if reason in _ZH:
        return _ZH[reason]
    head = reason.split(":", 1)[0]
    if head in _ZH:
        return _ZH[head]
    if reason.endswith("_failed"):
        return _ZH["failed"]
    return None


def status_detail(question: str, reason: str, detail: str) -> str:
    """`detail` as the asker reads it: for a Chinese question the reason's Chinese
    sentence first, the English detail after it; otherwise unchanged."""
    if not reason or language_of(question) != Language.CHINESE:
        return detail
    lead = _lead(reason)
    if lead is None:
        return detail
    return f"{lead}（{detail}）" if detail else lead
