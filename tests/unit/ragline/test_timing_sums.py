"""One node's server timing over several calls: each figure added, stages by name."""

from __future__ import annotations

from ragline.timing import duration, seconds_of, summed_server_timing
from ragline.v1 import common_pb2


def timing(queue: float, compute: float, total: float, stages, first: float | None = None):
    made = common_pb2.ServerTiming(
        queue_wait=duration(queue), compute=duration(compute), total=duration(total)
    )
    if first is not None:
        made.first_token.CopyFrom(duration(first))
    for name, seconds in stages:
        made.stages.add(name=name, duration=duration(seconds))
    return made


def test_two_calls_add_up_stage_by_stage():
    summed = summed_server_timing(
        timing(0.01, 0.2, 0.25, [("prefill", 0.1), ("decode", 0.1)], first=0.12),
        timing(0.03, 0.3, 0.35, [("decode", 0.2), ("engine_wait", 0.05)], first=0.2),
    )
    assert abs(seconds_of(summed.queue_wait) - 0.04) < 1e-9
    assert abs(seconds_of(summed.compute) - 0.5) < 1e-9
    assert abs(seconds_of(summed.total) - 0.6) < 1e-9
    assert abs(seconds_of(summed.first_token) - 0.12) < 1e-9  # the first call's
    assert [(s.name, round(seconds_of(s.duration), 6)) for s in summed.stages] == [
        ("prefill", 0.1),
        ("decode", 0.3),
        ("engine_wait", 0.05),
    ]
