"""What a service's start() makes and its servicer serves from, and the work it runs in
the background until stop()."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

from ragline.errors import Unavailable

log = structlog.get_logger("ragline.server")

T = TypeVar("T")


class Deferred(Generic[T]):
    """A domain object that exists once the service has started (a model, an index).

    Servicers read `.value`; before `set()` a call is answered UNAVAILABLE (retryable),
    never with a half-initialised object."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._value: T | None = None

    def set(self, value: T) -> None:
        self._value = value

    @property
    def ready(self) -> bool:
        return self._value is not None

    @property
    def value(self) -> T:
        if self._value is None:
            raise Unavailable(
                f"{self.what} is still starting; retry in a moment",
                reason="NOT_READY",
                retry_after_s=1.0,
            )
        return self._value


class Periodic:
    """Runs `action()` every `interval_s` seconds until stopped. A failed run is logged and
    the next one still comes (a failed index build leaves the current index serving)."""

    def __init__(self, interval_s: float, action: Callable[[], Awaitable[object]], name: str):
        self.interval_s = interval_s
        self.action = action
        self.name = name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.action()
            except Exception:
                log.exception("background.failed", task=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
