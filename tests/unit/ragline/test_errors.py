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


def test_codes_match_the_status_proto():
    code, message, status = to_rpc_status(Unimplemented("later"))
    assert status.code == code.value[0] == 12
    assert status.message == message
