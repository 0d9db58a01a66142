"""Domain errors and their mapping to gRPC status codes.

Domain code raises these; only the server interceptor turns them into a status, with
google.rpc details a caller in any language can read. Only `InvalidArgument` (naming the
field) tells a caller its request was wrong: any other exception, a ValueError from deep
inside a library included, is the server's fault and answers INTERNAL.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2


class RaglineError(Exception):
    """Base of every error that maps to a specific gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def details(self) -> list[any_pb2.Any]:
        return []


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class InvalidArgument(RaglineError):
    """Bad input; names the offending field path (for example `documents[2].text`)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, description: str, *more: FieldViolation) -> None:
        self.violations = (FieldViolation(field, description), *more)
        message = "; ".join(f"{v.field}: {v.description}" for v in self.violations)
        super().__init__(message)
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
        packed = any_pb2.Any()
        packed.Pack(bad_request)
        return [packed]


class ResourceExhausted(RaglineError):
    """Out of capacity or quota; `retry_after_s` tells the caller when to try again."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def details(self) -> list[any_pb2.Any]:
        if self.retry_after_s is None:
            return []
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(self.retry_after_s * 1e9))
        packed = any_pb2.Any()
        packed.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return [packed]


class DeadlineExceeded(RaglineError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(RaglineError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RaglineError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(RaglineError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(RaglineError):
    code = grpc.StatusCode.ABORTED


class Unauthenticated(RaglineError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RaglineError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(RaglineError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(RaglineError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Cancelled(RaglineError):
    code = grpc.StatusCode.CANCELLED


class StartRefused(RuntimeError):
    """The service will not start: its state needs an operator (the message says what to
    do). Not a gRPC error: nothing is serving yet."""


def to_rpc_status(error: BaseException) -> tuple[grpc.StatusCode, str, status_pb2.Status]:
    """Maps an exception to (code, message, google.rpc.Status with details)."""
    if isinstance(error, RaglineError):
        code, message, details = error.code, error.message, error.details()
    elif isinstance(error, grpc.aio.AioRpcError):
        # A downstream call failed: keep its code so the caller sees DEADLINE_EXCEEDED,
        # UNAVAILABLE, ... for what it is.
        code, message, details = error.code(), f"downstream call failed: {error.details()}", []
    elif isinstance(error, TimeoutError):
        code, message, details = grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "timed out", []
    else:
        code, message, details = (
            grpc.StatusCode.INTERNAL,
            f"internal error ({type(error).__name__}); see the server log",
            [],
        )
    # grpc.StatusCode values are (number, name) pairs; the number is the google.rpc code.
    status = status_pb2.Status(code=code.value[0], message=message, details=details)
    return code, message, status
