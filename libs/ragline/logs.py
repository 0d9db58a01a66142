"""structlog JSON logging; every line carries service, run id, tenant and stage when known."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(
    service: str, level: str = "info", fmt: str = "json", stream: TextIO | None = None
) -> None:
    numeric_level = getattr(logging, level.upper(), logging.INFO)
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries that use stdlib logging (grpc, asyncio) go to the same stream.
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=stream or sys.stderr)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
