"""Where each service's ServiceSpec lives. Imported lazily so a CLI call loads one service."""

from __future__ import annotations

import importlib

from ragline.server import ServiceSpec

# Start order of `ragline up`: what others depend on first, the orchestrator last.
SERVICE_MODULES: dict[str, str] = {
    "budget": "ragline_services.budget.service",
    "embedding": "ragline_services.embedding.service",
    "retrieval": "ragline_services.retrieval.service",
    "rerank": "ragline_services.rerank.service",
    "generation": "ragline_services.generation.service",
    "orchestrator": "ragline_services.orchestrator.service",
}


def service_names() -> list[str]:
    return list(SERVICE_MODULES)


def load_spec(name: str) -> ServiceSpec:
    try:
        module = SERVICE_MODULES[name]
    except KeyError:
        raise ValueError(
            f"unknown service {name!r}; expected one of {', '.join(SERVICE_MODULES)}"
        ) from None
    return importlib.import_module(module).SPEC
