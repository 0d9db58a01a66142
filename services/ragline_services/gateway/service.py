"""`ragline serve gateway`: the HTTP gateway on uvicorn, stopped gracefully.

uvicorn turns SIGTERM / SIGINT into a graceful stop (no new connections, requests in flight
get GRACE_S). Readiness (`/readyz`) follows the orchestrator's gRPC health, polled, so a
load balancer sends nothing to a gateway whose orchestrator is away; `/healthz` is the
process alone (a liveness probe must not restart a gateway for its dependency).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from collections.abc import Iterator

import grpc
import structlog
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragline import tracing
from ragline.auth import AuthConfig
from ragline.clients import open_channel
from ragline.config import CommonConfig
from ragline.logs import configure_logging
from ragline.metrics import ProcessMetrics
from ragline.tls import TlsConfig
from ragline_services.gateway.app import Backends, build_app
from ragline_services.gateway.config import GatewayConfig

log = structlog.get_logger("ragline.gateway")

READINESS_POLL_S = 2.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuses a body over `limit` bytes with 413 while it arrives (Content-Length first),
    before anything parses it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await _too_large(send, self.limit)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except BodyTooLarge:
            if not started:
                await _too_large(send, self.limit)


async def _too_large(send: Send, limit: int) -> None:
    body = (
        b'{"error": {"message": "the request body is larger than the gateway accepts ('
        + str(limit).encode()
        + b' bytes: RAGLINE_GATEWAY_MAX_BODY_BYTES)", "type": "invalid_request_error", '
        b'"param": null, "code": "REQUEST_TOO_LARGE"}}'
    )
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})


class TraceRequests:
    """Each request in a server span (the caller's `traceparent` continued), set status and
    route when the response starts; the gRPC calls it makes are the span's children."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not tracing.enabled():
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        with tracing.http_server_span(scope["method"], scope["path"], headers) as span:

            async def sending(message: Message) -> None:
                if span is not None and message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    route = getattr(scope.get("route"), "path", None)
                    if route:
                        span.update_name(f"{scope['method']} {route}")
                        span.set_attribute("http.route", route)
                await send(message)

            await self.app(scope, receive, sending)


class RequestMetrics:
    """Requests by route and HTTP status, and their time to the last byte."""

    def __init__(self, metrics: ProcessMetrics, app: ASGIApp) -> None:
        self.app = app
        self.requests = Counter(
            "ragline_gateway_requests",
            "HTTP requests answered, by route and status",
            ("route", "status"),
            registry=metrics.registry,
        )
        self.seconds = Histogram(
            "ragline_gateway_request_seconds",
            "Time from a request's arrival to its response's last byte, by route",
            ("route",),
            buckets=_LATENCY_BUCKETS,
            registry=metrics.registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            # The route's template, never the raw path: a label per URL would grow unbounded.
            name = getattr(route, "path", "unmatched")
            self.requests.labels(name, str(status)).inc()
            self.seconds.labels(name).observe(time.monotonic() - started)


class _Server(uvicorn.Server):
    """uvicorn's server with this process's signal handling: its own re-raises SIGTERM after
    a graceful stop (the process would die of the signal instead of exiting 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _watch_readiness(app, target: str) -> None:
    tls = TlsConfig()
    async with open_channel(target, tls) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                app.state.ready = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                app.state.ready = False
            await asyncio.sleep(READINESS_POLL_S)


async def serve_gateway(config: GatewayConfig | None = None, common: CommonConfig | None = None):
    config = config or GatewayConfig()
    common = common or CommonConfig()
    configure_logging("gateway", common.log_level, common.log_format)
    if tracing.configure("gateway", common.traces_file):
        log.info("tracing.on", exporter=os.environ.get("OTEL_TRACES_EXPORTER"))
    AuthConfig().check_exposure(config.host)
    backends = Backends(common)
    app = build_app(config, common, backends)
    app.state.started = time.time()
    asgi: ASGIApp = TraceRequests(BodyLimit(app, config.max_body_bytes))
    metrics = None
    if config.metrics_port is not None:
        metrics = ProcessMetrics(common.metrics_tenant_names())
        asgi = RequestMetrics(metrics, asgi)
    tls = TlsConfig()
    tls.check(server=True)
    server = _Server(
        uvicorn.Config(
            asgi,
            # HTTPS with RAGLINE_TLS_*'s certificate. Its callers prove who they are with
            # tokens, not client certificates (the edge of the system: browsers, SDKs, an
            # Ingress, the kubelet's probes); under mtls it presents the client certificate
            # on its own calls to the services.
            ssl_certfile=str(tls.cert_file) if tls.on else None,
            ssl_keyfile=str(tls.key_file) if tls.on else None,
            host=config.host,
            port=config.port,
            log_config=None,
            access_log=False,
            lifespan="off",
            limit_concurrency=config.max_connections,
            timeout_graceful_shutdown=math.ceil(config.grace_s),
            server_header=False,
        )
    )
    watcher = asyncio.create_task(_watch_readiness(app, backends.targets["orchestrator"]))
    if metrics is not None and config.metrics_port is not None:
        port = metrics.serve(config.host, config.metrics_port)
        log.info("metrics.listening", host=config.host, metrics_port=port)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        app.state.ready = False  # a load balancer drains before connections close
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    log.info(
        "service.listening",
        host=config.host,
        port=config.port,
        protocol="https" if tls.on else "http",
        tls=tls.mode,
    )
    try:
        await server.serve()
        if not server.started:
            raise OSError(f"cannot listen on {config.host}:{config.port} (is the port in use?)")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        watcher.cancel()
        await backends.pool.close()
        if metrics is not None:
            await asyncio.to_thread(metrics.close)
        await asyncio.to_thread(tracing.shutdown)
        log.info("service.stopped")
