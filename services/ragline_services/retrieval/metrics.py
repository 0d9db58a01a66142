"""What the retrieval service tells its operators (docs/operations.md): searches by the mode
that ran and their latency, fallbacks by reason, documents written, HNSW builds and their
duration; the index's size, delta, apply lag, write log and re-embed read at scrape time
(one read of the index per scrape)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ragline.metrics import LATENCY_BUCKETS, ProcessMetrics, read_safely
from ragline_services.retrieval.forget_notices import NoticeCounts
from ragline_services.retrieval.index import RetrievalIndex
from ragline_services.retrieval.index_types import SearchResult
from ragline_services.retrieval.vectors import VectorIndexStatus

# An HNSW build: seconds for a small corpus, an hour for a large one.
BUILD_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 10800.0)


class IndexCollector(Collector):
    """The index's state when scraped."""

    def __init__(self, index: RetrievalIndex) -> None:
        self.index = index

    def _families(self, read: bool):
        index = self.index
        vectors = read_safely(index.vectors.status) if read else None
        # None: not read, or a torn read (NaN)
        status = vectors if isinstance(vectors, VectorIndexStatus) else None
        # (kind, name, meaning, value or None when the vector index could not be read)
        rows = (
            ("gauge", "documents", "Live documents, every tenant's.", index.bm25.count),
            (
                "gauge",
                "delta_documents",
                "Vectors written since the last HNSW build (searched exhaustively).",
                (lambda: status.points - status.indexed_points) if status else None,
            ),
            (
                "gauge",
                "vector_index_ready",
                "1 once vector search can serve (else searches fall back to BM25).",
                (lambda: status.ready) if status else None,
            ),
            (
                "gauge",
                "rebuilding",
                "1 while an HNSW build runs.",
                (lambda: status.building) if status else None,
            ),
            (
                "gauge",
                "apply_lag_writes",
                "Writes logged but not yet applied to the search engines.",
                lambda: index.wal.last_seq - index.applied_seq,
            ),
            ("gauge", "wal_bytes", "Bytes of the write log.", lambda: index.wal.size),
            (
                "counter",
                "wal_compactions",
                "Compactions of the write log.",
                lambda: index.compaction.count,
            ),
            (
                "gauge",
                "reembed_remaining_documents",
                "Documents a running re-embed (after a model change) has still to write.",
                lambda: index.models.remaining if index.models.current.reembedding_to else 0,
            ),
        )
        for kind, name, meaning, value in rows:
            full = f"ragline_retrieval_{name}"
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(full, meaning)
            if read and value is not None:
                family.add_metric([], float(read_safely(value)))
            yield family

    def describe(self):
        return list(self._families(read=False))

    def collect(self):
        return self._families(read=True)


class RetrievalMetrics:
    def __init__(self, process: ProcessMetrics) -> None:
        self._process = process
        registry = process.registry
        self.search_seconds = Histogram(
            "ragline_retrieval_search_seconds",
            "Time of one search in the index (embedding the query included), by the mode "
            "that ran (bm25, vector, hybrid, prefilter).",
            ("mode",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "ragline_retrieval_search_fallbacks_total",
            "Searches that ran another mode than asked, by reason (vector_index_not_ready, "
            "embedding_unavailable, vector_index_reembedding, embedding_model_changed).",
            ("reason",),
            registry=registry,
        )
        self.written = Counter(
            "ragline_retrieval_documents_written_total",
            "Documents acknowledged by operation (upsert, delete).",
            ("operation",),
            registry=registry,
        )
        self.build_seconds = Histogram(
            "ragline_retrieval_build_seconds",
            "Time of one HNSW build (its count: the builds).",
            buckets=BUILD_BUCKETS,
            registry=registry,
        )

    def watch(self, index: RetrievalIndex) -> None:
        self._process.registry.register(IndexCollector(index))

    def watch_notices(self, counts: NoticeCounts) -> None:
        """The delete notices to the services keeping copies (forget_notices.py)."""
        self._process.reading(
            "ragline_retrieval_forget_notices_total",
            "Notices that documents were deleted or overwritten, to a service keeping "
            "copies of their text, by result: delivered (every replica took it), retried "
            "(an attempt failed; tried again), given_up (dropped: past the retry window, "
            "or over the bound of ids waiting).",
            "counter",
            ("result",),
        ).add(
            lambda: {
                ("delivered",): counts.delivered,
                ("retried",): counts.retried,
                ("given_up",): counts.given_up,
            }
        )
        self._process.reading(
            "ragline_retrieval_forget_notice_ids_waiting",
            "Document ids of notices not delivered yet, over all targets.",
        ).add(lambda: counts.pending_ids)

    def searched(self, result: SearchResult, seconds: float) -> None:
        self.search_seconds.labels(result.mode_used).observe(seconds)
        if result.fell_back:
            self.fallbacks.labels(result.fallback_reason or "unknown").inc()

    def wrote(self, operation: str, documents: int) -> None:
        self.written.labels(operation).inc(documents)

    def built(self, seconds: float) -> None:
        self.build_seconds.observe(seconds)
