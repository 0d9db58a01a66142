from __future__ import annotations

import pytest

from ragline import identity
from ragline.errors import InvalidArgument, Unauthenticated


def test_caller_from_metadata():
    caller = identity.caller_from_metadata(
        [
            ("x-ragline-tenant", "acme"),
            ("x-ragline-principal", "ana"),
            ("x-ragline-scopes", "eng, hr,,"),
        ]
    )
    assert caller == identity.Caller("acme", "ana", frozenset({"eng", "hr"}))
    assert identity.caller_from_metadata([("other", "x")]) is None


@pytest.mark.parametrize(
    "key,value",
    [
        ("x-ragline-tenant", "acme corp"),
        ("x-ragline-tenant", "t" * 65),
        ("x-ragline-scopes", "ok,bad scope"),
    ],
)
def test_malformed_identity_is_invalid_argument(key, value):
    metadata = [("x-ragline-tenant", "acme"), (key, value)]
    with pytest.raises(InvalidArgument) as caught:
        identity.caller_from_metadata(metadata)
    assert key in caught.value.field


def test_current_caller_requires_a_tenant():
    with pytest.raises(Unauthenticated, match="x-ragline-tenant"):
        identity.current_caller()


def test_outbound_metadata_propagates_caller_and_run_id():
    tokens = identity.bind(identity.Caller("acme", "ana", frozenset({"b", "a"})), "run-1")
    try:
        assert identity.outbound_metadata() == [
            ("x-ragline-tenant", "acme"),
            ("x-ragline-principal", "ana"),
            ("x-ragline-scopes", "a,b"),
            ("x-ragline-run-id", "run-1"),
        ]
    finally:
        identity.unbind(tokens)
    assert identity.outbound_metadata() == []


def test_run_id_is_taken_or_generated():
    assert identity.run_id_from_metadata([("x-ragline-run-id", "abc")]) == "abc"
    generated = identity.run_id_from_metadata([("x-ragline-run-id", "bad id with spaces")])
    assert len(generated) == 16 and generated != identity.run_id_from_metadata(None)
