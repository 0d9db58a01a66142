"""What the budget service tells its operators (docs/operations.md): ledger operations by
result (granted, replayed, or the refusal's reason), etcd's latency per operation, write
conflicts between replicas, and whether etcd answers."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from ragline.errors import RaglineError
from ragline.metrics import LATENCY_BUCKETS, ProcessMetrics
from ragline_services.budget.ledger import TaskLedger
from ragline_services.budget.store import EtcdLedgerStore

OK, REPLAYED = "ok", "replayed"


def result_of(outcome: object) -> str:
    return REPLAYED if getattr(outcome, "replayed", False) else OK


def reason_of(error: BaseException) -> str:
    """A refusal's reason (BUDGET_EXHAUSTED, NOT_FOUND, ...): a bounded set of constants."""
    return error.reason if isinstance(error, RaglineError) else "INTERNAL"


class BudgetMetrics:
    def __init__(self, process: ProcessMetrics) -> None:
        self._process = process
        self.operations = Counter(
            "ragline_budget_operations_total",
            "Ledger operations (reserve, settle, cancel, open_task, close_task, get) by "
            "result: ok, replayed, or the reason they were refused.",
            ("operation", "result"),
            registry=process.registry,
        )
        self.etcd_seconds = Histogram(
            "ragline_budget_etcd_seconds",
            "Time of one etcd operation (read, write, read_prefix, lease grant, ...) by "
            "result (ok, error).",
            ("operation", "result"),
            buckets=LATENCY_BUCKETS,
            registry=process.registry,
        )

    def watch(self, ledger: TaskLedger, store: EtcdLedgerStore, reachable) -> None:
        """The ledger's conflicts and etcd's reachability (`reachable()`), read when
        scraped; etcd's operations timed from now on."""
        store.observe = self.etcd_seconds_observed
        self._process.reading(
            "ragline_budget_conflicts_total",
            "Ledger transactions that lost to another replica's write and were tried again.",
            "counter",
        ).add(lambda: ledger.conflicts)
        self._process.reading(
            "ragline_budget_etcd_reachable",
            "1 while etcd answers the health probe, 0 while it does not (asks then fail "
            "with UNAVAILABLE: the ledger fails closed).",
        ).add(lambda: 1.0 if reachable() else 0.0)

    def etcd_seconds_observed(self, operation: str, result: str, seconds: float) -> None:
        self.etcd_seconds.labels(operation, result).observe(seconds)

    def done(self, operation: str, result: str) -> None:
        self.operations.labels(operation, result).inc()
