"""What the orchestrator tells its operators (docs/operations.md): answers by state and
reason, each plan node's time by kind, cache lookups by layer, escalations by signal. Read
from a finished run's outcome; label values are bounded (a reason's kind, never its text)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from ragline.metrics import LATENCY_BUCKETS, ProcessMetrics
from ragline_services.orchestrator.core import AskOutcome, Orchestrator


def reason_kind(reason: str) -> str:
    """ "degraded: rerank_unavailable, ..." -> "degraded": the label, never a run's details
    (a part's text, a list of stages)."""
    return reason.split(":", 1)[0].strip() or "none"


class OrchestratorMetrics:
    def __init__(self, process: ProcessMetrics) -> None:
        registry = process.registry
        self._process = process
        self.tenant = process.tenant
        self.answers = Counter(
            "ragline_orchestrator_answers_total",
            "Ask results by answer state, the kind of their reason, and tenant.",
            ("state", "reason", "tenant"),
            registry=registry,
        )
        self.node_seconds = Histogram(
            "ragline_orchestrator_node_seconds",
            "Time of each plan node that ran, from its reservation or call to its end.",
            ("kind", "state"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.cache_lookups = Counter(
            "ragline_orchestrator_cache_lookups_total",
            "Cache lookups by layer (answer, retrieval, tool) and result (hit, miss).",
            ("cache", "result"),
            registry=registry,
        )
        self.refusals = Counter(
            "ragline_orchestrator_refusals_total",
            "Asks refused before running, by reason (QUEUE_FULL, DEADLINE_TOO_SHORT_FOR_QUEUE).",
            ("reason",),
            registry=registry,
        )
        self.admission_wait = Histogram(
            "ragline_orchestrator_admission_wait_seconds",
            "Time an Ask waited for a run place (0 for an answer from the cache).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.escalations = Counter(
            "ragline_orchestrator_escalations_total",
            "Answers sent to the large tier, by the first signal that fired on the small one.",
            ("signal",),
            registry=registry,
        )
        self.not_escalated = Counter(
            "ragline_orchestrator_escalations_not_made_total",
            "Small answers that failed their checks and were not sent to the large tier, by "
            "why (evidence_unlikely, others_in_flight, no_large_tier, unaffordable, failed).",
            ("why",),
            registry=registry,
        )

    def watch(self, orchestrator: Orchestrator) -> None:
        """Admission's state, read when scraped (nothing to update on the request path)."""
        admission = orchestrator.admission
        for name, meaning, read in (
            ("runs_in_flight", "Runs holding a place now.", lambda: admission.in_flight),
            ("runs_waiting", "Asks queued for a place now.", lambda: admission.waiting),
            ("run_places", "Runs that may be in flight at once.", lambda: admission.max_in_flight),
        ):
            self._process.reading(f"ragline_orchestrator_{name}", meaning).add(read)
        self._process.reading(
            "ragline_orchestrator_generations_raised_total",
            "Generations sent again marked as a light tenant's: the run's tenant turned light "
            "(a flood began beside it) before their first token.",
            "counter",
        ).add(lambda: orchestrator.generations_raised)

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def record(self, outcome: AskOutcome, tenant: str) -> None:
        # States as the API names them (ANSWER_STATE_COMPLETE, NODE_STATE_SUCCEEDED, ...).
        state, reason = outcome.state.upper(), reason_kind(outcome.reason)
        self.answers.labels(state, reason, self.tenant(tenant)).inc()
        self.admission_wait.observe(max(outcome.admitted - outcome.received, 0.0))
        for record in outcome.records.values():
            if record.started is not None and record.finished is not None:
                self.node_seconds.labels(record.node.kind.value, record.state.upper()).observe(
                    max(record.finished - record.started, 0.0)
                )
        use = outcome.cache
        for layer, hits, misses in (
            ("answer", use.answer_hit, use.answer_miss),
            ("retrieval", use.retrieval_hits, use.retrieval_misses),
            ("tool", use.tool_hits, use.tool_misses),
        ):
            if hits:
                self.cache_lookups.labels(layer, "hit").inc(hits)
            if misses:
                self.cache_lookups.labels(layer, "miss").inc(misses)
        if outcome.written.escalated:
            first = outcome.written.signals[0] if outcome.written.signals else "unknown"
            self.escalations.labels(reason_kind(first)).inc()
        if outcome.written.not_escalated is not None:
            self.not_escalated.labels(outcome.written.not_escalated.value).inc()
