"""The local CA of `ragline up --tls`: kept while good, made again when it would not do."""

from __future__ import annotations

import datetime
import json
import os

from cryptography import x509

from ragline_app import certificates as certificates_module
from ragline_app.certificates import local_authority
from ragline_app.stack import use_stack_tls


def names(path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in san.get_values_for_type(x509.IPAddress)} | set(
        san.get_values_for_type(x509.DNSName)
    )


def test_the_service_certificate_names_loopback_and_the_host(tmp_path):
    made = local_authority(tmp_path, ["10.1.2.3", "node.example"])
    assert {"localhost", "127.0.0.1", "::1", "10.1.2.3", "node.example"} <= names(made.service_cert)
    for key in (made.service_key, made.client_key, tmp_path / "ca.key"):
        assert oct(key.stat().st_mode & 0o777) == "0o600"


def test_kept_while_good_and_made_again_for_a_new_host(tmp_path):
    first = local_authority(tmp_path).service_cert.read_bytes()
    assert local_authority(tmp_path).service_cert.read_bytes() == first
    assert local_authority(tmp_path, ["192.168.0.9"]).service_cert.read_bytes() != first


def test_made_again_near_its_end(tmp_path, monkeypatch):
    first = local_authority(tmp_path).ca.read_bytes()
    monkeypatch.setattr(certificates_module, "RENEW_BEFORE", datetime.timedelta(days=31))
    assert local_authority(tmp_path).ca.read_bytes() != first


def test_a_command_takes_the_tls_of_the_running_stack(tmp_path, monkeypatch):
    # use_stack_tls writes the process's environment: a copy, so that nothing it sets
    # outlives the test (a TLS mode left behind would change every later test's calls)
    monkeypatch.setattr(
        os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("RAGLINE_TLS_")}
    )
    made = local_authority(tmp_path / "tls")
    state = {"tls": made.client_environment("mtls"), "services": {}}
    (tmp_path / "up.json").write_text(json.dumps(state))
    use_stack_tls(tmp_path)
    assert os.environ["RAGLINE_TLS_MODE"] == "mtls"
    assert os.environ["RAGLINE_TLS_CERT_FILE"] == str(made.client_cert)


def test_the_environment_wins_over_the_stack(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", {**os.environ, "RAGLINE_TLS_MODE": "off"})
    state = {"tls": {"RAGLINE_TLS_MODE": "mtls"}, "services": {}}
    (tmp_path / "up.json").write_text(json.dumps(state))
    use_stack_tls(tmp_path)
    assert os.environ["RAGLINE_TLS_MODE"] == "off"
