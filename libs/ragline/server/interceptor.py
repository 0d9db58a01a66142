"""The one server interceptor: per-call scope for every ragline RPC.

For each call it: starts the request clock, binds run id / tenant / stage to the logs,
turns the incoming deadline into the context-variable deadline, validates the request
against the contract's rules, runs the handler under the deadline, and maps any error to a
status code with google.rpc details. Health and reflection calls pass through untouched.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message
from grpc_status import rpc_status

from ragline import auth, deadlines, identity, timing, tracing
from ragline.auth import AuthConfig, Authenticated, Authenticator
from ragline.errors import DeadlineExceeded, PermissionDenied, RaglineError, to_rpc_status
from ragline.metrics import SERVER_STREAM, UNARY, GrpcServerMetrics
from ragline.validation import check_size, validate

log = structlog.get_logger("ragline.rpc")

# Codes that are the server's failure, not the caller's (OpenTelemetry's rule for a gRPC
# server span's error status).
_SERVER_FAULTS = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)

# The handler keeps a little time past the caller's deadline to send a final message
# (generation reports finish reason `deadline`) before the backstop cancels it.
_BACKSTOP_GRACE_S = 0.25

# A handler's call context (requests and replies are whatever messages the method has).
Context = grpc.aio.ServicerContext[Any, Any]
# The behaviour of a method handler: grpc's stubs type it as a sync function; under grpc.aio
# it is a coroutine function (unary), or an async generator function or a coroutine function
# writing with context.write() (server streaming).
Behavior = Callable[[Any, Any], Any]


Metadata = tuple[tuple[str, str], ...]


class RaglineServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        *,
        default_deadline_s: float,
        max_request_bytes: int,
        access_log: bool = True,
        authenticator: Authenticator | None = None,
        metrics: GrpcServerMetrics | None = None,
        client_tokens: bool = True,
    ) -> None:
        """`client_tokens`: whether an end user's token may call this service (with
        authentication on; otherwise only other services' credentials)."""
        self._authenticator = authenticator or Authenticator(AuthConfig(mode="off"))
        self._client_tokens = client_tokens
        self._metrics = metrics
        self._default_deadline_s = default_deadline_s
        self._max_request_bytes = max_request_bytes
        self._access_log = access_log

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        received = time.monotonic()
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith("/grpc."):
            return handler
        # Text entries only: ragline reads no binary (`-bin`) metadata.
        metadata = tuple(
            (k, v) for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)
        )
        admitted = self._admitted(metadata)
        # A call refused on its metadata alone is refused before a byte of its body is
        # read: the same wrappers behind a handler that streams its request, a stream
        # nobody reads (the identity check in them fails first), so an unauthenticated
        # body is neither received whole nor parsed.
        refused = isinstance(admitted, RaglineError)
        if handler.unary_unary is not None:
            make = (
                grpc.stream_unary_rpc_method_handler
                if refused
                else grpc.unary_unary_rpc_method_handler
            )
            wrapped = self._wrap_unary(handler.unary_unary, method, received, metadata, admitted)
        elif handler.unary_stream is not None:
            make = (
                grpc.stream_stream_rpc_method_handler
                if refused
                else grpc.unary_stream_rpc_method_handler
            )
            wrapped = self._wrap_stream(handler.unary_stream, method, received, metadata, admitted)
        else:
            return handler
        return make(
            wrapped,
            request_deserializer=None if refused else handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _admitted(self, metadata: Metadata) -> Authenticated | RaglineError:
        """Who calls, from the call's metadata; or why the call is refused (it does not
        authenticate, its identity metadata is malformed, or an end user's token reaches a
        service that takes none)."""
        try:
            authenticated = self._authenticator.authenticate(metadata)
        except RaglineError as error:
            return error
        if authenticated.via == "token" and not self._client_tokens:
            return PermissionDenied(
                "this service answers other ragline services only (its "
                "RAGLINE_<SERVICE>_CLIENT_TOKENS is false): call the orchestrator",
                reason="CLIENT_TOKEN_NOT_ACCEPTED",
            )
        return authenticated

    def _wrap_unary(
        self,
        behavior: Behavior,
        method: str,
        received: float,
        metadata: Metadata,
        admitted: Authenticated | RaglineError,
    ) -> Behavior:
        async def unary(request: Any, context: Context) -> Any:
            scope = _CallScope(self, method, received, context, UNARY, metadata, admitted)
            try:
                scope.enter(request)
                async with asyncio.timeout_at(scope.backstop):
                    return await behavior(request, context)
            except BaseException as error:
                await scope.fail(error)
            finally:
                scope.exit()

        return unary

    def _wrap_stream(
        self,
        behavior: Behavior,
        method: str,
        received: float,
        metadata: Metadata,
        admitted: Authenticated | RaglineError,
    ) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            scope = _CallScope(self, method, received, context, SERVER_STREAM, metadata, admitted)
            result = None
            try:
                scope.enter(request)
                result = behavior(request, context)
                if inspect.isasyncgen(result):
                    # The backstop guards each step, never a `yield`: a cancel scope left
                    # open across a yield would fire inside gRPC's own writes.
                    while True:
                        try:
                            async with asyncio.timeout_at(scope.backstop):
                                item = await anext(result)
                        except StopAsyncIteration:
                            break
                        yield item
                else:  # a handler that writes with context.write()
                    async with asyncio.timeout_at(scope.backstop):
                        await result
            except GeneratorExit:
                raise  # gRPC closed the stream (the caller went away): nothing to answer
            except BaseException as error:
                await scope.fail(error)
            finally:
                if inspect.isasyncgen(result):
                    await result.aclose()
                scope.exit()

        return stream


class _CallScope:
    """Context variables, logging and error mapping around one call."""

    def __init__(
        self,
        owner: RaglineServerInterceptor,
        method: str,
        received: float,
        context: Context,
        grpc_type: str,
        metadata: Metadata,
        admitted: Authenticated | RaglineError,
    ) -> None:
        """`metadata`: the call's text metadata; `admitted`: the caller as it
        authenticated before the body was read, or why the call is refused."""
        self.owner = owner
        self.metadata = metadata
        self.admitted = admitted
        self.method = method
        self.context = context
        self._metrics = owner._metrics
        self._counted = (
            None if self._metrics is None else self._metrics.call_started(method, grpc_type)
        )
        self.clock = timing.RequestClock(received=received)
        self.run_id = ""
        self.backstop: float | None = None
        self._tokens: list[tuple[str, Any]] = []  # (which context variable, its reset token)
        self._outcome = "OK"
        self._span: tracing.ServerSpan | None = None
        self._finished: float | None = None

    def enter(self, request: Any) -> None:
        self.clock.handler_started = time.monotonic()
        metadata = self.metadata
        if tracing.enabled():
            # The call's span, child of the caller's (traceparent); its id goes back in
            # the trailers so that a caller can find the trace.
            self._span = tracing.ServerSpan(self.method, metadata, self.clock.received)
            self.context.set_trailing_metadata(((tracing.TRACE_ID_KEY, self._span.trace_id),))
        self.run_id = identity.run_id_from_metadata(metadata)
        exact_timeout = next((v for k, v in metadata if k == deadlines.TIMEOUT_METADATA_KEY), None)
        deadline = deadlines.deadline_from_grpc(
            self.context.time_remaining(), self.owner._default_deadline_s, exact_timeout
        )
        self.backstop = None if deadline is None else deadline + _BACKSTOP_GRACE_S
        self._tokens.append(("clock", timing.bind_clock(self.clock)))
        self._tokens.append(("deadline", deadlines.set_deadline(deadline)))
        # Bind the run id before parsing identity so a bad-metadata error is still logged
        # with it.
        self._tokens.append(("identity", identity.bind(None, self.run_id)))
        structlog.contextvars.bind_contextvars(run_id=self.run_id, stage=self.method)
        if isinstance(self.admitted, RaglineError):
            raise self.admitted
        caller = self.admitted.caller
        if caller is not None:
            identity.unbind(self._tokens.pop()[1])
            self._tokens.append(("identity", identity.bind(caller, self.run_id)))
            structlog.contextvars.bind_contextvars(tenant=caller.tenant)
        self._tokens.append(("via", auth.bind_via(self.admitted.via, self.admitted.service)))
        if isinstance(request, Message):
            check_size(request, self.owner._max_request_bytes)
            validate(request)
        deadlines.check(self.method)

    def _code(self) -> str:
        """The status code name the caller got (a handler's own abort: the code it set)."""
        if self._outcome != "ABORTED_BY_HANDLER":
            return self._outcome
        code = self.context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"

    async def fail(self, error: BaseException) -> None:
        if isinstance(error, grpc.aio.AbortError):
            self._outcome = "ABORTED_BY_HANDLER"
            raise error
        if isinstance(error, asyncio.CancelledError):
            # The caller went away (or its deadline passed): nothing to answer.
            self._outcome = "CANCELLED"
            raise error
        if isinstance(error, TimeoutError) and self.backstop is not None:
            error = DeadlineExceeded(f"{self.method} did not finish before the deadline")
        code, message, status = to_rpc_status(error)
        self._outcome = code.name
        if code == grpc.StatusCode.INTERNAL:
            log.exception("rpc.internal_error", method=self.method)
        grpc_status = rpc_status.to_status(status)
        trailing = (*grpc_status.trailing_metadata, (identity.RUN_ID_KEY, self.run_id))
        if self._span is not None:
            trailing = (*trailing, (tracing.TRACE_ID_KEY, self._span.trace_id))
        # gRPC's abort sends the status at once: counted first, so that a caller who got
        # its error and reads the metrics finds its call there.
        self._finish()
        await self.context.abort(code, message, trailing_metadata=trailing)

    def _finish(self) -> float:
        """Marks the call finished and counts it in the metrics, once."""
        if self._finished is None:
            self._finished = self.clock.mark_finished()
            if self._metrics is not None and self._counted is not None:
                seconds = self._finished - self.clock.received
                self._metrics.call_finished(self._counted, self._code(), seconds)
        return self._finished

    def exit(self) -> None:
        finished = self._finish()
        code = self._code()
        if self.owner._access_log:
            log.info(
                "rpc",
                method=self.method,
                code=self._outcome,
                duration_ms=round((finished - self.clock.received) * 1000, 3),
                queue_wait_ms=round(self.clock.queue_wait_s * 1000, 3),
            )
        try:
            for kind, token in reversed(self._tokens):
                if kind == "clock":
                    timing.unbind_clock(token)
                elif kind == "deadline":
                    deadlines.reset_deadline(token)
                elif kind == "via":
                    auth.unbind_via(token)
                else:
                    identity.unbind(token)
        except ValueError:
            # A stream closed from another context: its variables die with that context.
            pass
        structlog.contextvars.unbind_contextvars("run_id", "stage", "tenant")
        if self._span is not None:
            number = grpc.StatusCode[code].value[0] if code in grpc.StatusCode.__members__ else 2
            self._span.end(code, number, finished, code in _SERVER_FAULTS)
