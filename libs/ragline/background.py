"""Work a service does on its own behalf, started from inside a request."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import TypeVar

import structlog

from ragline import deadlines, identity, timing

T = TypeVar("T")


def detached_task(coroutine: Coroutine[object, object, T], *, name: str) -> asyncio.Task[T]:
    """Starts work that must outlive the request that starts it (applying a logged write,
    moving an index to a new model) as the service's own: in a context without the request's
    deadline, caller identity, run id and clock, so it neither times out with the caller nor
    acts for one tenant on every tenant's behalf (outbound calls carry no identity)."""
    context = contextvars.copy_context()
    context.run(_forget_the_request)
    return asyncio.get_running_loop().create_task(coroutine, name=name, context=context)


def _forget_the_request() -> None:
    deadlines.set_deadline(None)
    identity.bind(None, None)
    timing.bind_clock(timing.RequestClock())
    structlog.contextvars.unbind_contextvars("run_id", "tenant", "stage")
