from __future__ import annotations

import pytest
from pydantic import ValidationError

from ragline.config import CommonConfig, ConfigError, ServiceConfig


class _Config(ServiceConfig):
    model_config = ServiceConfig.env_for("example")


def test_service_config_reads_its_own_prefix(monkeypatch):
    assert _Config().port == 0  # no default port in the kit: the registry owns them
    monkeypatch.setenv("RAGLINE_EXAMPLE_PORT", "6000")
    monkeypatch.setenv("RAGLINE_OTHER_PORT", "7000")
    monkeypatch.setenv("RAGLINE_EXAMPLE_GRACE_S", "1.5")
    config = _Config()
    assert (config.port, config.grace_s) == (6000, 1.5)


def test_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("RAGLINE_EXAMPLE_PORT", "70000")
    with pytest.raises(ValidationError):
        _Config()


def test_addresses_come_from_configuration_keyed_by_name(monkeypatch):
    monkeypatch.setenv("RAGLINE_GENERATION_ADDR", "gpu-node:9000")
    monkeypatch.setenv("RAGLINE_SOME_NEW_THING_ADDR", "10.0.0.7:1234")
    monkeypatch.delenv("RAGLINE_BUDGET_ADDR", raising=False)
    common = CommonConfig()
    assert common.address_of("generation") == "gpu-node:9000"
    assert common.address_of("some_new_thing") == "10.0.0.7:1234"
    with pytest.raises(ConfigError, match="RAGLINE_BUDGET_ADDR"):
        common.address_of("budget")


def test_model_dir_follows_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("RAGLINE_MODEL_DIR", raising=False)
    monkeypatch.setenv("RAGLINE_CACHE_DIR", str(tmp_path))
    assert CommonConfig().model_dir == tmp_path / "models"
    monkeypatch.setenv("RAGLINE_MODEL_DIR", str(tmp_path / "elsewhere"))
    assert CommonConfig().model_dir == tmp_path / "elsewhere"


def test_an_empty_variable_unsets_an_optional_path_and_nothing_else(monkeypatch):
    from ragline_services.registry import load_spec

    monkeypatch.setenv("RAGLINE_MODEL_DIR", "")
    monkeypatch.setenv("RAGLINE_EMBEDDING_MODEL_DIR", "")
    monkeypatch.setenv("RAGLINE_RERANK_CROSS_ENCODER_MODEL", "")
    monkeypatch.setenv("RAGLINE_AUTH_JWT_PUBLIC_KEY_FILE", "")
    from ragline.auth import AuthConfig

    assert load_spec("embedding").config_factory().model_dir is None  # not Path(".")
    assert CommonConfig().model_dir == CommonConfig().cache_dir / "models"
    assert AuthConfig().jwt_public_key_file is None
    assert load_spec("rerank").config_factory().cross_encoder_model == ""  # its meaning kept
