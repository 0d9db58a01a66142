"""Typed configuration from environment variables, with defaults that work on a laptop.

Each service has one config class with its own prefix (`RAGLINE_EMBEDDING_PORT`, ...);
settings every process shares (logging, caches, where the other services listen) use
`RAGLINE_`. The kit knows no service by name: a service's address is whatever
`RAGLINE_<NAME>_ADDR` says (the application layer sets them all from the registry).
"""

from __future__ import annotations

import ipaddress
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024
# gRPC message size cap of servers and clients alike (a larger message is RESOURCE_EXHAUSTED).
TRANSPORT_CAP_BYTES = 64 * MiB

# A TCP port; 0 asks the kernel for a free one.
Port = Annotated[int, Field(ge=0, le=65535)]

_ADDRESS_VARIABLE = re.compile(r"^RAGLINE_([A-Z][A-Z0-9_]*)_ADDR$")


def _optional_path(annotation: Any) -> bool:  # a field's type, as pydantic holds it
    args = typing.get_args(annotation)
    return type(None) in args and any(a is Path for a in args)


class EmptyMeansUnset(BaseSettings):
    """`VAR=""` for an optional path means "not set" (a ConfigMap or a shell that always
    exports every key), not the current directory. Empty strings elsewhere keep their
    meaning (an empty large model means small only)."""

    @field_validator("*", mode="before")
    @classmethod
    def _empty_path_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if value == "" and field is not None and _optional_path(field.annotation):
            return None
        return value


class ConfigError(RuntimeError):
    """A setting is missing or wrong; the message names the variable to set."""


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ragline"


class CommonConfig(EmptyMeansUnset):
    """Settings shared by every ragline process (prefix `RAGLINE_`)."""

    model_config = SettingsConfigDict(env_prefix="RAGLINE_", extra="ignore")

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    # Time kept back on every outbound call so the callee answers before our own deadline.
    hop_margin_s: float = Field(0.005, ge=0)
    # State (indexes, logs, caches) of embedded backends.
    data_dir: Path = Path(".ragline")
    # Downloads and builds shared between runs (models, llama.cpp).
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    # The model store (default: <cache_dir>/models).
    model_dir: Path | None = None
    # The virtualenv holding the local tritonserver (PyPI nvidia-pytriton; `make triton-env`)
    # that tests and laptops start.
    triton_venv: Path = Path(".venv-triton")
    # Threads of the BLAS behind numpy (0: the library's own default, one per core). A
    # service sizes its parallelism itself (model runs, executors); a BLAS pool on top
    # spins beside them (docs/tuning.md).
    blas_threads: int = Field(1, ge=0)
    # Tenants that are label values in metrics (comma-separated); any other is "other".
    metrics_tenants: str = ""
    # Where the `jsonl` trace exporter appends spans (OTEL_TRACES_EXPORTER=jsonl; tracing
    # itself is configured by the standard OTEL_* variables: ragline.tracing).
    traces_file: Path | None = None
    # Where each service listens: RAGLINE_<NAME>_ADDR (host:port), keyed by name.
    _addresses: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _resolve(self) -> CommonConfig:
        if self.model_dir is None:
            self.model_dir = self.cache_dir / "models"
        for variable, value in os.environ.items():
            match = _ADDRESS_VARIABLE.match(variable)
            if match and value.strip():
                self._addresses[match.group(1).lower()] = value.strip()
        return self

    def metrics_tenant_names(self) -> list[str]:
        return [t.strip() for t in self.metrics_tenants.split(",") if t.strip()]

    def address_of(self, service: str) -> str:
        """Where `service` is (host:port, a gRPC target, or a list of ip:port); ConfigError
        naming the variable when it is not set or not a target."""
        try:
            address = self._addresses[service]
        except KeyError:
            raise ConfigError(
                f"no address for the {service} service: set RAGLINE_{service.upper()}_ADDR "
                "(host:port); `ragline serve` and `ragline up` set it for the local layout"
            ) from None
        try:
            channel_target(address)
        except ValueError as error:
            raise ConfigError(f"RAGLINE_{service.upper()}_ADDR: {error}") from None
        return address


