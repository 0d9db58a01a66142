"""Wiring of the orchestrator service: config, servicer registration, resources."""

from __future__ import annotations

import grpc

from ragline.config import ServiceConfig
from ragline.server import Service, ServiceSpec
from ragline.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from ragline_services.orchestrator.servicer import OrchestratorServicer


class OrchestratorConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("orchestrator")


class OrchestratorService(Service):
    def register(self, server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(
            OrchestratorServicer(), server
        )


SPEC = ServiceSpec(
    name="orchestrator",
    grpc_service=orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name,
    config_factory=OrchestratorConfig,
    service_factory=OrchestratorService,
)
