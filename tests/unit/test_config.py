from __future__ import annotations

import pytest
from pydantic import ValidationError

from ragline.config import CommonConfig
from ragline.stack import plan_ports
from ragline_services.registry import load_spec, service_names


def test_service_config_reads_its_own_prefix(monkeypatch):
    config_cls = load_spec("embedding").config_factory
    assert config_cls().port == 50101
    monkeypatch.setenv("RAGLINE_EMBEDDING_PORT", "6000")
    monkeypatch.setenv("RAGLINE_RETRIEVAL_PORT", "7000")
    monkeypatch.setenv("RAGLINE_EMBEDDING_GRACE_S", "1.5")
    config = config_cls()
    assert (config.port, config.grace_s) == (6000, 1.5)


def test_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("RAGLINE_BUDGET_PORT", "70000")
    with pytest.raises(ValidationError):
        load_spec("budget").config_factory()


def test_common_config_addresses(monkeypatch):
    monkeypatch.setenv("RAGLINE_GENERATION_ADDR", "gpu-node:9000")
    common = CommonConfig()
    assert common.address_of("generation") == "gpu-node:9000"
    assert common.address_of("budget") == "127.0.0.1:50105"


def test_every_service_has_a_distinct_default_port():
    ports = [load_spec(n).config_factory().port for n in service_names()]
    assert len(set(ports)) == len(ports) == 6


def test_port_plans():
    names = service_names()
    assert plan_ports(names, None, "127.0.0.1")["orchestrator"] == 50100
    shifted = plan_ports(names, 60100, "127.0.0.1")
    assert shifted["orchestrator"] == 60100 and shifted["budget"] == 60105
    assert shifted["etcd"] == 60110 and shifted["etcd-peer"] == 60111
    free = plan_ports(names, 0, "127.0.0.1")
    assert len(set(free.values())) == 8


def test_unknown_service_is_named():
    with pytest.raises(ValueError, match="unknown service 'nope'"):
        load_spec("nope")
