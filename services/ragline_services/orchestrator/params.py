"""Each step kind's parameters as a typed dataclass, and the one place a plan node's text
parameters (`PlanNode.params`, a map of strings) are read into them and checked.

A parameter left unset is None: the step uses the run's setting (a request's, else the
server's). The maxima are what the service a step calls accepts (its contract's rules),
so a plan that asks for more is the caller's error when the plan is built, not a failed
step.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields

from ragline.errors import FieldViolation
from ragline.vocabulary import Fusion, ModelTier, SearchMode


def boolean(text: str) -> bool:
    """A yes/no parameter: true/false, 1/0, yes/no."""
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValueError(text)


def _reads(read: Callable[[str], object], most: float | None = None) -> dict:
    """A parameter a plan may set (its field's metadata): how its text is read, and the
    most it may be."""
    return {"read": read, "most": most}


@dataclass(frozen=True)
class StepParams:
    """The parameters of a kind that takes none; the base of every other kind's."""

    @classmethod
    def settable(cls) -> dict[str, Field]:
        """The fields a plan may set, by name (internal ones, set by the server's own plans,
        are not among them)."""
        return {f.name: f for f in fields(cls) if "read" in f.metadata}

    @classmethod
    def accepted(cls) -> list[str]:
        return sorted(cls.settable())

    def as_text(self) -> dict[str, str]:
        """The parameters set (those that differ from their default), as a plan's text."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            default = None if f.default is MISSING else f.default
            if value != default:
                out[f.name] = str(value)
        return out


@dataclass(frozen=True)
class QueryParams(StepParams):
    # Instead of the question.
    query: str | None = field(default=None, metadata=_reads(str))


@dataclass(frozen=True)
class Bm25Params(QueryParams):
    k: int | None = field(default=None, metadata=_reads(int, most=1000))  # SearchRequest.k


@dataclass(frozen=True)
class VectorSearchParams(Bm25Params):
    hnsw_ef: int | None = field(default=None, metadata=_reads(int, most=4096))


@dataclass(frozen=True)
class RetrieveParams(Bm25Params):
    mode: SearchMode | None = field(default=None, metadata=_reads(SearchMode))
    # Internal: the agent's lookups are charged to the task's budget as calls of their own.
    charged: bool = False


@dataclass(frozen=True)
class FuseParams(StepParams):
    k: int | None = field(default=None, metadata=_reads(int, most=1000))
    fusion: Fusion | None = field(default=None, metadata=_reads(Fusion))
    vector_weight: float | None = field(default=None, metadata=_reads(float, most=1.0))


@dataclass(frozen=True)
class RerankParams(StepParams):
    top_k: int | None = field(default=None, metadata=_reads(int, most=1000))
    late_interaction_k: int | None = field(default=None, metadata=_reads(int, most=1000))
    cross_encoder: bool | None = field(default=None, metadata=_reads(boolean))


@dataclass(frozen=True)
class EvidenceParams(StepParams):
    # Passages whose sentences compete (RetrievalOptions.context_passages allows 50).
    passages: int | None = field(default=None, metadata=_reads(int, most=50))
    # Prompt tokens of evidence.
    max_tokens: int | None = field(default=None, metadata=_reads(int, most=32768))


@dataclass(frozen=True)
class AnswerParams(StepParams):
    # Answer tokens.
    max_tokens: int | None = field(default=None, metadata=_reads(int, most=8192))
    # Pinned: an answer in this tier is never escalated.
    tier: ModelTier | None = field(default=None, metadata=_reads(ModelTier))


def read_params(
    params_type: type[StepParams], kind_name: str, texts: Mapping[str, str], path: str
) -> tuple[StepParams, list[FieldViolation]]:
    """`texts` read into `params_type`, and every problem, each naming its key."""
    by_name = params_type.settable()
    values: dict[str, object] = {}
    problems: list[FieldViolation] = []

    def bad(key: str, why: str) -> None:
        problems.append(FieldViolation(f"{path}.params[{key}]", why))

    for key, text in sorted(texts.items()):
        known = by_name.get(key)
        if known is None:
            names = ", ".join(params_type.accepted()) or "none"
            bad(key, f"is not a parameter of {kind_name} (known: {names})")
            continue
        read, most = known.metadata["read"], known.metadata["most"]
        try:
            value = read(text)
        except ValueError:
            if isinstance(read, type) and issubclass(read, enum.Enum):
                words = sorted(str(word.value) for word in read)
                bad(key, f"{text!r} is not one of {words}")
            else:
                bad(key, f"{text!r} is not a {read.__name__}")
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            if value < 0:
                bad(key, "must not be negative")
                continue
            if isinstance(value, float) and not math.isfinite(value):
                bad(key, "must be a finite number")
                continue
            if most is not None and value > most:
                bad(key, f"is {text}; the maximum is {most:g}")
                continue
        values[key] = value
    return params_type(**values), problems
