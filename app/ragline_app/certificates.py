"""A private certificate authority for `ragline up --tls` and tests: TLS on a laptop without
a cluster's cert-manager.

Three certificates under one folder, all signed by its `ca.crt`:
- `service.crt` / `service.key`: what every service presents, as a server and (mTLS) as a
  client of the others; it names loopback and the host the stack listens on;
- `client.crt` / `client.key`: what commands (`ragline ask`, grpcurl) present under mTLS.

Kept between runs while each has a day left and names the hosts asked for; made again
otherwise. Keys are readable by their owner only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LIFETIME = datetime.timedelta(days=30)
RENEW_BEFORE = datetime.timedelta(days=1)
LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class LocalCertificates:
    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def service_cert(self) -> Path:
        return self.folder / "service.crt"

    @property
    def service_key(self) -> Path:
        return self.folder / "service.key"

    @property
    def client_cert(self) -> Path:
        return self.folder / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.folder / "client.key"

    def service_environment(self, mode: str) -> dict[str, str]:
        """RAGLINE_TLS_* of a service process."""
        return _environment(mode, self.service_cert, self.service_key, self.ca)

    def client_environment(self, mode: str) -> dict[str, str]:
        """RAGLINE_TLS_* of a command calling the stack."""
        return _environment(mode, self.client_cert, self.client_key, self.ca)


def _environment(mode: str, cert: Path, key: Path, ca: Path) -> dict[str, str]:
    return {
        "RAGLINE_TLS_MODE": mode,
        "RAGLINE_TLS_CERT_FILE": str(cert),
        "RAGLINE_TLS_KEY_FILE": str(key),
        "RAGLINE_TLS_CA_FILE": str(ca),
    }


def local_authority(folder: Path, hosts: list[str] | tuple[str, ...] = ()) -> LocalCertificates:
    """The folder's CA and certificates, made (again) where missing, near their end or not
    naming every one of `hosts` (besides loopback)."""
    certificates = LocalCertificates(folder)
    names = list(dict.fromkeys([*LOOPBACK, *hosts]))
    if _still_good(certificates, names):
        return certificates
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ragline local CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_usage(), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    service_key = ec.generate_private_key(ec.SECP256R1())
    service = _leaf(
        "ragline service",
        service_key,
        ca,
        ca_key,
        now,
        names,
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _leaf(
        "ragline client", client_key, ca, ca_key, now, [], [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    _write_key(folder / "ca.key", ca_key)
    _write_key(certificates.service_key, service_key)
    _write_key(certificates.client_key, client_key)
    for path, cert in (
        (certificates.ca, ca),
        (certificates.service_cert, service),
        (certificates.client_cert, client),
    ):
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return certificates


def _builder(subject, issuer, public_key, now):
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + LIFETIME)
    )


def _ca_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def _leaf(common_name, key, ca, ca_key, now, names, usages):
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        _builder(subject, ca.subject, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False
        )
    return builder.sign(ca_key, hashes.SHA256())


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return x509.DNSName(name)


def _write_key(path: Path, key) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def _still_good(certificates: LocalCertificates, names: list[str]) -> bool:
    paths = (
        certificates.ca,
        certificates.service_cert,
        certificates.service_key,
        certificates.client_cert,
        certificates.client_key,
    )
    if not all(p.exists() for p in paths):
        return False
    try:
        service = x509.load_pem_x509_certificate(certificates.service_cert.read_bytes())
        ca = x509.load_pem_x509_certificate(certificates.ca.read_bytes())
        san = service.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, OSError, x509.ExtensionNotFound):
        return False
    ends = min(service.not_valid_after_utc, ca.not_valid_after_utc)
    if ends - datetime.datetime.now(datetime.UTC) < RENEW_BEFORE:
        return False
    held = {str(v) for v in san.get_values_for_type(x509.IPAddress)}
    held |= set(san.get_values_for_type(x509.DNSName))
    return all(str(_general_name(n).value) in held for n in names)
