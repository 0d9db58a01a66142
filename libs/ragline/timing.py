"""Server-side timing of one call: queue wait, compute, first token, named stages.

The interceptor starts a RequestClock when a call arrives; services mark what they do and
put `clock.to_proto()` into their response so the caller can split network, queueing and
compute.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from google.protobuf import duration_pb2

if TYPE_CHECKING:
    from ragline.v1 import common_pb2


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(max(int(seconds * 1e9), 0))
    return value


def seconds_of(value: duration_pb2.Duration) -> float:
    """A Duration as seconds (the inverse of `duration`)."""
    return value.ToNanoseconds() / 1e9


def summed_server_timing(
    first: common_pb2.ServerTiming, then: common_pb2.ServerTiming
) -> common_pb2.ServerTiming:
    """Two calls' server timings as one node's: queue wait, compute and total added, the
    first token the first call's, stages of one name added in the order first seen."""
    from ragline.v1 import common_pb2

    summed = common_pb2.ServerTiming()
    for name in ("queue_wait", "compute", "total"):
        total = seconds_of(getattr(first, name)) + seconds_of(getattr(then, name))
        getattr(summed, name).CopyFrom(duration(total))
    source = first if first.HasField("first_token") else then
    if source.HasField("first_token"):
        summed.first_token.CopyFrom(source.first_token)
    stages: dict[str, float] = {}
    for stage in (*first.stages, *then.stages):
        stages[stage.name] = stages.get(stage.name, 0.0) + seconds_of(stage.duration)
    for name, seconds in stages.items():
        summed.stages.add(name=name, duration=duration(seconds))
    return summed


@dataclass
class RequestClock:
    received: float = field(default_factory=time.monotonic)
    # When the handler began (after transport-level queueing).
    handler_started: float | None = None
    # Set when the service starts real work (after its own queues); queue_wait ends there.
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None
    compute_s: float = 0.0
    stages: list[tuple[str, float]] = field(default_factory=list)

    def mark_started(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def mark_first_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def mark_finished(self) -> float:
        self.finished = time.monotonic()
        return self.finished

    def add_stage(self, name: str, seconds: float, *, compute: bool = True) -> None:
        self.stages.append((name, seconds))
        if compute:
            self.compute_s += seconds

    @contextmanager
    def stage(self, name: str, *, compute: bool = True) -> Iterator[None]:
        """Times the enclosed block as a named stage (counted as compute by default)."""
        self.mark_started()
        start = time.monotonic()
        try:
            yield
        finally:
            self.add_stage(name, time.monotonic() - start, compute=compute)

    @property
    def queue_wait_s(self) -> float:
        start = self.started or self.handler_started or time.monotonic()
        return start - self.received

    def to_proto(self) -> common_pb2.ServerTiming:
        from ragline.v1 import common_pb2

        end = self.finished if self.finished is not None else time.monotonic()
        timing = common_pb2.ServerTiming(
            queue_wait=duration(self.queue_wait_s),
            compute=duration(self.compute_s),
            total=duration(end - self.received),
            stages=[
                common_pb2.StageTiming(name=name, duration=duration(seconds))
                for name, seconds in self.stages
            ],
        )
        if self.first_token is not None:
            timing.first_token.CopyFrom(duration(self.first_token - self.received))
        return timing


_clock: ContextVar[RequestClock | None] = ContextVar("ragline_request_clock", default=None)


def current_clock() -> RequestClock:
    """The clock of the call in progress (a fresh one outside a call, e.g. in tests)."""
    clock = _clock.get()
    if clock is None:
        clock = RequestClock()
        _clock.set(clock)
    return clock


def bind_clock(clock: RequestClock) -> Token[RequestClock | None]:
    return _clock.set(clock)


def unbind_clock(token: Token[RequestClock | None]) -> None:
    _clock.reset(token)
