"""A scheduling hint in a generation request is believed from the orchestrator only (or
with authentication off): another service's credential or an end user's token could
otherwise pause every other tenant."""

from __future__ import annotations

import pytest

from ragline import auth
from ragline.v1 import generation_pb2
from ragline_services.generation.servicer import generation_request


@pytest.mark.parametrize(
    ("via", "service", "light"),
    [
        ("service", "orchestrator", True),
        ("service", "retrieval", False),
        ("service", "", False),
        ("metadata", "", True),
        ("none", "", True),
        ("token", "", False),
    ],
)
def test_light_tenant_only_from_the_orchestrator_or_with_authentication_off(via, service, light):
    request = generation_pb2.GenerateRequest(prompt="Hi", max_tokens=1, light_tenant=True)
    token = auth.bind_via(via, service)
    try:
        assert generation_request(request, "acme").light_tenant is light
    finally:
        auth.unbind_via(token)
