"""The local query encoder is adopted as the service's own work: not under the deadline
(nor the identity) of the call that happened to hear the embedding service's model. Under
a caller's deadline its warm-up failed whenever loading took longer, and the failure
surfaced at shutdown (the service exited 1)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ragline import deadlines, identity
from ragline_services.retrieval.service import RetrievalService


class RecordingEncoder:
    def __init__(self) -> None:
        self.seen: list[tuple[float | None, object]] = []

    def serves(self, version: str) -> bool:
        return False

    async def adopt(self, version: str) -> bool:
        await asyncio.sleep(0.05)  # longer than the caller's deadline
        self.seen.append((deadlines.remaining(), identity.optional_caller()))
        return True


async def test_adoption_runs_without_the_callers_deadline_or_identity():
    encoder = RecordingEncoder()
    service = SimpleNamespace(_local=encoder, _adopting=None, embedding_version="")
    tokens = identity.bind(identity.Caller(tenant="acme"), "run-1")
    try:
        with deadlines.deadline_scope(0.01):
            RetrievalService._heard_model(service, "me5-small-int8@abc")
    finally:
        identity.unbind(tokens)
    assert await service._adopting is True
    assert encoder.seen == [(None, None)]
    assert service.embedding_version == "me5-small-int8@abc"
