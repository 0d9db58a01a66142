"""GenerationService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

from ragline.errors import Unimplemented
from ragline.v1 import generation_pb2_grpc

_MISSING = "an engine (llama.cpp on CPU, TensorRT-LLM through Triton on GPU)"


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    async def Generate(self, request, context):
        raise Unimplemented(f"GenerationService.Generate is not available yet: needs {_MISSING}")
        yield  # a server-streaming handler is an async generator

    async def CountTokens(self, request, context):
        raise Unimplemented(f"GenerationService.CountTokens is not available yet: needs {_MISSING}")
