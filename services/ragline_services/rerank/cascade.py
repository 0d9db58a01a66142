"""The rerank cascade: late interaction narrows, the cross-encoder orders the best. No gRPC.

Stage 1 (late interaction) scores every candidate by MaxSim between the query's and the
candidate's token vectors, blended with the score the candidate came with (a retrieval
list already carries most of the signal), and keeps the best `late_interaction_k`.
Candidate token vectors are computed once per (tenant, id, text) and kept in a bounded
cache, stored reduced (projected, int8). Stage 2 (cross-encoder) reads the query with each
of the best `cross_encoder_candidates` survivors and keeps the best `top_k`.

`prepare` with embeddings also returns each document's embedding from the same model run
(the token model is an embedding model), so a loader encodes a passage once for its vector
and its token vectors.

A query can be encoded ahead of its candidates (`prepare` with a query: the orchestrator
sends the question while retrieval runs), so that stage 1 is only the scoring when the
candidates come; a rerank that finds its query still being encoded waits for that work
instead of doing it twice.

Each stage's cost is estimated from its recent measured latency; when the time left cannot
afford stage 2 and the request allows it, stage 2 is skipped and the response says so;
when it does not allow it, the call fails DEADLINE_EXCEEDED at once instead of running
into the deadline. Both models batch work across concurrent requests.

Why one file of this length: both stages, their blend and the deadline decision between
them are one ranking, read top to bottom.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import structlog
from cachetools import TTLCache

from ragline import deadlines
from ragline.batching import MicroBatcher
from ragline.errors import DeadlineExceeded, InvalidArgument
from ragline.tokenization import Tokenizer
from ragline.vocabulary import SkipCause
from ragline.words import has_han
from ragline_services.rerank.models import dequantize, maxsim_many, quantize
from ragline_services.rerank.token_store import TokenStore

log = structlog.get_logger("ragline.rerank")

LATE_INTERACTION, CROSS_ENCODER = "late_interaction", "cross_encoder"


@dataclass(frozen=True)
class Candidate:
    id: str
    text: str
    first_stage_score: float = 0.0


@dataclass(frozen=True)
class RerankInput:
    tenant: str
    query: str
    candidates: list[Candidate]
    top_k: int = 5
    late_interaction_k: int = 20
    allow_skip: bool = False
    late_interaction_only: bool = False


@dataclass(frozen=True)
class Scored:
    id: str
    score: float  # of the last stage that ran
    scores: dict[str, float]


@dataclass(frozen=True)
class Skipped:
    """A stage left out: its cause to decide on, its reason in words."""

    stage: str
    cause: SkipCause
    reason: str


@dataclass
class RerankOutput:
    results: list[Scored]
    stages_run: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    input_tokens: int = 0
    stage_seconds: list[tuple[str, float]] = field(default_factory=list)
    queue_wait_s: float = 0.0


def reads(scripts: frozenset[str], text: str) -> bool:
    """Whether a model reading `scripts` (empty: any) reads `text`: one trained on Latin
    script alone does not read Chinese."""
    return not scripts or "Han" in scripts or not has_han(text)


def language_skip(scripts: frozenset[str], query: str, candidates: list[Candidate]) -> str | None:
    """Why a model reading `scripts` cannot score the query against the candidates (None:
    it can): it must read the query and every candidate it would score."""
    if not reads(scripts, query):
        what = "the query"
    elif not all(reads(scripts, c.text) for c in candidates):
        what = "every candidate"
    else:
        return None
    return (
        f"language: the model reads {', '.join(sorted(scripts))} script only, not "
        f"{what}; the candidates keep their order"
    )


class TokenCache:
    """Candidate token vectors (int8 + scales) by (tenant, id, text digest), least recently
    used out first. The tenant is part of every key: a hit (and its speed) is only ever the
    tenant's own."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str, str], tuple[np.ndarray, np.ndarray]] = (
            OrderedDict()
        )
        self.hits = self.misses = 0

    @staticmethod
    def key(tenant: str, candidate: Candidate) -> tuple[str, str, str]:
        digest = hashlib.blake2b(candidate.text.encode(), digest_size=12).hexdigest()
        return tenant, candidate.id, digest

    def get(self, key) -> np.ndarray | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return dequantize(*entry)

    def put(self, key, vectors: np.ndarray) -> np.ndarray:
        """Keeps `vectors` (int8) and returns them as kept, so that a hit and a miss rank
        alike (also when the entry is evicted at once by a bound smaller than one batch)."""
        return self.put_entry(key, quantize(vectors))

    def forget(self, tenant: str, ids: set[str]) -> int:
        """Drops every entry of `tenant`'s documents `ids`, whatever their text."""
        gone = [k for k in self._entries if k[0] == tenant and k[1] in ids]
        for key in gone:
            self.bytes -= _nbytes(self._entries.pop(key))
        return len(gone)

    def put_entry(self, key, entry: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Keeps an entry already int8 (from the disk store); returns it as vectors."""
        if key in self._entries:
            self.bytes -= _nbytes(self._entries.pop(key))
        self._entries[key] = entry
        self.bytes += _nbytes(entry)
        while self.bytes > self.max_bytes and self._entries:
            self.bytes -= _nbytes(self._entries.popitem(last=False)[1])
        return dequantize(*entry)


@dataclass(frozen=True)
class EncodedQuery:
    rows: np.ndarray  # the token vectors MaxSim averages over
    tokens: int  # what encoding it read (charged to whoever encoded it)


class QueryCache:
    """Queries encoded ahead of their rerank, by (tenant, query digest): the encoding's
    task, done or under way. Short-lived and bounded: a plan reranks within a second or
    two of preparing its question, and a query prepared but never reranked must not stay.
    The tenant is part of every key, as in TokenCache."""

    def __init__(self, max_entries: int = 1024, ttl_s: float = 30.0) -> None:
        self._entries: TTLCache[tuple[str, str], asyncio.Future[EncodedQuery]] = TTLCache(
            maxsize=max_entries, ttl=ttl_s, timer=time.monotonic
        )

    @staticmethod
    def key(tenant: str, query: str) -> tuple[str, str]:
        return tenant, hashlib.blake2b(query.encode(), digest_size=16).hexdigest()

    def get(self, key) -> asyncio.Future[EncodedQuery] | None:
        return self._entries.get(key)

    def put(self, key, encoding: asyncio.Future[EncodedQuery]) -> None:
        self._entries[key] = encoding

    def forget(self, key, encoding: asyncio.Future[EncodedQuery]) -> None:
        if self._entries.get(key) is encoding:
            with contextlib.suppress(KeyError):
                del self._entries[key]


def _nbytes(entry: tuple[np.ndarray, np.ndarray]) -> int:
    rows, scales = entry
    return rows.nbytes + scales.nbytes


@dataclass
class StageCost:
    """Recent seconds per unit of work (moving average), for the deadline decision."""

    per_unit_s: float | None = None

    def record(self, seconds: float, units: int) -> None:
        sample = seconds / max(units, 1)
        self.per_unit_s = (
            sample if self.per_unit_s is None else 0.8 * self.per_unit_s + 0.2 * sample
        )

    def estimate(self, units: int) -> float | None:
        return None if self.per_unit_s is None else self.per_unit_s * units


def _minmax(values: np.ndarray) -> np.ndarray:
    if len(values) == 0:
        return values
    low, high = float(values.min()), float(values.max())
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


@dataclass(frozen=True)
class DocumentEmbedding:
    vector: np.ndarray  # L2 norm 1
    token_count: int
    truncated: bool


@dataclass
class PrepareOutput:
    prepared: int = 0
    already_prepared: int = 0
    query_prepared: bool = False
    query_already_prepared: bool = False
    input_tokens: int = 0
    queue_wait_s: float = 0.0
    # With embeddings: one per document, in order.
    embeddings: list[DocumentEmbedding] = field(default_factory=list)


def _check_ids(candidates: list[Candidate], field_name: str) -> None:
    seen: dict[str, int] = {}
    for index, candidate in enumerate(candidates):
        if candidate.id in seen:
            raise InvalidArgument(
                f"{field_name}[{index}].id",
                f"{candidate.id!r} is also {field_name}[{seen[candidate.id]}]; ids must differ",
            )
        seen[candidate.id] = index


class Reranker:
    def __init__(
        self,
        *,
        token_tokenizer: Tokenizer,
        token_batcher: MicroBatcher,
        pair_tokenizer: Tokenizer | None,
        pair_batcher: MicroBatcher | None,
        cache: TokenCache,
        store: TokenStore | None = None,
        queries: QueryCache | None = None,
        late_interaction_weight: float = 0.7,
        cross_encoder_weight: float = 0.3,
        cross_encoder_candidates: int = 5,
        deadline_margin_s: float = 0.005,
        skip_query_tokens: frozenset[int] = frozenset(),
        embedding_model_version: str = "",
        query_prefix: str = "",
        passage_prefix: str = "",
        token_scripts: frozenset[str] = frozenset(),
        pair_scripts: frozenset[str] = frozenset(),
    ) -> None:
        """`embedding_model_version`: how the embedding service names the token model's
        vectors; `query_prefix` / `passage_prefix`: what that model puts before a query / a
        passage it embeds ("query: ", "passage: " for multilingual-e5). Texts are run with
        them, as the model was trained to read them, so that a passage's run is also its
        embedding; the prefix's own token vectors are left out of what MaxSim reads."""
        self.token_tokenizer = token_tokenizer
        self.token_batcher = token_batcher
        self.pair_tokenizer = pair_tokenizer
        self.pair_batcher = pair_batcher
        self.cache = cache
        self.store = store
        self._persisting: set[asyncio.Future] = set()
        self.queries = queries if queries is not None else QueryCache()
        self._encodings: set[asyncio.Future] = set()
        self.late_interaction_weight = late_interaction_weight
        self.cross_encoder_weight = cross_encoder_weight
        self.cross_encoder_candidates = cross_encoder_candidates
        self.deadline_margin_s = deadline_margin_s
        self.skip_query_tokens = skip_query_tokens
        self.embedding_model_version = embedding_model_version
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self._prefix_rows = {
            prefix: self._leading_tokens(prefix) for prefix in {query_prefix, passage_prefix}
        }
        # The scripts each stage's model reads (the manifest's `scripts`; empty: any).
        self.token_scripts = token_scripts
        self.pair_scripts = pair_scripts
        self.costs = {LATE_INTERACTION: StageCost(), CROSS_ENCODER: StageCost()}

    async def rerank(self, request: RerankInput) -> RerankOutput:
        _check_ids(request.candidates, "candidates")
        output = RerankOutput(results=[])
        unread = language_skip(self.token_scripts, request.query, request.candidates)
        if unread:
            # An English model scoring a Chinese question reorders at random, worse than
            # the order it came with (docs/tuning.md): the order stands.
            output.skipped.append(Skipped(LATE_INTERACTION, SkipCause.LANGUAGE, unread))
            if not request.late_interaction_only and self.pair_batcher is not None:
                output.skipped.append(Skipped(CROSS_ENCODER, SkipCause.LANGUAGE, unread))
            output.results = [
                Scored(c.id, float(c.first_stage_score), {})
                for c in request.candidates[: request.top_k]
            ]
            return output
        survivors, stage1 = await self._late_interaction(request, output)
        results = [
            Scored(c.id, float(stage1[c.id]), {LATE_INTERACTION: float(stage1[c.id])})
            for c in survivors
        ]
        if request.late_interaction_only:
            pass  # the caller's choice: nothing skipped, nothing to report
        elif self.pair_batcher is None:
            output.skipped.append(Skipped(CROSS_ENCODER, SkipCause.DISABLED, "disabled"))
        elif unread := language_skip(
            self.pair_scripts, request.query, survivors[: self.cross_encoder_candidates]
        ):
            output.skipped.append(Skipped(CROSS_ENCODER, SkipCause.LANGUAGE, unread))
        else:
            chosen = survivors[: self.cross_encoder_candidates]
            reason = self._cannot_afford(CROSS_ENCODER, len(chosen))
            if reason and request.allow_skip:
                output.skipped.append(Skipped(CROSS_ENCODER, SkipCause.DEADLINE, reason))
            elif reason:
                raise DeadlineExceeded(
                    f"the cross-encoder would need about {reason}; the request does not allow "
                    "skipping it (allow_skip)",
                    reason="STAGE_UNAFFORDABLE",
                    metadata={"stage": CROSS_ENCODER},
                )
            else:
                results = await self._cross_encoder(request, chosen, stage1, output) + [
                    r for r in results if r.id not in {c.id for c in chosen}
                ]
        output.results = results[: request.top_k]
        return output

    def _cannot_afford(self, stage: str, units: int) -> str | None:
        """Why `stage` cannot run in the time left (None: it can)."""
        left = deadlines.remaining()
        estimate = self.costs[stage].estimate(units)
        if left is None or estimate is None:
            return None
        if estimate + self.deadline_margin_s > left:
            needed, remains = estimate * 1000, max(left, 0) * 1000
            return f"deadline: about {needed:.0f} ms needed, {remains:.0f} ms left"
        return None

    async def prepare(
        self, tenant: str, documents: list[Candidate], query: str = "", *, embeddings=False
    ) -> PrepareOutput:
        """Encodes and keeps the token vectors of the documents not kept already, and of
        `query` for the rerank that will follow. `embeddings`: every document is encoded,
        and its embedding from that run returned."""
        if not documents and not query:
            raise InvalidArgument(
                "documents", "is empty and no query was given; send documents, a query or both"
            )
        _check_ids(documents, "documents")
        output = PrepareOutput()
        if query:
            key = QueryCache.key(tenant, query)
            encoding = self.queries.get(key)
            output.query_already_prepared = encoding is not None
            if encoding is None:
                encoding = self._start_query_encoding(key, tenant, query)
            encoded = await self._encoded_query(key, encoding)
            if encoded is not None:
                output.query_prepared = True
                if not output.query_already_prepared:
                    output.input_tokens += encoded.tokens
        if documents:
            _, _, missing = await self._token_vectors(
                tenant, documents, None, output, durable=True, embeddings=embeddings
            )
            output.prepared = missing
            output.already_prepared = len(documents) - missing
        return output

    def _start_query_encoding(self, key, tenant: str, query: str) -> asyncio.Future:
        """The query's encoding as a task of its own, kept: a caller that gives up (cancel,
        deadline) leaves it to finish for the next."""
        encoding = asyncio.ensure_future(
            self._encode_query(tenant, query, deadlines.current_deadline())
        )
        self._encodings.add(encoding)
        encoding.add_done_callback(self._encodings.discard)
        self.queries.put(key, encoding)
        return encoding

    async def _encoded_query(self, key, encoding: asyncio.Future) -> EncodedQuery | None:
        """What a kept encoding gave (None: it failed; the caller then encodes the query
        itself, and the failure is forgotten)."""
        try:
            return await asyncio.shield(encoding)
        except asyncio.CancelledError:
            raise
        except Exception:  # a failed encoding is retried by whoever needs the query
            self.queries.forget(key, encoding)
            return None

    async def _encode_query(self, tenant: str, query: str, deadline: float | None) -> EncodedQuery:
        tokenized = self.token_tokenizer.encode(
            [self.query_prefix + query], refuse_over_limit=False
        )
        batch = await self.token_batcher.submit(tokenized, deadline, tenant, urgent=True)
        return EncodedQuery(
            self._query_rows(batch.rows[0].tokens, tokenized[0]), tokenized[0].length
        )

    async def _token_vectors(
        self, tenant, documents, query, output, *, durable=False, embeddings=False
    ):
        """(query vectors or None, vectors by document id as kept, number of documents
        encoded now). What is encoded goes to the disk store too: before this returns when
        `durable` (Prepare's answer means prepared), else behind the answer. `embeddings`:
        every document is encoded (kept ones too) and `output.embeddings` filled."""
        keys = [TokenCache.key(tenant, d) for d in documents]
        found: dict[str, np.ndarray] = {}
        missing: list[int] = []
        for index, key in enumerate(keys):
            cached = None if embeddings else self.cache.get(key)
            if cached is None:
                missing.append(index)
            else:
                found[documents[index].id] = cached
        if missing and self.store is not None and not embeddings:
            stored = await self._stored(tenant, [keys[i] for i in missing])
            for index in missing:
                entry = stored.get(keys[index])
                if entry is not None:
                    found[documents[index].id] = self.cache.put_entry(keys[index], entry)
            missing = [i for i in missing if keys[i] not in stored]
        texts = ([self.query_prefix + query] if query is not None else []) + [
            self.passage_prefix + documents[i].text for i in missing
        ]
        if not texts:
            return None, found, 0
        tokenized = self.token_tokenizer.encode(texts, refuse_over_limit=False)
        # A rerank's candidates are someone's question; Prepare's documents are bulk work.
        batch = await self.token_batcher.submit(
            tokenized, deadlines.current_deadline(), tenant, urgent=not durable
        )
        output.queue_wait_s = batch.queue_wait_s
        output.input_tokens += sum(t.length for t in tokenized)
        offset = 1 if query is not None else 0
        encoded = {}
        for position, index in enumerate(missing, start=offset):
            rows = self._text_rows(batch.rows[position].tokens, self.passage_prefix)
            entry = encoded[keys[index]] = quantize(rows)
            found[documents[index].id] = self.cache.put_entry(keys[index], entry)
        if embeddings:  # every document was encoded, in order
            output.embeddings = [
                DocumentEmbedding(row.embedding, text.length, text.truncated)
                for row, text in zip(batch.rows[offset:], tokenized[offset:], strict=True)
            ]
        if encoded and self.store is not None:
            if durable:
                await self._persist(encoded)
            else:
                task = asyncio.ensure_future(self._persist(encoded))
                self._persisting.add(task)
                task.add_done_callback(self._persisting.discard)
        if query is None:
            return None, found, len(missing)
        return self._query_rows(batch.rows[0].tokens, tokenized[0]), found, len(missing)

    async def _stored(self, tenant: str, keys) -> dict:
        assert self.store is not None
        try:
            return await self.store.get_many(keys)
        except Exception as error:  # a disk trouble is a miss, never a failed rerank
            log.warning("rerank.token_store_read_failed", tenant=tenant, error=str(error))
            return {}

    async def _persist(self, entries: dict) -> None:
        assert self.store is not None
        try:
            await self.store.put_many(entries)
        except Exception as error:
            log.warning("rerank.token_store_write_failed", entries=len(entries), error=str(error))

    async def forget(self, tenant: str, ids: list[str]) -> int:
        """Drops the token vectors of `tenant`'s documents `ids` (every text of each) from
        memory and disk; disk writes in flight land first, so none brings them back."""
        wanted = set(ids)
        forgotten = self.cache.forget(tenant, wanted)
        if self.store is not None:
            await self.flush()
            forgotten += await self.store.forget(tenant, sorted(wanted))
        return forgotten

    async def flush(self) -> None:
        """Waits for the disk writes behind earlier answers (a clean stop loses none)."""
        if self._persisting:
            await asyncio.gather(*self._persisting, return_exceptions=True)

    def _leading_tokens(self, prefix: str) -> int:
        """How many tokens `prefix` adds before a text (0 for none)."""
        if not prefix:
            return 0
        alone, prefixed = self.token_tokenizer.encode(["x", prefix + "x"], refuse_over_limit=False)
        return max(prefixed.length - alone.length, 0)

    def _prefix_skip(self, rows: np.ndarray, prefix: str) -> int:
        """How many of a run's leading token vectors are the prefix's it was run with (0
        when that would leave none: a text cut to nothing by the model's limit)."""
        skip = self._prefix_rows.get(prefix, 0)
        return skip if len(rows) > skip else 0

    def _text_rows(self, rows: np.ndarray, prefix: str) -> np.ndarray:
        """A run's token vectors without those of the prefix the text was run with."""
        return rows[self._prefix_skip(rows, prefix) :]

    def _query_rows(self, rows: np.ndarray, tokenized) -> np.ndarray:
        """The query's token vectors without its prefix's and without the tokens MaxSim
        should not average over (`skip_query_tokens`: stop words, punctuation), unless that
        would leave none."""
        skip = self._prefix_skip(rows, self.query_prefix)
        rows = rows[skip:]
        if not self.skip_query_tokens:
            return rows
        ids = tokenized.ids[1 + skip : 1 + skip + len(rows)]  # rows leave [CLS], [SEP] out
        keep = np.array([int(i) not in self.skip_query_tokens for i in ids], dtype=bool)
        return rows[keep] if keep.any() else rows

    async def _late_interaction(self, request: RerankInput, output: RerankOutput):
        started = time.perf_counter()
        key = QueryCache.key(request.tenant, request.query)
        encoding = self.queries.get(key)
        prepared = None if encoding is None else await self._encoded_query(key, encoding)
        query, documents, _ = await self._token_vectors(
            request.tenant,
            request.candidates,
            None if prepared is not None else request.query,
            output,
        )
        if prepared is not None:
            query = prepared.rows
        late = maxsim_many(query, [documents[c.id] for c in request.candidates])
        first = np.array([c.first_stage_score for c in request.candidates])
        weight = self.late_interaction_weight
        blended = weight * _minmax(late) + (1 - weight) * _minmax(first)
        order = np.argsort(-blended, kind="stable")[: request.late_interaction_k]
        seconds = time.perf_counter() - started
        self.costs[LATE_INTERACTION].record(seconds, len(request.candidates))
        output.stages_run.append(LATE_INTERACTION)
        output.stage_seconds.append((LATE_INTERACTION, seconds))
        survivors = [request.candidates[int(i)] for i in order]
        return survivors, {request.candidates[int(i)].id: float(blended[int(i)]) for i in order}

    async def _cross_encoder(self, request, chosen, stage1, output) -> list[Scored]:
        started = time.perf_counter()
        tokenizer, batcher = self.pair_tokenizer, self.pair_batcher
        assert tokenizer is not None and batcher is not None, "a cascade with a cross-encoder"
        pairs = tokenizer.encode_pairs([(request.query, c.text) for c in chosen])
        batch = await batcher.submit(pairs, deadlines.current_deadline(), request.tenant)
        output.input_tokens += sum(p.length for p in pairs)
        scores = np.array([float(row) for row in batch.rows])
        seconds = time.perf_counter() - started
        self.costs[CROSS_ENCODER].record(seconds, len(chosen))
        output.stages_run.append(CROSS_ENCODER)
        output.stage_seconds.append((CROSS_ENCODER, seconds))
        # The cross-encoder's view blended with what stage 1 knew: a small cross-encoder
        # alone orders the survivors worse than stage 1 does (docs/tuning.md).
        weight = self.cross_encoder_weight
        before = np.array([stage1[c.id] for c in chosen])
        blended = weight * _minmax(scores) + (1 - weight) * _minmax(before)
        order = np.argsort(-blended, kind="stable")
        return [
            Scored(
                chosen[i].id,
                float(blended[i]),
                {LATE_INTERACTION: stage1[chosen[i].id], CROSS_ENCODER: float(scores[i])},
            )
            for i in (int(j) for j in order)
        ]
