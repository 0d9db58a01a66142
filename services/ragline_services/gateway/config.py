"""The gateway's settings (prefix `RAGLINE_GATEWAY_`), defaults that work on a laptop.

Not a ServiceConfig: the gRPC transport's settings (message caps, concurrent RPCs,
connection age, the health port) mean nothing to an HTTP server; the listen address, the
shutdown grace and the metrics port mean the same as theirs.
"""

from __future__ import annotations

from pydantic import Field

from ragline.config import EmptyMeansUnset, MiB, Port, ServiceConfig


class GatewayConfig(EmptyMeansUnset):
    model_config = ServiceConfig.env_for("gateway")

    host: str = "127.0.0.1"
    # 0 asks the kernel for a free port; `ragline serve` applies the registry's default.
    port: Port = 0
    # Seconds requests in flight get to finish after SIGTERM / SIGINT.
    grace_s: float = Field(5.0, ge=0)
    # Prometheus metrics on this HTTP port (docs/operations.md); unset: none served.
    metrics_port: Port | None = None
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
