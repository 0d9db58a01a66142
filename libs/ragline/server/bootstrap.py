"""grpc.aio server bootstrap: one code path for every service.

A thin launcher in the style of vLLM's gRPC entrypoint: build the service, register it with
health and reflection, serve, and turn SIGTERM / SIGINT into a graceful `server.stop(grace)`.
Health reports NOT_SERVING while the service starts its backends (models, connections) and
again as soon as shutdown begins, so load balancers drain before connections close.
"""

from __future__ import annotations

import abc
import asyncio
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ragline import tracing
from ragline.allocator import fix_mmap_threshold
from ragline.auth import AuthConfig, Authenticator, name_process_service, process_credential
from ragline.config import CommonConfig, ServiceConfig
from ragline.cores import limit_blas_threads
from ragline.logs import configure_logging
from ragline.metrics import ProcessMetrics
from ragline.server import reflection_v1
from ragline.server.interceptor import RaglineServerInterceptor
from ragline.tls import TlsConfig

log = structlog.get_logger("ragline.server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The health service name a liveness probe asks: SERVING whenever the process's event loop
# answers, whatever its dependencies (a budget service without etcd is NOT_SERVING, and
# must not be restarted for it).
LIVENESS = "liveness"


def connection_age_options(cfg: ServiceConfig) -> list[tuple[str, int]]:
    """gRPC server options closing each connection at MAX_CONNECTION_AGE_S (calls in flight
    get DEFAULT_DEADLINE_S, or 120 s where that is 0, to finish on it)."""
    if cfg.max_connection_age_s <= 0:
        return []
    grace_s = cfg.default_deadline_s or 120.0
    return [
        ("grpc.max_connection_age_ms", int(cfg.max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(grace_s * 1000)),
    ]


class HealthReporter:
    """Lets a service flip its own health (for example when its database goes away)."""

    def __init__(self, servicer: health_aio.HealthServicer, grpc_service: str) -> None:
        self._servicer = servicer
        self._grpc_service = grpc_service
        self.serving = False

    async def set_serving(self, serving: bool, reason: str = "") -> None:
        if serving != self.serving:
            log.info("health.changed", serving=serving, reason=reason)
        self.serving = serving
        status = SERVING if serving else NOT_SERVING
        await self._servicer.set(self._grpc_service, status)
        await self._servicer.set("", status)


class Service(abc.ABC):
    """One service: registers its servicer and owns the resources it serves from."""

    def __init__(self, config: ServiceConfig, common: CommonConfig) -> None:
        self.config = config
        self.common = common
        self.health: HealthReporter | None = None
        # The process's metrics when a metrics port is set (a service adds its own).
        self.metrics: ProcessMetrics | None = None

    @abc.abstractmethod
    def register(self, server: grpc.aio.Server) -> None:
        """Adds the servicer(s) to the server."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Loads models and opens connections; runs while health says NOT_SERVING."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Releases resources after in-flight calls finished."""

    async def ready(self) -> bool:
        """Whether to report SERVING once started (a service may keep probing after)."""
        return True


@dataclass(frozen=True)
class ServiceSpec:
    """How to build and name a service."""

    name: str
    grpc_service: str
    config_factory: Callable[[], ServiceConfig]
    # (the service's own config class, CommonConfig) -> Service: each service takes the
    # config its config_factory makes, a subclass the signature cannot name.
    service_factory: Callable[..., Service]


class ServerRunner:
    """Starts and stops one service's server; `serve()` wraps it with signal handling."""

    def __init__(self, spec: ServiceSpec, config: ServiceConfig, common: CommonConfig) -> None:
        self.spec = spec
        self.config = config
        self.common = common
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self._health_server: grpc.aio.Server | None = None
        self._metrics: ProcessMetrics | None = None
        self._server: grpc.aio.Server | None = None
        self._service: Service | None = None
        self._authenticator: Authenticator | None = None
        self._health = health_aio.HealthServicer()

    async def start(self) -> int:
        cfg = self.config
        AuthConfig().check_exposure(cfg.host)
        name_process_service(self.spec.name)
        process_credential()  # a key file that cannot be read stops the start, named
        if cfg.metrics_port is not None:
            self._metrics = ProcessMetrics(self.common.metrics_tenant_names())
        self._authenticator = authenticator = Authenticator(AuthConfig())
        server = grpc.aio.server(
            interceptors=[
                RaglineServerInterceptor(
                    default_deadline_s=cfg.default_deadline_s,
                    max_request_bytes=cfg.max_request_bytes,
                    access_log=cfg.access_log,
                    authenticator=authenticator,
                    metrics=None if self._metrics is None else self._metrics.grpc,
                    client_tokens=cfg.client_tokens,
                )
            ],
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                # gRPC enables SO_REUSEPORT by default, which lets a second server silently
                # share a busy port; a port clash must fail loudly instead.
                ("grpc.so_reuseport", 0),
                *connection_age_options(cfg),
            ],
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs or None,
        )
        service = self.spec.service_factory(cfg, self.common)
        service.health = HealthReporter(self._health, self.spec.grpc_service)
        service.metrics = self._metrics
        service.register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflected = [
            self.spec.grpc_service,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
            reflection_v1.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(reflected, server)
        reflection_v1.enable(reflected, server)
        tls = TlsConfig()
        tls.check(server=True)
        port = _listen(
            server, f"{cfg.host}:{cfg.port}", tls.server_credentials() if tls.on else None
        )
        await service.health.set_serving(False, reason="starting")
        await self._health.set(LIVENESS, SERVING)
        await server.start()
        self._server, self._service, self.port = server, service, port
        log.info(
            "service.listening",
            host=cfg.host,
            port=port,
            grpc_service=self.spec.grpc_service,
            tls=tls.mode,
        )
        if cfg.health_port is not None:
            await self._serve_health(cfg)
        if self._metrics is not None and cfg.metrics_port is not None:
            try:
                self.metrics_port = self._metrics.serve(cfg.host, cfg.metrics_port)
            except OSError as error:
                raise OSError(
                    f"cannot serve metrics on {cfg.host}:{cfg.metrics_port}: {error} "
                    "(is the port in use?)"
                ) from error
            log.info("metrics.listening", host=cfg.host, metrics_port=self.metrics_port)
        await service.start()
        if not await asyncio.to_thread(authenticator.wait_ready):
            # Served anyway (health, and the key set may come): tokens wait for its keys.
            log.warning("auth.no_keys_yet", url=authenticator.config.jwks_url)
        ready = await service.ready()
        await service.health.set_serving(ready, reason="started" if ready else "backend not ready")
        log.info(
            "service.ready" if ready else "service.started_not_ready", host=cfg.host, port=port
        )
        return port

    async def _serve_health(self, cfg: ServiceConfig) -> None:
        # The same health servicer on a plaintext port of its own: a prober without TLS
        # sees what the service reports, and reaches nothing else.
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, health_server)
        self.health_port = _listen(health_server, f"{cfg.host}:{cfg.health_port}", None)
        await health_server.start()
        self._health_server = health_server
        log.info("health.listening", host=cfg.host, health_port=self.health_port)

    async def stop(self) -> None:
        if self._server is None:
            return
        log.info("service.stopping", grace_s=self.config.grace_s)
        await self._health.enter_graceful_shutdown()
        await self._server.stop(self.config.grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None
        if self._service is not None:
            await self._service.stop()
        if self._metrics is not None:
            # its server thread polls for shutdown every half second: off the event loop
            await asyncio.to_thread(self._metrics.close)
        if self._authenticator is not None:
            self._authenticator.close()
        log.info("service.stopped")
        self._server = None


def _listen(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None
) -> int:
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as error:
        raise OSError(f"cannot listen on {address}: {error} (is the port in use?)") from error
    if port == 0:
        raise OSError(f"cannot listen on {address} (is the port in use?)")
    return port


async def serve(
    spec: ServiceSpec, config: ServiceConfig | None = None, common: CommonConfig | None = None
) -> None:
    """Runs one service until SIGTERM or SIGINT, then shuts it down gracefully."""
    config = config or spec.config_factory()
    common = common or CommonConfig()
    configure_logging(spec.name, common.log_level, common.log_format)
    if tracing.configure(spec.name, common.traces_file):
        log.info("tracing.on", exporter=os.environ.get("OTEL_TRACES_EXPORTER"))
    limit_blas_threads(common.blas_threads)
    fix_mmap_threshold()
    runner = ServerRunner(spec, config, common)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        start = asyncio.create_task(runner.start())
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({start, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if start in done:
            start.result()  # surfaces a failed start
            await stopping
        else:
            start.cancel()
    finally:
        await runner.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await asyncio.to_thread(tracing.shutdown)  # exports what is pending
