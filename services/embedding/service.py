"""Wiring of the embedding service: config, servicer registration, resources."""

from __future__ import annotations

from typing import ClassVar

import grpc

from ragline.config import DEFAULT_PORTS, Port, ServiceConfig
from ragline.server import Service, ServiceSpec
from ragline.v1 import embedding_pb2, embedding_pb2_grpc
from ragline_services.embedding.servicer import EmbeddingServicer


class EmbeddingConfig(ServiceConfig):
    service_name: ClassVar[str] = "embedding"
    model_config = ServiceConfig.env_for("embedding")
    port: Port = DEFAULT_PORTS["embedding"]


class EmbeddingService(Service):
    def register(self, server: grpc.aio.Server) -> None:
        embedding_pb2_grpc.add_EmbeddingServiceServicer_to_server(EmbeddingServicer(), server)


SPEC = ServiceSpec(
    name="embedding",
    grpc_service=embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"].full_name,
    config_factory=EmbeddingConfig,
    service_factory=EmbeddingService,
)
