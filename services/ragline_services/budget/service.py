"""Wiring of the budget service: config, the etcd store, health that follows etcd."""

from __future__ import annotations

from pathlib import Path

import grpc
import structlog
from pydantic import Field

from ragline.config import MiB, ServiceConfig
from ragline.errors import RaglineError
from ragline.server import Periodic, Service, ServiceSpec
from ragline.v1 import budget_pb2, budget_pb2_grpc
from ragline_services.budget.ledger import TaskLedger
from ragline_services.budget.metrics import BudgetMetrics
from ragline_services.budget.servicer import BudgetServicer
from ragline_services.budget.store import EtcdAccess, EtcdLedgerStore

log = structlog.get_logger("ragline.budget")


class BudgetConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("budget")
    # Its largest request is a Batch of 64 small items: larger messages are refused by the
    # transport before they are read whole or parsed (docs/security.md).
    max_message_bytes: int = Field(1 * MiB, ge=1024)
    max_request_bytes: int = Field(512 * 1024, ge=1024)
    # Comma-separated host:port of the etcd cluster's client endpoints.
    etcd_endpoints: str = "127.0.0.1:2379"
    # TLS to etcd: the CA that signs etcd's certificate (unset: plaintext) ...
    etcd_ca_file: Path | None = None
    # ... and the client certificate etcd requires under --client-cert-auth.
    etcd_cert_file: Path | None = None
    etcd_key_file: Path | None = None
    # The name checked in etcd's certificate (one name for a list of endpoints).
    etcd_server_name: str = ""
    # An etcd user whose role covers the ledger's key prefix (etcd auth on); unset: none.
    etcd_username: str = ""
    etcd_password: str = ""
    # Longest one etcd operation may take before the call fails with UNAVAILABLE.
    etcd_timeout_s: float = Field(2.0, gt=0)
    # Ledger records outlive the task deadline by this much (late settlements, reports).
    expiry_grace_s: float = Field(300.0, ge=0)
    key_prefix: str = "/ragline/budget/v1"
    # How often health re-checks etcd (NOT_SERVING while it is unreachable).
    health_probe_s: float = Field(2.0, gt=0)
    # Transactions one write tries against a ledger other replicas keep changing before
    # the call ends ABORTED (reason CONFLICT; the caller retries with the same id).
    max_conflict_attempts: int = Field(1000, ge=1)


class BudgetService(Service):
    config: BudgetConfig

    def __init__(self, config: BudgetConfig, common) -> None:
        super().__init__(config, common)
        endpoints = [e.strip() for e in config.etcd_endpoints.split(",") if e.strip()]
        access = EtcdAccess(
            ca_file=config.etcd_ca_file,
            cert_file=config.etcd_cert_file,
            key_file=config.etcd_key_file,
            server_name=config.etcd_server_name,
            username=config.etcd_username,
            password=config.etcd_password,
        )
        self.store = EtcdLedgerStore(
            endpoints,
            timeout_s=config.etcd_timeout_s,
            access=access,
            ping_key=f"{config.key_prefix.rstrip('/')}/ping".encode(),
        )
        self.ledger = TaskLedger(
            self.store,
            key_prefix=config.key_prefix,
            expiry_grace_s=config.expiry_grace_s,
            max_attempts=config.max_conflict_attempts,
        )
        self._probe = Periodic(config.health_probe_s, self._update_health, "etcd-probe")
        self._servicer = BudgetServicer(self.ledger)
        self._etcd_reachable_now = False

    def register(self, server: grpc.aio.Server) -> None:
        budget_pb2_grpc.add_BudgetServiceServicer_to_server(self._servicer, server)

    async def start(self) -> None:
        if self.metrics is not None:
            metrics = self._servicer.metrics = BudgetMetrics(self.metrics)
            metrics.watch(self.ledger, self.store, lambda: self._etcd_reachable_now)
        await self.store.connect()

    async def _etcd_reachable(self) -> bool:
        try:
            await self.store.ping()
        except RaglineError as error:
            log.warning("budget.etcd_unreachable", error=error.message)
            self._etcd_reachable_now = False
            return False
        self._etcd_reachable_now = True
        return True

    async def ready(self) -> bool:
        reachable = await self._etcd_reachable()
        self._probe.start()
        return reachable

    async def _update_health(self) -> None:
        reachable = await self._etcd_reachable()
        if self.health is None:  # not serving (yet): nothing to report to
            return
        await self.health.set_serving(
            reachable, reason="etcd reachable" if reachable else "etcd unreachable"
        )

    async def stop(self) -> None:
        await self._probe.stop()
        await self.store.close()


SPEC = ServiceSpec(
    name="budget",
    grpc_service=budget_pb2.DESCRIPTOR.services_by_name["BudgetService"].full_name,
    config_factory=BudgetConfig,
    service_factory=BudgetService,
)
