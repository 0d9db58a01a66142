"""The gateway's settings (prefix `RAGLINE_GATEWAY_`), defaults that work on a laptop."""

from __future__ import annotations

from pydantic import Field

from ragline.config import MiB, Port, ServiceConfig


class GatewayConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("gateway")
    # A call's deadline when the request names none (header X-Ragline-Timeout, seconds),
    # and the longest one a caller may ask for.
    default_timeout_s: float = Field(60.0, gt=0)
    max_timeout_s: float = Field(300.0, gt=0)
    # Request bodies larger than this are refused (413) while they arrive, before they are
    # parsed: no credential is needed to send a body, so the cap protects the pod.
    max_body_bytes: int = Field(8 * MiB, ge=1024)
    # The tenant of a call that names none (X-Ragline-Tenant) while authentication is off;
    # with it on, the token names the tenant and this is not used.
    default_tenant: str = "default"
    # Connections uvicorn holds at once; beyond them it answers 503.
    max_connections: int = Field(1024, ge=1)
    metrics_port: Port | None = None
