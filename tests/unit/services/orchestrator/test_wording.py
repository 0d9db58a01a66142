"""Status details in the question's language."""

from __future__ import annotations

from ragline.words import has_han
from ragline_services.orchestrator.wording import status_detail


def test_a_chinese_question_gets_the_reason_in_chinese_and_the_english_detail_after_it():
    detail = status_detail("长江全长多少公里？", "budget_exhausted", "step generate did not fit")
    assert detail.startswith("任务预算不足") and detail.endswith("（step generate did not fit）")
    assert has_han(status_detail("长江？", "degraded: rerank_unavailable", "optional steps"))
    assert has_han(status_detail("长江？", "rerank_failed", "step r failed: boom"))


def test_an_english_question_or_a_complete_answer_keeps_the_detail_as_it_is():
    assert status_detail("How long is the Yangtze?", "no_evidence", "nothing found") == (
        "nothing found"
    )
    assert status_detail("长江全长多少公里？", "", "") == ""
    assert status_detail("长江？", "a_reason_not_known", "x") == "x"
