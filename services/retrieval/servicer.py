"""RetrievalService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

from ragline.errors import Unimplemented
from ragline.v1 import retrieval_pb2_grpc

_MISSING = "the Tantivy BM25 index, the Qdrant vector backends and the durable write log"


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServiceServicer):
    async def Upsert(self, request, context):
        raise Unimplemented(f"RetrievalService.Upsert is not available yet: needs {_MISSING}")

    async def Delete(self, request, context):
        raise Unimplemented(f"RetrievalService.Delete is not available yet: needs {_MISSING}")

    async def Search(self, request, context):
        raise Unimplemented(f"RetrievalService.Search is not available yet: needs {_MISSING}")

    async def IndexStatus(self, request, context):
        raise Unimplemented(f"RetrievalService.IndexStatus is not available yet: needs {_MISSING}")
