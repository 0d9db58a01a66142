"""What several commands share."""

from __future__ import annotations


def service_names() -> list[str]:
    """Every service `ragline serve` runs: the gRPC ones, then the HTTP ones."""
    from ragline_services.registry import http_service_names, service_names

    return [*service_names(), *http_service_names()]
