"""OrchestratorService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

from ragline.errors import Unimplemented
from ragline.v1 import orchestrator_pb2_grpc


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    async def Ask(self, request, context):
        raise Unimplemented(
            "OrchestratorService.Ask is not available yet: the plan runner needs the "
            "embedding, retrieval, rerank, generation and budget services first"
        )
        yield  # a server-streaming handler is an async generator