class ServiceConfig(EmptyMeansUnset):
    """Settings of one gRPC service. Subclasses set their env prefix with `env_for(name)`."""

    model_config = SettingsConfigDict(extra="ignore")

    host: str = "127.0.0.1"
    # 0 asks the kernel for a free port; `ragline serve` applies the registry's default.
    port: Port = 0
    # Seconds in-flight calls get to finish after SIGTERM / SIGINT.
    grace_s: float = Field(5.0, ge=0)
    # Transport cap: larger messages are refused by gRPC itself (RESOURCE_EXHAUSTED).
    max_message_bytes: int = Field(TRANSPORT_CAP_BYTES, ge=1024)
    # Application cap, checked first with INVALID_ARGUMENT naming the largest field.
    max_request_bytes: int = Field(16 * MiB, ge=1024)
    # Deadline applied when a caller sends none; 0 disables it.
    default_deadline_s: float = Field(120.0, ge=0)
    # Calls handled at once; beyond it gRPC answers RESOURCE_EXHAUSTED. 0 = unlimited. With
    # max_message_bytes it bounds what requests in flight can hold before any check.
    max_concurrent_rpcs: int = Field(256, ge=0)
    # A client connection is closed (GOAWAY) after this long, so that clients resolve the
    # service's name again and spread calls over replicas added since (HTTP/2 connections
    # otherwise live for ever). Calls in flight get DEFAULT_DEADLINE_S to finish. 0: never.
    max_connection_age_s: float = Field(300.0, ge=0)
    # One JSON log line per finished call.
    access_log: bool = True
    # With authentication on: whether an end user's token may call this service directly
    # (false: only other ragline services, with their credential; PERMISSION_DENIED
    # CLIENT_TOKEN_NOT_ACCEPTED otherwise). The front door (orchestrator) and the public
    # surfaces (retrieval's writes and searches, embedding, the shared budget, rerank's
    # ingest preparation) take tokens; generation does not (it would skip admission and
    # the budget).
    client_tokens: bool = True
    # Prometheus metrics on this HTTP port (`GET /metrics`, docs/operations.md); unset:
    # none served; 0: a free port (logged).
    metrics_port: Port | None = None
    # A second, plaintext port answering grpc.health.v1 only, for probes that cannot speak
    # TLS (Kubernetes' gRPC probe); unset: none. It reveals SERVING / NOT_SERVING, nothing
    # else.
    health_port: Port | None = None

    @staticmethod
    def env_for(name: str) -> SettingsConfigDict:
        """The pydantic settings of a service named `name` (env prefix RAGLINE_<NAME>_)."""
        return SettingsConfigDict(env_prefix=f"RAGLINE_{name.upper()}_", extra="ignore")


def channel_target(address: str) -> str:
    """The gRPC target of a configured address: `host:port` and any `scheme:` target
    (`dns:///name:port`, `dns://resolver/name:port`, `ipv4:`, `unix:`) as they are; a
    comma-separated list of `ip:port` as gRPC's static `ipv4:` / `ipv6:` list. A list can
    only hold IP addresses: a name of several replicas is one DNS name, resolved by gRPC."""
    address = address.strip()
    if "," not in address:
        return address
    addresses = [part.strip() for part in address.split(",") if part.strip()]
    families = set()
    for part in addresses:
        host, _, port = part.rpartition(":")
        try:
            families.add(ipaddress.ip_address(host.strip("[]")).version)
        except ValueError:
            raise ValueError(
                f"address list {address!r}: {part!r} is not ip:port; a list holds IP "
                "addresses only (for names, one DNS name that resolves to every replica)"
            ) from None
        if not port.isdigit():
            raise ValueError(f"address list {address!r}: {part!r} has no port")
    if len(families) > 1:
        raise ValueError(f"address list {address!r} mixes IPv4 and IPv6")
    return f"ipv{families.pop()}:{','.join(addresses)}"
