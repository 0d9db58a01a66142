"""The retrieval steps: the query's embedding, BM25, vector and one-call searches (their
retrieval-cache entries checked before use), and the fusion of two lists."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ragline.budget import Amounts
from ragline.ranking import score_fusion
from ragline.v1 import (
    embedding_pb2,
    retrieval_pb2,
)
from ragline.vocabulary import Fusion, SearchMode, search_mode_to_proto
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.caches import (
    RETRIEVAL,
    TOOL,
    normalise,
    stale_documents,
)
from ragline_services.orchestrator.params import (
    Bm25Params,
    FuseParams,
    RetrieveParams,
    VectorSearchParams,
)
from ragline_services.orchestrator.plan import Kind
from ragline_services.orchestrator.run_context import (
    QueryVector,
    Ranked,
    RunContext,
    merged,
    query_of,
    rankings,
)
from ragline_services.orchestrator.runner import Step


async def embed(ctx: RunContext, step: Step) -> QueryVector:
    text = query_of(step, ctx.settings)
    key, entry = await ctx.look_up(step, TOOL, "embed", text)
    if entry is not None:
        ctx.served_from_cache(step, TOOL, entry)
        return QueryVector(np.asarray(entry["values"], np.float32), entry["model_version"])
    request = embedding_pb2.EmbedRequest(texts=[text], input_type=embedding_pb2.INPUT_TYPE_QUERY)
    reply = await ctx.model_call(
        step,
        "embedding",
        "Embed",
        request,
        Amounts(input_tokens=ev.tokens_estimate(text) + 2, calls=1),
        lambda r: Amounts(input_tokens=r.usage.input_tokens, calls=1),
    )
    vector = QueryVector(np.asarray(reply.embeddings[0].values, np.float32), reply.model_version)
    if key:
        await ctx.remember(
            step,
            TOOL,
            key,
            {
                "values": vector.values.tolist(),
                "model_version": vector.model_version,
                "input_tokens": reply.usage.input_tokens,
            },
        )
    return vector


def _ranked(reply, source: str) -> Ranked:
    passages = [
        ev.Passage(h.id, h.title, h.text, h.version, h.score, dict(h.scores)) for h in reply.hits
    ]
    return Ranked(passages, source, reply.index_version)


async def _search(
    ctx: RunContext, step: Step, mode: SearchMode, vector: QueryVector | None
) -> Ranked:
    s, params = ctx.settings, step.node.params_as(Bm25Params)
    request = retrieval_pb2.SearchRequest(
        query=query_of(step, s),
        k=params.k or s.candidates,
        mode=search_mode_to_proto(mode),
        attributes=dict(s.attributes),
        hnsw_ef=(params.hnsw_ef or 0) if isinstance(params, VectorSearchParams) else 0,
        include_text=True,
    )
    key, entry = await ctx.look_up(
        step,
        RETRIEVAL,
        normalise(request.query),
        mode,
        request.k,
        sorted(s.attributes),
        request.hnsw_ef,
        vector.model_version if vector else "",
    )
    found = await _cached_search(ctx, step, key, entry, mode) if entry is not None else None
    if found is not None:
        return found
    if vector is not None:
        request.query_vector.extend(vector.values.tolist())
    if isinstance(params, RetrieveParams) and params.charged:
        # An agent's lookup: the retrieval service embeds its query (a model call).
        reply = await ctx.model_call(
            step,
            "retrieval",
            "Search",
            request,
            Amounts(input_tokens=ev.tokens_estimate(request.query) + 2, calls=1),
            lambda r: Amounts(input_tokens=ev.tokens_estimate(request.query) + 2, calls=1),
        )
    else:
        reply = await ctx.call(step, "retrieval", "Search", request)
    if reply.fell_back:
        ctx.degraded.append(reply.fallback_reason)
    ranked = replace(_ranked(reply, mode), query=request.query)
    if key and ranked.passages and not reply.fell_back:
        await ctx.remember(
            step,
            RETRIEVAL,
            key,
            {
                "passages": [
                    [p.id, p.title, p.text, p.version, p.score, p.scores] for p in ranked.passages
                ],
                "index_version": reply.index_version,
                "embedding_model_version": ""
                if mode == SearchMode.BM25
                else reply.embedding_model_version,
            },
        )
    return ranked


async def _cached_search(
    ctx: RunContext, step: Step, key: str, entry: dict, mode: SearchMode
) -> Ranked | None:
    """The retrieval entry found, if still true for this caller: the tenant's index has not
    changed since (no write or delete), the vector model neither, and every hit is still
    visible. Else it is dropped, and counted as a miss."""
    assert ctx.caches is not None
    request = retrieval_pb2.DocumentVersionsRequest(ids=[p[0] for p in entry["passages"]])
    current = await ctx.call(step, "retrieval", "DocumentVersions", request)
    model = entry["embedding_model_version"]
    stale = stale_documents({p[0]: p[3] for p in entry["passages"]}, dict(current.versions))
    if (
        current.index_version != entry["index_version"]
        or (model and model != current.embedding_model_version)
        or stale
    ):
        await ctx.caches.drop(RETRIEVAL, key, "index or documents changed")
        ctx.missed(RETRIEVAL)
        return None
    ctx.served_from_cache(step, RETRIEVAL, entry)
    passages = [
        ev.Passage(i, t, x, v, sc, dict(parts)) for i, t, x, v, sc, parts in entry["passages"]
    ]
    return Ranked(passages, mode, current.index_version)


async def bm25(ctx: RunContext, step: Step) -> Ranked:
    return await _search(ctx, step, SearchMode.BM25, None)


async def vector_search(ctx: RunContext, step: Step) -> Ranked:
    vector = step.upstream(Kind.EMBED)
    return await _search(
        ctx, step, SearchMode.VECTOR, vector if isinstance(vector, QueryVector) else None
    )


async def retrieve(ctx: RunContext, step: Step) -> Ranked:
    given = step.node.params_as(RetrieveParams)
    mode = given.mode or ctx.settings.search_mode
    vector = step.upstream(Kind.EMBED) if given.query is None else None
    return await _search(ctx, step, mode, vector if isinstance(vector, QueryVector) else None)


async def fuse(ctx: RunContext, step: Step) -> Ranked:
    s = ctx.settings
    given = step.node.params_as(FuseParams)
    k = given.k or s.candidates
    lists = rankings(step.inputs)
    by_source = {r.source: r for r in lists}
    if len(lists) == 2 and {SearchMode.BM25, SearchMode.VECTOR} <= set(by_source):
        passages = {p.id: p for r in lists for p in r.passages}
        weight = s.vector_weight if given.vector_weight is None else given.vector_weight
        if (given.fusion or s.fusion) == Fusion.RRF:
            from ragline.ranking import rrf as fusion
        else:
            fusion = score_fusion
        fused = fusion(
            [_Scored(p.id, p.score) for p in by_source[SearchMode.BM25].passages],
            [_Scored(p.id, p.score) for p in by_source[SearchMode.VECTOR].passages],
            weight,
            k,
        )
        out = [
            replace(passages[str(key)], score=score, scores=parts) for key, score, parts in fused
        ]
        return Ranked(out, "fused", max(r.index_version for r in lists))
    return Ranked(
        merged(step.inputs)[:k], "fused", max((r.index_version for r in lists), default=0)
    )


@dataclass(frozen=True)
class _Scored:
    key: str
    score: float
