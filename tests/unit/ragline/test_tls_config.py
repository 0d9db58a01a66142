"""RAGLINE_TLS_*: what each role needs, named in the refusal."""

from __future__ import annotations

import pytest

from ragline.config import ConfigError
from ragline.tls import TlsConfig
from ragline_app.certificates import local_authority


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return local_authority(tmp_path_factory.mktemp("pki"))


def test_off_needs_nothing():
    TlsConfig(mode="off").check(server=True)


def test_a_server_needs_its_certificate_and_key(pki):
    with pytest.raises(ConfigError, match="RAGLINE_TLS_CERT_FILE"):
        TlsConfig(mode="tls").check(server=True)
    with pytest.raises(ConfigError, match="RAGLINE_TLS_KEY_FILE"):
        TlsConfig(mode="tls", cert_file=pki.service_cert).check(server=True)
    TlsConfig(mode="tls", cert_file=pki.service_cert, key_file=pki.service_key).check(server=True)


def test_a_tls_client_needs_no_certificate_but_an_mtls_one_does(pki):
    TlsConfig(mode="tls", ca_file=pki.ca).check(server=False)
    with pytest.raises(ConfigError, match="a client under mtls"):
        TlsConfig(mode="mtls", ca_file=pki.ca).check(server=False)


def test_mtls_needs_the_ca_that_admits_peers(pki):
    config = TlsConfig(mode="mtls", cert_file=pki.service_cert, key_file=pki.service_key)
    with pytest.raises(ConfigError, match="RAGLINE_TLS_CA_FILE"):
        config.check(server=True)


def test_a_key_that_is_not_the_certificates_is_refused(pki):
    config = TlsConfig(mode="tls", cert_file=pki.service_cert, key_file=pki.client_key)
    with pytest.raises(ConfigError, match="is not the key of RAGLINE_TLS_CERT_FILE"):
        config.check(server=True)


def test_unreadable_and_malformed_files_name_their_variable(pki, tmp_path):
    missing = TlsConfig(mode="tls", ca_file=tmp_path / "absent.crt")
    with pytest.raises(ConfigError, match=r"RAGLINE_TLS_CA_FILE=.*absent\.crt"):
        missing.check(server=False)
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate")
    config = TlsConfig(mode="tls", cert_file=garbage, key_file=pki.service_key)
    with pytest.raises(ConfigError, match="not a PEM certificate"):
        config.check(server=True)


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("RAGLINE_TLS_MODE", "yes")
    with pytest.raises(ValueError, match="mode"):
        TlsConfig()


def test_the_server_name_override_applies_under_tls_only():
    assert TlsConfig(mode="off", server_name="svc").channel_options() == []
    assert TlsConfig(mode="tls", server_name="svc").channel_options() == [
        ("grpc.ssl_target_name_override", "svc")
    ]
