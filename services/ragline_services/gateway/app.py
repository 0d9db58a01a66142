"""The gateway's routes: HTTP in, one gRPC call to a ragline service out, HTTP back.

FastAPI on uvicorn: the body models are pydantic (the project's settings already are), their
validation and the OpenAPI file come from the same classes, and Starlette cancels a
streaming response's work when its client goes away, which is what cancels the gRPC call.

Identity: the caller's `Authorization: Bearer` goes on to the service, which verifies it as
it verifies a gRPC caller's; with authentication off, `X-Ragline-Tenant` / `-Principal` /
`-Scopes` (else the configured default tenant) name the caller, as the gRPC metadata
does. The gateway never adds the service credential: it vouches for nobody.

Deadlines: `X-Ragline-Timeout` (seconds; else the configured default, capped) is the gRPC
deadline. A closed connection cancels the call (a whole response: a watcher of the
request's disconnect; a stream: Starlette's cancellation of its generator).
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format
from google.protobuf.message import Message

import ragline
from ragline import deadlines, identity
from ragline.auth import AuthConfig
from ragline.clients import ChannelPool, ServiceClient
from ragline.config import CommonConfig
from ragline.errors import FieldViolation, InvalidArgument, RaglineError, Unauthenticated
from ragline.v1 import (
    embedding_pb2,
    embedding_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)
from ragline_services.gateway import chat, errors
from ragline_services.gateway.config import GatewayConfig
from ragline_services.gateway.models import (
    ChatCompletionRequest,
    EmbeddingsRequest,
)
from ragline_services.gateway.proto_schema import reference

log = structlog.get_logger("ragline.gateway")
T = TypeVar("T")

TIMEOUT_HEADER = "x-ragline-timeout"


@dataclass(frozen=True)
class CallIdentity:
    token: str | None
    caller: identity.Caller | None


def identity_of(request: Request, config: GatewayConfig, auth_on: bool) -> CallIdentity:
    """Who calls, as the service behind will read it."""
    bearer = request.headers.get("authorization", "")
    scheme, _, token = bearer.strip().partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    if bearer and not token:
        raise Unauthenticated("header Authorization must be `Bearer <token>`")
    tenant = request.headers.get(identity.TENANT_KEY, "").strip()
    principal = request.headers.get(identity.PRINCIPAL_KEY, "").strip()
    scopes = frozenset(
        s.strip() for s in request.headers.get(identity.SCOPES_KEY, "").split(",") if s.strip()
    )
    if auth_on:
        if not token:
            raise Unauthenticated(
                "authentication is on: send `Authorization: Bearer <token>` (a JWT with "
                "tenant, sub and scopes claims)"
            )
        # Headers may only narrow what the token says; the service checks that.
        caller = identity.Caller(tenant, principal, scopes) if tenant else None
        return CallIdentity(token, caller)
    tenant = tenant or config.default_tenant
    if not identity.is_tenant(tenant):
        raise InvalidArgument(f"header {identity.TENANT_KEY}", f"must be {identity.TENANT_RULE}")
    if principal and not identity.is_name(principal):
        raise InvalidArgument(f"header {identity.PRINCIPAL_KEY}", f"must be {identity.NAME_RULE}")
    return CallIdentity(token or None, identity.Caller(tenant, principal, scopes))


def timeout_of(request: Request, config: GatewayConfig) -> float:
    raw = request.headers.get(TIMEOUT_HEADER, "").strip()
    if not raw:
        return config.default_timeout_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise InvalidArgument(f"header {TIMEOUT_HEADER}", "must be a number of seconds above 0")
    return min(value, config.max_timeout_s)


async def until_disconnect(request: Request, work: Awaitable[T], timeout_s: float) -> T:
    """`work`'s result under a deadline of `timeout_s` (its gRPC calls' deadline), or its
    cancellation when the client closes the connection first (the gRPC call behind is
    cancelled with it)."""
    with deadlines.deadline_scope(timeout_s):
        task = asyncio.ensure_future(work)  # the task's context holds the deadline
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    return task.result()  # CancelledError when the client went away


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Backends:
    """Clients of the services behind, one per call (the channels are shared)."""

    def __init__(self, common: CommonConfig) -> None:
        self.pool = ChannelPool()
        self.targets = {
            "orchestrator": common.address_of("orchestrator"),
            "embedding": common.address_of("embedding"),
            "retrieval": common.address_of("retrieval"),
        }
        self.hop_margin_s = common.hop_margin_s

    def client(self, name: str, stub: Callable, who: CallIdentity) -> ServiceClient:
        return ServiceClient(
            stub,
            self.targets[name],
            pool=self.pool,
            hop_margin_s=self.hop_margin_s,
            caller=who.caller,
            token=who.token,
            service_credential=False,
        )


# The JSON routes: the gRPC contracts one to one (request message in, reply message out).
@dataclass(frozen=True)
class ProtoRoute:
    path: str
    service: str
    stub: Callable
    method: str
    request_type: type[Message]
    reply_type: type[Message]
    summary: str


PROTO_ROUTES = (
    ProtoRoute(
        "/v1/ask",
        "orchestrator",
        orchestrator_pb2_grpc.OrchestratorServiceStub,
        "Ask",
        orchestrator_pb2.AskRequest,
        orchestrator_pb2.AskResult,
        "OrchestratorService.Ask, its final result only (the stream's deltas dropped)",
    ),
    ProtoRoute(
        "/v1/documents",
        "retrieval",
        retrieval_pb2_grpc.RetrievalServiceStub,
        "Upsert",
        retrieval_pb2.UpsertRequest,
        retrieval_pb2.UpsertResponse,
        "RetrievalService.Upsert: write documents (the service embeds those sent without a vector)",
    ),
    ProtoRoute(
        "/v1/documents:delete",
        "retrieval",
        retrieval_pb2_grpc.RetrievalServiceStub,
        "Delete",
        retrieval_pb2.DeleteRequest,
        retrieval_pb2.DeleteResponse,
        "RetrievalService.Delete",
    ),
    ProtoRoute(
        "/v1/search",
        "retrieval",
        retrieval_pb2_grpc.RetrievalServiceStub,
        "Search",
        retrieval_pb2.SearchRequest,
        retrieval_pb2.SearchResponse,
        "RetrievalService.Search",
    ),
    ProtoRoute(
        "/v1/index:status",
        "retrieval",
        retrieval_pb2_grpc.RetrievalServiceStub,
        "IndexStatus",
        retrieval_pb2.IndexStatusRequest,
        retrieval_pb2.IndexStatusResponse,
        "RetrievalService.IndexStatus",
    ),
)


def message_json(message: Message) -> dict:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def parse_message(body: Any, message_type: type[Message]) -> Message:
    if not isinstance(body, dict):
        raise InvalidArgument("body", f"must be a JSON object ({message_type.DESCRIPTOR.name})")
    try:
        return json_format.ParseDict(body, message_type())
    except json_format.ParseError as error:
        raise InvalidArgument("body", str(error)) from None


def error_response(error: BaseException) -> JSONResponse:
    http = errors.from_exception(error)
    return JSONResponse(http.body, status_code=http.status, headers=http.headers)


def build_app(config: GatewayConfig, common: CommonConfig, backends: Backends) -> FastAPI:
    auth_on = AuthConfig().mode != "off"
    app = FastAPI(
        title="ragline gateway",
        version=ragline.__version__,
        summary="The OpenAI-compatible API of ragline, and its gRPC contracts as JSON",
        docs_url=None,
        redoc_url=None,
    )
    app.state.ready = False
    _add_error_handlers(app)
    _add_probes(app)
    _add_openai_routes(app, config, backends, auth_on)
    for route in PROTO_ROUTES:
        _add_proto_route(app, route, config, backends, auth_on)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Errors as the OpenAI API writes them, with the gRPC status a service would give."""

    @app.exception_handler(RaglineError)
    async def _domain_error(request: Request, error: RaglineError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def _rpc_error(request: Request, error: grpc.aio.AioRpcError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(chat.UnknownModel)
    async def _unknown_model(request: Request, error: chat.UnknownModel) -> JSONResponse:
        body = {
            "error": {
                "message": str(error),
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
        return JSONResponse(body, status_code=404)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        # The body's violations as an INVALID_ARGUMENT of the services, field by field.
        violations = [
            FieldViolation(
                ".".join(str(p) for p in problem["loc"] if p != "body") or "body",
                problem["msg"],
            )
            for problem in error.errors()
        ] or [FieldViolation("body", "invalid request")]
        first, *more = violations
        return error_response(InvalidArgument(first.field, first.description, *more))


def _add_probes(app: FastAPI) -> None:
    @app.get("/healthz", summary="Liveness: the process answers")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: the orchestrator behind answers its health check")
    async def readyz() -> JSONResponse:
        ready = app.state.ready
        return JSONResponse(
            {"status": "ready" if ready else "not ready"}, status_code=200 if ready else 503
        )


def _add_openai_routes(
    app: FastAPI, config: GatewayConfig, backends: Backends, auth_on: bool
) -> None:
    @app.get("/v1/models", summary="The model names of /v1/chat/completions")
    async def models() -> dict:
        return chat.model_list(int(app.state.started))

    @app.post("/v1/chat/completions", summary="OpenAI chat completions, answered from documents")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        ask = chat.ask_request(body)
        who = identity_of(request, config, auth_on)
        timeout_s = timeout_of(request, config)
        client = backends.client("orchestrator", orchestrator_pb2_grpc.OrchestratorServiceStub, who)
        sources = body.ragline.sources_in_content
        if not body.stream:
            result = await until_disconnect(request, _final_result(client, ask), timeout_s)
            return chat.completion(result, body.model, int(time.time()), sources)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        writer = chat.ChunkWriter(body.model, uuid.uuid4().hex, include_usage)
        messages = client.stream("Ask", ask).__aiter__()
        # The first message before any byte is sent: a refusal at admission
        # (RESOURCE_EXHAUSTED) is still an HTTP status with Retry-After.
        first = await until_disconnect(request, messages.__anext__(), timeout_s)
        return StreamingResponse(
            _chat_events(writer, first, messages, sources),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/embeddings", summary="OpenAI embeddings (the embedding service's Embed)")
    async def embeddings(body: EmbeddingsRequest, request: Request) -> dict:
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        embed = embedding_pb2.EmbedRequest(
            texts=texts,
            dim=body.dimensions or 0,
            model="" if body.model in ("", "ragline") else body.model,
            input_type=embedding_pb2.INPUT_TYPE_PASSAGE
            if body.ragline.input_type == "passage"
            else embedding_pb2.INPUT_TYPE_QUERY,
        )
        who = identity_of(request, config, auth_on)
        client = backends.client("embedding", embedding_pb2_grpc.EmbeddingServiceStub, who)
        reply = await until_disconnect(
            request, client.unary("Embed", embed), timeout_of(request, config)
        )
        tokens = sum(e.token_count for e in reply.embeddings)
        # base64: the vector's float32 bytes, little-endian (the OpenAI SDK asks for it).
        encode = list if body.encoding_format == "float" else _base64_floats
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": encode(e.values)}
                for i, e in enumerate(reply.embeddings)
            ],
            "model": reply.model_version or body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _base64_floats(values) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


async def _final_result(client: ServiceClient, ask: orchestrator_pb2.AskRequest):
    result = None
    async for message in client.stream("Ask", ask):
        if message.WhichOneof("event") == "result":
            result = message.result
    if result is None:
        raise RaglineError("the orchestrator's stream ended without a result")
    return result


async def _chat_events(
    writer: chat.ChunkWriter,
    first: orchestrator_pb2.AskResponse,
    messages: AsyncIterator[orchestrator_pb2.AskResponse],
    sources_in_content: bool,
) -> AsyncIterator[str]:
    yield writer.opening()
    message: orchestrator_pb2.AskResponse | None = first
    try:
        while message is not None:
            event = message.WhichOneof("event")
            if event == "delta":
                yield writer.draft(message.delta)
            elif event == "result":
                for line in writer.closing(message.result, sources_in_content):
                    yield line
                yield chat.DONE
                return
            message = await anext(messages, None)
        yield chat.sse(errors.from_exception(RaglineError("the answer stream ended early")).body)
    except grpc.aio.AioRpcError as error:
        # The status line went out with the first chunk: the error is an event (the OpenAI
        # SDK raises it as APIError).
        yield chat.sse(errors.from_exception(error).body)
    yield chat.DONE


def _add_proto_route(
    app: FastAPI, route: ProtoRoute, config: GatewayConfig, backends: Backends, auth_on: bool
) -> None:
    async def handle(request: Request) -> JSONResponse:
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            raise InvalidArgument("body", "is not JSON") from None
        message = parse_message(body, route.request_type)
        who = identity_of(request, config, auth_on)
        client = backends.client(route.service, route.stub, who)
        work = (
            _final_result(client, message)
            if isinstance(message, orchestrator_pb2.AskRequest)
            else client.unary(route.method, message)
        )
        reply = await until_disconnect(request, work, timeout_of(request, config))
        return JSONResponse(message_json(reply))

    handle.__name__ = route.method.lower()
    app.add_api_route(
        route.path,
        handle,
        methods=["POST"],
        summary=route.summary,
        openapi_extra={
            "x-grpc-method": f"{route.stub.__name__.removesuffix('Stub')}.{route.method}",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _ref(route.request_type)}}},
            },
            "responses": {
                "200": {
                    "description": route.reply_type.DESCRIPTOR.name,
                    "content": {"application/json": {"schema": {"$ref": _ref(route.reply_type)}}},
                }
            },
        },
    )


def _ref(message_type: type[Message]) -> str:
    return f"#/components/schemas/{message_type.DESCRIPTOR.full_name}"


def openapi_document(app: FastAPI) -> dict:
    """The OpenAPI file of the served routes (docs/openapi.json is this, written by
    `ragline openapi`): FastAPI's for the pydantic bodies, the protobuf descriptors' for
    the JSON routes."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    definitions: dict[str, dict] = {}
    for route in PROTO_ROUTES:
        reference(route.request_type.DESCRIPTOR, definitions)
        reference(route.reply_type.DESCRIPTOR, definitions)
    schemas.update(dict(sorted(definitions.items())))
    app.openapi_schema = document
    return document
