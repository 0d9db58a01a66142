"""EmbeddingService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

from ragline.errors import Unimplemented
from ragline.v1 import embedding_pb2_grpc


class EmbeddingServicer(embedding_pb2_grpc.EmbeddingServiceServicer):
    async def Embed(self, request, context):
        raise Unimplemented(
            "EmbeddingService.Embed is not available yet: the ONNX Runtime and Triton "
            "backends and the micro-batcher are still to be built"
        )
