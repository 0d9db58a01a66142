"""The words the services share: model tiers, search modes, fusion methods, cache policies,
rerank's skip causes, why a generation ended and the language of an answer, each one
StrEnum, and the one place each is converted to and from its protobuf enum.

A StrEnum is its text (`SearchMode.HYBRID == "hybrid"`), so logs, JSON reports and the
plan's text parameters keep the words they always had. An UNSPECIFIED protobuf value reads
as the server's default where the contract names one, and as None where the caller's
silence means "the service decides" (fusion).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from ragline.v1 import common_pb2, generation_pb2, orchestrator_pb2, rerank_pb2, retrieval_pb2


class ModelTier(enum.StrEnum):
    SMALL = "small"
    LARGE = "large"


class SearchMode(enum.StrEnum):
    BM25 = "bm25"
    VECTOR = "vector"
    HYBRID = "hybrid"
    # A vector search over only the passages the BM25 candidates name.
    PREFILTER = "prefilter"


class Fusion(enum.StrEnum):
    RRF = "rrf"
    SCORE = "score"


class SkipCause(enum.StrEnum):
    """Why rerank skipped a stage (rerank.proto's SkipCause)."""

    DEADLINE = "deadline"
    DISABLED = "disabled"
    LANGUAGE = "language"


class FinishReason(enum.StrEnum):
    """Why a generation ended (generation.proto's FinishReason)."""

    STOP = "stop"  # the model ended it, or a stop word
    LENGTH = "length"  # its token limit
    DEADLINE = "deadline"  # its deadline: the text so far is what there is


class Language(enum.StrEnum):
    """The language a question is answered in (ISO 639-1)."""

    ENGLISH = "en"
    CHINESE = "zh"


class CachePolicy(enum.StrEnum):
    """How an Ask uses the answer cache (the orchestrator's, the gateway's words for it)."""

    USE = "use"  # read and write
    REFRESH = "refresh"  # write only
    BYPASS = "bypass"  # neither


W = TypeVar("W", bound=enum.StrEnum)


_TIER_TO_PROTO: dict[ModelTier, common_pb2.ModelTier] = {
    ModelTier.SMALL: common_pb2.MODEL_TIER_SMALL,
    ModelTier.LARGE: common_pb2.MODEL_TIER_LARGE,
}
_MODE_TO_PROTO: dict[SearchMode, retrieval_pb2.SearchMode] = {
    SearchMode.BM25: retrieval_pb2.SEARCH_MODE_BM25,
    SearchMode.VECTOR: retrieval_pb2.SEARCH_MODE_VECTOR,
    SearchMode.HYBRID: retrieval_pb2.SEARCH_MODE_HYBRID,
    SearchMode.PREFILTER: retrieval_pb2.SEARCH_MODE_PREFILTER,
}
_FUSION_TO_PROTO: dict[Fusion, retrieval_pb2.Fusion] = {
    Fusion.RRF: retrieval_pb2.FUSION_RRF,
    Fusion.SCORE: retrieval_pb2.FUSION_SCORE,
}


def _inverse(forward: Mapping[W, int]) -> dict[int, W]:
    return {wire: word for word, wire in forward.items()}


_CACHE_TO_PROTO: dict[CachePolicy, orchestrator_pb2.CachePolicy] = {
    CachePolicy.USE: orchestrator_pb2.CACHE_POLICY_UNSPECIFIED,
    CachePolicy.REFRESH: orchestrator_pb2.CACHE_POLICY_REFRESH,
    CachePolicy.BYPASS: orchestrator_pb2.CACHE_POLICY_BYPASS,
}
_SKIP_TO_PROTO: dict[SkipCause, rerank_pb2.SkipCause] = {
    SkipCause.DEADLINE: rerank_pb2.SKIP_CAUSE_DEADLINE,
    SkipCause.DISABLED: rerank_pb2.SKIP_CAUSE_DISABLED,
    SkipCause.LANGUAGE: rerank_pb2.SKIP_CAUSE_LANGUAGE,
}
_FINISH_TO_PROTO: dict[FinishReason, generation_pb2.FinishReason] = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.DEADLINE: generation_pb2.FINISH_REASON_DEADLINE,
}
_FINISH_FROM_PROTO = _inverse(_FINISH_TO_PROTO)
_CACHE_FROM_PROTO = _inverse(_CACHE_TO_PROTO)
_SKIP_FROM_PROTO = _inverse(_SKIP_TO_PROTO)
_TIER_FROM_PROTO = _inverse(_TIER_TO_PROTO)
_MODE_FROM_PROTO = _inverse(_MODE_TO_PROTO)
_FUSION_FROM_PROTO = _inverse(_FUSION_TO_PROTO)


def tier_to_proto(tier: ModelTier) -> common_pb2.ModelTier:
    return _TIER_TO_PROTO[ModelTier(tier)]


def tier_from_proto(value: int) -> ModelTier:
    """UNSPECIFIED is the small tier (the contract's default)."""
    return (
        ModelTier.SMALL if value == common_pb2.MODEL_TIER_UNSPECIFIED else _TIER_FROM_PROTO[value]
    )


def cache_policy_to_proto(policy: CachePolicy) -> orchestrator_pb2.CachePolicy:
    return _CACHE_TO_PROTO[CachePolicy(policy)]


def cache_policy_from_proto(value: int) -> CachePolicy:
    """UNSPECIFIED is USE (the contract's default)."""
    return _CACHE_FROM_PROTO[value]


def skip_cause_to_proto(cause: SkipCause) -> rerank_pb2.SkipCause:
    return _SKIP_TO_PROTO[SkipCause(cause)]


def skip_cause_from_proto(value: int) -> SkipCause | None:
    """None: a rerank older than the field (its reason's words are all there is)."""
    return _SKIP_FROM_PROTO.get(value)


def finish_reason_to_proto(reason: FinishReason) -> generation_pb2.FinishReason:
    return _FINISH_TO_PROTO[FinishReason(reason)]


def finish_reason_from_proto(value: int) -> FinishReason:
    """UNSPECIFIED (a generation service older than the field) reads as STOP."""
    return _FINISH_FROM_PROTO.get(value, FinishReason.STOP)


def search_mode_to_proto(mode: SearchMode) -> retrieval_pb2.SearchMode:
    return _MODE_TO_PROTO[SearchMode(mode)]


def search_mode_from_proto(value: int) -> SearchMode:
    """UNSPECIFIED is HYBRID (the contract's default)."""
    if value == retrieval_pb2.SEARCH_MODE_UNSPECIFIED:
        return SearchMode.HYBRID
    return _MODE_FROM_PROTO[value]


def fusion_from_proto(value: int) -> Fusion | None:
    """UNSPECIFIED is None: the retrieval service's configured default decides."""
    return None if value == retrieval_pb2.FUSION_UNSPECIFIED else _FUSION_FROM_PROTO[value]
