"""Wiring of the retrieval service: config, servicer registration, resources."""

from __future__ import annotations

from typing import ClassVar

import grpc

from ragline.config import DEFAULT_PORTS, Port, ServiceConfig
from ragline.server import Service, ServiceSpec
from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc
from ragline_services.retrieval.servicer import RetrievalServicer


class RetrievalConfig(ServiceConfig):
    service_name: ClassVar[str] = "retrieval"
    model_config = ServiceConfig.env_for("retrieval")
    port: Port = DEFAULT_PORTS["retrieval"]


class RetrievalService(Service):
    def register(self, server: grpc.aio.Server) -> None:
        retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(RetrievalServicer(), server)


SPEC = ServiceSpec(
    name="retrieval",
    grpc_service=retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"].full_name,
    config_factory=RetrievalConfig,
    service_factory=RetrievalService,
)
