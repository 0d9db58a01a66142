"""Where a client connects: a configured address as a gRPC target (one host, a DNS name of
several replicas, or a list of IP addresses), refused at start when it cannot be one; and
the server options that make clients find replicas added later."""

from __future__ import annotations

import pytest

from ragline.config import CommonConfig, ConfigError, ServiceConfig, channel_target
from ragline.server.bootstrap import connection_age_options


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("127.0.0.1:50101", "127.0.0.1:50101"),
        ("embedding:50101", "embedding:50101"),
        ("dns:///rl-embedding-pods.ns.svc:50101", "dns:///rl-embedding-pods.ns.svc:50101"),
        ("10.0.0.1:50101, 10.0.0.2:50101", "ipv4:10.0.0.1:50101,10.0.0.2:50101"),
        ("[::1]:50101,[::2]:50101", "ipv6:[::1]:50101,[::2]:50101"),
    ],
)
def test_an_address_becomes_its_grpc_target(address, target):
    assert channel_target(address) == target


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("embedding-0:50101,embedding-1:50101", "IP addresses only"),
        ("10.0.0.1:50101,10.0.0.2", "is not ip:port"),
        ("10.0.0.1:50101,[::1]:50101", "mixes IPv4 and IPv6"),
    ],
)
def test_a_list_gRPC_cannot_resolve_is_refused_naming_the_variable(address, why, monkeypatch):
    monkeypatch.setenv("RAGLINE_EMBEDDING_ADDR", address)
    with pytest.raises(ConfigError, match="RAGLINE_EMBEDDING_ADDR") as error:
        CommonConfig().address_of("embedding")
    assert why in str(error.value)


def test_connections_are_closed_at_their_age_with_the_default_deadline_to_finish():
    options = dict(connection_age_options(ServiceConfig(max_connection_age_s=2.5)))
    assert options == {
        "grpc.max_connection_age_ms": 2500,
        "grpc.max_connection_age_grace_ms": 120_000,
    }
    assert connection_age_options(ServiceConfig(max_connection_age_s=0)) == []
