"""A small Qdrant stand-in speaking Qdrant's own gRPC protocol (the stubs qdrant-client
ships), for testing the retrieval service's Qdrant adapter. No Qdrant server can run on
this machine; this implements only what the adapter calls, with exact cosine search."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import numpy as np
from qdrant_client import grpc as q


def _python(value: q.Value):
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [_python(v) for v in value.list_value.values]
    return getattr(value, kind)


def _matches(pid: int, payload: dict, condition: q.Condition) -> bool:
    if condition.WhichOneof("condition_one_of") == "has_id":
        return pid in {p.num for p in condition.has_id.has_id}
    field = condition.field
    have = payload.get(field.key)
    values = set(have) if isinstance(have, list) else {have}
    match = field.match
    if match.WhichOneof("match_value") == "keyword":
        return match.keyword in values
    if match.WhichOneof("match_value") == "keywords":
        return bool(values & set(match.keywords.strings))
    raise NotImplementedError(match)


class FakeQdrant(q.CollectionsServicer, q.PointsServicer):
    def __init__(self) -> None:
        self.collections: dict[str, dict] = {}
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self.hold_queries_s = 0.0  # a stalled server: Query answers only after this

    def CollectionExists(self, request, context):
        self.calls.append("CollectionExists")
        return q.CollectionExistsResponse(
            result=q.CollectionExists(exists=request.collection_name in self.collections)
        )

    def Create(self, request, context):
        self.calls.append("Create")
        params = request.vectors_config.params
        assert params.distance == q.Distance.Cosine
        assert (request.hnsw_config.m, request.hnsw_config.ef_construct) == (16, 200)
        self.collections[request.collection_name] = {
            "dim": params.size,
            "points": {},
            "indexes": set(),
        }
        return q.CollectionOperationResponse(result=True)

    def Get(self, request, context):
        collection = self.collections[request.collection_name]
        count = len(collection["points"])
        return q.GetCollectionInfoResponse(
            result=q.CollectionInfo(
                status=q.CollectionStatus.Green, points_count=count, indexed_vectors_count=count
            )
        )

    def CreateFieldIndex(self, request, context):
        self.collections[request.collection_name]["indexes"].add(request.field_name)
        return q.PointsOperationResponse(result=q.UpdateResult(status=q.UpdateStatus.Completed))

    def Upsert(self, request, context):
        self.calls.append("Upsert")
        collection = self.collections[request.collection_name]
        with self.lock:
            for point in request.points:
                vector = np.asarray(point.vectors.vector.dense.data, dtype=np.float32)
                if vector.shape[0] != collection["dim"]:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "wrong vector dimension")
                payload = {k: _python(v) for k, v in point.payload.items()}
                collection["points"][point.id.num] = (vector / np.linalg.norm(vector), payload)
        return q.PointsOperationResponse(result=q.UpdateResult(status=q.UpdateStatus.Completed))

    def Delete(self, request, context):
        self.calls.append("Delete")
        collection = self.collections[request.collection_name]
        with self.lock:
            for point_id in request.points.points.ids:
                collection["points"].pop(point_id.num, None)
        return q.PointsOperationResponse(result=q.UpdateResult(status=q.UpdateStatus.Completed))

    def Query(self, request, context):
        self.calls.append("Query")
        if self.hold_queries_s:
            time.sleep(self.hold_queries_s)
        collection = self.collections[request.collection_name]
        query = np.asarray(request.query.nearest.dense.data, dtype=np.float32)
        query /= np.linalg.norm(query)
        scored = []
        with self.lock:
            for point_id, (vector, payload) in collection["points"].items():
                if all(_matches(point_id, payload, c) for c in request.filter.must):
                    scored.append((float(vector @ query), point_id, payload))
        scored.sort(key=lambda item: -item[0])
        return q.QueryResponse(
            result=[
                q.ScoredPoint(
                    id=q.PointId(num=pid),
                    score=score,
                    payload={"key": q.Value(string_value=payload["key"])}
                    if request.with_payload.enable
                    else {},
                )
                for score, pid, payload in scored[: request.limit]
            ]
        )


class _RequireApiKey(grpc.ServerInterceptor):
    """Qdrant with `service.api_key` set: a call without the key in its `api-key` metadata
    is UNAUTHENTICATED (as Qdrant's gRPC server answers)."""

    def __init__(self, key: str) -> None:
        self._key = key

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "Invalid api-key")

        self._refusal = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, details):
        if dict(details.invocation_metadata or ()).get("api-key") == self._key:
            return continuation(details)
        return self._refusal


def start_fake_qdrant(
    port: int, *, api_key: str = "", certificate: tuple[bytes, bytes] | None = None
) -> tuple[grpc.Server, FakeQdrant]:
    """`api_key`: required on every call; `certificate` (PEM key, chain): TLS only."""
    fake = FakeQdrant()
    interceptors = [_RequireApiKey(api_key)] if api_key else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
    q.add_CollectionsServicer_to_server(fake, server)
    q.add_PointsServicer_to_server(fake, server)
    if certificate is None:
        server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials([certificate]))
    server.start()
    return server, fake
