"""EmbeddingService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

import grpc

from ragline.embedder import PASSAGE, QUERY, Embedder
from ragline.identity import optional_caller
from ragline.server import Deferred
from ragline.timing import current_clock
from ragline.v1 import common_pb2, embedding_pb2, embedding_pb2_grpc

_INPUT_TYPES = {
    embedding_pb2.INPUT_TYPE_UNSPECIFIED: PASSAGE,
    embedding_pb2.INPUT_TYPE_PASSAGE: PASSAGE,
    embedding_pb2.INPUT_TYPE_QUERY: QUERY,
}


class EmbeddingServicer(embedding_pb2_grpc.EmbeddingServiceServicer):
    def __init__(self) -> None:
        self.embedder: Deferred[Embedder] = Deferred("the embedding model")

    async def Embed(
        self, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        embedder = self.embedder.value
        # A caller without identity (a tool) queues as tenant "" and is no operator.
        caller = optional_caller()
        result = await embedder.embed(
            list(request.texts),
            dim=request.dim,
            refuse_over_limit=request.truncation == embedding_pb2.TRUNCATION_NONE,
            input_type=_INPUT_TYPES[request.input_type],
            tenant=caller.tenant if caller is not None else "",
            bulk=request.priority == embedding_pb2.PRIORITY_BULK,
        )
        clock = current_clock()
        clock.add_stage("tokenize", result.tokenize_s)
        clock.started = result.batch_started  # queue_wait: receipt -> its batch starts
        clock.add_stage("inference", result.compute_s)
        clock.mark_finished()
        operator = caller is not None and caller.operator
        return embedding_pb2.EmbedResponse(
            embeddings=[
                embedding_pb2.Embedding(
                    values=vector.tolist(), token_count=count, truncated=truncated
                )
                for vector, count, truncated in zip(
                    result.vectors, result.token_counts, result.truncated, strict=True
                )
            ],
            model=embedder.model,
            model_version=embedder.model_version,
            dim=result.dim,
            usage=common_pb2.Usage(input_tokens=sum(result.token_counts)),
            timing=clock.to_proto(),
            # How many texts ran together shows others' traffic: operators only.
            batch_size=result.batch_texts if operator else len(request.texts),
        )
