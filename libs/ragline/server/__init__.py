"""The grpc.aio server bootstrap every ragline service runs on."""

from ragline.server.bootstrap import HealthReporter, Service, ServiceSpec, serve
from ragline.server.lifecycle import Deferred, Periodic

__all__ = ["Deferred", "HealthReporter", "Periodic", "Service", "ServiceSpec", "serve"]
