"""RerankService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

from ragline.errors import Unimplemented
from ragline.v1 import rerank_pb2_grpc


class RerankServicer(rerank_pb2_grpc.RerankServiceServicer):
    async def Rerank(self, request, context):
        raise Unimplemented(
            "RerankService.Rerank is not available yet: the late-interaction and "
            "cross-encoder stages are still to be built"
        )
