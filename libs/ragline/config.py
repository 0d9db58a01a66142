"""Typed configuration from environment variables, with defaults that work on a laptop.

Each service has one config class with its own prefix (`RAGLINE_EMBEDDING_PORT`, ...);
settings every process shares (logging, where the other services listen) use `RAGLINE_`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024

# A TCP port; 0 asks the kernel for a free one.
Port = Annotated[int, Field(ge=0, le=65535)]

# Default loopback ports of `ragline up`; the orchestrator sits at the base.
DEFAULT_PORTS: dict[str, int] = {
    "orchestrator": 50100,
    "embedding": 50101,
    "retrieval": 50102,
    "rerank": 50103,
    "generation": 50104,
    "budget": 50105,
}


class CommonConfig(BaseSettings):
    """Settings shared by every ragline process (prefix `RAGLINE_`)."""

    model_config = SettingsConfigDict(env_prefix="RAGLINE_", extra="ignore")

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    # Time kept back on every outbound call so the callee answers before our own deadline.
    hop_margin_s: float = Field(0.005, ge=0)
    # Where the services listen, as host:port (clients and the orchestrator use these).
    orchestrator_addr: str = f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}"
    embedding_addr: str = f"127.0.0.1:{DEFAULT_PORTS['embedding']}"
    retrieval_addr: str = f"127.0.0.1:{DEFAULT_PORTS['retrieval']}"
    rerank_addr: str = f"127.0.0.1:{DEFAULT_PORTS['rerank']}"
    generation_addr: str = f"127.0.0.1:{DEFAULT_PORTS['generation']}"
    budget_addr: str = f"127.0.0.1:{DEFAULT_PORTS['budget']}"
    # State (indexes, logs, caches) of embedded backends.
    data_dir: Path = Path(".ragline")

    def address_of(self, service: str) -> str:
        return getattr(self, f"{service}_addr")


class ServiceConfig(BaseSettings):
    """Settings of one gRPC service. Subclasses set `service_name` and their env prefix."""

    service_name: ClassVar[str] = ""
    model_config = SettingsConfigDict(extra="ignore")

    host: str = "127.0.0.1"
    port: Port = 0
    # Seconds in-flight calls get to finish after SIGTERM / SIGINT.
    grace_s: float = Field(5.0, ge=0)
    # Transport cap: larger messages are refused by gRPC itself (RESOURCE_EXHAUSTED).
    max_message_bytes: int = Field(64 * MiB, ge=1024)
    # Application cap, checked first with INVALID_ARGUMENT naming the largest field.
    max_request_bytes: int = Field(16 * MiB, ge=1024)
    # Deadline applied when a caller sends none; 0 disables it.
    default_deadline_s: float = Field(120.0, ge=0)
    # Calls handled at once; beyond it gRPC answers RESOURCE_EXHAUSTED. 0 = unlimited.
    max_concurrent_rpcs: int = Field(0, ge=0)
    # One JSON log line per finished call.
    access_log: bool = True

    @staticmethod
    def env_for(name: str) -> SettingsConfigDict:
        """The pydantic settings of a service named `name` (env prefix RAGLINE_<NAME>_)."""
        return SettingsConfigDict(env_prefix=f"RAGLINE_{name.upper()}_", extra="ignore")
