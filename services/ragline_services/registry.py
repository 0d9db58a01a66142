"""The directory of services: where each ServiceSpec lives and its default port.

The application layer (`ragline serve`, `ragline up`, the tests) reads this table; the kit
never does, and a service finds another only through the address configured for its name
(`RAGLINE_<NAME>_ADDR`). Modules are imported lazily so a CLI call loads one service.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ragline.server import ServiceSpec


@dataclass(frozen=True)
class Registered:
    module: str
    # Loopback port of the laptop layout (`ragline up`, `ragline serve NAME`).
    default_port: int


# Start order of `ragline up`: what others depend on first, the orchestrator last.
SERVICES: dict[str, Registered] = {
    "budget": Registered("ragline_services.budget.service", 50105),
    "embedding": Registered("ragline_services.embedding.service", 50101),
    "retrieval": Registered("ragline_services.retrieval.service", 50102),
    "rerank": Registered("ragline_services.rerank.service", 50103),
    "generation": Registered("ragline_services.generation.service", 50104),
    "orchestrator": Registered("ragline_services.orchestrator.service", 50100),
}


# Services that speak HTTP, not gRPC (no ServiceSpec: a launcher of their own), started by
# `ragline up` after the gRPC services they front.
HTTP_SERVICES: dict[str, Registered] = {
    "gateway": Registered("ragline_services.gateway.service", 50180),
}


def service_names() -> list[str]:
    """The gRPC services."""
    return list(SERVICES)


def http_service_names() -> list[str]:
    return list(HTTP_SERVICES)


def _entry(name: str) -> Registered:
    try:
        return SERVICES[name] if name in SERVICES else HTTP_SERVICES[name]
    except KeyError:
        raise LookupError(
            f"unknown service {name!r}; expected one of {', '.join([*SERVICES, *HTTP_SERVICES])}"
        ) from None


def default_port(name: str) -> int:
    return _entry(name).default_port


def default_address(name: str, host: str = "127.0.0.1") -> str:
    return f"{host}:{default_port(name)}"


def load_spec(name: str) -> ServiceSpec:
    return importlib.import_module(_entry(name).module).SPEC
