"""The grpc.aio server bootstrap every ragline service runs on."""

from ragline.server.bootstrap import HealthReporter, Service, ServiceSpec, serve

__all__ = ["HealthReporter", "Service", "ServiceSpec", "serve"]
