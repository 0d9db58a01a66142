from __future__ import annotations

import grpc
from google.rpc import error_details_pb2

from ragline.errors import InvalidArgument, ResourceExhausted, Unimplemented, to_rpc_status


def unpack(status, message_type):
    for detail in status.details:
        if detail.Is(message_type.DESCRIPTOR):
            out = message_type()
            detail.Unpack(out)
            return out
    return None


def test_invalid_argument_carries_bad_request_details():
    code, message, status = to_rpc_status(InvalidArgument("texts[1]", "must not be empty"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message == "texts[1]: must not be empty"
    bad_request = unpack(status, error_details_pb2.BadRequest)
    assert bad_request.field_violations[0].field == "texts[1]"


def test_resource_exhausted_carries_retry_info():
    code, _, status = to_rpc_status(ResourceExhausted("queue full", retry_after_s=0.25))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = unpack(status, error_details_pb2.RetryInfo)
    assert retry.retry_delay.ToMilliseconds() == 250


def test_only_invalid_argument_blames_the_caller_and_unknown_errors_do_not_leak():
    # A ValueError from inside the server (a malformed engine reply) is not the caller's
    # bad input.
    for error in (ValueError("malformed JSON from the engine"), KeyError("secret internals")):
        code, message, _ = to_rpc_status(error)
        assert code == grpc.StatusCode.INTERNAL
        assert "secret" not in message and "malformed" not in message


def test_a_method_the_server_does_not_implement_is_unimplemented():
    # What a generated servicer's default raises for a method newer than the server's code.
    code, message, _ = to_rpc_status(NotImplementedError("Method not implemented!"))
    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert "does not implement" in message


def test_codes_match_the_status_proto():
    code, message, status = to_rpc_status(Unimplemented("later"))
    assert status.code == code.value[0] == 12
    assert status.message == message


def test_every_error_carries_a_stable_reason_in_the_ragline_domain():
    from ragline import errors

    base = errors.RaglineError
    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, base) and c is not base
    ]
    assert len(classes) >= 12
    for cls in classes:
        error = cls("field", "why") if cls is InvalidArgument else cls("something happened")
        _, _, status = to_rpc_status(error)
        info = unpack(status, error_details_pb2.ErrorInfo)
        assert info is not None, cls
        assert info.domain == "ragline.dev" and info.reason == info.reason.upper(), cls
    _, _, status = to_rpc_status(ValueError("boom"))
    assert unpack(status, error_details_pb2.ErrorInfo).reason == "INTERNAL"


def test_a_specific_reason_and_its_metadata_travel():
    error = ResourceExhausted(
        "budget spent", reason="BUDGET_EXHAUSTED", metadata={"task_id": "t1", "over": 3}
    )
    _, _, status = to_rpc_status(error)
    info = unpack(status, error_details_pb2.ErrorInfo)
    assert info.reason == "BUDGET_EXHAUSTED" and dict(info.metadata) == {
        "task_id": "t1",
        "over": "3",
    }
    assert unpack(status, error_details_pb2.RetryInfo) is None  # waiting will not help


def test_errors_a_retry_can_cure_say_when():
    from ragline.errors import Aborted, DeadlineExceeded, Unavailable

    for error in (Unavailable("engine down"), Aborted("conflict")):
        _, _, status = to_rpc_status(error)
        assert unpack(status, error_details_pb2.RetryInfo) is not None, error
    _, _, status = to_rpc_status(DeadlineExceeded("late"))
    assert unpack(status, error_details_pb2.RetryInfo) is None


def test_a_downstream_failure_keeps_its_code_and_details():
    from grpc_status import rpc_status

    _, _, downstream = to_rpc_status(
        ResourceExhausted("full", retry_after_s=0.5, reason="QUEUE_FULL", metadata={"queue": "q"})
    )
    trailing = grpc.aio.Metadata(*rpc_status.to_status(downstream).trailing_metadata)
    failed = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailing, details="full"
    )
    code, _, status = to_rpc_status(failed)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert unpack(status, error_details_pb2.ErrorInfo).reason == "QUEUE_FULL"
    assert unpack(status, error_details_pb2.RetryInfo).retry_delay.ToMilliseconds() == 500
