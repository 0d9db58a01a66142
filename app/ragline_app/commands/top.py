"""`ragline top`: every service live from its Prometheus metrics."""

from __future__ import annotations

import argparse
import sys

from ragline.config import CommonConfig


def register(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser(
        "top", help="live view of every service from its metrics (calls, latency, queues)"
    )
    top.add_argument(
        "--metrics",
        action="append",
        default=[],
        type=_name_equals_url,
        metavar="NAME=URL",
        help="a service's /metrics URL (repeat; default: those `ragline up` recorded)",
    )
    top.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
    top.add_argument(
        "--frames", type=int, default=None, help="stop after this many redraws (default: Ctrl-C)"
    )
    top.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    from ragline_app.stack import read_state_metrics
    from ragline_app.top import run

    common = CommonConfig()
    endpoints = dict(item.split("=", 1) for item in args.metrics) or read_state_metrics(
        common.data_dir / "up.json"
    )
    if not endpoints:
        print(
            "ragline top: no metrics endpoints: start the stack with `ragline up` (it serves "
            "and records them), or pass --metrics NAME=URL for each service",
            file=sys.stderr,
        )
        return 2
    try:
        run(endpoints, args.interval, frames=args.frames)
    except KeyboardInterrupt:
        pass
    return 0


def _name_equals_url(value: str) -> str:
    name, _, url = value.partition("=")
    if not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://host:port/metrics, got {value!r}")
    return value
