"""etcd's client endpoints as one gRPC target: IP lists as they are, one DNS name through
gRPC's resolver (etcd3aio's `ipv4:` target takes no names), anything else refused."""

from __future__ import annotations

import pytest

from ragline.config import ConfigError
from ragline_services.budget.store import etcd_target


def test_ip_addresses_make_a_static_list():
    assert etcd_target(["10.0.0.1:2379", "10.0.0.2:2379"]) == "ipv4:10.0.0.1:2379,10.0.0.2:2379"
    assert etcd_target(["[::1]:2379"]) == "ipv6:[::1]:2379"


def test_one_name_goes_to_the_dns_resolver():
    assert etcd_target(["rl-etcd:2379"]) == "dns:///rl-etcd:2379"


@pytest.mark.parametrize(
    "endpoints", [["etcd-0:2379", "etcd-1:2379"], ["10.0.0.1:2379", "etcd-1:2379"]]
)
def test_several_names_or_a_mix_are_refused_with_what_to_give(endpoints):
    with pytest.raises(ConfigError, match="one DNS name that resolves to every member"):
        etcd_target(endpoints)
