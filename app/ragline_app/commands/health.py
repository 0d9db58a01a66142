"""`ragline health`: SERVING / NOT_SERVING of every service."""

from __future__ import annotations

import argparse
import asyncio
import json

from ragline.config import CommonConfig
from ragline_app.commands.common import service_names


def register(sub: argparse._SubParsersAction) -> None:
    health = sub.add_parser("health", help="health of every service")
    health.add_argument("--timeout", type=float, default=2.0)
    health.add_argument("--json", action="store_true")
    health.set_defaults(func=cmd_health)


def cmd_health(args: argparse.Namespace) -> int:
    from ragline_app.stack import service_address, service_status

    common = CommonConfig()
    names = service_names()

    async def run() -> dict[str, tuple[str, str]]:
        addresses = {n: service_address(n, common.data_dir) for n in names}
        statuses = await asyncio.gather(
            *(service_status(n, a, args.timeout) for n, a in addresses.items())
        )
        return {n: (addresses[n], s) for n, s in zip(names, statuses, strict=True)}

    results = asyncio.run(run())
    if args.json:
        print(json.dumps({n: {"address": a, "status": s} for n, (a, s) in results.items()}))
    else:
        for name, (address, status) in results.items():
            print(f"{name:<13} {address:<22} {status}")
    return 0 if all(s == "SERVING" for _, s in results.values()) else 1
