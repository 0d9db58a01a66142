"""RetrievalService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
from google.protobuf import timestamp_pb2

from ragline.identity import current_caller
from ragline.server import Deferred
from ragline.timing import current_clock
from ragline.v1 import common_pb2, retrieval_pb2, retrieval_pb2_grpc
from ragline.vocabulary import fusion_from_proto, search_mode_from_proto, search_mode_to_proto
from ragline_services.retrieval.documents import Visibility
from ragline_services.retrieval.index import RetrievalIndex
from ragline_services.retrieval.index_types import DocumentInput, SearchQuery
from ragline_services.retrieval.metrics import RetrievalMetrics
from ragline_services.retrieval.permissions import Writer


def _finish_timing(stages: Sequence[tuple[str, float]] = ()) -> common_pb2.ServerTiming:
    clock = current_clock()
    for name, seconds in stages:
        clock.add_stage(name, seconds)
    clock.mark_finished()
    return clock.to_proto()


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServiceServicer):
    def __init__(self, embedding_version=lambda: "") -> None:
        self.index: Deferred[RetrievalIndex] = Deferred("the retrieval index (replaying its log)")
        self._embedding_version = embedding_version
        self.metrics: RetrievalMetrics | None = None  # when the process serves metrics

    async def Upsert(
        self, request: retrieval_pb2.UpsertRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.UpsertResponse:
        index = self.index.value
        documents = [
            DocumentInput(
                id=d.id,
                title=d.title,
                text=d.text,
                acl=tuple(d.acl),
                attributes=dict(d.attributes),
                vector=tuple(d.vector),
                vector_model=d.vector_model_version,
            )
            for d in request.documents
        ]
        caller = current_caller()
        result = await index.upsert(caller.tenant, documents, writer=Writer.of(caller))
        if self.metrics is not None:
            self.metrics.wrote("upsert", len(documents))
        # The tenant's own write numbers: the global ones would show it everyone's writes.
        return retrieval_pb2.UpsertResponse(
            upserted=len(documents),
            log_sequence=result.tenant_seq,
            index_version=result.tenant_seq,
            versions=result.versions,
            timing=_finish_timing(),
        )

    async def Delete(
        self, request: retrieval_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.DeleteResponse:
        index = self.index.value
        caller = current_caller()
        result = await index.delete(caller.tenant, list(request.ids), writer=Writer.of(caller))
        if self.metrics is not None:
            self.metrics.wrote("delete", result.deleted)
        return retrieval_pb2.DeleteResponse(
            deleted=result.deleted,
            not_found=result.not_found,
            log_sequence=result.tenant_seq,
            index_version=result.tenant_seq,
            timing=_finish_timing(),
        )

    async def Search(
        self, request: retrieval_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.SearchResponse:
        index = self.index.value
        caller = current_caller()
        visibility = Visibility(
            caller.tenant, caller.visibility, tuple(sorted(request.attributes.items()))
        )
        started = time.perf_counter()
        result = await index.search(
            visibility,
            SearchQuery(
                text=request.query,
                k=request.k,
                mode=search_mode_from_proto(request.mode),
                vector=tuple(request.query_vector),
                hnsw_ef=request.hnsw_ef,
                candidates=request.candidates,
                fusion=fusion_from_proto(request.fusion),
                vector_weight=request.vector_weight,
                include_text=request.include_text,
            ),
        )
        if self.metrics is not None:
            self.metrics.searched(result, time.perf_counter() - started)
        return retrieval_pb2.SearchResponse(
            hits=[
                common_pb2.Hit(
                    id=h.id,
                    score=h.score,
                    rank=rank,
                    title=h.title,
                    text=h.text,
                    version=h.version,
                    scores=h.scores,
                )
                for rank, h in enumerate(result.hits, start=1)
            ],
            mode_used=search_mode_to_proto(result.mode_used),
            fell_back=result.fell_back,
            fallback_reason=result.fallback_reason,
            index_version=result.index_version,
            embedding_model_version=self._embedding_version(),
            timing=_finish_timing(result.stages),
        )

    async def DocumentVersions(
        self, request: retrieval_pb2.DocumentVersionsRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.DocumentVersionsResponse:
        caller = current_caller()
        versions, index_version = await self.index.value.document_versions(
            Visibility(caller.tenant, caller.visibility), list(request.ids)
        )
        return retrieval_pb2.DocumentVersionsResponse(
            versions=versions,
            index_version=index_version,
            embedding_model_version=self._embedding_version(),
            timing=_finish_timing(),
        )

    async def IndexStatus(
        self, request: retrieval_pb2.IndexStatusRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.IndexStatusResponse:
        caller = current_caller()
        status = await self.index.value.status(caller.tenant, operator=caller.operator)
        reply = retrieval_pb2.IndexStatusResponse(
            index_version=status.index_version,
            tenant_documents=status.tenant_documents,
            total_documents=status.total_documents,
            log_sequence=status.log_sequence,
            applied_sequence=status.applied_sequence,
            delta_documents=status.delta_documents,
            vector_index_ready=status.vector_index_ready,
            apply_error=status.apply_error,
            rebuilding=status.rebuilding,
            embedding_model_version=self._embedding_version(),
            dim=status.dim,
            reembedding_to=status.reembedding_to,
            reembed_remaining=status.reembed_remaining,
        )
        if status.last_build_finished is not None:
            finished = timestamp_pb2.Timestamp()
            finished.FromNanoseconds(int(status.last_build_finished * 1e9))
            reply.last_build_finished.CopyFrom(finished)
        return reply
