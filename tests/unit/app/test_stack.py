from __future__ import annotations

import pytest

from ragline_app.stack import local_addresses, plan_ports, service_address
from ragline_services.registry import default_port, load_spec, service_names


def test_every_service_has_a_distinct_default_port():
    ports = [default_port(n) for n in service_names()]
    assert len(set(ports)) == len(ports) == 6


def test_port_plans():
    names = service_names()
    assert plan_ports(names, None, "127.0.0.1")["orchestrator"] == 50100
    shifted = plan_ports(names, 60100, "127.0.0.1")
    assert shifted["orchestrator"] == 60100 and shifted["budget"] == 60105
    assert shifted["etcd"] == 60110 and shifted["etcd-peer"] == 60111
    assert shifted["orchestrator-metrics"] == 60200 and shifted["budget-metrics"] == 60205
    free = plan_ports(names, 0, "127.0.0.1")
    assert len(set(free.values())) == 14


def test_unknown_service_is_named():
    with pytest.raises(LookupError, match="unknown service 'nope'"):
        load_spec("nope")


def test_addresses_default_to_the_loopback_layout_unless_configured(monkeypatch, tmp_path):
    for name in service_names():
        monkeypatch.delenv(f"RAGLINE_{name.upper()}_ADDR", raising=False)
    monkeypatch.setenv("RAGLINE_GENERATION_ADDR", "gpu-node:9000")
    addresses = local_addresses()
    assert "RAGLINE_GENERATION_ADDR" not in addresses  # configured: left alone
    assert addresses["RAGLINE_BUDGET_ADDR"] == "127.0.0.1:50105"
    assert service_address("generation", tmp_path) == "gpu-node:9000"
    assert service_address("orchestrator", tmp_path) == "127.0.0.1:50100"
