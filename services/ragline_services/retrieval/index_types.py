"""The retrieval domain's values: what a write and a search take and give back, the
index's settings and status, and the embedding call an index is given. No behaviour."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from ragline.vocabulary import Fusion, SearchMode
from ragline_services.retrieval.bm25_params import TANTIVY, Bm25Params


@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray  # one row per text
    model_version: str  # of the model that made them ("": unknown)


# (texts, input kind "query" | "passage") -> vectors; raises Unavailable when it can't.
Embed = Callable[[list[str], str], Awaitable[Embedded]]
Changed = Callable[[str, list[str]], None]  # (tenant, ids of documents replaced or deleted)


EMBEDDING_MODEL_CHANGED = "embedding_model_changed"
REEMBEDDING = "vector_index_reembedding"


@dataclass(frozen=True)
class DocumentInput:
    id: str
    title: str
    text: str
    acl: tuple[str, ...] = ()
    attributes: dict[str, str] = field(default_factory=dict)
    vector: tuple[float, ...] = ()
    vector_model: str = ""  # the embedding model of `vector` ("": the caller's own)


@dataclass(frozen=True)
class WriteResult:
    seq: int  # position in the whole log (operators)
    versions: list[int]
    deleted: int = 0
    not_found: int = 0
    tenant_seq: int = 0  # position among the tenant's writes (what the tenant is shown)


@dataclass(frozen=True)
class SearchQuery:
    text: str
    k: int
    mode: SearchMode = SearchMode.HYBRID
    vector: tuple[float, ...] = ()
    hnsw_ef: int = 0
    candidates: int = 0
    fusion: Fusion | None = None  # None: the index's default
    vector_weight: float = 0.0
    include_text: bool = False


@dataclass(frozen=True)
class SearchHit:
    id: str
    score: float
    version: int
    scores: dict[str, float]
    title: str = ""
    text: str = ""


@dataclass(frozen=True)
class SearchResult:
    hits: list[SearchHit]
    mode_used: SearchMode
    fell_back: bool
    fallback_reason: str
    index_version: int
    stages: list[tuple[str, float]]


@dataclass(frozen=True)
class IndexStatus:
    index_version: int
    tenant_documents: int
    total_documents: int
    log_sequence: int
    applied_sequence: int
    delta_documents: int
    vector_index_ready: bool
    rebuilding: bool
    last_build_finished: float | None  # unix time
    dim: int
    apply_error: str = ""
    reembedding_to: str = ""
    reembed_remaining: int = 0


@dataclass
class IndexSettings:
    dim: int
    default_candidates: int = 100
    default_hnsw_ef: int = 128
    # HYBRID weight of the vector list (BM25 gets the rest) for RRF, and for min-max score
    # fusion, the default fusion: tuned on SQuAD dev, held out on new_wiki (docs/tuning.md).
    default_vector_weight: float = 0.2
    default_score_weight: float = 0.4
    default_fusion: Fusion = Fusion.SCORE
    bm25_max_open_tenants: int = 256
    # Weight of a BM25 query word's translation into the other language (Chinese <->
    # English, ragline.lexicon); 0: none (docs/tuning.md).
    cross_lingual_weight: float = 0.5
    # BM25's k1 and b (Tantivy's own by default; others score its candidates again).
    bm25: Bm25Params = TANTIVY
    # Threads that run searches (one hop per search), apart from writes and builds.
    query_threads: int = 2
    # HYBRID runs its vector half on a second thread while BM25 runs on the first: Tantivy
    # releases the GIL while it searches, and the vector half waits on its shard process
    # (or holds the GIL, in process), so the two overlap.
    parallel_hybrid: bool = True
    # When the embedding service runs another model than the index's vectors came from:
    # re-embed every document with it in the background (False: refuse such writes).
    reembed_on_model_change: bool = True
    # The write log is compacted (wal.py) once it is larger than this and twice what the
    # last compaction left; 0: never for size.
    wal_compact_bytes: int = 256 << 20
    # ... and once a delete is this old, so that deleted text leaves the log within it
    # (0: only for size).
    forget_after_s: float = 3600.0
