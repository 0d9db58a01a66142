"""A gRPC status (a downstream call's, or the gateway's own domain error) as an HTTP error.

The body is OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`, so the
OpenAI SDK and LangChain raise their usual exception classes), with the gRPC status name,
the ErrorInfo reason and metadata, and every field violation added: an HTTP caller branches
on `error.code` (the reason, QUEUE_FULL, BUDGET_EXHAUSTED, ...) as a gRPC caller branches on
ErrorInfo. A RetryInfo delay becomes `Retry-After` (whole seconds, rounded up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2, status_pb2

from ragline.errors import to_rpc_status

# As grpc-gateway and Google's API design guide map them; 499 is the de-facto "client
# closed request".
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}

# OpenAI's `error.type` for the statuses its clients tell apart.
_OPENAI_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    504: "timeout_error",
}


@dataclass
class HttpError:
    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)


def from_status(code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> HttpError:
    """The HTTP error of a gRPC status and its google.rpc details."""
    http = HTTP_STATUS.get(code, 500)
    error: dict = {
        "message": message,
        "type": _OPENAI_TYPE.get(http, "api_error"),
        "param": None,
        "code": code.name,
        "status": code.name,
    }
    headers: dict[str, str] = {}
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        retry = error_details_pb2.RetryInfo()
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(info):
            error["code"] = info.reason
            error["reason"] = info.reason
            if info.metadata:
                error["metadata"] = dict(info.metadata)
        elif detail.Unpack(retry):
            delay_s = retry.retry_delay.ToNanoseconds() / 1e9
            error["retry_after_s"] = round(delay_s, 3)
            headers["Retry-After"] = str(max(1, math.ceil(delay_s)))
        elif detail.Unpack(bad):
            violations = [
                {"field": v.field, "description": v.description} for v in bad.field_violations
            ]
            error["field_violations"] = violations
            if violations:
                error["param"] = violations[0]["field"]
    return HttpError(http, {"error": error}, headers)


def from_exception(error: BaseException) -> HttpError:
    """A downstream AioRpcError (its code and details kept), a domain error of the gateway,
    or anything else (INTERNAL, the type named, the rest in the log)."""
    if isinstance(error, grpc.aio.AioRpcError):
        code, message = error.code(), error.details() or code_message(error.code())
        _, _, status = to_rpc_status(error)
        return from_status(code, message, status)
    code, message, status = to_rpc_status(error)
    return from_status(code, message, status)


def code_message(code: grpc.StatusCode) -> str:
    return code.name.lower().replace("_", " ")
