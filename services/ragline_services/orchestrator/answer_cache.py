"""The answer cache's layer: what a stored COMPLETE answer holds (a typed entry, kept as
JSON by the caches of caches.py), the key it is stored under, and the checks a hit passes
before it is served (every document it returned still at its version and visible to this
caller, the tier's model still the one that wrote it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ragline.v1 import common_pb2, generation_pb2, retrieval_pb2
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator import verifier
from ragline_services.orchestrator.caches import (
    ANSWER,
    OrchestratorCaches,
    Viewer,
    normalise,
    stale_documents,
)
from ragline_services.orchestrator.plan import Kind, Plan
from ragline_services.orchestrator.run_context import Clients, Settings
from ragline_services.orchestrator.runner import NodeState
from ragline_services.orchestrator.verdict import Written

if TYPE_CHECKING:
    from ragline_services.orchestrator.core import AskOutcome

# Time the checks of a hit may take (each a cheap call).
_CHECK_TIMEOUT_S = 1.0
# Settings that do not shape the answer, so not part of its key.
_NOT_SHAPING = ("question", "allow_degrade", "prices")


@dataclass(frozen=True)
class CachedAnswer:
    """A COMPLETE answer as stored: its text, what it cites and read, who wrote it, and what
    each node of its run would have cost (a hit reports it as saved)."""

    answer: str
    citations: tuple[ev.EvidenceItem, ...]
    evidence: tuple[ev.EvidenceItem, ...]
    model: str
    model_version: str
    tier: common_pb2.ModelTier
    verified: float | None = None
    answer_logprob: float | None = None
    saved: tuple[dict[str, Any], ...] = ()
    route: str = "rag"
    subqueries: tuple[Any, ...] = field(default=())

    @classmethod
    def of(cls, outcome: AskOutcome, saved: tuple[dict[str, Any], ...]) -> CachedAnswer:
        written = outcome.written
        return cls(
            answer=written.answer,
            citations=tuple(written.citations),
            evidence=tuple(written.evidence),
            model=written.model,
            model_version=written.model_version,
            tier=written.tier,
            verified=written.verified,
            answer_logprob=written.answer_logprob,
            saved=saved,
            route=outcome.route,
            subqueries=tuple(outcome.subqueries),
        )

    def written(self) -> Written:
        """What the answer step wrote, as a hit serves it."""
        return Written(
            answer=self.answer,
            citations=list(self.citations),
            evidence=list(self.evidence),
            model=self.model,
            tier=self.tier,
            model_version=self.model_version,
            verified=self.verified,
            answer_logprob=self.answer_logprob,
        )

    @property
    def documents(self) -> dict[str, int]:
        """Every document it returned, at the version it read."""
        return {i.passage.id: i.passage.version for i in self.citations + self.evidence}

    def to_json(self) -> dict[str, Any]:
        return {
            "answer": self.answer,
            "citations": _rows(self.citations),
            "evidence": _rows(self.evidence),
            "documents": self.documents,  # what a sweep after a delete reads (caches.py)
            "model": self.model,
            "model_version": self.model_version,
            "tier": self.tier,
            "verified": self.verified,
            "answer_logprob": self.answer_logprob,
            "saved": list(self.saved),
            "route": self.route,
            "subqueries": list(self.subqueries),
        }

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> CachedAnswer:
        return cls(
            answer=entry["answer"],
            citations=_items(entry["citations"]),
            evidence=_items(entry["evidence"]),
            model=entry["model"],
            model_version=entry["model_version"],
            tier=entry["tier"],
            verified=entry.get("verified"),
            answer_logprob=entry.get("answer_logprob"),
            saved=tuple(entry["saved"]),
            route=entry.get("route", "rag"),
            subqueries=tuple(entry.get("subqueries", ())),
        )


def _rows(items: tuple[ev.EvidenceItem, ...]) -> list[list[Any]]:
    return [[i.marker, i.passage.id, i.passage.title, i.passage.version, i.text] for i in items]


def _items(rows: list[list[Any]]) -> tuple[ev.EvidenceItem, ...]:
    return tuple(
        ev.EvidenceItem(marker, ev.Passage(doc, title, "", version), text)
        for marker, doc, title, version, text in rows
    )


def answer_key(
    caches: OrchestratorCaches, viewer: Viewer, settings: Settings, plan: Plan, agent: object
) -> str:
    """Everything that decides the answer: the view, the question, the settings and plan
    that shape it, the prompt's and the verifier's versions."""
    shaping = {name: value for name, value in settings.__dict__.items() if name not in _NOT_SHAPING}
    return caches.key(
        ANSWER,
        viewer,
        normalise(settings.question),
        shaping,
        repr(plan.nodes),
        agent,
        ev.PROMPT_TEMPLATE_VERSION,
        verifier.VERSION,
    )


async def lookup(caches: OrchestratorCaches, clients: Clients, key: str) -> CachedAnswer | None:
    """The stored answer under `key` if it may be served now; a stale one is dropped."""
    entry = await caches.get(ANSWER, key)
    if entry is None:
        return None
    found = CachedAnswer.from_json(entry)
    versions, model = await asyncio.gather(
        clients.retrieval.unary(
            "DocumentVersions",
            retrieval_pb2.DocumentVersionsRequest(ids=list(found.documents)),
            stage_budget_s=_CHECK_TIMEOUT_S,
        ),
        clients.generation.unary(
            "CountTokens",
            generation_pb2.CountTokensRequest(prompt="x", tier=found.tier),
            stage_budget_s=_CHECK_TIMEOUT_S,
        ),
    )
    stale = stale_documents(found.documents, dict(versions.versions))
    if stale or model.model_version != found.model_version:
        why = f"documents changed or hidden: {stale}" if stale else "the model changed"
        await caches.drop(ANSWER, key, why)
        return None
    caches.hit(ANSWER)
    return found


async def remember(
    caches: OrchestratorCaches, key: str, outcome: AskOutcome, viewer: Viewer
) -> None:
    """Stores a COMPLETE outcome's answer, with what each node of its run cost."""
    written = outcome.written
    earlier = {saving["node_id"]: saving for saving in outcome.cache.saved}
    saved = []
    for node in outcome.plan.nodes:
        record = outcome.records[node.id]
        if record.state != NodeState.SUCCEEDED:
            continue
        saving = earlier.get(node.id) or {
            "node_id": node.id,
            "kind": node.kind.value,
            "time_s": record.duration_s,
            "input_tokens": 0,
            "output_tokens": 0,
        }
        saving = {**saving, "layer": ANSWER}
        if node.kind in (Kind.GENERATE, Kind.SYNTHESIZE) and written.usage is not None:
            stages = _stages(record.server)
            saving.update(
                input_tokens=written.usage.input_tokens,
                output_tokens=written.usage.output_tokens,
                prefill_s=stages.get("prefill", 0.0),
                decode_s=stages.get("decode", 0.0),
            )
        saved.append(saving)
    entry = CachedAnswer.of(outcome, tuple(saved))
    await caches.put(ANSWER, key, entry.to_json(), viewer=viewer)


def _stages(timing) -> dict[str, float]:
    if timing is None:
        return {}
    return {stage.name: stage.duration.ToNanoseconds() / 1e9 for stage in timing.stages}
