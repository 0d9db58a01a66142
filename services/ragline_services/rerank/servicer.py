"""RerankService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

import grpc

from ragline.identity import current_caller, write_scope_missing
from ragline.server import Deferred
from ragline.timing import current_clock
from ragline.v1 import common_pb2, embedding_pb2, rerank_pb2, rerank_pb2_grpc
from ragline.vocabulary import skip_cause_to_proto
from ragline_services.rerank.cascade import (
    CROSS_ENCODER,
    LATE_INTERACTION,
    Candidate,
    Reranker,
    RerankInput,
)

_STAGES = {
    LATE_INTERACTION: rerank_pb2.RERANK_STAGE_LATE_INTERACTION,
    CROSS_ENCODER: rerank_pb2.RERANK_STAGE_CROSS_ENCODER,
}


class RerankServicer(rerank_pb2_grpc.RerankServiceServicer):
    def __init__(self) -> None:
        self.reranker: Deferred[Reranker] = Deferred("the rerank models")

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        reranker = self.reranker.value
        output = await reranker.rerank(
            RerankInput(
                tenant=current_caller().tenant,
                query=request.query,
                candidates=[
                    Candidate(c.id, c.text, c.first_stage_score) for c in request.candidates
                ],
                top_k=request.top_k or 5,
                late_interaction_k=request.late_interaction_k or 20,
                allow_skip=request.allow_skip,
                late_interaction_only=request.late_interaction_only,
            )
        )
        clock = _finished_clock(output.queue_wait_s, output.stage_seconds)
        return rerank_pb2.RerankResponse(
            results=[
                common_pb2.Hit(id=r.id, score=r.score, rank=rank, scores=r.scores)
                for rank, r in enumerate(output.results, start=1)
            ],
            stages_run=[_STAGES[s] for s in output.stages_run],
            skipped=[
                rerank_pb2.SkippedStage(
                    stage=_STAGES[skip.stage],
                    reason=skip.reason,
                    cause=skip_cause_to_proto(skip.cause),
                )
                for skip in output.skipped
            ],
            usage=common_pb2.Usage(input_tokens=output.input_tokens),
            timing=clock.to_proto(),
        )

    async def Prepare(
        self, request: rerank_pb2.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.PrepareResponse:
        reranker = self.reranker.value
        output = await reranker.prepare(
            current_caller().tenant,
            [Candidate(d.id, d.text) for d in request.documents],
            request.query,
            embeddings=request.return_embeddings,
        )
        return rerank_pb2.PrepareResponse(
            prepared=output.prepared,
            already_prepared=output.already_prepared,
            query_prepared=output.query_prepared,
            query_already_prepared=output.query_already_prepared,
            usage=common_pb2.Usage(input_tokens=output.input_tokens),
            timing=_finished_clock(output.queue_wait_s, []).to_proto(),
            embeddings=[
                embedding_pb2.Embedding(
                    values=e.vector.tolist(), token_count=e.token_count, truncated=e.truncated
                )
                for e in output.embeddings
            ],
            embedding_model_version=reranker.embedding_model_version,
        )

    async def ForgetDocuments(
        self, request: rerank_pb2.ForgetDocumentsRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.ForgetDocumentsResponse:
        caller = current_caller()
        if not caller.may_write:
            raise write_scope_missing("ForgetDocuments")
        forgotten = await self.reranker.value.forget(caller.tenant, list(request.ids))
        return rerank_pb2.ForgetDocumentsResponse(forgotten=forgotten)


def _finished_clock(queue_wait_s: float, stage_seconds):
    clock = current_clock()
    clock.started = clock.received + queue_wait_s
    for name, seconds in stage_seconds:
        clock.add_stage(name, seconds)
    clock.mark_finished()
    return clock
