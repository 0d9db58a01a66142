"""The shared words and their protobuf enums: every word goes to the wire and back as
itself, and a value a caller left unset reads as the contract's default."""

from __future__ import annotations

import pytest

from ragline import vocabulary as v
from ragline.v1 import (
    common_pb2,
    generation_pb2,
    orchestrator_pb2,
    rerank_pb2,
    retrieval_pb2,
)

ROUND_TRIPS = [
    (v.ModelTier, v.tier_to_proto, v.tier_from_proto),
    (v.SearchMode, v.search_mode_to_proto, v.search_mode_from_proto),
    (v.CachePolicy, v.cache_policy_to_proto, v.cache_policy_from_proto),
    (v.SkipCause, v.skip_cause_to_proto, v.skip_cause_from_proto),
    (v.FinishReason, v.finish_reason_to_proto, v.finish_reason_from_proto),
]


@pytest.mark.parametrize(("words", "to_proto", "from_proto"), ROUND_TRIPS)
def test_every_word_goes_to_the_wire_and_back_as_itself(words, to_proto, from_proto):
    wire = [to_proto(word) for word in words]
    assert len(set(wire)) == len(wire)  # no two words share a wire value
    assert [from_proto(value) for value in wire] == list(words)
    # The text a log or a plan parameter holds converts too.
    assert [to_proto(word.value) for word in words] == wire


def test_an_unset_value_reads_as_the_contracts_default():
    assert v.tier_from_proto(common_pb2.MODEL_TIER_UNSPECIFIED) == v.ModelTier.SMALL
    assert v.search_mode_from_proto(retrieval_pb2.SEARCH_MODE_UNSPECIFIED) == v.SearchMode.HYBRID
    assert v.fusion_from_proto(retrieval_pb2.FUSION_UNSPECIFIED) is None
    assert v.cache_policy_from_proto(orchestrator_pb2.CACHE_POLICY_UNSPECIFIED) == v.CachePolicy.USE
    # A service older than the field: its reason's words are all there is.
    assert v.skip_cause_from_proto(rerank_pb2.SKIP_CAUSE_UNSPECIFIED) is None
    assert (
        v.finish_reason_from_proto(generation_pb2.FINISH_REASON_UNSPECIFIED) == v.FinishReason.STOP
    )


def test_a_word_is_its_text():
    assert v.FinishReason.DEADLINE == "deadline" and f"{v.FinishReason.LENGTH}" == "length"
