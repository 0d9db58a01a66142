"""Wiring of the budget service: config, servicer registration, resources."""

from __future__ import annotations

from typing import ClassVar

import grpc

from ragline.config import DEFAULT_PORTS, Port, ServiceConfig
from ragline.server import Service, ServiceSpec
from ragline.v1 import budget_pb2, budget_pb2_grpc
from ragline_services.budget.servicer import BudgetServicer


class BudgetConfig(ServiceConfig):
    service_name: ClassVar[str] = "budget"
    model_config = ServiceConfig.env_for("budget")
    port: Port = DEFAULT_PORTS["budget"]


class BudgetService(Service):
    def register(self, server: grpc.aio.Server) -> None:
        budget_pb2_grpc.add_BudgetServiceServicer_to_server(BudgetServicer(), server)


SPEC = ServiceSpec(
    name="budget",
    grpc_service=budget_pb2.DESCRIPTOR.services_by_name["BudgetService"].full_name,
    config_factory=BudgetConfig,
    service_factory=BudgetService,
)
