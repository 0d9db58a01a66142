"""gRPC server reflection v1 (`grpc.reflection.v1.ServerReflection`) beside v1alpha.

Current grpcurl, Postman and Kreya ask v1 first; grpcio-reflection serves only v1alpha. The
two protocols are the same messages under another package name, so v1 is served by the
v1alpha servicer itself: its file descriptor is renamed into `grpc.reflection.v1` at import
(no copy of the .proto in this repository), and each message crosses between the two by
its wire bytes, which the shared field numbers make identical.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha import _async as alpha_aio
from grpc_reflection.v1alpha import reflection_pb2 as alpha

PACKAGE = "grpc.reflection.v1"
SERVICE_NAME = f"{PACKAGE}.ServerReflection"
_ALPHA_PACKAGE = alpha.DESCRIPTOR.package  # grpc.reflection.v1alpha


_FILE = "grpc/reflection/v1/reflection.proto"


def _v1_pool() -> Any:  # a DescriptorPool (protobuf's pool functions are untyped)
    """The process's default pool, holding the v1 file (so that reflection describes its
    own v1 service too)."""
    pool: Any = descriptor_pool.Default()  # type: ignore[no-untyped-call]
    try:
        pool.FindFileByName(_FILE)
        return pool
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    alpha.DESCRIPTOR.CopyToProto(proto)
    proto.name = _FILE
    proto.package = PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(_ALPHA_PACKAGE, PACKAGE)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(_ALPHA_PACKAGE, PACKAGE)
            method.output_type = method.output_type.replace(_ALPHA_PACKAGE, PACKAGE)
    pool.Add(proto)
    return pool


_POOL: Any = _v1_pool()
ServerReflectionRequest = GetMessageClass(
    _POOL.FindMessageTypeByName(f"{PACKAGE}.ServerReflectionRequest")
)
ServerReflectionResponse = GetMessageClass(
    _POOL.FindMessageTypeByName(f"{PACKAGE}.ServerReflectionResponse")
)


def enable(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serves reflection v1 of `service_names` (which should name SERVICE_NAME too)."""
    servicer = alpha_aio.ReflectionServicer(list(service_names))

    async def info(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async def as_alpha() -> AsyncIterator[alpha.ServerReflectionRequest]:
            async for request in requests:
                yield alpha.ServerReflectionRequest.FromString(request.SerializeToString())

        async for response in servicer.ServerReflectionInfo(as_alpha(), context):
            yield ServerReflectionResponse.FromString(response.SerializeToString())

    handler = grpc.stream_stream_rpc_method_handler(
        info,
        request_deserializer=ServerReflectionRequest.FromString,
        response_serializer=ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
