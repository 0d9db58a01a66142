"""TLS and mutual TLS for every gRPC server and client of the stack.

Certificates come from PEM files (a cert-manager Secret mounts `tls.crt`, `tls.key` and
`ca.crt`), and are read again when they change: a server asks at each new connection's
handshake, a client pool before opening a call, so a renewed certificate is used without
a restart. A pair that does not match (a half-written rotation) is logged and the previous
one kept.

    off   plaintext (the laptop default, loopback only unless authentication is on)
    tls   servers present their certificate; clients verify it against RAGLINE_TLS_CA_FILE
          (the system's roots when unset)
    mtls  as tls, and servers require a client certificate signed by that CA; clients
          present RAGLINE_TLS_CERT_FILE / RAGLINE_TLS_KEY_FILE
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc
import structlog
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from ragline.config import ConfigError, EmptyMeansUnset

log = structlog.get_logger("ragline.tls")

# How often a client pool looks at the certificate files (a stat of each).
CLIENT_RECHECK_S = 5.0


class TlsConfig(EmptyMeansUnset):
    """Transport security shared by every process (prefix `RAGLINE_TLS_`)."""

    model_config = SettingsConfigDict(env_prefix="RAGLINE_TLS_", extra="ignore")

    mode: Literal["off", "tls", "mtls"] = "off"
    # The certificate chain this process presents (as a server; as a client under mtls)...
    cert_file: Path | None = None
    # ... and its private key.
    key_file: Path | None = None
    # The CA(s) that sign the peers' certificates (servers check clients' under mtls).
    ca_file: Path | None = None
    # The name clients check in a server's certificate instead of the target's host: one
    # certificate for addresses it does not name (an `ip:port` list, a test on loopback).
    server_name: str = ""
    # Seconds a client keeps a channel opened with a replaced certificate, for its calls in
    # flight to finish.
    client_rotation_grace_s: float = Field(120.0, ge=0)

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def check(self, *, server: bool) -> None:
        """Every file this role needs is named and readable, and a key matches its
        certificate (the message names the variable to set)."""
        if not self.on:
            return
        presents = server or self.mode == "mtls"
        needed = {"RAGLINE_TLS_CERT_FILE": self.cert_file, "RAGLINE_TLS_KEY_FILE": self.key_file}
        if presents:
            for variable, path in needed.items():
                if path is None:
                    role = "a server" if server else "a client under mtls"
                    raise ConfigError(f"RAGLINE_TLS_MODE={self.mode} needs {variable} ({role})")
            _matching_pair(self.cert_file, self.key_file)
        if self.mode == "mtls" and self.ca_file is None:
            raise ConfigError(
                "RAGLINE_TLS_MODE=mtls needs RAGLINE_TLS_CA_FILE: the CA that signs the "
                "certificates of the services and clients admitted"
            )
        if self.ca_file is not None:
            _read(self.ca_file, "RAGLINE_TLS_CA_FILE")

    def files(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.ca_file) if p is not None)

    def stamp(self) -> Stamp:
        """What changes when a file is replaced (a Secret's symlink swap included)."""
        return tuple(_stamp(path) for path in self.files())

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a client channel, from the files as they are now."""
        ca = _read(self.ca_file, "RAGLINE_TLS_CA_FILE") if self.ca_file else None
        if self.mode == "mtls":
            certificate, key = _matching_pair(self.cert_file, self.key_file)
            return grpc.ssl_channel_credentials(ca, key, certificate)
        return grpc.ssl_channel_credentials(ca)

    def channel_options(self) -> list[tuple[str, str]]:
        if self.on and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def ssl_client_context(self) -> ssl.SSLContext:
        """An HTTPS client's context: the CA to verify the server with, and under mtls the
        certificate to present (the HTTP gateway's clients, its readiness probe)."""
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.mode == "mtls" and self.cert_file and self.key_file:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context

    def server_credentials(self) -> grpc.ServerCredentials:
        return ServerCertificates(self).credentials()


def process_tls_for(wanted: bool, variable: str) -> TlsConfig | None:
    """The process's own TLS settings for a client of something outside the stack (Triton),
    when `variable` (its switch) asks for TLS: they must be on and complete."""
    if not wanted:
        return None
    tls = TlsConfig()
    if not tls.on:
        raise ConfigError(
            f"{variable}=true needs RAGLINE_TLS_MODE (tls or mtls) and its files: the client "
            "uses the process's TLS credentials"
        )
    tls.check(server=False)
    return tls


# Each file's (inode, mtime, size), None where it is missing: what a replacement changes.
Stamp = tuple[tuple[int, int, int] | None, ...]


@dataclass
class _Loaded:
    stamp: Stamp
    configuration: grpc.ServerCertificateConfiguration


class ServerCertificates:
    """A server's certificate files, read again at a handshake after they change."""

    def __init__(self, config: TlsConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._loaded = _Loaded(config.stamp(), self._configuration())
        self.reloads = 0

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        certificate, key = _matching_pair(self._config.cert_file, self._config.key_file)
        ca = _read(self._config.ca_file, "RAGLINE_TLS_CA_FILE") if self._config.ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, certificate)], ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._loaded.configuration,
            # types-grpcio says the fetcher never returns None; gRPC's own documentation:
            # None keeps the current configuration.
            self.fetch,  # type: ignore[arg-type]
            require_client_authentication=self._config.mode == "mtls",
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake question: a new configuration, or None to keep the last.
        Runs on gRPC's thread; a stat of each file when nothing changed."""
        stamp = self._config.stamp()
        with self._lock:
            if stamp == self._loaded.stamp:
                return None
            try:
                configuration = self._configuration()
            except (ConfigError, ValueError) as error:
                # Mid-rotation (a key beside the old certificate): keep serving the last
                # good pair and look again at the next handshake.
                log.warning("tls.reload_failed", error=str(error))
                return None
            self._loaded = _Loaded(stamp, configuration)
            self.reloads += 1
        log.info("tls.reloaded", files=[str(p) for p in self._config.files()])
        return configuration


class ClientCredentials:
    """A client's credentials, made again when its files change (looked at every
    CLIENT_RECHECK_S at most)."""

    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self._stamp = config.stamp()
        self._checked = time.monotonic()
        self.credentials = config.channel_credentials()

    def changed(self) -> bool:
        now = time.monotonic()
        if now - self._checked < CLIENT_RECHECK_S:
            return False
        self._checked = now
        stamp = self.config.stamp()
        if stamp == self._stamp:
            return False
        try:
            credentials = self.config.channel_credentials()
        except (ConfigError, ValueError) as error:
            log.warning("tls.reload_failed", error=str(error))
            return False
        self._stamp, self.credentials = stamp, credentials
        log.info("tls.client_reloaded", files=[str(p) for p in self.config.files()])
        return True


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _read(path: Path | None, variable: str) -> bytes:
    if path is None:
        raise ConfigError(f"{variable} is not set")
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{variable}={path}: {error.strerror or error}") from error


def _matching_pair(cert_file: Path | None, key_file: Path | None) -> tuple[bytes, bytes]:
    """The PEM certificate chain and key, refused unless the key is the certificate's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    certificate = _read(cert_file, "RAGLINE_TLS_CERT_FILE")
    key = _read(key_file, "RAGLINE_TLS_KEY_FILE")
    try:
        leaf = x509.load_pem_x509_certificate(certificate)
    except ValueError as error:
        raise ConfigError(f"RAGLINE_TLS_CERT_FILE={cert_file}: not a PEM certificate") from error
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as error:
        raise ConfigError(
            f"RAGLINE_TLS_KEY_FILE={key_file}: not an unencrypted PEM private key"
        ) from error
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if leaf.public_key().public_bytes(der, public) != private.public_key().public_bytes(
        der, public
    ):
        raise ConfigError(
            f"RAGLINE_TLS_KEY_FILE={key_file} is not the key of RAGLINE_TLS_CERT_FILE={cert_file}"
        )
    return certificate, key
