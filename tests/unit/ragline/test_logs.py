"""Every log line of a process is one JSON object: its own (structlog) and its libraries'
(grpc, asyncio, uvicorn through stdlib logging) alike."""

from __future__ import annotations

import io
import json
import logging

from ragline.logs import configure_logging, get_logger


def test_library_lines_are_json_with_the_service_and_logger():
    stream = io.StringIO()
    configure_logging("retrieval", stream=stream)
    get_logger("ragline.test").warning("own.event", tenant="acme")
    logging.getLogger("grpc._cython.cygrpc").warning("lost %s connections", 2)
    logging.getLogger("asyncio").info("below the libraries' level: not written")
    own, library = (json.loads(line) for line in stream.getvalue().splitlines())
    assert own["event"] == "own.event" and own["service"] == "retrieval"
    assert library["event"] == "lost 2 connections"
    assert library["service"] == "retrieval" and library["level"] == "warning"
    assert library["logger"] == "grpc._cython.cygrpc" and "timestamp" in library
