"""Wiring of the rerank service: config, servicer registration, resources."""

from __future__ import annotations

import grpc

from ragline.config import ServiceConfig
from ragline.server import Service, ServiceSpec
from ragline.v1 import rerank_pb2, rerank_pb2_grpc
from ragline_services.rerank.servicer import RerankServicer


class RerankConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("rerank")


class RerankService(Service):
    def register(self, server: grpc.aio.Server) -> None:
        rerank_pb2_grpc.add_RerankServiceServicer_to_server(RerankServicer(), server)


SPEC = ServiceSpec(
    name="rerank",
    grpc_service=rerank_pb2.DESCRIPTOR.services_by_name["RerankService"].full_name,
    config_factory=RerankConfig,
    service_factory=RerankService,
)
