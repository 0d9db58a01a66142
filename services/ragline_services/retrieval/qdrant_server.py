"""Vector index on a Qdrant server (cluster deployments), over gRPC.

A thin adapter on the gRPC stubs that `qdrant-client` ships (`qdrant_client.grpc`): one
collection, cosine distance, HNSW m=16 / ef_construct=200, keyword payload indexes on the
filter fields. Qdrant indexes in the background and searches unindexed segments exactly,
so this backend has no delta and no builder of its own. The last write-log sequence it
applied is kept beside the index so a restart replays only what Qdrant has not seen.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np

from ragline import deadlines
from ragline.clients import RECONNECT_OPTIONS
from ragline.errors import DeadlineExceeded, Unavailable
from ragline.files import atomic_write_text
from ragline_services.retrieval.documents import (
    Candidate,
    StoredDocument,
    Visibility,
    point_id,
)
from ragline_services.retrieval.vectors import HNSW_EF_CONSTRUCT, HNSW_M, VectorIndexStatus

_FILTER_FIELDS = ("tenant", "scope", "attr", "key")


class _ApiKey(grpc.UnaryUnaryClientInterceptor):
    """Qdrant's API key on every call (its `api-key` metadata)."""

    def __init__(self, key: str) -> None:
        self._metadata = (("api-key", key),)

    def intercept_unary_unary(self, continuation, details, request):
        metadata = (*(details.metadata or ()), *self._metadata)
        return continuation(_with_metadata(details, metadata), request)


