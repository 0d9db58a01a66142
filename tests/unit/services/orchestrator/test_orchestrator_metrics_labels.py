"""The orchestrator's metric labels stay bounded: a reason's kind, never its details."""

from __future__ import annotations

from ragline_services.orchestrator.metrics import reason_kind


def test_a_reason_is_labelled_by_its_kind_alone():
    assert reason_kind("degraded: rerank_unavailable, evidence_embedding_unavailable") == (
        "degraded"
    )
    assert reason_kind("part_without_evidence: who designed the garden") == (
        "part_without_evidence"
    )
    assert reason_kind("no_relevant_evidence") == "no_relevant_evidence"
    assert reason_kind("") == "none"
