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


def test_up_serves_metrics_on_the_planned_ports_unless_told_not_to(monkeypatch, tmp_path):
    from ragline_app.stack import Stack

    names = service_names()
    for name in names:
        monkeypatch.delenv(f"RAGLINE_{name.upper()}_METRICS_PORT", raising=False)
    ports = plan_ports(names, 60100, "127.0.0.1")
    served = Stack(names, ports, tmp_path).environment()
    assert served["RAGLINE_RERANK_METRICS_PORT"] == "60203"
    quiet = Stack(names, ports, tmp_path, metrics=False)
    assert "RAGLINE_RERANK_METRICS_PORT" not in quiet.environment()
    assert all(s.metrics_url is None for s in quiet.services)
    monkeypatch.setenv("RAGLINE_RERANK_METRICS_PORT", "9999")  # the environment's choice wins
    chosen = Stack(names, ports, tmp_path)
    assert chosen.environment()["RAGLINE_RERANK_METRICS_PORT"] == "9999"
    assert next(s for s in chosen.services if s.name == "rerank").metrics_url.endswith(
        ":9999/metrics"
    )