def _with_metadata(details, metadata):
    return _CallDetails(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def _value(item):
    from qdrant_client import grpc as q

    if isinstance(item, str):
        return q.Value(string_value=item)
    if isinstance(item, list):
        return q.Value(list_value=q.ListValue(values=[_value(i) for i in item]))
    raise TypeError(f"unsupported payload value {item!r}")


class QdrantServerIndex:
    def __init__(
        self,
        url: str,
        collection: str,
        dim: int,
        state_path: Path,
        *,
        timeout_s: float = 10.0,
        api_key: str = "",
        ca_file: Path | None = None,
    ) -> None:
        """`api_key`: sent as Qdrant's `api-key` metadata on every call; `ca_file`: TLS,
        the CA of Qdrant's certificate (unset: plaintext)."""
        from qdrant_client import grpc as q

        self._q = q
        self.url = url
        self.collection = collection
        self.dim = dim
        self._timeout = timeout_s
        if ca_file is None:
            channel = grpc.insecure_channel(url, options=RECONNECT_OPTIONS)
        else:
            credentials = grpc.ssl_channel_credentials(Path(ca_file).read_bytes())
            channel = grpc.secure_channel(url, credentials, options=RECONNECT_OPTIONS)
        if api_key:
            channel = grpc.intercept_channel(channel, _ApiKey(api_key))
        self._channel = channel
        self._points = q.PointsStub(self._channel)
        self._collections = q.CollectionsStub(self._channel)
        self._state_path = state_path
        self.built_seq = json.loads(state_path.read_text())["seq"] if state_path.exists() else 0
        self.building = False
        try:
            self._ensure_collection()
        except grpc.RpcError as error:
            raise Unavailable(f"Qdrant at {self.url}: {error.details()}") from error

    def _call(self, fn, request):
        """One Qdrant call that ends at the caller's deadline (at most the configured
        timeout), so a blocked call never holds its worker thread past it."""
        what = f"Qdrant at {self.url}"
        timeout = deadlines.outbound_timeout(what, stage_budget_s=self._timeout)
        try:
            return fn(request, timeout=timeout)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise deadlines.timed_out(
                    what, timeout, self._timeout, error.details() or ""
                ) from error
            raise Unavailable(f"{what}: {error.details()}") from error

    def _ensure_collection(self) -> None:
        q = self._q
        exists = self._collections.CollectionExists(
            q.CollectionExistsRequest(collection_name=self.collection), timeout=self._timeout
        )
        if exists.result.exists:
            return
        self._collections.Create(
            q.CreateCollection(
                collection_name=self.collection,
                vectors_config=q.VectorsConfig(
                    params=q.VectorParams(size=self.dim, distance=q.Distance.Cosine)
                ),
                hnsw_config=q.HnswConfigDiff(m=HNSW_M, ef_construct=HNSW_EF_CONSTRUCT),
            ),
            timeout=self._timeout,
        )
        for field in _FILTER_FIELDS:
            self._points.CreateFieldIndex(
                q.CreateFieldIndexCollection(
                    collection_name=self.collection,
                    wait=True,
                    field_name=field,
                    field_type=q.FieldType.FieldTypeKeyword,
                ),
                timeout=self._timeout,
            )

    def apply(self, seq: int, upserts: list[StoredDocument], deletes: list[str]) -> None:
        if seq <= self.built_seq:
            return
        q = self._q
        if deletes:
            self._call(
                self._points.Delete,
                q.DeletePoints(
                    collection_name=self.collection,
                    wait=True,
                    points=q.PointsSelector(
                        points=q.PointsIdsList(ids=[q.PointId(num=point_id(k)) for k in deletes])
                    ),
                ),
            )
        if upserts:
            points = [
                q.PointStruct(
                    id=q.PointId(num=point_id(doc.key)),
                    vectors=q.Vectors(
                        vector=q.Vector(dense=q.DenseVector(data=doc.vector.tolist()))
                    ),
                    payload={
                        "key": _value(doc.key),
                        "tenant": _value(doc.tenant),
                        "scope": _value(list(doc.scopes)),
                        "attr": _value(doc.attribute_terms),
                    },
                )
                for doc in upserts
            ]
            self._call(
                self._points.Upsert,
                q.UpsertPoints(collection_name=self.collection, wait=True, points=points),
            )
        self.built_seq = seq
        atomic_write_text(self._state_path, json.dumps({"seq": seq}))

    def search(
        self,
        vector: np.ndarray,
        visibility: Visibility,
        k: int,
        hnsw_ef: int,
        only_pids: list[int] | None = None,
    ) -> list[Candidate]:
        q = self._q

        def keyword(field, value):
            return q.Condition(field=q.FieldCondition(key=field, match=q.Match(keyword=value)))

        def any_of(field, values):
            return q.Condition(
                field=q.FieldCondition(
                    key=field, match=q.Match(keywords=q.RepeatedStrings(strings=list(values)))
                )
            )

        must = [keyword("tenant", visibility.tenant), any_of("scope", visibility.allowed_scopes)]
        must += [keyword("attr", term) for term in visibility.attribute_terms]
        if only_pids is not None:
            must.append(
                q.Condition(has_id=q.HasIdCondition(has_id=[q.PointId(num=p) for p in only_pids]))
            )
        reply = self._call(
            self._points.Query,
            q.QueryPoints(
                collection_name=self.collection,
                query=q.Query(
                    nearest=q.VectorInput(dense=q.DenseVector(data=[float(x) for x in vector]))
                ),
                filter=q.Filter(must=must),
                limit=k,
                with_payload=q.WithPayloadSelector(enable=False),
                params=q.SearchParams(hnsw_ef=hnsw_ef, exact=only_pids is not None),
            ),
        )
        return [Candidate(p.id.num, p.score) for p in reply.result]

    def ready(self) -> bool:
        """The collection exists (ensured at start); Qdrant indexes in the background."""
        return True

    def needs_build(self) -> bool:
        return False

    def request_build(self) -> None:
        """Nothing to build: Qdrant applies deletes itself (its optimizer vacuums them)."""

    def build(self, upto_seq: int) -> None:
        """Nothing to do: the Qdrant server builds its HNSW segments itself."""

    def status(self) -> VectorIndexStatus:
        q = self._q
        try:
            info = self._call(
                self._collections.Get, q.GetCollectionInfoRequest(collection_name=self.collection)
            ).result
        except (Unavailable, DeadlineExceeded):
            return VectorIndexStatus(0, 0, ready=False, building=False, built_seq=self.built_seq)
        return VectorIndexStatus(
            points=info.points_count,
            indexed_points=info.indexed_vectors_count,
            ready=True,
            building=info.status == q.CollectionStatus.Yellow,
            built_seq=self.built_seq,
        )

    def close(self) -> None:
        self._channel.close()
