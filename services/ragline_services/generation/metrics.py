"""What the generation service tells its operators (docs/operations.md), by tier: requests
by finish reason, tokens in and out, time to first token, decode rate, queue wait,
speculation; the slots, the queue, refusals, the prefix store and the engines read at
scrape time."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import Counter, Histogram

from ragline.metrics import LATENCY_BUCKETS, ProcessMetrics
from ragline.vocabulary import ModelTier
from ragline_services.generation.generator import Generator, Summary
from ragline_services.generation.pausing import Pausing
from ragline_services.generation.prefix_store import PrefixStore
from ragline_services.generation.scheduler import SlotScheduler

# Tokens per second of one sequence's decode: a 1.5B model on one CPU core to a GPU.
# Time per output token: 1 ms (a GPU) to 1 s (a large model on a busy CPU).
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
_STORE_EVENTS = ("lookups", "hits", "saves", "evictions", "discarded", "stale", "errors")


class GenerationMetrics:
    def __init__(self, process: ProcessMetrics) -> None:
        self._process = process
        registry = process.registry
        self.requests = Counter(
            "ragline_generation_requests_total",
            "Generations that ran, by tier and finish reason (stop, length, deadline).",
            ("tier", "finish"),
            registry=registry,
        )
        # Kinds that do not overlap, so that sum() over them is every token: a prompt's
        # tokens are either computed or read from the engine's cache.
        self.tokens = Counter(
            "ragline_generation_tokens_total",
            "Tokens by tier and kind: prompt_computed (prompt tokens the engine read), "
            "prompt_cached (prompt tokens its cache held), completion (out).",
            ("tier", "kind"),
            registry=registry,
        )
        self.ttft = Histogram(
            "ragline_generation_time_to_first_token_seconds",
            "From a request's arrival to its first token (queue wait and prefill included).",
            ("tier",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # Time per output token (not its inverse, a rate): quantiles and averages of a
        # time add up the way a latency budget does (TPOT x tokens + TTFT = the answer).
        self.time_per_output_token = Histogram(
            "ragline_generation_time_per_output_token_seconds",
            "One sequence's decode time per output token after its first.",
            ("tier",),
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "ragline_generation_queue_wait_seconds",
            "Time a request waited for a slot.",
            ("tier",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.speculation = Counter(
            "ragline_generation_speculation_tokens_total",
            "Speculative decoding's drafted tokens by tier and result (accepted, rejected): "
            "accepted / (accepted + rejected) is the acceptance rate.",
            ("tier", "result"),
            registry=registry,
        )

    def record(self, summary: Summary, first_token_s: float | None) -> None:
        """One generation that ran; `first_token_s`: from its arrival to its first token."""
        tier = summary.tier
        self.requests.labels(tier, summary.finish_reason).inc()
        cached = min(summary.cached_tokens, summary.prompt_tokens)
        for kind, count in (
            ("prompt_computed", summary.prompt_tokens - cached),
            ("prompt_cached", cached),
            ("completion", summary.completion_tokens),
        ):
            self.tokens.labels(tier, kind).inc(count)
        self.queue_wait.labels(tier).observe(summary.queue_wait_s)
        if first_token_s is not None:
            self.ttft.labels(tier).observe(first_token_s)
        if summary.decode_s > 0 and summary.completion_tokens > 1:
            self.time_per_output_token.labels(tier).observe(
                summary.decode_s / (summary.completion_tokens - 1)
            )
        if summary.drafted:
            accepted = min(summary.accepted, summary.drafted)
            self.speculation.labels(tier, "accepted").inc(accepted)
            self.speculation.labels(tier, "rejected").inc(summary.drafted - accepted)

    def watch(
        self, generator: Generator, engine_problems: Callable[[], Mapping[ModelTier, str]]
    ) -> None:
        """Each tier's slots, queue, refusals, prefix store and engine, read when scraped
        (`engine_problems()`: tier -> why its engine cannot serve, for those that cannot)."""
        for name, tier in generator.tiers.items():
            self._watch_slots(name, tier.scheduler)
            self._watch_pausing(name, tier.scheduler.pausing)
            self._watch_engine(name, engine_problems)
            self._watch_prefix_store(name, tier.prefix_store)

    def _watch_slots(self, tier: ModelTier, scheduler: SlotScheduler) -> None:
        reading = self._process.reading
        reading("ragline_generation_slots_busy", "Slots decoding now.", labels=("tier",)).add(
            lambda: scheduler.busy, tier
        )
        reading(
            "ragline_generation_slots",
            "Slots (sequences at once), the priority slots included.",
            labels=("tier",),
        ).add(lambda: len(scheduler.slots), tier)
        reading(
            "ragline_generation_requests_waiting", "Requests queued for a slot.", labels=("tier",)
        ).add(lambda: scheduler.waiting, tier)

        def refused() -> dict[tuple[str, ...], float]:
            counts: dict[tuple[str, ...], float] = {
                (reason,): count for reason, count in dict(scheduler.refusals).items()
            }
            return {**counts, ("DEADLINE_EXCEEDED",): scheduler.expired_waiting}

        reading(
            "ragline_generation_refusals_total",
            "Requests refused at once, by reason (QUEUE_FULL, DEADLINE_TOO_SHORT_FOR_QUEUE), "
            "or whose deadline passed while they waited (DEADLINE_EXCEEDED).",
            "counter",
            ("tier", "reason"),
        ).add(refused, tier)

    def _watch_pausing(self, tier: ModelTier, pausing: Pausing) -> None:
        reading = self._process.reading
        reading(
            "ragline_generation_pauses_total",
            "Sequences of heavier tenants paused while a light tenant's request ran "
            "(priority slots); each resumes where it stopped.",
            "counter",
            ("tier",),
        ).add(lambda: pausing.pauses, tier)
        reading(
            "ragline_generation_kept_for_deadline_total",
            "Decoding sequences of heavier tenants left running (or resumed) beside a light "
            "tenant's request because their deadline was closer than a decode takes.",
            "counter",
            ("tier",),
        ).add(lambda: pausing.kept_for_deadline, tier)
        reading(
            "ragline_generation_decoding_beside_total",
            "Paused decoding sequences of heavier tenants run again beside light tenants' "
            "requests once those all decode (a decode step costs them little).",
            "counter",
            ("tier",),
        ).add(lambda: pausing.decoding_beside, tier)
        reading(
            "ragline_generation_yielding_prompts_total",
            "Sequences of heavier tenants that read their prompts in small engine steps, one "
            "at a time, having been held back for a light tenant lately (whose requests then wait "
            "for one small step).",
            "counter",
            ("tier",),
        ).add(lambda: pausing.yielding_prompts, tier)

    def _watch_engine(
        self, tier: ModelTier, engine_problems: Callable[[], Mapping[ModelTier, str]]
    ) -> None:
        self._process.reading(
            "ragline_generation_engine_up",
            "1 while the tier's engine serves, 0 while it cannot (health is NOT_SERVING).",
            labels=("tier",),
        ).add(lambda: 0.0 if tier in engine_problems() else 1.0, tier)

    def _watch_prefix_store(self, tier: ModelTier, store: PrefixStore | None) -> None:
        """Its metrics are served (without samples) where no tier has a store."""
        reading = self._process.reading
        events = reading(
            "ragline_generation_prefix_store_events_total",
            "The hot-prefix KV store's events by tier: lookups, hits, saves, evictions, "
            "discarded (corrupt or mismatched states), stale (saves dropped: a source of "
            "their prompt was forgotten meanwhile), errors.",
            "counter",
            ("tier", "event"),
        )
        stored = reading(
            "ragline_generation_prefix_store_bytes",
            "Bytes of saved KV states the store holds (all replicas), as of the last save.",
            labels=("tier",),
        )
        saved = reading(
            "ragline_generation_prefix_store_saved_bytes_total",
            "Bytes of KV states this process saved.",
            "counter",
            ("tier",),
        )
        save_seconds = reading(
            "ragline_generation_prefix_store_save_seconds_total",
            "Seconds slots spent saving hot prefixes after their answers (held from the "
            "next request meanwhile; on no answer's path).",
            "counter",
            ("tier",),
        )
        if store is None:
            return
        counters = store.counters
        events.add(lambda: {(e,): getattr(counters, e) for e in _STORE_EVENTS}, tier)
        stored.add(lambda: store.stored_bytes, tier)
        saved.add(lambda: counters.saved_bytes, tier)
        save_seconds.add(lambda: counters.save_s, tier)
