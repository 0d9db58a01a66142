"""Domain errors and their mapping to gRPC status codes.

Domain code raises these; only the server interceptor turns them into a status, with
google.rpc details a caller in any language can read. Only `InvalidArgument` (naming the
field) tells a caller its request was wrong: any other exception, a ValueError from deep
inside a library included, is the server's fault and answers INTERNAL.

Every error carries `google.rpc.ErrorInfo` (domain `ragline.dev`, a stable UPPER_SNAKE
`reason` such as QUEUE_FULL or BUDGET_EXHAUSTED, and metadata): clients branch on the
reason, never on message text. `google.rpc.RetryInfo` comes with every error a retry can
cure (a full queue, a service still starting, an engine that failed), with the delay to
wait; `google.rpc.BadRequest` with INVALID_ARGUMENT, one violation per field.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "ragline.dev"


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def error_info(reason: str, metadata: dict[str, str] | None = None) -> any_pb2.Any:
    return _packed(
        error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {})
    )


def retry_info(delay_s: float) -> any_pb2.Any:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(delay_s * 1e9))
    return _packed(error_details_pb2.RetryInfo(retry_delay=delay))


class RaglineError(Exception):
    """Base of every error that maps to a specific gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"
    # Errors a retry can cure say when (RetryInfo); None: retrying the same call will not help.
    default_retry_after_s: float | None = None

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: dict[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.retry_after_s = (
            retry_after_s if retry_after_s is not None else self.default_retry_after_s
        )

    def details(self) -> list[any_pb2.Any]:
        out = [error_info(self.reason, self.metadata)]
        if self.retry_after_s is not None:
            out.append(retry_info(self.retry_after_s))
        return out


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class InvalidArgument(RaglineError):
    """Bad input; names the offending field path (for example `documents[2].text`)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, description: str, *more: FieldViolation) -> None:
        self.violations = (FieldViolation(field, description), *more)
        message = "; ".join(f"{v.field}: {v.description}" for v in self.violations)
        super().__init__(message, metadata={"field": field})
        self.field = field

    def details(self) -> list[any_pb2.Any]:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, description=v.description
                )
                for v in self.violations
            ]
        )
        return [_packed(bad_request), *super().details()]


class ResourceExhausted(RaglineError):
    """Out of capacity or quota; `retry_after_s` tells the caller when to try again (none
    when waiting cannot help, like an exhausted budget)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(RaglineError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class NotFound(RaglineError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class AlreadyExists(RaglineError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(RaglineError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class Aborted(RaglineError):
    """A conflict that a retry of the same call resolves."""

    code = grpc.StatusCode.ABORTED
    default_reason = "CONFLICT"
    default_retry_after_s = 0.05


class Unauthenticated(RaglineError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(RaglineError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class Unavailable(RaglineError):
    """An engine or a dependency failed; a retry after a short wait can succeed."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "ENGINE_UNAVAILABLE"
    default_retry_after_s = 1.0


class Unimplemented(RaglineError):
    code = grpc.StatusCode.UNIMPLEMENTED
    default_reason = "UNIMPLEMENTED"


class Cancelled(RaglineError):
    code = grpc.StatusCode.CANCELLED
    default_reason = "CANCELLED"


class StartRefused(RuntimeError):
    """The service will not start: its state needs an operator (the message says what to
    do). Not a gRPC error: nothing is serving yet."""


def to_rpc_status(error: BaseException) -> tuple[grpc.StatusCode, str, status_pb2.Status]:
    """Maps an exception to (code, message, google.rpc.Status with details)."""
    if isinstance(error, RaglineError):
        code, message, details = error.code, error.message, error.details()
    elif isinstance(error, grpc.aio.AioRpcError):
        # A downstream call failed: keep its code and its details (its ErrorInfo reason,
        # RetryInfo) so the caller sees DEADLINE_EXCEEDED, QUEUE_FULL, ... for what it is.
        code, message = error.code(), f"downstream call failed: {error.details()}"
        details = _downstream_details(error) or [error_info(code.name)]
    elif isinstance(error, NotImplementedError):
        # A generated servicer's default for a method this server's code does not have
        # (an older build behind newer stubs): the caller may fall back, as on UNIMPLEMENTED.
        code, message = grpc.StatusCode.UNIMPLEMENTED, "this server does not implement the method"
        details = [error_info("UNIMPLEMENTED")]
    elif isinstance(error, TimeoutError):
        code, message = grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "timed out"
        details = [error_info("DEADLINE_EXCEEDED")]
    else:
        code, message, details = (
            grpc.StatusCode.INTERNAL,
            f"internal error ({type(error).__name__}); see the server log",
            [error_info("INTERNAL")],
        )
    # grpc.StatusCode values are (number, name) pairs; the number is the google.rpc code.
    status = status_pb2.Status(code=code.value[0], message=message, details=details)
    return code, message, status


def _downstream_details(error: grpc.aio.AioRpcError) -> list[any_pb2.Any]:
    from grpc_status import rpc_status

    try:
        status = rpc_status.from_call(error)
    except ValueError:  # trailers that contradict the status: keep none
        return []
    return list(status.details) if status is not None else []
