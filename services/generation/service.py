"""Wiring of the generation service: config, servicer registration, resources."""

from __future__ import annotations

from typing import ClassVar

import grpc

from ragline.config import DEFAULT_PORTS, Port, ServiceConfig
from ragline.server import Service, ServiceSpec
from ragline.v1 import generation_pb2, generation_pb2_grpc
from ragline_services.generation.servicer import GenerationServicer


class GenerationConfig(ServiceConfig):
    service_name: ClassVar[str] = "generation"
    model_config = ServiceConfig.env_for("generation")
    port: Port = DEFAULT_PORTS["generation"]


class GenerationService(Service):
    def register(self, server: grpc.aio.Server) -> None:
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(), server)


SPEC = ServiceSpec(
    name="generation",
    grpc_service=generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
    config_factory=GenerationConfig,
    service_factory=GenerationService,
)
